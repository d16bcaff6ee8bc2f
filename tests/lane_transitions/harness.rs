//! The stress harness behind `tests/lane_transitions.rs` and `tests/lane_transitions_global.rs`.
//!
//! Worker threads allocate, grow, shrink and free blocks of a child of the `SystemAllocator`
//! (the parent) and of a child of that child, hand blocks to one another (so blocks are
//! freed on other threads than the ones that allocated them, and outlive their threads), and
//! exit and are replaced all along. Meanwhile a controller thread keeps setting and removing
//! budgets (Warn and Fail) and records on both allocators, which closes and reopens their
//! lanes of the thread caches under traffic. Every few rounds it stops the workers between
//! two calls and compares both allocators' statistics with the test's own tally.

use allocator_api2::alloc::Allocator;
use std::alloc::Layout;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU64, Ordering::Relaxed};
use std::sync::{Mutex, Once, RwLock};
use std::time::{Duration, Instant};
use tagalloc::{AllocatorStats, BlockAllocator, BudgetEvent, BudgetMode, RecordMode, Registration};

/// How long the controller runs and what the workers do.
#[derive(Clone, Copy)]
pub struct Config {
    /// Seconds of traffic by default (`LANE_TRANSITIONS_SECS` overrides it).
    pub secs: u64,
    /// The percentage of requests of 16 KiB to 2 MiB (the others are 8 B to 4 KiB).
    pub large_percent: u64,
    /// Calls each worker makes before it exits (and is replaced by a new thread).
    pub calls_per_worker: usize,
    /// Whether the controller sets Fail budgets just above the live bytes (so requests are
    /// refused), or only budgets that are never reached.
    pub tight_fail_budgets: bool,
    /// Whether the controller turns records on and off too.
    pub toggle_records: bool,
    /// The controller checks the statistics every this many rounds.
    pub check_every: u32,
}

/// Worker threads running at any time.
const WORKERS: usize = 4;
/// Blocks a worker holds at most.
const MAX_HELD: usize = 400;

/// A xorshift generator: the tests need cheap numbers, not good ones.
struct Rng(u64);

impl Rng {
    /// A generator from `seed` (xorshift needs a nonzero state).
    fn new(seed: u64) -> Self {
        Rng(seed | 1)
    }

    /// A number in `0..n`.
    fn below(&mut self, n: u64) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0 % n
    }
}

/// A live block, filled with `fill` over its requested size.
struct Block {
    ptr: NonNull<u8>,
    layout: Layout,
    granted: usize,
    in_child: bool,
    fill: u8,
}

// SAFETY: whoever holds a `Block` owns the memory it points to (no other copy of the pointer
// is kept), and both allocators may be called from any thread: moving the value moves the
// ownership to the receiving thread.
unsafe impl Send for Block {}

impl Block {
    /// Panics unless the block's requested bytes all still hold its fill byte.
    fn check(&self, when: &str) {
        // SAFETY: the block is live and its first `layout.size()` bytes were written by `fill`.
        let bytes = unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.layout.size()) };
        if let Some(i) = bytes.iter().position(|&b| b != self.fill) {
            panic!(
                "corrupted block ({when}): {:p}, {:?}, in_child {}: byte {i} is {:#x}, not {:#x}",
                self.ptr, self.layout, self.in_child, bytes[i], self.fill
            );
        }
    }

    /// Writes the fill byte over the requested size.
    fn fill(&self) {
        // SAFETY: the block is live and at least `layout.size()` bytes long.
        unsafe { self.ptr.as_ptr().write_bytes(self.fill, self.layout.size()) };
    }
}

/// What the test holds of one allocator's blocks: the blocks it got from that allocator
/// itself (the parent's figures also include the child's).
#[derive(Default)]
struct Tally {
    granted: AtomicI64,
    requested: AtomicI64,
    blocks: AtomicI64,
    allocations: AtomicU64,
    reallocations: AtomicU64,
    /// Allocations and growths the allocator refused.
    refusals: AtomicU64,
}

impl Tally {
    /// Adds a block that was handed out.
    fn add(&self, granted: usize, requested: usize) {
        self.granted.fetch_add(granted as i64, Relaxed);
        self.requested.fetch_add(requested as i64, Relaxed);
        self.blocks.fetch_add(1, Relaxed);
    }

    /// Removes a block that was freed.
    fn remove(&self, granted: usize, requested: usize) {
        self.granted.fetch_sub(granted as i64, Relaxed);
        self.requested.fetch_sub(requested as i64, Relaxed);
        self.blocks.fetch_sub(1, Relaxed);
    }

    /// (live granted bytes, live requested bytes, live blocks)
    fn live(&self) -> (usize, usize, usize) {
        let get = |n: &AtomicI64| n.load(Relaxed) as usize;
        (get(&self.granted), get(&self.requested), get(&self.blocks))
    }

    /// Allocations plus resizes that kept the block.
    fn calls(&self) -> u64 {
        self.allocations.load(Relaxed) + self.reallocations.load(Relaxed)
    }
}

/// What the workers and the controller share.
struct Shared<'a> {
    /// The parent (index 0) and the child (index 1).
    allocators: [&'a (dyn Allocator + Sync); 2],
    registrations: [&'static Registration; 2],
    tallies: [Tally; 2],
    /// Blocks handed from one worker to another.
    mailbox: Mutex<Vec<Block>>,
    /// Workers hold it for reading during each call; the controller takes it for writing to
    /// check the statistics while no call is under way.
    gate: RwLock<()>,
    stop: AtomicBool,
    next_fill: AtomicU64,
}

impl Shared<'_> {
    /// The child if `in_child`, else the parent.
    fn allocator(&self, in_child: bool) -> &dyn Allocator {
        self.allocators[in_child as usize]
    }

    /// The tally of the child if `in_child`, else the parent's.
    fn tally(&self, in_child: bool) -> &Tally {
        &self.tallies[in_child as usize]
    }

    /// Allocates a random block from a random one of the two allocators (`None` if refused).
    fn allocate(&self, rng: &mut Rng, large_percent: u64) -> Option<Block> {
        let layout = random_layout(rng, large_percent);
        let in_child = rng.below(2) == 1;
        let tally = self.tally(in_child);
        let Ok(ptr) = self.allocator(in_child).allocate(layout) else {
            tally.refusals.fetch_add(1, Relaxed);
            return None;
        };
        assert!(ptr.len() >= layout.size());
        assert_eq!(ptr.cast::<u8>().as_ptr() as usize % layout.align(), 0);
        let block = Block {
            ptr: ptr.cast(),
            layout,
            granted: ptr.len(),
            in_child,
            fill: (self.next_fill.fetch_add(1, Relaxed) % 255 + 1) as u8,
        };
        block.fill();
        tally.add(block.granted, layout.size());
        tally.allocations.fetch_add(1, Relaxed);
        Some(block)
    }

    /// Checks the block's contents and frees it.
    fn free(&self, block: Block) {
        block.check("before the free");
        // SAFETY: the block is live, from this allocator, with this layout; `block` is
        // consumed, so it is freed once.
        unsafe {
            self.allocator(block.in_child)
                .deallocate(block.ptr, block.layout)
        };
        self.tally(block.in_child)
            .remove(block.granted, block.layout.size());
    }

    /// Grows or shrinks the block to a random size (same alignment). Only a growth may be
    /// refused, and a refused one leaves the block as it was.
    fn resize(&self, rng: &mut Rng, block: &mut Block, large_percent: u64) {
        block.check("before the resize");
        let size = random_layout(rng, large_percent).size();
        let new_layout = Layout::from_size_align(size, block.layout.align()).unwrap();
        if size == block.layout.size() {
            return;
        }
        let allocator = self.allocator(block.in_child);
        let tally = self.tally(block.in_child);
        let grow = size > block.layout.size();
        // SAFETY: the block is live, from this allocator, with `block.layout`; the new size
        // is larger for `grow` and smaller for `shrink`, as each requires.
        let resized = unsafe {
            if grow {
                allocator.grow(block.ptr, block.layout, new_layout)
            } else {
                allocator.shrink(block.ptr, block.layout, new_layout)
            }
        };
        let Ok(ptr) = resized else {
            assert!(grow, "a shrink was refused");
            tally.refusals.fetch_add(1, Relaxed);
            block.check("after a refused growth");
            return;
        };
        assert!(ptr.len() >= size);
        tally.remove(block.granted, block.layout.size());
        tally.add(ptr.len(), size);
        tally.reallocations.fetch_add(1, Relaxed);
        let kept = block.layout.size().min(size);
        block.ptr = ptr.cast();
        block.granted = ptr.len();
        block.layout = Layout::from_size_align(kept, new_layout.align()).unwrap();
        block.check("after the resize (the bytes kept)");
        block.layout = new_layout;
        block.fill();
    }

    /// One worker thread: `calls` random calls (allocate, free, resize, hand a block to
    /// the mailbox, take blocks from it), then it leaves its blocks in the mailbox.
    fn work(&self, seed: u64, calls: usize, large_percent: u64) {
        let mut rng = Rng::new(seed);
        let mut held: Vec<Block> = Vec::new();
        for _ in 0..calls {
            if self.stop.load(Relaxed) {
                break;
            }
            let _call = self.gate.read().unwrap();
            let action = rng.below(100);
            let pick = |rng: &mut Rng, held: &Vec<Block>| rng.below(held.len() as u64) as usize;
            if held.len() >= MAX_HELD && action < 45 {
                let i = pick(&mut rng, &held);
                self.free(held.swap_remove(i));
            } else if action < 45 || held.is_empty() {
                held.extend(self.allocate(&mut rng, large_percent));
            } else if action < 75 {
                let i = pick(&mut rng, &held);
                self.free(held.swap_remove(i));
            } else if action < 85 {
                let i = pick(&mut rng, &held);
                self.resize(&mut rng, &mut held[i], large_percent);
            } else if action < 93 {
                let i = pick(&mut rng, &held);
                let block = held.swap_remove(i);
                self.mailbox.lock().unwrap().push(block);
            } else {
                let taken: Vec<Block> = {
                    let mut mailbox = self.mailbox.lock().unwrap();
                    let from = mailbox.len().saturating_sub(8);
                    mailbox.drain(from..).collect()
                };
                for block in taken {
                    if rng.below(2) == 0 {
                        self.free(block);
                    } else {
                        block.check("taken from the mailbox");
                        held.push(block);
                    }
                }
            }
        }
        let _call = self.gate.read().unwrap();
        self.mailbox.lock().unwrap().append(&mut held);
    }

    /// Compares both allocators' statistics with the tallies; no call may be under way.
    /// Returns (parent, child).
    fn check_stats(&self, when: &str) -> (AllocatorStats, AllocatorStats) {
        let (parent, child) = (self.registrations[0].stats(), self.registrations[1].stats());
        let (p, c) = (self.tallies[0].live(), self.tallies[1].live());
        let live = |s: &AllocatorStats| {
            (
                s.live_granted_bytes,
                s.live_requested_bytes.unwrap(),
                s.live_blocks,
            )
        };
        assert_eq!(live(&child), c, "{when}: child {child:?}");
        assert_eq!(
            live(&parent),
            (p.0 + c.0, p.1 + c.1, p.2 + c.2),
            "{when}: parent {parent:?}"
        );
        // A growth that moves the block while the allocator has a Fail budget counts as an
        // allocation and a free, not a reallocation: compare the sums.
        let (parent_calls, child_calls) = (self.tallies[0].calls(), self.tallies[1].calls());
        assert_eq!(
            child.allocations + child.reallocations,
            child_calls,
            "{when}: child {child:?}"
        );
        // The child's refusals never reach the parent when the request's size alone is over
        // the budget, but one refused only for the rounding of the granted size, or for a
        // thread racing it at the ceiling, is counted by the parent as an allocation and a
        // free: at most one per failure of the child.
        let parent_sum = parent.allocations + parent.reallocations;
        let expected = parent_calls + child_calls;
        assert!(
            (expected..=expected + child.budget_failures).contains(&parent_sum),
            "{when}: parent allocations + reallocations {parent_sum}, expected {expected} \
             plus at most the child's {} failures; parent {parent:?}",
            child.budget_failures
        );
        for (name, s) in [("parent", &parent), ("child", &child)] {
            assert_eq!(
                s.allocations - s.frees,
                s.live_blocks as u64,
                "{when}: {name} {s:?}"
            );
            assert!(
                s.peak_granted_bytes.unwrap() >= s.live_granted_bytes,
                "{when}: {name} {s:?}"
            );
        }
        (parent, child)
    }
}

/// A random layout: alignment 1 to 64, mostly small sizes, `large_percent` % large ones.
fn random_layout(rng: &mut Rng, large_percent: u64) -> Layout {
    let align = 1 << rng.below(7);
    let size = if rng.below(100) < large_percent {
        16 * 1024 + rng.below(2 * 1024 * 1024 - 16 * 1024) as usize
    } else {
        8 + rng.below(4096 - 8 + 1) as usize
    };
    Layout::from_size_align(size, align).unwrap()
}

/// A setting from the environment, or `default`.
fn env_or(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// Makes a panic on any thread abort the process, after printing it to the real stderr (the
/// test harness's capture of the output dies with the process). Otherwise a panicking
/// worker or controller leaves the others running: the controller never stops the
/// supervisor, which replaces workers forever, and the test hangs instead of failing.
fn abort_on_panic() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        std::panic::set_hook(Box::new(|info| {
            use std::io::Write;
            let backtrace = std::backtrace::Backtrace::capture();
            let _ = writeln!(std::io::stderr(), "{info}\n{backtrace}");
            std::process::abort();
        }));
    });
}

/// Runs the workers and the controller on `parent` and `child` (a child of `parent`; both
/// unused before) for the configured time, then frees every block and checks that both
/// allocators come back to nothing live, with their lanes open again where they can be.
pub fn run<P, C>(parent: P, child: C, config: Config)
where
    P: Allocator + BlockAllocator + Sync,
    C: Allocator + BlockAllocator + Sync,
{
    abort_on_panic();
    /// Budget hook: the refusals are counted by the tallies, warnings are expected.
    fn quiet(_: &BudgetEvent) {}
    let registrations = [P::registration(), C::registration()];
    for r in registrations {
        r.budget().set_hook(quiet);
        assert_eq!(
            r.stats().allocations,
            0,
            "{}: the checks assume a fresh allocator",
            r.name()
        );
    }
    let shared = Shared {
        allocators: [&parent, &child],
        registrations,
        tallies: Default::default(),
        mailbox: Mutex::new(Vec::new()),
        gate: RwLock::new(()),
        stop: AtomicBool::new(false),
        next_fill: AtomicU64::new(0),
    };
    let deadline =
        Instant::now() + Duration::from_secs(env_or("LANE_TRANSITIONS_SECS", config.secs));
    let mut rng = Rng::new(env_or("LANE_TRANSITIONS_SEED", 0x5EED_1A4E));
    let mut highest_live = [0; 2];
    // Whether the controller turned records on for the parent, the child.
    let mut recorded = [false; 2];
    std::thread::scope(|scope| {
        let shared = &shared;
        // The supervisor keeps `WORKERS` workers running, replacing the ones that finish.
        let supervisor = scope.spawn(move || {
            let mut seed = 0x9E37_79B9_7F4A_7C15u64;
            let mut workers = Vec::new();
            while !shared.stop.load(Relaxed) {
                workers.retain(|w: &std::thread::ScopedJoinHandle<()>| !w.is_finished());
                while workers.len() < WORKERS {
                    seed = seed
                        .wrapping_mul(6364136223846793005)
                        .wrapping_add(1442695040888963407);
                    let s = seed;
                    workers.push(scope.spawn(move || {
                        shared.work(s, config.calls_per_worker, config.large_percent)
                    }));
                }
                std::thread::sleep(Duration::from_millis(1));
            }
        });
        // The controller: a random budget or record setting on a random one of the two.
        let mut round = 0;
        while Instant::now() < deadline {
            round += 1;
            let index = rng.below(2) as usize;
            let target = registrations[index];
            let live = target.stats().live_granted_bytes;
            match rng.below(if config.toggle_records { 7 } else { 5 }) {
                0 => target.set_budget(None, BudgetMode::Warn),
                1 => target.set_budget(Some(live / 2 + 1), BudgetMode::Warn),
                2 => target.set_budget(Some(usize::MAX / 4), BudgetMode::Fail),
                3 if config.tight_fail_budgets => {
                    target.set_budget(Some(live + 64 * 1024), BudgetMode::Fail)
                }
                3 => target.set_budget(Some(1 << 40), BudgetMode::Fail),
                4 => target.set_budget(None, BudgetMode::Fail),
                5 => {
                    target.set_records(RecordMode::Basic);
                    recorded[index] = true;
                }
                _ => target.set_records(RecordMode::Off),
            }
            std::thread::sleep(Duration::from_micros(200 + rng.below(3000)));
            if round % config.check_every == 0 {
                let _no_calls = shared.gate.write().unwrap();
                let (p, c) = shared.check_stats(&format!("round {round}"));
                highest_live[0] = highest_live[0].max(p.live_granted_bytes);
                highest_live[1] = highest_live[1].max(c.live_granted_bytes);
            }
        }
        shared.stop.store(true, Relaxed);
        supervisor.join().unwrap();
    });
    shared.check_stats("after the workers exited");

    // Half the blocks left are freed under the last settings, half after clearing them.
    let mut left = std::mem::take(&mut *shared.mailbox.lock().unwrap());
    let second_half = left.split_off(left.len() / 2);
    for block in left {
        shared.free(block);
    }
    for r in registrations {
        r.set_budget(None, BudgetMode::Warn);
        r.set_records(RecordMode::Off);
    }
    for block in second_half {
        shared.free(block);
    }
    let (parent_end, child_end) = shared.check_stats("at the end");
    for (i, s) in [parent_end, child_end].iter().enumerate() {
        let name = registrations[i].name();
        assert_eq!(
            (s.live_blocks, s.live_granted_bytes, s.live_requested_bytes),
            (0, 0, Some(0)),
            "{name}"
        );
        assert_eq!(s.allocations, s.frees, "{name}");
        assert!(
            s.peak_granted_bytes.unwrap() >= highest_live[i],
            "{name}: {s:?}"
        );
        // With no budget left, a lane is open again, unless records were ever on for the
        // allocator or the one above it (a lane stays closed once they were, except for
        // sampled records).
        assert!(registrations[i].has_thread_cache_lane(), "{name}");
        let recorded_here_or_above = recorded[..=i].contains(&true);
        assert_eq!(
            registrations[i].thread_cache_lane_open(),
            !recorded_here_or_above,
            "{name}"
        );
    }
    let refusals: u64 = shared
        .tallies
        .iter()
        .map(|t| t.refusals.load(Relaxed))
        .sum();
    if !config.tight_fail_budgets {
        assert_eq!(
            refusals, 0,
            "a refusal under budgets that are never reached"
        );
    }
    eprintln!("{refusals} refusals; parent {parent_end:?}; child {child_end:?}");
}
