//! Reports: the `sys_DumpAllocators` CSV line by line, the numbers adding up (children
//! within their parents, Consumed summing to Reserved), the JSON parsing, the tree view.
//!
//! tagalloc is this binary's global allocator, so the System row holds the whole process.
//! One test only: the totals are compared while no other test thread allocates.

use allocator_api2::vec::Vec as AVec;
use tagalloc::SystemAllocator;
use tagalloc::report::Snapshot;

#[global_allocator]
static GLOBAL: SystemAllocator = SystemAllocator::new();

tagalloc::allocator!(Renderer: child of SystemAllocator, "Rendering");
tagalloc::allocator!(Textures: child of Renderer, "Texture data");
tagalloc::allocator!(Audio: child of SystemAllocator, "Audio, mixing");

fn parse_kib(s: &str) -> f64 {
    let v: f64 = s.parse().unwrap();
    assert_eq!(s.split('.').nth(1).map(str::len), Some(2), "%.2f: {s}");
    v
}

#[test]
fn reports_are_exact_and_add_up() {
    let mut textures: AVec<u8, Textures> = AVec::with_capacity_in(3 << 20, Textures);
    textures.resize(3 << 20, 1);
    let mut meshes: AVec<u64, Renderer> = AVec::new_in(Renderer);
    meshes.extend(0..10_000);
    let mut voices: AVec<f32, Audio> = AVec::new_in(Audio);
    voices.extend((0..50_000).map(|i| i as f32));

    let snapshot = Snapshot::take();
    let mut csv = Vec::new();
    snapshot.write_csv(&mut csv).unwrap();
    let csv = String::from_utf8(csv).unwrap();
    let lines: Vec<&str> = csv.lines().collect();

    // Header, one row per allocator, totals, count.
    assert_eq!(
        lines[0],
        "Index,Name,Used KiB,Reserved KiB,Consumed KiB,Parent Allocator"
    );
    let n = snapshot.allocators.len();
    assert_eq!(n, 5, "OS, System, Renderer, Textures, Audio");
    assert_eq!(lines.len(), n + 3);
    assert_eq!(lines[n + 2], "5 allocators active");
    let rows: Vec<Vec<&str>> = lines[1..=n]
        .iter()
        .map(|l| l.split(',').collect())
        .collect();
    let names: Vec<&str> = rows.iter().map(|r| r[1]).collect();
    assert_eq!(
        names,
        [
            "OSAllocator",
            "SystemAllocator",
            "Renderer",
            "Textures",
            "Audio"
        ]
    );
    let parents: Vec<&str> = rows.iter().map(|r| r[5]).collect();
    assert_eq!(
        parents,
        [
            "",
            "OSAllocator",
            "SystemAllocator",
            "Renderer",
            "SystemAllocator"
        ]
    );
    for (i, r) in rows.iter().enumerate() {
        assert_eq!(r.len(), 6);
        assert_eq!(r[0], i.to_string());
    }
    let col = |row: usize, c: usize| parse_kib(rows[row][c]);

    // A child's Used is within its parent's; a child's Reserved equals its Used.
    assert!(col(3, 2) >= 3072.0, "Textures holds 3 MiB");
    for (child, parent) in [(1, 0), (2, 1), (3, 2), (4, 1)] {
        assert!(
            col(child, 2) <= col(parent, 2),
            "{} within {}",
            names[child],
            names[parent]
        );
    }
    for child in [2, 3, 4] {
        assert_eq!(rows[child][2], rows[child][3]);
    }
    assert!(
        col(2, 2) >= col(3, 2) + 78.0,
        "Renderer includes Textures and its own meshes"
    );
    // Consumed = Reserved − children's Reserved.
    let a = &snapshot.allocators;
    assert_eq!(
        a[2].consumed_bytes,
        a[2].stats.reserved_bytes - a[3].stats.reserved_bytes
    );
    assert_eq!(
        a[1].consumed_bytes,
        a[1].stats.reserved_bytes - a[2].stats.reserved_bytes - a[4].stats.reserved_bytes
    );

    // Totals: each byte once; Consumed sums to Reserved.
    let totals = snapshot.totals();
    let t: Vec<&str> = lines[n + 1].split(',').collect();
    assert_eq!(&t[..2], ["-", "Totals"]);
    assert_eq!(t[5], "");
    let consumed_sum: usize = a.iter().map(|x| x.consumed_bytes).sum();
    assert_eq!(totals.consumed_bytes, consumed_sum);
    assert_eq!(totals.reserved_bytes, a[0].stats.reserved_bytes);
    assert_eq!(totals.consumed_bytes, totals.reserved_bytes, "{csv}");
    assert!(totals.used_bytes <= totals.reserved_bytes);
    assert!(totals.used_bytes >= (3 << 20) + 80_000 + 200_000);
    // The CSV prints KiB with `{:.2}` (which rounds an exact half, as 3368.125, to even).
    assert_eq!(t[2], format!("{:.2}", totals.used_bytes as f64 / 1024.0));
    parse_kib(t[2]);

    // JSON parses and carries the same figures.
    let json: serde_json::Value = serde_json::from_str(&snapshot.to_json()).unwrap();
    let list = json["allocators"].as_array().unwrap();
    assert_eq!(list.len(), n);
    assert_eq!(list[3]["name"], "Textures");
    assert_eq!(list[3]["parent"], "Renderer");
    assert_eq!(list[3]["kind"], "child");
    assert_eq!(list[3]["depth"], 3);
    assert_eq!(list[4]["description"], "Audio, mixing");
    assert_eq!(
        list[3]["used_bytes"].as_u64().unwrap() as usize,
        a[3].stats.live_granted_bytes
    );
    assert_eq!(list[3]["requested_bytes"].as_u64(), Some(3 << 20));
    assert!(
        list[1]["requested_bytes"].is_null(),
        "System counts granted sizes only"
    );
    assert_eq!(
        json["totals"]["reserved_bytes"].as_u64().unwrap() as usize,
        totals.reserved_bytes
    );

    // The tree: indented by parent, human units, share of the parent.
    let mut tree = Vec::new();
    snapshot.write_tree(&mut tree).unwrap();
    let tree = String::from_utf8(tree).unwrap();
    let tex = tree.lines().find(|l| l.contains("Textures")).unwrap();
    assert!(tex.starts_with("   │  └─ Textures"), "{tree}");
    assert!(tex.contains("3.0 MiB") && tex.contains('%'), "{tex}");
    assert!(
        tree.lines().any(|l| l.starts_with("└─ SystemAllocator")),
        "{tree}"
    );
    assert!(
        tree.lines()
            .any(|l| l.starts_with("Totals (each byte once)"))
    );
    // A legend under the table says what each column means, and explains the Totals.
    let legend = &tree[tree.find("\nColumns:\n").expect("a legend")..];
    for column in [
        "Used", "Reserved", "Consumed", "Blocks", "Peak", "Share", "Budget", "Totals",
    ] {
        assert!(
            legend.contains(&format!("\n  {column:<10}")),
            "{column}: {legend}"
        );
    }
    assert!(legend.contains("Share     Used as a share of the parent's Used"));
    assert!(
        !tree.contains("[thread-cache lane]"),
        "no internal jargon: {tree}"
    );

    drop((textures, meshes, voices));
    let after = Snapshot::take();
    assert_eq!(after.find("Textures").unwrap().stats.live_granted_bytes, 0);
}
