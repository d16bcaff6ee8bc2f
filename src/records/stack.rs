//! Call stacks: captured unresolved on the allocation path, interned in a table of their own.
//!
//! A capture walks the stack with [`unwind`](super::unwind) (the platform unwinder, which
//! allocates nothing through Rust's global allocator, replayed from what it learnt) and
//! keeps only instruction pointers. Frames of the recorder itself are skipped by stack
//! address: any frame whose canonical frame address lies below a marker taken in the
//! recording entry point belongs to the capture machinery. Up to [`PLUMBING`] frames more
//! than asked are kept, because the first frames above the recorder are the allocator's and
//! the container's own (`__rust_alloc`, `RawVec`, the handle's `Allocator` impl), which
//! reports trim after resolving symbols.
//!
//! Identical stacks share one id: the table stores each distinct stack once (stacks are
//! never removed), which also makes the id the call site that reports group by.

use super::heap::Internal;
use super::table::BuildFold;
use crate::sync::SpinLock;
use allocator_api2::vec::Vec as IVec;
use core::hash::{BuildHasher, Hasher};
use hashbrown::HashTable;

/// Frames captured beyond the number asked for, to survive the trimming of allocator frames.
/// The deepest allocator path (a child's small request its lane refused, with records on)
/// has nine such frames in an unoptimised build, where no call becomes a jump; one more is
/// kept as a margin.
pub(crate) const PLUMBING: usize = 10;
/// The most frames one capture holds.
pub(crate) const MAX_CAPTURE: usize = super::RecordMode::MAX_FRAMES as usize + PLUMBING;

/// A stack being captured: instruction pointers, innermost first.
pub(crate) struct Captured {
    pub(crate) ips: [usize; MAX_CAPTURE],
    pub(crate) len: usize,
}

/// Captures up to `frames + PLUMBING` frames above `boundary` (an address in the recording
/// entry point's stack frame).
#[inline(never)]
pub(crate) fn capture(frames: u8, boundary: usize) -> Captured {
    let want = (frames as usize + PLUMBING).min(MAX_CAPTURE);
    let mut out = Captured {
        ips: [0; MAX_CAPTURE],
        len: 0,
    };
    out.len = super::unwind::walk(boundary, &mut out.ips[..want]);
    out
}

/// The interned stacks.
struct StackTable {
    /// Every stack's instruction pointers, one after another.
    ips: IVec<usize, Internal>,
    /// Per stack id − 1: (start in `ips`, number of ips, frames to show).
    stacks: IVec<(u32, u8, u8), Internal>,
    /// Ids by the hash of their ips.
    index: HashTable<u32, Internal>,
}

static STACKS: SpinLock<StackTable> = SpinLock::new(StackTable {
    ips: IVec::new_in(Internal),
    stacks: IVec::new_in(Internal),
    index: HashTable::new_in(Internal),
});

fn hash(ips: &[usize], show: u8) -> u64 {
    let mut h = BuildFold.build_hasher();
    h.write_u64(u64::from(show));
    for &ip in ips {
        h.write_usize(ip);
    }
    h.finish()
}

/// The id (≥ 1) of a stack, adding it if new; 0 if the records' heap is out of memory.
/// `show` is how many frames reports show after trimming.
pub(crate) fn intern(ips: &[usize], show: u8) -> u32 {
    let h = hash(ips, show);
    let mut guard = STACKS.lock();
    let table = &mut *guard;
    let (all, stacks) = (&table.ips, &table.stacks);
    let same = |&id: &u32| {
        let (start, len, s) = stacks[id as usize - 1];
        s == show && &all[start as usize..start as usize + len as usize] == ips
    };
    if let Some(&id) = table.index.find(h, same) {
        return id;
    }
    if table.ips.len() + ips.len() > u32::MAX as usize
        || table.ips.try_reserve(ips.len()).is_err()
        || table.stacks.try_reserve(1).is_err()
        || table.index.try_reserve(1, |_| 0).is_err()
    {
        return 0;
    }
    let start = table.ips.len() as u32;
    table.ips.extend_from_slice(ips);
    table.stacks.push((start, ips.len() as u8, show));
    let id = table.stacks.len() as u32;
    let (all, stacks) = (&table.ips, &table.stacks);
    let rehash = |&id: &u32| {
        let (start, len, s) = stacks[id as usize - 1];
        hash(&all[start as usize..start as usize + len as usize], s)
    };
    table.index.insert_unique(h, id, rehash);
    id
}

/// A copy of every interned stack: `(ips, frames to show)`, indexed by id − 1. Copied
/// into the records' heap under the lock, then into ordinary vectors outside it.
pub(crate) fn copy_all() -> Vec<(Vec<usize>, u8)> {
    let (ips, stacks) = {
        let guard = STACKS.lock();
        let mut ips = IVec::new_in(Internal);
        let mut stacks = IVec::new_in(Internal);
        if ips.try_reserve(guard.ips.len()).is_ok()
            && stacks.try_reserve(guard.stacks.len()).is_ok()
        {
            ips.extend_from_slice(&guard.ips);
            stacks.extend_from_slice(&guard.stacks);
        }
        (ips, stacks)
    };
    stacks
        .iter()
        .map(|&(start, len, show)| {
            (
                ips[start as usize..start as usize + len as usize].to_vec(),
                show,
            )
        })
        .collect()
}

/// Takes the stack table's lock (before `fork`).
///
/// # Safety
/// Must be paired with [`unlock`], with no guard alive.
pub(crate) unsafe fn lock() {
    // SAFETY: forwarded from the caller.
    unsafe { STACKS.lock_raw() };
}

/// Releases the lock taken by [`lock`].
///
/// # Safety
/// Only after [`lock`], with no guard alive.
pub(crate) unsafe fn unlock() {
    // SAFETY: forwarded from the caller.
    unsafe { STACKS.force_unlock() };
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn identical_stacks_share_an_id() {
        let a = intern(&[0xdead_0001, 0xdead_0002, 0xdead_0003], 8);
        let b = intern(&[0xdead_0001, 0xdead_0002], 8);
        let c = intern(&[0xdead_0001, 0xdead_0002, 0xdead_0003], 8);
        let d = intern(&[0xdead_0001, 0xdead_0002, 0xdead_0003], 4);
        assert!(a >= 1 && b >= 1);
        assert_eq!(a, c);
        assert_ne!(a, b);
        assert_ne!(a, d);
        let all = copy_all();
        assert_eq!(
            all[a as usize - 1],
            (vec![0xdead_0001, 0xdead_0002, 0xdead_0003], 8)
        );
        assert_eq!(all[d as usize - 1].1, 4);
    }

    #[inline(never)]
    fn capture_here(frames: u8) -> Captured {
        let marker = 0u8;
        capture(frames, core::ptr::addr_of!(marker) as usize)
    }

    #[test]
    fn a_capture_starts_above_the_boundary_and_stops_at_the_limit() {
        let c = capture_here(2);
        assert!(c.len > 0 && c.len <= 2 + PLUMBING, "{}", c.len);
        // The first frame is `capture_here`'s caller or `capture_here` itself, never
        // `capture`: resolve it and check.
        let mut names = Vec::new();
        backtrace::resolve(c.ips[0] as *mut _, |s| {
            names.push(s.name().map(|n| n.to_string()).unwrap_or_default())
        });
        assert!(
            names.iter().all(|n| !n.ends_with("stack::capture")),
            "{names:?}"
        );
    }
}
