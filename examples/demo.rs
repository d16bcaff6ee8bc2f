//! The main demo: tagalloc as the global allocator of a program doing real work, then the
//! allocator's report.
//!
//! Run with `cargo run --release --example demo`.

use std::collections::{BTreeMap, HashMap};
use std::sync::mpsc;
use std::thread;
use tagalloc::SystemAllocator;

#[global_allocator]
static GLOBAL: SystemAllocator = SystemAllocator::new();

/// Builds a pseudo-random text and counts its words: strings, a hash map, sorting.
fn word_frequencies(words: usize) -> Vec<(String, usize)> {
    const SYLLABLES: [&str; 12] = [
        "ka", "lo", "mi", "ren", "tu", "sha", "vo", "ne", "qui", "dra", "po", "el",
    ];
    let mut state = 0x2545_f491_4f6c_dd1du64;
    let mut text = String::new();
    for _ in 0..words {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        let len = 1 + (state % 3) as usize;
        for k in 0..len {
            text.push_str(SYLLABLES[((state >> (8 * k)) % 12) as usize]);
        }
        text.push(' ');
    }
    let mut counts: HashMap<&str, usize> = HashMap::new();
    for w in text.split_whitespace() {
        *counts.entry(w).or_default() += 1;
    }
    let mut top: Vec<(String, usize)> =
        counts.into_iter().map(|(w, c)| (w.to_owned(), c)).collect();
    top.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(&b.0)));
    top.truncate(5);
    top
}

/// Worker threads build buffers and hand them to a consumer thread, which frees them:
/// every block is freed by a thread other than the one that allocated it.
fn pipeline(producers: usize, items: usize) -> usize {
    let (tx, rx) = mpsc::channel::<Vec<u32>>();
    let workers: Vec<_> = (0..producers)
        .map(|p| {
            let tx = tx.clone();
            thread::spawn(move || {
                for i in 0..items {
                    let len = 16 + (i * 37 + p * 11) % 4000;
                    tx.send((0..len as u32).collect()).unwrap();
                }
            })
        })
        .collect();
    drop(tx);
    let consumer = thread::spawn(move || rx.iter().map(|v| v.iter().sum::<u32>() as usize).sum());
    for w in workers {
        w.join().unwrap();
    }
    consumer.join().unwrap()
}

/// An ordered index of records with values of many sizes, grown and then mostly removed.
fn ordered_index(records: usize) -> BTreeMap<String, Vec<u8>> {
    let mut index = BTreeMap::new();
    for i in 0..records {
        index.insert(
            format!("record-{i:06}"),
            vec![i as u8; 16 + (i * 7919) % 12_000],
        );
    }
    index.retain(|k, _| !k.ends_with('7'));
    index
}

fn kib(bytes: usize) -> String {
    format!("{:.1} KiB", bytes as f64 / 1024.0)
}

fn main() {
    let start = std::time::Instant::now();
    let top = word_frequencies(200_000);
    let moved = pipeline(3, 20_000);
    let index = ordered_index(20_000);
    let kept: usize = index.values().map(Vec::len).sum();
    let during = GLOBAL.heap_stats();
    drop(index);
    println!("tagalloc demo: work done in {:.0?}", start.elapsed());
    println!("  most frequent words: {top:?}");
    println!("  pipeline checksum:   {moved}");
    println!("  index bytes kept:    {kept}");
    drop(top);

    GLOBAL.garbage_collect();
    let after = GLOBAL.heap_stats();
    let os = tagalloc::os::OsAllocator::stats();
    println!();
    println!("SystemAllocator report");
    println!("  {:<28} {:>14} {:>14}", "", "with index live", "after GC");
    let rows: [(&str, String, String); 8] = [
        (
            "live blocks",
            during.live_blocks.to_string(),
            after.live_blocks.to_string(),
        ),
        (
            "granted (live) bytes",
            kib(during.granted_bytes),
            kib(after.granted_bytes),
        ),
        (
            "  in small blocks",
            kib(during.small_granted_bytes),
            kib(after.small_granted_bytes),
        ),
        (
            "  in large blocks",
            kib(during.large_granted_bytes),
            kib(after.large_granted_bytes),
        ),
        (
            "held from the OS",
            kib(during.held_bytes),
            kib(after.held_bytes),
        ),
        (
            "small pages (64 KiB)",
            during.small_pages.to_string(),
            after.small_pages.to_string(),
        ),
        (
            "large chunks",
            during.chunks.to_string(),
            after.chunks.to_string(),
        ),
        (
            "free large bytes",
            kib(during.free_large_bytes),
            kib(after.free_large_bytes),
        ),
    ];
    for (name, a, b) in rows {
        println!("  {name:<28} {a:>14} {b:>14}");
    }
    println!(
        "  allocations {} / frees {}; OS: {} maps, {} unmaps, peak mapped {}, resident now {}",
        after.allocations,
        after.frees,
        os.map_calls,
        os.unmap_calls,
        kib(os.peak_mapped_bytes),
        tagalloc::os::OsAllocator::process_resident_bytes().map_or("?".into(), kib),
    );
    GLOBAL.validate().expect("heap invariants hold");
}
