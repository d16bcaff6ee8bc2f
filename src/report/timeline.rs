//! Memory over time: [`mark_frame`] records every allocator's Used and the peak since the
//! previous mark into a fixed ring; [`timeline`] and [`timeline_csv`] read it back.
//!
//! The ring is a `static` of [`TIMELINE_FRAMES`] frames of [`TIMELINE_ALLOCATORS`] columns
//! (a column per registry index: the OS layer, the `SystemAllocator`, then the allocators in
//! order of first use). Marking writes plain atomics: it never allocates and takes no lock
//! but those a statistics reading takes, so it may run anywhere `stats()` may, and a
//! process forked between two marks keeps its timeline. Allocators past the first
//! [`TIMELINE_ALLOCATORS`] are not in the timeline.
//!
//! The peak of a frame is the highest Used between the previous mark and this one (both
//! included):
//! - for a child, its counters keep that figure (within the peak's tolerance, see
//!   [`Counters`](crate::Counters));
//! - for pools, the OS layer and the `SystemAllocator`, which keep only an all-time peak,
//!   it is that peak if it rose during the interval, else the higher of the Used figures
//!   at the two marks (a spike below an earlier high is not seen).

use crate::records::clock::monotonic_ns;
use crate::registry::{self, AllocatorKind};
use core::sync::atomic::{
    AtomicU64, AtomicUsize,
    Ordering::{AcqRel, Acquire, Relaxed, Release},
};
use std::fmt::Write as _;

/// How many marks the ring keeps (the most recent ones).
pub const TIMELINE_FRAMES: usize = 512;
/// How many allocators (by registry index, from 0) the timeline follows.
pub const TIMELINE_ALLOCATORS: usize = 64;

/// A cell with no figure: the allocator was not registered at that mark.
const ABSENT: usize = usize::MAX;

/// One mark in the ring.
struct Frame {
    /// The mark's number plus one once it is written; 0 while it is written.
    seq: AtomicU64,
    /// Nanoseconds since the first mark.
    time_ns: AtomicU64,
    used: [AtomicUsize; TIMELINE_ALLOCATORS],
    peak: [AtomicUsize; TIMELINE_ALLOCATORS],
}

impl Frame {
    const fn new() -> Self {
        Self {
            seq: AtomicU64::new(0),
            time_ns: AtomicU64::new(0),
            used: [const { AtomicUsize::new(ABSENT) }; TIMELINE_ALLOCATORS],
            peak: [const { AtomicUsize::new(ABSENT) }; TIMELINE_ALLOCATORS],
        }
    }
}

static RING: [Frame; TIMELINE_FRAMES] = [const { Frame::new() }; TIMELINE_FRAMES];
/// Marks taken so far.
static MARKS: AtomicU64 = AtomicU64::new(0);
/// `CLOCK_MONOTONIC` at the first mark, plus one (0: no mark yet).
static START_NS: AtomicU64 = AtomicU64::new(0);
/// Each column's Used and all-time peak at the previous mark.
static LAST_USED: [AtomicUsize; TIMELINE_ALLOCATORS] =
    [const { AtomicUsize::new(ABSENT) }; TIMELINE_ALLOCATORS];
static LAST_PEAK: [AtomicUsize; TIMELINE_ALLOCATORS] =
    [const { AtomicUsize::new(0) }; TIMELINE_ALLOCATORS];

/// Records every registered allocator's Used (live granted bytes) and the peak since the
/// previous mark, as one row of the timeline; call it once per frame or interval, from one
/// thread. Never allocates (it reads each allocator's statistics, as `stats()` does).
///
/// ```
/// use tagalloc::SystemAllocator;
/// tagalloc::allocator!(Level: child of SystemAllocator, "Level data");
///
/// for frame in 0..3 {
///     let scratch = allocator_api2::vec::Vec::<u8, _>::with_capacity_in(1000 * (frame + 1), Level);
///     drop(scratch);
///     tagalloc::report::mark_frame();
/// }
/// let csv = tagalloc::report::timeline_csv();
/// assert!(csv.lines().next().unwrap().contains(",Level,Level peak"));
/// assert!(csv.lines().count() >= 4); // the header and a row per mark
/// ```
pub fn mark_frame() {
    let n = MARKS.fetch_add(1, AcqRel);
    let frame = &RING[(n % TIMELINE_FRAMES as u64) as usize];
    frame.seq.store(0, Release);
    let now = monotonic_ns();
    let _ = START_NS.compare_exchange(0, now + 1, Relaxed, Relaxed);
    let start = START_NS.load(Relaxed) - 1;
    for column in 0..TIMELINE_ALLOCATORS {
        frame.used[column].store(ABSENT, Relaxed);
        frame.peak[column].store(ABSENT, Relaxed);
    }
    for entry in registry::allocators() {
        let Some(column) = entry.index().filter(|&i| i < TIMELINE_ALLOCATORS) else {
            continue;
        };
        let stats = entry.stats();
        let used = stats.live_granted_bytes;
        let between = if entry.kind() == AllocatorKind::Child {
            entry.counters().take_frame_peak()
        } else {
            0
        };
        let all_time = stats.peak_granted_bytes.unwrap_or(0);
        let previous = LAST_USED[column].swap(used, Relaxed);
        let previous_peak = LAST_PEAK[column].swap(all_time, Relaxed);
        let mut peak = used.max(between);
        if previous != ABSENT {
            peak = peak.max(previous);
        }
        if all_time > previous_peak {
            // The all-time peak rose since the previous mark: it was reached in between.
            peak = peak.max(all_time);
        }
        frame.used[column].store(used, Relaxed);
        frame.peak[column].store(peak, Relaxed);
    }
    frame.time_ns.store(now.saturating_sub(start), Relaxed);
    frame.seq.store(n + 1, Release);
}

/// One allocator followed by the [`Timeline`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TimelineAllocator {
    /// Registry index (the column).
    pub index: usize,
    /// Name.
    pub name: &'static str,
    /// The budget now, if one is set.
    pub budget: Option<usize>,
}

/// One mark of the [`Timeline`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TimelineFrame {
    /// The mark's number, from 0 at the first [`mark_frame`].
    pub mark: u64,
    /// Nanoseconds since the first mark.
    pub time_ns: u64,
    /// Per allocator of [`Timeline::allocators`], in that order: Used at the mark and the
    /// peak since the previous mark; `None` where it was not registered yet.
    pub figures: Vec<Option<(usize, usize)>>,
}

/// The marks still in the ring, oldest first (see [`mark_frame`]).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Timeline {
    /// The allocators with a figure in at least one of the frames, by registry index.
    pub allocators: Vec<TimelineAllocator>,
    /// The frames.
    pub frames: Vec<TimelineFrame>,
}

/// Reads the ring: the last [`TIMELINE_FRAMES`] marks, oldest first.
pub fn timeline() -> Timeline {
    let marks = MARKS.load(Acquire);
    let first = marks.saturating_sub(TIMELINE_FRAMES as u64);
    let mut raw: Vec<(u64, u64, Vec<usize>, Vec<usize>)> = Vec::new();
    for n in first..marks {
        let frame = &RING[(n % TIMELINE_FRAMES as u64) as usize];
        if frame.seq.load(Acquire) != n + 1 {
            continue; // being written, or overwritten meanwhile
        }
        let time = frame.time_ns.load(Relaxed);
        let used: Vec<usize> = frame.used.iter().map(|c| c.load(Relaxed)).collect();
        let peak: Vec<usize> = frame.peak.iter().map(|c| c.load(Relaxed)).collect();
        if frame.seq.load(Acquire) == n + 1 {
            raw.push((n, time, used, peak));
        }
    }
    let mut allocators: Vec<TimelineAllocator> = registry::allocators()
        .filter_map(|entry| {
            let index = entry.index()?;
            (index < TIMELINE_ALLOCATORS && raw.iter().any(|f| f.2[index] != ABSENT)).then(|| {
                TimelineAllocator {
                    index,
                    name: entry.name(),
                    budget: entry.budget().limit(),
                }
            })
        })
        .collect();
    allocators.sort_by_key(|a| a.index);
    let frames = raw
        .into_iter()
        .map(|(mark, time_ns, used, peak)| TimelineFrame {
            mark,
            time_ns,
            figures: allocators
                .iter()
                .map(|a| (used[a.index] != ABSENT).then(|| (used[a.index], peak[a.index])))
                .collect(),
        })
        .collect();
    Timeline { allocators, frames }
}

impl Timeline {
    /// The timeline as CSV, one row per mark and two columns per allocator (Unreal's LLM
    /// CSV has this shape): `mark,time_ms,<name>,<name> peak,…`, bytes; an empty cell where
    /// the allocator was not registered yet.
    pub fn to_csv(&self) -> String {
        let mut out = String::from("mark,time_ms");
        for a in &self.allocators {
            let _ = write!(out, ",{0},{0} peak", a.name);
        }
        out.push('\n');
        for f in &self.frames {
            let _ = write!(out, "{},{:.3}", f.mark, f.time_ns as f64 / 1e6);
            for cell in &f.figures {
                match cell {
                    Some((used, peak)) => {
                        let _ = write!(out, ",{used},{peak}");
                    }
                    None => out.push_str(",,"),
                }
            }
            out.push('\n');
        }
        out
    }
}

/// The timeline as CSV (see [`Timeline::to_csv`]).
pub fn timeline_csv() -> String {
    timeline().to_csv()
}
