//! Scoped tags: a subsystem's memory counted in its allocator even where code never names
//! it (std's `Vec`, `String`, `Box`, `HashMap`, third-party crates).
//!
//! ```
//! #[global_allocator]
//! static GLOBAL: tagalloc::SystemAllocator = tagalloc::SystemAllocator::new();
//!
//! tagalloc::allocator!(pub Renderer: child of tagalloc::SystemAllocator, "Meshes");
//!
//! let meshes = {
//!     let _tag = Renderer.enter(); // every allocation of this thread is Renderer's...
//!     vec![[0.0f32; 3]; 1000]      // ...std's Vec included
//! };                               // ...until the guard drops
//! assert_eq!(Renderer.stats().live_blocks, 1);
//! assert!(Renderer.stats().live_granted_bytes >= 12_000);
//! drop(meshes); // freed anywhere, by anyone: still counted as Renderer's
//! assert_eq!(Renderer.stats().live_blocks, 0);
//! ```
//!
//! A thread enters a child allocator's tag with its handle ([`enter`](crate::allocator),
//! `scope`, `bind`, `instrument`: every `child of` handle whose chain of parents ends at
//! the [`SystemAllocator`](crate::SystemAllocator) has them; entering a pool does not
//! compile). While it is entered, every allocation the thread makes through the global
//! allocator, of any size, is made through that child, exactly as through its handle: it
//! counts in the child and its ancestors (blocks, granted and requested bytes, calls, peak),
//! its budget applies (a refusal in [`BudgetMode::Fail`](crate::BudgetMode::Fail) is a null
//! return, which `try_reserve` reports and ordinary std code turns into an abort through
//! Rust's allocation-failure handler: scope such code with a `Warn` budget), and its records
//! see it (with `TAGALLOC_RECORDS="Renderer=full"` the leak report shows where a
//! subsystem's std allocations come from).
//!
//! **Where the tag comes back from.** A block's tag is fixed when it is allocated: small
//! blocks come from heap segments of their tag, large ones carry it in their header, so a
//! free finds it from the address alone, whichever thread frees it, inside another scope or
//! none, after the allocating thread exited, in a forked child. No per-block header, no
//! side table. A `realloc` keeps the block's tag (a block allocated outside any scope stays
//! the `SystemAllocator`'s when it grows inside one).
//!
//! **Cost.** Entering and leaving is a few loads and stores of the thread's cache. Inside a
//! scope, small allocations come from the child's lane of the thread cache, the same fast
//! path as outside one; a program that never enters a scope runs the fast paths it always
//! did. Each tag in use holds at least one partly used page per size class it uses, in
//! segments of its own.
//!
//! **Guards** nest, and each restores what it replaced when it drops, in whatever order
//! guards drop (as `tracing` spans do). A guard is `!Send`: a tag belongs to a thread. A
//! future that may move between threads takes its tag with it through
//! [`instrument`](Instrumented), which enters the tag around each `poll`, never across an
//! `.await`.

use crate::child::BlockAllocator;
use crate::lanes;
use crate::registry::Registration;
use crate::schema::hpha::Tag;
use crate::thread_cache;
use core::future::Future;
use core::pin::Pin;
use core::task::{Context, Poll};

/// While it lives, the calling thread's global allocations are a child allocator's (see the
/// [module docs](self)); dropping it restores the tag it replaced. `!Send`.
///
/// ```compile_fail
/// tagalloc::allocator!(Renderer: child of tagalloc::SystemAllocator);
/// fn send<T: Send>(_: T) {}
/// send(Renderer.enter()); // a tag belongs to a thread
/// ```
///
/// Pools cannot be entered:
///
/// ```compile_fail
/// tagalloc::allocator!(Events: pool of tagalloc::SystemAllocator);
/// let _tag = Events.enter();
/// ```
#[must_use = "the tag is left when the guard drops"]
pub struct TagGuard {
    previous: Tag,
    /// The entering thread's cache, where the tag is left (the guard never leaves that
    /// thread: the pointer also makes it `!Send`).
    cache: thread_cache::CacheRef,
}

impl Drop for TagGuard {
    #[inline]
    fn drop(&mut self) {
        // SAFETY: `cache` came from `enter_scope` on this thread (the guard is `!Send`).
        unsafe { thread_cache::leave_scope(self.cache, self.previous) };
    }
}

impl core::fmt::Debug for TagGuard {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.debug_struct("TagGuard")
            .field("restores", &self.previous)
            .finish()
    }
}

/// Enters the tag of the child allocator `B` on the calling thread (what its handle's
/// `enter` calls).
#[doc(hidden)]
#[inline]
pub fn enter<B: BlockAllocator>() -> TagGuard {
    const {
        assert!(
            B::THREAD_CACHE_LANES,
            "only a child allocator whose chain of parents ends at the SystemAllocator can be \
             entered as a scoped tag"
        )
    };
    enter_tag(tag_of(B::registration()))
}

/// Enters `tag` (0: none) on the calling thread.
#[inline]
fn enter_tag(tag: Tag) -> TagGuard {
    let (previous, cache) = thread_cache::enter_scope(tag);
    TagGuard { previous, cache }
}

/// The tag a scope of `registration` enters: its own, claimed on first use. A child that
/// found no tag left (past [`MAX_TAGS`](crate::schema::hpha::MAX_TAGS)) counts its scoped
/// allocations in its nearest ancestor that has one (or the `SystemAllocator`). One load once
/// the allocator's first scope was entered.
#[inline]
fn tag_of(registration: &'static Registration) -> Tag {
    match registration.counters().scope_tag() {
        0 => tag_of_slow(registration),
        tag => tag,
    }
}

/// [`tag_of`] on an allocator's first scope: claims its tag, and marks tags as in use
/// before the first scoped allocation (from then on every thread's free fast path asks a
/// block for its tag), then keeps the tag for the next scopes.
#[cold]
#[inline(never)]
fn tag_of_slow(registration: &'static Registration) -> Tag {
    lanes::claim(registration);
    let tag = core::iter::successors(Some(registration), |r| r.parent())
        .find_map(|r| r.counters().tag())
        .unwrap_or(0);
    if tag != 0 {
        thread_cache::enable_tags();
        registration.counters().set_scope_tag(tag);
    }
    tag
}

/// Whether the calling thread's small frees through the global allocator go straight to the
/// lane of the tag it is in (`None` before any scope was entered, on a thread whose cache
/// is not live, or where the thread's lanes lie too low for a route to name them, as under
/// valgrind without `--aspace-minaddr`: its frees then all take the slower way): a diagnostic for tests, which check that a change of the records settings
/// does not leave a thread's frees on the slow path.
#[doc(hidden)]
pub fn __frees_follow_the_scope() -> Option<bool> {
    thread_cache::frees_routed_to_current()
}

/// Runs `f` with no tag entered: its global allocations are the `SystemAllocator`'s own
/// (memory a subsystem's scope allocates on behalf of the whole program).
///
/// ```
/// tagalloc::allocator!(Loader: child of tagalloc::SystemAllocator);
/// let _tag = Loader.enter();
/// let shared: Vec<u8> = tagalloc::untagged(|| Vec::with_capacity(64));
/// # drop(shared);
/// ```
#[inline]
pub fn untagged<R>(f: impl FnOnce() -> R) -> R {
    let _untagged = enter_tag(0);
    f()
}

/// A future whose every `poll` runs with a tag entered (see [`TagGuard`]); made by a child
/// handle's `instrument`.
///
/// ```
/// # use core::future::Future;
/// tagalloc::allocator!(Network: child of tagalloc::SystemAllocator);
/// let fut = Network.instrument(async { vec![1u8; 100] });
/// # fn assert_future(_: &impl Future<Output = Vec<u8>>) {}
/// # assert_future(&fut);
/// ```
#[must_use = "futures do nothing unless polled"]
pub struct Instrumented<F> {
    future: F,
    tag: Tag,
}

impl<F> Instrumented<F> {
    /// `future`, run with the tag of the child allocator `B` entered at each poll.
    #[doc(hidden)]
    pub fn new<B: BlockAllocator>(future: F) -> Self {
        const {
            assert!(
                B::THREAD_CACHE_LANES,
                "only a child of the SystemAllocator's chain can be entered"
            )
        };
        Self {
            future,
            tag: tag_of(B::registration()),
        }
    }
}

impl<F: Future> Future for Instrumented<F> {
    type Output = F::Output;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<F::Output> {
        let tag = self.tag;
        let _tag = enter_tag(tag);
        // SAFETY: structural pinning of `future`: it is never moved out of `self` (no method
        // hands it out by value or by `&mut` outside this `poll`), and `Instrumented` has no
        // `Drop` of its own that could move it.
        let future = unsafe { self.map_unchecked_mut(|s| &mut s.future) };
        future.poll(cx)
    }
}

impl<F> core::fmt::Debug for Instrumented<F> {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.debug_struct("Instrumented")
            .field("tag", &self.tag)
            .finish()
    }
}
