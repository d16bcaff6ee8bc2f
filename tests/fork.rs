//! `fork()` while other threads allocate: the child must be able to allocate and free.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread;
use tagalloc::SystemAllocator;

#[global_allocator]
static GLOBAL: SystemAllocator = SystemAllocator::new();

fn main() {
    let stop = Arc::new(AtomicBool::new(false));
    let workers: Vec<_> = (0..3)
        .map(|w| {
            let stop = Arc::clone(&stop);
            thread::spawn(move || {
                let mut keep = Vec::new();
                let mut n = 0u64;
                while !stop.load(Ordering::Relaxed) {
                    keep.push(vec![w as u8; (n as usize * 131) % 70_000]);
                    if keep.len() > 64 {
                        keep.drain(..32);
                    }
                    n += 1;
                }
                n
            })
        })
        .collect();

    for _ in 0..200 {
        // SAFETY: fork has no preconditions; the child only allocates, frees and exits.
        let pid = unsafe { libc::fork() };
        assert!(pid >= 0, "fork failed");
        if pid == 0 {
            let mut v: Vec<String> = (0..2000).map(|i| format!("child {i}")).collect();
            v.retain(|s| s.ends_with('7'));
            let big = vec![1u8; 3 << 20];
            let ok = v.len() == 200 && big.iter().all(|&b| b == 1);
            let t = thread::spawn(|| vec![0u64; 1000].len()).join().unwrap() == 1000;
            // SAFETY: `_exit` ends the child without running the parent's atexit handlers.
            unsafe { libc::_exit(if ok && t { 0 } else { 1 }) };
        }
        let mut status = 0;
        // SAFETY: `pid` is our child; `status` is writable.
        let waited = unsafe { libc::waitpid(pid, &mut status, 0) };
        assert_eq!(waited, pid);
        assert!(
            libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0,
            "child failed: status {status}"
        );
    }
    stop.store(true, Ordering::Relaxed);
    let iterations: u64 = workers.into_iter().map(|w| w.join().unwrap()).sum();
    GLOBAL.validate().unwrap();
    println!("fork: ok (200 children; workers did {iterations} iterations meanwhile)");
}
