//! The workloads: each one stresses a different part of an allocator and returns a checksum.
//!
//! Every workload is deterministic (seeded [`Rng`], results combined in a fixed order or by
//! addition), so its checksum is the same under every allocator. The driver compares the
//! checksums, which proves that each run did the whole job, and feeding the data into the
//! checksum keeps the optimiser from deleting allocations whose contents are never read.
//!
//! `scale` multiplies the amount of work: 1.0 is sized for roughly 0.2–1 s with the fastest
//! allocator on a small machine, `--quick` uses a tenth of that.

use std::collections::{BTreeMap, HashMap};
use std::hint::black_box;
use std::sync::mpsc;

use crate::allocator;
use crate::rng::Rng;
use std::thread;

/// One named workload.
pub struct Workload {
    /// The name used on the command line and in the tables.
    pub name: &'static str,
    /// One line on what it stresses, for `--list` and the README.
    pub about: &'static str,
    /// Runs the workload at the given scale and returns its checksum. All memory it allocated
    /// is freed and all threads it started are joined before it returns.
    pub run: fn(f64) -> u64,
}

/// All workloads, in table order.
pub const ALL: &[Workload] = &[
    Workload {
        name: "small",
        about: "single thread: alloc/free pairs and batches of 8-512 B",
        run: small,
    },
    Workload {
        name: "churn",
        about: "1M live objects of 8-256 B, random ones replaced",
        run: churn,
    },
    Workload {
        name: "realloc",
        about: "Vec and String growth by push: many small, some large",
        run: realloc,
    },
    Workload {
        name: "collections",
        about: "BTreeMap and HashMap of Strings: insert, look up, remove",
        run: collections,
    },
    Workload {
        name: "prodcons",
        about: "one thread allocates, another frees (batches over a channel)",
        run: prodcons,
    },
    Workload {
        name: "larson",
        about: "two threads replace objects and swap their arrays each round",
        run: larson,
    },
    Workload {
        name: "threads",
        about: "thousands of short threads allocate a little; some objects outlive them",
        run: threads,
    },
    Workload {
        name: "shortlived",
        about: "10,000 threads, four alive at a time, ~1000 small objects each; 10% outlive them",
        run: shortlived,
    },
    Workload {
        name: "large",
        about: "64 KiB-4 MiB blocks: allocate, touch every page, free",
        run: large,
    },
    Workload {
        name: "fragment",
        about: "mixed sizes, free every other one, then different sizes",
        run: fragment,
    },
];

/// Looks a workload up by name.
pub fn find(name: &str) -> Option<&'static Workload> {
    ALL.iter().find(|w| w.name == name)
}

/// `base * scale`, at least 1.
fn scaled(base: usize, scale: f64) -> usize {
    ((base as f64 * scale) as usize).max(1)
}

/// A boxed byte slice of `size` bytes filled with `fill` (non-zero, so it is a real allocation
/// followed by writes rather than a zeroed allocation the allocator might get for free).
fn object(size: usize, fill: u8) -> Box<[u8]> {
    vec![fill | 1; size].into_boxed_slice()
}

/// What freeing an object contributes to a checksum: its length and two of its bytes.
fn digest(o: &[u8]) -> u64 {
    o.len() as u64 + u64::from(o[0]) + u64::from(o[o.len() - 1])
}

/// Small alloc/free pairs: the thread-cache fast path. Half the operations are immediate
/// pairs (free right after alloc, the best case for any cache), half are batches of 32 freed
/// in allocation order or in reverse, so a free list is actually walked.
fn small(scale: f64) -> u64 {
    const SIZES: [usize; 7] = [8, 16, 32, 64, 128, 256, 512];
    let n = scaled(15_000_000, scale);
    let mut sum = 0u64;
    for i in 0..n {
        let size = SIZES[i % SIZES.len()];
        let mut v: Vec<u8> = Vec::with_capacity(size);
        v.push(i as u8);
        let v = black_box(v);
        sum += v.capacity() as u64 + u64::from(v[0]);
    }
    let mut batch: Vec<Vec<u8>> = Vec::with_capacity(32);
    for i in 0..n / 32 {
        for j in 0..32 {
            let size = SIZES[(i + j) % SIZES.len()];
            let mut v: Vec<u8> = Vec::with_capacity(size);
            v.push(j as u8);
            batch.push(black_box(v));
        }
        sum += batch
            .iter()
            .map(|v| v.capacity() as u64 + u64::from(v[0]))
            .sum::<u64>();
        if i % 2 == 0 {
            batch.clear(); // frees in allocation order (FIFO)
        } else {
            while let Some(v) = batch.pop() {
                drop(v); // frees in reverse order (LIFO)
            }
        }
    }
    sum
}

/// A large live set with random replacement: frees land all over the heap, so pages are
/// partly used and free lists are long. Stresses locality and per-page bookkeeping.
fn churn(scale: f64) -> u64 {
    let live = scaled(1_000_000, scale);
    let steps = scaled(3_000_000, scale);
    let mut rng = Rng::new(0xC4_u64);
    let mut slots: Vec<Box<[u8]>> = (0..live)
        .map(|i| object(rng.range(8, 256), i as u8))
        .collect();
    let mut sum = 0u64;
    for step in 0..steps {
        let i = rng.below(live);
        let fresh = object(rng.range(8, 256), step as u8);
        sum += digest(&std::mem::replace(&mut slots[i], fresh));
    }
    sum + slots.iter().map(|o| digest(o)).sum::<u64>()
}

/// Growth by `push`: many small vectors crossing size classes, a few vectors interleaved so
/// none of them sits at the end of the heap, and Strings grown by small appends. Rewards an
/// in-place `realloc` and a cheap move between classes.
fn realloc(scale: f64) -> u64 {
    let mut rng = Rng::new(0x05EA_110C);
    let mut sum = 0u64;

    // Many small vectors, each grown to 1..=200 elements of u32 (up to ~1 KiB).
    let mut small: Vec<Vec<u32>> = Vec::new();
    for round in 0..scaled(30, scale) {
        small.clear();
        small.extend((0..10_000).map(|_| Vec::new()));
        for (k, v) in small.iter_mut().enumerate() {
            for x in 0..rng.range(1, 200) {
                v.push((x + k + round) as u32);
            }
        }
        sum += small
            .iter()
            .map(|v| v.len() as u64 + u64::from(v[v.len() - 1]))
            .sum::<u64>();
    }
    drop(small);

    // 16 vectors grown side by side to 64K..1M u64 elements (512 KiB..8 MiB).
    for _ in 0..scaled(6, scale) {
        let targets: Vec<usize> = (0..16).map(|_| rng.range(1 << 16, 1 << 20)).collect();
        let mut vs: Vec<Vec<u64>> = (0..16).map(|_| Vec::new()).collect();
        for step in 0..(1 << 20) {
            for (v, &t) in vs.iter_mut().zip(&targets) {
                if step < t {
                    v.push(step as u64);
                }
            }
        }
        sum += vs
            .iter()
            .map(|v| v.len() as u64 + v[v.len() - 1])
            .sum::<u64>();
    }

    // Strings grown by appends of 1..=16 bytes to about 256 KiB, eight at a time.
    const PIECE: &str = "abcdefghijklmnop";
    for _ in 0..scaled(20, scale) {
        let mut ss: Vec<String> = (0..8).map(|_| String::new()).collect();
        while ss[0].len() < 256 << 10 {
            for s in ss.iter_mut() {
                s.push_str(&PIECE[..rng.range(1, 16)]);
            }
        }
        sum += ss
            .iter()
            .map(|s| s.len() as u64 + u64::from(s.as_bytes()[s.len() / 2]))
            .sum::<u64>();
    }
    sum
}

/// The key of element `i`, generated from a seeded stream so lookups can regenerate it.
fn key(rng: &mut Rng) -> String {
    format!("key-{:016x}", rng.next_u64())
}

/// Ordinary application code: maps keyed by `String` with `String` and `Vec` values. Inserts,
/// looks up by regenerated keys (a fresh `String` per lookup), removes half, reinserts.
fn collections(scale: f64) -> u64 {
    let n = scaled(100_000, scale);
    let mut sum = 0u64;
    for round in 0..3u64 {
        let seed = 0xC011 + round;
        let mut bt: BTreeMap<String, String> = BTreeMap::new();
        let mut hm: HashMap<String, Vec<u32>> = HashMap::new();
        let mut rng = Rng::new(seed);
        for i in 0..n {
            let k = key(&mut rng);
            bt.insert(k.clone(), format!("value number {i}"));
            hm.insert(k, vec![i as u32; i % 8 + 1]);
        }
        let mut rng = Rng::new(seed);
        for _ in 0..n {
            let k = key(&mut rng);
            sum += bt.get(&k).map_or(0, |v| v.len() as u64);
            sum += hm.get(&k).map_or(0, |v| v.len() as u64);
        }
        let mut rng = Rng::new(seed);
        for i in 0..n {
            let k = key(&mut rng);
            if i % 2 == 0 {
                sum += bt.remove(&k).map_or(0, |v| v.len() as u64);
                sum += hm.remove(&k).map_or(0, |v| u64::from(v[0]));
            }
        }
        let mut rng = Rng::new(seed ^ 0xFFFF);
        for i in 0..n / 2 {
            let k = key(&mut rng);
            bt.insert(k.clone(), "x".repeat(i % 64 + 1));
            hm.insert(k, Vec::with_capacity(i % 16 + 1));
        }
        sum += bt.len() as u64 + hm.len() as u64;
        sum += bt.values().map(|v| v.len() as u64).sum::<u64>();
    }
    sum
}

/// The xmalloc pattern: a producer thread allocates every object, the consumer frees every
/// object. Objects travel in batches of 256 so the channel is not the bottleneck. Every free
/// is a remote free, the hardest case for designs built on thread caches.
fn prodcons(scale: f64) -> u64 {
    const BATCH: usize = 256;
    let batches = scaled(36_000, scale);
    let (tx, rx) = mpsc::sync_channel::<Vec<Box<[u8]>>>(64);
    let producer = allocator::spawn(move || {
        let mut rng = Rng::new(0x9D0C);
        for b in 0..batches {
            let batch: Vec<Box<[u8]>> = (0..BATCH)
                .map(|i| object(rng.range(8, 512), (b + i) as u8))
                .collect();
            tx.send(batch).expect("consumer alive");
        }
    });
    let mut sum = 0u64;
    for batch in rx {
        sum += batch.iter().map(|o| digest(o)).sum::<u64>();
    }
    producer.join().expect("producer panicked");
    sum
}

/// Larson's server pattern with two threads: each replaces random objects in its array, then
/// the threads swap arrays, so from the second round on most frees are of objects the other
/// thread allocated, while both threads keep allocating.
fn larson(scale: f64) -> u64 {
    const SLOTS: usize = 10_000;
    let rounds = scaled(180, scale);
    let steps_per_round = 25_000;
    let (to_b, from_a) = mpsc::channel::<Vec<Box<[u8]>>>();
    let (to_a, from_b) = mpsc::channel::<Vec<Box<[u8]>>>();

    let worker = move |seed: u64, tx: mpsc::Sender<Vec<Box<[u8]>>>, rx: mpsc::Receiver<_>| {
        let mut rng = Rng::new(seed);
        let mut slots: Vec<Box<[u8]>> = (0..SLOTS)
            .map(|i| object(rng.range(16, 1024), i as u8))
            .collect();
        let mut sum = 0u64;
        for round in 0..rounds {
            for step in 0..steps_per_round {
                let i = rng.below(SLOTS);
                let fresh = object(rng.range(16, 1024), (round + step) as u8);
                sum += digest(&std::mem::replace(&mut slots[i], fresh));
            }
            tx.send(slots).expect("peer alive");
            slots = rx.recv().expect("peer alive");
        }
        sum + slots.iter().map(|o| digest(o)).sum::<u64>()
    };
    let a = allocator::spawn(move || worker(0xA, to_b, from_b));
    let b = allocator::spawn(move || worker(0xB, to_a, from_a));
    a.join().expect("thread a panicked") + b.join().expect("thread b panicked")
}

/// Thread start-up and exit: thousands of short threads, two at a time, each allocating a
/// little (a map, strings, vectors). A fifth of each thread's objects are handed back and freed
/// by the main thread after the thread has exited, so caches of dead threads must be handled.
fn threads(scale: f64) -> u64 {
    let count = scaled(6_000, scale);
    let mut sum = 0u64;
    let mut survivors: Vec<Vec<Box<[u8]>>> = Vec::new();
    for pair in 0..count.div_ceil(2) {
        let handles: Vec<_> = (0..2)
            .map(|t| {
                let seed = (pair * 2 + t) as u64;
                allocator::spawn(move || {
                    let mut rng = Rng::new(seed);
                    let mut local: Vec<Box<[u8]>> = (0..100)
                        .map(|i| object(rng.range(8, 512), i as u8))
                        .collect();
                    let mut map: HashMap<u64, String> = HashMap::new();
                    for i in 0..50 {
                        map.insert(rng.next_u64() % 1000, format!("thread {seed} item {i}"));
                    }
                    let mut s = map.values().map(|v| v.len() as u64).sum::<u64>();
                    let kept: Vec<Box<[u8]>> = local.drain(..20).collect();
                    s += local.iter().map(|o| digest(o)).sum::<u64>();
                    (s, kept)
                })
            })
            .collect();
        for h in handles {
            let (s, kept) = h.join().expect("worker panicked");
            sum += s;
            survivors.push(kept);
        }
        if survivors.len() >= 64 {
            sum += survivors
                .drain(..)
                .flatten()
                .map(|o| digest(&o))
                .sum::<u64>();
        }
    }
    sum + survivors
        .into_iter()
        .flatten()
        .map(|o| digest(&o))
        .sum::<u64>()
}

/// Many short-lived threads, as thread pools that spawn per task, test harnesses and rayon
/// scopes make them: 10,000 threads, four alive at a time, each allocating about a thousand
/// objects of 16-256 B (some freed at once, most kept until it ends), freeing most of them
/// itself and handing a tenth to the spawning thread, which frees them after the thread has
/// exited.
fn shortlived(scale: f64) -> u64 {
    const ALIVE: usize = 4;
    let count = scaled(10_000, scale);
    let mut sum = 0u64;
    /// A worker: its checksum and the objects it hands back.
    type Worker = thread::JoinHandle<(u64, Vec<Box<[u8]>>)>;
    let mut pending: std::collections::VecDeque<Worker> = std::collections::VecDeque::new();
    let mut handed: Vec<Box<[u8]>> = Vec::new();
    for t in 0..count {
        if pending.len() == ALIVE {
            let (s, kept) = pending
                .pop_front()
                .unwrap()
                .join()
                .expect("worker panicked");
            sum += s;
            handed.extend(kept);
        }
        pending.push_back(allocator::spawn(move || {
            let mut rng = Rng::new(t as u64 ^ 0x5407);
            let mut s = 0u64;
            let mut held: Vec<Box<[u8]>> = Vec::with_capacity(800);
            for i in 0..1000 {
                let o = object(rng.range(16, 256), i as u8);
                if i % 5 == 0 {
                    s += digest(&o); // short-lived: freed at once
                } else {
                    held.push(o);
                }
            }
            let kept: Vec<Box<[u8]>> = held.drain(..80).collect();
            s += held.iter().map(|o| digest(o)).sum::<u64>();
            (s, kept)
        }));
        if handed.len() >= 4_000 {
            sum += handed.drain(..).map(|o| digest(&o)).sum::<u64>();
        }
    }
    for h in pending {
        let (s, kept) = h.join().expect("worker panicked");
        sum += s;
        handed.extend(kept);
    }
    sum + handed.iter().map(|o| digest(o)).sum::<u64>()
}

/// Large blocks, 64 KiB to 4 MiB (log-uniform), four alive at a time. Each is zero-allocated
/// and then written once per 4 KiB page, so an allocator that hands out fresh pages pays page
/// faults and one that reuses memory pays the zeroing: both are real costs.
fn large(scale: f64) -> u64 {
    const PAGE: usize = 4096;
    let steps = scaled(3_000, scale);
    let mut rng = Rng::new(0x1A46E);
    let mut ring: Vec<Vec<u8>> = (0..4).map(|_| Vec::new()).collect();
    let mut sum = 0u64;
    for step in 0..steps {
        let base = (64 << 10) << rng.below(6); // 64 KiB .. 2 MiB
        let size = base + rng.below(base + 1); // .. 4 MiB
        let mut block = vec![0u8; size];
        for (n, page) in block.chunks_mut(PAGE).enumerate() {
            page[0] = (n + step) as u8;
        }
        let old = std::mem::replace(&mut ring[step % 4], block);
        sum += old.len() as u64 + old.iter().step_by(PAGE).map(|&b| u64::from(b)).sum::<u64>();
    }
    sum + ring.iter().map(|b| b.len() as u64).sum::<u64>()
}

/// Fragmentation: fill the heap with mixed small objects, free every other one (the holes are
/// too small for what comes next), allocate larger objects, then free the old survivors and
/// allocate small ones again. Peak RSS shows how well holes are reused or coalesced, end RSS
/// whether the now-empty memory goes back to the OS.
fn fragment(scale: f64) -> u64 {
    let n = scaled(1_000_000, scale);
    let mut rng = Rng::new(0xF4A6);
    let mut sum = 0u64;
    let mut first: Vec<Option<Box<[u8]>>> = (0..n)
        .map(|i| Some(object(rng.range(16, 256), i as u8)))
        .collect();
    for slot in first.iter_mut().skip(1).step_by(2) {
        sum += digest(&slot.take().expect("filled above"));
    }
    let second: Vec<Box<[u8]>> = (0..n / 4)
        .map(|i| object(rng.range(300, 1000), i as u8))
        .collect();
    sum += first.iter().flatten().map(|o| digest(o)).sum::<u64>();
    drop(first);
    let third: Vec<Box<[u8]>> = (0..n / 2)
        .map(|i| object(rng.range(16, 64), i as u8))
        .collect();
    sum += second.iter().chain(&third).map(|o| digest(o)).sum::<u64>();
    sum
}

#[cfg(test)]
mod tests {
    use super::ALL;

    /// Every workload runs at a tiny scale and gives the same checksum twice (determinism is
    /// what lets the driver compare checksums across allocators).
    #[test]
    fn workloads_are_deterministic() {
        for w in ALL {
            let a = (w.run)(0.01);
            assert_eq!(a, (w.run)(0.01), "{}", w.name);
            assert_ne!(a, 0, "{}", w.name);
        }
    }
}
