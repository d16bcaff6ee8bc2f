//! The clock the timed loops read: this thread's CPU time.
//!
//! The benchmark machine is shared: other processes take the CPU for milliseconds at a time,
//! which a wall clock counts against whichever contender was running. The thread's CPU time
//! leaves that out (what the others do to the caches still shows). Each reading is a system
//! call of well under a microsecond, so it times whole loops, not single calls.

/// Nanoseconds of CPU time this thread has used.
pub fn thread_cpu_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid, writable timespec; the clock id is a constant Linux knows.
    let rc = unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    assert_eq!(rc, 0, "clock_gettime(CLOCK_THREAD_CPUTIME_ID) failed");
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}
