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
}

impl Linear {
    pub(crate) fn new(capacity: u64) -> Self {
        Linear {
            capacity,
            lower: VecDeque::new(),
            second: Vec::new(),
            mode: Second::Empty,
            dead: 0,
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
    }

    /// Where the upper stack begins (the lower part may grow up to here).
    fn upper_limit(&self) -> u64 {
        match self.mode {
            Second::Upper => self.second.last().map_or(self.capacity, |e| e.offset),
            _ => self.capacity,
        }
    }

    /// Places `size` aligned to `align`; returns the offset.
    pub(crate) fn allocate(
        &mut self,
        size: u64,
        align: u64,
        upper: bool,
        owner: u32,
    ) -> Result<u64, LinearFail> {
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
    pub(crate) fn free(&mut self, offset: u64, owner: u32) -> bool {
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
        Ok(())
    }
}
