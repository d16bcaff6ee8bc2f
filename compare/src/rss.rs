//! Resident-set-size and CPU-time readings of the current process.
//!
//! Linux keeps both the current RSS (`VmRSS`) and its high-water mark (`VmHWM`) in
//! `/proc/self/status`; because each workload runs in a fresh process, `VmHWM` is that
//! workload's peak. `getrusage` would give only the peak, so `/proc` is read for both.

/// One reading, in KiB (the unit the kernel reports).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Rss {
    /// `VmRSS`: resident now.
    pub current_kib: u64,
    /// `VmHWM`: the most that was ever resident in this process.
    pub peak_kib: u64,
}

/// Reads `/proc/self/status`; `None` where it does not exist (not Linux) or lacks the fields.
pub fn read() -> Option<Rss> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    parse(&status)
}

/// Extracts `VmRSS` and `VmHWM` from the text of a `/proc/<pid>/status` file.
pub fn parse(status: &str) -> Option<Rss> {
    let field = |name: &str| -> Option<u64> {
        let line = status.lines().find(|l| l.starts_with(name))?;
        line[name.len()..]
            .trim()
            .trim_end_matches("kB")
            .trim()
            .parse()
            .ok()
    };
    Some(Rss {
        current_kib: field("VmRSS:")?,
        peak_kib: field("VmHWM:")?,
    })
}

/// User plus system CPU time this process has used so far, in milliseconds (all threads,
/// including ones already joined). On a shared machine it is less disturbed than wall time by
/// being descheduled, though it still grows with cache contention.
pub fn cpu_ms() -> f64 {
    // SAFETY: an all-zero `rusage` is a valid value of this plain C struct.
    let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: `usage` is a valid, writable `rusage`; RUSAGE_SELF is always accepted.
    if unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut usage) } != 0 {
        return 0.0;
    }
    let ms = |t: libc::timeval| t.tv_sec as f64 * 1e3 + t.tv_usec as f64 / 1e3;
    ms(usage.ru_utime) + ms(usage.ru_stime)
}

#[cfg(test)]
mod tests {
    #[test]
    fn parses_status_text() {
        let text = "Name:\tx\nVmPeak:\t  9000 kB\nVmHWM:\t    4242 kB\nVmRSS:\t    1234 kB\n";
        let r = super::parse(text).unwrap();
        assert_eq!((r.current_kib, r.peak_kib), (1234, 4242));
    }

    #[test]
    fn cpu_time_grows() {
        let a = super::cpu_ms();
        let mut x = 0u64;
        for i in 0..20_000_000u64 {
            x = std::hint::black_box(x.wrapping_add(i));
        }
        assert!(super::cpu_ms() > a, "{x}");
    }

    #[test]
    fn reads_this_process() {
        if let Some(r) = super::read() {
            assert!(r.peak_kib >= r.current_kib && r.current_kib > 0);
        }
    }
}
