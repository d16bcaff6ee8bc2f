//! The `SystemAllocator`'s recording paths, entered from its `GlobalAlloc` methods only when
//! its settings word asks for it (one relaxed load and a branch on the fast path).
//!
//! Each takes the plain operation as a function pointer, so these paths need to know nothing
//! about how the heap works, and the plain operations do not check the word again.

use super::mode::{KIND_BASIC, KIND_FULL, KIND_SAMPLE};
use super::sample::{Rng, next_interval};
use super::{after_alloc, after_realloc, before_free, before_realloc};
use crate::registry::{SYSTEM, SYSTEM_INDEX};
use crate::system::SystemAllocator;
use crate::thread_cache::{HOOK_ALLOC, HOOK_FREE, HOOK_FREE_SAMPLED, HOOK_SAMPLE};
use core::alloc::Layout;
use core::ptr::NonNull;

/// Whether an allocation must take the recording path.
#[inline(always)]
pub(crate) fn alloc_hooked() -> bool {
    SYSTEM.records().word() & super::ALLOC_HOOK != 0
}

/// Whether a free or a realloc must take the recording path.
#[inline(always)]
pub(crate) fn free_hooked() -> bool {
    SYSTEM.records().word() & super::FREE_HOOK != 0
}

/// Whether a small allocation of `size` bytes may take the fast path: records are off, or
/// the allocator only samples and this allocation is not sampled (the thread's countdown is
/// charged here). With records off this is one load, one test and one branch.
#[inline(always)]
pub(crate) fn alloc_fast(size: usize) -> bool {
    let word = SYSTEM.records().word();
    word & super::ALLOC_HOOK == 0 || super::skip_sample(word, size)
}

/// Whether a small free may take the fast path: records are off, or the allocator only
/// samples and `ptr` is certainly not a sampled block, or its record was in this thread's
/// buffer and is now removed (the common basic free: the record leaves before the block).
#[inline(always)]
pub(crate) fn free_fast(ptr: *mut u8) -> bool {
    let word = SYSTEM.records().word();
    word & super::FREE_HOOK == 0
        || super::skip_unsampled_free(word, ptr as usize)
        || (word & super::FREE_HOOK == super::TRACK_ALL && super::forget_own(&SYSTEM, ptr as usize))
}

/// Removes the record of a block about to be freed from this thread's buffer, without a
/// call; `false` if it was not found there that way. For frees whose thread cache says
/// records of any block may exist: a record found in the buffer is removed whatever the
/// settings word says now, so the word is not read.
#[inline(always)]
pub(crate) fn forget_own(ptr: *mut u8) -> bool {
    super::forget_own_as(SYSTEM_INDEX as u32, ptr as usize)
}

/// Records a small block the thread cache just handed out, and returns it. The common case
/// (a basic record into this thread's buffer) calls nothing and the rest is a tail call, so
/// a caller that returns the block right away needs no saved registers.
#[inline(always)]
pub(crate) fn recorded(ptr: NonNull<u8>, layout: Layout, granted: usize) -> *mut u8 {
    let word = SYSTEM.records().word();
    if word & super::ALLOC_HOOK == KIND_BASIC
        && super::push_own_as(SYSTEM_INDEX as u32, ptr.as_ptr() as usize, layout, granted)
    {
        return ptr.as_ptr();
    }
    recorded_slowly(ptr, layout, granted)
}

/// [`recorded`] for everything but a basic record that fits this thread's buffer.
#[inline(never)]
fn recorded_slowly(ptr: NonNull<u8>, layout: Layout, granted: usize) -> *mut u8 {
    after_alloc(&SYSTEM, ptr, layout, granted);
    ptr.as_ptr()
}

/// The thread caches' mirror of the settings word (see `thread_cache::HOOK_ALLOC`): which
/// of their fast paths must step aside for records.
pub(crate) fn thread_hooks() -> u8 {
    let word = SYSTEM.records().word();
    let mut hooks = 0;
    if word & super::PENDING_ENV != 0 || matches!(word & super::KIND_MASK, KIND_BASIC | KIND_FULL) {
        hooks |= HOOK_ALLOC;
    } else if word & super::KIND_MASK == KIND_SAMPLE {
        hooks |= HOOK_SAMPLE;
    }
    if word & (super::TRACK_ALL | super::PENDING_ENV) != 0 {
        hooks |= HOOK_FREE;
    } else if word & super::TRACK_SAMPLED != 0 {
        hooks |= HOOK_FREE_SAMPLED;
    }
    hooks
}

/// What a child's records settings `word` ask of its lane of the thread caches (see
/// `crate::allocator::lanes`): `None` if it must close (records of every block, now or
/// earlier, or the environment not read yet), else the hooks it needs: [`HOOK_SAMPLE`]
/// while it samples (the lane's per-class countdowns choose the sampled blocks, as lane 0's
/// do for the `SystemAllocator`) and [`HOOK_FREE_SAMPLED`] while sampled records may exist
/// (the sample filter answers a free).
pub(crate) fn child_lane_hooks(word: u64) -> Option<u8> {
    if word & (super::PENDING_ENV | super::TRACK_ALL) != 0 {
        return None;
    }
    let sampled_frees = if word & super::TRACK_SAMPLED != 0 {
        HOOK_FREE_SAMPLED
    } else {
        0
    };
    match word & super::KIND_MASK {
        0 => Some(sampled_frees),
        KIND_SAMPLE => Some(HOOK_SAMPLE | HOOK_FREE_SAMPLED),
        _ => None,
    }
}

/// The mean sample interval of an allocator whose records settings are `word`, if it
/// samples.
pub(crate) fn sampling_interval(word: u64) -> Option<u64> {
    (word & super::ALLOC_HOOK == KIND_SAMPLE).then_some(word >> 16)
}

/// Whether a sampled record may exist for the block at `ptr` (false: certainly not).
#[inline(always)]
pub(crate) fn maybe_sampled(ptr: *mut u8) -> bool {
    super::table::maybe_sampled(ptr as usize)
}

/// The mean sample interval in bytes, if the `SystemAllocator` only samples.
#[inline]
pub(crate) fn sample_interval() -> Option<u64> {
    sampling_interval(SYSTEM.records().word())
}

/// A seed for a thread's sample countdowns, from the clock and something thread-specific
/// (or from the fixed seed, see [`set_sample_seed`](super::set_sample_seed)). Never 0.
pub(crate) fn sample_seed(salt: usize) -> u64 {
    super::sample::generator_seed(|| super::clock::ticks() ^ (salt as u64).rotate_left(29))
}

/// A fresh countdown (bytes to the next sample) drawn with the generator state `rng`.
pub(crate) fn draw_countdown(rng: &mut u64, interval: u64) -> i64 {
    let mut g = Rng::new(*rng);
    let d = next_interval(&mut g, interval);
    *rng = g.state();
    d
}

/// Allocates with `plain` and records the block as a sample drawn at mean `interval`
/// (the thread cache's countdown chose it).
#[inline(never)]
pub(crate) fn alloc_sampled(
    layout: Layout,
    interval: u64,
    plain: fn(Layout) -> *mut u8,
) -> *mut u8 {
    let p = plain(layout);
    if let Some(ptr) = NonNull::new(p) {
        // SAFETY: `ptr` was just allocated with `layout`.
        let granted = unsafe { SystemAllocator::new().usable_size(ptr, layout) };
        super::record_sampled(&SYSTEM, ptr, layout, granted, interval);
    }
    p
}

/// Allocates with `plain` and records the block.
///
/// # Safety
/// `GlobalAlloc::alloc`'s contract; `plain` is the matching plain allocation.
///
/// Inlined into the `SystemAllocator`'s recording path, so that `plain` is a direct call
/// (or inlined) rather than a call through a pointer.
#[inline(always)]
pub(crate) unsafe fn alloc(layout: Layout, plain: unsafe fn(Layout) -> *mut u8) -> *mut u8 {
    // SAFETY: forwarded from the caller.
    let p = unsafe { plain(layout) };
    if let Some(ptr) = NonNull::new(p) {
        // SAFETY: `ptr` was just allocated with `layout`.
        let granted = unsafe { SystemAllocator::new().usable_size(ptr, layout) };
        after_alloc(&SYSTEM, ptr, layout, granted);
    }
    p
}

/// Removes the block's record, then frees it with `plain`.
///
/// # Safety
/// `GlobalAlloc::dealloc`'s contract; `plain` is the matching plain free.
#[inline(always)]
pub(crate) unsafe fn dealloc(ptr: *mut u8, layout: Layout, plain: unsafe fn(*mut u8, Layout)) {
    if let Some(p) = NonNull::new(ptr) {
        before_free(&SYSTEM, p);
    }
    // SAFETY: forwarded from the caller.
    unsafe { plain(ptr, layout) }
}

/// Resizes with `plain`, moving the block's record along.
///
/// # Safety
/// `GlobalAlloc::realloc`'s contract; `plain` is the matching plain realloc.
#[inline(never)]
pub(crate) unsafe fn realloc(
    ptr: *mut u8,
    layout: Layout,
    new_size: usize,
    plain: unsafe fn(*mut u8, Layout, usize) -> *mut u8,
) -> *mut u8 {
    let taken = NonNull::new(ptr).and_then(|p| before_realloc(&SYSTEM, p));
    // SAFETY: forwarded from the caller.
    let p = unsafe { plain(ptr, layout, new_size) };
    let new = NonNull::new(p).map(|p| {
        // SAFETY: `p` is live with `new_size` at the old alignment (realloc's contract).
        let granted = unsafe {
            let new_layout = Layout::from_size_align_unchecked(new_size, layout.align());
            SystemAllocator::new().usable_size(p, new_layout)
        };
        (p, granted)
    });
    after_realloc(taken, new, new_size);
    p
}
