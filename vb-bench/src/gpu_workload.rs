//! A GPU heap as a renderer uses one, as a fixed sequence of operations.
//!
//! Each frame replaces 2% of the long-lived textures (64 KiB – 8 MiB, aligned to 64 KiB: free
//! the old one, allocate the new one), then allocates 200 transient buffers (256 B – 256 KiB,
//! aligned to 256) and frees them at the frame's end, in allocation order. Sizes are
//! log-uniform: a power of two picked uniformly, then uniformly within that octave.
//!
//! Shared by vb-bench (which times it) and tagalloc's `vb_gpu_workload` test (which checks
//! that no failure in it is a false out-of-memory): both include this file, so it needs
//! nothing but `core`.

/// One step of the sequence. Slots name allocations: an `Alloc` fills its slot, a `Free`
/// empties it (skipped by the replayer when the allocation had failed).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Op {
    Alloc { slot: u32, size: u64, align: u64 },
    Free { slot: u32 },
}

/// The sequence and what it needs.
pub struct GpuWorkload {
    pub ops: Vec<Op>,
    /// Number of distinct slots.
    pub slots: usize,
}

/// Long-lived textures.
pub const TEXTURES: u32 = 384;
/// Transient buffers per frame.
pub const TRANSIENTS: u32 = 200;
/// Textures replaced per frame: 2% of [`TEXTURES`].
pub const REPLACED: u32 = TEXTURES / 50;
/// A heap the steady state fits in comfortably (the textures average about 1.8 MiB, about
/// 690 MiB in all, plus about 8 MiB of transients).
pub const HEAP: u64 = 1 << 30;
/// Frames for about 800,000 operations.
pub const FRAMES: u32 = 1900;

const TEXTURE_ALIGN: u64 = 64 << 10;
const BUFFER_ALIGN: u64 = 256;

/// xorshift64*.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }

    /// Log-uniform in `[2^lo, 2^hi)`.
    fn log_uniform(&mut self, lo: u32, hi: u32) -> u64 {
        let octave = lo + self.below(u64::from(hi - lo)) as u32;
        (1 << octave) + self.below(1 << octave)
    }
}

/// The sequence for `frames` frames (textures allocated first, everything freed at the end).
pub fn gpu_heap(frames: u32, seed: u64) -> GpuWorkload {
    let mut rng = Rng(seed | 1);
    let mut ops = Vec::with_capacity(
        (TEXTURES as usize) * 2 + frames as usize * (2 * (TRANSIENTS + REPLACED) as usize),
    );
    let texture = |rng: &mut Rng, slot| Op::Alloc {
        slot,
        size: rng.log_uniform(16, 23),
        align: TEXTURE_ALIGN,
    };
    for slot in 0..TEXTURES {
        ops.push(texture(&mut rng, slot));
    }
    for _ in 0..frames {
        for _ in 0..REPLACED {
            let slot = rng.below(u64::from(TEXTURES)) as u32;
            ops.push(Op::Free { slot });
            ops.push(texture(&mut rng, slot));
        }
        for j in 0..TRANSIENTS {
            ops.push(Op::Alloc {
                slot: TEXTURES + j,
                size: rng.log_uniform(8, 18),
                align: BUFFER_ALIGN,
            });
        }
        for j in 0..TRANSIENTS {
            ops.push(Op::Free { slot: TEXTURES + j });
        }
    }
    for slot in 0..TEXTURES {
        ops.push(Op::Free { slot });
    }
    GpuWorkload {
        ops,
        slots: (TEXTURES + TRANSIENTS) as usize,
    }
}
