//! A block recorded by a child and by the `SystemAllocator` above it is one block: the leak
//! report's totals and the DHAT profile's figures count it once, and the per-allocator
//! sections say which of the parent's blocks are the child's.
//!
//! One test: it reads the process-wide records. tagalloc is not the global allocator here,
//! so the `SystemAllocator` records only what passes through it (the child's blocks and the
//! ones this test allocates from it directly).

mod common;

use allocator_api2::boxed::Box as ABox;
use serde_json::Value;
use std::alloc::{GlobalAlloc, Layout};
use tagalloc::records::RecordMode;
use tagalloc::{SystemAllocator, report};

tagalloc::allocator!(Loader: child of SystemAllocator, "Loader");

#[inline(never)]
fn leak_one_block() {
    std::mem::forget(ABox::new_in([7u8; 1000], Loader));
}

#[inline(never)]
fn churn_through_loader() {
    for i in 0..10u8 {
        std::hint::black_box(ABox::new_in([i; 200], Loader));
    }
}

#[inline(never)]
fn parents_own_block() -> *mut u8 {
    // SAFETY: a non-zero size; freed below with the same layout.
    let p = unsafe { SystemAllocator::new().alloc(Layout::from_size_align(300, 8).unwrap()) };
    // Used after the call, so that the call is not a tail call (this frame stays).
    std::hint::black_box(p)
}

/// A DHAT program point: (frames as text, tbk, ebk, eb).
type Point = (Vec<String>, u64, u64, u64);

/// The DHAT profile's program points.
fn dhat_points() -> Vec<Point> {
    let v: Value = serde_json::from_str(&report::dhat_profile()).expect("valid JSON");
    let ftbl = v["ftbl"].as_array().unwrap();
    v["pps"]
        .as_array()
        .unwrap()
        .iter()
        .map(|pp| {
            let frames = pp["fs"]
                .as_array()
                .unwrap()
                .iter()
                .map(|f| {
                    ftbl[f.as_u64().unwrap() as usize]
                        .as_str()
                        .unwrap()
                        .to_string()
                })
                .collect();
            let n = |k: &str| pp[k].as_u64().unwrap();
            (frames, n("tbk"), n("ebk"), n("eb"))
        })
        .collect()
}

fn leak_report() -> String {
    let mut out = Vec::new();
    report::dump_leaks(&mut out).unwrap();
    String::from_utf8(out).unwrap()
}

#[test]
fn a_block_recorded_by_a_child_and_its_parent_counts_once() {
    SystemAllocator::new().set_records(RecordMode::full());
    Loader.set_records(RecordMode::full());
    leak_one_block();

    let leaks = leak_report();
    let first = leaks.lines().next().unwrap();
    assert_eq!(
        first,
        "Leak report: 1.0 KiB in 1 block still live (1000 B requested), recorded by 2 allocators",
        "{leaks}"
    );
    // Each allocator still lists the block; the parent says it is the child's.
    assert!(
        leaks.contains(
            "SystemAllocator: 1.0 KiB in 1 block at 1 call site, of which 1.0 KiB in 1 block \
             through Loader (listed there too)"
        ),
        "{leaks}"
    );
    assert!(
        leaks.contains("\nLoader: 1.0 KiB in 1 block at 1 call site\n"),
        "{leaks}"
    );

    // DHAT: one program point, under the allocator chain, then the call site.
    let points = dhat_points();
    assert_eq!(points.len(), 1, "{points:?}");
    let (frames, tbk, ebk, eb) = &points[0];
    assert_eq!((*tbk, *ebk, *eb), (1, 1, 1024));
    assert!(
        frames[0].contains("[allocator SystemAllocator]"),
        "{frames:?}"
    );
    assert!(frames[1].contains("[allocator Loader]"), "{frames:?}");
    assert!(frames[2].contains("leak_one_block"), "{frames:?}");

    // Freed blocks count once too, and the parent's own blocks stay its own.
    churn_through_loader();
    let own = parents_own_block();
    let points = dhat_points();
    let sum = |f: fn(&Point) -> u64| points.iter().map(f).sum::<u64>();
    assert_eq!(sum(|p| p.1), 1 + 10 + 1, "blocks allocated: {points:?}");
    assert_eq!(sum(|p| p.2), 2, "blocks live: {points:?}");
    let churn = points
        .iter()
        .find(|p| p.0.iter().any(|f| f.contains("churn_through_loader")))
        .expect("the churn's program point");
    assert_eq!((churn.1, churn.2), (10, 0));
    assert!(churn.0[1].contains("[allocator Loader]"));
    let parents = points
        .iter()
        .find(|p| p.0.iter().any(|f| f.contains("parents_own_block")))
        .expect("the parent's own program point");
    assert_eq!((parents.1, parents.2), (1, 1));
    assert!(parents.0[0].contains("[allocator SystemAllocator]"));
    assert!(!parents.0[1].contains("[allocator"), "{:?}", parents.0);
    assert!(
        leak_report().starts_with("Leak report: 1.3 KiB in 2 blocks still live"),
        "{}",
        leak_report()
    );

    // DHAT's own viewer: its root counts each block once, and its tree splits by allocator
    // first (the SystemAllocator, then the Loader beside the SystemAllocator's own block).
    if let Some(text) = common::viewers::dh_view_text(&report::dhat_profile()) {
        let root = &text[text.find("PP 1/1").expect("the root")..];
        let root = &root[..root.find("PP 1.1/").expect("the root's children")];
        assert!(root.contains("in 12 blocks (100%"), "{root}");
        assert!(
            root.contains("At t-end:") && root.contains("in 2 blocks (100%)"),
            "{root}"
        );
        assert!(
            root.contains("#1: 0x0: [allocator SystemAllocator]"),
            "{root}"
        );
        assert!(text.contains("#2: 0x0: [allocator Loader]"), "{text}");
        assert!(text.contains("parents_own_block"), "{text}");
    }

    // pprof: the same figures, each block once, labelled with its allocator.
    let live_bytes: u64 = points.iter().map(|p| p.3).sum();
    let profile = report::pprof_profile();
    let decoded = common::pprof::decode(&profile);
    assert_eq!(
        decoded.sample_types,
        [
            "alloc_objects/count",
            "alloc_space/bytes",
            "inuse_objects/count",
            "inuse_space/bytes"
        ]
    );
    assert_eq!(decoded.period, ("space/bytes".to_string(), 1));
    assert_eq!(decoded.total(0, None), 12);
    assert_eq!(decoded.total(2, None), 2);
    assert_eq!(decoded.total(3, None), live_bytes as i64);
    assert_eq!(decoded.total(0, Some(("allocator", "Loader"))), 11);
    assert_eq!(decoded.total(2, Some(("allocator", "SystemAllocator"))), 1);
    assert!(
        decoded
            .samples
            .iter()
            .all(|(_, labels)| labels.iter().any(|(k, _)| k == "allocator"))
    );
    if common::pprof::go_pprof_installed() {
        let dir = common::viewers::scratch_dir("pprof");
        let file = dir.join("heap.pb.gz");
        std::fs::write(&file, &profile).unwrap();
        let raw = common::pprof::go_pprof(&["-raw"], &file);
        assert!(
            raw.contains(
                "alloc_objects/count alloc_space/bytes inuse_objects/count inuse_space/bytes"
            ) && raw.contains("PeriodType: space bytes"),
            "{raw}"
        );
        assert!(raw.contains("allocator:[Loader]"), "{raw}");
        let tags = common::pprof::go_pprof(&["-tags"], &file);
        let allocators = &tags[tags.find("allocator: Total").expect("allocator tags")..];
        let allocators = &allocators[..allocators.find("\n\n").unwrap_or(allocators.len())];
        assert!(
            allocators.contains("): Loader") && allocators.contains("): SystemAllocator"),
            "{tags}"
        );
        let top = common::pprof::go_pprof(&["-top", "-sample_index=alloc_objects"], &file);
        assert!(top.contains("Total samples = 12"), "{top}");
        assert!(top.contains("churn_through_loader"), "{top}");
        let top = common::pprof::go_pprof(&["-top"], &file);
        assert!(
            top.contains(&format!("Total samples = {live_bytes}B")),
            "{live_bytes} B live:\n{top}"
        );
        let loader = common::pprof::go_pprof(&["-top", "-tagfocus=allocator=Loader"], &file);
        assert!(loader.contains("leak_one_block"), "{loader}");
        assert!(!loader.contains("parents_own_block"), "{loader}");
        let _ = std::fs::remove_dir_all(&dir);
    }

    // SAFETY: allocated above with this layout.
    unsafe { SystemAllocator::new().dealloc(own, Layout::from_size_align(300, 8).unwrap()) };
}
