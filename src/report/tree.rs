//! The allocator tree: indented by parent, human units, share of the parent.

use super::Snapshot;
use std::io;

/// `bytes` in the largest binary unit that keeps the number at or above 1.
pub(super) fn human(bytes: usize) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut value = bytes as f64;
    let mut unit = 0;
    while value >= 1024.0 && unit + 1 < UNITS.len() {
        value /= 1024.0;
        unit += 1;
    }
    if unit == 0 {
        format!("{bytes} B")
    } else {
        format!("{value:.1} {}", UNITS[unit])
    }
}

/// One line per allocator, depth first from the roots, children in registration order.
fn order(snapshot: &Snapshot) -> Vec<(usize, String)> {
    fn visit(
        snapshot: &Snapshot,
        i: usize,
        prefix: &str,
        last: bool,
        root: bool,
        out: &mut Vec<(usize, String)>,
    ) {
        let (branch, next) = match (root, last) {
            (true, _) => ("", String::new()),
            (false, true) => ("└─ ", format!("{prefix}   ")),
            (false, false) => ("├─ ", format!("{prefix}│  ")),
        };
        out.push((
            i,
            format!("{prefix}{branch}{}", snapshot.allocators[i].name),
        ));
        let children: Vec<usize> = snapshot.children(i).collect();
        for (k, &c) in children.iter().enumerate() {
            visit(snapshot, c, &next, k + 1 == children.len(), false, out);
        }
    }
    let mut out = Vec::new();
    for (i, a) in snapshot.allocators.iter().enumerate() {
        if a.parent.is_none() {
            visit(snapshot, i, "", true, true, &mut out);
        }
    }
    out
}

/// The label of the last line.
const TOTALS: &str = "Totals (each byte once)";

pub(super) fn write(snapshot: &Snapshot, out: &mut dyn io::Write) -> io::Result<()> {
    let lines = order(snapshot);
    let width = lines
        .iter()
        .map(|(_, l)| l.chars().count())
        .max()
        .unwrap_or(0)
        .max(TOTALS.len());
    writeln!(
        out,
        "{:<width$}  {:>10}  {:>10}  {:>10}  {:>9}  {:>10}  {:>7}  Description",
        "Allocator", "Used", "Reserved", "Consumed", "Blocks", "Peak", "Share"
    )?;
    for (i, line) in &lines {
        let a = &snapshot.allocators[*i];
        let share = match a.parent {
            Some(p) if snapshot.allocators[p].stats.live_granted_bytes > 0 => format!(
                "{:.1}%",
                100.0 * a.stats.live_granted_bytes as f64
                    / snapshot.allocators[p].stats.live_granted_bytes as f64
            ),
            _ => "-".to_string(),
        };
        let peak = a.stats.peak_granted_bytes.map_or("-".to_string(), human);
        let budget = match a.budget {
            Some(b) => format!(
                " [budget {}, {:.0}% used{}]",
                human(b),
                100.0 * a.stats.live_granted_bytes as f64 / b.max(1) as f64,
                if a.stats.budget_failures > 0 {
                    format!(", {} refused", a.stats.budget_failures)
                } else {
                    String::new()
                }
            ),
            None => String::new(),
        };
        let budget = if a.thread_cache_lane {
            format!("{budget} [thread-cache lane]")
        } else {
            budget
        };
        // `{:<width$}` counts chars, and the tree glyphs are one char each.
        let pad = width - line.chars().count();
        writeln!(
            out,
            "{line}{:pad$}  {:>10}  {:>10}  {:>10}  {:>9}  {:>10}  {:>7}  {}{budget}",
            "",
            human(a.stats.live_granted_bytes),
            human(a.stats.reserved_bytes),
            human(a.consumed_bytes),
            a.stats.live_blocks,
            peak,
            share,
            a.description,
        )?;
    }
    let t = snapshot.totals();
    writeln!(
        out,
        "{:<width$}  {:>10}  {:>10}  {:>10}",
        TOTALS,
        human(t.used_bytes),
        human(t.reserved_bytes),
        human(t.consumed_bytes),
    )
}

#[cfg(test)]
mod tests {
    use super::human;

    #[test]
    fn human_units() {
        assert_eq!(human(0), "0 B");
        assert_eq!(human(1023), "1023 B");
        assert_eq!(human(1536), "1.5 KiB");
        assert_eq!(human(3 << 20), "3.0 MiB");
    }
}
