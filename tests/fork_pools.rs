//! `fork()` while other threads are inside pool and thread-pool allocators (including a
//! pool whose pages come from another pool, one whose pages come from a recorded child,
//! and a thread pool's shared lock taken by garbage collection): every child must be able
//! to use each of them, read the report and exit. A pool lock held at the fork by a thread
//! the child does not have would hang the child, so each child gets a deadline and a hung
//! one fails the test.

use allocator_api2::vec::Vec as AVec;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread;
use std::time::{Duration, Instant};
use tagalloc::SystemAllocator;

tagalloc::allocator!(Pages: pool of SystemAllocator {
    page_size: 65536, min_size: 64, max_size: 4096
}, "pages for ForkInner");
tagalloc::allocator!(ForkInner: pool of Pages {
    page_size: 4096, min_size: 8, max_size: 512
}, "a pool whose pages come from a pool");
tagalloc::allocator!(Shared: thread_pool of SystemAllocator {
    page_size: 65536, min_size: 64, max_size: 4096
}, "thread pool");
tagalloc::allocator!(OverShared: pool of Shared {
    page_size: 1024, min_size: 8, max_size: 128
}, "a pool whose pages come from a thread pool");

tagalloc::allocator!(Recorded: child of SystemAllocator, "a recorded child");
tagalloc::allocator!(OverRecorded: pool of Recorded {
    page_size: 4096, min_size: 8, max_size: 256
}, "a pool whose pages are recorded (records taken with the pool's lock held)");

#[global_allocator]
static GLOBAL: SystemAllocator = SystemAllocator::new();

/// How many times the test forks (`FORK_POOLS_ROUNDS` overrides).
fn rounds() -> usize {
    std::env::var("FORK_POOLS_ROUNDS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(300)
}

/// How long a child may take before it counts as hung.
const CHILD_DEADLINE: Duration = Duration::from_secs(20);

/// One worker's loop: blocks through every pool, kept a while and dropped, with the pools'
/// garbage collection now and then (which calls the parents with the pool's lock held).
fn work(stop: &AtomicBool, w: usize) -> u64 {
    let mut inner: std::vec::Vec<AVec<u8, ForkInner>> = std::vec::Vec::new();
    let mut shared: std::vec::Vec<AVec<u8, Shared>> = std::vec::Vec::new();
    let mut over: std::vec::Vec<AVec<u8, OverShared>> = std::vec::Vec::new();
    let mut recorded: std::vec::Vec<AVec<u8, OverRecorded>> = std::vec::Vec::new();
    let mut n = 0u64;
    while !stop.load(Ordering::Relaxed) {
        let i = n as usize;
        let mut a = AVec::with_capacity_in(1 + (i * 37) % 500, ForkInner);
        a.push(w as u8);
        inner.push(a);
        let mut b = AVec::with_capacity_in(1 + (i * 53) % 4000, Shared);
        b.push(w as u8);
        shared.push(b);
        let mut c = AVec::with_capacity_in(1 + (i * 11) % 120, OverShared);
        c.push(w as u8);
        over.push(c);
        let mut d = AVec::with_capacity_in(1 + (i * 29) % 250, OverRecorded);
        d.push(w as u8);
        recorded.push(d);
        if inner.len() > 200 {
            inner.drain(..150);
            shared.drain(..150);
            over.drain(..150);
            recorded.drain(..150);
        }
        if n % 512 == 0 {
            ForkInner.garbage_collect();
            Pages.garbage_collect();
            OverShared.garbage_collect();
            Shared.garbage_collect();
            OverRecorded.garbage_collect();
        }
        n += 1;
    }
    n
}

/// In the child (this thread alone): each pool serves and takes back blocks, the report
/// reads every pool (and, if `dump_records`, the records dump reads the records), and a
/// new thread can use the thread pool.
fn child_can_use_every_pool(dump_records: bool) -> bool {
    let mut a = AVec::with_capacity_in(100, ForkInner);
    a.extend_from_slice(&[1u8; 100]);
    let mut b = AVec::with_capacity_in(3000, Shared);
    b.extend_from_slice(&[2u8; 3000]);
    let mut c = AVec::with_capacity_in(64, OverShared);
    c.extend_from_slice(&[3u8; 64]);
    let mut d = AVec::with_capacity_in(4000, Pages);
    d.extend_from_slice(&[4u8; 4000]);
    let mut e = AVec::with_capacity_in(200, OverRecorded);
    e.extend_from_slice(&[5u8; 200]);
    let contents = a.iter().all(|&x| x == 1)
        && b.iter().all(|&x| x == 2)
        && c.iter().all(|&x| x == 3)
        && d.iter().all(|&x| x == 4)
        && e.iter().all(|&x| x == 5);
    drop((a, b, c, d, e));
    ForkInner.garbage_collect();
    Shared.garbage_collect();
    OverRecorded.garbage_collect();
    let report = tagalloc::report::tree();
    let mut records = std::vec::Vec::new();
    // Resolving the records' call stacks takes a while: only some children do it.
    let recorded = !dump_records
        || (tagalloc::report::dump_records(&mut records).is_ok()
            && String::from_utf8_lossy(&records).contains("Recorded"));
    let named = ["ForkInner", "Pages", "Shared", "OverShared", "OverRecorded"]
        .iter()
        .all(|name| report.contains(name));
    let on_thread = thread::spawn(|| {
        let mut v = AVec::with_capacity_in(10, Shared);
        v.push(7u8);
        v[0] == 7
    })
    .join()
    .unwrap_or(false);
    contents && named && on_thread && recorded
}

/// Waits for `pid` until the deadline; `None` if it is still running then.
fn wait_with_deadline(pid: libc::pid_t) -> Option<i32> {
    let start = Instant::now();
    loop {
        let mut status = 0;
        // SAFETY: `pid` is our child; `status` is writable.
        let waited = unsafe { libc::waitpid(pid, &mut status, libc::WNOHANG) };
        assert!(waited >= 0, "waitpid failed");
        if waited == pid {
            return Some(status);
        }
        if start.elapsed() > CHILD_DEADLINE {
            return None;
        }
        thread::sleep(Duration::from_micros(200));
    }
}

fn main() {
    Recorded.set_records(tagalloc::RecordMode::Full { frames: 4 });
    let stop = Arc::new(AtomicBool::new(false));
    let workers: std::vec::Vec<_> = (0..4)
        .map(|w| {
            let stop = Arc::clone(&stop);
            thread::spawn(move || work(&stop, w))
        })
        .collect();
    // Let every worker get going before the first fork.
    thread::sleep(Duration::from_millis(20));

    let rounds = rounds();
    for round in 0..rounds {
        // SAFETY: fork has no preconditions; the child only allocates, frees, reads the
        // report and exits with `_exit`.
        let pid = unsafe { libc::fork() };
        assert!(pid >= 0, "fork failed");
        if pid == 0 {
            let ok = child_can_use_every_pool(round % 50 == 0);
            // SAFETY: `_exit` ends the child without running the parent's atexit handlers.
            unsafe { libc::_exit(if ok { 0 } else { 1 }) };
        }
        match wait_with_deadline(pid) {
            Some(status) => assert!(
                libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0,
                "child of fork {round} failed: status {status}"
            ),
            None => {
                // SAFETY: `pid` is our own child.
                unsafe { libc::kill(pid, libc::SIGKILL) };
                // SAFETY: as above; reaps the killed child.
                unsafe { libc::waitpid(pid, core::ptr::null_mut(), 0) };
                panic!("child of fork {round} hung (a lock held at the fork stayed held)");
            }
        }
    }
    stop.store(true, Ordering::Relaxed);
    let iterations: u64 = workers.into_iter().map(|w| w.join().unwrap()).sum();
    GLOBAL.validate().unwrap();
    println!("fork_pools: ok ({rounds} children; workers did {iterations} iterations meanwhile)");
}
