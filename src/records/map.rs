//! The record table's map: open addressing keyed by (address, allocator), linear probing,
//! backward-shift deletion (no tombstones), on any `allocator_api2` allocator.
//!
//! Made for this one job, it does less than a general hash map and so costs less per call:
//! a key is two integers compared directly, a slot is found in one or two cache lines, an
//! insert never looks for a duplicate (a live block is recorded once: its record leaves the
//! table before the block is freed), and growth is the only allocation. Capacity is a power
//! of two and the map grows at 5/8 full, which keeps probes short.

use allocator_api2::alloc::Allocator;
use core::alloc::Layout;
use core::mem::MaybeUninit;
use core::ptr::NonNull;

/// The hash of a key: a multiply-fold, good in the low bits (the slot) and in bits 32..38
/// (which the table uses to pick a shard).
#[inline(always)]
pub(crate) fn hash_parts(addr: usize, alloc: u32) -> u64 {
    let x = addr as u64 ^ u64::from(alloc).rotate_right(8);
    let p = u128::from(x) * 0x9E37_79B9_7F4A_7C15u128;
    (p as u64) ^ ((p >> 64) as u64)
}

/// One entry, as [`AddrMap::iter`] yields it.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Slot<V> {
    pub(crate) addr: usize,
    pub(crate) alloc: u32,
    pub(crate) value: V,
}

/// One slot as stored: `addr == 0` means empty (no block lives at address 0), and then
/// `value` is uninitialised.
#[derive(Clone, Copy)]
struct Raw<V: Copy> {
    addr: usize,
    alloc: u32,
    value: MaybeUninit<V>,
}

/// An open-addressing map from (non-zero address, allocator index) to `V`.
pub(crate) struct AddrMap<V: Copy, A: Allocator> {
    slots: NonNull<Raw<V>>,
    /// Capacity − 1 (capacity is a power of two, or 0 with nothing allocated).
    mask: usize,
    len: usize,
    alloc: A,
}

// SAFETY: the map owns its slots like a `Vec` does; sending or sharing it is as safe as
// sending or sharing the values and the allocator.
unsafe impl<V: Copy + Send, A: Allocator + Send> Send for AddrMap<V, A> {}

impl<V: Copy, A: Allocator> AddrMap<V, A> {
    /// An empty map that allocates nothing until its first insert.
    pub(crate) const fn new(alloc: A) -> Self {
        Self {
            slots: NonNull::dangling(),
            mask: 0,
            len: 0,
            alloc,
        }
    }

    fn capacity(&self) -> usize {
        if self.len == 0 && self.mask == 0 && self.slots == NonNull::dangling() {
            0
        } else {
            self.mask + 1
        }
    }

    /// Entries in the map.
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    #[inline(always)]
    fn slot(&self, i: usize) -> *mut Raw<V> {
        // SAFETY: callers pass `i <= mask` with a capacity > 0, inside the allocation.
        unsafe { self.slots.as_ptr().add(i) }
    }

    /// Inserts a key that is not in the map. `hash` is [`hash_parts`] of the key. Returns
    /// `false` if memory for growing ran out (the map is unchanged).
    #[inline]
    pub(crate) fn insert(&mut self, hash: u64, addr: usize, alloc: u32, value: V) -> bool {
        debug_assert_ne!(addr, 0);
        if (self.len + 1) * 8 > self.capacity() * 5 && !self.grow() {
            return false;
        }
        let mut i = hash as usize & self.mask;
        loop {
            let slot = self.slot(i);
            // SAFETY: `i <= mask`; every slot's `addr` and `alloc` are initialised.
            unsafe {
                if (*slot).addr == 0 {
                    slot.write(Raw {
                        addr,
                        alloc,
                        value: MaybeUninit::new(value),
                    });
                    self.len += 1;
                    return true;
                }
            }
            i = (i + 1) & self.mask;
        }
    }

    /// Removes a key and returns its value (`hash` as for [`insert`](Self::insert)).
    #[inline]
    pub(crate) fn remove(&mut self, hash: u64, addr: usize, alloc: u32) -> Option<V> {
        if self.len == 0 {
            return None;
        }
        let mut i = hash as usize & self.mask;
        // SAFETY: indices are masked into the allocation; never full (grows at 5/8), so a probe
        // meets an empty slot; slots copy whole (`MaybeUninit` values), read only when occupied.
        unsafe {
            loop {
                let s = *self.slot(i);
                if s.addr == addr && s.alloc == alloc {
                    break;
                }
                if s.addr == 0 {
                    return None;
                }
                i = (i + 1) & self.mask;
            }
            let value = (*self.slot(i)).value.assume_init();
            // Backward shift: move later entries of the cluster into the hole when their
            // home slot allows it, so no tombstone is needed.
            let mut hole = i;
            let mut j = (i + 1) & self.mask;
            loop {
                let s = *self.slot(j);
                if s.addr == 0 {
                    break;
                }
                let home = hash_parts(s.addr, s.alloc) as usize & self.mask;
                // The entry at `j` may move to `hole` unless its home lies cyclically in
                // (hole, j].
                let stays = if hole <= j {
                    hole < home && home <= j
                } else {
                    hole < home || home <= j
                };
                if !stays {
                    self.slot(hole).write(s);
                    hole = j;
                }
                j = (j + 1) & self.mask;
            }
            (*self.slot(hole)).addr = 0;
            self.len -= 1;
            Some(value)
        }
    }

    /// Doubles the capacity (16 slots at first) and re-inserts every entry.
    #[cold]
    fn grow(&mut self) -> bool {
        let old_cap = self.capacity();
        let new_cap = if old_cap == 0 { 16 } else { old_cap * 2 };
        let Ok(layout) = Layout::array::<Raw<V>>(new_cap) else {
            return false;
        };
        let Ok(block) = self.alloc.allocate(layout) else {
            return false;
        };
        let new: NonNull<Raw<V>> = block.cast();
        // SAFETY: the new block holds `new_cap` slots; each is written empty.
        unsafe {
            for k in 0..new_cap {
                new.as_ptr().add(k).write(Raw {
                    addr: 0,
                    alloc: 0,
                    value: MaybeUninit::uninit(),
                });
            }
        }
        let old = self.slots;
        self.slots = new;
        self.mask = new_cap - 1;
        if old_cap > 0 {
            // SAFETY: the old block holds `old_cap` initialised slots, then goes back to the
            // allocator with the layout it was allocated with.
            unsafe {
                for k in 0..old_cap {
                    let s = *old.as_ptr().add(k);
                    if s.addr != 0 {
                        let mut i = hash_parts(s.addr, s.alloc) as usize & self.mask;
                        while (*self.slot(i)).addr != 0 {
                            i = (i + 1) & self.mask;
                        }
                        self.slot(i).write(s);
                    }
                }
                let old_layout = Layout::array::<Raw<V>>(old_cap).unwrap_unchecked();
                self.alloc.deallocate(old.cast(), old_layout);
            }
        }
        true
    }

    /// Every entry, in slot order.
    pub(crate) fn iter(&self) -> impl Iterator<Item = Slot<V>> + '_ {
        (0..self.capacity()).filter_map(|i| {
            // SAFETY: indices below the capacity; a value is read only from an occupied slot.
            let raw = unsafe { *self.slot(i) };
            (raw.addr != 0).then(|| Slot {
                addr: raw.addr,
                alloc: raw.alloc,
                // SAFETY: occupied slots hold an initialised value.
                value: unsafe { raw.value.assume_init() },
            })
        })
    }
}

impl<V: Copy, A: Allocator> Drop for AddrMap<V, A> {
    fn drop(&mut self) {
        let cap = self.capacity();
        if cap > 0 {
            // SAFETY: the block was allocated with this layout and is freed once.
            unsafe {
                let layout = Layout::array::<Raw<V>>(cap).unwrap_unchecked();
                self.alloc.deallocate(self.slots.cast(), layout);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use allocator_api2::alloc::Global;
    use std::collections::HashMap;

    #[test]
    fn miri_the_map_matches_a_reference_under_random_inserts_and_removes() {
        let mut map: AddrMap<u64, Global> = AddrMap::new(Global);
        let mut reference: HashMap<(usize, u32), u64> = HashMap::new();
        let mut state = 0x2545_f491_4f6c_dd1du64;
        let rounds = if cfg!(miri) { 3_000 } else { 200_000 };
        for n in 0..rounds {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            // Few distinct keys, so clusters form and the backward shift is exercised.
            let addr = 16 * (1 + (state % 700) as usize);
            let alloc = (state >> 32) as u32 % 3;
            let h = hash_parts(addr, alloc);
            match reference.remove(&(addr, alloc)) {
                Some(expected) => {
                    assert_eq!(map.remove(h, addr, alloc), Some(expected), "round {n}")
                }
                None => {
                    assert!(map.insert(h, addr, alloc, n));
                    reference.insert((addr, alloc), n);
                }
            }
            assert_eq!(map.len(), reference.len());
        }
        let mut all: Vec<_> = map.iter().map(|s| ((s.addr, s.alloc), s.value)).collect();
        all.sort_unstable();
        let mut expected: Vec<_> = reference.into_iter().collect();
        expected.sort_unstable();
        assert_eq!(all, expected);
        for ((addr, alloc), v) in expected {
            assert_eq!(map.remove(hash_parts(addr, alloc), addr, alloc), Some(v));
        }
        assert_eq!(map.len(), 0);
        assert_eq!(map.remove(hash_parts(16, 0), 16, 0), None);
    }

    #[test]
    fn miri_colliding_keys_wrap_around_the_end() {
        // Six keys whose home is the last of the 16 slots: the cluster wraps around, and
        // removals in any order shift entries back across the end.
        let keys: Vec<usize> = (1..100_000usize)
            .map(|a| a * 16)
            .filter(|&a| hash_parts(a, 0) & 15 == 15)
            .take(6)
            .collect();
        for order in [
            [1usize, 0, 2, 3, 4, 5],
            [5, 4, 3, 2, 1, 0],
            [2, 4, 0, 5, 1, 3],
        ] {
            let mut map: AddrMap<usize, Global> = AddrMap::new(Global);
            for &a in &keys {
                assert!(map.insert(hash_parts(a, 0), a, 0, a));
            }
            assert_eq!(map.capacity(), 16);
            for (n, &k) in order.iter().enumerate() {
                let a = keys[k];
                assert_eq!(map.remove(hash_parts(a, 0), a, 0), Some(a));
                for &other in &order[n + 1..] {
                    let b = keys[other];
                    assert!(
                        map.iter().any(|s| s.addr == b),
                        "lost {b} after removing {a}"
                    );
                }
            }
            assert_eq!(map.len(), 0);
        }
    }
}
