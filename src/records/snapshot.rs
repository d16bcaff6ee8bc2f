//! Snapshots: the live records, the call stacks and the per-site totals, copied out of the
//! tables so that reports can resolve symbols and format without holding any lock.

use super::clock::TickScale;
use super::guard::Busy;
use super::table::{self, SiteStats};
use super::{RecordMode, stack, table::site_key};
use crate::registry::{self, AllocatorKind};
use std::collections::HashMap;

/// A registered allocator as a [`RecordsSnapshot`] saw it: its place in the hierarchy and
/// its record mode, so that reports can tell when two records are one block (a child's
/// block is also a block of every allocator above it).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RecordsAllocator {
    /// The registry index.
    pub index: usize,
    /// The allocator's name.
    pub name: &'static str,
    /// Its kind.
    pub kind: AllocatorKind,
    /// The parent's registry index, if any.
    pub parent: Option<usize>,
    /// The record mode when the snapshot was taken.
    pub mode: RecordMode,
}

/// One live record, as copied into a [`RecordsSnapshot`].
#[derive(Clone, Debug, PartialEq)]
pub struct Record {
    /// The allocator's name.
    pub allocator: &'static str,
    /// The allocator's registry index.
    pub allocator_index: usize,
    /// The block's address.
    pub address: usize,
    /// Bytes granted (the size class or block size).
    pub size: usize,
    /// Bytes requested (the layout's size).
    pub requested: usize,
    /// The layout's alignment.
    pub align: usize,
    /// The OS id of the allocating thread.
    pub thread: u32,
    /// When the block was allocated, in microseconds since records were first turned on.
    /// Coarse for `Basic` records: it is their thread's last clock read, taken at most 32 of
    /// its record operations earlier (so after the thread idled, possibly much earlier).
    pub time_us: u64,
    /// How many blocks this record stands for: 1, or `1/p` for a sampled record.
    pub weight: f64,
    /// Whether the record was sampled.
    pub sampled: bool,
    /// The call-stack id (see [`RecordsSnapshot::stack`]); 0 when no stack was captured.
    pub stack: u32,
}

/// A resolved symbol of one frame (a frame has several when calls were inlined, the
/// innermost first).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Symbol {
    /// The demangled name without its hash, or `"???"`.
    pub name: String,
    /// The source file, if debug info has it.
    pub file: Option<String>,
    /// The line, if known.
    pub line: Option<u32>,
    /// The column, if known.
    pub column: Option<u32>,
}

/// One frame of a resolved stack.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Frame {
    /// The return address.
    pub ip: usize,
    /// What it resolves to, innermost first (empty if nothing is known).
    pub symbols: Vec<Symbol>,
}

/// One interned call stack.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct StackInfo {
    /// The id records refer to (≥ 1).
    pub id: u32,
    /// The captured return addresses, innermost first, before trimming.
    pub ips: Vec<usize>,
    /// How many frames reports show (the mode's `frames`).
    pub show: usize,
    /// The frames to show, after [`RecordsSnapshot::resolve`]: the allocator's and the
    /// containers' allocation frames trimmed, at most `show` left. Empty until resolved.
    pub frames: Vec<Frame>,
}

/// Totals for one call site (one allocator and one stack).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct CallSite {
    /// The allocator's name.
    pub allocator: &'static str,
    /// The allocator's registry index.
    pub allocator_index: usize,
    /// The stack id (0: allocations recorded without a stack).
    pub stack: u32,
    /// Live bytes (granted), estimated for sampled sites.
    pub live_bytes: f64,
    /// Live blocks, estimated for sampled sites.
    pub live_blocks: f64,
    /// Bytes allocated since records were turned on (a realloc adds its growth).
    pub total_bytes: f64,
    /// Blocks allocated since records were turned on.
    pub total_blocks: f64,
    /// The most bytes live at once. Totals are kept per table shard, so this is the sum of
    /// each shard's maximum: an upper bound of the true maximum, exact when the site's
    /// blocks peaked together.
    pub max_bytes: f64,
    /// Blocks live at the `max_bytes` moment (same caveat).
    pub max_blocks: f64,
    /// Summed lifetimes of all blocks (the live ones up to the snapshot), microseconds.
    pub lifetimes_us: f64,
    /// Whether the site's records were sampled (its figures are estimates).
    pub sampled: bool,
}

/// A copy of every live record, call stack and call-site total; see [`snapshot`].
#[derive(Clone, Debug, Default)]
pub struct RecordsSnapshot {
    /// Live records, sorted by allocator index, then address.
    pub records: Vec<Record>,
    /// Every call stack recorded so far, by id − 1.
    pub stacks: Vec<StackInfo>,
    /// Per call-site totals, largest live bytes first.
    pub sites: Vec<CallSite>,
    /// When the snapshot was taken, microseconds since records were first turned on.
    pub taken_us: u64,
    /// Records dropped (ever) because the records' heap was out of memory.
    pub dropped: u64,
    /// Whether memory ran out while copying (some records are missing).
    pub incomplete: bool,
    /// Every registered allocator, by registry index.
    pub allocators: Vec<RecordsAllocator>,
    resolved: bool,
}

/// Copies the live records of every allocator (a few shard locks at a time, none held
/// while this function allocates). Stacks are not resolved yet: see
/// [`RecordsSnapshot::resolve`].
///
/// Allocations made while the snapshot is built are not recorded.
pub fn snapshot() -> RecordsSnapshot {
    let _busy = Busy::enter();
    let scale = TickScale::measure();
    let copy = table::copy();
    let raw_stacks = stack::copy_all();
    let mut names: HashMap<u32, &'static str> = HashMap::new();
    let mut allocators: Vec<RecordsAllocator> = Vec::new();
    for r in registry::allocators() {
        if let Some(i) = r.index() {
            names.insert(i as u32, r.name());
            allocators.push(RecordsAllocator {
                index: i,
                name: r.name(),
                kind: r.kind(),
                parent: r.parent().and_then(|p| p.index()),
                mode: r.record_mode(),
            });
        }
    }
    allocators.sort_by_key(|a| a.index);
    let name = |i: u32| names.get(&i).copied().unwrap_or("?");
    let now = scale.now_ticks();
    let mut live_lifetimes: HashMap<u64, f64> = HashMap::new();
    let mut records: Vec<Record> = copy
        .records
        .iter()
        .map(|(key, rec)| {
            *live_lifetimes
                .entry(site_key(key.alloc, rec.stack))
                .or_default() += rec.weight * now.saturating_sub(rec.time) as f64;
            Record {
                allocator: name(key.alloc),
                allocator_index: key.alloc as usize,
                address: key.addr,
                size: rec.size,
                requested: rec.requested,
                align: 1usize << rec.align_log2,
                thread: rec.thread,
                time_us: scale.us(rec.time),
                weight: rec.weight,
                sampled: rec.sampled,
                stack: rec.stack,
            }
        })
        .collect();
    records.sort_by_key(|r| (r.allocator_index, r.address));
    let sampled_sites: std::collections::HashSet<u64> = copy
        .records
        .iter()
        .filter(|(_, r)| r.sampled)
        .map(|(k, r)| site_key(k.alloc, r.stack))
        .collect();
    let mut sites: Vec<CallSite> = copy
        .sites
        .iter()
        .filter(|(_, s)| s.total_blocks > 0.0)
        .map(|(&key, s): (&u64, &SiteStats)| {
            let alloc = (key >> 32) as u32;
            let lifetime_ticks =
                s.freed_lifetime_ticks + live_lifetimes.get(&key).copied().unwrap_or(0.0);
            CallSite {
                allocator: name(alloc),
                allocator_index: alloc as usize,
                stack: key as u32,
                live_bytes: s.live_bytes.max(0.0),
                live_blocks: s.live_blocks.max(0.0),
                total_bytes: s.total_bytes,
                total_blocks: s.total_blocks,
                max_bytes: s.max_bytes.min(s.total_bytes).max(s.live_bytes),
                max_blocks: s.max_blocks.min(s.total_blocks).max(s.live_blocks),
                lifetimes_us: scale.span_us(lifetime_ticks),
                sampled: sampled_sites.contains(&key),
            }
        })
        .collect();
    sort_sites(&mut sites);
    let stacks = raw_stacks
        .into_iter()
        .enumerate()
        .map(|(i, (ips, show))| StackInfo {
            id: i as u32 + 1,
            ips,
            show: show as usize,
            frames: Vec::new(),
        })
        .collect();
    RecordsSnapshot {
        records,
        stacks,
        sites,
        taken_us: scale.now_us(),
        dropped: table::dropped(),
        incomplete: copy.incomplete,
        allocators,
        resolved: false,
    }
}

impl RecordsSnapshot {
    /// The records of the allocator with this name or description (ignoring ASCII case).
    pub fn records_of<'a>(&'a self, allocator: &'a str) -> impl Iterator<Item = &'a Record> + 'a {
        let index = allocator_index(allocator);
        self.records
            .iter()
            .filter(move |r| Some(r.allocator_index) == index)
    }

    /// The records of blocks that start in `[start, end)` (O3DE's
    /// `sys_DumpAllocationRecordsInRange`).
    pub fn in_range(&self, start: usize, end: usize) -> impl Iterator<Item = &Record> + '_ {
        self.records
            .iter()
            .filter(move |r| r.address >= start && r.address < end)
    }

    /// The stack with this id (`None` for 0 or an unknown id).
    pub fn stack(&self, id: u32) -> Option<&StackInfo> {
        self.stacks.get((id as usize).checked_sub(1)?)
    }

    /// The allocator with this registry index, if it was registered.
    pub fn allocator(&self, index: usize) -> Option<&RecordsAllocator> {
        match self.allocators.binary_search_by_key(&index, |a| a.index) {
            Ok(i) => Some(&self.allocators[i]),
            Err(_) => None,
        }
    }

    /// The strict ancestors of the allocator at registry `index`, nearest first.
    pub fn ancestors(&self, index: usize) -> impl Iterator<Item = &RecordsAllocator> + '_ {
        let mut next = self.allocator(index).and_then(|a| a.parent);
        // A registry chain ends at a root; the bound guards against a malformed one.
        let mut left = self.allocators.len();
        core::iter::from_fn(move || {
            let a = self.allocator(next?)?;
            left = left.checked_sub(1)?;
            next = a.parent;
            Some(a)
        })
    }

    /// Whether [`resolve`](Self::resolve) has run.
    pub fn is_resolved(&self) -> bool {
        self.resolved
    }

    /// Resolves the frames of every stack referred to by a record or a site (slow: reads
    /// debug info; each address is resolved once). Allocator frames at the top of each
    /// stack are trimmed and at most `show` frames are kept.
    pub fn resolve(&mut self) {
        if self.resolved {
            return;
        }
        let _busy = Busy::enter();
        let mut used = vec![false; self.stacks.len()];
        for id in self
            .records
            .iter()
            .map(|r| r.stack)
            .chain(self.sites.iter().map(|s| s.stack))
        {
            if let Some(slot) = (id as usize).checked_sub(1).and_then(|i| used.get_mut(i)) {
                *slot = true;
            }
        }
        let mut cache: HashMap<usize, Vec<Symbol>> = HashMap::new();
        for (stack, _) in self.stacks.iter_mut().zip(used).filter(|(_, u)| *u) {
            let frames: Vec<Frame> = stack
                .ips
                .iter()
                .map(|&ip| Frame {
                    ip,
                    symbols: cache.entry(ip).or_insert_with(|| resolve_ip(ip)).clone(),
                })
                .collect();
            stack.frames = trim(frames, stack.show);
        }
        self.merge_same_frames();
        self.resolved = true;
    }

    /// After resolving: stacks that differ only in trimmed frames show the same call site,
    /// so their records and sites are merged under the lowest such id.
    fn merge_same_frames(&mut self) {
        let mut first: HashMap<Vec<usize>, u32> = HashMap::new();
        let mut canonical: Vec<u32> = Vec::with_capacity(self.stacks.len());
        for stack in &self.stacks {
            let key: Vec<usize> = if stack.frames.is_empty() {
                stack.ips.clone()
            } else {
                stack.frames.iter().map(|f| f.ip).collect()
            };
            canonical.push(*first.entry(key).or_insert(stack.id));
        }
        let map = |id: u32| -> u32 {
            (id as usize)
                .checked_sub(1)
                .and_then(|i| canonical.get(i).copied())
                .unwrap_or(id)
        };
        for r in &mut self.records {
            r.stack = map(r.stack);
        }
        let mut merged: Vec<CallSite> = Vec::with_capacity(self.sites.len());
        let mut at: HashMap<(usize, u32), usize> = HashMap::new();
        for mut site in self.sites.drain(..) {
            site.stack = map(site.stack);
            match at.get(&(site.allocator_index, site.stack)) {
                Some(&i) => {
                    let m = &mut merged[i];
                    m.live_bytes += site.live_bytes;
                    m.live_blocks += site.live_blocks;
                    m.total_bytes += site.total_bytes;
                    m.total_blocks += site.total_blocks;
                    m.max_bytes += site.max_bytes;
                    m.max_blocks += site.max_blocks;
                    m.lifetimes_us += site.lifetimes_us;
                    m.sampled |= site.sampled;
                }
                None => {
                    at.insert((site.allocator_index, site.stack), merged.len());
                    merged.push(site);
                }
            }
        }
        sort_sites(&mut merged);
        self.sites = merged;
    }

    /// Live bytes and blocks per allocator and call stack, from the live records (estimated
    /// for sampled ones), largest first.
    pub fn live_by_site(&self) -> Vec<CallSite> {
        let mut by: HashMap<(usize, u32), CallSite> = HashMap::new();
        for r in &self.records {
            let site = by
                .entry((r.allocator_index, r.stack))
                .or_insert_with(|| CallSite {
                    allocator: r.allocator,
                    allocator_index: r.allocator_index,
                    stack: r.stack,
                    ..CallSite::default()
                });
            site.live_bytes += r.weight * r.size as f64;
            site.live_blocks += r.weight;
            site.sampled |= r.sampled;
        }
        let mut sites: Vec<CallSite> = by.into_values().collect();
        sites.sort_by(|a, b| {
            b.live_bytes
                .total_cmp(&a.live_bytes)
                .then(a.allocator_index.cmp(&b.allocator_index))
                .then(a.stack.cmp(&b.stack))
        });
        sites
    }
}

/// Largest live bytes first, then largest totals.
fn sort_sites(sites: &mut [CallSite]) {
    sites.sort_by(|a, b| {
        b.live_bytes
            .total_cmp(&a.live_bytes)
            .then(b.total_bytes.total_cmp(&a.total_bytes))
            .then(a.allocator_index.cmp(&b.allocator_index))
            .then(a.stack.cmp(&b.stack))
    });
}

fn allocator_index(name: &str) -> Option<usize> {
    registry::allocators()
        .find(|r| r.name().eq_ignore_ascii_case(name) || r.description().eq_ignore_ascii_case(name))
        .and_then(|r| r.index())
}

fn resolve_ip(ip: usize) -> Vec<Symbol> {
    let mut out = Vec::new();
    backtrace::resolve(ip as *mut core::ffi::c_void, |s| {
        out.push(Symbol {
            name: s
                .name()
                .map_or_else(|| "???".to_string(), |n| format!("{n:#}")),
            file: s.filename().map(|p| p.display().to_string()),
            line: s.lineno(),
            column: s.colno(),
        });
    });
    out
}

/// Whether a symbol belongs to the allocation machinery (the allocator, the global
/// allocator shims, `alloc::alloc`, `RawVec`, `allocator_api2`, handle impls).
pub(crate) fn is_plumbing(name: &str) -> bool {
    const PREFIXES: [&str; 26] = [
        "tagalloc::",
        "<tagalloc::",
        "alloc::alloc::",
        "<alloc::alloc::",
        "alloc::raw_vec::",
        "<alloc::raw_vec::",
        // std's containers: the call site is the code that asked them for memory.
        "alloc::vec::",
        "<alloc::vec::",
        "alloc::string::",
        "<alloc::string::",
        "alloc::boxed::",
        "<alloc::boxed::",
        "alloc::collections::",
        "<alloc::collections::",
        "std::collections::",
        "<std::collections::",
        "__rust_",
        "__rustc::",
        "__rg_",
        "__rdl_",
        "core::alloc::",
        "<core::alloc::",
        "allocator_api2::",
        "<allocator_api2::",
        "std::alloc::",
        "<std::alloc::",
    ];
    const PARTS: [&str; 12] = [
        "hashbrown::raw::",
        "hashbrown::alloc::",
        "hashbrown::raw_table::",
        " as allocator_api2::",
        " as core::alloc::",
        " as tagalloc::",
        "<impl allocator_api2::",
        "<impl core::alloc::",
        "<impl tagalloc::",
        "::__tagalloc_",
        "hashbrown::raw::alloc::",
        "backtrace::",
    ];
    PREFIXES.iter().any(|p| name.starts_with(p)) || PARTS.iter().any(|p| name.contains(p))
}

/// Whether a frame is where the runtime (or the test harness) calls `main`, a thread's
/// closure or a test.
fn is_runtime_entry(frame: &Frame) -> bool {
    frame.symbols.iter().any(|s| {
        s.name
            .starts_with("std::sys::backtrace::__rust_begin_short_backtrace")
    })
}

/// Drops the allocation frames at the top of a stack and the runtime's frames at the
/// bottom (from `__rust_begin_short_backtrace` down: `lang_start`, `main`, thread start),
/// and keeps at most `show` frames. A stack made only of allocation frames is kept whole
/// (there is nothing better to show).
fn trim(mut frames: Vec<Frame>, show: usize) -> Vec<Frame> {
    if let Some(entry) = frames.iter().position(is_runtime_entry) {
        frames.truncate(entry);
        // The closure call just above the runtime entry is the runtime's too.
        if frames.last().is_some_and(|f| {
            f.symbols.len() == 1
                && f.symbols[0]
                    .name
                    .starts_with("core::ops::function::FnOnce::call_once")
        }) {
            frames.pop();
        }
    }
    let first_user = frames
        .iter()
        .position(|f| f.symbols.is_empty() || f.symbols.iter().any(|s| !is_plumbing(&s.name)));
    if let Some(first) = first_user {
        frames.drain(..first);
        // Inside the first kept frame, drop the inlined allocation symbols above the user's.
        if let Some(f) = frames.first_mut() {
            if let Some(k) = f.symbols.iter().position(|s| !is_plumbing(&s.name)) {
                f.symbols.drain(..k);
            }
        }
    }
    frames.truncate(show.max(1));
    frames
}

#[cfg(test)]
mod tests {
    use super::*;

    fn frame(names: &[&str]) -> Frame {
        Frame {
            ip: 1,
            symbols: names
                .iter()
                .map(|n| Symbol {
                    name: n.to_string(),
                    ..Symbol::default()
                })
                .collect(),
        }
    }

    #[test]
    fn allocation_frames_are_trimmed_from_the_top() {
        let frames = vec![
            frame(&["tagalloc::records::record"]),
            frame(&["<game::Renderer as allocator_api2::stable::alloc::Allocator>::allocate"]),
            frame(&["allocator_api2::stable::boxed::Box<T,A>::new_in"]),
            frame(&["__rustc::__rust_alloc", "game::load_textures"]),
            frame(&["game::main"]),
            frame(&["core::ops::function::FnOnce::call_once"]),
            frame(&["std::sys::backtrace::__rust_begin_short_backtrace"]),
            frame(&["std::rt::lang_start"]),
        ];
        let t = trim(frames.clone(), 8);
        assert_eq!(t.len(), 2);
        assert_eq!(t[1].symbols[0].name, "game::main");
        assert_eq!(t[0].symbols.len(), 1);
        assert_eq!(t[0].symbols[0].name, "game::load_textures");
        assert_eq!(trim(frames.clone(), 1).len(), 1);
        let only_plumbing = vec![frame(&["tagalloc::x"]), frame(&["__rust_alloc"])];
        assert_eq!(trim(only_plumbing, 8).len(), 2);
    }
}
