//! Scoped tags under threads and `fork()`, with tagalloc as the global allocator:
//! - 8 threads, each inside one of 8 tags, build std containers and hand half of their blocks
//!   to the next thread, which frees them inside its own tag; at a barrier every tag holds
//!   exactly what its threads still own, and at the end every tag is back to where it was;
//! - 100 forks while those threads run: the child inherits tagged blocks, frees them and
//!   allocates inside a tag, and its figures stay exact;
//! - a tag entered before `main` (in an ELF constructor) counts from the first allocation;
//! - meanwhile the records settings are switched on and off, and each worker's frees stay on
//!   the fast path of its tag's lane.
//!
//! One binary without the test harness, so no other test's threads share the tags.

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Barrier, mpsc};
use tagalloc::{AllocatorStats, RecordMode, SystemAllocator, TagGuard};

#[global_allocator]
static GLOBAL: SystemAllocator = SystemAllocator::new();

tagalloc::allocator!(W0: child of SystemAllocator, "worker 0");
tagalloc::allocator!(W1: child of SystemAllocator, "worker 1");
tagalloc::allocator!(W2: child of SystemAllocator, "worker 2");
tagalloc::allocator!(W3: child of SystemAllocator, "worker 3");
tagalloc::allocator!(W4: child of SystemAllocator, "worker 4");
tagalloc::allocator!(W5: child of SystemAllocator, "worker 5");
tagalloc::allocator!(W6: child of SystemAllocator, "worker 6");
tagalloc::allocator!(W7: child of SystemAllocator, "worker 7");
tagalloc::allocator!(Forked: child of SystemAllocator, "allocations in forked children");
tagalloc::allocator!(Early: child of SystemAllocator, "entered before main");

const THREADS: usize = 8;
const ENTER: [fn() -> TagGuard; THREADS] = [
    || W0.enter(),
    || W1.enter(),
    || W2.enter(),
    || W3.enter(),
    || W4.enter(),
    || W5.enter(),
    || W6.enter(),
    || W7.enter(),
];
const STATS: [fn() -> AllocatorStats; THREADS] = [
    || W0.stats(),
    || W1.stats(),
    || W2.stats(),
    || W3.stats(),
    || W4.stats(),
    || W5.stats(),
    || W6.stats(),
    || W7.stats(),
];

/// Rounds in which a worker found its frees not routed to its current lane.
static OFF_ROUTE: AtomicUsize = AtomicUsize::new(0);

/// Blocks of one kind or another, as a program holds them (held, never read: their blocks
/// are what the test counts).
#[allow(dead_code)]
enum Thing {
    Text(String),
    Numbers(Vec<u64>),
    Map(HashMap<u32, String>),
    Tree(BTreeMap<u64, Vec<u8>>),
    Big(Vec<u8>),
}

fn make(i: usize) -> Thing {
    match i % 5 {
        0 => Thing::Text(format!("thing number {i} with some text")),
        1 => Thing::Numbers((0..(i % 300) as u64).collect()),
        2 => Thing::Map((0..(i % 20) as u32).map(|k| (k, k.to_string())).collect()),
        3 => Thing::Tree(
            (0..(i % 40) as u64)
                .map(|k| (k, vec![0u8; k as usize]))
                .collect(),
        ),
        _ => Thing::Big(vec![1u8; 5_000 + i * 97]),
    }
}

/// Things on their way to the next worker.
struct Batch(Vec<Thing>);

/// Every worker tag is back where it started: live figures and balanced calls.
fn check(start: &[AllocatorStats], what: &str) {
    for t in 0..THREADS {
        let (st, s0) = (STATS[t](), &start[t]);
        assert_eq!(
            (
                st.live_blocks,
                st.live_granted_bytes,
                st.live_requested_bytes
            ),
            (
                s0.live_blocks,
                s0.live_granted_bytes,
                s0.live_requested_bytes
            ),
            "{what}: tag W{t}"
        );
        assert_eq!(
            st.allocations - s0.allocations,
            st.frees - s0.frees,
            "{what}: W{t}"
        );
    }
}

/// Each worker: inside its tag, builds things; sends half to the next worker and frees the
/// half it receives, inside its own tag. Between rounds, the live figures of its tag are
/// exactly what it holds plus what is in flight, which the main thread checks at barriers.
fn workers(rounds: usize, forking: &AtomicBool) -> usize {
    let barrier = Arc::new(Barrier::new(THREADS + 1));
    let (senders, receivers): (Vec<_>, Vec<_>) =
        (0..THREADS).map(|_| mpsc::channel::<Batch>()).unzip();
    let mut receivers: Vec<Option<mpsc::Receiver<Batch>>> =
        receivers.into_iter().map(Some).collect();
    let start: Vec<AllocatorStats> = (0..THREADS).map(|t| STATS[t]()).collect();
    let made = AtomicUsize::new(0);
    std::thread::scope(|s| {
        let mut handles = Vec::new();
        for t in 0..THREADS {
            let to_next = senders[(t + 1) % THREADS].clone();
            let from_prev = receivers[t].take().unwrap();
            let barrier = Arc::clone(&barrier);
            let made = &made;
            handles.push(s.spawn(move || {
                let _tag = ENTER[t]();
                let mut kept = Vec::new();
                for round in 0..rounds {
                    let mut mine: Vec<Thing> = (0..50).map(|i| make(round * 50 + i + t)).collect();
                    made.fetch_add(50, Ordering::Relaxed);
                    let theirs = mine.split_off(25);
                    to_next.send(Batch(theirs)).unwrap();
                    kept.push(mine);
                    let Batch(received) = from_prev.recv().unwrap();
                    drop(received); // the previous worker's tag, freed here
                    if kept.len() > 4 {
                        kept.remove(0);
                    }
                    // Records settings change meanwhile (`flip_records`): the thread's frees
                    // still go straight to its tag's lane (counted, not asserted here: a
                    // worker that panicked would leave the others waiting for it).
                    // (`None` where routes cannot name the thread's lanes: valgrind.)
                    if tagalloc::scope::__frees_follow_the_scope() == Some(false) {
                        OFF_ROUTE.fetch_add(1, Ordering::Relaxed);
                    }
                    if round == rounds / 2 {
                        barrier.wait(); // the main thread looks at the figures here
                        barrier.wait();
                    }
                }
                drop(kept);
                drop(to_next);
            }));
        }
        drop(senders);
        barrier.wait();
        // Mid-run: every tag holds at least the four rounds its worker keeps; all counts sane.
        for t in 0..THREADS {
            let st = STATS[t]();
            assert!(
                st.live_blocks > start[t].live_blocks,
                "W{t} holds its kept blocks"
            );
            assert!(st.allocations >= st.frees);
        }
        forking.store(true, Ordering::Relaxed);
        barrier.wait();
        // Joined by hand: a scope's own end does not wait for the threads' TLS destructors,
        // which free what std keeps per thread (a channel's wait context, allocated inside
        // the worker's tag).
        for h in handles {
            h.join().unwrap();
        }
    });
    check(&start, "after the workers");
    assert_eq!(
        OFF_ROUTE.load(Ordering::Relaxed),
        0,
        "rounds that found a worker's frees not routed to its tag's lane"
    );
    made.load(Ordering::Relaxed)
}

/// In a forked child: inherited tagged blocks are freed exactly; new ones too.
fn in_forked_child(inherited: Vec<String>) -> bool {
    let start = Forked.stats();
    drop(inherited);
    let freed = Forked.stats();
    let more = Forked.scope(|| (0..100).map(|i| format!("{i:>40}")).collect::<Vec<_>>());
    let held = Forked.stats();
    let t = std::thread::spawn(move || drop(more)).join().is_ok();
    let end = Forked.stats();
    t && freed.live_blocks + 1001 == start.live_blocks
        && held.live_blocks == freed.live_blocks + 101
        && end.live_blocks == freed.live_blocks
        && end.live_granted_bytes == freed.live_granted_bytes
}

/// Entered by the ELF constructor below, before `main` and before the Rust runtime's own
/// allocations.
static EARLY_GUARD_ENTERED: AtomicBool = AtomicBool::new(false);
static EARLY_BLOCK: AtomicUsize = AtomicUsize::new(0);

extern "C" fn before_main() {
    let guard = Early.enter();
    let block = Box::new([3u8; 100]);
    EARLY_BLOCK.store(Box::into_raw(block) as usize, Ordering::Relaxed);
    drop(guard);
    EARLY_GUARD_ENTERED.store(true, Ordering::Relaxed);
}

#[used]
#[unsafe(link_section = ".init_array")]
static BEFORE_MAIN: extern "C" fn() = before_main;

/// Changes the records settings of the `SystemAllocator` and of one worker's tag while the
/// workers run, as a profiler switched on and off would: their figures must stay exact, and
/// their frees on the fast path (checked by each worker every round).
fn flip_records(stop: &AtomicBool) {
    let mut flips = 0u32;
    while !stop.load(Ordering::Relaxed) {
        let (system, child) = if flips % 2 == 0 {
            (RecordMode::sample(), RecordMode::sample())
        } else {
            (RecordMode::Off, RecordMode::Off)
        };
        GLOBAL.set_records(system);
        W3.set_records(child);
        flips += 1;
        std::thread::sleep(std::time::Duration::from_millis(2));
    }
    GLOBAL.set_records(RecordMode::Off);
    W3.set_records(RecordMode::Off);
}

fn main() {
    // The block allocated before main is Early's, and freeing it here uncounts it.
    assert!(EARLY_GUARD_ENTERED.load(Ordering::Relaxed));
    assert_eq!(Early.stats().live_blocks, 1);
    // SAFETY: the block leaked by `before_main`, freed once.
    drop(unsafe { Box::from_raw(EARLY_BLOCK.load(Ordering::Relaxed) as *mut [u8; 100]) });
    assert_eq!(Early.stats().live_blocks, 0);

    // ThreadSanitizer cannot follow a threaded process through fork() (the child here
    // starts a thread): stress/run.sh's TSan stage sets this to run the rest without forks.
    let no_fork = std::env::var_os("TAGALLOC_TEST_NO_FORK").is_some();
    let forking = AtomicBool::new(false);
    let stop = Arc::new(AtomicBool::new(false));
    let made = std::thread::scope(|s| {
        // Forks while the workers run (once they reached the middle).
        let forker = s.spawn(|| {
            while !forking.load(Ordering::Relaxed) {
                std::thread::yield_now();
            }
            let mut forks = 0;
            while !no_fork && !stop.load(Ordering::Relaxed) && forks < 100 {
                let inherited =
                    Forked.scope(|| (0..1000).map(|i| i.to_string()).collect::<Vec<_>>());
                // SAFETY: fork has no preconditions; the child only allocates, frees and exits.
                let pid = unsafe { libc::fork() };
                assert!(pid >= 0, "fork failed");
                if pid == 0 {
                    let ok = in_forked_child(inherited);
                    // SAFETY: ends the child without running the parent's exit handlers.
                    unsafe { libc::_exit(if ok { 0 } else { 1 }) };
                }
                drop(inherited);
                let mut status = 0;
                // SAFETY: `pid` is our child; `status` is writable.
                assert_eq!(unsafe { libc::waitpid(pid, &mut status, 0) }, pid);
                assert!(
                    libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0,
                    "forked child failed: status {status}"
                );
                forks += 1;
            }
            forks
        });
        let flipper = s.spawn(|| flip_records(&stop));
        let made = workers(200, &forking);
        stop.store(true, Ordering::Relaxed);
        flipper.join().unwrap();
        let forks = forker.join().unwrap();
        assert!(no_fork || forks >= 1, "no fork ran while the workers did");
        made
    });
    assert_eq!(Forked.stats().live_blocks, 0);
    GLOBAL.validate().unwrap();
    let forks = if no_fork {
        "forks skipped"
    } else {
        "forks checked"
    };
    println!(
        "scoped_threads: ok ({THREADS} threads in {THREADS} tags made {made} things; {forks})"
    );
}
