//! The linear algorithm: allocations only at the ends, like VMA's linear pools.
//!
//! One structure covers four usage patterns, chosen by how the caller allocates and frees:
//!
//! - **free at once**: allocate upwards, then [`clear`](super::VirtualBlock::clear);
//! - **stack**: free the most recent allocation first;
//! - **double stack**: allocations with [`Request::upper_address`](super::Request::upper_address)
//!   grow down from the end, the others grow up from the start;
//! - **ring buffer**: free the oldest allocation first; when the top is reached, new
//!   allocations wrap around to the start.
//!
//! Entries are kept sorted by offset. Freeing an entry that is not at an end only marks it
//! dead (found by binary search, O(log n)); dead entries are dropped when they reach an end,
//! and compacted away when they outnumber the live ones. Space in the middle is therefore
//! not reused until the ends reach it: that is the contract of a linear allocator, and why
//! the "never a false out-of-memory" promise is made by the TLSF algorithm only.

use std::collections::VecDeque;

use super::Record;
use super::tlsf::NIL;

/// Owner value of a dead entry.
const DEAD: u32 = u32::MAX;

/// Dead entries tolerated before compaction, on top of 1.5 per live entry.
const COMPACT_SLACK: usize = 32;

#[derive(Clone, Copy, Debug)]
struct Entry {
    offset: u64,
    size: u64,
    owner: u32,
}

impl Entry {
    fn end(&self) -> u64 {
        self.offset + self.size
    }
}

/// What the second vector holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Second {
    /// Nothing.
    Empty,
    /// The upper stack, by descending offset (the last entry is the top of the stack).
    Upper,
    /// The wrapped part of a ring buffer, by ascending offset, all below `lower`'s entries.
    Ring,
}

/// Why a linear allocation failed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum LinearFail {
    /// No room at the ends.
    NoSpace,
    /// An upper-address allocation while the block is used as a ring buffer.
    UpperInRing,
    /// Every slot number is in use.
    TooManyAllocations,
}

/// `next_free` of a live slot.
const LIVE: u32 = NIL - 1;

/// A linear allocation's record; its index is the allocation's identity (the handle's id).
#[derive(Clone, Debug)]
struct Slot {
    offset: u64,
    size: u64,
    meta: u32,
    generation: u32,
    /// [`LIVE`], or the next free slot.
    next_free: u32,
}

/// The linear state of one block.
#[derive(Clone, Debug)]
pub(crate) struct Linear {
    capacity: u64,
    /// Ascending offsets. In ring mode: the older entries, at the top of the block.
    lower: VecDeque<Entry>,
    second: Vec<Entry>,
    mode: Second,
    dead: usize,
    /// Allocation records by id; entries' owners are indices here.
    slots: Vec<Slot>,
    /// Head of the free-slot chain.
    free_slot: u32,
}

impl Linear {
    pub(crate) fn new(capacity: u64) -> Self {
        Linear {
            capacity,
            lower: VecDeque::new(),
            second: Vec::new(),
            mode: Second::Empty,
            dead: 0,
            slots: Vec::new(),
            free_slot: NIL,
        }
    }

    pub(crate) fn grow(&mut self, capacity: u64) {
        self.capacity = capacity;
    }

    pub(crate) fn clear(&mut self) {
        self.lower.clear();
        self.second.clear();
        self.mode = Second::Empty;
        self.dead = 0;
        self.free_slot = NIL;
        for (i, slot) in self.slots.iter_mut().enumerate().rev() {
            slot.next_free = self.free_slot;
            self.free_slot = i as u32;
        }
    }

    /// The live allocation with id `id`, if there is one.
    pub(crate) fn record(&self, id: u32) -> Option<Record> {
        let s = self.slots.get(id as usize)?;
        (s.next_free == LIVE).then_some(Record {
            offset: s.offset,
            size: s.size,
            meta: s.meta,
            generation: s.generation,
        })
    }

    /// Replaces the meta of live allocation `id`.
    pub(crate) fn set_meta(&mut self, id: u32, meta: u32) {
        let s = &mut self.slots[id as usize];
        debug_assert_eq!(s.next_free, LIVE);
        s.meta = meta;
    }

    /// Places `size` aligned to `align` and records it with `meta` and `generation`; returns
    /// the new allocation's id and offset.
    pub(crate) fn allocate(
        &mut self,
        size: u64,
        align: u64,
        upper: bool,
        meta: u32,
        generation: u32,
    ) -> Result<(u32, u64), LinearFail> {
        let id = if self.free_slot != NIL {
            self.free_slot
        } else if self.slots.len() < LIVE as usize {
            self.slots.len() as u32
        } else {
            return Err(LinearFail::TooManyAllocations);
        };
        let offset = self.place(size, align, upper, id)?;
        let slot = Slot {
            offset,
            size,
            meta,
            generation,
            next_free: LIVE,
        };
        if id as usize == self.slots.len() {
            self.slots.push(slot);
        } else {
            let s = &mut self.slots[id as usize];
            self.free_slot = s.next_free;
            *s = slot;
        }
        Ok((id, offset))
    }

    /// Frees live allocation `id`; returns its record.
    pub(crate) fn free(&mut self, id: u32) -> Option<Record> {
        let r = self.record(id)?;
        let found = self.free_entry(r.offset, id);
        debug_assert!(found, "linear entry missing for a live slot");
        self.slots[id as usize].next_free = self.free_slot;
        self.free_slot = id;
        Some(r)
    }

    /// Where the upper stack begins (the lower part may grow up to here).
    fn upper_limit(&self) -> u64 {
        match self.mode {
            Second::Upper => self.second.last().map_or(self.capacity, |e| e.offset),
            _ => self.capacity,
        }
    }

    /// The largest free space at the ends, where the next allocation can go (O(1)): between
    /// the lower part and the upper stack (or the block's end), and, unless an upper stack
    /// is in use, below the oldest entry where a ring wraps to; in ring mode, between the
    /// wrapped part and the oldest entry.
    pub(crate) fn largest_usable(&self) -> u64 {
        let lower_start = self.lower.front().map_or(self.capacity, |e| e.offset);
        match self.mode {
            Second::Ring => lower_start - self.second.last().map_or(0, Entry::end),
            Second::Upper => self.upper_limit() - self.lower.back().map_or(0, Entry::end),
            Second::Empty => {
                let top = self.capacity - self.lower.back().map_or(0, Entry::end);
                top.max(if self.lower.is_empty() {
                    0
                } else {
                    lower_start
                })
            }
        }
    }

    /// Places `size` aligned to `align` for `owner`; returns the offset.
    fn place(&mut self, size: u64, align: u64, upper: bool, owner: u32) -> Result<u64, LinearFail> {
        let mask = align - 1;
        let align_up = |x: u64| x.checked_add(mask).map(|v| v & !mask);
        if upper {
            if self.mode == Second::Ring {
                return Err(LinearFail::UpperInRing);
            }
            let floor = self.lower.back().map_or(0, Entry::end);
            let offset = self
                .upper_limit()
                .checked_sub(size)
                .map(|o| o & !mask)
                .filter(|&o| o >= floor)
                .ok_or(LinearFail::NoSpace)?;
            self.second.push(Entry {
                offset,
                size,
                owner,
            });
            self.mode = Second::Upper;
            return Ok(offset);
        }
        if self.mode == Second::Ring {
            let start = self.second.last().map_or(0, Entry::end);
            let limit = self.lower.front().map_or(self.capacity, |e| e.offset);
            let offset = align_up(start)
                .filter(|&o| o.checked_add(size).is_some_and(|end| end <= limit))
                .ok_or(LinearFail::NoSpace)?;
            self.second.push(Entry {
                offset,
                size,
                owner,
            });
            return Ok(offset);
        }
        let start = self.lower.back().map_or(0, Entry::end);
        let limit = self.upper_limit();
        if let Some(offset) =
            align_up(start).filter(|&o| o.checked_add(size).is_some_and(|end| end <= limit))
        {
            self.lower.push_back(Entry {
                offset,
                size,
                owner,
            });
            return Ok(offset);
        }
        // Wrap around (ring buffer) when the start of the block has been freed.
        if let Some(front) = self.lower.front() {
            if size <= front.offset {
                if self.mode == Second::Upper {
                    return Err(LinearFail::NoSpace);
                }
                self.second.push(Entry {
                    offset: 0,
                    size,
                    owner,
                });
                self.mode = Second::Ring;
                return Ok(0);
            }
        }
        Err(LinearFail::NoSpace)
    }

    /// Frees the live entry at `offset` owned by `owner`. Returns false when there is none.
    fn free_entry(&mut self, offset: u64, owner: u32) -> bool {
        let in_second = match self.mode {
            Second::Empty => false,
            Second::Upper => self.second.last().is_some_and(|e| offset >= e.offset),
            Second::Ring => self.lower.front().is_none_or(|e| offset < e.offset),
        };
        let found = if in_second {
            let pos = if self.mode == Second::Upper {
                self.second.binary_search_by(|e| offset.cmp(&e.offset))
            } else {
                self.second.binary_search_by(|e| e.offset.cmp(&offset))
            };
            match pos {
                Ok(p) if self.second[p].owner == owner => {
                    self.second[p].owner = DEAD;
                    true
                }
                _ => false,
            }
        } else {
            match self.lower.binary_search_by(|e| e.offset.cmp(&offset)) {
                Ok(p) if self.lower[p].owner == owner => {
                    self.lower[p].owner = DEAD;
                    true
                }
                _ => false,
            }
        };
        if found {
            self.dead += 1;
            self.trim();
        }
        found
    }

    /// Drops dead entries at the ends; compacts when dead entries pile up in the middle.
    fn trim(&mut self) {
        loop {
            while self.lower.front().is_some_and(|e| e.owner == DEAD) {
                self.lower.pop_front();
                self.dead -= 1;
            }
            while self.lower.back().is_some_and(|e| e.owner == DEAD) {
                self.lower.pop_back();
                self.dead -= 1;
            }
            while self.second.last().is_some_and(|e| e.owner == DEAD) {
                self.second.pop();
                self.dead -= 1;
            }
            if self.second.is_empty() {
                self.mode = Second::Empty;
            }
            if self.lower.is_empty() && self.mode == Second::Ring {
                // The ring's older part is gone: the wrapped part becomes the lower part.
                self.lower.extend(self.second.drain(..));
                self.mode = Second::Empty;
                continue;
            }
            break;
        }
        let live = self.lower.len() + self.second.len() - self.dead;
        if self.dead > COMPACT_SLACK && self.dead * 2 > live * 3 {
            self.lower.retain(|e| e.owner != DEAD);
            self.second.retain(|e| e.owner != DEAD);
            self.dead = 0;
        }
    }

    /// The live entries in offset order: `(offset, size, owner)`.
    pub(crate) fn taken(&self) -> impl Iterator<Item = (u64, u64, u32)> + '_ {
        let wrapped: &[Entry] = if self.mode == Second::Ring {
            &self.second
        } else {
            &[]
        };
        let upper: &[Entry] = if self.mode == Second::Upper {
            &self.second
        } else {
            &[]
        };
        let (a, b) = self.lower.as_slices();
        wrapped
            .iter()
            .chain(a)
            .chain(b)
            .chain(upper.iter().rev())
            .filter(|e| e.owner != DEAD)
            .map(|e| (e.offset, e.size, e.owner))
    }

    pub(crate) fn validate(&self) -> Result<(), String> {
        let all: Vec<&Entry> = match self.mode {
            Second::Ring => self.second.iter().chain(self.lower.iter()).collect(),
            Second::Upper => self.lower.iter().chain(self.second.iter().rev()).collect(),
            Second::Empty => {
                if !self.second.is_empty() {
                    return Err("second vector not empty in its empty mode".into());
                }
                self.lower.iter().collect()
            }
        };
        if self.mode != Second::Empty && self.second.is_empty() {
            return Err("mode set with an empty second vector".into());
        }
        let mut end = 0u64;
        let mut dead = 0;
        for e in &all {
            if e.size == 0 || e.offset < end {
                return Err(format!("entry at {} overlaps or is empty", e.offset));
            }
            end = e.end();
            dead += usize::from(e.owner == DEAD);
        }
        if end > self.capacity {
            return Err(format!("entries end at {end}, block is {}", self.capacity));
        }
        if dead != self.dead {
            return Err(format!("{dead} dead entries, counter says {}", self.dead));
        }
        let ends = [self.lower.front(), self.lower.back(), self.second.last()];
        if ends.iter().flatten().any(|e| e.owner == DEAD) {
            return Err("a dead entry was left at an end".into());
        }
        // Every live entry has a live slot that describes it, and vice versa.
        let mut live = 0usize;
        for e in all.iter().filter(|e| e.owner != DEAD) {
            match self.record(e.owner) {
                Some(r) if (r.offset, r.size) == (e.offset, e.size) => live += 1,
                _ => return Err(format!("entry at {} has no matching slot", e.offset)),
            }
        }
        let live_slots = self.slots.iter().filter(|s| s.next_free == LIVE).count();
        if live_slots != live {
            return Err(format!("{live_slots} live slots, {live} live entries"));
        }
        let mut free_slots = 0usize;
        let mut f = self.free_slot;
        while f != NIL {
            let s = self
                .slots
                .get(f as usize)
                .ok_or_else(|| format!("free slot {f} out of range"))?;
            if s.next_free == LIVE {
                return Err(format!("slot {f} is on the free chain but live"));
            }
            free_slots += 1;
            if free_slots > self.slots.len() {
                return Err("free-slot chain has a cycle".into());
            }
            f = s.next_free;
        }
        if free_slots + live_slots != self.slots.len() {
            return Err("free-slot chain misses slots".into());
        }
        Ok(())
    }
}
