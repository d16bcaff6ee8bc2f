//! The resident memory of scoped tags in a process that is past the 8 MiB at which new
//! heap mappings ask for transparent huge pages: each tag's heap is used lightly (one block
//! of each of 10 classes), so none of its segments may become a resident 2 MiB huge page.
//! Before the heap-local threshold, 64 tags here cost over 100 MiB where the kernel offers
//! huge pages to regions that ask.
//!
//! Its own process (harness = false): the threshold is process-wide, and resident memory is
//! the process's.

use tagalloc::SystemAllocator;
use tagalloc::os::OsAllocator;

#[global_allocator]
static GLOBAL: SystemAllocator = SystemAllocator::new();

#[path = "common/tags64.rs"]
mod tags64;

const MIB: usize = 1 << 20;

fn main() {
    let Some(start) = OsAllocator::process_resident_bytes() else {
        println!("tag_memory: no resident-memory figure on this system; not checked");
        return;
    };
    // Past the process-wide threshold: 24 MiB mapped, barely touched.
    let big: Vec<u8> = Vec::with_capacity(24 * MIB);
    assert!(OsAllocator::stats().mapped_bytes >= 8 * MIB);
    let warm = tags64::untagged_blocks();
    let hints_before = OsAllocator::stats().huge_page_hints;
    let before = OsAllocator::process_resident_bytes().unwrap();
    let held = tags64::one_block_of_each_class_in_each_tag();
    let after = OsAllocator::process_resident_bytes().unwrap();
    let added = after.saturating_sub(before);
    let hints = OsAllocator::stats().huge_page_hints - hints_before;
    println!(
        "tag_memory: 64 tags x 10 classes past 8 MiB mapped: +{:.2} MiB resident, {hints} \
         huge-page hints (process started at {:.1} MiB)",
        added as f64 / MIB as f64,
        start as f64 / MIB as f64
    );
    assert_eq!(hints, 0, "a lightly used tag's heap asked for huge pages");
    // Valgrind's own memory grows with the program's (its shadow of every byte touched).
    if std::env::var("LD_PRELOAD").is_ok_and(|p| p.contains("vgpreload")) {
        println!("tag_memory: under valgrind, resident memory not checked");
        drop((held, warm, big));
        return;
    }
    assert!(
        added <= 6 * MIB,
        "64 lightly used tags added {added} bytes of resident memory"
    );
    drop((held, warm, big));
}
