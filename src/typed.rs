//! Typed allocation in a given allocator: the Rust forms of O3DE's `AZ_CLASS_ALLOCATOR`,
//! `azcreate`/`azdestroy` and `azmalloc`/`azfree`.
//!
//! - [`ClassAllocator`] binds a type to its allocator (`AZ_CLASS_ALLOCATOR(Class, Alloc)`):
//!   `T::new_boxed(value)` boxes it there, `T::create`/`T::destroy` manage a raw pointer.
//! - [`create`]/[`destroy`] (`azcreate`/`azdestroy`) put one value in any allocator.
//! - [`malloc`]/[`free`] (`azmalloc`/`azfree`) are raw bytes with an alignment.
//!
//! O3DE's `AZStdAlloc<Allocator>` (a stateless container adapter) needs no counterpart:
//! every handle already is one.
//!
//! Allocation failures are returned as `Err(AllocError)` or `None`, never as a panic, so
//! the caller decides (containers call `handle_alloc_error`). The one exception is
//! [`ClassAllocator::new_boxed`], which is `Box::new_in` and so ends in
//! `handle_alloc_error` like `Box::new`; [`ClassAllocator::try_new_boxed`] returns the
//! error instead.

use allocator_api2::alloc::{AllocError, Allocator};
use allocator_api2::boxed::Box;
use core::alloc::Layout;
use core::ptr::NonNull;

/// Binds a type to the allocator its values live in (`AZ_CLASS_ALLOCATOR`).
///
/// ```
/// use tagalloc::{ClassAllocator, SystemAllocator};
///
/// tagalloc::allocator!(PhysicsAllocator: child of SystemAllocator, "Physics");
///
/// struct RigidBody { mass: f32, velocity: [f32; 3] }
/// impl ClassAllocator for RigidBody { type Allocator = PhysicsAllocator; }
///
/// let body = RigidBody::new_boxed(RigidBody { mass: 2.0, velocity: [0.0; 3] });
/// assert_eq!(PhysicsAllocator.stats().live_blocks, 1);
/// let raw = RigidBody::create(RigidBody { mass: 1.0, velocity: [1.0; 3] }).unwrap();
/// assert_eq!(PhysicsAllocator.stats().live_blocks, 2);
/// // SAFETY: `raw` came from `create` and is destroyed once.
/// unsafe { RigidBody::destroy(raw) };
/// drop(body);
/// assert_eq!(PhysicsAllocator.stats().live_blocks, 0);
/// ```
pub trait ClassAllocator: Sized {
    /// The allocator values of this type are created in.
    type Allocator: Allocator + Copy + Default;

    /// Boxes `value` in the type's allocator. Out of memory (or a budget in
    /// [`BudgetMode::Fail`](crate::BudgetMode::Fail) refusing it) ends in
    /// `handle_alloc_error`, as for `Box::new`; see [`try_new_boxed`](Self::try_new_boxed).
    fn new_boxed(value: Self) -> Box<Self, Self::Allocator> {
        Box::new_in(value, Self::Allocator::default())
    }

    /// Boxes `value` in the type's allocator, or gives the allocation failure back.
    fn try_new_boxed(value: Self) -> Result<Box<Self, Self::Allocator>, AllocError> {
        Box::try_new_in(value, Self::Allocator::default())
    }

    /// Moves `value` into a new block of the type's allocator (`aznew` / `azcreate`).
    fn create(value: Self) -> Result<NonNull<Self>, AllocError> {
        create(Self::Allocator::default(), value)
    }

    /// Drops the value and frees its block (`delete` / `azdestroy`).
    ///
    /// # Safety
    /// `ptr` must come from [`ClassAllocator::create`] of this type and not be destroyed
    /// yet; nothing may use it afterwards.
    unsafe fn destroy(ptr: NonNull<Self>) {
        // SAFETY: forwarded from the caller.
        unsafe { destroy(Self::Allocator::default(), ptr) }
    }
}

/// Moves `value` into a new block of `alloc` (`azcreate(Class, (args), Allocator)`).
///
/// ```
/// use tagalloc::SystemAllocator;
/// tagalloc::allocator!(AudioAllocator: child of SystemAllocator, "Audio");
///
/// let voice = tagalloc::typed::create(AudioAllocator, [0.5f32; 64]).unwrap();
/// assert_eq!(AudioAllocator.stats().live_requested_bytes, Some(256));
/// // SAFETY: created above with the same allocator, destroyed once.
/// unsafe { tagalloc::typed::destroy(AudioAllocator, voice) };
/// ```
pub fn create<T, A: Allocator>(alloc: A, value: T) -> Result<NonNull<T>, AllocError> {
    let ptr = alloc.allocate(Layout::new::<T>())?.cast::<T>();
    // SAFETY: the block is fresh, aligned for `T` and large enough.
    unsafe { ptr.as_ptr().write(value) };
    Ok(ptr)
}

/// Drops the value at `ptr` and frees its block (`azdestroy(ptr, Allocator)`).
///
/// # Safety
/// `ptr` must come from [`create`] with an allocator that behaves like `alloc` (for a
/// handle: the same handle type), and not be destroyed yet.
pub unsafe fn destroy<T, A: Allocator>(alloc: A, ptr: NonNull<T>) {
    // SAFETY: the caller promises a live `T` created in `alloc` with `Layout::new::<T>()`.
    unsafe {
        ptr.as_ptr().drop_in_place();
        alloc.deallocate(ptr.cast(), Layout::new::<T>());
    }
}

/// Allocates `size` raw bytes aligned to `align` in `alloc` (`azmalloc(size, align,
/// Allocator)`); `None` if out of memory or `align` is not a power of two. A zero size
/// returns a dangling aligned pointer.
///
/// ```
/// use tagalloc::SystemAllocator;
/// tagalloc::allocator!(ScratchAllocator: child of SystemAllocator);
///
/// let p = tagalloc::typed::malloc(ScratchAllocator, 1000, 64).unwrap();
/// assert_eq!(p.as_ptr() as usize % 64, 0);
/// // SAFETY: allocated above with the same size and alignment, freed once.
/// unsafe { tagalloc::typed::free(ScratchAllocator, p, 1000, 64) };
/// assert_eq!(ScratchAllocator.stats().live_granted_bytes, 0);
/// ```
pub fn malloc<A: Allocator>(alloc: A, size: usize, align: usize) -> Option<NonNull<u8>> {
    let layout = Layout::from_size_align(size, align).ok()?;
    alloc.allocate(layout).ok().map(NonNull::cast)
}

/// Frees bytes from [`malloc`] (`azfree(ptr, Allocator, size, align)`).
///
/// # Safety
/// `ptr` must come from [`malloc`] with an allocator that behaves like `alloc` and the
/// same `size` and `align`, and not be freed yet.
pub unsafe fn free<A: Allocator>(alloc: A, ptr: NonNull<u8>, size: usize, align: usize) {
    // SAFETY: `malloc` succeeded with this size and alignment, so the layout is valid and
    // describes the block.
    unsafe {
        alloc.deallocate(ptr, Layout::from_size_align_unchecked(size, align));
    }
}
