//! Allocation records: a subsystem with full records (call stacks), the whole program
//! sampled, a deliberate leak, and every records report written to a temporary directory.
//!
//! ```sh
//! cargo run --example records
//! TAGALLOC_RECORDS="SystemAllocator=basic" cargo run --example records   # record everything
//! ```
//!
//! Open `dhat-heap.json` in DHAT's viewer (`/usr/libexec/valgrind/dh_view.html` from valgrind,
//! or <https://nnethercote.github.io/dh_view/dh_view.html>) or the Firefox Profiler
//! (<https://profiler.firefox.com>), and `heap.pb.gz` with `go tool pprof -http=:8080 heap.pb.gz`.

use allocator_api2::boxed::Box as ABox;
use allocator_api2::vec::Vec as AVec;
use std::collections::HashMap;
use std::fs;
use std::hint::black_box;
use tagalloc::records::{self, RecordMode};
use tagalloc::report;
use tagalloc::{SystemAllocator, allocator};

#[global_allocator]
static GLOBAL: SystemAllocator = SystemAllocator::new();

allocator!(pub ScriptCanvas: child of SystemAllocator, "Script Canvas");
allocator!(pub Particles: pool of SystemAllocator, "Particles");

/// A script graph: nodes and their names, all in the Script Canvas allocator.
struct Graph {
    nodes: AVec<[f32; 16], ScriptCanvas>,
    names: hashbrown::HashMap<
        u32,
        AVec<u8, ScriptCanvas>,
        hashbrown::DefaultHashBuilder,
        ScriptCanvas,
    >,
}

#[inline(never)]
fn load_graph(nodes: usize) -> Graph {
    let mut graph = Graph {
        nodes: AVec::new_in(ScriptCanvas),
        names: hashbrown::HashMap::with_hasher_in(Default::default(), ScriptCanvas),
    };
    for i in 0..nodes {
        graph.nodes.push([i as f32; 16]);
        let mut name = AVec::with_capacity_in(24, ScriptCanvas);
        name.extend_from_slice(format!("node {i}").as_bytes());
        graph.names.insert(i as u32, name);
    }
    graph
}

/// Forgets to free what it allocates: the leak the reports should point at.
#[inline(never)]
fn cache_compiled_script(size: usize) {
    let bytecode = ABox::new_in([0xC3u8; 512], ScriptCanvas);
    std::mem::forget(bytecode);
    let mut buffer = AVec::<u8, ScriptCanvas>::with_capacity_in(size, ScriptCanvas);
    buffer.resize(size, 0x90);
    std::mem::forget(buffer);
}

#[inline(never)]
fn spawn_particles(n: usize) -> Vec<ABox<[f32; 8], Particles>> {
    (0..n)
        .map(|i| ABox::new_in([i as f32; 8], Particles))
        .collect()
}

/// Ordinary program work through the global allocator (sampled).
#[inline(never)]
fn word_counts(rounds: usize) -> usize {
    let mut total = 0;
    for r in 0..rounds {
        let mut counts: HashMap<String, usize> = HashMap::new();
        for i in 0..2000 {
            *counts
                .entry(format!("word{}", (i * 7 + r) % 500))
                .or_default() += 1;
        }
        total += black_box(counts.len());
    }
    total
}

fn main() -> std::io::Result<()> {
    // Full records (8 frames) for the subsystem, basic for the pool; the whole program is
    // sampled unless TAGALLOC_RECORDS says otherwise for it.
    ScriptCanvas.set_records(RecordMode::full());
    Particles.set_records(RecordMode::Basic);
    if GLOBAL.record_mode() == RecordMode::Off {
        GLOBAL.set_records(RecordMode::Sample {
            interval: 64 * 1024,
            frames: 8,
        });
    }

    let graph = load_graph(300);
    let particles = spawn_particles(200);
    cache_compiled_script(3000);
    let words = word_counts(20);
    drop(particles);

    let dir = std::env::temp_dir().join(format!("tagalloc-records-{}", std::process::id()));
    fs::create_dir_all(&dir)?;
    let mut snapshot = records::snapshot();
    snapshot.resolve();

    let mut dump = Vec::new();
    snapshot.write_dump(&mut dump, None)?;
    fs::write(dir.join("records.txt"), &dump)?;
    let mut sites = Vec::new();
    snapshot.write_call_sites(&mut sites)?;
    fs::write(dir.join("call-sites.txt"), &sites)?;
    let mut leaks = Vec::new();
    snapshot.write_leaks(&mut leaks)?;
    fs::write(dir.join("leaks.txt"), &leaks)?;
    fs::write(dir.join("dhat-heap.json"), snapshot.to_dhat_json())?;
    fs::write(dir.join("heap.pb.gz"), snapshot.to_pprof())?;
    fs::write(dir.join("records.json"), snapshot.to_json())?;
    report::write_report_at_exit(dir.join("exit-report.txt"))?;

    println!(
        "{} live records ({} words counted, {} graph nodes)",
        snapshot.records.len(),
        words,
        graph.nodes.len() + graph.names.len()
    );
    println!("Call sites, largest first (excerpt):");
    for line in String::from_utf8_lossy(&sites).lines().take(16) {
        println!("  {line}");
    }
    println!("Reports written to {}:", dir.display());
    for name in [
        "records.txt",
        "call-sites.txt",
        "leaks.txt",
        "dhat-heap.json",
        "heap.pb.gz",
        "records.json",
    ] {
        println!("  {name}");
    }
    println!("  exit-report.txt (written when the process exits)");
    println!(
        "Open dhat-heap.json in DHAT's viewer (/usr/libexec/valgrind/dh_view.html, or \
         https://nnethercote.github.io/dh_view/dh_view.html) or https://profiler.firefox.com"
    );
    println!("Open heap.pb.gz with: go tool pprof -http=:8080 heap.pb.gz");
    drop(graph);
    Ok(())
}
