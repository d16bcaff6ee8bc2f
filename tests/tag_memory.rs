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

macro_rules! tags {
    ($($name:ident)*) => {
        $(tagalloc::allocator!($name: child of SystemAllocator, "test tag");)*
        const ENTER: &[fn() -> tagalloc::TagGuard] = &[$(|| $name.enter()),*];
    };
}

tags!(T00 T01 T02 T03 T04 T05 T06 T07 T08 T09 T10 T11 T12 T13 T14 T15 T16 T17 T18 T19 T20 T21
    T22 T23 T24 T25 T26 T27 T28 T29 T30 T31 T32 T33 T34 T35 T36 T37 T38 T39 T40 T41 T42 T43 T44
    T45 T46 T47 T48 T49 T50 T51 T52 T53 T54 T55 T56 T57 T58 T59 T60 T61 T62 T63);

const SIZES: [usize; 10] = [32, 48, 64, 96, 128, 256, 512, 1024, 2048, 4096];
const MIB: usize = 1 << 20;

fn main() {
    let Some(start) = OsAllocator::process_resident_bytes() else {
        println!("tag_memory: no resident-memory figure on this system; not checked");
        return;
    };
    // Past the process-wide threshold: 24 MiB mapped, barely touched.
    let big: Vec<u8> = Vec::with_capacity(24 * MIB);
    assert!(OsAllocator::stats().mapped_bytes >= 8 * MIB);
    let warm: Vec<Vec<u8>> = SIZES.iter().map(|&s| Vec::with_capacity(s)).collect();
    let hints_before = OsAllocator::stats().huge_page_hints;
    let before = OsAllocator::process_resident_bytes().unwrap();
    let held: Vec<Vec<Vec<u8>>> = ENTER
        .iter()
        .map(|enter| {
            let _tag = enter();
            SIZES
                .iter()
                .map(|&s| {
                    let mut v = Vec::with_capacity(s);
                    v.push(1u8);
                    v
                })
                .collect()
        })
        .collect();
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
