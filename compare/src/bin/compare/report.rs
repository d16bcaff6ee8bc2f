//! The markdown report: a time table and a memory table, aligned so they also read well in
//! a terminal.

use crate::Options;
use crate::run::{Results, Sample};

/// The median of a non-empty list (the mean of the middle two for an even count).
pub fn median(mut xs: Vec<f64>) -> f64 {
    xs.sort_by(f64::total_cmp);
    let n = xs.len();
    if n % 2 == 1 {
        xs[n / 2]
    } else {
        (xs[n / 2 - 1] + xs[n / 2]) / 2.0
    }
}

/// Renders rows (the first is the header) as a markdown table with padded columns; columns
/// after the first are right-aligned because they hold numbers.
pub fn table(rows: &[Vec<String>]) -> String {
    let cols = rows.iter().map(Vec::len).max().unwrap_or(0);
    let width = |c: usize| {
        rows.iter()
            .filter_map(|r| r.get(c))
            .map(|s| s.chars().count())
            .max()
            .unwrap_or(0)
            .max(3)
    };
    let widths: Vec<usize> = (0..cols).map(width).collect();
    let mut out = String::new();
    for (i, row) in rows.iter().enumerate() {
        out += "|";
        for (c, w) in widths.iter().enumerate() {
            let cell = row.get(c).map_or("", String::as_str);
            out += &if c == 0 {
                format!(" {cell:<w$} |")
            } else {
                format!(" {cell:>w$} |")
            };
        }
        out += "\n";
        if i == 0 {
            out += "|";
            for (c, w) in widths.iter().enumerate() {
                out += &if c == 0 {
                    format!("{}|", "-".repeat(w + 2))
                } else {
                    format!("{}:|", "-".repeat(w + 1))
                };
            }
            out += "\n";
        }
    }
    out
}

fn mib(kib: f64) -> String {
    if kib >= 100.0 * 1024.0 {
        format!("{:.0}", kib / 1024.0)
    } else {
        format!("{:.1}", kib / 1024.0)
    }
}

/// Formats a duration in ms with three significant digits or so.
fn ms(m: f64) -> String {
    if m >= 100.0 {
        format!("{m:.0}")
    } else {
        format!("{m:.1}")
    }
}

/// A ratio column of a time table: the median of `over` divided by the smallest median of
/// `under` (the allocators present among them).
struct RatioColumn {
    label: &'static str,
    over: &'static str,
    under: &'static [&'static str],
}

/// The ratio columns a set of allocators gets: tagalloc against the faster of mimalloc and
/// jemalloc, and a child of tagalloc's `SystemAllocator` against tagalloc itself.
fn ratio_columns(allocs: &[&str]) -> Vec<RatioColumn> {
    let candidates = [
        RatioColumn {
            label: "tagalloc ÷ best(mi, je)",
            over: "tagalloc",
            under: &["mimalloc", "jemalloc"],
        },
        RatioColumn {
            label: "tagalloc-child ÷ tagalloc",
            over: "tagalloc-child",
            under: &["tagalloc"],
        },
        RatioColumn {
            label: "tagalloc-scoped ÷ tagalloc",
            over: "tagalloc-scoped",
            under: &["tagalloc"],
        },
        RatioColumn {
            label: "tagalloc-nothp ÷ tagalloc",
            over: "tagalloc-nothp",
            under: &["tagalloc"],
        },
        RatioColumn {
            label: "tagalloc-guarded ÷ tagalloc",
            over: "tagalloc-guarded",
            under: &["tagalloc"],
        },
        RatioColumn {
            label: "tagalloc-scoped ÷ tracking",
            over: "tagalloc-scoped",
            under: &["tracking"],
        },
    ];
    candidates
        .into_iter()
        .filter(|c| allocs.contains(&c.over) && c.under.iter().any(|u| allocs.contains(u)))
        .collect()
}

/// A table of one time metric: median and median absolute deviation per allocator, and the
/// [`ratio_columns`], each with the geometric mean of its ratios as the last row.
fn time_table(opts: &Options, results: &Results, metric: fn(&Sample) -> f64) -> String {
    let allocs = &opts.allocators;
    let values = |w: &'static str, a: &'static str| -> Option<Vec<f64>> {
        let s = results.samples.get(&(w, a)).filter(|s| !s.is_empty())?;
        Some(s.iter().map(metric).collect())
    };
    let columns = ratio_columns(allocs);
    let mut header = vec!["workload".to_string()];
    header.extend(allocs.iter().map(|a| a.to_string()));
    header.extend(columns.iter().map(|c| c.label.to_string()));
    let mut rows = vec![header];
    let mut log_ratios = vec![Vec::new(); columns.len()];
    for w in &opts.workloads {
        let med = |a: &'static str| values(w.name, a).map(median);
        let mut row = vec![w.name.to_string()];
        for a in allocs {
            row.push(match values(w.name, a) {
                None => "FAILED".into(),
                Some(xs) => {
                    let m = median(xs.clone());
                    // Median absolute deviation: one disturbed run out of five does not
                    // move it, unlike the min-max range.
                    let mad = median(xs.iter().map(|x| (x - m).abs()).collect());
                    let spread = if m > 0.0 { mad / m * 100.0 } else { 0.0 };
                    format!("{} ±{spread:.0}%", ms(m))
                }
            });
        }
        for (column, logs) in columns.iter().zip(&mut log_ratios) {
            let best = column
                .under
                .iter()
                .filter_map(|u| med(u))
                .fold(f64::INFINITY, f64::min);
            row.push(match med(column.over) {
                Some(t) if best.is_finite() && best > 0.0 => {
                    logs.push((t / best).ln());
                    format!("{:.2}", t / best)
                }
                _ => "-".into(),
            });
        }
        rows.push(row);
    }
    if log_ratios.iter().any(|logs| !logs.is_empty()) {
        let mut row = vec!["geometric mean".to_string()];
        row.extend(allocs.iter().map(|_| String::new()));
        for logs in &log_ratios {
            row.push(if logs.is_empty() {
                "-".into()
            } else {
                let mean = logs.iter().sum::<f64>() / logs.len() as f64;
                format!("{:.2}", mean.exp())
            });
        }
        rows.push(row);
    }
    table(&rows)
}

/// A table with a row per workload and a column per allocator, each cell `cell` of that
/// run's samples ("FAILED" where it has none).
fn sample_table(opts: &Options, results: &Results, cell: impl Fn(&[Sample]) -> String) -> String {
    let mut header = vec!["workload".to_string()];
    header.extend(opts.allocators.iter().map(|a| a.to_string()));
    let mut rows = vec![header];
    for w in &opts.workloads {
        let mut row = vec![w.name.to_string()];
        for &a in &opts.allocators {
            row.push(
                match results.samples.get(&(w.name, a)).filter(|s| !s.is_empty()) {
                    None => "FAILED".into(),
                    Some(s) => cell(s),
                },
            );
        }
        rows.push(row);
    }
    table(&rows)
}

/// The whole report for a run of the workloads.
pub fn render(opts: &Options, results: &Results, version: &str) -> String {
    let cpus = std::thread::available_parallelism().map_or(0, |n| n.get());
    let mut out = String::from("# tagalloc vs System vs mimalloc vs jemalloc\n\n");
    out += &format!(
        "tagalloc sources: {version}; {cpus} CPUs; {} round(s), interleaved, one process per run; scale {}.\n\n",
        opts.rounds, opts.scale
    );
    for note in &results.notes {
        out += &format!("**Note — {note}**\n\n");
    }

    out += "## Wall time (median ms ± median absolute deviation, as % of the median)\n\n";
    out += &time_table(opts, results, |s| s.ms);
    out += "\nRatio above 1: tagalloc is slower than the faster of mimalloc and jemalloc.\n\n";
    out += "## CPU time, user + system, all threads (median ms ± median absolute deviation %)\n\n";
    out += "Less disturbed than wall time when the machine is shared; it includes spinning and \
            cache contention but not waiting.\n\n";
    out += &time_table(opts, results, |s| s.cpu_ms);
    out += "\n";

    // Memory table.
    out += "## RSS (median MiB: peak / end / end after trim hook)\n\n";
    out += "peak = VmHWM of the run; end = VmRSS once the workload freed everything (+50 ms); \
            after trim = VmRSS after the allocator's trim hook (+50 ms), `-` when it has none.\n\n";
    out += &sample_table(opts, results, |s| {
        let m = |f: fn(&Sample) -> u64| median(s.iter().map(|x| f(x) as f64).collect());
        let trim = if s.iter().any(|x| x.trimmed) {
            mib(m(|x| x.trim_kib))
        } else {
            "-".into()
        };
        format!(
            "{} / {} / {}",
            mib(m(|x| x.peak_kib)),
            mib(m(|x| x.end_kib)),
            trim
        )
    });
    out += "\nTrim hooks: tagalloc `SystemAllocator::garbage_collect()`, System \
            `malloc_trim(0)`, mimalloc `mi_collect(true)`, jemalloc tcache flush + `arena.<all>.purge`.\n";

    // Peak spread: some peaks are bimodal across runs (prodcons: how full the channel got
    // depends on how the two threads were scheduled), which a median alone hides.
    out += "\n## Peak RSS over the rounds (MiB: min / median / max)\n\n";
    out += &sample_table(opts, results, |s| {
        let peaks: Vec<f64> = s.iter().map(|x| x.peak_kib as f64).collect();
        let min = peaks.iter().copied().fold(f64::INFINITY, f64::min);
        let max = peaks.iter().copied().fold(0.0, f64::max);
        format!("{} / {} / {}", mib(min), mib(median(peaks)), mib(max))
    });

    if !results.failures.is_empty() {
        out += "\n## Failures\n\n";
        for f in &results.failures {
            out += &format!("- {f}\n");
        }
    }
    out
}

#[cfg(test)]
mod tests {
    #[test]
    fn median_of_odd_and_even() {
        assert_eq!(super::median(vec![3.0, 1.0, 2.0]), 2.0);
        assert_eq!(super::median(vec![4.0, 1.0, 2.0, 3.0]), 2.5);
    }

    #[test]
    fn table_is_aligned_markdown() {
        let rows = vec![
            vec!["a".to_string(), "bb".to_string()],
            vec!["ccc".to_string(), "1".to_string()],
        ];
        assert_eq!(
            super::table(&rows),
            "| a   |  bb |\n|-----|----:|\n| ccc |   1 |\n"
        );
    }
}
