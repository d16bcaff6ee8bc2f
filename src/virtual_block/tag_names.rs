//! Tag names made at run time, kept once each for the life of the process.
//!
//! [`Tag`](super::Tag) holds a `&'static str` so that it stays `Copy` and free to carry. A
//! name built at run time (`format!("pool {i}")`) is copied here once: the same name always
//! gives back the same copy, so making tags in a loop does not grow memory, and the table
//! holds one copy per distinct name. The copies and the table live in pages from the OS
//! layer, never the global allocator, so a tag can be made from allocator code (a
//! `#[global_allocator]` that manages a virtual block) without re-entering it. (Under Miri the
//! pages come from `std::alloc::System`, which Miri can follow.)

use crate::sync::SpinLock;

/// Size of the pages names are copied into (a longer name gets pages of its own).
const ARENA_CHUNK: usize = 64 << 10;
/// Slots of the first table (a power of two); it doubles at half full.
const FIRST_SLOTS: usize = 256;

/// One stored name: where its bytes are, and how many.
#[derive(Clone, Copy)]
struct Slot {
    ptr: *const u8,
    len: usize,
}

const EMPTY: Slot = Slot {
    ptr: core::ptr::null(),
    len: 0,
};

struct Interner {
    /// Open-addressing table of `capacity` slots (a power of two), or null before the first
    /// name.
    slots: *mut Slot,
    capacity: usize,
    names: usize,
    /// Unused bytes of the current arena chunk.
    free: *mut u8,
    free_len: usize,
}

// SAFETY: the pointers lead to pages owned by the interner alone; the lock around it lets one
// thread at a time use them.
unsafe impl Send for Interner {}

static NAMES: SpinLock<Interner> = SpinLock::new(Interner {
    slots: core::ptr::null_mut(),
    capacity: 0,
    names: 0,
    free: core::ptr::null_mut(),
    free_len: 0,
});

/// Pages from the OS layer (or from `System` under Miri), zeroed.
mod pages {
    #[cfg(not(miri))]
    pub(super) fn map(len: usize) -> *mut u8 {
        use crate::os::{OsAllocator, PageSource};
        let page = OsAllocator::page_size();
        OsAllocator.map(len.next_multiple_of(page), page, 0)
    }

    /// # Safety
    /// `ptr` and `len` must be a live mapping from [`map`] with the same `len`.
    #[cfg(not(miri))]
    pub(super) unsafe fn unmap(ptr: *mut u8, len: usize) {
        use crate::os::{OsAllocator, PageSource};
        let page = OsAllocator::page_size();
        // SAFETY: the caller passes a live mapping of this length, rounded as `map` did.
        unsafe { OsAllocator.unmap(ptr, len.next_multiple_of(page)) }
    }

    #[cfg(miri)]
    pub(super) fn map(len: usize) -> *mut u8 {
        use std::alloc::{GlobalAlloc, Layout, System};
        match Layout::from_size_align(len, 16) {
            // SAFETY: the layout has a non-zero size (callers never ask for 0 bytes).
            Ok(layout) => unsafe { System.alloc_zeroed(layout) },
            Err(_) => core::ptr::null_mut(),
        }
    }

    /// # Safety
    /// `ptr` and `len` must be a live mapping from [`map`] with the same `len`.
    #[cfg(miri)]
    pub(super) unsafe fn unmap(ptr: *mut u8, len: usize) {
        use std::alloc::{GlobalAlloc, Layout, System};
        // SAFETY: `map` allocated `ptr` with this layout (it succeeded, so the layout is valid).
        unsafe { System.dealloc(ptr, Layout::from_size_align_unchecked(len, 16)) }
    }
}

/// FNV-1a: short names, no attacker, and the same hash the SVG map colours tags by.
pub(crate) fn fnv1a(bytes: &[u8]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for &b in bytes {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    h
}

impl Interner {
    /// The stored copy of `name`, copying it in if it is new; `None` when the OS refuses
    /// memory.
    fn intern(&mut self, name: &str) -> Option<&'static str> {
        if self.names * 2 >= self.capacity {
            self.grow()?;
        }
        let mask = self.capacity - 1;
        let mut i = fnv1a(name.as_bytes()) as usize & mask;
        loop {
            // SAFETY: `slots` holds `capacity` initialised slots and `i <= mask`.
            let slot = unsafe { &mut *self.slots.add(i) };
            if slot.ptr.is_null() {
                let ptr = self.store(name.as_bytes())?;
                *slot = Slot {
                    ptr,
                    len: name.len(),
                };
                self.names += 1;
                // SAFETY: `store` copied valid UTF-8 (from a `str`) there, in pages that are
                // never unmapped or written again.
                return Some(unsafe { Self::text(*slot) });
            }
            // SAFETY: a non-null slot describes a stored name, as above.
            let stored = unsafe { Self::text(*slot) };
            if stored == name {
                return Some(stored);
            }
            i = (i + 1) & mask;
        }
    }

    /// # Safety
    /// `slot` must describe a name copied in by [`Interner::store`].
    unsafe fn text(slot: Slot) -> &'static str {
        // SAFETY: the caller promises `len` bytes of UTF-8 at `ptr` that live for ever.
        unsafe { core::str::from_utf8_unchecked(core::slice::from_raw_parts(slot.ptr, slot.len)) }
    }

    /// Copies `bytes` into the arena (pages that are never freed); returns where.
    fn store(&mut self, bytes: &[u8]) -> Option<*const u8> {
        if bytes.is_empty() {
            // Any non-null pointer does for zero bytes; the slot must not look empty.
            return Some(core::ptr::NonNull::<u8>::dangling().as_ptr());
        }
        if bytes.len() > self.free_len {
            let len = bytes.len().max(ARENA_CHUNK);
            let chunk = pages::map(len);
            if chunk.is_null() {
                return None;
            }
            // A long name gets its own pages and leaves the current chunk as it is.
            if bytes.len() >= ARENA_CHUNK {
                // SAFETY: the new mapping holds `len >= bytes.len()` bytes.
                unsafe { core::ptr::copy_nonoverlapping(bytes.as_ptr(), chunk, bytes.len()) };
                return Some(chunk);
            }
            self.free = chunk;
            self.free_len = len;
        }
        let at = self.free;
        // SAFETY: `bytes.len() <= free_len` bytes are unused at `free` in the current chunk.
        unsafe {
            core::ptr::copy_nonoverlapping(bytes.as_ptr(), at, bytes.len());
            self.free = at.add(bytes.len());
        }
        self.free_len -= bytes.len();
        Some(at)
    }

    /// Doubles the table (or makes the first one) and moves the names over.
    fn grow(&mut self) -> Option<()> {
        let capacity = (self.capacity * 2).max(FIRST_SLOTS);
        let bytes = capacity * core::mem::size_of::<Slot>();
        let slots = pages::map(bytes).cast::<Slot>();
        if slots.is_null() {
            return None;
        }
        for i in 0..capacity {
            // SAFETY: the new mapping holds `capacity` slots, suitably aligned (page-aligned).
            unsafe { slots.add(i).write(EMPTY) };
        }
        let mask = capacity - 1;
        for i in 0..self.capacity {
            // SAFETY: the old table holds `self.capacity` initialised slots.
            let slot = unsafe { *self.slots.add(i) };
            if slot.ptr.is_null() {
                continue;
            }
            // SAFETY: a non-null slot describes a stored name.
            let mut j = fnv1a(unsafe { Self::text(slot) }.as_bytes()) as usize & mask;
            // SAFETY: `j <= mask` indexes the new table of `capacity` initialised slots.
            while unsafe { !(*slots.add(j)).ptr.is_null() } {
                j = (j + 1) & mask;
            }
            // SAFETY: as above.
            unsafe { slots.add(j).write(slot) };
        }
        if !self.slots.is_null() {
            // SAFETY: the old table is a live mapping of this size, no longer used.
            unsafe {
                pages::unmap(
                    self.slots.cast(),
                    self.capacity * core::mem::size_of::<Slot>(),
                )
            };
        }
        self.slots = slots;
        self.capacity = capacity;
        Some(())
    }
}

/// The process-wide copy of `name` (see the module docs). Aborts with a message, without
/// allocating, if the OS refuses the few pages it needs, as the standard library does when
/// memory runs out.
pub(crate) fn intern(name: &str) -> &'static str {
    match NAMES.lock().intern(name) {
        Some(stored) => stored,
        None => crate::fatal::abort_with(format_args!(
            "out of memory storing a virtual-block tag name of {} bytes",
            name.len()
        )),
    }
}

/// How many distinct names are stored (tests).
#[cfg(test)]
pub(crate) fn stored_names() -> usize {
    NAMES.lock().names
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_same_name_is_stored_once() {
        let a = intern(&format!("interned test tag {}", 7));
        let b = intern(&String::from("interned test tag 7"));
        assert_eq!(a, "interned test tag 7");
        assert_eq!(a.as_ptr(), b.as_ptr(), "one copy per distinct name");
        assert_eq!(intern(""), "");
        let long = "x".repeat(ARENA_CHUNK + 10);
        assert_eq!(intern(&long), long);
    }

    #[test]
    fn many_names_survive_the_table_growing() {
        let n = if cfg!(miri) { 300 } else { 5000 };
        let stored: Vec<&'static str> = (0..n)
            .map(|i| intern(&format!("growth test tag {i}")))
            .collect();
        assert!(stored_names() >= n);
        for (i, s) in stored.iter().enumerate() {
            assert_eq!(*s, format!("growth test tag {i}"));
            assert_eq!(intern(s).as_ptr(), s.as_ptr());
        }
    }
}
