//! A child declared with `requested_bytes: false`: every figure but the requested bytes stays
//! exact (on its thread-cache lane and on its general path, across threads, in containers),
//! the requested bytes are reported as unknown by it and by the allocators above it from its
//! registration on, and nobody else's figures change.
//!
//! One test: the switch from known to unknown is process-wide, so the steps must not
//! interleave with another test's.

use allocator_api2::boxed::Box as ApiBox;
use allocator_api2::vec::Vec as ApiVec;
use std::alloc::Layout;
use tagalloc::{BlockAllocator, SystemAllocator};

tagalloc::allocator!(Subsystem: child of SystemAllocator, "keeps requested bytes");
tagalloc::allocator!(
    HotPath: child of Subsystem { requested_bytes: false },
    "tagging only"
);
tagalloc::allocator!(Neighbour: child of SystemAllocator, "a sibling, unaffected");

/// The JSON report's `requested_bytes` of the allocator called `name`.
fn reported_requested(name: &str) -> serde_json::Value {
    let json: serde_json::Value = serde_json::from_str(&tagalloc::report::json()).unwrap();
    json["allocators"]
        .as_array()
        .unwrap()
        .iter()
        .find(|a| a["name"] == name)
        .unwrap_or_else(|| panic!("{name} not in the report"))["requested_bytes"]
        .clone()
}

#[test]
fn a_child_without_requested_bytes_keeps_every_other_figure_exact() {
    assert!(Subsystem::registration().keeps_requested_bytes());
    assert!(!HotPath::registration().keeps_requested_bytes());

    // Before the lean child is used, its parent knows its requested bytes.
    let kept: ApiVec<u8, Subsystem> = {
        let mut v = ApiVec::with_capacity_in(100, Subsystem);
        v.extend(0..100u8);
        v
    };
    assert!(Subsystem.stats().live_requested_bytes.unwrap() >= 100);
    assert_eq!(
        reported_requested("Subsystem"),
        serde_json::json!(Subsystem.stats().live_requested_bytes.unwrap())
    );

    let neighbour = ApiBox::new_in([7u8; 24], Neighbour);
    assert_eq!(
        HotPath.stats().live_requested_bytes,
        None,
        "before its first call"
    );
    assert!(Subsystem.stats().live_requested_bytes.is_some());
    // Its first call registers it: from then on its parent's figures include its blocks.
    drop(ApiBox::new_in(0u8, HotPath));
    assert_eq!(
        Subsystem.stats().live_requested_bytes,
        None,
        "its parent's include it"
    );
    let sub_start = Subsystem.stats();
    let start = HotPath.stats();
    assert_eq!(
        Neighbour.stats().live_requested_bytes,
        Some(24),
        "a sibling keeps them"
    );
    assert_eq!(reported_requested("HotPath"), serde_json::Value::Null);
    assert_eq!(reported_requested("Subsystem"), serde_json::Value::Null);
    assert_eq!(reported_requested("Neighbour"), serde_json::json!(24));

    // Small blocks (the lane) and big ones (the general path), sizes off their classes.
    let layouts: Vec<Layout> = (0..3_000)
        .map(|i| Layout::from_size_align(1 + (i * 37) % 1500 + (i % 7) * 5000, 8).unwrap())
        .collect();
    let mut blocks = Vec::new();
    let mut granted = 0;
    for &layout in &layouts {
        let block = HotPath.allocate_block(layout).expect("out of memory");
        // SAFETY: the block holds at least `layout.size()` bytes.
        unsafe { block.ptr.as_ptr().write_bytes(0x5A, layout.size()) };
        granted += block.size;
        blocks.push((block.ptr, layout));
    }
    assert!(HotPath::registration().has_thread_cache_lane());
    let st = HotPath.stats();
    assert_eq!(st.live_blocks, start.live_blocks + layouts.len());
    assert_eq!(st.live_granted_bytes, start.live_granted_bytes + granted);
    assert_eq!(st.allocations, start.allocations + layouts.len() as u64);
    assert_eq!(st.live_requested_bytes, None);
    let sub = Subsystem.stats();
    assert_eq!(
        sub.live_granted_bytes,
        sub_start.live_granted_bytes + granted
    );
    assert_eq!(sub.live_blocks, sub_start.live_blocks + layouts.len());

    // Half freed on another thread, half here.
    let theirs: Vec<(usize, Layout)> = blocks
        .iter()
        .skip(1)
        .step_by(2)
        .map(|&(p, l)| (p.as_ptr() as usize, l))
        .collect();
    std::thread::spawn(move || {
        for (addr, layout) in theirs {
            let ptr = std::ptr::NonNull::new(addr as *mut u8).unwrap();
            // SAFETY: a live block of `HotPath` with `layout`, freed once (the other half
            // is freed below).
            unsafe { HotPath.deallocate_block(ptr, layout) };
        }
    })
    .join()
    .unwrap();
    for &(ptr, layout) in blocks.iter().step_by(2) {
        // SAFETY: as above, the other half.
        unsafe {
            assert!(
                std::slice::from_raw_parts(ptr.as_ptr(), layout.size())
                    .iter()
                    .all(|&b| b == 0x5A)
            );
            HotPath.deallocate_block(ptr, layout)
        };
    }
    let end = HotPath.stats();
    assert_eq!(end.live_blocks, start.live_blocks);
    assert_eq!(end.live_granted_bytes, start.live_granted_bytes);
    assert_eq!(end.frees, start.frees + layouts.len() as u64);
    assert!(end.peak_granted_bytes.unwrap() >= granted);

    // Containers of every kind the handles serve.
    {
        let mut v = ApiVec::new_in(HotPath);
        v.extend(0..10_000u32);
        let b = ApiBox::new_in([1u64; 8], HotPath);
        let mut m =
            hashbrown::HashMap::with_hasher_in(hashbrown::DefaultHashBuilder::default(), HotPath);
        for i in 0..1_000u32 {
            m.insert(i, i * 2);
        }
        assert_eq!(v.iter().map(|&x| x as u64).sum::<u64>(), 49_995_000);
        assert_eq!(b.iter().sum::<u64>(), 8);
        assert_eq!(m[&999], 1998);
        assert!(HotPath.stats().live_blocks >= start.live_blocks + 3);
    }
    let after = HotPath.stats();
    assert_eq!(after.live_blocks, start.live_blocks);
    assert_eq!(after.live_granted_bytes, start.live_granted_bytes);
    assert_eq!(
        after.allocations - start.allocations,
        after.frees - start.frees
    );

    drop((kept, neighbour));
    assert_eq!(Subsystem.stats().live_granted_bytes, 0);
    assert_eq!(Neighbour.stats().live_requested_bytes, Some(0));
}
