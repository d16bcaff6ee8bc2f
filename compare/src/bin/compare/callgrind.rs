//! Instructions per small alloc+free under `valgrind --tool=callgrind`.
//!
//! Wall time on a shared two-core machine is noisy; instruction counts are not. For each
//! allocator and case the `pairs` binary runs twice under callgrind, once doing no measured
//! pairs and once doing `n`; both pay the same start-up and warm-up, so
//! `(Ir(n) - Ir(0)) / n` is the instruction cost of one allocation plus one free. Instruction
//! counts ignore cache misses and contention, so this complements the timings, it does not
//! replace them.
//!
//! The measured loop itself (building a `Vec`, writing a byte, summing) costs instructions that
//! are the same for every allocator. They are the self cost of the loop function, which
//! `callgrind_annotate` reports, and are subtracted, so the table shows what the allocator
//! costs: its `GlobalAlloc` glue, `__rust_alloc`/`__rust_dealloc` and everything below.

use std::path::Path;
use std::process::Command;

use crate::Options;
use crate::build::{self, Bins};
use crate::report::table;

/// (mode, size, column header) of each measured case.
const CASES: [(&str, usize, &str); 4] = [
    ("pair", 32, "32 B pair"),
    ("batch", 32, "32 B batch of 64"),
    ("pair", 512, "512 B pair"),
    ("pair", 4096, "4 KiB pair"),
];

/// Instructions of one run of `pairs` under callgrind.
struct Count {
    /// Everything the program executed.
    total: u64,
    /// The self cost of the measured loop function; `None` without `callgrind_annotate`.
    harness: Option<u64>,
}

/// The self cost of the measured loop function (`pairs::pairs` or `pairs::batches`), read
/// from `callgrind_annotate`'s per-function listing.
fn loop_self_cost(out_file: &Path, mode: &str) -> Option<u64> {
    let function = if mode == "batch" {
        ":pairs::batches "
    } else {
        ":pairs::pairs "
    };
    let out = Command::new("callgrind_annotate")
        .arg("--threshold=100")
        .arg(out_file)
        .output()
        .ok()?;
    let text = String::from_utf8_lossy(&out.stdout);
    let line = text.lines().find(|l| l.contains(function))?;
    line.split_whitespace()
        .next()?
        .replace(',', "")
        .parse()
        .ok()
}

/// Runs `pairs` under callgrind and counts its instructions.
fn instructions(
    bins: &Bins,
    alloc: &str,
    mode: &str,
    size: usize,
    n: usize,
) -> Result<Count, String> {
    let out_file = bins
        .dir
        .join(format!("callgrind.out.{alloc}.{mode}.{size}.{n}"));
    let out = Command::new("valgrind")
        .arg("--tool=callgrind")
        // Valgrind hands out the client's mappings bottom-up from a low address; a native
        // process gets them top-down from under its stack. Starting them at 8 GiB keeps
        // the native order around the 4 GiB hint of tagalloc's guarded area (its free
        // fast path relies on ordinary blocks lying above the area), so the counts are
        // those of the native code path. Every allocator runs with the same setting.
        .arg("--aspace-minaddr=0x200000000")
        .arg(format!("--callgrind-out-file={}", out_file.display()))
        .arg(bins.pairs(alloc))
        .args([mode, &size.to_string(), &n.to_string()])
        .output()
        .map_err(|e| format!("cannot run valgrind (is it installed?): {e}"))?;
    if !out.status.success() {
        return Err(format!(
            "{alloc} {mode} {size} {n}: valgrind failed: {}",
            String::from_utf8_lossy(&out.stderr)
                .lines()
                .last()
                .unwrap_or("")
        ));
    }
    let text =
        std::fs::read_to_string(&out_file).map_err(|e| format!("{}: {e}", out_file.display()))?;
    let total = text
        .lines()
        .find_map(|l| l.strip_prefix("summary:"))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
        .ok_or_else(|| format!("no summary line in {}", out_file.display()))?;
    let harness = loop_self_cost(&out_file, mode);
    let _ = std::fs::remove_file(&out_file);
    Ok(Count { total, harness })
}

/// Measures every case for every selected allocator, prints the table and writes it.
pub fn main(opts: &Options, bins: &Bins) -> Result<(), String> {
    let n = opts.callgrind_n;
    let mut rows = vec![{
        let mut h = vec!["allocator".to_string()];
        h.extend(CASES.iter().map(|c| c.2.to_string()));
        h
    }];
    // The loop's own cost per case: equal for every allocator, so the first one seen is shown.
    let mut harness_row: Vec<Option<f64>> = vec![None; CASES.len()];
    let mut subtracted = true;
    let mut warnings = Vec::new();
    for alloc in &opts.allocators {
        let mut row = vec![alloc.to_string()];
        for (i, (mode, size, _)) in CASES.into_iter().enumerate() {
            let base = instructions(bins, alloc, mode, size, 0)?;
            let full = instructions(bins, alloc, mode, size, n)?;
            let mut per = full.total.saturating_sub(base.total) as f64 / n as f64;
            if let (Some(f), Some(b)) = (full.harness, base.harness) {
                let harness = f.saturating_sub(b) as f64 / n as f64;
                per -= harness;
                let first = *harness_row[i].get_or_insert(harness);
                // The loop is the same code for every allocator unless allocator code got
                // inlined into it, which would make the subtraction hide allocator work.
                if (harness - first).abs() > 1.0 {
                    warnings.push(format!(
                        "{alloc} {mode} {size} B: loop cost {harness:.1} differs from {first:.1}; \
                         allocator code may be inlined into the loop"
                    ));
                }
            } else {
                subtracted = false;
            }
            eprintln!("{alloc:<9} {mode:<5} {size:>5} B: {per:.1} instructions per alloc+free");
            row.push(format!("{per:.1}"));
        }
        rows.push(row);
    }
    if subtracted {
        let mut row = vec!["(loop, subtracted)".to_string()];
        row.extend(
            harness_row
                .iter()
                .map(|h| h.map_or("-".into(), |h| format!("{h:.1}"))),
        );
        rows.push(row);
    }
    let mut text = String::from("# Instructions per alloc+free (callgrind)\n\n");
    text += &format!(
        "tagalloc sources: {}; {n} measured alloc+free per case, minus a run with none; \
         \"batch of 64\" allocates 64 blocks then frees them in order. {}\n\n",
        build::source_version(&bins.root),
        if subtracted {
            "The measured loop's own instructions (last row, equal for all) are subtracted."
        } else {
            "callgrind_annotate was not found, so the loop's own instructions are included."
        }
    );
    text += &table(&rows);
    for w in &warnings {
        text += &format!("\n**Warning — {w}**\n");
    }
    print!("{text}");
    let path = opts
        .out
        .clone()
        .unwrap_or_else(|| bins.dir.join("callgrind.md"));
    std::fs::write(&path, &text).map_err(|e| format!("writing {}: {e}", path.display()))?;
    eprintln!("report written to {}", path.display());
    Ok(())
}
