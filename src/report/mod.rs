//! Reports: where the memory is, as a table, a tree, or JSON; and, from the allocation
//! records, the records dump, call sites, leaks and DHAT profiles.
//!
//! | report | function | from |
//! |---|---|---|
//! | allocator table (O3DE's `sys_DumpAllocators`) | [`dump_allocators`] | statistics |
//! | allocator tree | [`tree`] | statistics |
//! | JSON snapshot of the allocators | [`json`] | statistics |
//! | records dump (`sys_DumpAllocationRecordsToFile`) | [`dump_records`], [`dump_records_in_range`] | records |
//! | live memory by call site | [`dump_call_sites`] | records |
//! | leak report | [`dump_leaks`], and at exit with `TAGALLOC_REPORT` or [`write_report_at_exit`] | records |
//! | DHAT profile (open in DHAT's `dh_view.html` or the Firefox Profiler) | [`dhat_profile`], and at exit with `TAGALLOC_DHAT` | records |
//! | pprof heap profile (open with `go tool pprof`) | [`pprof_profile`], and at exit with `TAGALLOC_PPROF` | records |
//! | records as JSON | [`records_json`] | records |
//! | memory over time, one row per frame (CSV) | [`mark_frame`], [`timeline_csv`] | statistics |
//! | one self-contained HTML page: treemap, timeline charts with budgets, top call sites, memory maps | [`html`], [`HtmlReport`] | statistics, records |
//!
//! The records reports copy a [`RecordsSnapshot`] first (briefly taking each table lock),
//! then resolve symbols and format with no lock held; their own allocations are not
//! recorded.
//!
//! Every report starts from a [`Snapshot`]: the registry is walked (lock-free) and each
//! allocator's figures are copied into plain structs *before* anything is formatted, so
//! formatting may allocate freely (reports are not on the allocation path), even when the
//! allocators being reported are the global allocator.
//!
//! # What the columns mean
//!
//! - **Used**: live granted bytes: blocks this allocator has handed out and not yet got
//!   back, at their real size (size class or block size). A child's blocks are blocks of
//!   its parent too, so a parent's Used includes its children's. For the OS layer, Used is
//!   the bytes it has mapped (all handed to the heap).
//! - **Reserved**: bytes held from the parent or the OS: Used plus what the allocator keeps
//!   for reuse (free heap pages, free pool slots). A child holds nothing more than its
//!   blocks, so its Reserved equals its Used.
//! - **Consumed**: the bytes this allocator alone accounts for, each byte counted once in
//!   the whole table: its Reserved minus its direct children's Reserved (a child's memory
//!   is consumed by the child, not again by its parent). Summed over all rows it gives the
//!   process's footprint.
//!
//! - **Peak**: the highest Used so far. The `SystemAllocator`'s threads count apart, with
//!   no shared running total, so its peak is the highest Used any reading saw (a report,
//!   `stats()`, [`mark_frame`]).
//! - **Share**: Used as a share of the parent's Used.
//! - **Budget** (tree): the budget set on the allocator and how full Used makes it.
//!
//! The tree prints these meanings under the table, with the Totals explained in the
//! snapshot's own numbers.
//!
//! The **Totals** row counts every byte once: Used is the sum of each allocator's own Used
//! (its Used minus what its children hold: the bytes the program really has in blocks),
//! Reserved is the sum of the root allocators' Reserved (what the process holds from the
//! OS), and Consumed the sum of the column, equal to the Reserved total when the snapshot
//! was taken while no other thread was allocating.
//!
//! Figures are read one allocator after another without stopping other threads, so under
//! load they are a blend of nearby instants; differences that would go negative are
//! clamped at zero.

mod csv;
mod dhat;
pub(crate) mod exit;
mod html;
mod json;
mod owners;
mod pprof;
mod records;
mod records_json;
mod timeline;
mod tree;

pub use html::HtmlReport;
pub use timeline::{
    TIMELINE_ALLOCATORS, TIMELINE_FRAMES, Timeline, TimelineAllocator, TimelineFrame, mark_frame,
    timeline, timeline_csv,
};

use crate::records::RecordsSnapshot;
use crate::records::guard::Busy;
use crate::registry::{self, AllocatorKind, Registration};
use crate::stats::AllocatorStats;
use std::io;

/// One allocator in a [`Snapshot`].
#[derive(Clone, Debug)]
pub struct AllocatorSnapshot {
    /// Registration index (0 = OS layer, 1 = SystemAllocator, then in order of first use).
    pub index: usize,
    /// Name (for declared allocators, the handle type's name).
    pub name: &'static str,
    /// Description given at declaration.
    pub description: &'static str,
    /// Kind of allocator.
    pub kind: AllocatorKind,
    /// Position of the parent in [`Snapshot::allocators`], if any.
    pub parent: Option<usize>,
    /// Name of the parent, if any.
    pub parent_name: Option<&'static str>,
    /// The allocator's own figures.
    pub stats: AllocatorStats,
    /// Byte budget, if one is set.
    pub budget: Option<usize>,
    /// Whether the allocator, a child of the `SystemAllocator`, serves its small blocks from
    /// an open lane of the thread caches (see
    /// [`Registration::thread_cache_lane_open`](crate::Registration::thread_cache_lane_open)).
    pub thread_cache_lane: bool,
    /// Reserved bytes not held by a direct child: see the [module docs](self).
    pub consumed_bytes: usize,
    /// Used bytes not handed to a direct child: the blocks this allocator serves to the
    /// program itself.
    pub own_used_bytes: usize,
    /// Depth in the tree (0 for a root).
    pub depth: usize,
}

/// The process-wide figures, each byte counted once (see the [module docs](self)).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Totals {
    /// Bytes in live blocks held by the program.
    pub used_bytes: usize,
    /// Bytes held from the OS by the root allocators.
    pub reserved_bytes: usize,
    /// Sum of the Consumed column.
    pub consumed_bytes: usize,
}

/// Every registered allocator's figures at one moment, in registration order.
#[derive(Clone, Debug)]
pub struct Snapshot {
    /// The allocators, sorted by registration index (parents before their children).
    pub allocators: Vec<AllocatorSnapshot>,
}

impl Snapshot {
    /// Reads every registered allocator.
    pub fn take() -> Self {
        // Copy the entries out first; the list is lock-free, so collecting (which
        // allocates) while walking it cannot deadlock with an allocator.
        let mut entries: Vec<&'static Registration> = registry::allocators()
            .filter(|r| r.index().is_some())
            .collect();
        entries.sort_by_key(|r| r.index());
        let mut allocators: Vec<AllocatorSnapshot> = entries
            .iter()
            .map(|r| AllocatorSnapshot {
                index: r.index().unwrap_or(usize::MAX),
                name: r.name(),
                description: r.description(),
                kind: r.kind(),
                parent: None,
                parent_name: r.parent().map(Registration::name),
                stats: r.stats(),
                budget: r.budget().limit(),
                thread_cache_lane: r.thread_cache_lane_open(),
                consumed_bytes: 0,
                own_used_bytes: 0,
                depth: 0,
            })
            .collect();
        for (i, entry) in entries.iter().enumerate() {
            if let Some(parent) = entry.parent() {
                let parent_pos = entries.iter().position(|e| core::ptr::eq(*e, parent));
                allocators[i].parent = parent_pos;
            }
        }
        // Parents come before children (lower index), so depth is known when needed.
        for i in 0..allocators.len() {
            allocators[i].depth = allocators[i].parent.map_or(0, |p| allocators[p].depth + 1);
        }
        let mut children_reserved = vec![0usize; allocators.len()];
        for a in &allocators {
            if let Some(p) = a.parent {
                children_reserved[p] += a.stats.reserved_bytes;
            }
        }
        for (a, held_by_children) in allocators.iter_mut().zip(children_reserved) {
            a.consumed_bytes = a.stats.reserved_bytes.saturating_sub(held_by_children);
            a.own_used_bytes = a.stats.live_granted_bytes.saturating_sub(held_by_children);
        }
        Self { allocators }
    }

    /// The Totals row: each byte counted once.
    pub fn totals(&self) -> Totals {
        Totals {
            used_bytes: self.allocators.iter().map(|a| a.own_used_bytes).sum(),
            reserved_bytes: self
                .allocators
                .iter()
                .filter(|a| a.parent.is_none())
                .map(|a| a.stats.reserved_bytes)
                .sum(),
            consumed_bytes: self.allocators.iter().map(|a| a.consumed_bytes).sum(),
        }
    }

    /// The direct children of the allocator at position `i`.
    pub fn children(&self, i: usize) -> impl Iterator<Item = usize> + '_ {
        self.allocators
            .iter()
            .enumerate()
            .filter(move |(_, a)| a.parent == Some(i))
            .map(|(j, _)| j)
    }

    /// The allocator with this name, if registered.
    pub fn find(&self, name: &str) -> Option<&AllocatorSnapshot> {
        self.allocators.iter().find(|a| a.name == name)
    }

    /// Writes O3DE's `sys_DumpAllocators` table; see [`dump_allocators`].
    pub fn write_csv(&self, out: &mut dyn io::Write) -> io::Result<()> {
        csv::write(self, out)
    }

    /// Writes the allocator tree: indented by parent, human units, share of the parent.
    pub fn write_tree(&self, out: &mut dyn io::Write) -> io::Result<()> {
        tree::write(self, out)
    }

    /// The snapshot as a JSON document (see [`Snapshot::to_json`] for the schema).
    pub fn write_json(&self, out: &mut dyn io::Write) -> io::Result<()> {
        out.write_all(self.to_json().as_bytes())
    }

    /// The snapshot as a JSON document:
    ///
    /// ```json
    /// {"allocators": [{"index": 1, "name": "SystemAllocator", "description": "…",
    ///   "kind": "system", "parent": "OSAllocator", "depth": 1, "used_bytes": 0,
    ///   "requested_bytes": null, "reserved_bytes": 0, "consumed_bytes": 0,
    ///   "live_blocks": 0, "allocations": 0, "frees": 0, "reallocations": 0,
    ///   "peak_bytes": null, "budget_bytes": null, "over_budget": 0,
    ///   "budget_failures": 0, "thread_cache_lane": false}, …],
    ///  "totals": {"used_bytes": 0, "reserved_bytes": 0, "consumed_bytes": 0}}
    /// ```
    pub fn to_json(&self) -> String {
        json::render(self)
    }
}

/// Writes O3DE's `sys_DumpAllocators` CSV for every registered allocator to `out`.
///
/// The header is `Index,Name,Used KiB,Reserved KiB,Consumed KiB,Parent Allocator`; one row
/// per allocator (`%.2f` KiB, the parent's name or empty); then a `-,Totals,…` row and a
/// line `N allocators active`. The columns are defined in the [module docs](self).
///
/// ```
/// let mut out = Vec::new();
/// tagalloc::dump_allocators(&mut out).unwrap();
/// let text = String::from_utf8(out).unwrap();
/// assert!(text.starts_with("Index,Name,Used KiB,Reserved KiB,Consumed KiB,Parent Allocator\n"));
/// assert!(text.lines().any(|l| l.starts_with("1,SystemAllocator,")));
/// assert!(text.trim_end().ends_with("allocators active"));
/// ```
pub fn dump_allocators(out: &mut dyn io::Write) -> io::Result<()> {
    Snapshot::take().write_csv(out)
}

/// The allocator tree as text (see [`Snapshot::write_tree`]).
pub fn tree() -> String {
    let mut out = Vec::new();
    // Writing to a Vec cannot fail.
    let _ = Snapshot::take().write_tree(&mut out);
    String::from_utf8_lossy(&out).into_owned()
}

/// A JSON snapshot of every allocator (see [`Snapshot::to_json`]).
pub fn json() -> String {
    Snapshot::take().to_json()
}

// ---- Reports from the allocation records. ----

impl RecordsSnapshot {
    /// Writes the records dump (O3DE's `sys_DumpAllocationRecordsToFile`): per allocator,
    /// every live record (or those whose address lies in `range`), with size, alignment,
    /// requested size, thread, time and frames (resolved if [`resolve`](Self::resolve) ran,
    /// raw addresses otherwise).
    pub fn write_dump(
        &self,
        out: &mut dyn io::Write,
        range: Option<(usize, usize)>,
    ) -> io::Result<()> {
        let _busy = Busy::enter();
        records::write_dump(self, out, range)
    }

    /// Writes live bytes and blocks per allocator and call stack, largest first.
    pub fn write_call_sites(&self, out: &mut dyn io::Write) -> io::Result<()> {
        let _busy = Busy::enter();
        records::write_call_sites(self, out)
    }

    /// Writes the leak report: everything still live, per allocator, grouped by call site,
    /// with a few addresses per site.
    pub fn write_leaks(&self, out: &mut dyn io::Write) -> io::Result<()> {
        let _busy = Busy::enter();
        records::write_leaks(self, out)
    }

    /// The snapshot as a DHAT heap profile, the JSON `dhat-rs` writes: save it as
    /// `dhat-heap.json` and open it in DHAT's viewer (`dh_view.html`, installed by valgrind
    /// at `/usr/libexec/valgrind/dh_view.html`, online at
    /// <https://nnethercote.github.io/dh_view/dh_view.html>) or in the Firefox Profiler
    /// (<https://profiler.firefox.com>, "Load a profile from file").
    ///
    /// Every block counts once, under the innermost allocator that recorded it; the
    /// viewer's tree splits by allocator first (see `src/report/dhat.rs`). A snapshot not
    /// yet [resolved](Self::resolve) is resolved in a copy first: the frames name the
    /// functions, and a child's call sites are matched with its parent's by them.
    pub fn to_dhat_json(&self) -> String {
        let _busy = Busy::enter();
        with_resolved(self, dhat::render)
    }

    /// The snapshot as a pprof heap profile: gzip-compressed `profile.proto` bytes, laid out
    /// as Go's runtime writes heap profiles (sample types `alloc_objects`, `alloc_space`,
    /// `inuse_objects`, `inuse_space`; the sampling interval as `period`), with the labels
    /// `allocator` and `allocator_path` on every sample. Save it as `heap.pb.gz` and open it
    /// with `go tool pprof -http=:8080 heap.pb.gz`, or `go tool pprof -top
    /// -tagfocus=allocator=Renderer heap.pb.gz` for one allocator's call sites. Every block
    /// counts once, under the innermost allocator that recorded it (see
    /// `src/report/pprof.rs`). Resolves a copy first if the snapshot is not resolved.
    pub fn to_pprof(&self) -> Vec<u8> {
        let _busy = Busy::enter();
        with_resolved(self, pprof::render)
    }

    /// The snapshot as JSON:
    ///
    /// ```json
    /// {"taken_us": 1234, "dropped": 0, "incomplete": false,
    ///  "records": [{"allocator": "Textures", "allocator_index": 5, "address": 140000000,
    ///    "size": 1024, "requested": 1000, "align": 8, "thread": 4242, "time_us": 17,
    ///    "weight": 1.0, "sampled": false, "stack": 3}, …],
    ///  "stacks": [{"id": 3, "show": 8, "ips": [94000000, …],
    ///    "frames": [{"ip": 94000000, "symbols": [{"name": "game::load", "file": "src/main.rs",
    ///      "line": 12, "column": 5}]}, …]}, …],
    ///  "sites": [{"allocator": "Textures", "allocator_index": 5, "stack": 3,
    ///    "live_bytes": 1024.0, "live_blocks": 1.0, "total_bytes": 4096.0, "total_blocks": 4.0,
    ///    "max_bytes": 2048.0, "max_blocks": 2.0, "lifetimes_us": 80.0, "sampled": false}, …]}
    /// ```
    ///
    /// Only the stacks that records or sites refer to are included.
    pub fn to_json(&self) -> String {
        let _busy = Busy::enter();
        records_json::render(self)
    }
}

/// Runs `f` on `snapshot`, resolved (in a copy if it is not yet).
fn with_resolved<R>(snapshot: &RecordsSnapshot, f: impl FnOnce(&RecordsSnapshot) -> R) -> R {
    if snapshot.is_resolved() {
        f(snapshot)
    } else {
        let mut copy = snapshot.clone();
        copy.resolve();
        f(&copy)
    }
}

/// One self-contained HTML page (no network, no script, no other file): the allocator tree
/// as a treemap (area = bytes; live blocks solid, reserved free space hatched) with the
/// table, the timeline of [`mark_frame`] as a chart per allocator with its budget, and the
/// top call sites per allocator when records are on. [`HtmlReport`] adds virtual blocks'
/// memory maps.
///
/// ```
/// tagalloc::allocator!(Audio: child of tagalloc::SystemAllocator, "Voices");
/// let voice = allocator_api2::vec::Vec::<f32, _>::with_capacity_in(4800, Audio);
/// tagalloc::report::mark_frame();
/// let page = tagalloc::report::html();
/// assert!(page.starts_with("<!DOCTYPE html>") && page.contains("Audio"));
/// assert!(!page.contains("<script"));
/// # drop(voice);
/// ```
pub fn html() -> String {
    HtmlReport::new().render()
}

/// A resolved records snapshot if some allocator keeps records, for the HTML report.
fn records_if_any() -> Option<RecordsSnapshot> {
    let recording = registry::allocators().any(|r| r.record_mode().is_on());
    recording.then(resolved_snapshot)
}

/// A resolved snapshot of the records, built with the re-entrancy guard set.
fn resolved_snapshot() -> RecordsSnapshot {
    let _busy = Busy::enter();
    let mut snapshot = crate::records::snapshot();
    snapshot.resolve();
    snapshot
}

/// Writes every live allocation record, per allocator, with resolved frames (O3DE's
/// `sys_DumpAllocationRecordsToFile`); see [`RecordsSnapshot::write_dump`].
///
/// ```
/// use tagalloc::{RecordMode, SystemAllocator};
///
/// tagalloc::allocator!(Meshes: child of SystemAllocator, "Mesh data");
/// Meshes.set_records(RecordMode::Basic);
/// let mesh = allocator_api2::boxed::Box::new_in([0u8; 100], Meshes);
///
/// let mut out = Vec::new();
/// tagalloc::report::dump_records(&mut out).unwrap();
/// let text = String::from_utf8(out).unwrap();
/// assert!(text.contains("Printing allocation records for allocator Meshes (1 records)"));
/// assert!(text.contains(&format!("Allocation Addr: {:p} Size: 104 Alignment: 1", &*mesh)));
/// # drop(mesh);
/// ```
pub fn dump_records(out: &mut dyn io::Write) -> io::Result<()> {
    let _busy = Busy::enter();
    resolved_snapshot().write_dump(out, None)
}

/// Writes the live records of blocks starting in `[start, end)` (O3DE's
/// `sys_DumpAllocationRecordsInRange`).
pub fn dump_records_in_range(start: usize, end: usize, out: &mut dyn io::Write) -> io::Result<()> {
    let _busy = Busy::enter();
    resolved_snapshot().write_dump(out, Some((start, end)))
}

/// Writes live bytes and blocks per allocator and call stack, largest first.
///
/// ```
/// use tagalloc::{RecordMode, SystemAllocator};
///
/// tagalloc::allocator!(Sounds: child of SystemAllocator, "Sound banks");
/// Sounds.set_records(RecordMode::full());
///
/// #[inline(never)]
/// fn load_bank() -> allocator_api2::vec::Vec<u8, Sounds> {
///     allocator_api2::vec::Vec::with_capacity_in(4096, Sounds)
/// }
/// let bank = load_bank();
///
/// let mut out = Vec::new();
/// tagalloc::report::dump_call_sites(&mut out).unwrap();
/// let text = String::from_utf8(out).unwrap();
/// assert!(text.contains("Sounds: 4.0 KiB in 1 block at 1 call site"));
/// assert!(text.contains("load_bank"));
/// # drop(bank);
/// ```
pub fn dump_call_sites(out: &mut dyn io::Write) -> io::Result<()> {
    let _busy = Busy::enter();
    resolved_snapshot().write_call_sites(out)
}

/// Writes the leak report now (what is still live, per allocator, by call site); the
/// exit report ([`write_report_at_exit`], `TAGALLOC_REPORT`) ends with the same.
///
/// ```
/// use tagalloc::{RecordMode, SystemAllocator};
///
/// tagalloc::allocator!(Cache: child of SystemAllocator, "Asset cache");
/// Cache.set_records(RecordMode::Basic);
/// std::mem::forget(allocator_api2::boxed::Box::new_in([0u64; 16], Cache));
///
/// let mut out = Vec::new();
/// tagalloc::report::dump_leaks(&mut out).unwrap();
/// let text = String::from_utf8(out).unwrap();
/// assert!(text.contains("Cache: 128 B in 1 block at 1 call site"));
/// ```
pub fn dump_leaks(out: &mut dyn io::Write) -> io::Result<()> {
    let _busy = Busy::enter();
    resolved_snapshot().write_leaks(out)
}

/// A DHAT heap profile of the records (see [`RecordsSnapshot::to_dhat_json`]).
///
/// ```
/// use tagalloc::{RecordMode, SystemAllocator};
///
/// tagalloc::allocator!(Physics: child of SystemAllocator, "Physics");
/// Physics.set_records(RecordMode::full());
/// let bodies = allocator_api2::vec::Vec::<[f32; 4], Physics>::with_capacity_in(64, Physics);
///
/// let profile = tagalloc::report::dhat_profile();
/// // Save it as dhat-heap.json and open it in DHAT's viewer.
/// assert!(profile.starts_with("{\"dhatFileVersion\":2,\"mode\":\"rust-heap\""));
/// assert!(profile.contains("[allocator Physics]"));
/// # drop(bodies);
/// ```
pub fn dhat_profile() -> String {
    let _busy = Busy::enter();
    resolved_snapshot().to_dhat_json()
}

/// A pprof heap profile of the records (see [`RecordsSnapshot::to_pprof`]): gzip-compressed
/// `profile.proto` bytes for `go tool pprof` and the services that ingest Go heap profiles.
///
/// ```
/// use tagalloc::{RecordMode, SystemAllocator};
///
/// tagalloc::allocator!(Renderer: child of SystemAllocator, "Renderer");
/// Renderer.set_records(RecordMode::full());
/// let meshes = allocator_api2::vec::Vec::<[f32; 3], Renderer>::with_capacity_in(1000, Renderer);
///
/// let profile = tagalloc::report::pprof_profile();
/// // Save it as heap.pb.gz: `go tool pprof -top -tagfocus=allocator=Renderer heap.pb.gz`.
/// assert_eq!(profile[..2], [0x1f, 0x8b]); // gzip
/// # drop(meshes);
/// ```
pub fn pprof_profile() -> Vec<u8> {
    let _busy = Busy::enter();
    resolved_snapshot().to_pprof()
}

/// The live records as JSON (see [`RecordsSnapshot::to_json`]).
pub fn records_json() -> String {
    let _busy = Busy::enter();
    resolved_snapshot().to_json()
}

/// Writes the exit report (the allocator table and tree, then the leak report) to `path`
/// when the process exits, as `TAGALLOC_REPORT=<path>` does. May be called more than once
/// (each path gets a report).
pub fn write_report_at_exit(path: impl Into<std::path::PathBuf>) -> io::Result<()> {
    exit::register(path.into())
}

/// Writes the exit report's contents (allocator table, tree, leak report) now.
pub fn write_exit_report(out: &mut dyn io::Write) -> io::Result<()> {
    let _busy = Busy::enter();
    exit::write_report(out)
}
