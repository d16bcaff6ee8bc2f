//! O3DE's `sys_DumpAllocators` table as CSV.

use super::Snapshot;
use std::io;

/// The header line, exactly as O3DE prints it.
pub(super) const HEADER: &str = "Index,Name,Used KiB,Reserved KiB,Consumed KiB,Parent Allocator";

fn kib(bytes: usize) -> f64 {
    bytes as f64 / 1024.0
}

/// A CSV field: quoted (with doubled quotes) only if it holds a comma, quote or newline.
fn field(text: &str) -> std::borrow::Cow<'_, str> {
    if text.contains([',', '"', '\n', '\r']) {
        format!("\"{}\"", text.replace('"', "\"\"")).into()
    } else {
        text.into()
    }
}

pub(super) fn write(snapshot: &Snapshot, out: &mut dyn io::Write) -> io::Result<()> {
    writeln!(out, "{HEADER}")?;
    for a in &snapshot.allocators {
        writeln!(
            out,
            "{},{},{:.2},{:.2},{:.2},{}",
            a.index,
            field(a.name),
            kib(a.stats.live_granted_bytes),
            kib(a.stats.reserved_bytes),
            kib(a.consumed_bytes),
            field(a.parent_name.unwrap_or("")),
        )?;
    }
    let totals = snapshot.totals();
    writeln!(
        out,
        "-,Totals,{:.2},{:.2},{:.2},",
        kib(totals.used_bytes),
        kib(totals.reserved_bytes),
        kib(totals.consumed_bytes),
    )?;
    writeln!(out, "{} allocators active", snapshot.allocators.len())
}
