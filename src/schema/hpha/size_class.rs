//! Small-block size classes.
//!
//! Classes step by 8 bytes up to 512 B (as O3DE's HPHA does), so the common small sizes waste
//! at most 7 bytes and the lookup is a shift. From 512 B to 4 KiB there are four classes per
//! power of two (640, 768, 896, 1024, 1280, …, 4096), which caps waste at 25% while keeping
//! medium sizes off the locked large-block tree.
//!
//! A class can serve an alignment `a` when its element size is a multiple of `a`: slots are
//! carved backwards from the 64 KiB-aligned end of a page, so every slot then lands on a
//! multiple of `a`. Rounding the request up to its alignment before the lookup guarantees this
//! (proved exhaustively by a test below).

use core::alloc::Layout;

/// Largest size (after rounding up to the alignment) served by small-block pages.
pub const MAX_SMALL: usize = 4096;
/// End of the linear (8-byte step) region.
const LINEAR_MAX: usize = 512;
const LINEAR_CLASSES: usize = LINEAR_MAX / 8;
/// Number of small size classes.
pub(crate) const CLASS_COUNT: usize = LINEAR_CLASSES + 12;

/// The element size of class `c`.
#[inline]
pub(crate) const fn class_size(c: usize) -> usize {
    if c < LINEAR_CLASSES {
        (c + 1) * 8
    } else {
        let j = c - LINEAR_CLASSES;
        let shift = 7 + j / 4;
        (5 + j % 4) << shift
    }
}

/// [`class_size`] of every class, for paths that look it up with a class only known at run
/// time: one load instead of a branch and a shift. Padded to 256 entries (zero past the
/// last class) so that a class read from [`CLASS_BY_UNITS`] (a byte) needs no bounds check.
///
/// A `const` reference rather than a `static`: the table is then emitted in every crate that
/// inlines a lookup, so the optimiser knows its contents and a class known at compile time
/// (a `Box<T>`'s) folds to its size; a `static` of this crate is opaque to other crates.
pub(crate) const CLASS_SIZES: &[u32; 256] = &{
    let mut table = [0u32; 256];
    let mut class = 0;
    while class < CLASS_COUNT {
        table[class] = class_size(class) as u32;
        class += 1;
    }
    table
};

/// The smallest class whose element size is ≥ `size`; `size` must be in `0..=MAX_SMALL`.
#[inline]
pub(crate) const fn class_of(size: usize) -> usize {
    if size <= LINEAR_MAX {
        let s = if size == 0 { 1 } else { size };
        ((s + 7) >> 3) - 1
    } else {
        let m = size - 1;
        let k = (usize::BITS - 1 - m.leading_zeros()) as usize; // floor(log2(m)) >= 9
        LINEAR_CLASSES + (k - 9) * 4 + (m >> (k - 2)) - 4
    }
}

/// The class of every size in 8-byte units: `CLASS_BY_UNITS[(size + 7) / 8]` for sizes up to
/// [`MAX_SMALL`]. One byte load replaces the branch between the linear and geometric regions
/// on the allocation fast path.
///
/// A `const` reference for the reason given at [`CLASS_SIZES`]: with it, the class of a
/// compile-time layout folds to a constant in the program's own code.
pub(crate) const CLASS_BY_UNITS: &[u8; MAX_SMALL / 8 + 1] = &{
    let mut table = [0u8; MAX_SMALL / 8 + 1];
    let mut units = 0;
    while units <= MAX_SMALL / 8 {
        table[units] = class_of(units * 8) as u8;
        units += 1;
    }
    table
};
const _: () = assert!(CLASS_COUNT <= u8::MAX as usize);

/// The class of a layout on the fast paths (the thread caches, a child's lane), or `None`
/// for the general path: a non-zero size rounded up to the alignment, looked up in
/// [`CLASS_BY_UNITS`]. Every alignment whose rounded size is small takes it, so types
/// aligned to 16 (SIMD vectors, `u128`) or to a cache line get the thread caches too. With
/// the alignment known at compile time (as for `Box<T>` and `Vec<T>`) the rounding folds
/// away; with both unknown it costs one instruction more than a size compare.
///
/// Agrees with [`class_for`] wherever it returns a class (tested exhaustively). A zero
/// size (which `GlobalAlloc` callers may not pass) gets `None`: [`class_for`] gives it the
/// class its alignment needs.
#[inline(always)]
pub(crate) fn fast_class(layout: Layout) -> Option<usize> {
    fast_units(layout).map(|units| CLASS_BY_UNITS[units] as usize)
}

/// The row of the by-units tables ([`CLASS_BY_UNITS`], and the thread caches' table of
/// class keys) for a layout on the fast paths, or `None` for the general path: see
/// [`fast_class`].
#[inline(always)]
pub(crate) fn fast_units(layout: Layout) -> Option<usize> {
    // The size rounded up to the alignment, minus one: for a power-of-two alignment and a
    // non-zero size, `(size - 1) | (align - 1)`. A zero size wraps to `usize::MAX`, so one
    // compare says both "small" and "not zero".
    let last = layout.size().wrapping_sub(1) | (layout.align() - 1);
    (last < MAX_SMALL).then(|| (last >> 3) + 1)
}

/// The granted size of a class from [`fast_class`]: one load, no bounds check.
#[inline(always)]
pub(crate) fn fast_class_size(class: usize) -> usize {
    CLASS_SIZES[class as u8 as usize] as usize
}

/// The class serving a request of `size` bytes at `align`, or `None` for the large heap.
#[inline(always)]
pub(crate) const fn class_for(size: usize, align: usize) -> Option<usize> {
    // The common case first: classes step by 8, so at alignments up to 8 the class is the
    // size in 8-byte units (a zero size takes the smallest class).
    if size <= LINEAR_MAX && align <= 8 {
        return Some(size.saturating_sub(1) >> 3);
    }
    class_for_any(size, align)
}

/// [`class_for`] for any size and alignment.
#[inline]
const fn class_for_any(size: usize, align: usize) -> Option<usize> {
    if size > MAX_SMALL || align > MAX_SMALL {
        return None;
    }
    let rounded = (if size == 0 { 1 } else { size } + align - 1) & !(align - 1);
    if rounded > MAX_SMALL {
        return None;
    }
    Some(class_of(rounded))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn classes_are_increasing_and_cover_every_size() {
        for c in 1..CLASS_COUNT {
            assert!(class_size(c) > class_size(c - 1));
        }
        assert_eq!(class_size(CLASS_COUNT - 1), MAX_SMALL);
        for size in 0..=MAX_SMALL {
            let c = class_of(size);
            assert!(class_size(c) >= size.max(1), "size {size}");
            if c > 0 {
                assert!(
                    class_size(c - 1) < size,
                    "size {size} not in its smallest class"
                );
            }
        }
    }

    #[test]
    fn the_unit_table_agrees_with_the_computed_classes() {
        for size in 0..=MAX_SMALL {
            assert_eq!(
                CLASS_BY_UNITS[size.div_ceil(8)] as usize,
                class_of(size),
                "{size}"
            );
        }
    }

    #[test]
    fn every_class_element_is_a_multiple_of_the_alignment_it_serves() {
        let mut align = 1;
        while align <= MAX_SMALL {
            for size in 0..=MAX_SMALL {
                if let Some(c) = class_for(size, align) {
                    assert_eq!(class_size(c) % align, 0, "size {size} align {align}");
                    assert!(class_size(c) >= size);
                }
            }
            align *= 2;
        }
    }

    #[test]
    fn the_fast_class_agrees_with_class_for() {
        let mut align = 1;
        while align <= 4 * MAX_SMALL {
            for size in 0..=2 * MAX_SMALL {
                let Ok(layout) = Layout::from_size_align(size, align) else {
                    continue;
                };
                match fast_class(layout) {
                    Some(c) => assert_eq!(Some(c), class_for(size, align), "{layout:?}"),
                    None => assert!(
                        size == 0 || class_for(size, align).is_none(),
                        "{layout:?} is small but missed the fast class"
                    ),
                }
            }
            align *= 2;
        }
    }

    #[test]
    fn any_size_between_request_and_grant_maps_to_the_same_class() {
        // The allocator contract lets a free name any size in [requested, granted].
        for align in [1, 8, 16, 64, 512, 4096] {
            for size in (0..=MAX_SMALL).step_by(7) {
                if let Some(c) = class_for(size, align) {
                    for freed in [size, (size + class_size(c)) / 2, class_size(c)] {
                        assert_eq!(class_for(freed, align), Some(c));
                    }
                }
            }
        }
    }
}
