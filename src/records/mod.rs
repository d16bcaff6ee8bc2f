//! Allocation records: what each allocator has handed out, with sizes, threads, times and
//! call stacks, for the records dump, call-site summaries, leak reports and DHAT profiles.
//!
//! This is O3DE's `AllocationRecords`, per allocator: every registered allocator (the
//! [`SystemAllocator`](crate::SystemAllocator) and each handle declared with
//! [`allocator!`](crate::allocator)) has a [`RecordMode`]:
//!
//! | mode | records | what it costs per call | alloc+free pair, `SystemAllocator` / child (`benches/records.rs`) |
//! |---|---|---|---|
//! | [`Off`](RecordMode::Off) | nothing (the default) | one relaxed load and a branch (the `SystemAllocator`: a compare of a per-class mark on allocation, a test of a byte in the thread's own cache on free) | 2.2 ns / 7.0–7.2 ns |
//! | [`Sample`](RecordMode::Sample) | one block per N requested bytes on average (default 512 KiB), weighted; with stacks | the `SystemAllocator`: a per-class countdown in its fast path's own compare, a filter load per free; a child: a thread-local countdown; a replayed stack walk per sample | 2.6–2.7 ns / 8.3–8.6 ns |
//! | [`Basic`](RecordMode::Basic) | every block: address, granted and requested size, alignment, thread, time | a probe and a few plain stores in the thread's own record table (no call, no lock, no atomic read-modify-write); a lock only for a block freed by another thread or whose thread has exited | 8.1–8.3 ns / 27.3–27.9 ns |
//! | [`Full`](RecordMode::Full) | as `Basic`, plus the call stack (default 8 frames), unresolved | plus a stack walk (~16 frames, replayed from learnt frame sizes once a call site is known) per allocation, a lock and a table insert or remove, a clock read | 189–200 ns / 198–207 ns |
//!
//! (2-core machine, 16- and 256-byte blocks. On the `compare` harness's `small` workload,
//! 30 million small allocations, the workload's own timing, medians of 9 interleaved runs:
//! off 222.6 ms, sample 233.3 ms (+4.8%), basic 419.6 ms (1.89×); full 5.0–5.6 s. With sampling
//! on, the `SystemAllocator`'s fast paths stay: an allocation leaves only when its class's
//! count reaches the next sampled block, a free only when the sample filter may hold it. In
//! basic mode every call leaves the fast path for its miss function, where the record table
//! is reached. Stacks are walked by the platform unwinder until a call site has been seen
//! twice, then replayed (`unwind.rs`).)
//!
//! Basic records go to a per-thread record table (see `buffer.rs`: open addressing, grown
//! from the records' heap), written by its thread alone with plain stores: a block freed on
//! the thread that allocated it never touches a lock, an atomic read-modify-write or the
//! shared table, however many blocks are live. The shared table gets a thread's records
//! when the thread exits (and a `fork()` child gets those of the threads it lost); a free
//! on another thread marks the record dead in its owner's table. Basic record times are
//! coarse: a thread reads the clock about once per 32 frees of its records and whenever
//! its table grows, and a basic record's time is the last read, which after an idle spell
//! may be well before the allocation.
//!
//! Records follow the hierarchy as the statistics do: a block of a child is also a block of
//! every allocator above it, so each of them that records has a record of it (a parent's
//! records, like its Used figure, include its children's), and a dump of several levels
//! lists the block under each. Totals count it once: the leak report's first line and the
//! DHAT and pprof profiles put each block under the innermost allocator that recorded it
//! (the rules, sampling included, are in `src/report/owners.rs`).
//!
//! Set a mode in code, on a handle (`Renderer.set_records(RecordMode::full())`) or on the
//! `SystemAllocator` (`GLOBAL.set_records(..)`), or at start-up with the environment:
//!
//! ```text
//! TAGALLOC_RECORDS="Script Canvas=full,SystemAllocator=sample:512KiB"
//! TAGALLOC_REPORT=/tmp/memory-at-exit.txt
//! TAGALLOC_DHAT=/tmp/dhat-heap.json TAGALLOC_PPROF=/tmp/heap.pb.gz
//! ```
//!
//! (the syntax is in [`config`]). Reports read a [`RecordsSnapshot`]: see
//! [`report`](crate::report) for the records dump, the call-site summary, the leak report,
//! the DHAT and pprof profiles and the JSON dump; `docs/records.md` says how to open the
//! profiles and how precise sampled estimates are.
//!
//! ```
//! use allocator_api2::vec::Vec;
//! use tagalloc::SystemAllocator;
//! use tagalloc::records::{self, RecordMode};
//!
//! tagalloc::allocator!(pub Textures: child of SystemAllocator, "Texture data");
//! Textures.set_records(RecordMode::full());
//!
//! let mut pixels: Vec<u32, Textures> = Vec::with_capacity_in(256, Textures);
//! pixels.push(0xff00ff);
//!
//! let snapshot = records::snapshot();
//! let mine: std::vec::Vec<_> = snapshot.records_of("Textures").collect();
//! assert_eq!(mine.len(), 1);
//! assert_eq!(mine[0].requested, 1024);
//! assert_eq!(mine[0].address, pixels.as_ptr() as usize);
//! assert!(snapshot.stack(mine[0].stack).is_some_and(|s| !s.ips.is_empty()));
//! drop(pixels);
//! assert_eq!(records::snapshot().records_of("Textures").count(), 0);
//! ```
//!
//! # How recording stays safe inside an allocator
//!
//! - **No recursion.** Records, stacks and snapshots live on the records' own HPHA heap
//!   on the OS layer (shown as `AllocationRecords` in the allocator table), never on the
//!   global allocator. Stacks are captured with the platform unwinder, which does not
//!   allocate through Rust's allocator, and resolved to symbols only when a report is
//!   written. A per-thread guard lets any allocation made while the thread records or
//!   reports pass unrecorded.
//! - **No deadlock.** The table's locks are allocation-free spin locks that are never held
//!   across a call that could allocate through the global allocator; reports copy a
//!   snapshot under the locks (into the records' heap) and resolve and format after
//!   releasing them. A thread never waits for anything while it writes its record table,
//!   so readers waiting for a consistent copy always get one. `fork()` handlers take and
//!   release every records lock and hold every record table's thread outside its writes.
//! - **No unwinding.** Nothing on the recording path panics; when the records' heap runs
//!   out of memory a record is dropped and counted ([`RecordsSnapshot::dropped`]).
//! - **Exact.** A block's record is added after the block is allocated and removed before
//!   it is freed, so under any interleaving of threads the live records are exactly the
//!   live recorded blocks. A record in its thread's table is found by a free on any thread
//!   (under the record's shard lock, which a record needs to move to the shared table), and
//!   reports copy the threads' tables with every shard lock held. Blocks allocated before
//!   recording was turned on have no record; their frees simply miss the table. A realloc moves and resizes the record
//!   (keeping its stack, thread and time); it never starts one.
//! - **Turning records off** stops new records at once; frees keep looking their blocks up
//!   so that the records made while on leave exactly.

mod buffer;
pub(crate) mod clock;
pub mod config;
pub(crate) mod env;
pub(crate) mod global;
pub(crate) mod guard;
mod heap;
mod map;
mod mode;
pub(crate) mod sample;
mod snapshot;
mod stack;
mod table;
mod unwind;

pub use mode::{RecordMode, RecordSettings};
pub use sample::{sample_probability, sample_seed, sample_weight, set_sample_seed};
pub use snapshot::{
    CallSite, Frame, Record, RecordsAllocator, RecordsSnapshot, StackInfo, Symbol, snapshot,
};

use crate::registry::{self, Registration};
use core::alloc::Layout;
use core::ptr::NonNull;
use core::sync::atomic::{AtomicBool, Ordering::*};
pub(crate) use mode::TRACK_ALL;
use mode::TRACK_SAMPLED;
use mode::{ALLOC_HOOK, FREE_HOOK, KIND_BASIC, KIND_FULL, KIND_MASK, KIND_SAMPLE, PENDING_ENV};
use table::{Key, Rec};

/// Sets the record mode of every registered allocator whose name or description is `name`
/// (ignoring ASCII case, as O3DE's console does); returns how many matched.
///
/// Allocators register on first use, so one that has not been used yet is not found:
/// set those through their handle, or with `TAGALLOC_RECORDS`.
///
/// ```
/// use tagalloc::records::{self, RecordMode};
///
/// assert_eq!(records::set_by_name("systemallocator", RecordMode::Off), 1);
/// assert_eq!(records::set_by_name("No such allocator", RecordMode::Basic), 0);
/// ```
pub fn set_by_name(name: &str, mode: RecordMode) -> usize {
    let mut n = 0;
    for entry in registry::allocators() {
        if entry.name().eq_ignore_ascii_case(name) || entry.description().eq_ignore_ascii_case(name)
        {
            entry.set_records(mode);
            n += usize::from(entry.records_supported());
        }
    }
    n
}

static ACTIVE: AtomicBool = AtomicBool::new(false);

/// Prepares what records need, the first time any allocator turns them on: the clock's
/// epoch, the registry entry of the records' heap, and the `fork()` handlers.
pub(crate) fn activate() {
    if ACTIVE.load(Acquire) || ACTIVE.swap(true, AcqRel) {
        return;
    }
    clock::start_epoch();
    heap::REGISTRATION.register();
    crate::fork::install();
}

/// Whether records were ever turned on (their locks then matter around `fork()`).
pub(crate) fn is_active() -> bool {
    ACTIVE.load(Acquire)
}

/// Takes the records' locks before `fork()` (called by the fork handlers in `fork`).
///
/// # Safety
/// Must be followed by [`after_fork`] on the same thread (or in the child it forks).
pub(crate) unsafe fn before_fork() {
    // SAFETY: released by `after_fork`; the order (table, buffers, stacks, heap) is the
    // only order in which these locks are ever nested.
    unsafe {
        table::lock_all();
        buffer::before_fork();
        stack::lock();
        heap::RECORDS_HEAP.lock_small_heaps();
        heap::RECORDS_HEAP.large_heap().lock_all();
    }
}

/// Releases what `before_fork` took.
///
/// # Safety
/// Only after `before_fork`, on the thread that called it (or in the child it forked).
pub(crate) unsafe fn after_fork(child: bool) {
    // SAFETY: the locks were taken by `before_fork` (on this thread, or copied into the child).
    unsafe {
        heap::RECORDS_HEAP.large_heap().unlock_all();
        heap::RECORDS_HEAP.unlock_small_heaps();
        stack::unlock();
        table::unlock_all();
        buffer::after_fork(child);
    }
}

// ---- Hooks, called by the allocators. Each is one load and one branch while off. ----

/// After an allocation of `granted` bytes at `ptr` for `layout`: records it if the
/// allocator records.
///
/// The common cases (a basic record into this thread's buffer, an allocation sampling
/// skips) call nothing, and everything else goes through one call: an allocator's fast
/// path that inlines this needs no saved registers for it.
#[inline(always)]
pub(crate) fn after_alloc(
    reg: &'static Registration,
    ptr: NonNull<u8>,
    layout: Layout,
    granted: usize,
) {
    let word = reg.records().word();
    let hook = word & ALLOC_HOOK;
    if hook == 0 {
        return;
    }
    let addr = ptr.as_ptr() as usize;
    if hook == KIND_BASIC {
        if push_own(reg, addr, layout, granted) {
            return;
        }
    } else if skip_sample(word, layout.size()) {
        return;
    }
    record(reg, word, addr, layout, granted);
}

/// A basic record into this thread's buffer, if it has one and nothing asks for more than
/// appending (calls nothing); `false`: record it the long way.
#[inline(always)]
pub(crate) fn push_own(
    reg: &'static Registration,
    addr: usize,
    layout: Layout,
    granted: usize,
) -> bool {
    let Some(index) = reg.index() else {
        return false;
    };
    push_own_as(index as u32, addr, layout, granted)
}

/// [`push_own`] for the allocator at registry index `alloc`.
#[inline(always)]
pub(crate) fn push_own_as(alloc: u32, addr: usize, layout: Layout, granted: usize) -> bool {
    let Some(buf) = guard::own_buffer() else {
        return false;
    };
    let align_log2 = layout.align().trailing_zeros() as u8;
    buf.push(addr, alloc, granted, layout.size(), align_log2)
}

/// Whether an allocation of `size` bytes in an allocator that only samples is certainly
/// not sampled (the thread's countdown, charged here; see [`sample`]).
#[inline(always)]
pub(crate) fn skip_sample(word: u64, size: usize) -> bool {
    word & ALLOC_HOOK == KIND_SAMPLE && guard::with_sampler(|s| s.try_skip(word >> 16, size))
}

/// Whether a free in an allocator that only samples certainly has no record to remove (the
/// filter of sampled addresses).
#[inline(always)]
pub(crate) fn skip_unsampled_free(word: u64, addr: usize) -> bool {
    word & FREE_HOOK == TRACK_SAMPLED && !table::maybe_sampled(addr)
}

/// Before `ptr` is freed: removes its record. As [`after_alloc`], the common cases (a
/// record in this thread's buffer, a block the sample filter rules out) call nothing.
#[inline(always)]
pub(crate) fn before_free(reg: &'static Registration, ptr: NonNull<u8>) {
    let word = reg.records().word();
    let track = word & FREE_HOOK;
    if track == 0 {
        return;
    }
    let addr = ptr.as_ptr() as usize;
    if track == TRACK_ALL {
        if forget_own(reg, addr) {
            return;
        }
    } else if skip_unsampled_free(word, addr) {
        return;
    }
    forget(reg, word, addr);
}

/// Drops the record of a block this thread allocated and has in its record table (calls
/// nothing); `false` when it is not found there this way (look in the table again after
/// serving requests, then in the shared table and the other threads' tables).
#[inline(always)]
pub(crate) fn forget_own(reg: &'static Registration, addr: usize) -> bool {
    let Some(index) = reg.index() else {
        return false;
    };
    forget_own_as(index as u32, addr)
}

/// [`forget_own`] for the allocator at registry index `alloc`.
#[inline(always)]
pub(crate) fn forget_own_as(alloc: u32, addr: usize) -> bool {
    let me = guard::own_buffer_quick();
    // SAFETY: a non-null buffer pointer from this thread's state is its claimed buffer,
    // never freed.
    match unsafe { me.as_ref() } {
        Some(buf) => buf.forget_own(addr, alloc),
        None => false,
    }
}

/// A record taken out of the table while its block is being resized.
#[derive(Debug)]
pub(crate) struct Taken {
    key: Key,
    rec: Rec,
    /// Taken from a thread's buffer (its site counts it live no more).
    from_buffer: bool,
}

/// Before `ptr` is resized: takes its record out (see [`after_realloc`]).
#[inline(always)]
pub(crate) fn before_realloc(reg: &'static Registration, ptr: NonNull<u8>) -> Option<Taken> {
    let word = reg.records().word();
    if word & FREE_HOOK != 0 {
        take(reg, word, ptr.as_ptr() as usize)
    } else {
        None
    }
}

/// After a resize: puts the record back at the block's new address and size (`new` is
/// the block and its granted size, `None` if the resize failed and the old block stays).
#[inline(always)]
pub(crate) fn after_realloc(
    taken: Option<Taken>,
    new: Option<(NonNull<u8>, usize)>,
    new_size: usize,
) {
    if let Some(taken) = taken {
        put_back(taken, new, new_size);
    }
}

/// Reads the environment if this is the `SystemAllocator`'s first call; returns the word
/// to act on.
#[cold]
fn settle_env(reg: &'static Registration) -> u64 {
    env::ensure_read();
    let word = reg.records().word();
    if word & PENDING_ENV != 0 {
        // The environment is being read by this very thread (re-entered): act as off.
        word & !(ALLOC_HOOK | FREE_HOOK)
    } else {
        word
    }
}

#[inline(never)]
fn record(reg: &'static Registration, mut word: u64, addr: usize, layout: Layout, granted: usize) {
    if word & PENDING_ENV != 0 {
        word = settle_env(reg);
    }
    let kind = word & KIND_MASK;
    if kind == 0 {
        return;
    }
    let target = guard::target();
    if let guard::Target::Busy = target {
        return; // an allocation made while this thread records or reports
    }
    let Some(index) = reg.index() else {
        return;
    };
    let align_log2 = layout.align().trailing_zeros() as u8;
    if kind == KIND_BASIC {
        if let guard::Target::Buffer(buf) = target {
            if buf.push_slow(addr, index as u32, granted, layout.size(), align_log2) {
                return;
            }
        }
    }
    let frames = (word >> 8) as u8;
    let (weight, sampled, frames) = match kind {
        KIND_BASIC => (1.0, false, 0),
        KIND_FULL => (1.0, false, frames),
        KIND_SAMPLE => {
            let interval = word >> 16;
            let seed = || {
                sample::generator_seed(|| {
                    clock::ticks() ^ (u64::from(guard::thread_id()) << 32) ^ addr as u64
                })
            };
            match guard::with_sampler(|s| s.charge(interval, layout.size(), seed)) {
                Some(weight) => (weight, true, frames),
                None => return,
            }
        }
        _ => return,
    };
    insert(index, kind, frames, addr, layout, granted, weight, sampled);
}

/// Records a block the `SystemAllocator`'s thread cache sampled at mean `interval` (its
/// countdown made the decision, so this only weighs and inserts). The cache counts blocks
/// of a size class, so a block's chance of being sampled follows its `granted` size.
#[inline(never)]
pub(crate) fn record_sampled(
    reg: &'static Registration,
    ptr: NonNull<u8>,
    layout: Layout,
    granted: usize,
    interval: u64,
) {
    let word = reg.records().word();
    if word & KIND_MASK != KIND_SAMPLE || guard::is_busy() {
        return; // the mode changed meanwhile, or an allocation made while recording
    }
    let Some(index) = reg.index() else {
        return;
    };
    let weight = sample::sample_weight(granted, interval);
    let frames = (word >> 8) as u8;
    insert(
        index,
        KIND_SAMPLE,
        frames,
        ptr.as_ptr() as usize,
        layout,
        granted,
        weight,
        true,
    );
}

/// Inserts one record (its stack captured if `frames > 0`).
#[allow(clippy::too_many_arguments)]
fn insert(
    index: usize,
    kind: u64,
    frames: u8,
    addr: usize,
    layout: Layout,
    granted: usize,
    weight: f64,
    sampled: bool,
) {
    let stack = if frames > 0 { capture_stack(frames) } else { 0 };
    table::insert(
        Key {
            addr,
            alloc: index as u32,
        },
        Rec {
            size: granted,
            requested: layout.size(),
            time: clock::ticks(),
            weight,
            thread: guard::thread_id(),
            stack,
            align_log2: layout.align().trailing_zeros() as u8,
            sampled,
            timed: kind != KIND_BASIC,
            site: 0,
        },
    );
}

/// Captures and interns the caller's stack, with the guard set (the unwinder allocates
/// nothing through Rust's allocator, but an allocation made meanwhile would pass
/// unrecorded rather than recurse).
#[inline(never)]
fn capture_stack(frames: u8) -> u32 {
    let Some(_busy) = guard::Busy::try_enter() else {
        return 0;
    };
    let marker = 0u8;
    let boundary = core::hint::black_box(core::ptr::addr_of!(marker)) as usize;
    let captured = stack::capture(frames, boundary);
    stack::intern(&captured.ips[..captured.len], frames)
}

/// Whether a free in an allocator with settings `word` must look `addr` up.
#[inline]
fn must_look_up(word: u64, addr: usize) -> bool {
    word & TRACK_ALL != 0 || (word & TRACK_SAMPLED != 0 && table::maybe_sampled(addr))
}

#[inline(never)]
fn forget(reg: &'static Registration, mut word: u64, addr: usize) {
    if word & PENDING_ENV != 0 {
        word = settle_env(reg);
    }
    if !must_look_up(word, addr) {
        return;
    }
    if let Some(index) = reg.index() {
        let me = guard::current_buffer();
        // SAFETY: a non-null buffer pointer from this thread's state is its claimed buffer,
        // never freed.
        if let Some(buf) = unsafe { me.as_ref() } {
            if buf.take_own(addr, index as u32).is_some() {
                return;
            }
        }
        let key = Key {
            addr,
            alloc: index as u32,
        };
        table::remove(key, clock::ticks, me);
    }
}

#[inline(never)]
fn take(reg: &'static Registration, mut word: u64, addr: usize) -> Option<Taken> {
    if word & PENDING_ENV != 0 {
        word = settle_env(reg);
    }
    if !must_look_up(word, addr) {
        return None;
    }
    let key = Key {
        addr,
        alloc: reg.index()? as u32,
    };
    let me = guard::current_buffer();
    // SAFETY: as in `forget`.
    if let Some(buf) = unsafe { me.as_ref() } {
        if let Some(e) = buf.take_own(key.addr, key.alloc) {
            let rec = e.rec(guard::thread_id());
            return Some(Taken {
                key,
                rec,
                from_buffer: true,
            });
        }
    }
    table::take(key, me).map(|(rec, from_buffer)| Taken {
        key,
        rec,
        from_buffer,
    })
}

#[inline(never)]
fn put_back(taken: Taken, new: Option<(NonNull<u8>, usize)>, new_size: usize) {
    let Taken {
        mut key,
        mut rec,
        from_buffer,
    } = taken;
    let old_size = rec.size;
    if let Some((ptr, granted)) = new {
        key.addr = ptr.as_ptr() as usize;
        rec.size = granted;
        rec.requested = new_size;
    }
    table::put_resized(key, rec, old_size, from_buffer);
}

/// Live records in the whole table (all allocators).
pub fn live_records() -> usize {
    table::live_records()
}

/// What one allocator's live records add up to (unweighted: each record counts once).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RecordTotals {
    /// Live records.
    pub records: usize,
    /// Their granted bytes.
    pub bytes: usize,
    /// Their requested bytes.
    pub requested: usize,
}

/// Adds up the live records of `allocator` without allocating (it walks the table, taking
/// each shard lock in turn), so it can be compared with the allocator's statistics at the
/// same moment. With `Basic` or `Full` records on since the allocator's first block, the
/// records equal its live blocks and granted bytes.
///
/// ```
/// use tagalloc::{RecordMode, SystemAllocator};
/// use tagalloc::records::{self, RecordTotals};
///
/// tagalloc::allocator!(Audio: child of SystemAllocator, "Audio");
/// Audio.set_records(RecordMode::Basic);
/// let clip = allocator_api2::vec::Vec::<i16, Audio>::with_capacity_in(1000, Audio);
/// let totals = records::live_totals(Audio::registration());
/// assert_eq!(totals, RecordTotals { records: 1, bytes: Audio.stats().live_granted_bytes, requested: 2000 });
/// # drop(clip);
/// ```
pub fn live_totals(allocator: &Registration) -> RecordTotals {
    let Some(index) = allocator.index() else {
        return RecordTotals::default();
    };
    let (records, bytes, requested) = table::totals_of(index as u32);
    RecordTotals {
        records,
        bytes,
        requested,
    }
}
