//! Model test of the thread-pool schema: random alloc / free / collect / thread-exit
//! sequences spread over three worker threads, so blocks are often freed on a thread other
//! than the one that allocated them, and threads exit while others still hold their blocks.
//! Each step runs to completion before the next, so after every step the statistics must
//! equal the model exactly (the peak within its documented bound), no two live blocks
//! overlap, every pointer is aligned and contents survive until freed.

mod common;

use core::alloc::Layout;
use core::ptr::NonNull;
use proptest::prelude::*;
use std::alloc::System;
use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::mpsc::{Receiver, Sender, channel};
use std::thread::JoinHandle;
use tagalloc::schema::{PoolConfig, ThreadPoolSchema};

type Pool = ThreadPoolSchema<System>;

const WORKERS: usize = 3;

#[derive(Clone, Copy, Debug)]
struct Block {
    ptr: NonNull<u8>,
    layout: Layout,
    granted: usize,
    seed: u8,
}
// SAFETY: each block is owned by one thread at a time; the test hands it over by message.
unsafe impl Send for Block {}

enum Task {
    Alloc(Layout, u8),
    Free(Block),
    Collect,
}

/// A thread that runs tasks on the pool one at a time and answers each.
struct Worker {
    tasks: Sender<Task>,
    done: Receiver<Option<Block>>,
    handle: JoinHandle<()>,
}

impl Worker {
    fn spawn(pool: Arc<Pool>) -> Self {
        let (tasks, rx) = channel::<Task>();
        let (tx, done) = channel();
        let handle = std::thread::spawn(move || {
            for task in rx {
                let answer = match task {
                    Task::Alloc(layout, seed) => pool.allocate(layout).map(|a| {
                        // SAFETY: a live block of `a.size` bytes.
                        unsafe { a.ptr.as_ptr().write_bytes(seed, a.size) };
                        Block {
                            ptr: a.ptr,
                            layout,
                            granted: a.size,
                            seed,
                        }
                    }),
                    Task::Free(b) => {
                        // SAFETY: the block is live and `granted` bytes long.
                        let bytes =
                            unsafe { core::slice::from_raw_parts(b.ptr.as_ptr(), b.granted) };
                        assert!(bytes.iter().all(|&x| x == b.seed), "contents changed");
                        // SAFETY: allocated by this pool with this layout, freed once.
                        unsafe { pool.deallocate(b.ptr, b.layout) };
                        None
                    }
                    Task::Collect => {
                        pool.garbage_collect();
                        None
                    }
                };
                tx.send(answer).unwrap();
            }
        });
        Self {
            tasks,
            done,
            handle,
        }
    }

    fn run(&self, task: Task) -> Option<Block> {
        self.tasks.send(task).unwrap();
        self.done.recv().unwrap()
    }

    /// Ends the thread and waits until it has fully exited (thread-locals destroyed).
    fn exit(self) {
        drop(self.tasks);
        self.handle.join().unwrap();
    }
}

#[derive(Clone, Debug)]
enum Op {
    Alloc {
        on: usize,
        size: usize,
        align_log: u32,
    },
    Free {
        on: usize,
        pick: usize,
    },
    Collect {
        on: usize,
    },
    Exit {
        who: usize,
    },
}

fn op_strategy() -> impl Strategy<Value = Op> {
    let on = 0..WORKERS;
    prop_oneof![
        8 => (on.clone(), prop_oneof![3 => 0usize..=128, 1 => 0usize..=600], 0u32..=9)
            .prop_map(|(on, size, align_log)| Op::Alloc { on, size, align_log }),
        6 => (on.clone(), any::<usize>()).prop_map(|(on, pick)| Op::Free { on, pick }),
        1 => on.clone().prop_map(|on| Op::Collect { on }),
        1 => on.prop_map(|who| Op::Exit { who }),
    ]
}

fn run(ops: Vec<Op>) {
    let cfg = PoolConfig::new(2048, 16, 256).unwrap().with_name("model");
    let pool = Arc::new(ThreadPoolSchema::with_config(System, cfg));
    common::messages::capture();
    let mut refusal_noted = false;
    let mut workers: Vec<Worker> = (0..WORKERS)
        .map(|_| Worker::spawn(Arc::clone(&pool)))
        .collect();
    let mut live: BTreeMap<usize, Block> = BTreeMap::new();
    let (mut allocations, mut frees, mut granted, mut requested, mut peak) = (0u64, 0u64, 0, 0, 0);
    for (step, op) in ops.into_iter().enumerate() {
        match op {
            Op::Alloc {
                on,
                size,
                align_log,
            } => {
                let layout = Layout::from_size_align(size, 1 << align_log).unwrap();
                let Some(b) = workers[on].run(Task::Alloc(layout, step as u8)) else {
                    assert_eq!(cfg.block_size(layout), None, "refused {layout:?}");
                    if !refusal_noted {
                        // The pool's first refusal is noted (captured, not printed).
                        refusal_noted = true;
                        let line = format!(
                            "tagalloc: pool 'model': request of {} bytes aligned to {} refused",
                            layout.size(),
                            layout.align()
                        );
                        assert!(common::messages::captured(&line), "{line}");
                    }
                    continue;
                };
                assert_eq!(Some(b.granted), cfg.block_size(layout));
                let addr = b.ptr.as_ptr() as usize;
                assert_eq!(addr % layout.align(), 0);
                if let Some((&prev, p)) = live.range(..addr).next_back() {
                    assert!(prev + p.granted <= addr, "overlaps the block before");
                }
                if let Some((&next, _)) = live.range(addr..).next() {
                    assert!(addr + b.granted <= next, "overlaps the block after");
                }
                live.insert(addr, b);
                allocations += 1;
                granted += b.granted;
                requested += size;
                peak = peak.max(granted);
            }
            Op::Free { on, pick } => {
                if live.is_empty() {
                    continue;
                }
                let addr = *live.keys().nth(pick % live.len()).unwrap();
                let b = live.remove(&addr).unwrap();
                workers[on].run(Task::Free(b));
                frees += 1;
                granted -= b.granted;
                requested -= b.layout.size();
            }
            Op::Collect { on } => {
                workers[on].run(Task::Collect);
            }
            Op::Exit { who } => {
                let fresh = Worker::spawn(Arc::clone(&pool));
                std::mem::replace(&mut workers[who], fresh).exit();
            }
        }
        let st = pool.stats();
        assert_eq!(st.allocations, allocations);
        assert_eq!(st.frees, frees);
        assert_eq!(st.live_blocks, live.len());
        assert_eq!(st.granted_bytes, granted);
        assert_eq!(st.requested_bytes, requested);
        // Never below the true peak; above it by less than a page per heap.
        assert!(
            st.peak_granted_bytes >= peak,
            "{} < {peak}",
            st.peak_granted_bytes
        );
        assert!(st.peak_granted_bytes <= peak + st.thread_heaps * cfg.page_size());
        // Heaps are adopted: never more than the threads alive at once, plus the fallback.
        assert!(st.thread_heaps <= WORKERS + 2, "{st:?}");
    }
    for w in workers {
        w.exit();
    }
    let mut pool = Arc::into_inner(pool).expect("workers are gone");
    pool.validate().unwrap();
    for (_, b) in std::mem::take(&mut live) {
        // SAFETY: as above, now on the main thread.
        unsafe { pool.deallocate(b.ptr, b.layout) };
    }
    pool.validate().unwrap();
    pool.garbage_collect();
    let st = pool.stats();
    assert_eq!(
        (st.live_blocks, st.granted_bytes, st.requested_bytes),
        (0, 0, 0)
    );
    assert_eq!((st.pages, st.free_pages), (0, 0), "{st:?}");
    pool.validate().unwrap();
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(common::model_cases(48)))]

    #[test]
    fn thread_pool_matches_its_model(ops in prop::collection::vec(op_strategy(), 1..200)) {
        run(ops);
    }
}
