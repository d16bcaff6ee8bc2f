//! Scoped tags (`src/scope.rs`): with tagalloc as the global allocator, a thread that enters a
//! child's tag allocates through that child, std containers included, and every block keeps
//! its tag until it is freed, wherever and whenever that happens. Each test uses tags of its
//! own, so the tests can run side by side. Blocks a test only counts go through `black_box`:
//! an optimised build may otherwise leave out an allocation nothing reads.

use std::collections::HashMap;
use std::future::Future;
use std::hint::black_box;
use std::pin::pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Barrier, mpsc};
use std::task::{Context, Poll, Wake, Waker};
use tagalloc::{AllocatorStats, BudgetMode, SystemAllocator};

#[global_allocator]
static GLOBAL: SystemAllocator = SystemAllocator::new();

tagalloc::allocator!(Containers: child of SystemAllocator, "std containers");
tagalloc::allocator!(Large: child of SystemAllocator, "large blocks");
tagalloc::allocator!(Outer: child of SystemAllocator, "nesting, outer");
tagalloc::allocator!(Inner: child of SystemAllocator, "nesting, inner");
tagalloc::allocator!(Producer: child of SystemAllocator, "cross-thread, allocating side");
tagalloc::allocator!(Consumer: child of SystemAllocator, "cross-thread, freeing side");
tagalloc::allocator!(Leaver: child of SystemAllocator, "threads that exit");
tagalloc::allocator!(Grower: child of SystemAllocator, "realloc");
tagalloc::allocator!(Subsystem: child of SystemAllocator, "a parent");
tagalloc::allocator!(Part: child of Subsystem, "a grandchild");
tagalloc::allocator!(Capped: child of SystemAllocator, "Fail budget");
tagalloc::allocator!(Watched: child of SystemAllocator, "Warn budget");
tagalloc::allocator!(Async: child of SystemAllocator, "futures");
tagalloc::allocator!(Bound: child of SystemAllocator, "bind");
tagalloc::allocator!(Lean: child of SystemAllocator { requested_bytes: false }, "lean");
tagalloc::allocator!(Host: child of SystemAllocator, "a scope that uses pools");
tagalloc::allocator!(Sparks: thread_pool of SystemAllocator, "a thread pool used in a scope");
tagalloc::allocator!(Events: pool of SystemAllocator, "a pool used in a scope");
tagalloc::allocator!(Other: child of SystemAllocator, "a handle used in a scope");
tagalloc::allocator!(Late: child of SystemAllocator, "freed after the thread's cache retired");
tagalloc::allocator!(Changing: child of SystemAllocator, "settings changed while in use");
tagalloc::allocator!(Handed: child of SystemAllocator, "freed first by a new thread");
tagalloc::allocator!(RecordedLater: child of SystemAllocator, "records switched on mid-scope");

/// Live blocks, granted and requested bytes of a snapshot.
fn live(st: &AllocatorStats) -> (usize, usize, Option<usize>) {
    (
        st.live_blocks,
        st.live_granted_bytes,
        st.live_requested_bytes,
    )
}

/// What a small request of `size` bytes at alignment 8 is granted.
fn granted(size: usize) -> usize {
    let layout = std::alloc::Layout::from_size_align(size, 8).unwrap();
    // SAFETY: a valid non-zero layout; the block is freed at once with it.
    unsafe {
        let p = std::alloc::alloc(layout);
        let g = GLOBAL.usable_size(std::ptr::NonNull::new(p).unwrap(), layout);
        std::alloc::dealloc(p, layout);
        g
    }
}

#[test]
fn std_containers_count_in_the_entered_child() {
    let start = Containers.stats();
    let (v, s, b, m) = Containers.scope(|| {
        let v: Vec<u64> = Vec::with_capacity(100);
        let s = String::from("a string of some length");
        let b = Box::new([7u8; 40]);
        let mut m = HashMap::with_capacity(10);
        m.insert(1u32, 2u32);
        (v, s, b, m)
    });
    let held = Containers.stats();
    assert_eq!(held.live_blocks, start.live_blocks + 4);
    assert_eq!(held.allocations, start.allocations + 4);
    let (_, g0, r0) = live(&start);
    let (_, g1, r1) = live(&held);
    assert!(g1 - g0 >= 800 + 23 + 40, "granted {}", g1 - g0);
    let requested = r1.unwrap() - r0.unwrap();
    assert!(requested >= 800 + 23 + 40 && requested <= g1 - g0);
    // Freed outside the scope: still the child's.
    drop((v, s, b, m));
    let end = Containers.stats();
    assert_eq!(live(&end), live(&start));
    assert_eq!(end.frees, start.frees + 4);
}

#[test]
fn large_blocks_and_own_mappings_count_and_reallocation_keeps_the_tag() {
    let start = Large.stats();
    let (mut big, huge) = Large.scope(|| (vec![1u8; 100_000], vec![2u8; 20 << 20]));
    let held = Large.stats();
    assert_eq!(held.live_blocks, start.live_blocks + 2);
    assert!(held.live_granted_bytes >= start.live_granted_bytes + 100_000 + (20 << 20));
    // Grown outside the scope (in place or moved): still the child's, counted once.
    big.resize(3_000_000, 3);
    let grown = Large.stats();
    assert_eq!(grown.live_blocks, held.live_blocks);
    assert!(grown.live_granted_bytes >= start.live_granted_bytes + 3_000_000 + (20 << 20));
    assert!(grown.reallocations > held.reallocations);
    assert!(big[..100_000].iter().all(|&b| b == 1) && big[100_000..].iter().all(|&b| b == 3));
    drop((big, huge));
    assert_eq!(live(&Large.stats()), live(&start));
}

#[test]
fn nested_guards_restore_what_they_replaced_in_any_order() {
    let (outer0, inner0) = (Outer.stats(), Inner.stats());
    let outer = Outer.enter();
    let a = Box::new(1u64); // Outer's
    let inner = Inner.enter();
    let b = Box::new(2u64); // Inner's
    // The outer guard goes first: it restores what it replaced (no tag), even though the
    // inner guard is alive.
    drop(outer);
    let c = Box::new(3u64); // nobody's
    drop(inner); // restores Outer, which it replaced
    let d = Box::new(4u64); // Outer's again
    tagalloc::untagged(|| {
        let e = Box::new(5u64); // nobody's
        drop(e);
    });
    let after = Box::new(6u64); // still Outer's: `untagged` restored it
    drop(Outer.enter()); // a guard dropped at once changes nothing
    let last = Box::new(7u64); // Outer's
    // No guard is left alive that would restore Outer: leave it by hand.
    let none = tagalloc::untagged(|| Inner.enter());
    drop(none); // restores what `untagged` had entered: no tag
    let free = Box::new(8u64);
    assert_eq!(Outer.stats().live_blocks, outer0.live_blocks + 4);
    assert_eq!(Inner.stats().live_blocks, inner0.live_blocks + 1);
    drop((a, b, c, d, after, last, free));
    assert_eq!(live(&Outer.stats()), live(&outer0));
    assert_eq!(live(&Inner.stats()), live(&inner0));
}

/// Raw blocks handed between threads.
struct Blocks(Vec<(usize, std::alloc::Layout)>);

fn alloc_raw(layout: std::alloc::Layout) -> usize {
    // SAFETY: non-zero layouts only.
    let p = unsafe { std::alloc::alloc(layout) };
    assert!(!p.is_null());
    p as usize
}

fn free_raw(blocks: Blocks) {
    for (p, layout) in blocks.0 {
        // SAFETY: allocated by `alloc_raw` with `layout`, freed once.
        unsafe { std::alloc::dealloc(p as *mut u8, layout) };
    }
}

#[test]
fn frees_on_other_threads_inside_other_scopes_count_in_the_blocks_tag() {
    let (p0, c0) = (Producer.stats(), Consumer.stats());
    let (tx, rx) = mpsc::channel::<Blocks>();
    let sizes = [8usize, 24, 100, 512, 1000, 4096, 5000, 70_000, 1 << 20];
    let consumer = std::thread::spawn(Consumer.bind(move || {
        let mut mine = Vec::new();
        for blocks in rx {
            // Allocations here are the consumer's...
            mine.push(vec![0u8; 300]);
            // ...frees of the producer's blocks are the producer's.
            free_raw(blocks);
        }
        mine.len()
    }));
    let _tag = Producer.enter();
    for round in 0..50 {
        let blocks = Blocks(
            sizes
                .iter()
                .map(|&s| {
                    let layout = std::alloc::Layout::from_size_align(s, 8).unwrap();
                    (alloc_raw(layout), layout)
                })
                .collect(),
        );
        tagalloc::untagged(|| tx.send(blocks).unwrap());
        if round == 25 {
            std::thread::yield_now();
        }
    }
    drop(_tag);
    drop(tx);
    let consumed = consumer.join().unwrap();
    assert_eq!(consumed, 50);
    let (p1, c1) = (Producer.stats(), Consumer.stats());
    assert_eq!(live(&p1), live(&p0));
    // Each round's blocks, and the vector that carries them (allocated in the scope too).
    let per_round = sizes.len() as u64 + 1;
    assert_eq!(p1.allocations, p0.allocations + 50 * per_round);
    assert_eq!(p1.frees, p0.frees + 50 * per_round);
    // The consumer's own vectors died with its closure's locals, inside its scope.
    assert_eq!(live(&c1), live(&c0));
    assert!(c1.allocations >= c0.allocations + 50);
}

/// A new thread whose first allocator call frees blocks of a tag (handed over by its
/// spawner) registers with that tag's lane set up; the frees, and the thread's own scoped
/// blocks, count exactly, also once it exited.
#[test]
fn a_thread_whose_first_call_frees_a_tags_block_counts_exactly() {
    let start = Handed.stats();
    let handed: Vec<Box<[u8]>> =
        Handed.scope(|| (0..100).map(|i| vec![7u8; 16 + i].into()).collect());
    let kept = std::thread::spawn(move || {
        // The test allocated nothing on this thread yet: these frees come first (std may
        // have allocated before the closure runs; then the frees find the cache registered).
        let mut handed = handed;
        while let Some(block) = handed.pop() {
            drop(block);
        }
        drop(handed);
        Handed.scope(|| (0..50).map(|i| vec![9u8; 8 + i]).collect::<Vec<_>>())
    })
    .join()
    .unwrap();
    let held = Handed.stats();
    assert_eq!(held.live_blocks, start.live_blocks + 51);
    let requested = held.live_requested_bytes.unwrap() - start.live_requested_bytes.unwrap();
    let expected: usize =
        kept.iter().map(|v| v.capacity()).sum::<usize>() + 50 * size_of::<Vec<u8>>();
    assert_eq!(requested, expected);
    drop(kept);
    assert_eq!(live(&Handed.stats()), live(&start));
}

#[test]
fn blocks_outlive_the_thread_that_allocated_them() {
    let start = Leaver.stats();
    let (kept, expected) = std::thread::spawn(|| {
        let _tag = Leaver.enter();
        let kept: Vec<Vec<u8>> = (0..200).map(|i| vec![i as u8; 1 + i * 37]).collect();
        let expected: usize = kept.iter().map(|v| v.capacity()).sum();
        (kept, expected)
    })
    .join()
    .unwrap();
    // The thread is gone; its lane's counts were handed over, the blocks are still Leaver's.
    let held = Leaver.stats();
    assert_eq!(held.live_blocks, start.live_blocks + 201);
    let requested = held.live_requested_bytes.unwrap() - start.live_requested_bytes.unwrap();
    assert_eq!(requested, expected + 200 * size_of::<Vec<u8>>());
    drop(kept);
    assert_eq!(live(&Leaver.stats()), live(&start));
}

#[test]
fn reallocation_keeps_each_blocks_tag() {
    let start = Grower.stats();
    // Allocated outside: grown inside, it stays the SystemAllocator's.
    let mut outside: Vec<u8> = Vec::with_capacity(16);
    Grower.scope(|| outside.extend(std::iter::repeat_n(1u8, 10_000)));
    assert_eq!(live(&Grower.stats()), live(&start));
    // Allocated inside: grown outside, across the small/large line and back down, it stays
    // Grower's; each resize is one reallocation.
    let mut inside: Vec<u8> = Grower.scope(|| Vec::with_capacity(16));
    let mut reallocations = 0;
    for size in [64usize, 600, 5_000, 300_000, 2 << 20, 100, 20] {
        if size > inside.capacity() {
            inside.reserve_exact(size - inside.len());
        } else {
            inside.truncate(size);
            inside.shrink_to(size);
        }
        reallocations += 1;
        let st = Grower.stats();
        assert_eq!(st.live_blocks, start.live_blocks + 1, "size {size}");
        assert_eq!(
            st.live_requested_bytes.unwrap() - start.live_requested_bytes.unwrap(),
            inside.capacity(),
            "size {size}"
        );
    }
    assert_eq!(
        Grower.stats().reallocations,
        start.reallocations + reallocations
    );
    drop((outside, inside));
    assert_eq!(live(&Grower.stats()), live(&start));
}

#[test]
fn a_grandchilds_scoped_blocks_count_in_its_ancestors() {
    let (s0, p0) = (Subsystem.stats(), Part.stats());
    let blocks = Part.scope(|| (vec![0u32; 50], vec![0u8; 50_000]));
    let (s1, p1) = (Subsystem.stats(), Part.stats());
    assert_eq!(p1.live_blocks, p0.live_blocks + 2);
    assert_eq!(s1.live_blocks, s0.live_blocks + 2);
    assert_eq!(
        s1.live_granted_bytes - s0.live_granted_bytes,
        p1.live_granted_bytes - p0.live_granted_bytes
    );
    drop(blocks);
    assert_eq!(live(&Part.stats()), live(&p0));
    assert_eq!(live(&Subsystem.stats()), live(&s0));
}

#[test]
fn a_fail_budget_refuses_scoped_allocations_exactly_as_through_the_handle() {
    fn quiet(_: &tagalloc::BudgetEvent) {}
    Capped.set_budget(Some(64 * 1024), BudgetMode::Fail);
    Capped::registration().budget().set_hook(quiet);
    let _tag = Capped.enter();
    let mut small: Vec<u8> = Vec::new();
    assert!(small.try_reserve_exact(1000).is_ok());
    let mut big: Vec<u8> = Vec::new();
    assert!(big.try_reserve_exact(100_000).is_err(), "over the budget");
    let mut fits: Vec<u8> = Vec::new();
    assert!(fits.try_reserve_exact(40_000).is_ok());
    drop(_tag);
    let st = Capped.stats();
    assert_eq!(st.budget_failures, 1);
    assert_eq!(st.live_blocks, 2);
    drop((small, fits));
    Capped.set_budget(None, BudgetMode::Fail);
    assert_eq!(Capped.stats().live_blocks, 0);
}

#[test]
fn a_warn_budget_tells_its_hook_about_scoped_allocations() {
    static TOLD: AtomicUsize = AtomicUsize::new(0);
    fn hook(event: &tagalloc::BudgetEvent) {
        assert_eq!(event.allocator, "Watched");
        assert!(!event.refused);
        TOLD.fetch_add(1, Ordering::Relaxed);
    }
    Watched.set_budget(Some(10_000), BudgetMode::Warn);
    Watched::registration().budget().set_hook(hook);
    let v = Watched.scope(|| black_box(vec![0u8; 50_000]));
    assert!(TOLD.load(Ordering::Relaxed) >= 1);
    assert_eq!(Watched.stats().live_blocks, 1);
    drop(v);
    Watched.set_budget(None, BudgetMode::Warn);
}

/// A waker that does nothing (the test polls by hand).
struct Noop;
impl Wake for Noop {
    fn wake(self: Arc<Self>) {}
}

/// A future that allocates, yields once, then allocates again.
async fn two_steps() -> (Vec<u8>, Vec<u8>) {
    let first = vec![1u8; 200];
    Yield(false).await;
    let second = vec![2u8; 300];
    (first, second)
}

struct Yield(bool);
impl Future for Yield {
    type Output = ();
    fn poll(mut self: std::pin::Pin<&mut Self>, _: &mut Context<'_>) -> Poll<()> {
        if self.0 {
            Poll::Ready(())
        } else {
            self.0 = true;
            Poll::Pending
        }
    }
}

#[test]
fn an_instrumented_future_takes_its_tag_to_every_thread_that_polls_it() {
    let start = Async.stats();
    let fut = Box::pin(Async.instrument(two_steps()));
    let waker = Waker::from(Arc::new(Noop));
    // First poll here, second on another thread; the allocations between polls are not
    // the future's.
    let mut fut = fut;
    assert!(
        fut.as_mut()
            .poll(&mut Context::from_waker(&waker))
            .is_pending()
    );
    assert_eq!(Async.stats().live_blocks, start.live_blocks + 1);
    let not_the_futures = vec![0u8; 1000];
    let (first, second) = std::thread::spawn(move || {
        let waker = Waker::from(Arc::new(Noop));
        match fut.as_mut().poll(&mut Context::from_waker(&waker)) {
            Poll::Ready(out) => out,
            Poll::Pending => panic!("still pending"),
        }
    })
    .join()
    .unwrap();
    assert_eq!(Async.stats().live_blocks, start.live_blocks + 2);
    drop((first, second, not_the_futures));
    assert_eq!(live(&Async.stats()), live(&start));
    // Pinned in place on the stack works too.
    let mut fut = pin!(Async.instrument(async { vec![0u8; 64].len() }));
    assert_eq!(
        fut.as_mut().poll(&mut Context::from_waker(&waker)),
        Poll::Ready(64)
    );
}

#[test]
fn a_bound_closure_enters_its_tag_on_the_thread_that_runs_it() {
    let start = Bound.stats();
    let barrier = Arc::new(Barrier::new(2));
    let b = Arc::clone(&barrier);
    let worker = std::thread::spawn(Bound.bind(move || {
        let held = black_box(vec![0u8; 4000]);
        b.wait(); // counted while alive
        b.wait();
        held.len()
    }));
    barrier.wait();
    assert_eq!(Bound.stats().live_blocks, start.live_blocks + 1);
    barrier.wait();
    assert_eq!(worker.join().unwrap(), 4000);
    assert_eq!(live(&Bound.stats()), live(&start));
}

#[test]
fn a_child_without_requested_bytes_can_be_entered() {
    let start = Lean.stats();
    let v = Lean.scope(|| black_box(vec![0u16; 500]));
    let st = Lean.stats();
    assert_eq!(st.live_blocks, start.live_blocks + 1);
    assert_eq!(st.live_requested_bytes, None);
    assert!(st.live_granted_bytes >= start.live_granted_bytes + 1000);
    drop(v);
    assert_eq!(Lean.stats().live_blocks, start.live_blocks);
}

#[test]
fn pools_and_other_handles_used_inside_a_scope_keep_their_blocks_out_of_it() {
    let (host0, other0) = (Host.stats(), Other.stats());
    let (sparks, events, other, zeroed) = Host.scope(|| {
        // Pool pages come from the SystemAllocator as a parent, not through the global
        // allocator: they are the pools', not the scope's.
        let sparks: Vec<_> = (0..2000)
            .map(|i| allocator_api2::boxed::Box::new_in([i as u8; 48], Sparks))
            .collect();
        let events: Vec<_> = (0..50)
            .map(|i| allocator_api2::boxed::Box::new_in([i as u32; 8], Events))
            .collect();
        // Another child's handle counts in that child only.
        let other = allocator_api2::vec::Vec::<u8, _>::with_capacity_in(100_000, Other);
        let zeroed = allocator_api2::boxed::Box::<[u8; 300_000], _>::new_zeroed_in(Other);
        (sparks, events, other, zeroed)
    });
    let host = Host.stats();
    // Only the two std vectors holding the boxes are the scope's.
    assert_eq!(host.live_blocks, host0.live_blocks + 2);
    assert_eq!(Other.stats().live_blocks, other0.live_blocks + 2);
    assert!(Sparks.stats().live_blocks >= 2000 && Events.stats().live_blocks >= 50);
    drop((sparks, events, other, zeroed));
    assert_eq!(live(&Host.stats()), live(&host0));
    assert_eq!(live(&Other.stats()), live(&other0));
}

/// Tagged blocks a thread frees at its very end, after its thread cache was handed back (a
/// pthread key destructor of its own, which runs after tagalloc's), and blocks a new thread
/// frees before it allocates anything: each goes back to its tag, in its own heap segments.
#[test]
fn tagged_blocks_freed_by_a_thread_without_a_live_cache_go_back_to_their_tag() {
    static KEY: std::sync::OnceLock<libc::pthread_key_t> = std::sync::OnceLock::new();
    unsafe extern "C" fn free_at_exit(blocks: *mut libc::c_void) {
        // SAFETY: the value set below: a boxed vector of blocks, freed once here.
        drop(unsafe { Box::from_raw(blocks.cast::<Vec<Vec<u8>>>()) });
    }
    let key = *KEY.get_or_init(|| {
        let mut key = 0;
        // SAFETY: `key` is writable; the destructor has the signature pthread wants.
        assert_eq!(
            unsafe { libc::pthread_key_create(&mut key, Some(free_at_exit)) },
            0
        );
        key
    });
    let start = Late.stats();
    for round in 0..20 {
        // Made inside the tag by this thread; freed by the next thread when it exits.
        let blocks: Vec<Vec<u8>> = Late.scope(|| {
            (0..100)
                .map(|i| vec![round as u8; 8 + (i * 41) % 3000])
                .collect()
        });
        std::thread::spawn(move || {
            let boxed = Box::into_raw(Box::new(blocks));
            // SAFETY: the key exists; the value is freed by its destructor.
            assert_eq!(unsafe { libc::pthread_setspecific(key, boxed.cast()) }, 0);
        })
        .join()
        .unwrap();
        // And a thread whose first call frees a tagged block.
        let block = Late.scope(|| vec![1u8; 100]);
        std::thread::spawn(move || drop(block)).join().unwrap();
    }
    assert_eq!(live(&Late.stats()), live(&start));
    GLOBAL.validate().unwrap();
    // The blocks are usable again, from the right heap.
    let again: Vec<Vec<u8>> = Late.scope(|| (0..300).map(|i| vec![0u8; 8 + i * 7]).collect());
    drop(again);
    assert_eq!(live(&Late.stats()), live(&start));
}

/// Threads allocate and free inside a tag while another thread keeps changing the tag's
/// records mode and budget (which open and close its lanes under them): every block is
/// counted once, and the figures return exactly to the start.
#[test]
fn a_tag_in_use_while_its_records_and_budget_change_stays_exact() {
    use std::sync::atomic::AtomicBool;
    fn quiet(_: &tagalloc::BudgetEvent) {}
    Changing::registration().budget().set_hook(quiet);
    let start = Changing.stats();
    let stop = AtomicBool::new(false);
    std::thread::scope(|s| {
        let stop = &stop;
        let workers: Vec<_> = (0..3)
            .map(|t| {
                s.spawn(move || {
                    let _tag = Changing.enter();
                    let mut kept: Vec<Vec<u8>> = Vec::new();
                    let mut i = 0usize;
                    while !stop.load(Ordering::Relaxed) || i < 20_000 {
                        kept.push(vec![t as u8; 8 + (i * 37) % 6000]);
                        if kept.len() > 64 {
                            kept.swap_remove(i % 64);
                        }
                        i += 1;
                    }
                    i
                })
            })
            .collect();
        let modes = [
            tagalloc::RecordMode::sample(),
            tagalloc::RecordMode::Off,
            tagalloc::RecordMode::Basic,
            tagalloc::RecordMode::Off,
        ];
        for round in 0..40 {
            Changing.set_records(modes[round % modes.len()]);
            let budget = if round % 3 == 0 { None } else { Some(64 << 20) };
            let mode = if round % 2 == 0 {
                BudgetMode::Warn
            } else {
                BudgetMode::Fail
            };
            Changing.set_budget(budget, mode);
            std::thread::sleep(std::time::Duration::from_millis(2));
        }
        stop.store(true, Ordering::Relaxed);
        for w in workers {
            assert!(w.join().unwrap() >= 20_000);
        }
    });
    Changing.set_budget(None, BudgetMode::Warn);
    Changing.set_records(tagalloc::RecordMode::Off);
    let end = Changing.stats();
    assert_eq!(live(&end), live(&start));
    assert_eq!(end.allocations - start.allocations, end.frees - start.frees);
    assert_eq!(end.budget_failures, 0);
}

/// A thread in a tag whose records another thread switches on while it stays inside: the
/// free route the thread set as it entered (with the tag's blocks going straight into its
/// lane) is brought up to date by the switch, so each recorded block's free removes its
/// record. Before that, these frees went into the lane past the records. The two threads meet
/// through atomics, not channels: a channel's blocking receive allocates inside the scope.
#[test]
fn records_switched_on_while_a_thread_is_in_the_tag_see_its_frees() {
    use std::sync::atomic::AtomicBool;
    for round in 0..20 {
        let ready = AtomicBool::new(false);
        let go = AtomicBool::new(false);
        std::thread::scope(|s| {
            let worker = s.spawn(|| {
                let _tag = RecordedLater.enter();
                // The lane is set up and the route taken: these go straight into the lane.
                for i in 0..100 {
                    drop(black_box(vec![i as u8; 24]));
                }
                ready.store(true, Ordering::Release);
                while !go.load(Ordering::Acquire) {
                    std::hint::spin_loop();
                }
                for i in 0..1000 {
                    drop(black_box(vec![i as u8; 8 + i % 200]));
                }
            });
            while !ready.load(Ordering::Acquire) {
                std::hint::spin_loop();
            }
            RecordedLater.set_records(tagalloc::RecordMode::Basic);
            go.store(true, Ordering::Release);
            worker.join().unwrap();
        });
        let totals = tagalloc::records::live_totals(RecordedLater::registration());
        RecordedLater.set_records(tagalloc::RecordMode::Off);
        assert_eq!(
            totals.records, 0,
            "round {round}: records left behind by freed blocks: {totals:?}"
        );
    }
    assert!(RecordedLater.stats().allocations >= 20 * 1100);
}

#[test]
fn small_requests_are_granted_their_class() {
    // A sanity check of the helper the other tests lean on.
    assert_eq!(granted(24), 24);
    assert!(granted(1000) >= 1000);
}
