//! Reports: where the memory is, as a table, a tree, or JSON.
//!
//! Every report starts from a [`Snapshot`]: the registry is walked (lock-free) and each
//! allocator's figures are copied into plain structs *before* anything is formatted, so
//! formatting may allocate freely (reports are not on the allocation path), even when the
//! allocators being reported are the global allocator.
//!
//! # What the columns mean
//!
//! - **Used**: live granted bytes: blocks this allocator has handed out and not yet got
//!   back, at their real size (size class or block size). A child's blocks are blocks of
//!   its parent too, so a parent's Used includes its children's. For the OS layer, Used is
//!   the bytes it has mapped (all handed to the heap).
//! - **Reserved**: bytes held from the parent or the OS: Used plus what the allocator keeps
//!   for reuse (free heap pages, free pool slots). A child holds nothing more than its
//!   blocks, so its Reserved equals its Used.
//! - **Consumed**: the bytes this allocator alone accounts for, each byte counted once in
//!   the whole table: its Reserved minus its direct children's Reserved (a child's memory
//!   is consumed by the child, not again by its parent). Summed over all rows it gives the
//!   process's footprint.
//!
//! The **Totals** row counts every byte once: Used is the sum of each allocator's own Used
//! (its Used minus what its children hold: the bytes the program really has in blocks),
//! Reserved is the sum of the root allocators' Reserved (what the process holds from the
//! OS), and Consumed the sum of the column, equal to the Reserved total when the snapshot
//! was taken while no other thread was allocating.
//!
//! Figures are read one allocator after another without stopping other threads, so under
//! load they are a blend of nearby instants; differences that would go negative are
//! clamped at zero.

mod csv;
mod json;
mod tree;

use crate::registry::{self, AllocatorKind, Registration};
use crate::stats::AllocatorStats;
use std::io;

/// One allocator in a [`Snapshot`].
#[derive(Clone, Debug)]
pub struct AllocatorSnapshot {
    /// Registration index (0 = OS layer, 1 = SystemAllocator, then in order of first use).
    pub index: usize,
    /// Name (for declared allocators, the handle type's name).
    pub name: &'static str,
    /// Description given at declaration.
    pub description: &'static str,
    /// Kind of allocator.
    pub kind: AllocatorKind,
    /// Position of the parent in [`Snapshot::allocators`], if any.
    pub parent: Option<usize>,
    /// Name of the parent, if any.
    pub parent_name: Option<&'static str>,
    /// The allocator's own figures.
    pub stats: AllocatorStats,
    /// Byte budget, if one is set.
    pub budget: Option<usize>,
    /// Reserved bytes not held by a direct child: see the [module docs](self).
    pub consumed_bytes: usize,
    /// Used bytes not handed to a direct child: the blocks this allocator serves to the
    /// program itself.
    pub own_used_bytes: usize,
    /// Depth in the tree (0 for a root).
    pub depth: usize,
}

/// The process-wide figures, each byte counted once (see the [module docs](self)).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Totals {
    /// Bytes in live blocks held by the program.
    pub used_bytes: usize,
    /// Bytes held from the OS by the root allocators.
    pub reserved_bytes: usize,
    /// Sum of the Consumed column.
    pub consumed_bytes: usize,
}

/// Every registered allocator's figures at one moment, in registration order.
#[derive(Clone, Debug)]
pub struct Snapshot {
    /// The allocators, sorted by registration index (parents before their children).
    pub allocators: Vec<AllocatorSnapshot>,
}

impl Snapshot {
    /// Reads every registered allocator.
    pub fn take() -> Self {
        // Copy the entries out first; the list is lock-free, so collecting (which
        // allocates) while walking it cannot deadlock with an allocator.
        let mut entries: Vec<&'static Registration> = registry::allocators()
            .filter(|r| r.index().is_some())
            .collect();
        entries.sort_by_key(|r| r.index());
        let mut allocators: Vec<AllocatorSnapshot> = entries
            .iter()
            .map(|r| AllocatorSnapshot {
                index: r.index().unwrap_or(usize::MAX),
                name: r.name(),
                description: r.description(),
                kind: r.kind(),
                parent: None,
                parent_name: r.parent().map(Registration::name),
                stats: r.stats(),
                budget: r.budget().limit(),
                consumed_bytes: 0,
                own_used_bytes: 0,
                depth: 0,
            })
            .collect();
        for (i, entry) in entries.iter().enumerate() {
            if let Some(parent) = entry.parent() {
                let parent_pos = entries.iter().position(|e| core::ptr::eq(*e, parent));
                allocators[i].parent = parent_pos;
            }
        }
        // Parents come before children (lower index), so depth is known when needed.
        for i in 0..allocators.len() {
            allocators[i].depth = allocators[i].parent.map_or(0, |p| allocators[p].depth + 1);
        }
        let mut children_reserved = vec![0usize; allocators.len()];
        for a in &allocators {
            if let Some(p) = a.parent {
                children_reserved[p] += a.stats.reserved_bytes;
            }
        }
        for (a, held_by_children) in allocators.iter_mut().zip(children_reserved) {
            a.consumed_bytes = a.stats.reserved_bytes.saturating_sub(held_by_children);
            a.own_used_bytes = a.stats.live_granted_bytes.saturating_sub(held_by_children);
        }
        Self { allocators }
    }

    /// The Totals row: each byte counted once.
    pub fn totals(&self) -> Totals {
        Totals {
            used_bytes: self.allocators.iter().map(|a| a.own_used_bytes).sum(),
            reserved_bytes: self
                .allocators
                .iter()
                .filter(|a| a.parent.is_none())
                .map(|a| a.stats.reserved_bytes)
                .sum(),
            consumed_bytes: self.allocators.iter().map(|a| a.consumed_bytes).sum(),
        }
    }

    /// The direct children of the allocator at position `i`.
    pub fn children(&self, i: usize) -> impl Iterator<Item = usize> + '_ {
        self.allocators
            .iter()
            .enumerate()
            .filter(move |(_, a)| a.parent == Some(i))
            .map(|(j, _)| j)
    }

    /// The allocator with this name, if registered.
    pub fn find(&self, name: &str) -> Option<&AllocatorSnapshot> {
        self.allocators.iter().find(|a| a.name == name)
    }

    /// Writes O3DE's `sys_DumpAllocators` table; see [`dump_allocators`].
    pub fn write_csv(&self, out: &mut dyn io::Write) -> io::Result<()> {
        csv::write(self, out)
    }

    /// Writes the allocator tree: indented by parent, human units, share of the parent.
    pub fn write_tree(&self, out: &mut dyn io::Write) -> io::Result<()> {
        tree::write(self, out)
    }

    /// The snapshot as a JSON document (see [`Snapshot::to_json`] for the schema).
    pub fn write_json(&self, out: &mut dyn io::Write) -> io::Result<()> {
        out.write_all(self.to_json().as_bytes())
    }

    /// The snapshot as a JSON document:
    ///
    /// ```json
    /// {"allocators": [{"index": 1, "name": "SystemAllocator", "description": "…",
    ///   "kind": "system", "parent": "OSAllocator", "depth": 1, "used_bytes": 0,
    ///   "requested_bytes": null, "reserved_bytes": 0, "consumed_bytes": 0,
    ///   "live_blocks": 0, "allocations": 0, "frees": 0, "reallocations": 0,
    ///   "peak_bytes": null, "budget_bytes": null, "over_budget": 0,
    ///   "budget_failures": 0}, …],
    ///  "totals": {"used_bytes": 0, "reserved_bytes": 0, "consumed_bytes": 0}}
    /// ```
    pub fn to_json(&self) -> String {
        json::render(self)
    }
}

/// Writes O3DE's `sys_DumpAllocators` CSV for every registered allocator to `out`.
///
/// The header is `Index,Name,Used KiB,Reserved KiB,Consumed KiB,Parent Allocator`; one row
/// per allocator (`%.2f` KiB, the parent's name or empty); then a `-,Totals,…` row and a
/// line `N allocators active`. The columns are defined in the [module docs](self).
///
/// ```
/// let mut out = Vec::new();
/// tagalloc::dump_allocators(&mut out).unwrap();
/// let text = String::from_utf8(out).unwrap();
/// assert!(text.starts_with("Index,Name,Used KiB,Reserved KiB,Consumed KiB,Parent Allocator\n"));
/// assert!(text.lines().any(|l| l.starts_with("1,SystemAllocator,")));
/// assert!(text.trim_end().ends_with("allocators active"));
/// ```
pub fn dump_allocators(out: &mut dyn io::Write) -> io::Result<()> {
    Snapshot::take().write_csv(out)
}

/// The allocator tree as text (see [`Snapshot::write_tree`]).
pub fn tree() -> String {
    let mut out = Vec::new();
    // Writing to a Vec cannot fail.
    let _ = Snapshot::take().write_tree(&mut out);
    String::from_utf8_lossy(&out).into_owned()
}

/// A JSON snapshot of every allocator (see [`Snapshot::to_json`]).
pub fn json() -> String {
    Snapshot::take().to_json()
}
