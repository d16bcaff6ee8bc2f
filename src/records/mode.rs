//! Record modes and the per-allocator settings word the hooks test.
//!
//! Every [`Registration`](crate::Registration) carries a [`RecordSettings`]: one `AtomicU64`
//! holding the mode, its parameters and a few flags. The allocation and free paths read it
//! with one relaxed load and test it against a constant mask, so with records off an
//! allocator pays one load and one predictable branch per call.

use core::sync::atomic::{AtomicU64, Ordering::Relaxed};

/// What an allocator records about each of its allocations (O3DE's
/// `AllocationRecordMode`, plus sampling).
///
/// Set per allocator in code (`Handle.set_records(..)`,
/// [`SystemAllocator::set_records`](crate::SystemAllocator::set_records)) or at start-up
/// with `TAGALLOC_RECORDS` (see [`records`](crate::records)).
///
/// ```
/// use tagalloc::records::RecordMode;
///
/// assert_eq!(RecordMode::full(), RecordMode::Full { frames: 8 });
/// assert_eq!(RecordMode::sample(), RecordMode::Sample { interval: 512 * 1024, frames: 8 });
/// assert!(RecordMode::Basic.is_on() && !RecordMode::Off.is_on());
/// ```
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum RecordMode {
    /// Nothing is recorded (the default).
    #[default]
    Off,
    /// Every allocation: address, granted and requested size, alignment, thread, time.
    Basic,
    /// Every allocation, as `Basic`, plus up to `frames` frames of the call stack, captured
    /// unresolved and resolved only when a report is written.
    Full {
        /// Frames shown per stack (1 to [`RecordMode::MAX_FRAMES`]), after the
        /// allocator's own frames are trimmed.
        frames: u8,
    },
    /// One allocation per `interval` bytes allocated, on average, chosen at random (each
    /// byte has the same chance, as jemalloc's `lg_prof_sample`); each sampled record
    /// carries a weight so that reports estimate the true totals. The mode for
    /// production.
    Sample {
        /// Mean bytes allocated between two samples (1 to
        /// [`RecordMode::MAX_SAMPLE_INTERVAL`]).
        interval: u64,
        /// Frames per sampled stack (0 = no stacks, up to [`RecordMode::MAX_FRAMES`]).
        frames: u8,
    },
}

impl RecordMode {
    /// Frames per stack when not given (O3DE's legacy default was 5, its current 3; eight
    /// usually reach the caller past a container's own frames).
    pub const DEFAULT_FRAMES: u8 = 8;
    /// The most frames a stack may have.
    pub const MAX_FRAMES: u8 = 64;
    /// Mean bytes between samples when not given: 512 KiB, jemalloc's default
    /// (`lg_prof_sample:19`).
    pub const DEFAULT_SAMPLE_INTERVAL: u64 = 512 * 1024;
    /// The largest sampling interval (2⁴⁸ − 1 bytes).
    pub const MAX_SAMPLE_INTERVAL: u64 = (1 << 48) - 1;

    /// `Full` with [`DEFAULT_FRAMES`](Self::DEFAULT_FRAMES).
    pub const fn full() -> Self {
        Self::Full {
            frames: Self::DEFAULT_FRAMES,
        }
    }

    /// `Sample` with the default interval and frames.
    pub const fn sample() -> Self {
        Self::Sample {
            interval: Self::DEFAULT_SAMPLE_INTERVAL,
            frames: Self::DEFAULT_FRAMES,
        }
    }

    /// Whether anything is recorded.
    pub const fn is_on(self) -> bool {
        !matches!(self, Self::Off)
    }

    /// Frames captured per stack (0 when no stacks are kept).
    pub const fn frames(self) -> u8 {
        match self {
            Self::Full { frames } | Self::Sample { frames, .. } => frames,
            _ => 0,
        }
    }

    /// The same mode with out-of-range parameters brought into range.
    pub const fn clamped(self) -> Self {
        const fn clamp_frames(f: u8, min: u8) -> u8 {
            if f < min {
                min
            } else if f > RecordMode::MAX_FRAMES {
                RecordMode::MAX_FRAMES
            } else {
                f
            }
        }
        match self {
            Self::Full { frames } => Self::Full {
                frames: clamp_frames(frames, 1),
            },
            Self::Sample { interval, frames } => Self::Sample {
                interval: if interval == 0 {
                    1
                } else if interval > Self::MAX_SAMPLE_INTERVAL {
                    Self::MAX_SAMPLE_INTERVAL
                } else {
                    interval
                },
                frames: clamp_frames(frames, 0),
            },
            other => other,
        }
    }

    /// Packs the mode into the low bits (kind), bits 8..16 (frames) and 16..64 (interval).
    pub(crate) const fn encode(self) -> u64 {
        match self.clamped() {
            Self::Off => 0,
            Self::Basic => KIND_BASIC,
            Self::Full { frames } => KIND_FULL | (frames as u64) << 8,
            Self::Sample { interval, frames } => {
                KIND_SAMPLE | (frames as u64) << 8 | interval << 16
            }
        }
    }

    /// The mode packed in `word` (flags are ignored).
    pub(crate) const fn decode(word: u64) -> Self {
        let frames = (word >> 8) as u8;
        match word & KIND_MASK {
            KIND_BASIC => Self::Basic,
            KIND_FULL => Self::Full { frames },
            KIND_SAMPLE => Self::Sample {
                interval: word >> 16,
                frames,
            },
            _ => Self::Off,
        }
    }
}

pub(crate) const KIND_MASK: u64 = 0b11;
pub(crate) const KIND_BASIC: u64 = 1;
pub(crate) const KIND_FULL: u64 = 2;
pub(crate) const KIND_SAMPLE: u64 = 3;
/// Records of every allocation may be in the table: frees must look theirs up. Stays set
/// after records are turned off, so that the records made earlier still leave exactly.
pub(crate) const TRACK_ALL: u64 = 1 << 2;
/// Sampled records may be in the table: frees consult the sample filter first.
pub(crate) const TRACK_SAMPLED: u64 = 1 << 3;
/// The mode was set in code, so the environment does not override it.
pub(crate) const SET_BY_CODE: u64 = 1 << 4;
/// The environment has not been read yet: the next call takes the recording path, which
/// reads it (only the `SystemAllocator` starts with this set, so that its very first
/// allocation can be recorded).
pub(crate) const PENDING_ENV: u64 = 1 << 5;
/// Bits that send an allocation down the recording path.
pub(crate) const ALLOC_HOOK: u64 = KIND_MASK | PENDING_ENV;
/// Bits that send a free down the recording path.
pub(crate) const FREE_HOOK: u64 = TRACK_ALL | TRACK_SAMPLED | PENDING_ENV;
const MODE_BITS: u64 = KIND_MASK | 0xFF00 | !0xFFFF;

/// One allocator's record settings: a single word, read with one relaxed load.
#[derive(Debug)]
pub struct RecordSettings {
    word: AtomicU64,
}

impl RecordSettings {
    /// Records off.
    pub(crate) const fn new() -> Self {
        Self {
            word: AtomicU64::new(0),
        }
    }

    /// Records off until the environment has been read (for the `SystemAllocator`).
    pub(crate) const fn pending_env() -> Self {
        Self {
            word: AtomicU64::new(PENDING_ENV),
        }
    }

    /// The raw word (one relaxed load).
    #[inline(always)]
    pub(crate) fn word(&self) -> u64 {
        self.word.load(Relaxed)
    }

    /// The current mode.
    pub fn mode(&self) -> RecordMode {
        RecordMode::decode(self.word())
    }

    /// Sets the mode, keeping the "may have records" flags (so earlier records still
    /// leave the table when their blocks are freed). `by_code` marks it as set in code;
    /// a setting from the environment (`by_code == false`) never overrides one from code.
    /// Returns `false` when it did not apply for that reason.
    pub(crate) fn set(&self, mode: RecordMode, by_code: bool) -> bool {
        let packed = mode.encode();
        let track = match packed & KIND_MASK {
            KIND_BASIC | KIND_FULL => TRACK_ALL,
            KIND_SAMPLE => TRACK_SAMPLED,
            _ => 0,
        };
        let mut old = self.word();
        loop {
            if !by_code && old & SET_BY_CODE != 0 {
                return false;
            }
            let flags = old & (TRACK_ALL | TRACK_SAMPLED | SET_BY_CODE | PENDING_ENV);
            let new = packed | flags | track | if by_code { SET_BY_CODE } else { 0 };
            match self.word.compare_exchange_weak(old, new, Relaxed, Relaxed) {
                Ok(_) => return true,
                Err(now) => old = now,
            }
        }
    }

    /// Clears [`PENDING_ENV`] once the environment has been applied.
    pub(crate) fn clear_pending_env(&self) {
        self.word.fetch_and(!PENDING_ENV, Relaxed);
    }
}

impl Default for RecordSettings {
    fn default() -> Self {
        Self::new()
    }
}

const _: () = assert!(MODE_BITS & (TRACK_ALL | TRACK_SAMPLED | SET_BY_CODE | PENDING_ENV) == 0);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn miri_modes_round_trip_through_the_word() {
        for mode in [
            RecordMode::Off,
            RecordMode::Basic,
            RecordMode::full(),
            RecordMode::Full { frames: 1 },
            RecordMode::Full { frames: 64 },
            RecordMode::sample(),
            RecordMode::Sample {
                interval: 1,
                frames: 0,
            },
            RecordMode::Sample {
                interval: RecordMode::MAX_SAMPLE_INTERVAL,
                frames: 64,
            },
        ] {
            assert_eq!(RecordMode::decode(mode.encode()), mode);
        }
        assert_eq!(
            RecordMode::decode(RecordMode::Full { frames: 200 }.encode()),
            RecordMode::Full { frames: 64 }
        );
        assert_eq!(
            RecordMode::Sample {
                interval: 0,
                frames: 3
            }
            .clamped(),
            RecordMode::Sample {
                interval: 1,
                frames: 3
            }
        );
    }

    #[test]
    fn miri_settings_keep_tracking_flags_and_respect_code() {
        let s = RecordSettings::new();
        assert_eq!(s.word() & (ALLOC_HOOK | FREE_HOOK), 0);
        assert!(s.set(RecordMode::Basic, false));
        assert_ne!(s.word() & ALLOC_HOOK, 0);
        assert!(s.set(RecordMode::Off, true));
        // Off for allocations, but frees still look up the records made while on.
        assert_eq!(s.word() & ALLOC_HOOK, 0);
        assert_ne!(s.word() & FREE_HOOK, 0);
        // The environment does not override code.
        assert!(!s.set(RecordMode::full(), false));
        assert_eq!(s.mode(), RecordMode::Off);
        assert!(s.set(RecordMode::sample(), true));
        assert_eq!(s.mode(), RecordMode::sample());
        assert_ne!(s.word() & TRACK_SAMPLED, 0);

        let p = RecordSettings::pending_env();
        assert_ne!(p.word() & ALLOC_HOOK, 0);
        assert_ne!(p.word() & FREE_HOOK, 0);
        p.clear_pending_env();
        assert_eq!(p.word(), 0);
    }
}
