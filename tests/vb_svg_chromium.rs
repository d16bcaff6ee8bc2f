//! The SVG memory map as a browser draws it: headless Chromium (Debian's `chromium`) renders
//! it to a PNG, and in every bar and zoom strip the share of free-grey pixels must be within
//! 5 points of the share of free units in the range it shows. The blocks are those the map
//! used to get wrong: half free in 384 KiB holes (which read as a solid bar), plus tagged,
//! named allocations (names drawn where they fit) and a zoom strip.
//!
//! Skips with one line when `chromium` is not installed (`.ci/run` installs it where it can).

use std::path::Path;
use std::process::Command;

use tagalloc::virtual_block::{MapRow, Range, Request, Tag, VirtualBlock, memory_map_svg};

const KI: u64 = 1 << 10;
const MI: u64 = 1 << 20;
/// The free colour of the map, `#d9d9d9`.
const FREE: [u8; 3] = [0xd9, 0xd9, 0xd9];

fn chromium() -> Option<&'static str> {
    ["chromium", "chromium-browser"].into_iter().find(|c| {
        Command::new(c)
            .arg("--version")
            .output()
            .is_ok_and(|o| o.status.success())
    })
}

/// The value of attribute `name` in the tag `element` (the text of one `<rect .../>`).
fn attribute(element: &str, name: &str) -> f64 {
    let key = format!(" {name}=\"");
    let start = element.find(&key).expect("attribute present") + key.len();
    let end = start + element[start..].find('"').expect("closing quote");
    element[start..end].parse().expect("a number")
}

/// The bars and zoom strips of an SVG: (x, y, width, height, first unit, end unit).
fn bars(svg: &str) -> Vec<(f64, f64, f64, f64, u64, u64)> {
    svg.match_indices("<rect class=\"")
        .filter_map(|(i, _)| {
            let element = &svg[i..i + svg[i..].find("/>")?];
            (element.contains("class=\"bar\"") || element.contains("class=\"zoom\"")).then(|| {
                (
                    attribute(element, "x"),
                    attribute(element, "y"),
                    attribute(element, "width"),
                    attribute(element, "height"),
                    attribute(element, "data-start") as u64,
                    attribute(element, "data-end") as u64,
                )
            })
        })
        .collect()
}

/// Free units of `block` in `[start, end)`.
fn free_in<U>(block: &VirtualBlock<U>, start: u64, end: u64) -> u64 {
    block
        .ranges()
        .filter_map(|r| match r {
            Range::Free { offset, size } => {
                let (a, b) = (offset.max(start), (offset + size).min(end));
                (a < b).then(|| b - a)
            }
            _ => None,
        })
        .sum()
}

/// Renders `svg` (`width` × `height` CSS pixels) with Chromium; returns RGB rows.
fn render(browser: &str, svg: &str, width: u32, height: u32, dir: &Path) -> Vec<Vec<[u8; 3]>> {
    let svg_path = dir.join("map.svg");
    let png_path = dir.join("map.png");
    std::fs::write(&svg_path, svg).unwrap();
    let profile = dir.join("profile");
    let out = Command::new(browser)
        .args([
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-quic",
            "--no-first-run",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            "--hide-scrollbars",
            "--force-device-scale-factor=1",
        ])
        .arg(format!("--user-data-dir={}", profile.display()))
        .arg(format!("--window-size={width},{height}"))
        .arg(format!("--screenshot={}", png_path.display()))
        .arg(format!("file://{}", svg_path.display()))
        .output()
        .expect("chromium runs");
    assert!(
        png_path.exists(),
        "chromium wrote no screenshot: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let decoder = png::Decoder::new(std::io::BufReader::new(
        std::fs::File::open(&png_path).unwrap(),
    ));
    let mut reader = decoder.read_info().unwrap();
    let mut buf = vec![0; reader.output_buffer_size().unwrap()];
    let info = reader.next_frame(&mut buf).unwrap();
    let channels = info.color_type.samples();
    assert!(info.bit_depth == png::BitDepth::Eight && channels >= 3);
    (0..info.height as usize)
        .map(|y| {
            (0..info.width as usize)
                .map(|x| {
                    let p = (y * info.width as usize + x) * channels;
                    [buf[p], buf[p + 1], buf[p + 2]]
                })
                .collect()
        })
        .collect()
}

#[test]
fn free_space_in_the_picture_matches_free_space_in_the_block() {
    let Some(browser) = chromium() else {
        println!("skipped: chromium is not installed (apt-get install chromium)");
        return;
    };
    // Half free in 384 KiB holes, the map that looked full.
    let mut holes = VirtualBlock::<()>::new(256 * MI);
    holes.set_name("half free in 384 KiB holes");
    let buffers = Tag::new("vertex buffers");
    let all: Vec<_> = (0..(256 * MI / (384 * KI)))
        .map(|_| {
            holes
                .allocate(&Request::new(384 * KI).tag(buffers), ())
                .unwrap()
        })
        .collect();
    for a in all.iter().step_by(2) {
        holes.free(*a).unwrap();
    }
    // Tagged, named allocations of many sizes, a free tail, and small holes at the start.
    let mut heap = VirtualBlock::<()>::new(64 * MI);
    let mut small = Vec::new();
    for i in 0..200u64 {
        let r = Request::new(4 * KI + i * 64)
            .align(256)
            .tag(Tag::new("uniforms"));
        small.push(heap.allocate(&r, ()).unwrap());
    }
    for a in small.iter().skip(1).step_by(3) {
        heap.free(*a).unwrap();
    }
    for (i, size) in [6 * MI, 3 * MI, 9 * MI, 512 * KI, 12 * MI]
        .into_iter()
        .enumerate()
    {
        let tag = Tag::intern(&format!("textures {}", i % 2));
        let name = format!("texture #{i}");
        heap.allocate(&Request::new(size).align(64 * KI).tag(tag).name(&name), ())
            .unwrap();
    }
    let svg = memory_map_svg(&[
        MapRow::new("", &holes).zoom(0, 4 * MI),
        MapRow::new("heap", &heap).zoom(0, MI),
    ]);
    assert!(
        svg.contains(">texture #2</text>"),
        "a wide allocation shows its name"
    );
    let width = attribute(&svg[..svg.find('>').unwrap()], "width") as u32;
    let height = attribute(&svg[..svg.find('>').unwrap()], "height").ceil() as u32;

    let dir = std::env::temp_dir().join(format!("tagalloc-vb-svg-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let pixels = render(browser, &svg, width, height, &dir);
    let _ = std::fs::remove_dir_all(&dir);

    let found = bars(&svg);
    assert_eq!(found.len(), 4, "two bars and two zoom strips");
    // Bars come in row order, each followed by its zoom strip.
    for ((x, y, w, h, start, end), block) in found.into_iter().zip([&holes, &holes, &heap, &heap]) {
        let (x0, y0) = (x.round() as usize, y.round() as usize);
        let (x1, y1) = ((x + w).round() as usize, (y + h).round() as usize);
        let mut free_px = 0u64;
        let mut all_px = 0u64;
        for row in &pixels[y0..y1] {
            for p in &row[x0..x1] {
                all_px += 1;
                if p.iter().zip(FREE).all(|(&a, b)| a.abs_diff(b) <= 3) {
                    free_px += 1;
                }
            }
        }
        let pixel_share = free_px as f64 / all_px as f64;
        let unit_share = free_in(block, start, end) as f64 / (end - start) as f64;
        assert!(
            (pixel_share - unit_share).abs() <= 0.05,
            "range {start}..{end}: {:.1}% of the pixels free-grey, {:.1}% of the units free",
            100.0 * pixel_share,
            100.0 * unit_share
        );
        // Something is drawn besides free space (the bars are not blank).
        assert!(free_px < all_px);
    }
}
