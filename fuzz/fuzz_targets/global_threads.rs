//! tagalloc as the global allocator, called through `std::alloc::{alloc, alloc_zeroed,
//! realloc, dealloc}` by two threads at once, each running its own part of the input. A
//! thread may hand a block to the other, which verifies and frees it (the thread caches'
//! remote-free path); blocks still held when a thread ends are freed by it, and blocks
//! still in flight by the receiver, after its sender has exited (its thread cache torn
//! down).
//!
//! Every block holds its pattern until freed or resized, zeroed blocks read as zero, every
//! pointer is aligned, and a thread's live blocks never overlap (the two threads' blocks are
//! checked together through a shared map of live ranges).
#![no_main]

use arbitrary::Arbitrary;
use core::alloc::Layout;
use libfuzzer_sys::fuzz_target;
use std::sync::Mutex;
use std::sync::mpsc::{Receiver, Sender, channel};
use tagalloc::SystemAllocator;
use tagalloc_fuzz::{
    AlignSeed, MAX_OPS, Shadow, SizeSeed, check_aligned, fill, verify, verify_prefix, verify_zero,
};

#[global_allocator]
static GLOBAL: SystemAllocator = SystemAllocator::new();

#[derive(Arbitrary, Debug)]
enum Op {
    Alloc {
        size: SizeSeed,
        align: AlignSeed,
        zeroed: bool,
    },
    /// Frees one of the thread's blocks, or hands it to the other thread if `send`.
    Free {
        pick: u16,
        send: bool,
    },
    Realloc {
        pick: u16,
        size: SizeSeed,
    },
    /// Takes whatever the other thread has sent so far.
    Receive,
}

#[derive(Arbitrary, Debug)]
struct Input {
    a: Vec<Op>,
    b: Vec<Op>,
}

/// A block in flight: address, layout, pattern id.
struct Sent(usize, Layout, u64);

/// What a live block's owner keeps: its layout and pattern id.
#[derive(Clone, Copy)]
struct Live {
    layout: Layout,
    id: u64,
}

/// Both threads' live blocks (a block in flight stays in it until freed): an overlap
/// between the threads' blocks is caught at the second allocation.
type Ranges = Mutex<Shadow<()>>;

/// Verifies and frees a block, and drops it from the shared ranges.
fn release(ranges: &Ranges, addr: usize, b: Live, what: &str) {
    ranges.lock().unwrap().take_at(addr);
    // SAFETY: a live block of the global allocator with this layout, freed once; the
    // pattern covers its requested bytes.
    unsafe {
        verify(addr as *const u8, b.layout.size(), b.id, what);
        std::alloc::dealloc(addr as *mut u8, b.layout);
    }
}

/// One thread's part: runs `ops`, sends blocks on `send`, frees what arrives on `recv`.
fn run(side: u64, ops: Vec<Op>, ranges: &Ranges, send: Sender<Sent>, recv: Receiver<Sent>) {
    let mut mine: Shadow<Live> = Shadow::default();
    let take =
        |Sent(addr, layout, id): Sent| release(ranges, addr, Live { layout, id }, "received");
    for (step, op) in ops.into_iter().take(MAX_OPS).enumerate() {
        let id = (side << 32) | step as u64;
        match op {
            Op::Alloc {
                size,
                align,
                zeroed,
            } => {
                // `GlobalAlloc` takes no zero-size requests.
                let layout =
                    Layout::from_size_align(size.get(usize::MAX).max(1), align.get(1 << 20))
                        .unwrap();
                // SAFETY: a layout of non-zero size.
                let p = unsafe {
                    if zeroed {
                        std::alloc::alloc_zeroed(layout)
                    } else {
                        std::alloc::alloc(layout)
                    }
                };
                assert!(!p.is_null(), "{layout:?} refused");
                check_aligned(p as usize, layout.align(), "alloc");
                if zeroed {
                    // SAFETY: the block holds `layout.size()` bytes.
                    unsafe { verify_zero(p, 0, layout.size(), "alloc_zeroed") };
                }
                // SAFETY: as above.
                unsafe { fill(p, layout.size(), id) };
                ranges
                    .lock()
                    .unwrap()
                    .insert(p as usize, layout.size(), (), "alloc");
                mine.insert(p as usize, layout.size(), Live { layout, id }, "alloc");
            }
            Op::Free {
                pick,
                send: hand_over,
            } => {
                let Some((addr, b)) = mine.take(pick) else {
                    continue;
                };
                if !hand_over {
                    release(ranges, addr, b, "free");
                } else if let Err(back) = send.send(Sent(addr, b.layout, b.id)) {
                    // The other thread has finished: free it here.
                    take(back.0);
                }
            }
            Op::Realloc { pick, size } => {
                let Some((addr, b)) = mine.take(pick) else {
                    continue;
                };
                let new = size.get(usize::MAX).max(1);
                // SAFETY: as for `release`, before the block is resized.
                unsafe { verify(addr as *const u8, b.layout.size(), b.id, "before realloc") };
                ranges.lock().unwrap().take_at(addr);
                // SAFETY: a live block with its layout; `new` is non-zero and far below
                // `isize::MAX` rounded to the alignment.
                let q = unsafe { std::alloc::realloc(addr as *mut u8, b.layout, new) };
                assert!(!q.is_null(), "realloc of {:?} to {new} refused", b.layout);
                let layout = Layout::from_size_align(new, b.layout.align()).unwrap();
                check_aligned(q as usize, layout.align(), "realloc");
                // SAFETY: the block holds `new` bytes, the first `min` of them copied.
                unsafe {
                    verify_prefix(q, b.layout.size(), new, b.id, "after realloc");
                    fill(q, new, id);
                }
                ranges
                    .lock()
                    .unwrap()
                    .insert(q as usize, new, (), "realloc");
                mine.insert(q as usize, new, Live { layout, id }, "realloc");
            }
            Op::Receive => recv.try_iter().for_each(take),
        }
    }
    for (addr, b) in mine.drain() {
        release(ranges, addr, b, "final free");
    }
    drop(send);
    // Whatever the other thread still sends, until it has finished.
    recv.into_iter().for_each(take);
}

fuzz_target!(|input: Input| {
    let ranges: Ranges = Mutex::new(Shadow::default());
    let (to_b, from_a) = channel();
    let (to_a, from_b) = channel();
    std::thread::scope(|s| {
        let ranges = &ranges;
        let a = s.spawn(move || run(1, input.a, ranges, to_b, from_b));
        let b = s.spawn(move || run(2, input.b, ranges, to_a, from_a));
        // Joined by hand: the scope's own wait ends when the closures return, before the
        // threads have exited, and LeakSanitizer would then find glibc's list of their
        // thread-local destructors (and tagalloc's thread caches not yet torn down).
        a.join().unwrap();
        b.join().unwrap();
    });
    assert!(ranges.lock().unwrap().is_empty(), "every block was freed");
});
