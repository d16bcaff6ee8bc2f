//! The allocators under test, behind one trait.

use std::alloc::Layout;
use std::mem::MaybeUninit;
use std::ptr::NonNull;

use tagalloc::virtual_block::{Alloc, Request, Strategy, VirtualBlock};

/// One allocator under test. `alloc` returns the handle, the aligned offset, and the range
/// the allocator really holds for it (start, length), which may include padding.
pub trait Contender {
    type Handle: Copy;
    fn name(&self) -> String;
    fn alloc(&mut self, size: u64, align: u64) -> Option<(Self::Handle, u64, (u64, u64))>;
    fn free(&mut self, h: Self::Handle);
    /// Whether false out-of-memory can be judged from the held ranges.
    fn exact_ranges(&self) -> bool {
        true
    }
}

pub struct Tag {
    block: VirtualBlock<()>,
    strategy: Strategy,
}

impl Tag {
    pub fn new(capacity: u64, strategy: Strategy) -> Self {
        Tag {
            block: VirtualBlock::new(capacity),
            strategy,
        }
    }
}

impl Contender for Tag {
    type Handle = Alloc;
    fn name(&self) -> String {
        format!("tagalloc {:?}", self.strategy)
    }
    #[inline]
    fn alloc(&mut self, size: u64, align: u64) -> Option<(Alloc, u64, (u64, u64))> {
        let a = self
            .block
            .allocate(&Request::new(size).align(align).strategy(self.strategy), ())
            .ok()?;
        Some((a, a.offset(), (a.offset(), size)))
    }
    #[inline]
    fn free(&mut self, h: Alloc) {
        let _ = self.block.free(h);
    }
}

pub struct OffsetAlloc(offset_allocator::Allocator);

impl OffsetAlloc {
    pub fn new(capacity: u64) -> Self {
        let cap = u32::try_from(capacity).expect("offset-allocator is 32-bit");
        OffsetAlloc(offset_allocator::Allocator::with_max_allocs(cap, 1 << 20))
    }
}

impl Contender for OffsetAlloc {
    type Handle = offset_allocator::Allocation;
    fn name(&self) -> String {
        "offset-allocator 0.2".into()
    }
    #[inline]
    fn alloc(&mut self, size: u64, align: u64) -> Option<(Self::Handle, u64, (u64, u64))> {
        let padded = u32::try_from(size + align - 1).ok()?;
        let a = self.0.allocate(padded)?;
        let raw = u64::from(a.offset);
        Some((a, raw.next_multiple_of(align), (raw, u64::from(padded))))
    }
    #[inline]
    fn free(&mut self, h: Self::Handle) {
        self.0.free(h);
    }
}

type RlsfTlsf = rlsf::Tlsf<'static, u32, u32, 28, 32>;

pub struct Rlsf {
    tlsf: RlsfTlsf,
    base: usize,
    /// The managed memory; `tlsf` points into it, so it is declared (and dropped) after it.
    _pool: Box<[MaybeUninit<u8>]>,
}

impl Rlsf {
    pub fn new(capacity: u64) -> Self {
        let len = usize::try_from(capacity).expect("pool fits in memory");
        // Pre-fault the pool so first-touch page faults are not timed (a zeroed allocation
        // may come from calloc, untouched: write to every page).
        let mut pool: Box<[MaybeUninit<u8>]> = vec![MaybeUninit::new(0u8); len].into_boxed_slice();
        for page in pool.chunks_mut(4096) {
            // SAFETY: `page` is a valid, non-empty slice of this pool.
            unsafe { std::ptr::write_volatile(page.as_mut_ptr(), MaybeUninit::new(0)) };
        }
        let ptr = NonNull::new(std::ptr::slice_from_raw_parts_mut(
            pool.as_mut_ptr().cast::<u8>(),
            len,
        ))
        .expect("non-null pool");
        let mut tlsf = RlsfTlsf::new();
        // SAFETY: the pool is valid for reads and writes, is not used by anything else, and
        // outlives `tlsf` (both live in this struct; `tlsf` is dropped first and rlsf does not
        // touch the memory when dropped). Moving the Box does not move its heap buffer.
        unsafe { tlsf.insert_free_block_ptr(ptr) };
        Rlsf {
            base: ptr.as_ptr().cast::<u8>() as usize,
            tlsf,
            _pool: pool,
        }
    }
}

impl Contender for Rlsf {
    type Handle = (NonNull<u8>, usize);
    fn name(&self) -> String {
        "rlsf 0.2 (in-band)".into()
    }
    #[inline]
    fn alloc(&mut self, size: u64, align: u64) -> Option<(Self::Handle, u64, (u64, u64))> {
        let layout = Layout::from_size_align(size as usize, align as usize).ok()?;
        let p = self.tlsf.allocate(layout)?;
        let off = (p.as_ptr() as usize - self.base) as u64;
        Some(((p, align as usize), off, (off, size)))
    }
    #[inline]
    fn free(&mut self, (p, align): Self::Handle) {
        // SAFETY: `p` came from `allocate` on this `tlsf` with this alignment and is freed once.
        unsafe { self.tlsf.deallocate(p, align) };
    }
    fn exact_ranges(&self) -> bool {
        false
    }
}

pub struct RangeAlloc(range_alloc::RangeAllocator<u64>);

impl RangeAlloc {
    pub fn new(capacity: u64) -> Self {
        RangeAlloc(range_alloc::RangeAllocator::new(0..capacity))
    }
}

impl Contender for RangeAlloc {
    type Handle = (u64, u64);
    fn name(&self) -> String {
        "range-alloc 0.1".into()
    }
    #[inline]
    fn alloc(&mut self, size: u64, align: u64) -> Option<(Self::Handle, u64, (u64, u64))> {
        let r = if align == 1 {
            self.0.allocate_range(size).ok()?
        } else {
            self.0.allocate_range_aligned(size, align).ok()?
        };
        Some(((r.start, r.end), r.start, (r.start, size)))
    }
    #[inline]
    fn free(&mut self, (start, end): Self::Handle) {
        self.0.free_range(start..end);
    }
}

/// The contenders' table labels, in row order (`VB_ONLY` picks rows by these indices).
pub const CONTENDERS: [&str; 6] = [
    "tagalloc Balanced",
    "tagalloc MinTime",
    "tagalloc MinMemory",
    "offset-allocator 0.2",
    "rlsf 0.2 (in-band)",
    "range-alloc 0.1",
];

/// Row of rlsf, whose false-OOM count is not defined (its headers live in the managed memory).
pub const RLSF: usize = 4;
/// Row of range-alloc, an O(n) baseline left out of the long workloads.
pub const RANGE_ALLOC: usize = 5;

/// Runs `f` on contender `k` (a row of [`CONTENDERS`]) of `capacity` units.
macro_rules! with_contender {
    ($k:expr, $capacity:expr, |$c:ident| $body:expr) => {{
        use tagalloc::virtual_block::Strategy;
        use $crate::contenders::*;
        let capacity = $capacity;
        match $k {
            0 => {
                let mut $c = Tag::new(capacity, Strategy::Balanced);
                $body
            }
            1 => {
                let mut $c = Tag::new(capacity, Strategy::MinTime);
                $body
            }
            2 => {
                let mut $c = Tag::new(capacity, Strategy::MinMemory);
                $body
            }
            3 => {
                let mut $c = OffsetAlloc::new(capacity);
                $body
            }
            4 => {
                let mut $c = Rlsf::new(capacity);
                $body
            }
            _ => {
                let mut $c = RangeAlloc::new(capacity);
                $body
            }
        }
    }};
}
pub(crate) use with_contender;

/// Checks that the contenders' names match the table labels.
pub fn check_labels() {
    assert_eq!(Tag::new(1, Strategy::Balanced).name(), CONTENDERS[0]);
    assert_eq!(Tag::new(1, Strategy::MinTime).name(), CONTENDERS[1]);
    assert_eq!(Tag::new(1, Strategy::MinMemory).name(), CONTENDERS[2]);
    assert_eq!(OffsetAlloc::new(1).name(), CONTENDERS[3]);
    assert_eq!(Rlsf::new(4096).name(), CONTENDERS[RLSF]);
    assert_eq!(RangeAlloc::new(1).name(), CONTENDERS[RANGE_ALLOC]);
}
