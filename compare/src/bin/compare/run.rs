//! The interleaved runs of the workloads and the collection of their result lines.

use std::collections::BTreeMap;
use std::fs::File;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use compare::rng::Rng;

use crate::Options;
use crate::build::{self, Bins};
use crate::report;

/// One measured run of one workload under one allocator.
#[derive(Clone, Debug)]
pub struct Sample {
    pub ms: f64,
    pub cpu_ms: f64,
    pub peak_kib: u64,
    pub end_kib: u64,
    pub trim_kib: u64,
    pub trimmed: bool,
    pub check: u64,
    /// The round the run belongs to (0-based): the ratio columns pair runs of one round.
    pub round: usize,
}

/// Every sample, by workload then allocator, plus what went wrong.
#[derive(Default)]
pub struct Results {
    pub samples: BTreeMap<(&'static str, &'static str), Vec<Sample>>,
    pub failures: Vec<String>,
    /// Warnings the binaries printed (for example that tagalloc is a stand-in).
    pub notes: Vec<String>,
}

/// Parses the `RESULT key=value ...` line of a workload run.
fn parse_result(stdout: &str) -> Option<Sample> {
    let line = stdout.lines().find(|l| l.starts_with("RESULT "))?;
    let field = |key: &str| {
        line.split_whitespace()
            .find_map(|kv| kv.strip_prefix(key)?.strip_prefix('='))
    };
    Some(Sample {
        ms: field("ms")?.parse().ok()?,
        cpu_ms: field("cpu_ms")?.parse().ok()?,
        peak_kib: field("peak_kib")?.parse().ok()?,
        end_kib: field("end_kib")?.parse().ok()?,
        trim_kib: field("trim_kib")?.parse().ok()?,
        trimmed: field("trimmed")? == "1",
        check: field("check")?.parse().ok()?,
        round: 0,
    })
}

/// Runs one workload in a fresh process, killing it after `timeout` (a deadlocked allocator
/// must not hang the whole comparison). Its output goes to files rather than pipes so a
/// chatty failure cannot block on a full pipe while we wait.
fn run_one(
    bins: &Bins,
    alloc: &str,
    workload: &str,
    scale: f64,
    timeout: Duration,
) -> Result<(Sample, String), String> {
    let fail = |e: String| format!("{workload}/{alloc}: {e}");
    let (out_path, err_path) = (bins.dir.join("run.stdout"), bins.dir.join("run.stderr"));
    let out_file = File::create(&out_path).map_err(|e| fail(e.to_string()))?;
    let err_file = File::create(&err_path).map_err(|e| fail(e.to_string()))?;
    let mut child = Command::new(bins.workload(alloc))
        .args([workload, "--scale", &scale.to_string()])
        .stdin(Stdio::null())
        .stdout(out_file)
        .stderr(err_file)
        .spawn()
        .map_err(|e| fail(format!("cannot start: {e}")))?;
    let started = Instant::now();
    let status = loop {
        if let Some(status) = child.try_wait().map_err(|e| fail(e.to_string()))? {
            break status;
        }
        if started.elapsed() > timeout {
            let _ = child.kill();
            let _ = child.wait();
            return Err(fail(format!("killed after {} s", timeout.as_secs())));
        }
        std::thread::sleep(Duration::from_millis(5));
    };
    let stdout = std::fs::read_to_string(&out_path).unwrap_or_default();
    let stderr = std::fs::read_to_string(&err_path)
        .unwrap_or_default()
        .trim()
        .to_string();
    if !status.success() {
        return Err(fail(format!("{status} {stderr}")));
    }
    let sample =
        parse_result(&stdout).ok_or_else(|| fail(format!("no result line in {stdout:?}")))?;
    Ok((sample, stderr))
}

/// Puts `items` in a random order (Fisher-Yates).
fn shuffle<T>(items: &mut [T], rng: &mut Rng) {
    for i in (1..items.len()).rev() {
        items.swap(i, rng.below(i + 1));
    }
}

/// Runs every selected workload under every selected allocator for `opts.rounds` rounds,
/// then prints the report and writes it to a file.
pub fn main(opts: &Options, bins: &Bins) -> Result<(), String> {
    let mut results = Results::default();
    // A fixed seed: the same order of runs for the same options, run after run.
    let mut order_rng = Rng::new(0x0DE5_0C0A);
    for round in 0..opts.rounds {
        for w in &opts.workloads {
            let mut line = format!("round {}/{} {:<12}", round + 1, opts.rounds, w.name);
            // A new random order for every workload of every round: a rotation, used until
            // 2026-12-03, kept each allocator's predecessor the same in every round.
            let mut order = opts.allocators.clone();
            shuffle(&mut order, &mut order_rng);
            // An untimed warm-up run first, so that every timed run follows a run of the
            // same workload. The first run after another workload's process can be far
            // slower: in `fragment`, where about half the time is the kernel's page faults,
            // the first run of each round took 250-310 ms and the others 160-200 ms, whatever
            // the allocator (2026-12-03, 11 rounds).
            if let Err(e) = run_one(
                bins,
                order[0],
                w.name,
                opts.scale,
                Duration::from_secs(opts.timeout_s),
            ) {
                results.failures.push(e);
            }
            for alloc in order {
                match run_one(
                    bins,
                    alloc,
                    w.name,
                    opts.scale,
                    Duration::from_secs(opts.timeout_s),
                ) {
                    Ok((mut s, stderr)) => {
                        s.round = round;
                        line += &format!(" {alloc} {:.0}ms", s.ms);
                        for note in stderr.lines().filter_map(|l| l.strip_prefix("warning: ")) {
                            let note = format!("{alloc}: {note}");
                            if !results.notes.contains(&note) {
                                results.notes.push(note);
                            }
                        }
                        results.samples.entry((w.name, alloc)).or_default().push(s);
                    }
                    Err(e) => {
                        line += &format!(" {alloc} FAILED");
                        results.failures.push(e);
                    }
                }
            }
            eprintln!("{line}");
        }
    }

    // Every run of a workload must have computed the same checksum, whatever the allocator.
    for w in &opts.workloads {
        let checks: Vec<(&str, u64)> = opts
            .allocators
            .iter()
            .flat_map(|a| {
                results
                    .samples
                    .get(&(w.name, *a))
                    .into_iter()
                    .flatten()
                    .map(|s| (*a, s.check))
            })
            .collect();
        let Some(&(_, first)) = checks.first() else {
            continue;
        };
        if let Some((a, c)) = checks.iter().find(|(_, c)| *c != first) {
            results.failures.push(format!(
                "{}: checksum {c} under {a} differs from {first}",
                w.name
            ));
        }
    }

    let text = report::render(opts, &results, &build::source_version(&bins.root));
    print!("{text}");
    let path = opts
        .out
        .clone()
        .unwrap_or_else(|| bins.dir.join("report.md"));
    std::fs::write(&path, &text).map_err(|e| format!("writing {}: {e}", path.display()))?;
    eprintln!("report written to {}", path.display());
    if results.failures.is_empty() {
        Ok(())
    } else {
        Err(format!(
            "{} run(s) failed or disagreed; see the report",
            results.failures.len()
        ))
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn parses_a_result_line() {
        let s = super::parse_result(
            "noise\nRESULT workload=small alloc=system ms=12.5 cpu_ms=20 peak_kib=10 end_kib=4 trim_kib=3 trimmed=1 check=99\n",
        )
        .unwrap();
        assert_eq!(
            (s.ms, s.peak_kib, s.end_kib, s.trim_kib, s.trimmed, s.check),
            (12.5, 10, 4, 3, true, 99)
        );
        assert!(super::parse_result("RESULT ms=1").is_none());
    }
}
