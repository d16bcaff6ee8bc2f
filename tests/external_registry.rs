//! An `ExternalMapAllocator` (O3DE's BestFitExternalMap facade over a virtual block)
//! registered as an allocator: its live bytes and blocks show in the registry and in every
//! report. Own binary: it reads process-wide registry figures.

use core::ptr::NonNull;
use tagalloc::AllocatorKind;
use tagalloc::registry::Registration;
use tagalloc::report::Snapshot;
use tagalloc::virtual_block::ExternalMapAllocator;

static GPU_HEAP: Registration = Registration::new(
    "TestGpuHeap",
    "Device-local memory (never touched)",
    AllocatorKind::External,
    None,
    Registration::read_counters,
);

#[test]
fn a_registered_external_map_appears_in_the_reports_and_counts_exactly() {
    // A pretend GPU range: the facade never dereferences it.
    let base = NonNull::new(0x1000_0000 as *mut u8).unwrap();
    let mut heap = ExternalMapAllocator::new("TestGpuHeap", base, 64 << 20).unwrap();
    let early = heap.allocate(1 << 20, 4096).unwrap();
    heap.register(&GPU_HEAP);
    let textures: Vec<_> = (0..10)
        .map(|i| heap.allocate(256 << 10, 256 << (i % 3)).unwrap())
        .collect();

    let stats = GPU_HEAP.stats();
    assert_eq!(
        stats.live_blocks, 11,
        "blocks live before registering count too"
    );
    assert_eq!(stats.live_granted_bytes, (1 << 20) + 10 * (256 << 10));
    assert_eq!(
        stats.live_granted_bytes as u64,
        heap.statistics().live_bytes,
        "registry and facade agree"
    );

    let snapshot = Snapshot::take();
    let row = snapshot.find("TestGpuHeap").expect("registered");
    assert_eq!(row.kind, AllocatorKind::External);
    assert_eq!(row.parent, None);
    let mut csv = Vec::new();
    snapshot.write_csv(&mut csv).unwrap();
    let csv = String::from_utf8(csv).unwrap();
    assert!(csv.contains("TestGpuHeap,"), "{csv}");
    assert!(tagalloc::report::json().contains("\"kind\":\"external\""));

    for t in textures {
        heap.deallocate(t.as_ptr()).unwrap();
    }
    heap.deallocate(early.as_ptr()).unwrap();
    let end = GPU_HEAP.stats();
    assert_eq!((end.live_blocks, end.live_granted_bytes), (0, 0));
    assert_eq!(end.allocations, end.frees);
}
