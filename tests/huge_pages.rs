//! Transparent huge pages (`TAGALLOC_HUGE_PAGES`, `OsAllocator::set_huge_pages`): which
//! mappings of a heap ask for them, and that the kernel backs them so. Own binary, no
//! harness: the setting and the OS layer's counters are process-wide.

use std::alloc::Layout;
use tagalloc::config::HugePages;
use tagalloc::os::OsAllocator;
use tagalloc::schema::HphaSchema;

const MIB: usize = 1 << 20;

/// Bytes of this process backed by huge pages (`None` where smaps_rollup does not exist).
fn anon_huge_bytes() -> Option<usize> {
    let text = std::fs::read_to_string("/proc/self/smaps_rollup").ok()?;
    let line = text.lines().find(|l| l.starts_with("AnonHugePages:"))?;
    let kib: usize = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

/// Whether the kernel gives huge pages to regions that ask (`always` or `madvise`).
fn kernel_offers_huge_pages() -> bool {
    std::fs::read_to_string("/sys/kernel/mm/transparent_hugepage/enabled")
        .is_ok_and(|s| s.contains("[always]") || s.contains("[madvise]"))
}

fn main() {
    let hints = || OsAllocator::stats().huge_page_hints;
    let heap = HphaSchema::new(OsAllocator);
    let small = Layout::from_size_align(64, 8).unwrap();

    // Never: no mapping asks.
    HphaSchema::<OsAllocator>::set_huge_pages(HugePages::Never);
    let a = heap.allocate(small).unwrap();
    let big = Layout::from_size_align(3 * MIB, 8).unwrap();
    let b = heap.allocate(big).unwrap();
    assert_eq!(
        hints(),
        0,
        "huge pages asked for with the setting at `never`"
    );
    // SAFETY: blocks of this heap, freed once with their layouts.
    unsafe {
        heap.deallocate(a.ptr, small);
        heap.deallocate(b.ptr, big);
    }

    // Auto: only once the OS layer maps 8 MiB; then new small-block segments, large-block
    // chunks and blocks with their own mapping all ask.
    HphaSchema::<OsAllocator>::set_huge_pages(HugePages::Auto);
    let mapped = OsAllocator::stats().mapped_bytes;
    assert!(
        mapped < 8 * MIB,
        "{mapped} bytes mapped before the test's heap grew"
    );
    let mut live = Vec::new();
    let chunk = Layout::from_size_align(3 * MIB, 64).unwrap();
    while OsAllocator::stats().mapped_bytes < 8 * MIB {
        live.push((heap.allocate(chunk).unwrap(), chunk));
    }
    let before = hints();
    assert_eq!(before, 0, "asked below the 8 MiB of `auto`");
    live.push((heap.allocate(chunk).unwrap(), chunk));
    assert_eq!(
        hints(),
        before + 1,
        "a new large-block chunk past 8 MiB did not ask"
    );
    let direct = Layout::from_size_align(20 * MIB, 8).unwrap();
    live.push((heap.allocate(direct).unwrap(), direct));
    assert_eq!(
        hints(),
        before + 2,
        "a block with its own mapping did not ask"
    );
    // A heap's first segments do not ask, however much the process has mapped: a heap used
    // lightly (a scoped tag's) would turn a few blocks into a resident huge page. Another
    // heap's first segment and first chunk, past 8 MiB mapped:
    let light = HphaSchema::new(OsAllocator);
    let light_small = light.allocate(small).unwrap();
    let light_large = light.allocate(big).unwrap();
    assert_eq!(
        hints(),
        before + 2,
        "a heap's first segment or chunk asked for huge pages"
    );
    // SAFETY: blocks of `light`, freed once with their layouts.
    unsafe {
        light.deallocate(light_small.ptr, small);
        light.deallocate(light_large.ptr, big);
    }
    // Once the heap has 4 MiB of segments, its next one asks (2 MiB segments; the first
    // holds the 64-byte class's page from above).
    let page = Layout::from_size_align(4096, 8).unwrap();
    for _ in 0..1536 {
        live.push((heap.allocate(page).unwrap(), page));
    }
    assert!(
        hints() >= before + 3,
        "a new small-block segment did not ask"
    );

    // The kernel backs them with huge pages, where it offers them to regions that ask (it
    // may still fall back to small pages when no huge page is free: then stalls are counted
    // or the test says so).
    for &(a, layout) in &live {
        // SAFETY: live blocks of `layout.size()` bytes.
        unsafe { a.ptr.as_ptr().write_bytes(1, layout.size()) };
    }
    let stats = OsAllocator::stats();
    assert!(stats.huge_page_stalls <= stats.huge_page_hints);
    match anon_huge_bytes() {
        Some(bytes) if kernel_offers_huge_pages() => {
            if bytes == 0 {
                println!("huge_pages: the kernel gave no huge page (none free?); not checked");
            } else {
                assert!(bytes >= 2 * MIB, "{bytes} bytes in huge pages");
            }
        }
        _ => println!("huge_pages: the kernel offers no transparent huge pages here; not checked"),
    }
    for (a, layout) in live.drain(..) {
        // SAFETY: live blocks of this heap, freed once with their layouts.
        unsafe { heap.deallocate(a.ptr, layout) };
    }

    // The stall guard: with every first fault counted as a stall, the second one turns the
    // hints off for good.
    OsAllocator::set_huge_page_stall_ns(0);
    for _ in 0..8 {
        if OsAllocator::stats().huge_page_stalls >= 2 {
            break;
        }
        live.push((heap.allocate(direct).unwrap(), direct));
    }
    assert_eq!(OsAllocator::stats().huge_page_stalls, 2);
    let before = hints();
    for _ in 0..2 {
        live.push((heap.allocate(direct).unwrap(), direct));
    }
    assert_eq!(hints(), before, "huge pages asked for after two stalls");
    for (a, layout) in live {
        // SAFETY: live blocks of this heap, freed once with their layouts.
        unsafe { heap.deallocate(a.ptr, layout) };
    }
    println!(
        "huge_pages: ok ({} hints, {} stalls)",
        stats.huge_page_hints, stats.huge_page_stalls
    );
}
