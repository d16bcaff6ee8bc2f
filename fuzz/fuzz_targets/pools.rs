//! A `PoolSchema` and a `ThreadPoolSchema`, each with a geometry picked by the input, driven
//! by alloc / free / collect sequences. The thread pool runs its steps on the main thread or
//! on a worker (which the input may retire and replace), so blocks are freed by threads
//! other than their allocator's and heaps are adopted from exited threads.
//!
//! Both pools are checked against the same model: a request is refused exactly when the
//! geometry says so, a block gets its class size, no two live blocks overlap, contents
//! survive until freed, the statistics (allocations, frees, live blocks, granted and
//! requested bytes, the peak) equal the model's after every step, and with everything freed
//! and collected a pool holds no pages.
#![no_main]

use arbitrary::Arbitrary;
use core::alloc::Layout;
use core::ptr::NonNull;
use libfuzzer_sys::fuzz_target;
use std::alloc::System;
use std::sync::mpsc::{Receiver, Sender, channel};
use tagalloc::schema::{PoolConfig, PoolSchema, PoolStats, ThreadPoolSchema};
use tagalloc_fuzz::{MAX_OPS, Shadow, check_aligned, fill, messages, verify};

/// Geometries to pick from: O3DE's default, the smallest pages, one class only, large
/// classes on large pages.
const CONFIGS: [(usize, usize, usize); 5] = [
    (4096, 8, 512),
    (1024, 64, 256),
    (1024, 8, 64),
    (8192, 16, 1024),
    (2048, 32, 32),
];

#[derive(Arbitrary, Debug)]
enum Op {
    /// `size` up to 1 KiB plus some (past every geometry's largest class), alignment up to
    /// 2^(`align_log` % 11).
    Alloc {
        size: u16,
        align_log: u8,
    },
    Free {
        pick: u16,
    },
    Collect,
}

#[derive(Arbitrary, Debug)]
struct Step {
    op: Op,
    /// Thread pool only: run the step on the worker thread rather than the main one.
    on_worker: bool,
    /// Thread pool only: retire the worker before the step (its thread exits; a new one
    /// takes its place).
    retire: bool,
}

#[derive(Arbitrary, Debug)]
struct Input {
    pool_config: u8,
    pool: Vec<Op>,
    thread_config: u8,
    thread_pool: Vec<Step>,
}

fn config(pick: u8, name: &'static str) -> PoolConfig {
    let (page, min, max) = CONFIGS[usize::from(pick) % CONFIGS.len()];
    PoolConfig::new(page, min, max)
        .expect("valid geometry")
        .with_name(name)
}

fn layout(size: u16, align_log: u8) -> Layout {
    Layout::from_size_align(usize::from(size) % 1200, 1 << (align_log % 11)).unwrap()
}

struct Live {
    layout: Layout,
    granted: usize,
    id: u64,
}

/// The model's statistics of one pool.
#[derive(Default)]
struct Expect {
    allocations: u64,
    frees: u64,
    granted: usize,
    requested: usize,
    peak: usize,
    /// Whether the pool refused a request (it then notes it, once).
    refused: bool,
}

impl Expect {
    /// Checks a pool's statistics; `peak_slack` is how far above the true peak the pool
    /// may report (a thread pool publishes per page and heap).
    fn check(&self, st: &PoolStats, live: usize, peak_slack: usize, step: usize) {
        assert_eq!(st.allocations, self.allocations, "step {step}: allocations");
        assert_eq!(st.frees, self.frees, "step {step}: frees");
        assert_eq!(st.live_blocks, live, "step {step}: live blocks");
        assert_eq!(st.granted_bytes, self.granted, "step {step}: granted bytes");
        assert_eq!(
            st.requested_bytes, self.requested,
            "step {step}: requested bytes"
        );
        assert!(
            st.peak_granted_bytes >= self.peak && st.peak_granted_bytes <= self.peak + peak_slack,
            "step {step}: peak {} for a true peak of {} (slack {peak_slack})",
            st.peak_granted_bytes,
            self.peak
        );
    }
}

/// What the model does with a block the pool granted (or refused): checks it and records it.
fn granted(
    cfg: &PoolConfig,
    layout: Layout,
    got: Option<(NonNull<u8>, usize)>,
    id: u64,
    live: &mut Shadow<Live>,
    expect: &mut Expect,
) {
    let Some((ptr, size)) = got else {
        assert_eq!(cfg.block_size(layout), None, "{layout:?} refused");
        expect.refused = true;
        return;
    };
    assert_eq!(
        Some(size),
        cfg.block_size(layout),
        "class size of {layout:?}"
    );
    check_aligned(ptr.as_ptr() as usize, layout.align(), "pool");
    // SAFETY: the block holds `size >= layout.size()` bytes.
    unsafe { fill(ptr.as_ptr(), layout.size(), id) };
    live.insert(
        ptr.as_ptr() as usize,
        size,
        Live {
            layout,
            granted: size,
            id,
        },
        "pool",
    );
    expect.allocations += 1;
    expect.granted += size;
    expect.requested += layout.size();
    expect.peak = expect.peak.max(expect.granted);
}

fn forget(b: &Live, expect: &mut Expect) {
    expect.frees += 1;
    expect.granted -= b.granted;
    expect.requested -= b.layout.size();
}

fn run_pool(pick: u8, ops: Vec<Op>) {
    let cfg = config(pick, "fuzzed pool");
    let notes = messages();
    let pool = PoolSchema::with_config(System, cfg);
    let mut live: Shadow<Live> = Shadow::default();
    let mut expect = Expect::default();
    for (step, op) in ops.into_iter().take(MAX_OPS).enumerate() {
        match op {
            Op::Alloc { size, align_log } => {
                let l = layout(size, align_log);
                let got = pool.allocate(l).map(|a| (a.ptr, a.size));
                granted(&cfg, l, got, step as u64, &mut live, &mut expect);
            }
            Op::Free { pick } => {
                let Some((addr, b)) = live.take(pick) else {
                    continue;
                };
                // SAFETY: a live block of this pool, freed once with its layout.
                unsafe {
                    verify(addr as *const u8, b.layout.size(), b.id, "pool free");
                    pool.deallocate(NonNull::new(addr as *mut u8).unwrap(), b.layout);
                }
                forget(&b, &mut expect);
            }
            Op::Collect => pool.garbage_collect(),
        }
        pool.validate()
            .unwrap_or_else(|e| panic!("step {step}: {e}"));
        expect.check(&pool.stats(), live.len(), 0, step);
    }
    for (addr, b) in live.drain() {
        // SAFETY: as for `Free`.
        unsafe {
            verify(addr as *const u8, b.layout.size(), b.id, "pool final free");
            pool.deallocate(NonNull::new(addr as *mut u8).unwrap(), b.layout);
        }
    }
    pool.garbage_collect();
    let st = pool.stats();
    assert_eq!(
        (st.live_blocks, st.granted_bytes, st.pages),
        (0, 0, 0),
        "{st:?}"
    );
    assert_eq!(
        messages() - notes,
        usize::from(expect.refused),
        "one note per pool that refused"
    );
}

/// A block on its way to or from the worker.
struct Sent(usize, Layout, u64);

enum Task {
    Alloc(Layout),
    Free(Sent),
    Collect,
}

/// A thread that runs one task at a time on the thread pool and answers each, so the
/// pool is quiescent between steps and its statistics are exact.
struct Worker<'s> {
    tasks: Sender<Task>,
    done: Receiver<Option<(usize, usize)>>,
    thread: std::thread::ScopedJoinHandle<'s, ()>,
}

impl<'s> Worker<'s> {
    fn spawn<'e>(
        scope: &'s std::thread::Scope<'s, 'e>,
        pool: &'s ThreadPoolSchema<System>,
    ) -> Self {
        let (tasks, inbox) = channel::<Task>();
        let (answer, done) = channel();
        let thread = scope.spawn(move || {
            for task in inbox {
                answer.send(run_task(pool, task)).unwrap();
            }
        });
        Self {
            tasks,
            done,
            thread,
        }
    }

    fn run(&self, task: Task) -> Option<(usize, usize)> {
        self.tasks.send(task).unwrap();
        self.done.recv().unwrap()
    }

    /// Ends the thread and waits for it to exit (its thread-locals, the pool's heap among
    /// them, are destroyed by then).
    fn retire(self) {
        drop(self.tasks);
        self.thread.join().unwrap();
    }
}

/// One thread-pool task, on whichever thread runs it: an allocation answers with its
/// address and granted size.
fn run_task(pool: &ThreadPoolSchema<System>, task: Task) -> Option<(usize, usize)> {
    match task {
        Task::Alloc(l) => pool.allocate(l).map(|a| (a.ptr.as_ptr() as usize, a.size)),
        Task::Free(Sent(addr, l, id)) => {
            // SAFETY: a live block of this pool, freed once with its layout; the pattern
            // covers its requested bytes.
            unsafe {
                verify(addr as *const u8, l.size(), id, "thread pool free");
                pool.deallocate(NonNull::new(addr as *mut u8).unwrap(), l);
            }
            None
        }
        Task::Collect => {
            pool.garbage_collect();
            None
        }
    }
}

fn run_thread_pool(pick: u8, steps: Vec<Step>) {
    let cfg = config(pick, "fuzzed thread pool");
    let mut pool = ThreadPoolSchema::with_config(System, cfg);
    let notes = messages();
    let mut live: Shadow<Live> = Shadow::default();
    let mut expect = Expect::default();
    std::thread::scope(|s| {
        let pool = &pool;
        let mut worker = Worker::spawn(s, pool);
        for (
            step,
            Step {
                op,
                on_worker,
                retire,
            },
        ) in steps.into_iter().take(MAX_OPS).enumerate()
        {
            if retire {
                std::mem::replace(&mut worker, Worker::spawn(s, pool)).retire();
            }
            let run = |task| {
                if on_worker {
                    worker.run(task)
                } else {
                    run_task(pool, task)
                }
            };
            match op {
                Op::Alloc { size, align_log } => {
                    let l = layout(size, align_log);
                    let got = run(Task::Alloc(l))
                        .map(|(addr, size)| (NonNull::new(addr as *mut u8).unwrap(), size));
                    granted(&cfg, l, got, step as u64, &mut live, &mut expect);
                }
                Op::Free { pick } => {
                    let Some((addr, b)) = live.take(pick) else {
                        continue;
                    };
                    run(Task::Free(Sent(addr, b.layout, b.id)));
                    forget(&b, &mut expect);
                }
                Op::Collect => {
                    run(Task::Collect);
                }
            }
            let st = pool.stats();
            // Main thread, worker, the shared fallback heap, and a retired worker's heap
            // while no thread has adopted it yet.
            assert!(st.thread_heaps <= 4, "step {step}: {st:?}");
            expect.check(&st, live.len(), st.thread_heaps * cfg.page_size(), step);
        }
        worker.retire();
    });
    pool.validate().expect("valid with no thread inside");
    for (addr, b) in live.drain() {
        run_task(&pool, Task::Free(Sent(addr, b.layout, b.id)));
    }
    pool.garbage_collect();
    pool.validate().expect("valid once empty");
    let st = pool.stats();
    assert_eq!(
        (st.live_blocks, st.granted_bytes, st.requested_bytes),
        (0, 0, 0),
        "{st:?}"
    );
    assert_eq!(
        (st.pages, st.free_pages),
        (0, 0),
        "an empty collected pool holds no page: {st:?}"
    );
    assert_eq!(
        messages() - notes,
        usize::from(expect.refused),
        "one note per pool that refused"
    );
}

fuzz_target!(|input: Input| {
    run_pool(input.pool_config, input.pool);
    run_thread_pool(input.thread_config, input.thread_pool);
});
