//! The allocator tree: indented by parent, human units, share of the parent.

use super::Snapshot;
use crate::registry::AllocatorKind;
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

/// The label of the Totals line.
const TOTALS: &str = "Totals (each byte once)";

/// The footer under the table: what each column means.
const LEGEND: &str = "\
Columns:
  Used      bytes in live blocks, at their granted size (size class or block size); a
            parent's Used includes its children's blocks (for OSAllocator: bytes mapped)
  Reserved  bytes held from the parent or the OS: Used plus free space kept for reuse
            (free pages, free pool slots, blocks in thread caches)
  Consumed  Reserved minus the direct children's Reserved: the bytes this row alone holds;
            each byte is in one row, and the column adds up to the process's footprint
  Blocks    live blocks (for OSAllocator: live mappings)
  Peak      highest Used so far (for SystemAllocator: the highest seen by a reading, that
            is a report, stats() or report::mark_frame(), as its threads count apart)
  Share     Used as a share of the parent's Used
  Budget    the budget set on the allocator, and how full Used makes it
";

/// The budget column: `-`, or the limit and how full it is (and refusals).
fn budget_cell(a: &super::AllocatorSnapshot) -> String {
    match a.budget {
        Some(b) => {
            let mut cell = format!(
                "{} {:.0}%",
                human(b),
                100.0 * a.stats.live_granted_bytes as f64 / b.max(1) as f64
            );
            if a.stats.budget_failures > 0 {
                cell.push_str(&format!(" ({} refused)", a.stats.budget_failures));
            }
            cell
        }
        None => "-".to_string(),
    }
}

pub(super) fn write(snapshot: &Snapshot, out: &mut dyn io::Write) -> io::Result<()> {
    let lines = order(snapshot);
    let width = lines
        .iter()
        .map(|(_, l)| l.chars().count())
        .max()
        .unwrap_or(0)
        .max(TOTALS.len());
    let budgets: Vec<String> = snapshot.allocators.iter().map(budget_cell).collect();
    let budget_width = budgets
        .iter()
        .map(|b| b.chars().count())
        .max()
        .unwrap_or(0)
        .max("Budget".len());
    writeln!(
        out,
        "{:<width$}  {:>10}  {:>10}  {:>10}  {:>9}  {:>10}  {:>7}  {:<budget_width$}  Description",
        "Allocator", "Used", "Reserved", "Consumed", "Blocks", "Peak", "Share", "Budget"
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
        // `{:<width$}` counts chars, and the tree glyphs are one char each.
        let pad = width - line.chars().count();
        writeln!(
            out,
            "{line}{:pad$}  {:>10}  {:>10}  {:>10}  {:>9}  {:>10}  {:>7}  {:<budget_width$}  {}",
            "",
            human(a.stats.live_granted_bytes),
            human(a.stats.reserved_bytes),
            human(a.consumed_bytes),
            a.stats.live_blocks,
            peak,
            share,
            budgets[*i],
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
    )?;
    writeln!(out)?;
    out.write_all(LEGEND.as_bytes())?;
    write_totals_note(snapshot, t, out)
}

/// Explains the Totals line with this snapshot's numbers: why its Used differs from the
/// `SystemAllocator`'s, and what the OS layer's own Consumed bytes are.
fn write_totals_note(
    snapshot: &Snapshot,
    t: super::Totals,
    out: &mut dyn io::Write,
) -> io::Result<()> {
    let (Some(os), Some(system)) = (
        snapshot
            .allocators
            .iter()
            .find(|a| a.kind == AllocatorKind::Os),
        snapshot
            .allocators
            .iter()
            .find(|a| a.kind == AllocatorKind::System),
    ) else {
        return writeln!(
            out,
            "  Totals    Used: every byte in a live block once; Reserved: what the roots hold \
             from the OS;\n            Consumed: the column's sum"
        );
    };
    // Bytes that allocators below the SystemAllocator reserve but have not handed out
    // (free pool slots, pool pages): in the SystemAllocator's Used, in no block.
    let kept_free: usize = snapshot
        .allocators
        .iter()
        .filter(|a| a.depth >= 2)
        .map(|a| {
            a.stats
                .reserved_bytes
                .saturating_sub(a.stats.live_granted_bytes)
        })
        .sum();
    let bookkeeping = if os.own_used_bytes == 0 {
        "OSAllocator's Consumed is 0 B: every page it maps is held by the allocators above it"
    } else {
        "OSAllocator's own: pages it maps for tagalloc's bookkeeping (thread caches,\n            \
         registry, records), also its Consumed"
    };
    writeln!(
        out,
        "  Totals    Used: every byte in a live block once: {} = SystemAllocator's Used {}\n            \
         - {} that allocators below it reserve but have not handed out (free pool slots)\n            \
         + {} {bookkeeping}.\n            \
         Reserved: what the roots hold from the OS; Consumed: the column's sum.",
        human(t.used_bytes),
        human(system.stats.live_granted_bytes),
        human(kept_free),
        human(os.own_used_bytes),
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
