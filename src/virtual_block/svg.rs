//! An SVG memory map: one bar per block, allocations coloured by tag, free space grey.
//!
//! Like VMA's GpuMemDumpVis picture, but as scalable text with no tools needed, showing tags
//! (VMA's shows only resource kinds), a legend with each tag's bytes, and a tooltip per
//! allocation (name, offset, size). Each bar spans the full width, so a small block is as
//! readable as a big one; its label states its size. Neighbouring allocations of one tag that
//! would be drawn in the same pixel are merged, so a block with a million allocations still
//! gives a file of reasonable size; an allocation thinner than a pixel is drawn one pixel wide.

use std::fmt::Write;

use super::{Range, Statistics, Tag, TagStatistics, VirtualBlock};

const WIDTH: f64 = 1000.0;
const MARGIN: f64 = 12.0;
const BAR_HEIGHT: f64 = 28.0;
/// Label above, bar, scale below.
const ROW_HEIGHT: f64 = 20.0 + BAR_HEIGHT + 22.0;
const FREE_COLOUR: &str = "#d9d9d9";
const UNTAGGED_COLOUR: &str = "#5b6770";
const RESERVED_COLOUR: &str = "#f2c94c";
/// Distinct, colour-blind-friendly hues (Okabe–Ito and Tableau-like), cycled by tag order.
const PALETTE: [&str; 10] = [
    "#0072b2", "#d55e00", "#009e73", "#cc79a7", "#e69f00", "#56b4e9", "#8c564b", "#7f3c8d",
    "#3b8f3b", "#b2182b",
];

/// What a drawn rectangle stands for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Paint {
    Tag(Option<Tag>),
    Reserved,
}

/// Appends `s` with XML's special characters escaped.
fn push_xml(out: &mut String, s: &str) {
    for c in s.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&apos;"),
            c if (c as u32) < 0x20 && !matches!(c, '\t' | '\n' | '\r') => out.push('\u{fffd}'),
            c => out.push(c),
        }
    }
}

/// `1536` → `"1.5 Ki"`: sizes in binary units without assuming bytes.
fn human(n: u64) -> String {
    const UNITS: [&str; 7] = ["", " Ki", " Mi", " Gi", " Ti", " Pi", " Ei"];
    let mut v = n as f64;
    let mut u = 0;
    while v >= 1024.0 && u + 1 < UNITS.len() {
        v /= 1024.0;
        u += 1;
    }
    if u == 0 {
        format!("{n}")
    } else {
        format!("{v:.1}{}", UNITS[u])
    }
}

/// One bar of a [memory map](memory_map_svg): what the picture needs of a block, taken at
/// one moment. A snapshot lets blocks with different user-data types share one picture.
#[derive(Clone, Debug)]
pub struct MapRow {
    label: String,
    statistics: Statistics,
    largest_free: u64,
    fragmentation: f64,
    free_bytes: u64,
    tags: Vec<TagStatistics>,
    /// Pending defragmentation reservations: units and count.
    reserved: (u64, u32),
    /// Taken ranges in offset order.
    taken: Vec<Segment>,
}

#[derive(Clone, Debug)]
struct Segment {
    offset: u64,
    size: u64,
    paint: Paint,
    name: Option<String>,
}

impl MapRow {
    /// A bar for `block`, labelled `label` (the block's own name when `label` is empty).
    pub fn new<U>(label: &str, block: &VirtualBlock<U>) -> Self {
        let label = if label.is_empty() {
            block.name().unwrap_or("virtual block")
        } else {
            label
        };
        let taken = block
            .ranges()
            .filter_map(|r| match r {
                Range::Free { .. } => None,
                Range::Reserved { offset, size } => Some(Segment {
                    offset,
                    size,
                    paint: Paint::Reserved,
                    name: None,
                }),
                Range::Allocation(a) => Some(Segment {
                    offset: a.offset,
                    size: a.size,
                    paint: Paint::Tag(a.tag),
                    name: a.name.map(str::to_string),
                }),
            })
            .collect();
        MapRow {
            label: label.to_string(),
            statistics: block.statistics(),
            largest_free: block.largest_free(),
            fragmentation: block.fragmentation(),
            free_bytes: block.free_bytes(),
            tags: block.tag_statistics(),
            reserved: (block.defrag.reserved_bytes, block.defrag.open),
            taken,
        }
    }
}

/// Draws several blocks in one picture, one bar each, with a shared legend.
///
/// ```
/// use tagalloc::virtual_block::{memory_map_svg, MapRow, Request, Tag, VirtualBlock};
/// let mut a = VirtualBlock::<u32>::new(1 << 20);
/// a.allocate(&Request::new(4096).tag(Tag::new("textures")), 7)?;
/// let b = VirtualBlock::<()>::new_linear(1 << 16);
/// let svg = memory_map_svg(&[MapRow::new("heap 0", &a), MapRow::new("ring", &b)]);
/// assert!(svg.starts_with("<svg") && svg.contains("textures") && svg.contains("ring"));
/// # Ok::<(), tagalloc::virtual_block::Error>(())
/// ```
pub fn memory_map_svg(rows: &[MapRow]) -> String {
    // Legend entries: every tag in use, in a stable order, with its total.
    let mut legend: Vec<(Paint, u64, u32)> = Vec::new();
    for row in rows {
        for t in &row.tags {
            add_to_legend(
                &mut legend,
                Paint::Tag(t.tag),
                t.allocation_bytes,
                t.allocation_count,
            );
        }
        if row.reserved.1 > 0 {
            add_to_legend(&mut legend, Paint::Reserved, row.reserved.0, row.reserved.1);
        }
    }
    let mut tagged = 0;
    let colours: Vec<(Paint, &str)> = legend
        .iter()
        .map(|&(p, _, _)| {
            let c = match p {
                Paint::Reserved => RESERVED_COLOUR,
                Paint::Tag(None) => UNTAGGED_COLOUR,
                Paint::Tag(Some(_)) => {
                    tagged += 1;
                    PALETTE[(tagged - 1) % PALETTE.len()]
                }
            };
            (p, c)
        })
        .collect();
    let colour_of = |p: Paint| {
        colours
            .iter()
            .find(|c| c.0 == p)
            .map_or(UNTAGGED_COLOUR, |c| c.1)
    };

    let legend_rows = (legend.len() + 1).div_ceil(3);
    let height = MARGIN * 2.0 + ROW_HEIGHT * rows.len() as f64 + 22.0 * legend_rows as f64 + 8.0;
    let total_width = WIDTH + 2.0 * MARGIN;
    let mut o = String::new();
    let _ = write!(
        o,
        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{total_width}\" height=\"{height}\" \
         viewBox=\"0 0 {total_width} {height}\" font-family=\"sans-serif\" font-size=\"12\">\n\
         <rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n"
    );
    for (i, row) in rows.iter().enumerate() {
        let top = MARGIN + ROW_HEIGHT * i as f64;
        draw_row(&mut o, row, top, &colour_of);
    }
    // Legend.
    let top = MARGIN + ROW_HEIGHT * rows.len() as f64;
    let mut entries: Vec<(String, &str)> = legend
        .iter()
        .map(|&(p, bytes, count)| {
            let name = match p {
                Paint::Tag(Some(t)) => t.name().to_string(),
                Paint::Tag(None) => "untagged".to_string(),
                Paint::Reserved => "defrag destination".to_string(),
            };
            (format!("{name}: {} in {count}", human(bytes)), colour_of(p))
        })
        .collect();
    let free: u64 = rows.iter().map(|r| r.free_bytes).sum();
    entries.push((format!("free: {}", human(free)), FREE_COLOUR));
    for (i, (text, colour)) in entries.iter().enumerate() {
        let x = MARGIN + (i % 3) as f64 * (WIDTH / 3.0);
        let y = top + 22.0 * (i / 3) as f64;
        let _ = write!(
            o,
            "<rect x=\"{x}\" y=\"{y}\" width=\"14\" height=\"14\" fill=\"{colour}\" stroke=\"#333\" \
             stroke-width=\"0.5\"/><text x=\"{}\" y=\"{}\">",
            x + 20.0,
            y + 11.5
        );
        push_xml(&mut o, text);
        o.push_str("</text>\n");
    }
    o.push_str("</svg>\n");
    o
}

fn add_to_legend(legend: &mut Vec<(Paint, u64, u32)>, p: Paint, bytes: u64, count: u32) {
    match legend.iter_mut().find(|e| e.0 == p) {
        Some(e) => {
            e.1 += bytes;
            e.2 += count;
        }
        None => {
            // Reserved last, untagged first, tags by name.
            let key = |p: &Paint| match p {
                Paint::Tag(t) => (0, *t),
                Paint::Reserved => (1, None),
            };
            let at = legend.partition_point(|e| key(&e.0) < key(&p));
            legend.insert(at, (p, bytes, count));
        }
    }
}

fn draw_row(o: &mut String, row: &MapRow, top: f64, colour_of: &dyn Fn(Paint) -> &'static str) {
    let s = row.statistics;
    let used_pct = if s.block_bytes == 0 {
        0.0
    } else {
        100.0 * s.allocation_bytes as f64 / s.block_bytes as f64
    };
    let _ = write!(
        o,
        "<text x=\"{MARGIN}\" y=\"{}\" font-weight=\"bold\" xml:space=\"preserve\">",
        top + 13.0
    );
    push_xml(o, &row.label);
    let _ = writeln!(
        o,
        "<tspan font-weight=\"normal\">\u{a0}— {} of {} used ({used_pct:.1} %), {} allocations, \
         largest free {}, fragmentation {:.2}</tspan></text>",
        human(s.allocation_bytes),
        human(s.block_bytes),
        s.allocation_count,
        human(row.largest_free),
        row.fragmentation
    );
    let bar_top = top + 20.0;
    let _ = writeln!(
        o,
        "<rect x=\"{MARGIN}\" y=\"{bar_top}\" width=\"{WIDTH}\" height=\"{BAR_HEIGHT}\" \
         fill=\"{FREE_COLOUR}\"/>"
    );
    let cap = s.block_bytes.max(1) as f64;
    let px = |off: u64| MARGIN + WIDTH * (off as f64 / cap);
    // A pending run of allocations drawn as one rectangle: (paint, x0, x1, count, tooltip).
    // Runs under two pixels go to `thin`, drawn last so that wide neighbours cannot hide them.
    let mut run: Option<(Paint, f64, f64, u32, String)> = None;
    let mut thin = String::new();
    let flush =
        |wide: &mut String, thin: &mut String, run: Option<(Paint, f64, f64, u32, String)>| {
            if let Some((paint, x0, x1, count, tip)) = run {
                let w = (x1 - x0).max(1.5);
                let o = if w < 2.0 { thin } else { wide };
                let _ = write!(
                    o,
                    "<rect x=\"{x0:.2}\" y=\"{bar_top}\" width=\"{w:.2}\" height=\"{BAR_HEIGHT}\" \
                 fill=\"{}\"",
                    colour_of(paint)
                );
                if w >= 4.0 {
                    o.push_str(" stroke=\"white\" stroke-width=\"0.5\"");
                }
                o.push_str("><title>");
                if count == 1 {
                    push_xml(o, &tip);
                } else {
                    let _ = write!(o, "{count} allocations");
                }
                o.push_str("</title></rect>\n");
            }
        };
    for seg in &row.taken {
        let (paint, offset, size) = (seg.paint, seg.offset, seg.size);
        let tip = match paint {
            Paint::Reserved => format!("defrag destination @{offset} +{size}"),
            Paint::Tag(tag) => {
                let mut tip = seg.name.clone().unwrap_or_default();
                let _ = write!(tip, " @{offset} +{size}");
                if let Some(t) = tag {
                    let _ = write!(tip, " [{}]", t.name());
                }
                tip.trim_start().to_string()
            }
        };
        let (x0, x1) = (px(offset), px(offset + size));
        match &mut run {
            Some((p, _, end, count, _)) if *p == paint && x0 - *end < 0.5 && x1 - x0 < 1.0 => {
                *end = x1;
                *count += 1;
            }
            _ => {
                let done = run.take();
                flush(o, &mut thin, done);
                run = Some((paint, x0, x1, 1, tip));
            }
        }
    }
    flush(o, &mut thin, run);
    o.push_str(&thin);
    // Scale: offsets at the quarters.
    for q in 0..=4u64 {
        let off = (u128::from(s.block_bytes) * u128::from(q) / 4) as u64;
        let x = px(off);
        let anchor = match q {
            0 => "start",
            4 => "end",
            _ => "middle",
        };
        let _ = writeln!(
            o,
            "<line x1=\"{x:.2}\" y1=\"{}\" x2=\"{x:.2}\" y2=\"{}\" stroke=\"#555\"/>\
             <text x=\"{x:.2}\" y=\"{}\" font-size=\"10\" fill=\"#555\" text-anchor=\"{anchor}\">{}</text>",
            bar_top + BAR_HEIGHT,
            bar_top + BAR_HEIGHT + 4.0,
            bar_top + BAR_HEIGHT + 15.0,
            human(off)
        );
    }
}

impl<U> VirtualBlock<U> {
    /// This block as an SVG memory map (see [`memory_map_svg`] for several blocks).
    pub fn to_svg(&self) -> String {
        memory_map_svg(&[MapRow::new("", self)])
    }
}
