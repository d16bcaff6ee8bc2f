//! Under a multi-threaded workload with cross-thread frees and reallocs, the live records
//! of each recorded allocator are exactly its live blocks: the same count and bytes as its
//! statistics, and (for the handles) the very set of blocks the program still holds.
//!
//! Runs in a child process (this binary re-executed) so that `TAGALLOC_RECORDS` is set
//! before the first allocation: the `SystemAllocator` records from its very first block,
//! so its records must match its statistics exactly, process-wide.

use allocator_api2::vec::Vec as AVec;
use std::collections::HashMap;
use std::process::Command;
use std::sync::mpsc;
use std::thread;
use tagalloc::records::{self, RecordTotals};
use tagalloc::{AllocatorStats, RecordMode, SystemAllocator};

#[global_allocator]
static GLOBAL: SystemAllocator = SystemAllocator::new();

tagalloc::allocator!(RecChild: child of SystemAllocator, "records test child");
tagalloc::allocator!(RecGrandchild: child of RecChild, "records test grandchild");
tagalloc::allocator!(RecPool: pool of SystemAllocator, "records test pool");
tagalloc::allocator!(
    RecThreadPool: thread_pool of SystemAllocator { page_size: 16384, min_size: 8, max_size: 512 },
    "records test thread pool"
);

const CHILD_VAR: &str = "TAGALLOC_RECORDS_THREADS_CHILD";
const THREADS: usize = 4;
const ROUNDS: usize = 3000;

/// Blocks of every allocator, so one channel can carry them between threads.
enum Block {
    Child(AVec<u8, RecChild>),
    Grandchild(AVec<u8, RecGrandchild>),
    Pool(AVec<u8, RecPool>),
    ThreadPool(AVec<u8, RecThreadPool>),
    Global(Vec<u8>),
}

impl Block {
    /// (allocator name, address, requested bytes).
    fn key(&self) -> (&'static str, usize, usize) {
        match self {
            Block::Child(v) => ("RecChild", v.as_ptr() as usize, v.capacity()),
            Block::Grandchild(v) => ("RecGrandchild", v.as_ptr() as usize, v.capacity()),
            Block::Pool(v) => ("RecPool", v.as_ptr() as usize, v.capacity()),
            Block::ThreadPool(v) => ("RecThreadPool", v.as_ptr() as usize, v.capacity()),
            Block::Global(v) => ("SystemAllocator", v.as_ptr() as usize, v.capacity()),
        }
    }

    /// Grows the block (a realloc through the allocator).
    fn grow(&mut self, extra: usize) {
        match self {
            Block::Child(v) => v.reserve_exact(v.capacity() + extra),
            Block::Grandchild(v) => v.reserve_exact(v.capacity() + extra),
            Block::Pool(v) => v.reserve_exact((v.capacity() + extra).min(512) - v.capacity()),
            Block::ThreadPool(v) => v.reserve_exact((v.capacity() + extra).min(512) - v.capacity()),
            Block::Global(v) => v.reserve_exact(v.capacity() + extra),
        }
    }
}

/// A small deterministic generator.
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> usize {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0 as usize
    }
}

fn make(rng: &mut Rng) -> Block {
    let small = 1 + rng.next() % 200;
    let any = match rng.next() % 16 {
        0 => 20_000 + rng.next() % 100_000, // large blocks
        _ => 1 + rng.next() % 3000,
    };
    let mut block = match rng.next() % 5 {
        0 => Block::Child(AVec::with_capacity_in(any, RecChild)),
        1 => Block::Grandchild(AVec::with_capacity_in(any, RecGrandchild)),
        2 => Block::Pool(AVec::with_capacity_in(small, RecPool)),
        3 => Block::ThreadPool(AVec::with_capacity_in(small, RecThreadPool)),
        _ => Block::Global(Vec::with_capacity(any)),
    };
    if rng.next() % 4 == 0 {
        block.grow(1 + rng.next() % 300);
    }
    block
}

/// Each thread allocates, keeps some blocks, frees some itself, and sends some to the next
/// thread, which frees them (cross-thread frees). Returns the blocks still held.
fn workload() -> Vec<Block> {
    let (senders, receivers): (Vec<_>, Vec<_>) =
        (0..THREADS).map(|_| mpsc::channel::<Block>()).unzip();
    let handles: Vec<_> = receivers
        .into_iter()
        .enumerate()
        .map(|(t, inbox)| {
            let next = senders[(t + 1) % THREADS].clone();
            thread::spawn(move || {
                let mut rng = Rng(0x9E37_79B9 + t as u64);
                let mut kept = Vec::new();
                let mut recent: Vec<Block> = Vec::new();
                for round in 0..ROUNDS {
                    let block = make(&mut rng);
                    match rng.next() % 4 {
                        0 => kept.push(block),
                        1 => drop(block),
                        2 => next.send(block).unwrap(),
                        _ => recent.push(block),
                    }
                    if recent.len() > 16 {
                        recent.swap_remove(rng.next() % recent.len());
                    }
                    while let Ok(theirs) = inbox.try_recv() {
                        if round % 3 == 0 {
                            kept.push(theirs); // freed later, by the main thread
                        }
                    }
                }
                drop(next);
                // Whatever arrives until every sender is gone is freed here.
                kept.retain(|b| !matches!(b, Block::Pool(_)) || rng.next() % 2 == 0);
                (kept, inbox)
            })
        })
        .collect();
    drop(senders);
    let mut held = Vec::new();
    let mut inboxes = Vec::new();
    for h in handles {
        let (kept, inbox) = h.join().unwrap();
        held.extend(kept);
        inboxes.push(inbox);
    }
    for inbox in inboxes {
        for b in inbox.try_iter() {
            drop(b);
        }
    }
    held
}

fn check_totals(name: &str, stats: AllocatorStats, totals: RecordTotals) {
    assert_eq!(
        (totals.records, totals.bytes),
        (stats.live_blocks, stats.live_granted_bytes),
        "{name}: records {totals:?} against statistics {stats:?}"
    );
    if let Some(requested) = stats.live_requested_bytes {
        assert_eq!(totals.requested, requested, "{name}: requested bytes");
    }
}

fn child() {
    // RecChild and the grandchild are set by the environment (the grandchild by its
    // description); the pools from code.
    assert_eq!(RecChild.record_mode(), RecordMode::Full { frames: 4 });
    RecPool.set_records(RecordMode::Basic);
    RecThreadPool.set_records(RecordMode::full());
    assert_eq!(GLOBAL.record_mode(), RecordMode::Basic);

    let held = workload();

    // The SystemAllocator, process-wide: read statistics and records with no allocation
    // in between (both are allocation-free), and again to be sure nothing moved.
    GLOBAL.flush_thread_cache();
    let system = tagalloc::registry::SYSTEM.stats();
    let totals = records::live_totals(&tagalloc::registry::SYSTEM);
    assert_eq!(system, tagalloc::registry::SYSTEM.stats());
    assert_eq!(
        (totals.records, totals.bytes),
        (system.live_blocks, system.live_granted_bytes),
        "SystemAllocator: records {totals:?} against statistics {system:?}"
    );

    check_totals(
        "RecChild",
        RecChild.stats(),
        records::live_totals(RecChild::registration()),
    );
    check_totals(
        "RecGrandchild",
        RecGrandchild.stats(),
        records::live_totals(RecGrandchild::registration()),
    );
    check_totals(
        "RecPool",
        RecPool.stats(),
        records::live_totals(RecPool::registration()),
    );
    check_totals(
        "RecThreadPool",
        RecThreadPool.stats(),
        records::live_totals(RecThreadPool::registration()),
    );

    // The handles: the records are exactly the blocks still held, address by address. A
    // grandchild's blocks are blocks of its parent too.
    let snapshot = records::snapshot();
    for name in ["RecChild", "RecGrandchild", "RecPool", "RecThreadPool"] {
        let mut expected: Vec<(usize, usize)> = held
            .iter()
            .map(Block::key)
            .filter(|k| k.0 == name || (name == "RecChild" && k.0 == "RecGrandchild"))
            .map(|k| (k.1, k.2))
            .collect();
        expected.sort_unstable();
        let recorded: Vec<(usize, usize)> = snapshot
            .records_of(name)
            .map(|r| (r.address, r.requested))
            .collect();
        assert!(!expected.is_empty(), "{name}: the workload kept no block");
        let missing: Vec<_> = expected
            .iter()
            .filter(|b| !recorded.contains(b))
            .take(5)
            .collect();
        let extra: Vec<_> = recorded
            .iter()
            .filter(|b| !expected.contains(b))
            .take(5)
            .collect();
        assert!(
            recorded == expected,
            "{name}: {} records for {} held blocks; held but not recorded (first 5): {missing:?}; \
             recorded but not held: {extra:?}",
            recorded.len(),
            expected.len()
        );
        // Full records carry stacks.
        if name == "RecChild" || name == "RecThreadPool" {
            assert!(
                snapshot.records_of(name).all(|r| r.stack != 0),
                "{name} stacks"
            );
        }
    }
    let mut by_allocator: HashMap<&str, usize> = HashMap::new();
    for b in &held {
        *by_allocator.entry(b.key().0).or_default() += 1;
    }
    drop(snapshot);
    drop(held);
    for reg in [
        RecChild::registration(),
        RecGrandchild::registration(),
        RecPool::registration(),
        RecThreadPool::registration(),
    ] {
        assert_eq!(records::live_totals(reg).records, 0, "{}", reg.name());
    }
    println!(
        "records_threads: exact under {THREADS} threads; blocks held per allocator: {by_allocator:?}"
    );
}

fn main() {
    if std::env::var_os(CHILD_VAR).is_some() {
        child();
        return;
    }
    let out = Command::new(std::env::current_exe().unwrap())
        .env(CHILD_VAR, "1")
        .env(
            "TAGALLOC_RECORDS",
            "SystemAllocator=basic, RecChild=full:4, Records Test Grandchild=basic",
        )
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "child failed\n{stdout}\n{stderr}");
    print!("{stdout}");
    assert!(stdout.contains("records_threads: exact"), "{stdout}");
    assert!(
        !stderr.contains("tagalloc:"),
        "unexpected warning: {stderr}"
    );
}
