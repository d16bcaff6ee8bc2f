//! One self-contained HTML page: the allocator tree as a treemap, the memory timeline as
//! a chart per allocator with its budget, the top call sites per allocator when records
//! are on, and virtual blocks' memory maps. Everything is drawn here as inline SVG: the
//! page needs no network, no script and no other file.

use super::timeline::{Timeline, timeline};
use super::tree::human;
use super::{AllocatorSnapshot, Snapshot};
use crate::records::RecordsSnapshot;
use crate::virtual_block::{MapRow, memory_map_svg};
use std::fmt::Write as _;

/// An HTML report being put together: the allocators and the timeline always, plus any
/// virtual blocks' memory maps given to it. See [`html`](super::html) for the plain page.
///
/// ```
/// use tagalloc::virtual_block::{MapRow, Request, VirtualBlock};
///
/// let mut heap = VirtualBlock::<()>::new(1 << 20);
/// heap.allocate(&Request::new(4096), ())?;
/// let page = tagalloc::report::HtmlReport::new()
///     .memory_map("GPU heaps", &[MapRow::new("heap 0", &heap)])
///     .render();
/// assert!(page.starts_with("<!DOCTYPE html>") && page.contains("heap 0"));
/// # Ok::<(), tagalloc::virtual_block::Error>(())
/// ```
#[derive(Clone, Debug, Default)]
pub struct HtmlReport {
    maps: Vec<(String, String)>,
}

impl HtmlReport {
    /// A report of the allocators, the timeline and the records as they are when it is
    /// rendered.
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds a memory map of virtual blocks (drawn now, as
    /// [`memory_map_svg`](crate::virtual_block::memory_map_svg) draws it) under `title`.
    pub fn memory_map(mut self, title: &str, rows: &[MapRow]) -> Self {
        self.maps.push((title.to_string(), memory_map_svg(rows)));
        self
    }

    /// The page.
    pub fn render(&self) -> String {
        // The report's own allocations are not recorded.
        let _busy = crate::records::guard::Busy::enter();
        let snapshot = Snapshot::take();
        let timeline = timeline();
        let records = super::records_if_any();
        render(&snapshot, &timeline, records.as_ref(), &self.maps)
    }
}

/// Escapes text for HTML and SVG.
fn esc(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&#39;"),
            c => out.push(c),
        }
    }
    out
}

/// A colour per allocator, stable across reports (from its name).
fn colour(name: &str) -> String {
    let hash = name.bytes().fold(0x811c_9dc5u32, |h, b| {
        (h ^ u32::from(b)).wrapping_mul(0x0100_0193)
    });
    format!("hsl({}, 55%, 62%)", hash % 360)
}

const STYLE: &str = "
body { font: 14px/1.4 system-ui, sans-serif; margin: 24px; color: #222; background: #fafafa; }
h1 { font-size: 22px; margin: 0 0 4px; } h2 { font-size: 17px; margin: 28px 0 8px; }
p.note { color: #555; margin: 4px 0 12px; max-width: 70em; }
table { border-collapse: collapse; background: #fff; }
td, th { padding: 3px 10px; border-bottom: 1px solid #e4e4e4; text-align: right; white-space: nowrap; }
td:first-child, th:first-child, .text { text-align: left; }
.charts { display: flex; flex-wrap: wrap; gap: 12px; }
.chart { background: #fff; border: 1px solid #ddd; padding: 6px; }
.chart h3 { font-size: 13px; margin: 0 0 4px; }
.sites li { margin: 2px 0; } .sites code { font-size: 12px; }
svg text { font: 11px system-ui, sans-serif; }
";

fn render(
    snapshot: &Snapshot,
    timeline: &Timeline,
    records: Option<&RecordsSnapshot>,
    maps: &[(String, String)],
) -> String {
    let mut out = String::new();
    let totals = snapshot.totals();
    let _ = write!(
        out,
        "<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">\
         <title>tagalloc report</title><style>{STYLE}</style></head><body>\n\
         <h1>tagalloc: where the memory is</h1>\n\
         <p class=\"note\">{} allocators; {} in live blocks, {} held from the OS.</p>\n",
        snapshot.allocators.len(),
        human(totals.used_bytes),
        human(totals.reserved_bytes)
    );
    out.push_str("<h2>Allocators</h2>\n<p class=\"note\">Each box is an allocator, its area the bytes it reserves from its parent; inside it, its children's boxes, its own live blocks (solid) and what it keeps free for reuse (hatched). Hover for the figures.</p>\n");
    treemap(&mut out, snapshot);
    table(&mut out, snapshot);
    out.push_str("<h2>Memory over time</h2>\n");
    charts(&mut out, timeline);
    if let Some(records) = records {
        out.push_str("<h2>Top call sites (live bytes, from the allocation records)</h2>\n");
        call_sites(&mut out, records);
    }
    for (title, svg) in maps {
        let _ = write!(out, "<h2>{}</h2>\n<div>{svg}</div>\n", esc(title));
    }
    out.push_str("</body></html>\n");
    out
}

/// A rectangle: x, y, width, height.
#[derive(Clone, Copy, Debug)]
struct Rect(f64, f64, f64, f64);

/// Squarified treemap layout (Bruls, Huizing, van Wijk): `values` (all > 0, largest
/// first) in `rect`, areas proportional to the values.
fn squarify(values: &[f64], rect: Rect) -> Vec<Rect> {
    let mut out = Vec::with_capacity(values.len());
    let total: f64 = values.iter().sum();
    if total <= 0.0 || rect.2 <= 0.0 || rect.3 <= 0.0 {
        return vec![Rect(rect.0, rect.1, 0.0, 0.0); values.len()];
    }
    let scale = rect.2 * rect.3 / total;
    let areas: Vec<f64> = values.iter().map(|v| v * scale).collect();
    let mut r = rect;
    let mut i = 0;
    while i < areas.len() {
        let side = r.2.min(r.3);
        let worst = |row: &[f64]| -> f64 {
            let sum: f64 = row.iter().sum();
            let (max, min) = row
                .iter()
                .fold((0.0f64, f64::MAX), |(a, b), &v| (a.max(v), b.min(v)));
            (side * side * max / (sum * sum)).max(sum * sum / (side * side * min))
        };
        let mut end = i + 1;
        while end < areas.len() && worst(&areas[i..=end]) <= worst(&areas[i..end]) {
            end += 1;
        }
        let row = &areas[i..end];
        let sum: f64 = row.iter().sum();
        let thickness = sum / side;
        let mut along = 0.0;
        for &a in row {
            let length = a / thickness;
            if r.2 >= r.3 {
                out.push(Rect(r.0, r.1 + along, thickness, length));
            } else {
                out.push(Rect(r.0 + along, r.1, length, thickness));
            }
            along += length;
        }
        if r.2 >= r.3 {
            r = Rect(r.0 + thickness, r.1, r.2 - thickness, r.3);
        } else {
            r = Rect(r.0, r.1 + thickness, r.2, r.3 - thickness);
        }
        i = end;
    }
    out
}

const MAP_WIDTH: f64 = 960.0;
const MAP_HEIGHT: f64 = 480.0;

/// What a box of the treemap holds.
enum Part {
    Allocator(usize),
    Own,
    Free,
}

fn treemap(out: &mut String, snapshot: &Snapshot) {
    let _ = writeln!(
        out,
        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{MAP_WIDTH}\" height=\"{MAP_HEIGHT}\" \
         viewBox=\"0 0 {MAP_WIDTH} {MAP_HEIGHT}\" role=\"img\" aria-label=\"allocator treemap\">\
         <defs><pattern id=\"free\" width=\"6\" height=\"6\" patternUnits=\"userSpaceOnUse\" \
         patternTransform=\"rotate(45)\"><rect width=\"6\" height=\"6\" fill=\"#fff\"/>\
         <line x1=\"0\" y1=\"0\" x2=\"0\" y2=\"6\" stroke=\"#bbb\" stroke-width=\"3\"/></pattern></defs>"
    );
    let roots: Vec<usize> = (0..snapshot.allocators.len())
        .filter(|&i| snapshot.allocators[i].parent.is_none())
        .collect();
    let values: Vec<f64> = roots
        .iter()
        .map(|&i| snapshot.allocators[i].stats.reserved_bytes.max(1) as f64)
        .collect();
    let rects = squarify(&values, Rect(0.0, 0.0, MAP_WIDTH, MAP_HEIGHT));
    for (&i, r) in roots.iter().zip(rects) {
        allocator_box(out, snapshot, i, r);
    }
    out.push_str("</svg>\n");
}

fn title(a: &AllocatorSnapshot) -> String {
    format!(
        "{}: Used {}, Reserved {}, {} blocks{}{}",
        a.name,
        human(a.stats.live_granted_bytes),
        human(a.stats.reserved_bytes),
        a.stats.live_blocks,
        a.budget
            .map_or(String::new(), |b| format!(", budget {}", human(b))),
        if a.description.is_empty() {
            String::new()
        } else {
            format!(" ({})", a.description)
        }
    )
}

/// Draws allocator `i` in `r`: its frame and name, then its children, own blocks and free
/// space inside.
fn allocator_box(out: &mut String, snapshot: &Snapshot, i: usize, r: Rect) {
    let a = &snapshot.allocators[i];
    let _ = write!(
        out,
        "<g><title>{}</title><rect x=\"{:.1}\" y=\"{:.1}\" width=\"{:.1}\" height=\"{:.1}\" \
         fill=\"{}\" fill-opacity=\"0.35\" stroke=\"#333\" stroke-width=\"1\"/>",
        esc(&title(a)),
        r.0,
        r.1,
        r.2,
        r.3,
        colour(a.name)
    );
    let header = if r.2 > 50.0 && r.3 > 30.0 { 15.0 } else { 0.0 };
    if header > 0.0 {
        let _ = write!(
            out,
            "<text x=\"{:.1}\" y=\"{:.1}\">{} {}</text>",
            r.0 + 3.0,
            r.1 + 12.0,
            esc(&clip(a.name, r.2)),
            human(a.stats.live_granted_bytes)
        );
    }
    out.push_str("</g>\n");
    let inner = Rect(
        r.0 + 2.0,
        r.1 + header + 1.0,
        (r.2 - 4.0).max(0.0),
        (r.3 - header - 3.0).max(0.0),
    );
    let mut parts: Vec<(Part, f64)> = snapshot
        .children(i)
        .map(|c| {
            (
                Part::Allocator(c),
                snapshot.allocators[c].stats.reserved_bytes as f64,
            )
        })
        .collect();
    parts.push((Part::Own, a.own_used_bytes as f64));
    parts.push((
        Part::Free,
        a.stats
            .reserved_bytes
            .saturating_sub(a.stats.live_granted_bytes) as f64,
    ));
    parts.retain(|(_, v)| *v > 0.0);
    parts.sort_by(|x, y| y.1.total_cmp(&x.1));
    let values: Vec<f64> = parts.iter().map(|p| p.1).collect();
    for ((part, bytes), rect) in parts.iter().zip(squarify(&values, inner)) {
        if rect.2 < 1.0 || rect.3 < 1.0 {
            continue;
        }
        match part {
            Part::Allocator(c) => allocator_box(out, snapshot, *c, rect),
            Part::Own | Part::Free => {
                let (fill, what) = match part {
                    Part::Own => (colour(a.name), "live blocks of its own"),
                    _ => ("url(#free)".to_string(), "reserved, free for reuse"),
                };
                let _ = writeln!(
                    out,
                    "<rect x=\"{:.1}\" y=\"{:.1}\" width=\"{:.1}\" height=\"{:.1}\" fill=\"{fill}\">\
                     <title>{}: {} {what}</title></rect>",
                    rect.0,
                    rect.1,
                    rect.2,
                    rect.3,
                    esc(a.name),
                    human(*bytes as usize)
                );
            }
        }
    }
}

/// `name`, cut to what fits in `width` pixels.
fn clip(name: &str, width: f64) -> String {
    let fits = ((width - 60.0) / 6.5).max(3.0) as usize;
    if name.chars().count() <= fits {
        name.to_string()
    } else {
        let mut cut: String = name.chars().take(fits.saturating_sub(1)).collect();
        cut.push('…');
        cut
    }
}

fn table(out: &mut String, snapshot: &Snapshot) {
    out.push_str(
        "<table><tr><th>Allocator</th><th>Used</th><th>Reserved</th><th>Consumed</th>\
         <th>Blocks</th><th>Peak</th><th>Budget</th><th>Failures</th><th class=\"text\">Description</th></tr>\n",
    );
    for a in &snapshot.allocators {
        let _ = writeln!(
            out,
            "<tr><td style=\"padding-left:{}px\">{}</td><td>{}</td><td>{}</td><td>{}</td>\
             <td>{}</td><td>{}</td><td>{}</td><td>{}</td><td class=\"text\">{}</td></tr>",
            10 + 16 * a.depth,
            esc(a.name),
            human(a.stats.live_granted_bytes),
            human(a.stats.reserved_bytes),
            human(a.consumed_bytes),
            a.stats.live_blocks,
            a.stats.peak_granted_bytes.map_or("-".to_string(), human),
            a.budget.map_or("-".to_string(), human),
            a.stats.budget_failures,
            esc(a.description)
        );
    }
    out.push_str("</table>\n");
}

const CHART_WIDTH: f64 = 300.0;
const CHART_HEIGHT: f64 = 110.0;

fn charts(out: &mut String, timeline: &Timeline) {
    if timeline.frames.is_empty() {
        out.push_str(
            "<p class=\"note\">No frames marked: call <code>tagalloc::report::mark_frame()</code> \
             once per frame or interval to see memory over time.</p>\n",
        );
        return;
    }
    let _ = writeln!(
        out,
        "<p class=\"note\">{} marks. Per allocator: Used at each mark (solid), the peak between \
         marks (light), the budget (dashed red).</p><div class=\"charts\">",
        timeline.frames.len()
    );
    let n = timeline.frames.len();
    for (k, a) in timeline.allocators.iter().enumerate() {
        let points: Vec<Option<(usize, usize)>> =
            timeline.frames.iter().map(|f| f.figures[k]).collect();
        let top = points
            .iter()
            .flatten()
            .map(|&(u, p)| u.max(p))
            .chain(a.budget)
            .max()
            .unwrap_or(0)
            .max(1) as f64;
        let x = |j: usize| {
            if n <= 1 {
                CHART_WIDTH / 2.0
            } else {
                j as f64 * CHART_WIDTH / (n - 1) as f64
            }
        };
        let y = |v: usize| CHART_HEIGHT - v as f64 / top * (CHART_HEIGHT - 4.0);
        let line = |pick: fn((usize, usize)) -> usize| -> String {
            points
                .iter()
                .enumerate()
                .filter_map(|(j, p)| p.map(|p| format!("{:.1},{:.1}", x(j), y(pick(p)))))
                .collect::<Vec<_>>()
                .join(" ")
        };
        let last = points.iter().rev().flatten().next().map_or(0, |p| p.0);
        let _ = write!(
            out,
            "<div class=\"chart\"><h3>{} — {} now, peak {}</h3>\
             <svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{CHART_WIDTH}\" height=\"{CHART_HEIGHT}\">\
             <rect width=\"{CHART_WIDTH}\" height=\"{CHART_HEIGHT}\" fill=\"#fff\"/>\
             <polyline points=\"{}\" fill=\"none\" stroke=\"{}\" stroke-opacity=\"0.45\" stroke-width=\"3\"/>\
             <polyline points=\"{}\" fill=\"none\" stroke=\"#234\" stroke-width=\"1.5\"/>",
            esc(a.name),
            human(last),
            human(top as usize),
            line(|p| p.1),
            colour(a.name),
            line(|p| p.0),
        );
        if let Some(budget) = a.budget {
            let _ = write!(
                out,
                "<line x1=\"0\" x2=\"{CHART_WIDTH}\" y1=\"{0:.1}\" y2=\"{0:.1}\" stroke=\"#c22\" \
                 stroke-dasharray=\"5 3\"><title>budget {1}</title></line>\
                 <text x=\"4\" y=\"{2:.1}\" fill=\"#c22\">budget {1}</text>",
                y(budget),
                human(budget),
                (y(budget) - 3.0).max(10.0)
            );
        }
        out.push_str("</svg></div>\n");
    }
    out.push_str("</div>\n");
}

/// The first frames of a call stack that are the program's (not tagalloc's, std's or the
/// container crates'), as function names.
fn site_frames(records: &RecordsSnapshot, stack: u32) -> Vec<String> {
    const SKIP: [&str; 9] = [
        "tagalloc::",
        "alloc::",
        "core::",
        "std::",
        "allocator_api2::",
        "hashbrown::",
        "<",
        "__rust",
        "backtrace::",
    ];
    let Some(info) = records.stacks.iter().find(|s| s.id == stack) else {
        return Vec::new();
    };
    info.frames
        .iter()
        .flat_map(|f| f.symbols.iter())
        .map(|s| s.name.as_str())
        .filter(|name| !SKIP.iter().any(|p| name.starts_with(p)))
        .take(3)
        .map(str::to_string)
        .collect()
}

fn call_sites(out: &mut String, records: &RecordsSnapshot) {
    let mut names: Vec<&'static str> = records
        .sites
        .iter()
        .filter(|s| s.live_bytes > 0.0)
        .map(|s| s.allocator)
        .collect();
    names.sort_unstable();
    names.dedup();
    if names.is_empty() {
        out.push_str("<p class=\"note\">No live recorded blocks.</p>\n");
        return;
    }
    for name in names {
        let mut sites: Vec<_> = records
            .sites
            .iter()
            .filter(|s| s.allocator == name && s.live_bytes > 0.0)
            .collect();
        sites.sort_by(|a, b| b.live_bytes.total_cmp(&a.live_bytes));
        let _ = write!(out, "<h3>{}</h3><ol class=\"sites\">", esc(name));
        for site in sites.iter().take(5) {
            let frames = site_frames(records, site.stack);
            let shown = if frames.is_empty() {
                "(no call stack: basic records)".to_string()
            } else {
                frames.join(" ← ")
            };
            let _ = write!(
                out,
                "<li>{} in {:.0} blocks: <code>{}</code></li>",
                human(site.live_bytes.round().max(0.0) as usize),
                site.live_blocks,
                esc(&shown)
            );
        }
        out.push_str("</ol>\n");
    }
}

#[cfg(test)]
mod tests {
    use super::{Rect, squarify};

    #[test]
    fn squarified_areas_are_proportional_and_inside() {
        let values = [6.0, 6.0, 4.0, 3.0, 2.0, 2.0, 1.0];
        let rect = Rect(10.0, 20.0, 600.0, 400.0);
        let rects = squarify(&values, rect);
        let scale = 600.0 * 400.0 / values.iter().sum::<f64>();
        for (v, r) in values.iter().zip(&rects) {
            assert!((r.2 * r.3 - v * scale).abs() < 1e-6, "{r:?}");
            assert!(r.0 >= 10.0 - 1e-9 && r.1 >= 20.0 - 1e-9);
            assert!(r.0 + r.2 <= 610.0 + 1e-6 && r.1 + r.3 <= 420.0 + 1e-6);
        }
    }
}
