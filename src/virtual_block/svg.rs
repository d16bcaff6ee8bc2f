//! An SVG memory map: one bar per block that shows how much of it is free at every scale.
//!
//! Each pixel column of a bar stands for an equal share of the block. The column is filled
//! from the bottom with the colours of the tags that own its units, in proportion to how
//! many they own, and the rest of its height is free grey: a column whose units are half free
//! is half grey, whether the free space is one range or a thousand holes too small to draw.
//! So the grey area of a bar is the block's free share (to a pixel's rounding per column), and
//! a heap 50% free in small holes looks half free, not full. Neighbouring columns alike are
//! drawn as one rectangle, so a block with a million allocations still gives a file of
//! reasonable size. There are no outlines (white lines between allocations read as gaps).
//!
//! A tag's colour comes from a hash of its name, so "vertex buffers" has the same colour in
//! every picture. Allocations wide enough for their name show it; every allocation at least
//! two pixels wide has a tooltip (name, offset, size, tag). [`MapRow::zoom`] adds a strip
//! that magnifies a range of the block, drawn the same way, for the detail a whole-block bar
//! cannot show.

use std::fmt::Write;

use super::tag_names::fnv1a;
use super::{Range, Statistics, Tag, TagStatistics, VirtualBlock};

const WIDTH: f64 = 1000.0;
/// Pixel columns per bar.
const COLUMNS: u64 = 1000;
const MARGIN: f64 = 12.0;
/// Height of a bar, in whole pixels: a column's free share is rounded to one of these.
const BAR_HEIGHT: u32 = 36;
const ZOOM_HEIGHT: u32 = 24;
/// Label above, bar, scale below.
const ROW_HEIGHT: f64 = 20.0 + BAR_HEIGHT as f64 + 22.0;
/// Gap, connector lines, zoom strip and its scale.
const ZOOM_ROW_HEIGHT: f64 = 14.0 + ZOOM_HEIGHT as f64 + 20.0;
const FREE_COLOUR: &str = "#d9d9d9";
const UNTAGGED_COLOUR: &str = "#5b6770";
const RESERVED_COLOUR: &str = "#f2c94c";
/// Width of a character of the 11 px label font, generously.
const CHAR_WIDTH: f64 = 6.6;

/// What a drawn rectangle stands for.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Paint {
    /// Untagged first, tags by name.
    Tag(Option<Tag>),
    Reserved,
}

/// The colour of a tag: a hue from the hash of its name, saturated and mid-dark enough that
/// no tag looks like free space or white text fails on it.
fn tag_colour(tag: Tag) -> String {
    // FNV-1a, then a finaliser (MurmurHash3's) so that names differing in one letter land
    // far apart; hue, saturation and lightness from separate bits.
    let mut h = fnv1a(tag.name().as_bytes());
    h ^= h >> 33;
    h = h.wrapping_mul(0xff51_afd7_ed55_8ccd);
    h ^= h >> 33;
    h = h.wrapping_mul(0xc4ce_b9fe_1a85_ec53);
    h ^= h >> 33;
    let hue = (h % 360) as f64;
    let saturation = 0.6 + 0.25 * ((h >> 16) % 5) as f64 / 4.0;
    let lightness = 0.33 + 0.27 * ((h >> 24) % 4) as f64 / 3.0;
    let (r, g, b) = hsl_to_rgb(hue, saturation, lightness);
    format!("#{r:02x}{g:02x}{b:02x}")
}

fn hsl_to_rgb(hue: f64, s: f64, l: f64) -> (u8, u8, u8) {
    let c = (1.0 - (2.0 * l - 1.0).abs()) * s;
    let h = hue / 60.0;
    let x = c * (1.0 - (h % 2.0 - 1.0).abs());
    let (r, g, b) = match h as u32 {
        0 => (c, x, 0.0),
        1 => (x, c, 0.0),
        2 => (0.0, c, x),
        3 => (0.0, x, c),
        4 => (x, 0.0, c),
        _ => (c, 0.0, x),
    };
    let m = l - c / 2.0;
    let to = |v: f64| ((v + m) * 255.0).round().clamp(0.0, 255.0) as u8;
    (to(r), to(g), to(b))
}

fn colour_of(p: Paint) -> String {
    match p {
        Paint::Reserved => RESERVED_COLOUR.to_string(),
        Paint::Tag(None) => UNTAGGED_COLOUR.to_string(),
        Paint::Tag(Some(t)) => tag_colour(t),
    }
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
    /// The range [`MapRow::zoom`] magnifies.
    zoom: Option<(u64, u64)>,
}

#[derive(Clone, Debug)]
struct Segment {
    offset: u64,
    size: u64,
    paint: Paint,
    name: Option<String>,
}

impl Segment {
    fn end(&self) -> u64 {
        self.offset + self.size
    }
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
            zoom: None,
        }
    }

    /// Adds a strip under the bar that magnifies `[start, end)` of the block (clamped to it),
    /// drawn the same way, with lines from the range on the bar to the strip's ends.
    ///
    /// ```
    /// use tagalloc::virtual_block::{memory_map_svg, MapRow, Request, VirtualBlock};
    /// let mut b = VirtualBlock::<()>::new(1 << 30);
    /// b.allocate(&Request::new(4096).name("tiny"), ())?;
    /// let row = MapRow::new("heap", &b).zoom(0, 64 << 10); // the first 64 Ki, 16 384 times larger
    /// assert!(memory_map_svg(&[row]).contains("class=\"zoom\""));
    /// # Ok::<(), tagalloc::virtual_block::Error>(())
    /// ```
    pub fn zoom(mut self, start: u64, end: u64) -> Self {
        let cap = self.statistics.block_bytes;
        let (start, end) = (start.min(cap), end.min(cap));
        self.zoom = (start < end).then_some((start, end));
        self
    }
}

/// A pixel column's contents: units per paint (in legend order), and the column's units.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
struct Column {
    used: Vec<(usize, u64)>,
    units: u64,
}

/// A column as drawn: whole pixels per paint, bottom up, the rest free.
type Stack = Vec<(usize, u32)>;

/// Splits `[start, end)` into `columns` equal shares and sums what each holds per paint.
fn columns(taken: &[Segment], paints: &[Paint], start: u64, end: u64, n: u64) -> Vec<Column> {
    let span = u128::from(end - start);
    let bound = |c: u64| start + (span * u128::from(c) / u128::from(n)) as u64;
    let paint_index = |p: Paint| paints.iter().position(|&q| q == p).unwrap_or(0);
    let mut out = Vec::with_capacity(n as usize);
    // The first segment that ends after `start`.
    let mut s = taken.partition_point(|seg| seg.end() <= start);
    for c in 0..n {
        let (lo, hi) = (bound(c), bound(c + 1));
        let mut col = Column {
            used: Vec::new(),
            units: hi - lo,
        };
        let mut k = s;
        while let Some(seg) = taken.get(k) {
            if seg.offset >= hi {
                break;
            }
            let overlap = seg.end().min(hi) - seg.offset.max(lo);
            let p = paint_index(seg.paint);
            match col.used.iter_mut().find(|e| e.0 == p) {
                Some(e) => e.1 += overlap,
                None => col.used.push((p, overlap)),
            }
            if seg.end() <= hi {
                k += 1;
                s = k;
            } else {
                break;
            }
        }
        col.used.sort_unstable();
        out.push(col);
    }
    out
}

/// Whole pixels for each paint of a column of `height` pixels: the free share is rounded
/// to the nearest pixel, and the used pixels are shared out by largest remainder.
fn stack(col: &Column, height: u32) -> Stack {
    if col.units == 0 {
        return Vec::new();
    }
    let used: u64 = col.used.iter().map(|e| e.1).sum();
    let h = u128::from(height);
    let units = u128::from(col.units);
    let used_px = ((u128::from(used) * h * 2 + units) / (units * 2)) as u32;
    let mut px: Vec<(usize, u32, u128)> = col
        .used
        .iter()
        .map(|&(p, b)| {
            let exact = u128::from(b) * u128::from(used_px);
            let whole = exact / u128::from(used.max(1));
            (p, whole as u32, exact % u128::from(used.max(1)))
        })
        .collect();
    let mut left = used_px - px.iter().map(|e| e.1).sum::<u32>();
    let mut order: Vec<usize> = (0..px.len()).collect();
    order.sort_by(|&a, &b| px[b].2.cmp(&px[a].2));
    for i in order {
        if left == 0 {
            break;
        }
        px[i].1 += 1;
        left -= 1;
    }
    px.into_iter()
        .filter(|e| e.1 > 0)
        .map(|(p, n, _)| (p, n))
        .collect()
}

/// Draws `[start, end)` of a row as a bar at `(x0, top)`, `WIDTH` wide and `height` tall,
/// with a background rect of class `class` that tests find the bar by.
#[allow(clippy::too_many_arguments)]
fn draw_bar(
    o: &mut String,
    row: &MapRow,
    paints: &[Paint],
    colours: &[String],
    start: u64,
    end: u64,
    top: f64,
    height: u32,
    class: &str,
) {
    let units = end - start;
    let n = COLUMNS.min(units.max(1));
    let col_w = WIDTH / n as f64;
    let _ = writeln!(
        o,
        "<rect class=\"{class}\" x=\"{MARGIN}\" y=\"{top}\" width=\"{WIDTH}\" height=\"{height}\" \
         fill=\"{FREE_COLOUR}\" data-start=\"{start}\" data-end=\"{end}\"/>"
    );
    if units == 0 {
        return;
    }
    let cols = columns(&row.taken, paints, start, end, n);
    // Runs of alike columns become one rectangle per paint.
    let mut c = 0;
    while c < cols.len() {
        let st = stack(&cols[c], height);
        let mut run = c + 1;
        while run < cols.len() && stack(&cols[run], height) == st {
            run += 1;
        }
        let x = MARGIN + c as f64 * col_w;
        let w = (run - c) as f64 * col_w;
        let mut y = top + f64::from(height);
        for &(p, px) in &st {
            y -= f64::from(px);
            let _ = writeln!(
                o,
                "<rect x=\"{x:.3}\" y=\"{y}\" width=\"{w:.3}\" height=\"{px}\" fill=\"{}\"/>",
                colours[p]
            );
        }
        c = run;
    }
    // Tooltips and names for the allocations wide enough to point at.
    let scale = WIDTH / units as f64;
    let first = row.taken.partition_point(|s| s.end() <= start);
    for seg in row.taken[first..].iter().take_while(|s| s.offset < end) {
        let (a, b) = (seg.offset.max(start), seg.end().min(end));
        let w = (b - a) as f64 * scale;
        if w < 2.0 {
            continue;
        }
        let x = MARGIN + (a - start) as f64 * scale;
        let _ = write!(
            o,
            "<rect x=\"{x:.3}\" y=\"{top}\" width=\"{w:.3}\" height=\"{height}\" \
             fill-opacity=\"0\"><title>"
        );
        push_tooltip(o, seg);
        o.push_str("</title></rect>\n");
        if let Some(name) = &seg.name {
            let text_w = name.chars().count() as f64 * CHAR_WIDTH + 6.0;
            if w >= text_w && height >= 14 {
                let colour = &colours[paints.iter().position(|&p| p == seg.paint).unwrap_or(0)];
                let _ = write!(
                    o,
                    "<text x=\"{:.3}\" y=\"{}\" font-size=\"11\" text-anchor=\"middle\" \
                     fill=\"{}\" pointer-events=\"none\">",
                    x + w / 2.0,
                    top + f64::from(height) / 2.0 + 4.0,
                    text_colour(colour)
                );
                push_xml(o, name);
                o.push_str("</text>\n");
            }
        }
    }
}

fn push_tooltip(o: &mut String, seg: &Segment) {
    match seg.paint {
        Paint::Reserved => {
            let _ = write!(o, "defrag destination @{} +{}", seg.offset, seg.size);
        }
        Paint::Tag(tag) => {
            if let Some(name) = &seg.name {
                push_xml(o, name);
                o.push(' ');
            }
            let _ = write!(o, "@{} +{}", seg.offset, seg.size);
            if let Some(t) = tag {
                o.push_str(" [");
                push_xml(o, t.name());
                o.push(']');
            }
        }
    }
}

/// Black or white, whichever reads better on `background` (`#rrggbb`).
fn text_colour(background: &str) -> &'static str {
    let v = |i: usize| u8::from_str_radix(&background[i..i + 2], 16).map_or(0.0, f64::from);
    let luminance = 0.299 * v(1) + 0.587 * v(3) + 0.114 * v(5);
    if luminance > 140.0 { "#000" } else { "#fff" }
}

/// Offsets at the quarters of `[start, end)` under a bar at `bottom`.
fn draw_scale(o: &mut String, start: u64, end: u64, bottom: f64) {
    for q in 0..=4u64 {
        let off = start + (u128::from(end - start) * u128::from(q) / 4) as u64;
        let x = MARGIN + WIDTH * q as f64 / 4.0;
        let anchor = match q {
            0 => "start",
            4 => "end",
            _ => "middle",
        };
        let _ = writeln!(
            o,
            "<line x1=\"{x:.2}\" y1=\"{bottom}\" x2=\"{x:.2}\" y2=\"{}\" stroke=\"#555\"/>\
             <text x=\"{x:.2}\" y=\"{}\" font-size=\"10\" fill=\"#555\" text-anchor=\"{anchor}\">{}</text>",
            bottom + 4.0,
            bottom + 15.0,
            human(off)
        );
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
    // Legend entries: every tag in use, untagged first, tags by name, reservations last.
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
    let paints: Vec<Paint> = legend.iter().map(|e| e.0).collect();
    let colours: Vec<String> = paints.iter().map(|&p| colour_of(p)).collect();

    let legend_rows = (legend.len() + 1).div_ceil(3);
    let zooms = rows.iter().filter(|r| r.zoom.is_some()).count();
    let height = MARGIN * 2.0
        + ROW_HEIGHT * rows.len() as f64
        + ZOOM_ROW_HEIGHT * zooms as f64
        + 22.0 * legend_rows as f64
        + 8.0;
    let total_width = WIDTH + 2.0 * MARGIN;
    let mut o = String::new();
    let _ = write!(
        o,
        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{total_width}\" height=\"{height}\" \
         viewBox=\"0 0 {total_width} {height}\" font-family=\"sans-serif\" font-size=\"12\" \
         shape-rendering=\"crispEdges\">\n\
         <rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n"
    );
    let mut top = MARGIN;
    for row in rows {
        draw_row(&mut o, row, &paints, &colours, top);
        top += ROW_HEIGHT;
        if let Some((start, end)) = row.zoom {
            draw_zoom(&mut o, row, &paints, &colours, top, start, end);
            top += ZOOM_ROW_HEIGHT;
        }
    }
    // Legend.
    let mut entries: Vec<(String, &str)> = legend
        .iter()
        .zip(&colours)
        .map(|(&(p, bytes, count), colour)| {
            let name = match p {
                Paint::Tag(Some(t)) => t.name().to_string(),
                Paint::Tag(None) => "untagged".to_string(),
                Paint::Reserved => "defrag destination".to_string(),
            };
            (
                format!("{name}: {} in {count}", human(bytes)),
                colour.as_str(),
            )
        })
        .collect();
    let free: u64 = rows.iter().map(|r| r.free_bytes).sum();
    entries.push((format!("free: {}", human(free)), FREE_COLOUR));
    for (i, (text, colour)) in entries.iter().enumerate() {
        let x = MARGIN + (i % 3) as f64 * (WIDTH / 3.0);
        let y = top + 22.0 * (i / 3) as f64;
        let _ = write!(
            o,
            "<rect x=\"{x}\" y=\"{y}\" width=\"14\" height=\"14\" fill=\"{colour}\"/>\
             <text x=\"{}\" y=\"{}\">",
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
    match legend.binary_search_by(|e| e.0.cmp(&p)) {
        Ok(i) => {
            legend[i].1 += bytes;
            legend[i].2 += count;
        }
        Err(i) => legend.insert(i, (p, bytes, count)),
    }
}

fn draw_row(o: &mut String, row: &MapRow, paints: &[Paint], colours: &[String], top: f64) {
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
    draw_bar(
        o,
        row,
        paints,
        colours,
        0,
        s.block_bytes,
        bar_top,
        BAR_HEIGHT,
        "bar",
    );
    draw_scale(o, 0, s.block_bytes, bar_top + f64::from(BAR_HEIGHT));
}

fn draw_zoom(
    o: &mut String,
    row: &MapRow,
    paints: &[Paint],
    colours: &[String],
    top: f64,
    start: u64,
    end: u64,
) {
    // Lines from the zoomed range on the bar above (its bottom, past the scale) to the
    // strip's corners.
    let cap = row.statistics.block_bytes.max(1) as f64;
    let bar_bottom = top - 22.0;
    let strip_top = top + 14.0;
    let x = |off: u64| MARGIN + WIDTH * (off as f64 / cap);
    let _ = writeln!(
        o,
        "<path d=\"M{:.2} {bar_bottom} L{MARGIN} {strip_top} M{:.2} {bar_bottom} L{} {strip_top}\" \
         stroke=\"#888\" stroke-dasharray=\"3 2\" fill=\"none\"/>",
        x(start),
        x(end),
        MARGIN + WIDTH
    );
    draw_bar(
        o,
        row,
        paints,
        colours,
        start,
        end,
        strip_top,
        ZOOM_HEIGHT,
        "zoom",
    );
    draw_scale(o, start, end, strip_top + f64::from(ZOOM_HEIGHT));
}

impl<U> VirtualBlock<U> {
    /// This block as an SVG memory map (see [`memory_map_svg`] for several blocks).
    pub fn to_svg(&self) -> String {
        memory_map_svg(&[MapRow::new("", self)])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn colours_follow_the_name_only() {
        let a = tag_colour(Tag::new("vertex buffers"));
        assert_eq!(a, tag_colour(Tag::intern("vertex buffers")));
        assert_ne!(a, tag_colour(Tag::new("index buffers")));
        for name in ["a", "textures", "uniforms", "pool 7", "zz"] {
            let c = tag_colour(Tag::new(name));
            assert_ne!(c, FREE_COLOUR);
            assert_ne!(c, UNTAGGED_COLOUR);
        }
    }

    #[test]
    fn a_half_free_column_is_half_grey() {
        let col = Column {
            used: vec![(0, 30), (1, 20)],
            units: 100,
        };
        let st = stack(&col, 36);
        assert_eq!(st.iter().map(|e| e.1).sum::<u32>(), 18);
        assert_eq!(st, [(0, 11), (1, 7)]);
        let full = Column {
            used: vec![(2, 100)],
            units: 100,
        };
        assert_eq!(stack(&full, 36), [(2, 36)]);
        assert!(stack(&Column::default(), 36).is_empty());
    }

    #[test]
    fn columns_share_out_segments() {
        let seg = |offset, size, paint| Segment {
            offset,
            size,
            paint,
            name: None,
        };
        let untagged = Paint::Tag(None);
        let taken = [seg(5, 10, untagged), seg(20, 40, Paint::Reserved)];
        let cols = columns(&taken, &[untagged, Paint::Reserved], 0, 100, 10);
        assert_eq!(cols[0].used, [(0, 5)]);
        assert_eq!(cols[1].used, [(0, 5)]);
        assert_eq!(cols[2].used, [(1, 10)]);
        assert_eq!(cols[6].used, []);
        assert!(cols.iter().all(|c| c.units == 10));
        // A zoomed range in the middle of a segment.
        let cols = columns(&taken, &[untagged, Paint::Reserved], 30, 40, 5);
        assert!(cols.iter().all(|c| c.used == [(1, 2)]));
    }
}
