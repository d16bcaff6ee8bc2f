//! Transparent huge pages (`TAGALLOC_HUGE_PAGES`, `OsAllocator::set_huge_pages`): which
//! mappings of a heap ask for them, and that the kernel backs them so. Own binary, no
//! harness: the setting and the OS layer's counters are process-wide.

use std::alloc::Layout;
use tagalloc::config::HugePages;
use tagalloc::os::{OsAllocator, PageSource};
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
    // No fault counts as a stall until the stall guard's own test below: on a loaded machine
    // two slow first faults would turn the hints off before the checks that count them.
    OsAllocator::set_huge_page_stall_ns(u64::MAX);
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

    growing_buffers_keep_to_huge_page_boundaries();

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

/// A buffer that grows into a mapping of its own is placed so that huge pages can back it:
/// its mapping's first 4 KiB page ends on a 2 MiB boundary, the first huge page is in it
/// whole, and `mremap` keeps that offset where it moves the mapping (the kernel, left to
/// choose, puts it anywhere, and a doubling buffer was then backed by 4 KiB pages almost
/// whole). Runs while huge pages are on (`auto`).
fn growing_buffers_keep_to_huge_page_boundaries() {
    const HUGE: usize = 2 * MIB;
    const PAGE: usize = 4096;
    let os = OsAllocator;

    // The OS layer: a mapping placed one page before a boundary, grown where it cannot grow
    // in place (a page just after it is taken), moves to the same offset, contents kept.
    let len = MIB + PAGE;
    let m = os.map(len, HUGE, PAGE);
    assert!(!m.is_null());
    assert_eq!(
        (m.addr() + PAGE) % HUGE,
        0,
        "map(len, 2 MiB, 4 KiB) misplaced"
    );
    // SAFETY: `m` is a fresh mapping of `len` bytes.
    unsafe { m.write_bytes(0x5A, len) };
    // SAFETY: a one-page inaccessible mapping at the address after `m`, only if that address
    // is free (MAP_FIXED_NOREPLACE); unmapped below.
    let blocker = unsafe {
        libc::mmap(
            m.add(len).cast(),
            PAGE,
            libc::PROT_NONE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_FIXED_NOREPLACE,
            -1,
            0,
        )
    };
    let new_len = 8 * MIB + PAGE;
    // SAFETY: `m` is a live mapping of `len` bytes from `os`, not used again unless this
    // fails.
    let p = unsafe { os.remap(m, len, new_len) };
    assert!(!p.is_null(), "remap to 8 MiB failed");
    assert_ne!(p, m, "grew in place past a taken page");
    assert_eq!(
        (p.addr() + PAGE) % HUGE,
        0,
        "remap moved the mapping off its offset from a 2 MiB boundary"
    );
    // SAFETY: `p` is a live mapping of `new_len` bytes whose first `len` were kept.
    unsafe {
        assert_eq!(*p, 0x5A);
        assert_eq!(*p.add(len - 1), 0x5A, "contents lost in the move");
        assert_eq!(*p.add(len), 0, "the grown part reads as zero");
        os.unmap(p, new_len);
        if blocker != libc::MAP_FAILED {
            libc::munmap(blocker, PAGE);
        }
    }

    // The heap: a 900 KiB block followed by another cannot grow in place, so growing it past
    // `GROW_DIRECT_MIN` moves it into a mapping of its own, which then doubles to 32 MiB.
    let heap = HphaSchema::new(OsAllocator);
    let mut layout = Layout::from_size_align(900 << 10, 8).unwrap();
    let mut buffer = heap.allocate(layout).unwrap();
    let after = Layout::from_size_align(100 << 10, 8).unwrap();
    let neighbour = heap.allocate(after).unwrap();
    // SAFETY: a live block of `layout.size()` bytes.
    unsafe { buffer.ptr.as_ptr().write_bytes(0xA5, layout.size()) };
    let mut size = layout.size();
    for new_size in [
        MIB + (100 << 10),
        2 * MIB,
        4 * MIB,
        8 * MIB,
        16 * MIB,
        32 * MIB,
    ] {
        // SAFETY: `buffer` is live with `layout`; the new size is far below isize::MAX.
        buffer = unsafe { heap.reallocate(buffer.ptr, layout, new_size) }.unwrap();
        let p = buffer.ptr.as_ptr();
        // SAFETY: the block holds `new_size` bytes, the first `size` of them copied.
        unsafe {
            assert_eq!(*p, 0xA5, "first byte kept growing to {new_size}");
            assert_eq!(
                *p.add(size - 1),
                0xA5,
                "last byte kept growing to {new_size}"
            );
            p.add(size).write_bytes(0xA5, new_size - size);
        }
        assert_eq!(
            heap.stats().direct_blocks,
            1,
            "growing to {new_size} did not move the buffer into a mapping of its own"
        );
        let offset = p.addr() % HUGE;
        assert!(
            offset >= HUGE - PAGE,
            "a {new_size}-byte buffer's payload {offset:#x} past a 2 MiB boundary"
        );
        assert!(
            buffer.size >= HUGE - PAGE,
            "{new_size} bytes granted {}: the first huge page is not whole",
            buffer.size
        );
        size = new_size;
        layout = Layout::from_size_align(size, 8).unwrap();
    }
    // SAFETY: both blocks are live with these layouts.
    unsafe {
        heap.deallocate(buffer.ptr, layout);
        heap.deallocate(neighbour.ptr, after);
    }
}
