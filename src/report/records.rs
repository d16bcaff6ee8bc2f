//! Text reports from the allocation records: the records dump (O3DE's
//! `sys_DumpAllocationRecordsToFile`), the call-site summary and the leak report.

use super::owners::{self, Blocks};
use super::tree::human;
use crate::records::{CallSite, Record, RecordsSnapshot, StackInfo};
use std::io::{self, Write};

/// `bytes` (maybe an estimate) in human units; estimates get a `~`.
fn amount(bytes: f64, estimate: bool) -> String {
    let text = human(bytes.round().max(0.0) as usize);
    if estimate { format!("~{text}") } else { text }
}

fn blocks(n: f64, estimate: bool) -> String {
    let n = n.round().max(0.0) as u64;
    let s = if n == 1 { "" } else { "s" };
    if estimate {
        format!("~{n} block{s}")
    } else {
        format!("{n} block{s}")
    }
}

/// One line per frame (one per symbol when calls were inlined), indented.
fn write_frames(out: &mut dyn Write, stack: Option<&StackInfo>, indent: &str) -> io::Result<()> {
    let Some(stack) = stack else {
        return writeln!(out, "{indent}(no call stack: basic records)");
    };
    if stack.frames.is_empty() {
        // Not resolved: raw return addresses.
        for (i, ip) in stack.ips.iter().take(stack.show.max(1)).enumerate() {
            writeln!(out, "{indent}#{} {ip:#x}", i + 1)?;
        }
        return Ok(());
    }
    let mut n = 0;
    for frame in &stack.frames {
        if frame.symbols.is_empty() {
            n += 1;
            writeln!(out, "{indent}#{n} {:#x} ???", frame.ip)?;
        }
        for s in &frame.symbols {
            n += 1;
            write!(out, "{indent}#{n} {:#x} {}", frame.ip, s.name)?;
            match (&s.file, s.line) {
                (Some(file), Some(line)) => {
                    writeln!(out, " ({file}:{line}:{})", s.column.unwrap_or(0))?
                }
                (Some(file), None) => writeln!(out, " ({file})")?,
                _ => writeln!(out)?,
            }
        }
    }
    Ok(())
}

fn write_record(out: &mut dyn Write, snapshot: &RecordsSnapshot, r: &Record) -> io::Result<()> {
    write!(
        out,
        "Allocation Addr: {:#x} Size: {} Alignment: {} Requested: {} Thread: {} Time: {:.6} s",
        r.address,
        r.size,
        r.align,
        r.requested,
        r.thread,
        r.time_us as f64 / 1e6
    )?;
    if r.sampled {
        write!(out, " Sampled (stands for {:.1} blocks)", r.weight)?;
    }
    writeln!(out)?;
    if r.stack != 0 {
        write_frames(out, snapshot.stack(r.stack), "    ")?;
    }
    Ok(())
}

/// The records dump: for each allocator with records, every live record (or those whose
/// address is in `range`), with its frames. See [`RecordsSnapshot::write_dump`].
pub(crate) fn write_dump(
    snapshot: &RecordsSnapshot,
    out: &mut dyn Write,
    range: Option<(usize, usize)>,
) -> io::Result<()> {
    let selected: Vec<&Record> = match range {
        Some((start, end)) => snapshot.in_range(start, end).collect(),
        None => snapshot.records.iter().collect(),
    };
    if let Some((start, end)) = range {
        writeln!(out, "Allocation records in [{start:#x}, {end:#x})")?;
    }
    let mut i = 0;
    while i < selected.len() {
        let allocator = selected[i].allocator_index;
        let end = selected[i..]
            .iter()
            .position(|r| r.allocator_index != allocator)
            .map_or(selected.len(), |n| i + n);
        let name = selected[i].allocator;
        writeln!(
            out,
            "Printing allocation records for allocator {name} ({} records)",
            end - i
        )?;
        for r in &selected[i..end] {
            write_record(out, snapshot, r)?;
        }
        writeln!(
            out,
            "Printed {} allocations for allocator \"{name}\"",
            end - i
        )?;
        i = end;
    }
    if selected.is_empty() {
        writeln!(out, "No allocation records")?;
    }
    Ok(())
}

/// Groups sites by allocator, allocators by live bytes (largest first).
fn by_allocator(sites: &[CallSite]) -> Vec<(usize, &'static str, Vec<&CallSite>)> {
    let mut groups: Vec<(usize, &'static str, Vec<&CallSite>)> = Vec::new();
    for site in sites.iter().filter(|s| s.live_blocks > 0.0) {
        match groups.iter_mut().find(|g| g.0 == site.allocator_index) {
            Some(g) => g.2.push(site),
            None => groups.push((site.allocator_index, site.allocator, vec![site])),
        }
    }
    let live = |g: &(usize, &str, Vec<&CallSite>)| g.2.iter().map(|s| s.live_bytes).sum::<f64>();
    groups.sort_by(|a, b| live(b).total_cmp(&live(a)).then(a.0.cmp(&b.0)));
    groups
}

/// What of an allocator's live records are blocks of allocators below it (which list them
/// too): `, of which 1.0 KiB in 1 block through Loader (listed there too)`, or nothing.
fn through_descendants(
    snapshot: &RecordsSnapshot,
    blocks_of: &Blocks<'_>,
    allocator: usize,
) -> String {
    let (mut bytes, mut count, mut estimate) = (0.0, 0.0, false);
    let mut names: Vec<&str> = Vec::new();
    for (r, inner) in snapshot.records.iter().zip(&blocks_of.inner) {
        let Some(inner) = *inner else { continue };
        if r.allocator_index != allocator {
            continue;
        }
        bytes += r.weight * r.size as f64;
        count += r.weight;
        estimate |= r.sampled;
        let name = snapshot.allocator(inner).map_or("?", |a| a.name);
        if !names.contains(&name) {
            names.push(name);
        }
    }
    if names.is_empty() {
        return String::new();
    }
    format!(
        ", of which {} in {} through {} (listed there too)",
        amount(bytes, estimate),
        blocks(count, estimate),
        names.join(", ")
    )
}

/// The call-site summary: live bytes and blocks per allocator and call stack, largest
/// first. `examples` addresses are listed per site (for the leak report).
fn write_sites(
    snapshot: &RecordsSnapshot,
    blocks_of: &Blocks<'_>,
    out: &mut dyn Write,
    examples: usize,
) -> io::Result<()> {
    let sites = snapshot.live_by_site();
    let groups = by_allocator(&sites);
    for (index, name, sites) in &groups {
        let bytes: f64 = sites.iter().map(|s| s.live_bytes).sum();
        let count: f64 = sites.iter().map(|s| s.live_blocks).sum();
        let estimate = sites.iter().any(|s| s.sampled);
        writeln!(
            out,
            "{name}: {} in {} at {} call site{}{}",
            amount(bytes, estimate),
            blocks(count, estimate),
            sites.len(),
            if sites.len() == 1 { "" } else { "s" },
            through_descendants(snapshot, blocks_of, *index)
        )?;
        for site in sites {
            let share = if bytes > 0.0 {
                100.0 * site.live_bytes / bytes
            } else {
                0.0
            };
            writeln!(
                out,
                "  {} in {} ({share:.1}%){}",
                amount(site.live_bytes, site.sampled),
                blocks(site.live_blocks, site.sampled),
                if site.sampled {
                    ", estimated from samples"
                } else {
                    ""
                }
            )?;
            write_frames(out, snapshot.stack(site.stack), "      ")?;
            if examples > 0 {
                let addresses: Vec<String> = snapshot
                    .records
                    .iter()
                    .filter(|r| r.allocator_index == *index && r.stack == site.stack)
                    .take(examples)
                    .map(|r| format!("{:#x} ({} B)", r.address, r.requested))
                    .collect();
                writeln!(out, "      blocks: {}", addresses.join(", "))?;
            }
        }
    }
    if groups.is_empty() {
        writeln!(out, "No live records")?;
    }
    Ok(())
}

/// See [`RecordsSnapshot::write_call_sites`].
pub(crate) fn write_call_sites(snapshot: &RecordsSnapshot, out: &mut dyn Write) -> io::Result<()> {
    writeln!(
        out,
        "Live memory by call site (from allocation records, largest first)"
    )?;
    write_sites(snapshot, &owners::live_blocks(snapshot), out, 0)
}

/// See [`RecordsSnapshot::write_leaks`]. The first line counts every block once (see
/// [`owners`]): its granted bytes, and the requested bytes when they differ.
pub(crate) fn write_leaks(snapshot: &RecordsSnapshot, out: &mut dyn Write) -> io::Result<()> {
    let blocks_of = owners::live_blocks(snapshot);
    let live = &blocks_of.counted;
    let estimate = live.iter().any(|b| b.sampled);
    let weighted = |f: fn(&Record) -> usize| -> f64 {
        live.iter().map(|b| b.weight * f(b.record) as f64).sum()
    };
    let bytes = weighted(|r| r.size);
    let requested = weighted(|r| r.requested);
    let count: f64 = live.iter().map(|b| b.weight).sum();
    let allocators = by_allocator(&snapshot.live_by_site()).len();
    let requested = if amount(requested, estimate) == amount(bytes, estimate) {
        String::new()
    } else {
        format!(" ({} requested)", amount(requested, estimate))
    };
    writeln!(
        out,
        "Leak report: {} in {} still live{requested}, recorded by {allocators} allocator{}",
        amount(bytes, estimate),
        blocks(count, estimate),
        if allocators == 1 { "" } else { "s" }
    )?;
    if estimate && bytes > 0.0 {
        // Each sampled block stands for w blocks with probability 1/w: the estimate's
        // variance is estimated by the sum of w (w - 1) s² over the samples.
        let variance: f64 = live
            .iter()
            .filter(|b| b.sampled)
            .map(|b| b.weight * (b.weight - 1.0) * (b.record.size as f64).powi(2))
            .sum();
        writeln!(
            out,
            "(estimated from samples: the bytes within ±{:.1}% at one standard error)",
            100.0 * variance.sqrt() / bytes
        )?;
    }
    writeln!(
        out,
        "(only allocators with records are listed; blocks allocated before records were \
         turned on are not known)"
    )?;
    if snapshot.dropped > 0 {
        writeln!(
            out,
            "({} records were dropped: the records' heap ran out of memory)",
            snapshot.dropped
        )?;
    }
    write_sites(snapshot, &blocks_of, out, 3)
}
