//! VMA's full JSON dump for a set of virtual blocks ([`gpu_mem_dump`]): valid against the
//! dump's JSON Schema (tests/data/gpu_mem_dump.schema.json, and VMA's own
//! GpuMemDump.schema.json when it is put next to it), consistent with the blocks, and
//! readable by VMA's viewer when one is at hand (`VMA_GPU_MEM_DUMP_VIS=<path to
//! GpuMemDumpVis.py>`, with python3 and Pillow).

use std::path::Path;
use std::process::Command;

use serde_json::Value;
use tagalloc::virtual_block::{
    DefragLimits, DumpBlock, DumpedAllocation, Request, ResourceKind, Tag, VirtualBlock,
    gpu_mem_dump,
};

/// Blocks of every kind: tagged and named allocations with user data, a second block of the
/// same pool, a linear ring, a pending defragmentation move, an empty block.
fn dump() -> (String, Vec<(u64, u64)>) {
    let mut heap = VirtualBlock::<u32>::new(64 << 20);
    let mut handles = Vec::new();
    for i in 0..60u32 {
        let (tag, align) = if i % 3 == 0 {
            (Tag::new("textures"), 64 << 10)
        } else {
            (Tag::intern(&format!("buffers {}", i % 2)), 256)
        };
        let r = Request::new(4096 + u64::from(i) * 3000)
            .align(align)
            .tag(tag);
        let name = format!("resource \"{i}\"");
        let r = if i % 4 == 0 { r.name(&name) } else { r };
        handles.push(heap.allocate(&r, 1000 + i).unwrap());
    }
    for h in handles.iter().step_by(5) {
        heap.free(*h).unwrap();
    }
    let mut second = VirtualBlock::<u32>::new(16 << 20);
    second.allocate(&Request::new(5 << 20), 7).unwrap();
    let mut ring = VirtualBlock::<()>::new_linear(4 << 20);
    let first = ring.allocate(&Request::new(1 << 20), ()).unwrap();
    ring.allocate(&Request::new(1 << 20), ()).unwrap();
    ring.free(first).unwrap();
    ring.allocate(&Request::new(512 << 10), ()).unwrap(); // wraps
    let mut moving = VirtualBlock::<()>::new(1 << 20);
    let a = moving.allocate(&Request::new(1000), ()).unwrap();
    moving.allocate(&Request::new(1000), ()).unwrap();
    moving.free(a).unwrap();
    let moves = moving.defrag_pass(&DefragLimits::default()).unwrap();
    assert_eq!(moves.len(), 1, "one pending move, its destination reserved");
    let empty = VirtualBlock::<()>::new(1 << 16);

    let describe = |a: &tagalloc::virtual_block::AllocInfo<'_, u32>| DumpedAllocation {
        kind: if a.tag == Some(Tag::new("textures")) {
            ResourceKind::ImageOptimal
        } else {
            ResourceKind::Buffer
        },
        usage: 0x84,
        custom_data: u64::from(*a.user),
    };
    let blocks = [
        DumpBlock::with("device heap", &heap, describe),
        DumpBlock::new("upload ring", &ring),
        DumpBlock::with("device heap", &second, describe),
        DumpBlock::new("defragmenting", &moving),
        DumpBlock::new("empty", &empty),
    ];
    let sizes = [&heap as &dyn Capacity, &ring, &second, &moving, &empty]
        .iter()
        .map(|b| (b.capacity(), b.allocated()))
        .collect();
    (gpu_mem_dump("tagalloc \"test\" GPU", &blocks), sizes)
}

/// Capacity and allocated units, whatever the user-data type.
trait Capacity {
    fn capacity(&self) -> u64;
    fn allocated(&self) -> u64;
}

impl<U> Capacity for VirtualBlock<U> {
    fn capacity(&self) -> u64 {
        VirtualBlock::capacity(self)
    }
    fn allocated(&self) -> u64 {
        self.statistics().allocation_bytes
    }
}

fn validator(path: &Path) -> jsonschema::Validator {
    let schema: Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    jsonschema::validator_for(&schema).expect("a valid schema")
}

fn schemas() -> Vec<std::path::PathBuf> {
    let data = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data");
    ["gpu_mem_dump.schema.json", "GpuMemDump.schema.json"]
        .iter()
        .map(|f| data.join(f))
        .filter(|p| p.exists())
        .collect()
}

#[test]
fn the_dump_is_valid_against_the_schema() {
    let (text, _) = dump();
    let json: Value = serde_json::from_str(&text).expect("the dump parses as JSON");
    let schemas = schemas();
    assert!(!schemas.is_empty());
    for path in &schemas {
        let v = validator(path);
        let errors: Vec<String> = v.iter_errors(&json).map(|e| e.to_string()).collect();
        assert!(errors.is_empty(), "{}: {errors:?}", path.display());
        // The schema has teeth: a suballocation without its Type, or an unknown type, fails.
        for broken in [
            text.replacen("\"Type\": \"FREE\", ", "", 1),
            text.replacen("\"Type\": \"UNKNOWN\"", "\"Type\": \"WHATEVER\"", 1),
            text.replacen("\"General\"", "\"Generals\"", 1),
        ] {
            let broken: Value = serde_json::from_str(&broken).unwrap();
            assert!(
                !v.is_valid(&broken),
                "{} accepts a broken dump",
                path.display()
            );
        }
    }
}

#[test]
fn the_dump_describes_the_blocks() {
    let (text, sizes) = dump();
    let json: Value = serde_json::from_str(&text).unwrap();
    assert_eq!(json["General"]["API"], "Vulkan");
    assert_eq!(json["General"]["GPU"], "tagalloc \"test\" GPU");
    let pools = json["CustomPools"]["Type 0"].as_array().unwrap();
    let names: Vec<&str> = pools.iter().map(|p| p["Name"].as_str().unwrap()).collect();
    assert_eq!(
        names,
        ["device heap", "upload ring", "defragmenting", "empty"]
    );
    assert_eq!(pools[0]["Blocks"].as_object().unwrap().len(), 2);
    assert_eq!(pools[1]["Flags"][0], "LINEAR");
    // Blocks in dump order: heap, second (same pool), ring, moving, empty.
    let blocks: Vec<&Value> = pools
        .iter()
        .flat_map(|p| p["Blocks"].as_object().unwrap().values())
        .collect();
    let expected = [sizes[0], sizes[2], sizes[1], sizes[3], sizes[4]];
    let (mut total_bytes, mut total_allocated) = (0, 0);
    for (b, (capacity, allocated)) in blocks.iter().zip(expected) {
        assert_eq!(b["TotalBytes"], capacity);
        assert_eq!(b["UnusedBytes"], capacity - allocated);
        // The suballocations tile the block in offset order.
        let mut end = 0;
        let mut used = 0;
        for s in b["Suballocations"].as_array().unwrap() {
            assert_eq!(s["Offset"], end);
            let size = s["Size"].as_u64().unwrap();
            end += size;
            if s["Type"] != "FREE" {
                used += size;
                assert!(s["Usage"].is_u64());
            }
        }
        assert_eq!((end, used), (capacity, allocated));
        total_bytes += capacity;
        total_allocated += allocated;
    }
    assert_eq!(json["Total"]["BlockCount"], 5);
    assert_eq!(json["Total"]["BlockBytes"], total_bytes);
    assert_eq!(json["Total"]["AllocationBytes"], total_allocated);
    let heap = &json["MemoryInfo"]["Heap 0"];
    assert_eq!(heap["Budget"]["UsageBytes"], total_allocated);
    assert_eq!(heap["Stats"], json["Total"]);
    // Kinds, custom data (the user data, in hex, as VMA writes a pointer), escaped names.
    let heap_subs = blocks[0]["Suballocations"].as_array().unwrap();
    assert!(heap_subs.iter().any(|s| s["Type"] == "IMAGE_OPTIMAL"));
    assert!(heap_subs.iter().any(|s| s["Type"] == "BUFFER"));
    assert!(
        heap_subs
            .iter()
            .any(|s| s["CustomData"] == format!("0x{:x}", 1004) && s["Name"] == "resource \"4\"")
    );
    let moving = blocks[3]["Suballocations"].as_array().unwrap();
    assert!(moving.iter().any(|s| s["Name"] == "defrag destination"));
}

#[test]
fn vma_viewer_draws_the_dump() {
    let Some(script) = std::env::var_os("VMA_GPU_MEM_DUMP_VIS") else {
        println!(
            "skipped: set VMA_GPU_MEM_DUMP_VIS to VMA's tools/GpuMemDumpVis/GpuMemDumpVis.py to run VMA's viewer"
        );
        return;
    };
    let dir = std::env::temp_dir().join(format!("tagalloc-vb-dump-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let (input, output) = (dir.join("dump.json"), dir.join("dump.png"));
    std::fs::write(&input, dump().0).unwrap();
    let out = Command::new("python3")
        .arg(&script)
        .arg("-o")
        .arg(&output)
        .arg(&input)
        .output()
        .expect("python3 runs");
    let png = std::fs::read(&output).ok();
    let _ = std::fs::remove_dir_all(&dir);
    assert!(
        out.status.success(),
        "GpuMemDumpVis.py failed: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    let png = png.expect("the viewer wrote a picture");
    assert!(png.starts_with(b"\x89PNG"));
}
