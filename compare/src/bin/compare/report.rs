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

/// A ratio column of a time table: in each round, the time of `over` divided by the
/// smallest time of `under` (the allocators present among them) in that round; the column
/// shows the median of these ratios over the rounds. Paired by round, unlike a ratio of two
/// medians: this machine's speed drifts by 10% and more over minutes, and runs of one round
/// are close in time, so the drift cancels in the ratio. (On 2026-12-03 three runs of 11
/// rounds gave `tagalloc-scoped ÷ tagalloc` ratios of medians of 0.86-1.20 on single
/// workloads, and paired ratios of 0.94-1.08.)
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

/// The median over the rounds of `column`'s ratio within a round (see [`RatioColumn`]), for
/// workload `w`; `None` if no round has a run of both sides.
fn paired_ratio(
    results: &Results,
    w: &'static str,
    column: &RatioColumn,
    metric: fn(&Sample) -> f64,
) -> Option<f64> {
    let runs = |a: &'static str| results.samples.get(&(w, a)).map_or(&[][..], Vec::as_slice);
    let ratios: Vec<f64> = runs(column.over)
        .iter()
        .filter_map(|over| {
            let best = column
                .under
                .iter()
                .flat_map(|u| runs(u).iter().filter(|s| s.round == over.round))
                .map(metric)
                .fold(f64::INFINITY, f64::min);
            (best.is_finite() && best > 0.0).then(|| metric(over) / best)
        })
        .collect();
    (!ratios.is_empty()).then(|| median(ratios))
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
            row.push(match paired_ratio(results, w.name, column, metric) {
                Some(r) => {
                    logs.push(r.ln());
                    format!("{r:.2}")
                }
                None => "-".into(),
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
    out += "\nRatio columns: the median over the rounds of the ratio within each round (paired \
            runs, so the machine's drift over minutes cancels); above 1, the first is slower. \
            `best(mi, je)` is the faster of mimalloc and jemalloc in that round.\n\n";
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

    /// Each round's ratio uses that round's runs only, against the faster of the `under`
    /// allocators in that round, and a round missing a side is left out.
    #[test]
    fn ratio_columns_pair_runs_by_round() {
        use crate::run::{Results, Sample};
        let sample = |ms: f64, round: usize| Sample {
            ms,
            cpu_ms: ms,
            peak_kib: 0,
            end_kib: 0,
            trim_kib: 0,
            trimmed: false,
            check: 0,
            round,
        };
        let mut results = Results::default();
        // A machine twice as slow in round 1: the medians' ratio would be 150 / 100.
        results.samples.insert(
            ("w", "tagalloc"),
            vec![sample(110.0, 0), sample(220.0, 1), sample(150.0, 2)],
        );
        results
            .samples
            .insert(("w", "mimalloc"), vec![sample(100.0, 0), sample(200.0, 1)]);
        results.samples.insert(
            ("w", "jemalloc"),
            vec![sample(120.0, 0), sample(180.0, 1), sample(100.0, 3)],
        );
        let column = super::RatioColumn {
            label: "",
            over: "tagalloc",
            under: &["mimalloc", "jemalloc"],
        };
        let r = super::paired_ratio(&results, "w", &column, |s| s.ms).unwrap();
        // Rounds 0 and 1: 110 / 100 and 220 / 180; round 2 has no `under` run.
        assert!((r - (1.1 + 220.0 / 180.0) / 2.0).abs() < 1e-12, "{r}");
        assert_eq!(super::paired_ratio(&results, "x", &column, |s| s.ms), None);
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
