//! What the fuzz targets share: how input bytes become layouts (skewed towards the small
//! classes, as real programs are), the pattern every live block holds, and the shadow map of
//! live ranges that catches overlaps.
//!
//! The targets are in `fuzz_targets/`; each one checks one layer of tagalloc against a
//! model kept here, so a crash names the layer.

use arbitrary::Arbitrary;
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};

/// A size drawn from the input: a class byte picks the range, the value is reduced into it.
/// Half the draws stay under 600 bytes (the small classes and the thread caches), most of
/// the rest under 8 KiB, and one in ten reaches 300 KiB or 2 MiB (large blocks, dedicated
/// mappings).
#[derive(Arbitrary, Debug, Clone, Copy)]
pub struct SizeSeed {
    class: u8,
    value: u32,
}

impl SizeSeed {
    /// The size, at most `max`.
    pub fn get(self, max: usize) -> usize {
        let cap: usize = match self.class % 10 {
            0..=4 => 600,
            5..=7 => 8192,
            8 => 300_000,
            _ => 2 << 20,
        };
        self.value as usize % (cap.min(max) + 1)
    }
}

/// An alignment drawn from one byte: mostly 1 to 8, often up to 4 KiB, sometimes up to
/// 1 MiB (the HPHA's large-alignment paths).
#[derive(Arbitrary, Debug, Clone, Copy)]
pub struct AlignSeed(u8);

impl AlignSeed {
    /// The alignment, at most `max` (a power of two).
    pub fn get(self, max: usize) -> usize {
        let log = match self.0 {
            0..=179 => self.0 % 4,
            180..=244 => self.0 % 13,
            _ => self.0 % 21,
        };
        (1usize << log).min(max)
    }
}

/// The byte a block with id `id` holds at offset `i`: differs between neighbouring blocks
/// and along a block, so a block overwritten by another, or shifted by a bad copy, shows.
pub fn pattern(id: u64, i: usize) -> u8 {
    (id.wrapping_mul(0x9e37_79b9_7f4a_7c15) >> 56) as u8 ^ (i as u8) ^ ((i >> 8) as u8)
}

/// The offsets of a `len`-byte block that hold the pattern: every byte of blocks up to
/// 8 KiB; of larger ones the first and last 2 KiB and every 509th byte between (writing
/// all 2 MiB of a large block on every step would spend the fuzzer's time in `memset`; the
/// samples still land in every page of it).
pub fn pattern_offsets(len: usize) -> impl Iterator<Item = usize> {
    const EDGE: usize = 2048;
    let whole = len <= 8192;
    let head = if whole { len } else { EDGE };
    let tail = if whole { len } else { len - EDGE };
    let middle = (head..tail).step_by(509);
    (0..head).chain(middle).chain(tail..len)
}

/// Writes the pattern of block `id` over its first `len` bytes.
///
/// # Safety
/// `ptr` must be valid for writes of `len` bytes.
pub unsafe fn fill(ptr: *mut u8, len: usize, id: u64) {
    for i in pattern_offsets(len) {
        // SAFETY: `i < len`, and the caller gives `len` writable bytes.
        unsafe { ptr.add(i).write(pattern(id, i)) };
    }
}

/// Checks the pattern of block `id` over its first `len` bytes; panics naming the first
/// byte that differs.
///
/// # Safety
/// `ptr` must be valid for reads of `len` bytes, written by [`fill`] with the same `id`
/// over `len` bytes.
pub unsafe fn verify(ptr: *const u8, len: usize, id: u64, what: &str) {
    // SAFETY: forwarded.
    unsafe { verify_prefix(ptr, len, len, id, what) }
}

/// Checks the first `upto` bytes of a block that [`fill`] wrote over `filled` bytes: what a
/// resize must have kept (the samples of a large block depend on the length it was filled
/// at, so they are taken at that length and cut at `upto`).
///
/// # Safety
/// `ptr` must be valid for reads of `upto` bytes, written by [`fill`] with the same `id`
/// over `filled` bytes.
pub unsafe fn verify_prefix(ptr: *const u8, filled: usize, upto: usize, id: u64, what: &str) {
    for i in pattern_offsets(filled).take_while(|&i| i < upto) {
        // SAFETY: `i < upto`, readable by the caller's promise.
        let got = unsafe { ptr.add(i).read() };
        assert_eq!(
            got,
            pattern(id, i),
            "{what}: block {id} at {ptr:p} lost byte {i} of {upto} (overlapped or badly copied?)"
        );
    }
}

/// Checks that `len` bytes from `from` read as zero (on the pattern's offsets of
/// `from..len`, which for blocks up to 8 KiB is every byte).
///
/// # Safety
/// `ptr` must be valid for reads of `len` bytes.
pub unsafe fn verify_zero(ptr: *const u8, from: usize, len: usize, what: &str) {
    for i in pattern_offsets(len).filter(|&i| i >= from) {
        // SAFETY: `i < len`, readable by the caller's promise.
        let got = unsafe { ptr.add(i).read() };
        assert_eq!(got, 0, "{what}: byte {i} of {len} at {ptr:p} is not zero");
    }
}

/// Panics unless `addr` is a multiple of `align`.
pub fn check_aligned(addr: usize, align: usize, what: &str) {
    assert_eq!(
        addr % align,
        0,
        "{what}: {addr:#x} is not aligned to {align}"
    );
}

/// The live blocks of the model by start address, each with the length it covers (at
/// least one byte, so that two blocks at one address collide) and what the target keeps
/// about it.
pub struct Shadow<T> {
    map: BTreeMap<usize, (usize, T)>,
}

impl<T> Default for Shadow<T> {
    fn default() -> Self {
        Self {
            map: BTreeMap::new(),
        }
    }
}

impl<T> Shadow<T> {
    /// Adds a block covering `addr..addr + len`; panics if it overlaps a live one.
    pub fn insert(&mut self, addr: usize, len: usize, value: T, what: &str) {
        let len = len.max(1);
        if let Some((&before, &(blen, _))) = self.map.range(..=addr).next_back() {
            assert!(
                before + blen <= addr,
                "{what}: {addr:#x}+{len} overlaps the live block {before:#x}+{blen}"
            );
        }
        if let Some((&after, &(alen, _))) = self.map.range(addr..).next() {
            assert!(
                addr + len <= after,
                "{what}: {addr:#x}+{len} overlaps the live block {after:#x}+{alen}"
            );
        }
        self.map.insert(addr, (len, value));
    }

    /// Removes and returns the block at rank `pick` (modulo the count), if any.
    pub fn take(&mut self, pick: u16) -> Option<(usize, T)> {
        if self.map.is_empty() {
            return None;
        }
        let addr = *self.map.keys().nth(usize::from(pick) % self.map.len())?;
        self.map.remove(&addr).map(|(_, v)| (addr, v))
    }

    /// Removes and returns the block at `addr`; panics if none starts there.
    pub fn take_at(&mut self, addr: usize) -> T {
        let Some((_, v)) = self.map.remove(&addr) else {
            panic!("no live block at {addr:#x}");
        };
        v
    }

    /// The number of live blocks.
    pub fn len(&self) -> usize {
        self.map.len()
    }

    /// Whether no block is live.
    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }

    /// The live blocks' values.
    pub fn values(&self) -> impl Iterator<Item = &T> {
        self.map.values().map(|(_, v)| v)
    }

    /// Removes every block, in address order.
    pub fn drain(&mut self) -> impl Iterator<Item = (usize, T)> {
        std::mem::take(&mut self.map)
            .into_iter()
            .map(|(a, (_, v))| (a, v))
    }
}

/// Caps the operations one input runs, so that a long input cannot make one execution
/// slow enough to trip libFuzzer's timeout (the interesting states are reached within a
/// few hundred steps).
pub const MAX_OPS: usize = 400;

/// tagalloc's warning lines seen so far (see [`messages`]).
static MESSAGES: AtomicUsize = AtomicUsize::new(0);
/// Lines that did not have the documented shape (`tagalloc: ...\n`).
static MALFORMED: AtomicUsize = AtomicUsize::new(0);

/// Counts a warning line instead of printing it. Runs inside allocations: no allocation, no
/// panic here; the target checks the counts.
fn count_message(line: &str) {
    if line.starts_with("tagalloc: ") && line.ends_with('\n') {
        MESSAGES.fetch_add(1, Relaxed);
    } else {
        MALFORMED.fetch_add(1, Relaxed);
    }
}

/// Routes tagalloc's warnings to a counter (a pool's refusal notes and budget warnings would
/// otherwise fill the fuzzer's output, once per execution) and returns how many arrived so
/// far; panics if one was malformed.
pub fn messages() -> usize {
    tagalloc::messages::set_hook(Some(count_message));
    assert_eq!(
        MALFORMED.load(Relaxed),
        0,
        "a warning line without its 'tagalloc: ' prefix or newline"
    );
    MESSAGES.load(Relaxed)
}
