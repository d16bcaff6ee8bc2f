//! Record timestamps: a cheap tick counter, turned into microseconds only in reports.
//!
//! On x86-64 a tick is a time-stamp-counter cycle (`rdtsc`, a few nanoseconds, no system
//! call); elsewhere it is a nanosecond of `CLOCK_MONOTONIC`. The ratio of ticks to
//! nanoseconds is measured between the epoch (when records were first turned on) and the
//! moment a report is written, so no calibration runs on the allocation path. A measured
//! ratio is kept and reused until the time since the epoch has doubled: reports written
//! close together give a record the same time (two measurements differ in their last
//! digits, which would move a time by a microsecond now and then), and a long run still
//! gets a ratio measured over at least half its length.

use core::sync::atomic::{AtomicBool, AtomicU64, Ordering::*};

/// The tick counter.
#[inline]
pub(crate) fn ticks() -> u64 {
    #[cfg(all(target_arch = "x86_64", not(miri)))]
    {
        // SAFETY: `rdtsc` exists on every x86-64 CPU and has no preconditions.
        unsafe { core::arch::x86_64::_rdtsc() }
    }
    #[cfg(not(all(target_arch = "x86_64", not(miri))))]
    {
        monotonic_ns()
    }
}

/// Nanoseconds of `CLOCK_MONOTONIC` (a vDSO read: no allocation).
pub(crate) fn monotonic_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is writable; the clock id is valid.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

static EPOCH_SET: AtomicBool = AtomicBool::new(false);
static EPOCH_TICKS: AtomicU64 = AtomicU64::new(0);
static EPOCH_NS: AtomicU64 = AtomicU64::new(0);
/// The last measured tick ratio (`f64` bits), and the tick count it was measured at (0
/// before the first measurement).
static KEPT_NS_PER_TICK: AtomicU64 = AtomicU64::new(0);
static KEPT_AT_TICKS: AtomicU64 = AtomicU64::new(0);

/// Fixes the epoch (time zero of the records) the first time it is called.
pub(crate) fn start_epoch() {
    if !EPOCH_SET.load(Acquire) && !EPOCH_SET.swap(true, AcqRel) {
        let (t, ns) = paired_reading();
        EPOCH_NS.store(ns, Relaxed);
        EPOCH_TICKS.store(t, Release);
    }
}

/// The tick count and the monotonic clock read together: the closest of a few tries, each
/// clock read between two tick reads (a thread preempted in between would skew the tick
/// rate, and two reports would give one record different times).
fn paired_reading() -> (u64, u64) {
    let mut best = (u64::MAX, 0, 0);
    for _ in 0..8 {
        let before = ticks();
        let ns = monotonic_ns();
        let width = ticks().wrapping_sub(before);
        if width < best.0 {
            best = (width, before + width / 2, ns);
        }
    }
    (best.1, best.2)
}

/// Converts ticks into microseconds since the epoch. Built once per report: it may sleep a
/// few milliseconds when the epoch is too recent to measure the tick rate well.
#[derive(Clone, Copy, Debug)]
pub(crate) struct TickScale {
    epoch_ticks: u64,
    ns_per_tick: f64,
    now_ticks: u64,
}

impl TickScale {
    /// The tick rate for a report: the kept one while the time since the epoch is less than
    /// twice the span it was measured over, else measured again (and kept).
    pub(crate) fn measure() -> Self {
        start_epoch();
        let epoch_ticks = EPOCH_TICKS.load(Acquire);
        let now_ticks = ticks();
        // Acquire: the ratio stored before the tick count is at least as new.
        let kept_at = KEPT_AT_TICKS.load(Acquire);
        let kept_span = kept_at.saturating_sub(epoch_ticks);
        if kept_at != 0 && now_ticks.saturating_sub(epoch_ticks) < kept_span.saturating_mul(2) {
            return Self {
                epoch_ticks,
                ns_per_tick: f64::from_bits(KEPT_NS_PER_TICK.load(Relaxed)),
                now_ticks,
            };
        }
        let scale = Self::measure_since(epoch_ticks);
        // A race with another report keeps either measurement: both are good.
        KEPT_NS_PER_TICK.store(scale.ns_per_tick.to_bits(), Relaxed);
        KEPT_AT_TICKS.store(scale.now_ticks, Release);
        scale
    }

    /// Measures the tick rate between the epoch (at `epoch_ticks`) and now.
    fn measure_since(epoch_ticks: u64) -> Self {
        let epoch_ns = EPOCH_NS.load(Relaxed);
        if cfg!(not(all(target_arch = "x86_64", not(miri)))) {
            return Self {
                epoch_ticks,
                ns_per_tick: 1.0,
                now_ticks: ticks(),
            };
        }
        const MIN_SPAN_NS: u64 = 20_000_000;
        loop {
            let (t, ns) = paired_reading();
            let span = ns.saturating_sub(epoch_ns);
            if span >= MIN_SPAN_NS && t > epoch_ticks {
                return Self {
                    epoch_ticks,
                    ns_per_tick: span as f64 / (t - epoch_ticks) as f64,
                    now_ticks: t,
                };
            }
            std::thread::sleep(core::time::Duration::from_nanos(
                MIN_SPAN_NS - span.min(MIN_SPAN_NS) + 1000,
            ));
        }
    }

    /// Microseconds from the epoch to `t`.
    pub(crate) fn us(&self, t: u64) -> u64 {
        (t.saturating_sub(self.epoch_ticks) as f64 * self.ns_per_tick / 1000.0) as u64
    }

    /// Microseconds a span of `ticks` lasted.
    pub(crate) fn span_us(&self, ticks: f64) -> f64 {
        ticks * self.ns_per_tick / 1000.0
    }

    /// Microseconds from the epoch to when the scale was measured.
    pub(crate) fn now_us(&self) -> u64 {
        self.us(self.now_ticks)
    }

    /// The tick count when the scale was measured.
    pub(crate) fn now_ticks(&self) -> u64 {
        self.now_ticks
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reports_close_together_give_a_tick_the_same_time() {
        let t = ticks();
        let first = TickScale::measure();
        let second = TickScale::measure();
        assert_eq!(first.ns_per_tick.to_bits(), second.ns_per_tick.to_bits());
        assert_eq!(first.us(t), second.us(t));
        assert!(second.now_ticks() >= first.now_ticks());
        assert!(first.ns_per_tick > 0.0);
    }
}
