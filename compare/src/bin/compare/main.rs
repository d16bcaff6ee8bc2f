//! The comparison driver: builds the workload binaries once per allocator, runs them
//! interleaved, and prints (and writes) the tables. `compare --help` lists the options.
//!
//! Each measurement is its own process so that one allocator's state (cached pages, thread
//! caches, a grown heap) never leaks into another's numbers and `VmHWM` is the workload's own
//! peak. Runs are interleaved (every round runs each workload once under every allocator, in
//! a new random order each time, after an untimed warm-up run of the same workload, so that
//! no allocator always follows the same neighbour or another workload's process) so
//! that background load on a shared machine hits every allocator alike, and medians are
//! reported so one disturbed run does not move the result.

mod build;
mod callgrind;
mod report;
mod run;

use std::path::PathBuf;
use std::process::ExitCode;

use compare::{allocator, workloads};

const HELP: &str = "\
compare: tagalloc vs System vs mimalloc vs jemalloc, one process per run, interleaved.

usage: compare [options]            run the workloads and print the tables
       compare callgrind [options]  instructions per small alloc+free under callgrind
       compare --list               list the workloads

options:
  --rounds N          rounds of interleaved runs (default 5, --quick: 2)
  --quick             smoke run: a tenth of the work, 2 rounds
  --scale F           multiply every workload's work by F (default 1, --quick: 0.1)
  --workloads a,b     only these workloads (default: all)
  --allocators a,b    only these allocators (default: tagalloc,system,mimalloc,jemalloc)
  --out FILE          also write the markdown report to FILE
                      (default: <target>/compare/report.md or callgrind.md)
  --no-build          use the binaries from the last build
  --timeout S         kill a run after S seconds and count it as failed (default 120)
  --n N               callgrind: alloc+free pairs per measurement (default 200000)
";

/// Command-line options shared by both modes.
pub struct Options {
    pub rounds: usize,
    pub scale: f64,
    pub workloads: Vec<&'static workloads::Workload>,
    pub allocators: Vec<&'static str>,
    pub out: Option<PathBuf>,
    pub build: bool,
    pub callgrind_n: usize,
    pub timeout_s: u64,
}

fn parse(args: &[String]) -> Result<Options, String> {
    let mut o = Options {
        rounds: 5,
        scale: 1.0,
        workloads: workloads::ALL.iter().collect(),
        allocators: allocator::ALL.to_vec(),
        out: None,
        build: true,
        callgrind_n: 200_000,
        timeout_s: 120,
    };
    let (mut rounds, mut scale) = (None, None);
    let mut quick = false;
    let mut it = args.iter();
    while let Some(arg) = it.next() {
        let mut value = || it.next().ok_or_else(|| format!("{arg} needs a value"));
        match arg.as_str() {
            "--quick" => quick = true,
            "--no-build" => o.build = false,
            "--rounds" => rounds = Some(value()?.parse().map_err(|_| "--rounds: not a number")?),
            "--scale" => scale = Some(value()?.parse().map_err(|_| "--scale: not a number")?),
            "--timeout" => {
                o.timeout_s = value()?.parse().map_err(|_| "--timeout: not a number")?;
            }
            "--n" => o.callgrind_n = value()?.parse().map_err(|_| "--n: not a number")?,
            "--out" => o.out = Some(PathBuf::from(value()?)),
            "--workloads" => {
                o.workloads = value()?
                    .split(',')
                    .map(|n| workloads::find(n).ok_or_else(|| format!("unknown workload {n:?}")))
                    .collect::<Result<_, _>>()?;
            }
            "--allocators" => {
                o.allocators = value()?
                    .split(',')
                    .map(|n| {
                        allocator::ALL
                            .iter()
                            .chain(&allocator::EXTRA)
                            .copied()
                            .find(|a| *a == n)
                            .ok_or_else(|| format!("unknown allocator {n:?}"))
                    })
                    .collect::<Result<_, _>>()?;
            }
            other => return Err(format!("unknown option {other:?}")),
        }
    }
    o.rounds = rounds.unwrap_or(if quick { 2 } else { 5 });
    o.scale = scale.unwrap_or(if quick { 0.1 } else { 1.0 });
    if o.rounds == 0 || o.scale <= 0.0 || o.callgrind_n == 0 {
        return Err("--rounds, --scale and --n must be positive".into());
    }
    if o.workloads.is_empty() || o.allocators.is_empty() {
        return Err("nothing to run".into());
    }
    Ok(o)
}

fn main() -> ExitCode {
    let mut args: Vec<String> = std::env::args().skip(1).collect();
    if args.iter().any(|a| a == "--help" || a == "-h") {
        print!("{HELP}");
        return ExitCode::SUCCESS;
    }
    if args.iter().any(|a| a == "--list") {
        for w in workloads::ALL {
            println!("{:<12} {}", w.name, w.about);
        }
        return ExitCode::SUCCESS;
    }
    let callgrind_mode = args.first().map(String::as_str) == Some("callgrind");
    if callgrind_mode {
        args.remove(0);
    }
    let opts = match parse(&args) {
        Ok(o) => o,
        Err(e) => {
            eprintln!("compare: {e}\n\n{HELP}");
            return ExitCode::FAILURE;
        }
    };
    let bins = match build::prepare(&opts.allocators, opts.build) {
        Ok(b) => b,
        Err(e) => {
            eprintln!("compare: {e}");
            return ExitCode::FAILURE;
        }
    };
    let result = if callgrind_mode {
        callgrind::main(&opts, &bins)
    } else {
        run::main(&opts, &bins)
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("compare: {e}");
            ExitCode::FAILURE
        }
    }
}
