//! Sampling: which allocations to record, and how much each sampled record stands for.
//!
//! Every thread keeps a countdown of bytes to the next sample, drawn from an exponential
//! distribution with the allocator's mean interval `N`. Each allocation of `s` bytes
//! subtracts `s`; the one that takes the countdown to zero or below is sampled and a fresh
//! countdown is drawn. Because the exponential distribution is memoryless, this samples
//! each byte independently with probability `1/N` (a Poisson process over the bytes a
//! thread allocates, as jemalloc's `lg_prof_sample` and tcmalloc do), so an allocation of
//! `s` bytes is sampled with probability `p(s) = 1 − e^(−s/N)`. A sampled record carries
//! the weight `1/p(s)`: summing weights (blocks) and weight × size (bytes) over the
//! sampled records estimates the true totals without bias.
//!
//! A thread keeps one countdown per distinct interval in use (up to four), so allocators
//! with different intervals do not disturb each other's rates.
//!
//! The cost of an allocation that is not sampled is one subtraction and one branch on a
//! thread-local value. Everything here is plain arithmetic (testable under Miri).

/// A small, fast pseudo-random generator (xorshift64*), seeded per thread.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Rng(u64);

impl Rng {
    pub(crate) const fn new(seed: u64) -> Self {
        Self(if seed == 0 {
            0x9E37_79B9_7F4A_7C15
        } else {
            seed
        })
    }

    /// The generator's state, to resume it later with [`Rng::new`].
    pub(crate) fn state(&self) -> u64 {
        self.0
    }

    pub(crate) fn next_u64(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.0 = x;
        x.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    /// A uniform number in (0, 1].
    pub(crate) fn unit(&mut self) -> f64 {
        ((self.next_u64() >> 11) + 1) as f64 * (1.0 / (1u64 << 53) as f64)
    }
}

/// A countdown drawn from the exponential distribution with mean `mean` bytes (at least 1).
pub(crate) fn next_interval(rng: &mut Rng, mean: u64) -> i64 {
    let draw = -rng.unit().ln() * mean as f64;
    // `as` saturates; a countdown of at least one byte keeps the arithmetic simple.
    (draw as i64).max(1)
}

/// The probability that an allocation of `size` bytes is sampled at mean interval `mean`.
pub fn sample_probability(size: usize, mean: u64) -> f64 {
    if size == 0 {
        return 0.0;
    }
    // 1 - e^(-x), computed without cancellation for small x.
    -(-(size as f64) / mean as f64).exp_m1()
}

/// What a sampled allocation of `size` bytes stands for, in blocks: `1 / p(size)`.
///
/// ```
/// use tagalloc::records::sample_weight;
///
/// // A block much smaller than the interval stands for about interval / size blocks...
/// assert!((sample_weight(64, 512 * 1024) - 8192.5).abs() < 1.0);
/// // ...a block much larger than the interval is always sampled and stands for itself.
/// assert!((sample_weight(64 << 20, 512 * 1024) - 1.0).abs() < 1e-9);
/// ```
pub fn sample_weight(size: usize, mean: u64) -> f64 {
    let p = sample_probability(size, mean);
    if p > 0.0 { 1.0 / p } else { 0.0 }
}

const SLOTS: usize = 4;

/// One thread's countdowns, one per interval in use.
#[derive(Debug)]
pub(crate) struct Sampler {
    intervals: [u64; SLOTS],
    countdowns: [i64; SLOTS],
    rng: Rng,
    seeded: bool,
}

impl Sampler {
    pub(crate) const fn new() -> Self {
        Self {
            intervals: [0; SLOTS],
            countdowns: [0; SLOTS],
            rng: Rng::new(0),
            seeded: false,
        }
    }

    /// A sampler with a fixed seed (for tests).
    #[cfg(test)]
    pub(crate) const fn with_seed(seed: u64) -> Self {
        Self {
            intervals: [0; SLOTS],
            countdowns: [0; SLOTS],
            rng: Rng::new(seed),
            seeded: true,
        }
    }

    /// The fast half of [`charge`](Self::charge): charges `size` bytes and returns `true`
    /// when this allocation is certainly not sampled (the countdown of `interval`, if it is
    /// the first one, stays above zero); `false` means "call `charge`", which then charges
    /// it exactly once.
    #[inline(always)]
    pub(crate) fn try_skip(&mut self, interval: u64, size: usize) -> bool {
        if self.intervals[0] != interval {
            return false;
        }
        let left = self.countdowns[0] - size.min(1 << 48) as i64;
        if left > 0 {
            self.countdowns[0] = left;
            return true;
        }
        false
    }

    /// Charges an allocation of `size` bytes to the countdown of `interval`; returns the
    /// record's weight if this allocation is sampled. `seed` is called once per thread.
    #[inline]
    pub(crate) fn charge(
        &mut self,
        interval: u64,
        size: usize,
        seed: impl FnOnce() -> u64,
    ) -> Option<f64> {
        let slot = match self.intervals.iter().position(|&i| i == interval) {
            Some(slot) => slot,
            None => self.start(interval, seed),
        };
        let left = self.countdowns[slot].saturating_sub(size.min(i64::MAX as usize) as i64);
        if left > 0 {
            self.countdowns[slot] = left;
            return None;
        }
        self.countdowns[slot] = next_interval(&mut self.rng, interval);
        Some(sample_weight(size, interval))
    }

    /// Takes a slot for a new interval (the last one if all are in use).
    #[cold]
    fn start(&mut self, interval: u64, seed: impl FnOnce() -> u64) -> usize {
        if !self.seeded {
            self.rng = Rng::new(seed());
            self.seeded = true;
        }
        let slot = self
            .intervals
            .iter()
            .position(|&i| i == 0)
            .unwrap_or(SLOTS - 1);
        self.intervals[slot] = interval;
        self.countdowns[slot] = next_interval(&mut self.rng, interval);
        slot
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn miri_probabilities_and_weights() {
        assert_eq!(sample_probability(0, 100), 0.0);
        assert!((sample_probability(100, 100) - (1.0 - (-1.0f64).exp())).abs() < 1e-12);
        assert!(sample_probability(1 << 40, 1) > 0.999_999);
        assert!((sample_weight(1, 1 << 20) - (1u64 << 20) as f64).abs() < 1.0);
        assert!(sample_weight(1000, 1000) > 1.0);
    }

    #[test]
    fn miri_intervals_are_positive_and_average_the_mean() {
        let mut rng = Rng::new(7);
        let n = if cfg!(miri) { 2_000 } else { 200_000 };
        let mean = 4096u64;
        let mut sum = 0f64;
        for _ in 0..n {
            let d = next_interval(&mut rng, mean);
            assert!(d >= 1);
            sum += d as f64;
        }
        let avg = sum / n as f64;
        // The standard error of the mean is mean / sqrt(n): allow five of them.
        let tolerance = 5.0 * mean as f64 / (n as f64).sqrt();
        assert!((avg - mean as f64).abs() < tolerance, "average {avg}");
    }

    /// Sampled weights estimate the true totals: allocate a known mix, sum the weights.
    #[test]
    fn miri_weighted_samples_estimate_the_totals() {
        // With a fixed seed the outcome is deterministic; the bounds are about six standard
        // deviations of the estimate (dominated by the 16-byte blocks: weight ~64 each).
        let mut sampler = Sampler::with_seed(12345);
        let interval = 1024;
        let sizes = [16usize, 48, 256, 1024, 4000, 40_000];
        let rounds = if cfg!(miri) { 600 } else { 200_000 };
        let (mut true_bytes, mut true_blocks) = (0f64, 0f64);
        let (mut est_bytes, mut est_blocks) = (0f64, 0f64);
        for i in 0..rounds {
            let size = sizes[i % sizes.len()];
            true_bytes += size as f64;
            true_blocks += 1.0;
            if let Some(w) = sampler.charge(interval, size, || 1) {
                est_bytes += w * size as f64;
                est_blocks += w;
            }
        }
        let bytes_error = (est_bytes - true_bytes).abs() / true_bytes;
        let blocks_error = (est_blocks - true_blocks).abs() / true_blocks;
        let limit = if cfg!(miri) { 0.5 } else { 0.05 };
        assert!(bytes_error < limit, "bytes off by {bytes_error}");
        assert!(blocks_error < limit, "blocks off by {blocks_error}");
    }

    /// Skipping on the fast path and charging on the slow one charge each allocation once:
    /// the number of samples matches a sampler that only ever charges.
    #[test]
    fn miri_the_fast_skip_charges_like_the_slow_path() {
        let mut fast = Sampler::with_seed(99);
        let mut slow = Sampler::with_seed(99);
        let (mut a, mut b) = (0, 0);
        for i in 0..5000usize {
            let size = 8 + (i * 37) % 500;
            if !fast.try_skip(2048, size) {
                a += usize::from(fast.charge(2048, size, || 1).is_some());
            }
            b += usize::from(slow.charge(2048, size, || 1).is_some());
        }
        assert_eq!(a, b);
        assert!(a > 100, "{a}");
    }

    #[test]
    fn miri_intervals_keep_separate_countdowns() {
        let mut s = Sampler::with_seed(3);
        // A huge interval is (almost) never sampled, however the small one is charged.
        let mut big = 0;
        let mut small = 0;
        for _ in 0..1000 {
            big += usize::from(s.charge(1 << 40, 64, || 1).is_some());
            small += usize::from(s.charge(64, 64, || 1).is_some());
        }
        assert_eq!(big, 0);
        assert!(small > 500, "{small}");
        // A fifth interval reuses the last slot instead of failing.
        for interval in [10, 20, 30, 40, 50] {
            let _ = s.charge(interval, 1, || 1);
        }
        assert!(s.charge(1 << 41, 1 << 50, || 1).is_some());
    }
}
