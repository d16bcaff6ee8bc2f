//! Per-size-class summaries that let a TLSF search skip classes where nothing fits.
//!
//! The O(1) paths of the TLSF search only take ranges large enough to hold a request with any
//! padding. When they find nothing, the exact search must look at every range that is at
//! least as large as the request but may miss its alignment, and prove that none fits
//! before failing. Without help that is a walk over those ranges: a block holding 50,000
//! holes of 509 units, each starting 2 units past a multiple of 512, walks all of them to
//! refuse 256 units aligned to 256.
//!
//! A summary of size class `c` is a pair `(k, fit)`: no range in class `c` can hold more than
//! `fit` units at an offset aligned to `2^k`. It stays true as ranges come and go:
//!
//! - a range that joins the class, or grows in it, raises `fit` to cover it ([`FitSummaries::note`]:
//!   one bitmap test on that path, a few instructions more for a summarised class);
//! - a range that leaves the class, or shrinks in it, can only lower the true maximum, so the
//!   bound holds (it may become loose);
//! - taking an allocation from a range never creates room that was not there before.
//!
//! A request for `size` at alignment `2^j` with `j >= k` cannot fit in class `c` when
//! `fit < size` (a larger alignment never fits more), so the search skips the class. A class
//! with no summary, one for a larger alignment than the request's, or a loose one is walked,
//! and the walk leaves an exact summary for the request's alignment.
//!
//! So a failing allocation costs O(size classes) once the classes it looks at are summarised
//! for its alignment (or a smaller one); the documented worst case is the walk over the
//! candidate ranges of a class whose summary is missing or loose, which the walk repairs.

use super::tlsf::LISTS;

/// The summaries of one block's size classes.
#[derive(Clone, Debug)]
pub(crate) struct FitSummaries {
    /// Made on the first summary: a block whose allocations never need the exact search pays
    /// one test of this pointer where a range joins a class.
    table: Option<Box<Table>>,
}

#[derive(Clone, Debug)]
struct Table {
    /// Per octave, bit `sl` set when class `fl * 32 + sl` has a summary.
    bits: [u32; 64],
    /// log2 of the alignment each summary is for.
    align_log2: [u8; LISTS],
    /// An upper bound on what any range of the class holds at that alignment.
    fit: [u64; LISTS],
}

/// The most units a free range `[offset, offset + size)` holds at an offset aligned to
/// `2^align_log2` (0 when no aligned offset lies inside it).
#[inline]
pub(crate) fn fit_at(offset: u64, size: u64, align_log2: u32) -> u64 {
    let mask = (1u64 << align_log2) - 1;
    match offset.checked_add(mask) {
        Some(v) => (offset + size).saturating_sub(v & !mask),
        None => 0,
    }
}

impl FitSummaries {
    pub(crate) const fn new() -> Self {
        FitSummaries { table: None }
    }

    /// The table if class `li` has a summary in it.
    #[inline(always)]
    fn summary(&self, li: usize) -> Option<&Table> {
        self.table
            .as_deref()
            .filter(|t| t.bits[(li / 32) & 63] & (1 << (li % 32)) != 0)
    }

    /// A free range `[offset, offset + size)` joined class `li` or grew in it.
    #[inline(always)]
    pub(crate) fn note(&mut self, li: usize, offset: u64, size: u64) {
        if let Some(t) = &mut self.table {
            t.raise(li, offset, size);
        }
    }

    /// True when class `li` certainly holds no range that fits `size` at alignment
    /// `2^align_log2`.
    #[inline]
    pub(crate) fn rules_out(&self, li: usize, size: u64, align_log2: u32) -> bool {
        let Some(t) = self.summary(li) else {
            return false;
        };
        let li = li % LISTS;
        align_log2 >= u32::from(t.align_log2[li]) && t.fit[li] < size
    }

    /// Records that no range of class `li` holds more than `fit` at alignment `2^align_log2`
    /// (the result of a walk over the whole class).
    pub(crate) fn set(&mut self, li: usize, align_log2: u32, fit: u64) {
        let t = self.table.get_or_insert_with(|| {
            Box::new(Table {
                bits: [0; 64],
                align_log2: [0; LISTS],
                fit: [0; LISTS],
            })
        });
        let li = li % LISTS;
        t.align_log2[li] = align_log2 as u8;
        t.fit[li] = fit;
        t.bits[li / 32] |= 1 << (li % 32);
    }

    /// Forgets every summary (the block was emptied). The table stays for the next ones.
    pub(crate) fn clear(&mut self) {
        if let Some(t) = &mut self.table {
            t.bits = [0; 64];
        }
    }

    /// Whether the summary of class `li`, if any, covers a free range `[offset, offset + size)`
    /// (for `validate`).
    pub(crate) fn covers(&self, li: usize, offset: u64, size: u64) -> bool {
        match self.summary(li) {
            Some(t) => {
                let li = li % LISTS;
                fit_at(offset, size, u32::from(t.align_log2[li])) <= t.fit[li]
            }
            None => true,
        }
    }
}

impl Table {
    /// Raises class `li`'s bound, if it has one, to cover `[offset, offset + size)`. Out of
    /// line: only blocks that have needed the exact search get here.
    #[cold]
    #[inline(never)]
    fn raise(&mut self, li: usize, offset: u64, size: u64) {
        let li = li % LISTS;
        if self.bits[li / 32] & (1 << (li % 32)) != 0 {
            let fit = fit_at(offset, size, u32::from(self.align_log2[li]));
            self.fit[li] = self.fit[li].max(fit);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fit_at_counts_what_an_aligned_offset_leaves() {
        assert_eq!(fit_at(2, 509, 8), 255); // [2, 511): from 256 to 511
        assert_eq!(fit_at(0, 509, 8), 509);
        assert_eq!(fit_at(1, 100, 8), 0); // no multiple of 256 inside
        assert_eq!(fit_at(u64::MAX - 10, 10, 4), 0);
        assert_eq!(fit_at(7, 9, 0), 9);
    }

    #[test]
    fn a_summary_rules_out_only_what_it_proves() {
        let mut s = FitSummaries::new();
        assert!(!s.rules_out(300, 1, 8));
        s.set(300, 8, 255);
        assert!(s.rules_out(300, 256, 8));
        assert!(s.rules_out(300, 256, 9), "a larger alignment fits no more");
        assert!(
            !s.rules_out(300, 256, 7),
            "a smaller alignment may fit more"
        );
        assert!(!s.rules_out(300, 255, 8));
        // A range that joins the class raises the bound.
        s.note(300, 512, 300);
        assert!(!s.rules_out(300, 256, 8));
        assert!(s.covers(300, 512, 300));
        s.clear();
        assert!(!s.rules_out(300, 1000, 8));
    }
}
