//! The purge policy gives memory back to the OS without `garbage_collect`, once it has been
//! idle for the configured delay; and `TAGALLOC_PURGE_DELAY_MS` is read without aborting on
//! bad values. Own binary, no harness: it reads the process's RSS.

use std::process::Command;
use std::time::{Duration, Instant};
use tagalloc::SystemAllocator;
use tagalloc::os::OsAllocator;

#[global_allocator]
static GLOBAL: SystemAllocator = SystemAllocator::new();

fn rss_mib() -> f64 {
    OsAllocator::process_resident_bytes().unwrap() as f64 / (1 << 20) as f64
}

fn child_mode(mode: &str) {
    // Print what the allocator resolved from the environment.
    let delay = GLOBAL.purge_delay();
    println!("{mode}: {delay:?}");
}

fn main() {
    if let Ok(mode) = std::env::var("PURGE_TEST_CHILD") {
        return child_mode(&mode);
    }

    // Environment handling, in child processes.
    let exe = std::env::current_exe().unwrap();
    for (value, expect_out, expect_err) in [
        ("250", "Some(250ms)", ""),
        ("never", "None", ""),
        (
            "soon",
            "Some(1s)",
            "TAGALLOC_PURGE_DELAY_MS=\"soon\" ignored",
        ),
        ("", "Some(1s)", "ignored: empty value"),
    ] {
        let out = Command::new(&exe)
            .env("PURGE_TEST_CHILD", "env")
            .env("TAGALLOC_PURGE_DELAY_MS", value)
            .output()
            .unwrap();
        assert!(out.status.success());
        let stdout = String::from_utf8_lossy(&out.stdout);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(stdout.contains(expect_out), "{value:?}: {stdout}");
        assert!(stderr.contains(expect_err), "{value:?}: {stderr}");
    }

    // The policy itself.
    GLOBAL.set_purge_delay(Some(Duration::from_millis(50)));
    let start = rss_mib();
    let mut small: Vec<Box<[u8; 200]>> = (0..400_000).map(|i| Box::new([i as u8; 200])).collect();
    let mut large: Vec<Vec<u8>> = (0..300).map(|i| vec![i as u8; 300_000]).collect();
    let peak = rss_mib();
    assert!(
        peak > start + 150.0,
        "the workload should have touched memory"
    );
    small.clear();
    small.shrink_to_fit();
    large.clear();
    large.shrink_to_fit();
    GLOBAL.flush_thread_cache();
    let freed = rss_mib();

    // Keep the allocator's slow paths busy (as a running program would) for a while.
    let deadline = Instant::now() + Duration::from_millis(600);
    let mut after = freed;
    while Instant::now() < deadline {
        // black_box: the optimiser may otherwise remove an allocation that is freed unused.
        let v = std::hint::black_box(vec![0u8; 100_000]);
        drop(v);
        for _ in 0..200 {
            drop(std::hint::black_box(Box::new([0u8; 48])));
        }
        std::thread::sleep(Duration::from_millis(5));
        after = rss_mib();
        if after < start + 8.0 {
            break;
        }
    }
    println!(
        "purge: RSS {start:.1} MiB at start, {peak:.1} at peak, {freed:.1} right after freeing, \
         {after:.1} after the purge delay"
    );
    assert!(
        after < start + 8.0,
        "RSS should fall back near its start without garbage_collect"
    );
    GLOBAL.validate().unwrap();
}
