//! A small game-like program that tags its memory by subsystem, then shows where every
//! byte is.
//!
//! Run with `cargo run --release -p game` (the `game` package of the workspace: it depends
//! on tagalloc, allocator-api2 and serde_json only, so it builds quickly).
//!
//! The loader, renderer, physics, audio and scripting each have their own child of the
//! SystemAllocator (textures are a child of the renderer). Most of their memory is ordinary
//! std containers (`Vec`, `String`, `HashMap`) and a third-party crate (serde_json parsing
//! the level), made inside each subsystem's *scoped tag* (`Renderer.scope(..)`, `.enter()`,
//! `.bind(..)` for threads); rigid bodies and their contacts go through the physics
//! allocator's handle instead (`ClassAllocator`, `allocator_api2` containers). Particles live
//! in a thread pool shared by the worker threads; UI events come from a single-threaded
//! pool. A frame loop runs physics and particles on worker threads, and frees on one thread
//! what another allocated. At the end it prints O3DE's `sys_DumpAllocators` table, the
//! allocator tree, and a JSON snapshot.

use allocator_api2::boxed::Box as ABox;
use allocator_api2::vec::Vec as AVec;
use std::collections::HashMap;
use std::sync::mpsc;
use std::thread;
use tagalloc::report::Snapshot;
use tagalloc::{BudgetEvent, BudgetMode, ClassAllocator, SystemAllocator, TaggedAllocator};

#[global_allocator]
static GLOBAL: SystemAllocator = SystemAllocator::new();

tagalloc::allocator!(pub LoaderAllocator: child of SystemAllocator, "The level description (serde_json)");
tagalloc::allocator!(pub RendererAllocator: child of SystemAllocator, "Meshes, draw lists");
tagalloc::allocator!(pub TextureAllocator: child of RendererAllocator, "Texture pixels");
tagalloc::allocator!(pub PhysicsAllocator: child of SystemAllocator, "Rigid bodies, contacts");
tagalloc::allocator!(pub AudioAllocator: child of SystemAllocator, "Voices, mix buffers");
tagalloc::allocator!(pub ScriptAllocator: child of SystemAllocator, "Script Canvas graphs");
tagalloc::allocator!(
    pub ParticleAllocator: thread_pool of SystemAllocator
        { page_size: 65536, min_size: 16, max_size: 256 },
    "Particles (per-thread pools)"
);
tagalloc::allocator!(pub UiEventPool: pool of SystemAllocator, "UI events (one thread)");

const FRAMES: usize = 120;
const WORKERS: usize = 2;

/// A rigid body: created in the physics allocator (`AZ_CLASS_ALLOCATOR`), through its
/// handle; its contacts are an `allocator_api2` vector in the same allocator.
struct RigidBody {
    position: [f32; 3],
    velocity: [f32; 3],
    contacts: AVec<u32, PhysicsAllocator>,
}
impl ClassAllocator for RigidBody {
    type Allocator = PhysicsAllocator;
}

/// A particle: 48 bytes, in the thread pool.
#[derive(Clone, Copy)]
struct Particle {
    position: [f32; 3],
    velocity: [f32; 3],
    life: f32,
    _pad: [f32; 5],
}

/// A tiny deterministic random generator.
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn unit(&mut self) -> f32 {
        (self.next() % 10_000) as f32 / 10_000.0
    }
}

/// Counts how often the audio budget is exceeded (the hook must not allocate much; this
/// one only counts).
static AUDIO_OVER_BUDGET: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
fn audio_budget_hook(_: &BudgetEvent) {
    AUDIO_OVER_BUDGET.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
}

/// One physics step on a worker: moves bodies, records contacts.
fn step_physics(bodies: &mut [ABox<RigidBody, PhysicsAllocator>], rng: &mut Rng) {
    for body in bodies.iter_mut() {
        for k in 0..3 {
            body.position[k] += body.velocity[k] / 60.0;
        }
        body.velocity[1] -= 9.81 / 60.0;
        if body.position[1] < 0.0 {
            body.position[1] = 0.0;
            body.velocity[1] = -body.velocity[1] * 0.5;
            body.contacts.push(rng.next() as u32);
        }
        if body.contacts.len() > 64 {
            body.contacts.clear();
            body.contacts.shrink_to_fit();
        }
    }
}

/// Spawns particles on a worker thread; they are sent back and freed on the main thread.
fn emit_particles(count: usize, rng: &mut Rng) -> AVec<ABox<Particle, ParticleAllocator>> {
    (0..count)
        .map(|_| {
            ABox::new_in(
                Particle {
                    position: [rng.unit(), rng.unit(), rng.unit()],
                    velocity: [rng.unit() - 0.5, rng.unit(), rng.unit() - 0.5],
                    life: 1.0 + rng.unit(),
                    _pad: [0.0; 5],
                },
                ParticleAllocator,
            )
        })
        .collect()
}

/// The level file's text, as if read from disk (made outside any tag: the program's own).
fn level_file() -> String {
    let textures: Vec<String> = (0..12)
        .map(|i| format!(r#"{{"name": "texture_{i}", "side": {}}}"#, 128 << (i % 3)))
        .collect();
    let meshes: Vec<String> = (0..200)
        .map(|i| {
            format!(
                r#"{{"id": {i}, "vertices": {}, "material": "mat_{}"}}"#,
                100 + i * 7,
                i % 9
            )
        })
        .collect();
    let scripts: Vec<String> = (0..40)
        .map(|g| format!(r#"{{"graph": "graph_{g}", "nodes": {}}}"#, 50 * (g + 1)))
        .collect();
    format!(
        r#"{{"name": "Harbour", "textures": [{}], "meshes": [{}], "scripts": [{}]}}"#,
        textures.join(", "),
        meshes.join(", "),
        scripts.join(", ")
    )
}

/// A number in the level description.
fn field(value: &serde_json::Value, key: &str) -> usize {
    value[key].as_u64().expect("a number in the level") as usize
}

/// Writes the reports to files, in the directory given as the first argument (default
/// `target/game-report`): the tree as text, the memory timeline as CSV, and the HTML page.
fn write_reports(snapshot: &Snapshot) {
    let dir = std::path::PathBuf::from(
        std::env::args()
            .nth(1)
            .unwrap_or_else(|| "target/game-report".to_string()),
    );
    std::fs::create_dir_all(&dir).expect("a directory for the reports");
    let mut tree = Vec::new();
    snapshot.write_tree(&mut tree).unwrap();
    let files = [
        ("report.txt", tree),
        (
            "timeline.csv",
            tagalloc::report::timeline_csv().into_bytes(),
        ),
        // Open it in a browser: treemap, a chart per allocator, budgets.
        ("report.html", tagalloc::report::html().into_bytes()),
    ];
    println!();
    for (name, contents) in files {
        let path = dir.join(name);
        std::fs::write(&path, contents).expect("the report written");
        println!("wrote {}", path.display());
    }
}

fn main() {
    // Loading. The level description is parsed by serde_json inside the loader's tag: every
    // block of the parsed tree is the loader's, though serde_json knows nothing of tagalloc.
    let file = level_file();
    let level: serde_json::Value =
        LoaderAllocator.scope(|| serde_json::from_str(&file).expect("a valid level"));
    drop(file);
    // Textures, meshes and script graphs: std containers inside each subsystem's tag.
    let textures: Vec<Vec<u8>> = TextureAllocator.scope(|| {
        let list = level["textures"].as_array().unwrap();
        list.iter()
            .enumerate()
            .map(|(i, t)| vec![i as u8; field(t, "side").pow(2) * 4])
            .collect()
    });
    let meshes: HashMap<u32, Vec<[f32; 8]>> = RendererAllocator.scope(|| {
        let list = level["meshes"].as_array().unwrap();
        list.iter()
            .map(|m| {
                let vertices = (0..field(m, "vertices")).map(|v| [v as f32; 8]).collect();
                (field(m, "id") as u32, vertices)
            })
            .collect()
    });
    let scripts: HashMap<String, Vec<u64>> = {
        let _tag = ScriptAllocator.enter();
        let list = level["scripts"].as_array().unwrap();
        list.iter()
            .map(|g| {
                let name = g["graph"].as_str().unwrap().to_string();
                (name, (0..field(g, "nodes") as u64).collect())
            })
            .collect()
    };
    AudioAllocator.set_budget(Some(1 << 20), BudgetMode::Warn);
    AudioAllocator.set_budget_hook(audio_budget_hook);
    let mut voices: Vec<Vec<f32>> = AudioAllocator.scope(Vec::new);

    // Physics bodies live on the physics worker, particles are emitted by all workers.
    let (to_main, particles_in) = mpsc::channel::<AVec<ABox<Particle, ParticleAllocator>>>();
    let (frame_tx, frame_rx): (Vec<_>, Vec<_>) =
        (0..WORKERS).map(|_| mpsc::channel::<usize>()).unzip();
    let workers: Vec<_> = frame_rx
        .into_iter()
        .enumerate()
        .map(|(w, frames)| {
            let to_main = to_main.clone();
            // The worker runs inside the physics tag: its own scratch memory is physics'.
            thread::spawn(PhysicsAllocator.bind(move || {
                let mut rng = Rng(0x9E37_79B9_7F4A_7C15 ^ (w as u64 + 1));
                let mut bodies: Vec<ABox<RigidBody, PhysicsAllocator>> = (0..300)
                    .map(|_| {
                        RigidBody::new_boxed(RigidBody {
                            position: [rng.unit(), 10.0 * rng.unit(), rng.unit()],
                            velocity: [0.0; 3],
                            contacts: AVec::new_in(PhysicsAllocator),
                        })
                    })
                    .collect();
                for frame in frames {
                    step_physics(&mut bodies, &mut rng);
                    let burst = 200 + (frame * 37 + w * 11) % 300;
                    to_main.send(emit_particles(burst, &mut rng)).unwrap();
                }
                // The bodies outlive the worker: the main thread frees them at shutdown.
                bodies
            }))
        })
        .collect();
    drop(to_main);

    let mut live_particles: AVec<ABox<Particle, ParticleAllocator>> = AVec::new();
    let mut peak_particles = 0;
    let mut rng = Rng(42);
    for frame in 0..FRAMES {
        for tx in &frame_tx {
            tx.send(frame).unwrap();
        }
        // Collect this frame's particles from every worker; age and free old ones here
        // (a cross-thread free into the thread pool).
        for _ in 0..WORKERS {
            live_particles.extend(particles_in.recv().unwrap());
        }
        for p in live_particles.iter_mut() {
            p.life -= 1.0 / 30.0;
            for k in 0..3 {
                p.position[k] += p.velocity[k] / 60.0;
            }
        }
        live_particles.retain(|p| p.life > 0.0);
        peak_particles = peak_particles.max(live_particles.len());

        // Audio: start a voice now and then, stop old ones (a std Vec in the audio tag,
        // which has a 1 MiB budget in Warn mode).
        if frame % 4 == 0 {
            AudioAllocator.scope(|| {
                let buffer: Vec<f32> = (0..48_000 / 4).map(|s| (s as f32 * 0.01).sin()).collect();
                voices.push(buffer);
            });
        }
        if voices.len() > 40 {
            voices.remove(0);
        }

        // UI: a few events per frame, handled and dropped on this thread.
        let events: Vec<ABox<[u32; 6], UiEventPool>> = (0..(rng.next() % 8) as u32)
            .map(|e| ABox::new_in([e; 6], UiEventPool))
            .collect();
        drop(events);

        // Renderer: rebuild a draw list each frame (a std Vec in the renderer's tag).
        RendererAllocator.scope(|| {
            let mut draw_list: Vec<u32> = meshes.keys().copied().collect();
            draw_list.sort_unstable();
        });

        // One row of the memory timeline per frame (no allocation).
        tagalloc::report::mark_frame();
    }
    drop(frame_tx);
    let bodies: Vec<ABox<RigidBody, PhysicsAllocator>> = workers
        .into_iter()
        .flat_map(|w| w.join().unwrap())
        .collect();

    println!(
        "level {}: {FRAMES} frames on {WORKERS} workers: {} rigid bodies, {} particles alive \
         (peak {peak_particles}), {} voices, {} meshes, {} textures, {} script graphs; \
         audio went over its 1 MiB budget {} times",
        level["name"].as_str().unwrap_or("?"),
        bodies.len(),
        live_particles.len(),
        voices.len(),
        meshes.len(),
        textures.len(),
        scripts.len(),
        AUDIO_OVER_BUDGET.load(std::sync::atomic::Ordering::Relaxed),
    );

    // The reports, while everything above is still alive.
    let snapshot = Snapshot::take();
    println!("\n== sys_DumpAllocators");
    snapshot.write_csv(&mut std::io::stdout()).unwrap();
    println!("\n== Allocator tree");
    snapshot.write_tree(&mut std::io::stdout()).unwrap();
    println!(
        "\n== JSON snapshot ({} bytes; first allocator shown)",
        snapshot.to_json().len()
    );
    let json = snapshot.to_json();
    let first = json.find("},{").map_or(json.as_str(), |end| &json[..=end]);
    println!("{first} …");
    write_reports(&snapshot);

    drop((
        live_particles,
        voices,
        meshes,
        scripts,
        textures,
        bodies,
        level,
        particles_in,
    ));
    let after = Snapshot::take();
    let leaked: Vec<_> = after
        .allocators
        .iter()
        .filter(|a| a.index > 1 && a.stats.live_blocks > 0)
        .map(|a| (a.name, a.stats.live_blocks))
        .collect();
    println!("\nAfter shutdown, tagged allocators with live blocks: {leaked:?}");
}
