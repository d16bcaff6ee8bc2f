//! Statistics: VMA's basic and detailed figures, per-tag sums and a fragmentation metric.

use super::{Engine, Meta, Owner, Range, Tag, VirtualBlock};

/// The O(1) figures of a block, field for field VMA's `VmaStatistics`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Statistics {
    /// Number of blocks (1 for one virtual block; sums of several blocks add up).
    pub block_count: u32,
    /// Live allocations, pending defragmentation destinations included (they hold space).
    pub allocation_count: u32,
    /// Size of the block(s).
    pub block_bytes: u64,
    /// Units held by allocations. Alignment padding is not counted: it stays free space.
    pub allocation_bytes: u64,
}

/// Figures that need a walk over the block, field for field VMA's `VmaDetailedStatistics`.
///
/// As in VMA, the minimums are `u64::MAX` and the maximums 0 when there is nothing to measure.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DetailedStatistics {
    /// The basic figures.
    pub statistics: Statistics,
    /// Number of free ranges.
    pub unused_range_count: u32,
    /// Smallest allocation.
    pub allocation_size_min: u64,
    /// Largest allocation.
    pub allocation_size_max: u64,
    /// Smallest free range.
    pub unused_range_size_min: u64,
    /// Largest free range.
    pub unused_range_size_max: u64,
}

impl Default for DetailedStatistics {
    fn default() -> Self {
        DetailedStatistics {
            statistics: Statistics::default(),
            unused_range_count: 0,
            allocation_size_min: u64::MAX,
            allocation_size_max: 0,
            unused_range_size_min: u64::MAX,
            unused_range_size_max: 0,
        }
    }
}

impl DetailedStatistics {
    fn add_allocation(&mut self, size: u64) {
        self.statistics.allocation_count += 1;
        self.statistics.allocation_bytes += size;
        self.allocation_size_min = self.allocation_size_min.min(size);
        self.allocation_size_max = self.allocation_size_max.max(size);
    }
}

/// The live allocations of one tag (`None`: untagged), see [`VirtualBlock::tag_statistics`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TagStatistics {
    /// The tag.
    pub tag: Option<Tag>,
    /// Its live allocations.
    pub allocation_count: u32,
    /// Their requested units.
    pub allocation_bytes: u64,
}

/// `1 - sqrt(Σ fᵢ²) / Σ fᵢ` over free range sizes fᵢ: 0 when all free space is one range,
/// approaching 1 as it splinters into many small ones.
pub(crate) fn fragmentation_metric(sum: u64, squares: u128) -> f64 {
    if sum == 0 {
        return 0.0;
    }
    let metric = 1.0 - (squares as f64).sqrt() / sum as f64;
    metric.max(0.0)
}

impl<U> VirtualBlock<U> {
    /// The basic figures, O(1) (VMA's `vmaGetVirtualBlockStatistics`).
    ///
    /// ```
    /// use tagalloc::virtual_block::{Request, VirtualBlock};
    /// let mut b = VirtualBlock::<()>::new(1000);
    /// b.allocate(&Request::new(300), ())?;
    /// let s = b.statistics();
    /// assert_eq!((s.block_bytes, s.allocation_count, s.allocation_bytes), (1000, 1, 300));
    /// # Ok::<(), tagalloc::virtual_block::Error>(())
    /// ```
    pub fn statistics(&self) -> Statistics {
        Statistics {
            block_count: 1,
            allocation_count: self.live_count + self.defrag.open,
            block_bytes: self.capacity,
            allocation_bytes: self.live_bytes + self.defrag.reserved_bytes,
        }
    }

    /// Units not held by any allocation, O(1).
    pub fn free_bytes(&self) -> u64 {
        self.capacity - self.live_bytes - self.defrag.reserved_bytes
    }

    /// The size of the largest free range, exactly. TLSF: the top non-empty size list is found
    /// from the bitmaps and only that list is scanned, and, while allocations hold alignment
    /// padding not yet listed, the nodes that may hold it (those noted since, or made since,
    /// the last exact search). Linear: a walk over the entries.
    pub fn largest_free(&self) -> u64 {
        match &self.engine {
            Engine::Tlsf(t) => t.largest_free(),
            Engine::Linear(_) => self.free_ranges().map(|(_, s)| s).max().unwrap_or(0),
        }
    }

    /// How splintered the free space is: `1 - sqrt(Σ fᵢ²) / Σ fᵢ` over the free range sizes
    /// (the metric Adam Sawicki proposed for VMA). 0 means one free range (or none); values
    /// near 1 mean many small ones. O(free ranges) with TLSF, which walks its free lists
    /// (keeping Σ fᵢ² up to date cost every allocation and free about 20 instructions); a
    /// walk over every range when linear.
    ///
    /// ```
    /// use tagalloc::virtual_block::{Request, VirtualBlock};
    /// let mut b = VirtualBlock::<()>::new(400);
    /// let a: Vec<_> = (0..4).map(|_| b.allocate(&Request::new(100), ()).unwrap()).collect();
    /// b.free(a[0])?;
    /// b.free(a[2])?; // two free ranges of 100
    /// assert!((b.fragmentation() - (1.0 - 2f64.sqrt() / 2.0)).abs() < 1e-12);
    /// # Ok::<(), tagalloc::virtual_block::Error>(())
    /// ```
    pub fn fragmentation(&self) -> f64 {
        match &self.engine {
            Engine::Tlsf(t) => {
                let totals = t.free_totals();
                fragmentation_metric(totals.bytes, totals.squares)
            }
            Engine::Linear(_) => {
                let (sum, squares) = self.free_ranges().fold((0u64, 0u128), |(s, q), (_, f)| {
                    (s + f, q + u128::from(f) * u128::from(f))
                });
                fragmentation_metric(sum, squares)
            }
        }
    }

    /// The free ranges as `(offset, size)`, in offset order.
    pub(crate) fn free_ranges(&self) -> impl Iterator<Item = (u64, u64)> + '_ {
        self.ranges().filter_map(|r| match r {
            Range::Free { offset, size } => Some((offset, size)),
            _ => None,
        })
    }

    /// VMA's detailed figures, by a walk over every range (`vmaCalculateVirtualBlockStatistics`).
    pub fn detailed_statistics(&self) -> DetailedStatistics {
        let mut d = DetailedStatistics {
            statistics: Statistics {
                block_count: 1,
                block_bytes: self.capacity,
                ..Default::default()
            },
            ..Default::default()
        };
        for r in self.ranges() {
            match r {
                Range::Allocation(a) => d.add_allocation(a.size),
                Range::Reserved { size, .. } => d.add_allocation(size),
                Range::Free { size, .. } => {
                    d.unused_range_count += 1;
                    d.unused_range_size_min = d.unused_range_size_min.min(size);
                    d.unused_range_size_max = d.unused_range_size_max.max(size);
                }
            }
        }
        d
    }

    /// Live allocations summed per tag, sorted by tag (untagged first). O(n).
    ///
    /// ```
    /// use tagalloc::virtual_block::{Request, Tag, VirtualBlock};
    /// let mut b = VirtualBlock::<()>::new(1000);
    /// b.allocate(&Request::new(10).tag(Tag::new("mesh")), ())?;
    /// b.allocate(&Request::new(20).tag(Tag::new("mesh")), ())?;
    /// let t = b.tag_statistics();
    /// assert_eq!((t[0].tag, t[0].allocation_count, t[0].allocation_bytes), (Some(Tag::new("mesh")), 2, 30));
    /// # Ok::<(), tagalloc::virtual_block::Error>(())
    /// ```
    pub fn tag_statistics(&self) -> Vec<TagStatistics> {
        // Sum by tag code first (codes index the block's tag table), then sort by tag.
        let mut by_code: Vec<(u32, u64)> = vec![(0, 0); self.tags.len() + 1];
        for (_, _, owner) in self.taken() {
            if let Owner::Alloc(_, r) = owner {
                let e = &mut by_code[usize::from(Meta(r.meta).tag())];
                e.0 += 1;
                e.1 += r.size;
            }
        }
        let mut out: Vec<TagStatistics> = by_code
            .into_iter()
            .enumerate()
            .filter(|(_, (count, _))| *count > 0)
            .map(
                |(code, (allocation_count, allocation_bytes))| TagStatistics {
                    tag: self.tag_of(code as u16),
                    allocation_count,
                    allocation_bytes,
                },
            )
            .collect();
        out.sort_by_key(|t| t.tag);
        out
    }
}
