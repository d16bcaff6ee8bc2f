//! A pretend GPU heap managed by a virtual block: allocate textures and buffers, free some,
//! defragment, print statistics, and write the JSON dumps and the SVG memory map.
//!
//! Run: `cargo run --example virtual_block [output-directory]` (default: the temp directory).
//! It writes `virtual_block.json` (VMA's virtual-block JSON), `virtual_block_gpu_dump.json`
//! (VMA's full dump shape: `python GpuMemDumpVis.py -o map.png virtual_block_gpu_dump.json`
//! with VMA's viewer draws it) and `virtual_block.svg` / `virtual_block_before_defrag.svg`.

use std::path::PathBuf;

use tagalloc::virtual_block::{
    DefragLimits, DumpBlock, DumpedAllocation, MapRow, Request, ResourceKind, Strategy, Tag,
    VirtualBlock, gpu_mem_dump, memory_map_svg,
};

const KI: u64 = 1 << 10;
const MI: u64 = 1 << 20;

const TEXTURES: Tag = Tag::new("textures");
const VERTEX_BUFFERS: Tag = Tag::new("vertex buffers");
const UNIFORMS: Tag = Tag::new("uniforms");

/// Deterministic pseudo-random numbers, so the picture is the same on every run.
struct Rng(u64);

impl Rng {
    fn below(&mut self, n: u64) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0 % n
    }
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let out_dir = std::env::args()
        .nth(1)
        .map_or_else(std::env::temp_dir, PathBuf::from);
    std::fs::create_dir_all(&out_dir)?;

    // A 256 MiB device-local heap. The user data is the resource id a renderer would keep.
    let mut heap: VirtualBlock<u32> = VirtualBlock::new(256 * MI);
    heap.set_name("device-local heap 0");
    let mut rng = Rng(0x1234_5678);
    let mut live = Vec::new();
    for id in 0..600u32 {
        let (req, name) = match rng.below(3) {
            // Textures: 64 KiB-aligned, 256 KiB .. 2 MiB.
            0 => (
                Request::new(256 * KI + rng.below(1792) * KI)
                    .align(64 * KI)
                    .tag(TEXTURES),
                format!("texture #{id}"),
            ),
            // Vertex buffers: 256-aligned, 4 KiB .. 512 KiB.
            1 => (
                Request::new(4 * KI + rng.below(508 * KI))
                    .align(256)
                    .tag(VERTEX_BUFFERS),
                format!("mesh #{id}"),
            ),
            // Uniform blocks: small, 256-aligned.
            _ => (
                Request::new(256 + rng.below(3840)).align(256).tag(UNIFORMS),
                format!("constants #{id}"),
            ),
        };
        match heap.allocate(&req.name(&name), id) {
            Ok(a) => live.push(a),
            Err(e) => println!("allocation {id} failed: {e}"),
        }
        // Streaming: now and then a resource goes away.
        if !live.is_empty() && rng.below(3) == 0 {
            let victim = live.swap_remove(rng.below(live.len() as u64) as usize);
            heap.free(victim)?;
        }
    }
    heap.validate()?;
    report("after streaming", &heap);

    // The picture before defragmentation.
    let before = heap.to_svg();

    // Defragment in passes of at most 32 MiB / 64 moves. A renderer would record a GPU copy
    // per move here and wait for it before committing.
    let limits = DefragLimits {
        max_bytes: 32 * MI,
        max_moves: 64,
    };
    let mut passes = 0;
    loop {
        let moves = heap.defrag_pass(&limits)?;
        if moves.is_empty() {
            break;
        }
        for m in &moves {
            // copy_gpu_buffer(m.src_offset(), m.dst_offset(), m.size());
            let new = heap.commit_move(m)?;
            let slot = live
                .iter()
                .position(|&a| a == m.handle())
                .expect("moved a live resource");
            live[slot] = new;
        }
        passes += 1;
    }
    heap.validate()?;
    println!("\ndefragmented in {passes} passes");
    report("after defragmentation", &heap);

    // A small per-frame upload ring next to it: a linear block used as a ring buffer. Its
    // tags are made at run time, one per frame parity.
    let mut ring: VirtualBlock<()> = VirtualBlock::new_linear(4 * MI);
    ring.set_name("upload ring");
    let mut in_flight = std::collections::VecDeque::new();
    let upload_tags = [
        Tag::intern("uploads, even frames"),
        Tag::intern("uploads, odd frames"),
    ];
    for frame in 0..40 {
        let req = Request::new(128 * KI + rng.below(256) * KI)
            .align(256)
            .tag(upload_tags[frame % 2]);
        let a = loop {
            match ring.allocate(&req, ()) {
                Ok(a) => break a,
                // Full: retire the oldest frame's upload.
                Err(_) => ring.free(in_flight.pop_front().expect("ring holds something"))?,
            }
        };
        in_flight.push_back(a);
    }
    ring.validate()?;

    let json_path = out_dir.join("virtual_block.json");
    std::fs::write(&json_path, heap.to_json_with(true, |&id| u64::from(id)))?;
    // VMA's full dump for its own viewer: resource kinds and Vulkan usage flags by tag, the
    // resource id as custom data.
    let dump_path = out_dir.join("virtual_block_gpu_dump.json");
    let describe = |a: &tagalloc::virtual_block::AllocInfo<'_, u32>| {
        let (kind, usage) = match a.tag.map(Tag::name) {
            Some("textures") => (ResourceKind::ImageOptimal, 0x4), // SAMPLED
            Some("vertex buffers") => (ResourceKind::Buffer, 0x80), // VERTEX_BUFFER
            Some("uniforms") => (ResourceKind::Buffer, 0x10),      // UNIFORM_BUFFER
            _ => (ResourceKind::Unknown, 0),
        };
        DumpedAllocation {
            kind,
            usage,
            custom_data: u64::from(*a.user),
        }
    };
    std::fs::write(
        &dump_path,
        gpu_mem_dump(
            "pretend GPU",
            &[
                DumpBlock::with("device-local heap", &heap, describe),
                DumpBlock::new("upload ring", &ring),
            ],
        ),
    )?;
    // The map, with the first 8 MiB of the heap magnified.
    let svg_path = out_dir.join("virtual_block.svg");
    std::fs::write(
        &svg_path,
        memory_map_svg(&[
            MapRow::new("", &heap).zoom(0, 8 * MI),
            MapRow::new("", &ring),
        ]),
    )?;
    let before_path = out_dir.join("virtual_block_before_defrag.svg");
    std::fs::write(&before_path, before)?;
    println!(
        "\nwrote {}\n      {}\n      {}\n      {}",
        json_path.display(),
        dump_path.display(),
        svg_path.display(),
        before_path.display()
    );

    // The strategy matters little for speed and a little for packing: compare on one request.
    let probe = heap.allocate(
        &Request::new(MI)
            .align(64 * KI)
            .strategy(Strategy::MinMemory),
        0,
    )?;
    println!(
        "a 1 MiB best-fit probe landed at offset {} MiB",
        probe.offset() / MI
    );
    Ok(())
}

fn report(title: &str, heap: &VirtualBlock<u32>) {
    let s = heap.statistics();
    let d = heap.detailed_statistics();
    println!("\n== {title}: {}", heap.name().unwrap_or("heap"));
    println!(
        "   {} allocations, {:.1} MiB of {:.1} MiB used, {} free ranges, largest free {:.2} MiB, fragmentation {:.3}",
        s.allocation_count,
        s.allocation_bytes as f64 / MI as f64,
        s.block_bytes as f64 / MI as f64,
        d.unused_range_count,
        heap.largest_free() as f64 / MI as f64,
        heap.fragmentation()
    );
    for t in heap.tag_statistics() {
        println!(
            "   {:<15} {:>4} allocations {:>8.2} MiB",
            t.tag.map_or("untagged", Tag::name),
            t.allocation_count,
            t.allocation_bytes as f64 / MI as f64
        );
    }
}
