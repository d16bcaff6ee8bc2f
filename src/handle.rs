//! Per-type handles: one macro line declares an allocator as a zero-sized `Copy` type.
//!
//! [`allocator!`](crate::allocator) expands to a unit struct (the handle) and a private
//! `static` [`Registration`](crate::Registration) built in a `const` context (its counters,
//! budget and registry link), so a handle costs nothing to store in a container and the
//! allocator needs no initialisation: it registers itself on first use.
//!
//! Every handle implements:
//! - `allocator_api2::alloc::Allocator` (the 0.2 line: what hashbrown and bumpalo use), so
//!   `allocator_api2::vec::Vec`, `allocator_api2::boxed::Box` and `hashbrown::HashMap` work
//!   on stable Rust;
//! - `core::alloc::Allocator` with feature `nightly` (std's `Vec<T, A>`, `Box<T, A>`);
//! - [`BlockAllocator`], so it can be the parent of another allocator;
//! - [`TaggedAllocator`](crate::TaggedAllocator): name, statistics, budget and its hook,
//!   records and garbage collection, the same interface as the `SystemAllocator`'s;
//! - `GlobalAlloc` for child allocators, so a child can even be the global allocator and
//!   tag a whole program.
//!
//! The `Allocator` contract, as implemented here:
//! - A zero-size request returns a dangling pointer aligned to the layout, counts nothing
//!   and does not call the parent; freeing it does nothing.
//! - `allocate` returns a slice whose length is the granted size (the parent's size class
//!   or block size). `deallocate` accepts any size from the requested one to that length;
//!   the granted bytes and block counts stay exact whatever size is passed, because the
//!   granted size freed is read from the heap, not from the layout. Live *requested* bytes
//!   are counted from the layouts passed in, so they are exact when blocks are freed with
//!   the layout they were allocated with (as `Vec`, `Box` and `HashMap` do).
//! - `grow`/`shrink` keep the block in place when the heap can, and move it otherwise;
//!   a change of alignment always moves it.

use crate::child::BlockAllocator;
use core::alloc::Layout;
use core::ptr::{self, NonNull};

/// A dangling, well-aligned pointer for a zero-size block.
#[inline]
fn dangling(layout: Layout) -> NonNull<[u8]> {
    let ptr = ptr::without_provenance_mut::<u8>(layout.align());
    // SAFETY: an alignment is a power of two, so never zero.
    NonNull::slice_from_raw_parts(unsafe { NonNull::new_unchecked(ptr) }, 0)
}

/// `Allocator::allocate` for any [`BlockAllocator`] (what the macro's impls call).
#[inline]
pub fn allocate<B: BlockAllocator>(alloc: B, layout: Layout) -> Option<NonNull<[u8]>> {
    if layout.size() == 0 {
        return Some(dangling(layout));
    }
    let block = alloc.allocate_block(layout)?;
    Some(NonNull::slice_from_raw_parts(block.ptr, block.size))
}

/// `Allocator::allocate_zeroed` for any [`BlockAllocator`].
#[inline]
pub fn allocate_zeroed<B: BlockAllocator>(alloc: B, layout: Layout) -> Option<NonNull<[u8]>> {
    if layout.size() == 0 {
        return Some(dangling(layout));
    }
    let block = alloc.allocate_block_zeroed(layout)?;
    Some(NonNull::slice_from_raw_parts(block.ptr, block.size))
}

/// `Allocator::deallocate` for any [`BlockAllocator`].
///
/// # Safety
/// `ptr` must denote a block currently allocated by `alloc`, and `layout` must fit it
/// (same alignment; size between the one requested and the length returned).
#[inline]
pub unsafe fn deallocate<B: BlockAllocator>(alloc: B, ptr: NonNull<u8>, layout: Layout) {
    if layout.size() != 0 {
        // SAFETY: forwarded from the caller; non-zero blocks came from `allocate_block`.
        unsafe { alloc.deallocate_block(ptr, layout) };
    }
}

/// Moves a block to a new layout: allocate, copy `copy` bytes, free the old one.
///
/// # Safety
/// `ptr`/`old` as for [`deallocate`]; `copy` at most both sizes.
unsafe fn move_block<B: BlockAllocator>(
    alloc: B,
    ptr: NonNull<u8>,
    old: Layout,
    new: Layout,
    copy: usize,
    zeroed: bool,
) -> Option<NonNull<[u8]>> {
    let block = if zeroed {
        allocate_zeroed(alloc, new)?
    } else {
        allocate(alloc, new)?
    };
    // SAFETY: the blocks are distinct live blocks of at least `copy` bytes each; the old
    // block is freed once, with a layout that fits it.
    unsafe {
        ptr.as_ptr()
            .copy_to_nonoverlapping(block.cast().as_ptr(), copy);
        deallocate(alloc, ptr, old);
    }
    Some(block)
}

/// `Allocator::grow` (and `grow_zeroed` when `zeroed`) for any [`BlockAllocator`].
///
/// # Safety
/// As for [`deallocate`] with `old`; `new.size() >= old.size()`.
#[inline]
pub unsafe fn grow<B: BlockAllocator>(
    alloc: B,
    ptr: NonNull<u8>,
    old: Layout,
    new: Layout,
    zeroed: bool,
) -> Option<NonNull<[u8]>> {
    if old.size() == 0 || old.align() != new.align() {
        // SAFETY: forwarded from the caller.
        return unsafe { move_block(alloc, ptr, old, new, old.size(), zeroed) };
    }
    // SAFETY: forwarded from the caller; `new.size()` comes from a valid layout.
    let (block, _) = unsafe { alloc.reallocate_block(ptr, old, new.size())? };
    if zeroed {
        // SAFETY: the block holds `block.size` bytes; the contract asks for zeros from the
        // old requested size to the new granted size.
        unsafe {
            block
                .ptr
                .as_ptr()
                .add(old.size())
                .write_bytes(0, block.size - old.size())
        };
    }
    Some(NonNull::slice_from_raw_parts(block.ptr, block.size))
}

/// `Allocator::shrink` for any [`BlockAllocator`].
///
/// # Safety
/// As for [`deallocate`] with `old`; `new.size() <= old.size()`.
#[inline]
pub unsafe fn shrink<B: BlockAllocator>(
    alloc: B,
    ptr: NonNull<u8>,
    old: Layout,
    new: Layout,
) -> Option<NonNull<[u8]>> {
    if new.size() == 0 {
        // SAFETY: forwarded from the caller.
        unsafe { deallocate(alloc, ptr, old) };
        return Some(dangling(new));
    }
    if old.align() != new.align() {
        // SAFETY: forwarded from the caller.
        return unsafe { move_block(alloc, ptr, old, new, new.size(), false) };
    }
    // SAFETY: forwarded from the caller.
    let (block, _) = unsafe { alloc.reallocate_block(ptr, old, new.size())? };
    Some(NonNull::slice_from_raw_parts(block.ptr, block.size))
}

/// `GlobalAlloc::realloc` for any [`BlockAllocator`].
///
/// # Safety
/// GlobalAlloc's contract for `realloc`.
#[inline]
pub unsafe fn global_realloc<B: BlockAllocator>(
    alloc: B,
    ptr: *mut u8,
    layout: Layout,
    new_size: usize,
) -> *mut u8 {
    // SAFETY: GlobalAlloc's contract: `ptr` is a live block (non-null) with `layout`, and
    // `new_size` is non-zero and fits `isize` when rounded to the alignment.
    unsafe {
        alloc
            .reallocate_block(NonNull::new_unchecked(ptr), layout, new_size)
            .map_or(ptr::null_mut(), |(block, _)| block.ptr.as_ptr())
    }
}

/// Declares an allocator as a zero-sized, `Copy` handle type, in one line.
///
/// ```text
/// allocator!( [#[attributes]] [pub] Name: child of Parent
///             [{ requested_bytes: false }] [, "description"] );
/// allocator!( [#[attributes]] [pub] Name: pool of Parent
///             [{ page_size: P, min_size: MIN, max_size: MAX }] [, "description"] );
/// allocator!( [#[attributes]] [pub] Name: thread_pool of Parent
///             [{ page_size: P, min_size: MIN, max_size: MAX }] [, "description"] );
/// ```
///
/// - `child of`: a pass-through that counts its own blocks (O3DE's child allocator). With
///   `{ requested_bytes: false }` it keeps every figure but the requested bytes (`None` in
///   its statistics and in those of the allocators above it): its small alloc+free pairs
///   then cost what its parent's do, two memory writes fewer (see
///   [`Registration::with_requested_bytes`](crate::Registration::with_requested_bytes)).
/// - `pool of`: fixed size classes from `MIN` to `MAX` bytes on `P`-byte pages taken from
///   the parent ([`PoolCore`](crate::pools::PoolCore): one thread at a time, behind a spin
///   lock). Without the braces, O3DE's geometry: 4 KiB pages, 8..=512 bytes.
/// - `thread_pool of`: the same with one heap per thread
///   ([`ThreadPoolCore`](crate::pools::ThreadPoolCore)), for any number of threads.
///
/// The geometry is checked at compile time ([`PoolConfig::new`](crate::schema::PoolConfig::new)).
/// Pools refuse requests outside their classes with an error (see [`pools`](crate::pools)).
///
/// `Parent` is [`SystemAllocator`](crate::SystemAllocator) or any handle declared with this
/// macro, including another child or a pool. The allocator appears in the registry under
/// `Name` on first use, with the description and its parent, and its statistics are part of
/// its parent's.
///
/// The handle gets `Clone, Copy, Debug, Default, PartialEq, Eq, Hash`, the traits listed in
/// the [module docs](crate::handle) (among them [`TaggedAllocator`](crate::TaggedAllocator),
/// which generic code uses), and inherent methods `stats()`, `set_budget()`,
/// `set_records()`, `record_mode()` and `registration()` (pools also `config()` and
/// `garbage_collect()`).
///
/// ```
/// use allocator_api2::vec::Vec;
/// use tagalloc::SystemAllocator;
///
/// tagalloc::allocator!(pub ScriptCanvasAllocator: child of SystemAllocator, "Script Canvas");
/// tagalloc::allocator!(pub NodeAllocator: child of ScriptCanvasAllocator, "Script nodes");
///
/// let mut nodes: Vec<u64, NodeAllocator> = Vec::new_in(NodeAllocator);
/// nodes.extend(0..100);
/// let mut names = hashbrown::HashMap::with_hasher_in(
///     hashbrown::DefaultHashBuilder::default(),
///     ScriptCanvasAllocator,
/// );
/// names.insert(1, "start");
///
/// // The child's blocks are counted in the child and in its parent.
/// let node_stats = NodeAllocator.stats();
/// assert!(node_stats.live_granted_bytes >= 800);
/// assert_eq!(node_stats.live_blocks, 1);
/// assert!(ScriptCanvasAllocator.stats().live_granted_bytes > node_stats.live_granted_bytes);
/// assert_eq!(NodeAllocator::registration().parent().unwrap().name(), "ScriptCanvasAllocator");
///
/// drop((nodes, names));
/// assert_eq!(ScriptCanvasAllocator.stats().live_granted_bytes, 0);
/// ```
///
/// Pools, with and without a geometry:
///
/// ```
/// use allocator_api2::boxed::Box;
/// use tagalloc::SystemAllocator;
///
/// tagalloc::allocator!(pub EventPool: pool of SystemAllocator, "UI events");
/// tagalloc::allocator!(
///     pub ParticleAllocator: thread_pool of SystemAllocator
///         { page_size: 65536, min_size: 16, max_size: 256 },
///     "Particles"
/// );
///
/// let event = Box::new_in([0u8; 40], EventPool);
/// let sparks: Vec<_> = (0..100).map(|i| Box::new_in([i as f32; 8], ParticleAllocator)).collect();
/// assert_eq!(EventPool.stats().live_granted_bytes, 40);
/// assert_eq!(ParticleAllocator.stats().live_granted_bytes, 100 * 32);
/// // Pages (and per-thread bookkeeping) are held from the parent.
/// assert!(ParticleAllocator.stats().reserved_bytes >= 65536);
/// // Too large for the pool: an error, not undefined behaviour.
/// assert!(Box::try_new_in([0u8; 300], ParticleAllocator).is_err());
/// drop((event, sparks));
/// ```
#[macro_export]
macro_rules! allocator {
    (@description) => { "" };
    (@description $description:literal) => { $description };

    (@config $name:ident) => {
        $crate::schema::PoolConfig::DEFAULT.with_name(stringify!($name))
    };
    (@config $name:ident $page_size:expr, $min_size:expr, $max_size:expr) => {
        match $crate::schema::PoolConfig::new($page_size, $min_size, $max_size) {
            ::core::result::Result::Ok(config) => config.with_name(stringify!($name)),
            ::core::result::Result::Err(_) => ::core::panic!(concat!(
                "tagalloc::allocator!: invalid pool geometry for ", stringify!($name),
                " (see tagalloc::schema::PoolConfig::new for the rules)"
            )),
        }
    };

    ($(#[$meta:meta])* $vis:vis $name:ident : pool of $parent:ty
        $({ page_size: $page_size:expr, min_size: $min_size:expr, max_size: $max_size:expr $(,)? })?
        $(, $description:literal)? $(,)?) => {
        $crate::allocator!(@pool PoolCore, Pool, "Pool",
            $(#[$meta])* $vis $name, $parent,
            $crate::allocator!(@config $name $($page_size, $min_size, $max_size)?),
            $crate::allocator!(@description $($description)?));
    };

    ($(#[$meta:meta])* $vis:vis $name:ident : thread_pool of $parent:ty
        $({ page_size: $page_size:expr, min_size: $min_size:expr, max_size: $max_size:expr $(,)? })?
        $(, $description:literal)? $(,)?) => {
        $crate::allocator!(@pool ThreadPoolCore, ThreadPool, "Thread-pool",
            $(#[$meta])* $vis $name, $parent,
            $crate::allocator!(@config $name $($page_size, $min_size, $max_size)?),
            $crate::allocator!(@description $($description)?));
    };

    (@pool $core:ident, $kind:ident, $label:literal, $(#[$meta:meta])* $vis:vis $name:ident, $parent:ty,
        $config:expr, $description:expr) => {
        $(#[$meta])*
        #[doc = concat!(
            $label, " allocator `", stringify!($name), "` (pages from `", stringify!($parent),
            "`), declared with `tagalloc::allocator!`."
        )]
        #[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
        $vis struct $name;

        const _: () = {
            static CORE: $crate::pools::$core<$parent> =
                $crate::pools::$core::new(<$parent as $crate::BlockAllocator>::INSTANCE, $config);

            fn read(registration: &'static $crate::Registration) -> $crate::AllocatorStats {
                CORE.stats(registration)
            }

            fn hold_for_fork() {
                CORE.hold_for_fork();
            }

            /// # Safety
            /// As for `release` in `tagalloc::registry::ForkLock`.
            unsafe fn release_after_fork() {
                // SAFETY: forwarded from the caller (the fork handlers, after `hold`).
                unsafe { CORE.release_after_fork() };
            }

            static REGISTRATION: $crate::Registration = $crate::Registration::new(
                stringify!($name),
                $description,
                $crate::AllocatorKind::$kind,
                ::core::option::Option::Some(<$parent as $crate::BlockAllocator>::registration),
                read,
            )
            .with_fork_lock($crate::registry::ForkLock {
                hold: hold_for_fork,
                release: release_after_fork,
            });

            impl $name {
                /// The pool's geometry (page size, smallest and largest block).
                pub fn config(self) -> $crate::schema::PoolConfig {
                    CORE.config()
                }

                /// Returns the pool's empty pages to its parent.
                pub fn garbage_collect(self) {
                    CORE.garbage_collect(&REGISTRATION);
                }
            }

            impl $crate::TaggedAllocator for $name {
                fn registry_entry(&self) -> &'static $crate::Registration {
                    &REGISTRATION
                }
                fn garbage_collect(&self) {
                    CORE.garbage_collect(&REGISTRATION);
                }
            }

            // SAFETY: blocks come from the pool schema, which hands out valid, aligned,
            // unaliased slots of its class size and reports that size.
            unsafe impl $crate::BlockAllocator for $name {
                const INSTANCE: Self = $name;
                #[inline]
                fn registration() -> &'static $crate::Registration {
                    &REGISTRATION
                }
                #[inline]
                fn allocate_block(
                    self,
                    layout: ::core::alloc::Layout,
                ) -> ::core::option::Option<$crate::schema::Allocation> {
                    CORE.allocate(&REGISTRATION, layout, false)
                }
                #[inline]
                fn allocate_block_zeroed(
                    self,
                    layout: ::core::alloc::Layout,
                ) -> ::core::option::Option<$crate::schema::Allocation> {
                    CORE.allocate(&REGISTRATION, layout, true)
                }
                #[inline]
                unsafe fn deallocate_block(
                    self,
                    ptr: ::core::ptr::NonNull<u8>,
                    layout: ::core::alloc::Layout,
                ) -> usize {
                    // SAFETY: forwarded from the caller.
                    unsafe { CORE.deallocate(&REGISTRATION, ptr, layout) }
                }
                #[inline]
                unsafe fn reallocate_block(
                    self,
                    ptr: ::core::ptr::NonNull<u8>,
                    layout: ::core::alloc::Layout,
                    new_size: usize,
                ) -> ::core::option::Option<($crate::schema::Allocation, usize)> {
                    // SAFETY: forwarded from the caller.
                    unsafe { CORE.reallocate(&REGISTRATION, ptr, layout, new_size) }
                }
                #[inline]
                unsafe fn granted_size(
                    self,
                    _ptr: ::core::ptr::NonNull<u8>,
                    layout: ::core::alloc::Layout,
                ) -> usize {
                    // A pool's block is its layout's class, whatever the address.
                    CORE.config().block_size(layout).unwrap_or(0)
                }
            }
        };
        $crate::__handle_common!($name);
    };

    ($(#[$meta:meta])* $vis:vis $name:ident : child of $parent:ty
        { requested_bytes: $requested:expr $(,)? }
        $(, $description:literal)? $(,)?) => {
        $crate::allocator!(@child $(#[$meta])* $vis $name, $parent, $requested,
            $crate::allocator!(@description $($description)?));
    };

    ($(#[$meta:meta])* $vis:vis $name:ident : child of $parent:ty $(, $description:literal)? $(,)?) => {
        $crate::allocator!(@child $(#[$meta])* $vis $name, $parent, true,
            $crate::allocator!(@description $($description)?));
    };

    (@child $(#[$meta:meta])* $vis:vis $name:ident, $parent:ty, $requested:expr, $description:expr) => {
        $(#[$meta])*
        #[doc = concat!(
            "Child allocator `", stringify!($name), "` (parent `", stringify!($parent), "`), declared with `tagalloc::allocator!`."
        )]
        #[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
        $vis struct $name;

        const _: () = {
            static OPS: $crate::child::ChildOps = $crate::child::ChildOps::of::<$name>();

            static REGISTRATION: $crate::Registration = $crate::Registration::new(
                stringify!($name),
                $description,
                $crate::AllocatorKind::Child,
                ::core::option::Option::Some(<$parent as $crate::BlockAllocator>::registration),
                $crate::Registration::read_counters,
            )
            .with_requested_bytes($requested)
            .with_child_ops(&OPS);

            impl $name {
                #[inline(always)]
                fn __tagalloc_child() -> $crate::child::Child<$parent, $name, { $requested }> {
                    $crate::child::Child::new()
                }

                /// Enters this allocator's scoped tag on the calling thread: until the guard
                /// drops, the thread's global allocations (std containers included) are this
                /// allocator's, as if made through the handle (see `tagalloc::scope`).
                #[inline]
                pub fn enter(self) -> $crate::TagGuard {
                    $crate::scope::enter::<$name>()
                }

                /// Runs `f` with this allocator's scoped tag entered (see
                /// [`enter`](Self::enter)).
                #[inline]
                pub fn scope<R>(self, f: impl ::core::ops::FnOnce() -> R) -> R {
                    let _tag = self.enter();
                    f()
                }

                /// `f`, to run with this allocator's scoped tag entered wherever it runs:
                /// `std::thread::spawn(Renderer.bind(move || work()))`.
                #[inline]
                pub fn bind<F, R>(
                    self,
                    f: F,
                ) -> impl ::core::ops::FnOnce() -> R + ::core::marker::Send + 'static
                where
                    F: ::core::ops::FnOnce() -> R + ::core::marker::Send + 'static,
                    R: 'static,
                {
                    move || self.scope(f)
                }

                /// `future`, polled with this allocator's scoped tag entered at each poll
                /// (never across an `.await`), so it keeps its tag on whatever thread
                /// polls it.
                #[inline]
                pub fn instrument<F: ::core::future::Future>(
                    self,
                    future: F,
                ) -> $crate::scope::Instrumented<F> {
                    $crate::scope::Instrumented::new::<$name>(future)
                }
            }

            impl $crate::TaggedAllocator for $name {
                fn registry_entry(&self) -> &'static $crate::Registration {
                    &REGISTRATION
                }
                /// A child holds nothing beyond its live blocks: nothing to give back.
                fn garbage_collect(&self) {}
            }

            // SAFETY: every block comes from the parent, a `BlockAllocator`, unchanged; the
            // granted sizes are the parent's.
            unsafe impl $crate::BlockAllocator for $name {
                const INSTANCE: Self = $name;
                // A child passes its blocks on unchanged: they are the thread caches' if
                // its parent's are.
                const THREAD_CACHE_LANES: bool =
                    <$parent as $crate::BlockAllocator>::THREAD_CACHE_LANES;
                #[inline(always)]
                fn registration() -> &'static $crate::Registration {
                    &REGISTRATION
                }
                #[inline(always)]
                fn allocate_block(
                    self,
                    layout: ::core::alloc::Layout,
                ) -> ::core::option::Option<$crate::schema::Allocation> {
                    Self::__tagalloc_child().allocate(layout)
                }
                #[inline]
                fn allocate_block_zeroed(
                    self,
                    layout: ::core::alloc::Layout,
                ) -> ::core::option::Option<$crate::schema::Allocation> {
                    Self::__tagalloc_child().allocate_zeroed(layout)
                }
                #[inline(always)]
                unsafe fn deallocate_block(
                    self,
                    ptr: ::core::ptr::NonNull<u8>,
                    layout: ::core::alloc::Layout,
                ) -> usize {
                    // SAFETY: forwarded from the caller.
                    unsafe { Self::__tagalloc_child().deallocate(ptr, layout) }
                }
                #[inline]
                unsafe fn reallocate_block(
                    self,
                    ptr: ::core::ptr::NonNull<u8>,
                    layout: ::core::alloc::Layout,
                    new_size: usize,
                ) -> ::core::option::Option<($crate::schema::Allocation, usize)> {
                    // SAFETY: forwarded from the caller.
                    unsafe { Self::__tagalloc_child().reallocate(ptr, layout, new_size) }
                }
                #[inline]
                unsafe fn granted_size(
                    self,
                    ptr: ::core::ptr::NonNull<u8>,
                    layout: ::core::alloc::Layout,
                ) -> usize {
                    // SAFETY: forwarded from the caller; a child's blocks are its parent's.
                    unsafe {
                        <$parent as $crate::BlockAllocator>::INSTANCE.granted_size(ptr, layout)
                    }
                }
                #[inline]
                fn allocate_block_tagged(
                    self,
                    layout: ::core::alloc::Layout,
                    tag: $crate::schema::hpha::Tag,
                    zeroed: bool,
                ) -> ::core::option::Option<$crate::schema::Allocation> {
                    Self::__tagalloc_child().allocate_tagged(layout, tag, zeroed)
                }
                #[inline]
                unsafe fn deallocate_block_tagged(
                    self,
                    ptr: ::core::ptr::NonNull<u8>,
                    layout: ::core::alloc::Layout,
                    tag: $crate::schema::hpha::Tag,
                ) -> usize {
                    // SAFETY: forwarded from the caller.
                    unsafe { Self::__tagalloc_child().deallocate_tagged(ptr, layout, tag) }
                }
                #[inline]
                unsafe fn reallocate_block_tagged(
                    self,
                    ptr: ::core::ptr::NonNull<u8>,
                    layout: ::core::alloc::Layout,
                    new_size: usize,
                    tag: $crate::schema::hpha::Tag,
                ) -> ::core::option::Option<($crate::schema::Allocation, usize)> {
                    // SAFETY: forwarded from the caller.
                    unsafe {
                        Self::__tagalloc_child().reallocate_tagged(ptr, layout, new_size, tag)
                    }
                }
            }

            // SAFETY: blocks come from a `BlockAllocator` (valid, aligned, unaliased, or
            // null on failure); nothing here unwinds.
            unsafe impl ::core::alloc::GlobalAlloc for $name {
                #[inline]
                unsafe fn alloc(&self, layout: ::core::alloc::Layout) -> *mut u8 {
                    Self::__tagalloc_child()
                        .allocate(layout)
                        .map_or(::core::ptr::null_mut(), |b| b.ptr.as_ptr())
                }
                #[inline]
                unsafe fn alloc_zeroed(&self, layout: ::core::alloc::Layout) -> *mut u8 {
                    Self::__tagalloc_child()
                        .allocate_zeroed(layout)
                        .map_or(::core::ptr::null_mut(), |b| b.ptr.as_ptr())
                }
                #[inline]
                unsafe fn dealloc(&self, ptr: *mut u8, layout: ::core::alloc::Layout) {
                    // SAFETY: GlobalAlloc's contract: a live, non-null block with `layout`.
                    unsafe { Self::__tagalloc_child().deallocate(::core::ptr::NonNull::new_unchecked(ptr), layout) };
                }
                #[inline]
                unsafe fn realloc(
                    &self,
                    ptr: *mut u8,
                    layout: ::core::alloc::Layout,
                    new_size: usize,
                ) -> *mut u8 {
                    // SAFETY: forwarded from the caller.
                    unsafe { $crate::handle::global_realloc(*self, ptr, layout, new_size) }
                }
            }
        };
        $crate::__handle_common!($name);
    };
}

/// The parts every handle kind shares: inherent methods and the `Allocator` impls.
#[doc(hidden)]
#[macro_export]
macro_rules! __handle_common {
    ($name:ident) => {
        impl $name {
            /// This allocator's registry entry (name, parent, counters, budget).
            #[inline]
            pub fn registration() -> &'static $crate::Registration {
                <Self as $crate::BlockAllocator>::registration()
            }

            /// A snapshot of this allocator's statistics.
            pub fn stats(self) -> $crate::AllocatorStats {
                Self::registration().stats()
            }

            /// Sets (`Some(bytes)`) or removes (`None`) a budget on live granted bytes.
            pub fn set_budget(
                self,
                bytes: ::core::option::Option<usize>,
                mode: $crate::BudgetMode,
            ) {
                Self::registration().set_budget(bytes, mode);
            }

            /// Sets what this allocator records from now on (see `tagalloc::records`);
            /// overrides `TAGALLOC_RECORDS`.
            pub fn set_records(self, mode: $crate::RecordMode) {
                Self::registration().set_records(mode);
            }

            /// What this allocator records (registering it first, so that a
            /// `TAGALLOC_RECORDS` entry for it applies).
            pub fn record_mode(self) -> $crate::RecordMode {
                Self::registration().register();
                Self::registration().record_mode()
            }

            /// Guards one allocation in `every` of this allocator (`None`: none): its block
            /// ends against an inaccessible page, so an overflow faults at once with a
            /// message naming this allocator (see `tagalloc::guarded`). Overrides
            /// `TAGALLOC_GUARDED`. `false`, changing nothing, for allocators that cannot
            /// guard: pools, thread pools and their children.
            pub fn set_guarded(
                self,
                every: ::core::option::Option<::core::num::NonZeroU32>,
            ) -> bool {
                Self::registration().set_guarded(every)
            }

            /// This allocator's guarded rate (one allocation in `N`), if any.
            pub fn guarded(self) -> ::core::option::Option<::core::num::NonZeroU32> {
                Self::registration().register();
                Self::registration().guarded()
            }
        }

        // SAFETY: the functions in `tagalloc::handle` implement the trait's contract on top
        // of a `BlockAllocator`; all copies of the handle share one static allocator.
        unsafe impl $crate::allocator_api2::alloc::Allocator for $name {
            #[inline]
            fn allocate(
                &self,
                layout: ::core::alloc::Layout,
            ) -> ::core::result::Result<
                ::core::ptr::NonNull<[u8]>,
                $crate::allocator_api2::alloc::AllocError,
            > {
                $crate::handle::allocate(*self, layout)
                    .ok_or($crate::allocator_api2::alloc::AllocError)
            }
            #[inline]
            fn allocate_zeroed(
                &self,
                layout: ::core::alloc::Layout,
            ) -> ::core::result::Result<
                ::core::ptr::NonNull<[u8]>,
                $crate::allocator_api2::alloc::AllocError,
            > {
                $crate::handle::allocate_zeroed(*self, layout)
                    .ok_or($crate::allocator_api2::alloc::AllocError)
            }
            #[inline]
            unsafe fn deallocate(
                &self,
                ptr: ::core::ptr::NonNull<u8>,
                layout: ::core::alloc::Layout,
            ) {
                // SAFETY: forwarded from the caller.
                unsafe { $crate::handle::deallocate(*self, ptr, layout) }
            }
            #[inline]
            unsafe fn grow(
                &self,
                ptr: ::core::ptr::NonNull<u8>,
                old: ::core::alloc::Layout,
                new: ::core::alloc::Layout,
            ) -> ::core::result::Result<
                ::core::ptr::NonNull<[u8]>,
                $crate::allocator_api2::alloc::AllocError,
            > {
                // SAFETY: forwarded from the caller.
                unsafe { $crate::handle::grow(*self, ptr, old, new, false) }
                    .ok_or($crate::allocator_api2::alloc::AllocError)
            }
            #[inline]
            unsafe fn grow_zeroed(
                &self,
                ptr: ::core::ptr::NonNull<u8>,
                old: ::core::alloc::Layout,
                new: ::core::alloc::Layout,
            ) -> ::core::result::Result<
                ::core::ptr::NonNull<[u8]>,
                $crate::allocator_api2::alloc::AllocError,
            > {
                // SAFETY: forwarded from the caller.
                unsafe { $crate::handle::grow(*self, ptr, old, new, true) }
                    .ok_or($crate::allocator_api2::alloc::AllocError)
            }
            #[inline]
            unsafe fn shrink(
                &self,
                ptr: ::core::ptr::NonNull<u8>,
                old: ::core::alloc::Layout,
                new: ::core::alloc::Layout,
            ) -> ::core::result::Result<
                ::core::ptr::NonNull<[u8]>,
                $crate::allocator_api2::alloc::AllocError,
            > {
                // SAFETY: forwarded from the caller.
                unsafe { $crate::handle::shrink(*self, ptr, old, new) }
                    .ok_or($crate::allocator_api2::alloc::AllocError)
            }
        }

        // SAFETY: pages are blocks of this allocator (valid, aligned, unaliased); a handle
        // never calls back into a pool that uses it as its parent.
        unsafe impl $crate::schema::PageParent for $name {
            #[inline]
            fn allocate_page(
                &self,
                layout: ::core::alloc::Layout,
            ) -> ::core::option::Option<::core::ptr::NonNull<u8>> {
                <Self as $crate::BlockAllocator>::allocate_block(*self, layout).map(|b| b.ptr)
            }
            #[inline]
            unsafe fn free_page(
                &self,
                ptr: ::core::ptr::NonNull<u8>,
                layout: ::core::alloc::Layout,
            ) {
                // SAFETY: forwarded from the caller.
                unsafe { <Self as $crate::BlockAllocator>::deallocate_block(*self, ptr, layout) };
            }
            #[inline]
            unsafe fn granted_size(
                &self,
                ptr: ::core::ptr::NonNull<u8>,
                layout: ::core::alloc::Layout,
            ) -> usize {
                // SAFETY: forwarded from the caller.
                unsafe { <Self as $crate::BlockAllocator>::granted_size(*self, ptr, layout) }
            }
        }

        $crate::__nightly_allocator!($name);
    };
}

/// With feature `nightly`: `core::alloc::Allocator` for a handle.
#[cfg(feature = "nightly")]
#[doc(hidden)]
#[macro_export]
#[allow_internal_unstable(allocator_api)]
macro_rules! __nightly_allocator {
    ($name:ident) => {
        // SAFETY: as for the allocator_api2 impl: the same functions, the same contract.
        unsafe impl ::core::alloc::Allocator for $name {
            #[inline]
            fn allocate(
                &self,
                layout: ::core::alloc::Layout,
            ) -> ::core::result::Result<::core::ptr::NonNull<[u8]>, ::core::alloc::AllocError> {
                $crate::handle::allocate(*self, layout).ok_or(::core::alloc::AllocError)
            }
            #[inline]
            fn allocate_zeroed(
                &self,
                layout: ::core::alloc::Layout,
            ) -> ::core::result::Result<::core::ptr::NonNull<[u8]>, ::core::alloc::AllocError> {
                $crate::handle::allocate_zeroed(*self, layout).ok_or(::core::alloc::AllocError)
            }
            #[inline]
            unsafe fn deallocate(
                &self,
                ptr: ::core::ptr::NonNull<u8>,
                layout: ::core::alloc::Layout,
            ) {
                // SAFETY: forwarded from the caller.
                unsafe { $crate::handle::deallocate(*self, ptr, layout) }
            }
            #[inline]
            unsafe fn grow(
                &self,
                ptr: ::core::ptr::NonNull<u8>,
                old: ::core::alloc::Layout,
                new: ::core::alloc::Layout,
            ) -> ::core::result::Result<::core::ptr::NonNull<[u8]>, ::core::alloc::AllocError> {
                // SAFETY: forwarded from the caller.
                unsafe { $crate::handle::grow(*self, ptr, old, new, false) }
                    .ok_or(::core::alloc::AllocError)
            }
            #[inline]
            unsafe fn grow_zeroed(
                &self,
                ptr: ::core::ptr::NonNull<u8>,
                old: ::core::alloc::Layout,
                new: ::core::alloc::Layout,
            ) -> ::core::result::Result<::core::ptr::NonNull<[u8]>, ::core::alloc::AllocError> {
                // SAFETY: forwarded from the caller.
                unsafe { $crate::handle::grow(*self, ptr, old, new, true) }
                    .ok_or(::core::alloc::AllocError)
            }
            #[inline]
            unsafe fn shrink(
                &self,
                ptr: ::core::ptr::NonNull<u8>,
                old: ::core::alloc::Layout,
                new: ::core::alloc::Layout,
            ) -> ::core::result::Result<::core::ptr::NonNull<[u8]>, ::core::alloc::AllocError> {
                // SAFETY: forwarded from the caller.
                unsafe { $crate::handle::shrink(*self, ptr, old, new) }
                    .ok_or(::core::alloc::AllocError)
            }
        }
    };
}

/// Without feature `nightly`: nothing.
#[cfg(not(feature = "nightly"))]
#[doc(hidden)]
#[macro_export]
macro_rules! __nightly_allocator {
    ($name:ident) => {};
}
