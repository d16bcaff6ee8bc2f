//! The exit report: with `TAGALLOC_RECORDS` and `TAGALLOC_REPORT` set, a program that leaks
//! gets, when it exits, a report naming the function that leaked; bad settings print one
//! line and are otherwise ignored.
//!
//! Each case runs in a child process (this test binary re-executed with the environment
//! set before its first allocation), since the report is written at process exit.

use allocator_api2::boxed::Box as ABox;
use std::path::PathBuf;
use std::process::{Command, Output};
use tagalloc::SystemAllocator;

#[global_allocator]
static GLOBAL: SystemAllocator = SystemAllocator::new();

tagalloc::allocator!(pub LeakyLoader: child of SystemAllocator, "Leaky Loader");
tagalloc::allocator!(pub TidyLoader: child of SystemAllocator, "Tidy Loader");
tagalloc::allocator!(pub ScopedLeaker: child of SystemAllocator, "Scoped Leaker");

const CASE_VAR: &str = "TAGALLOC_RECORDS_EXIT_CASE";

fn run_child(case: &str, records: &str, report: Option<&PathBuf>) -> Output {
    let mut command = Command::new(std::env::current_exe().unwrap());
    command
        .args([
            "child_entry_point",
            "--exact",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(CASE_VAR, case)
        .env("TAGALLOC_RECORDS", records);
    if let Some(path) = report {
        command.env("TAGALLOC_REPORT", path);
    }
    let out = command.output().unwrap();
    assert!(
        out.status.success(),
        "child {case} failed:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

/// Leaks three blocks: two in `LeakyLoader`, one through the global allocator.
#[inline(never)]
fn load_level_and_forget_to_free_it() {
    let level = ABox::new_in([0x5au8; 300], LeakyLoader);
    std::mem::forget(level);
    let mut names = allocator_api2::vec::Vec::with_capacity_in(77, LeakyLoader);
    names.push(1u64);
    std::mem::forget(names);
    let cache: Vec<u8> = Vec::with_capacity(4321);
    std::mem::forget(cache);
}

/// Leaks std containers inside `ScopedLeaker`'s scoped tag: a vector of 555 bytes and one
/// of 70,000 (a large block).
#[inline(never)]
fn leak_std_containers_inside_a_scope() {
    ScopedLeaker.scope(|| {
        std::mem::forget(Vec::<u8>::with_capacity(555));
        std::mem::forget(Vec::<u8>::with_capacity(70_000));
        drop(String::from("freed: no leak"));
    });
}

/// Allocates and frees: nothing of it may appear as a leak.
#[inline(never)]
fn load_and_free_properly() {
    let level = ABox::new_in([0u8; 500], TidyLoader);
    drop(level);
}

/// The child side: runs the case named in the environment, then exits normally.
#[test]
fn child_entry_point() {
    let Ok(case) = std::env::var(CASE_VAR) else {
        return; // Not a child: nothing to do.
    };
    match case.as_str() {
        "leak" => {
            load_level_and_forget_to_free_it();
            load_and_free_properly();
        }
        "bad_settings" => {
            // The valid entry still applies, the bad one is off.
            assert_eq!(TidyLoader.record_mode(), tagalloc::RecordMode::Basic);
            assert_eq!(LeakyLoader.record_mode(), tagalloc::RecordMode::Off);
            load_level_and_forget_to_free_it();
        }
        "scoped_leak" => leak_std_containers_inside_a_scope(),
        "busy" => threads_allocate_while_reports_are_written(),
        "fork" => fork_while_threads_record(),
        other => panic!("unknown case {other}"),
    }
}

/// With the global allocator recording full stacks, worker threads allocate through it
/// while this thread writes every report (which allocates through it too, unrecorded).
fn threads_allocate_while_reports_are_written() {
    use std::sync::atomic::{AtomicBool, Ordering};
    static STOP: AtomicBool = AtomicBool::new(false);
    let workers: Vec<_> = (0..3)
        .map(|t| {
            std::thread::spawn(move || {
                let mut kept: Vec<String> = Vec::new();
                let mut i = 0usize;
                while !STOP.load(Ordering::Relaxed) || i < 3000 {
                    kept.push(format!("{t}-{i}"));
                    if kept.len() > 100 {
                        kept.swap_remove(i % 100);
                    }
                    i += 1;
                }
                kept.len()
            })
        })
        .collect();
    for _ in 0..3 {
        let mut sink = Vec::new();
        tagalloc::report::dump_records(&mut sink).unwrap();
        tagalloc::report::dump_leaks(&mut sink).unwrap();
        assert!(!tagalloc::report::dhat_profile().is_empty());
        assert!(!sink.is_empty());
    }
    STOP.store(true, Ordering::Relaxed);
    for w in workers {
        assert_eq!(w.join().unwrap(), 100);
    }
    println!("busy: done");
}

/// `fork()` while other threads record: the child (only the forking thread survives) must
/// find every records lock free, allocate with records, and take a snapshot.
fn fork_while_threads_record() {
    use std::sync::atomic::{AtomicBool, Ordering};
    static STOP: AtomicBool = AtomicBool::new(false);
    let workers: Vec<_> = (0..2)
        .map(|t| {
            std::thread::spawn(move || {
                let mut kept: Vec<Vec<u8>> = Vec::new();
                let mut i = 0usize;
                while !STOP.load(Ordering::Relaxed) {
                    kept.push(vec![t as u8; 1 + (i * 97) % 5000]);
                    if kept.len() > 50 {
                        kept.drain(..25);
                    }
                    i += 1;
                }
            })
        })
        .collect();
    for _ in 0..30 {
        // SAFETY: fork has no preconditions; the child allocates, reads records and exits.
        let pid = unsafe { libc::fork() };
        assert!(pid >= 0, "fork failed");
        if pid == 0 {
            // SAFETY: a deadlocked child is killed instead of hanging the test.
            unsafe { libc::alarm(20) };
            let v: Vec<String> = (0..500).map(|i| format!("child {i}")).collect();
            let snapshot = tagalloc::records::snapshot();
            let ok = v.len() == 500 && snapshot.records_of("SystemAllocator").count() > 500;
            // SAFETY: `_exit` ends the child without running the parent's atexit handlers.
            unsafe { libc::_exit(if ok { 0 } else { 1 }) };
        }
        let mut status = 0;
        // SAFETY: `pid` is our child; `status` is writable.
        assert_eq!(unsafe { libc::waitpid(pid, &mut status, 0) }, pid);
        assert!(
            libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0,
            "forked child failed: status {status}"
        );
    }
    STOP.store(true, Ordering::Relaxed);
    for w in workers {
        w.join().unwrap();
    }
    println!("fork: done");
}

#[test]
fn fork_while_other_threads_record_leaves_the_child_usable() {
    let out = run_child("fork", "SystemAllocator=full:4", None);
    assert!(String::from_utf8_lossy(&out.stdout).contains("fork: done"));
}

#[test]
fn the_global_allocator_records_while_reports_are_written() {
    let out = run_child("busy", "SystemAllocator=full:6", None);
    assert!(String::from_utf8_lossy(&out.stdout).contains("busy: done"));
}

fn report_path(name: &str) -> PathBuf {
    std::env::temp_dir().join(format!("tagalloc-exit-{}-{name}.txt", std::process::id()))
}

#[test]
fn a_deliberate_leak_appears_in_the_exit_report_with_its_call_site() {
    let path = report_path("leak");
    let _ = std::fs::remove_file(&path);
    let out = run_child(
        "leak",
        "leaky loader=full, TidyLoader=full, SystemAllocator=full:12",
        Some(&path),
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains(&format!(
            "tagalloc: wrote the exit report to {}",
            path.display()
        )),
        "{stderr}"
    );
    let report = std::fs::read_to_string(&path).unwrap();
    let _ = std::fs::remove_file(&path);

    // The allocator table comes first, then the leaks.
    assert!(report.contains("Index,Name,Used KiB,Reserved KiB,Consumed KiB,Parent Allocator"));
    let leaks = &report[report.find("-- Leaks --").expect("a leaks section")..];

    // LeakyLoader: exactly the two blocks leaked, both at the leaking function.
    let leaky = section(leaks, "LeakyLoader:");
    assert!(leaky.starts_with("LeakyLoader: "), "{leaky}");
    assert!(
        leaky
            .lines()
            .next()
            .unwrap()
            .ends_with(" in 2 blocks at 2 call sites"),
        "{leaky}"
    );
    assert_eq!(
        leaky.matches("load_level_and_forget_to_free_it").count(),
        2,
        "{leaky}"
    );
    assert!(
        leaky.contains("(300 B)") && leaky.contains("(616 B)"),
        "{leaky}"
    );
    // The allocator's own frames are trimmed: the leaking function is the first frame.
    let lines: Vec<&str> = leaky.lines().collect();
    let site_headers: Vec<usize> = (0..lines.len())
        .filter(|&i| lines[i].starts_with("  ") && !lines[i].starts_with("   "))
        .collect();
    assert_eq!(site_headers.len(), 2, "{leaky}");
    for i in site_headers {
        let first = lines[i + 1];
        assert!(
            first.trim_start().starts_with("#1 ")
                && first.contains("load_level_and_forget_to_free_it"),
            "{leaky}"
        );
    }
    // Nothing of TidyLoader is live.
    assert!(!leaks.contains("TidyLoader:"), "{leaks}");
    // The global allocator's leak (and the LeakyLoader blocks, which are its blocks too).
    let system = section(leaks, "SystemAllocator:");
    assert!(system.contains("(4321 B)"), "{system}");
    assert!(
        system.contains("load_level_and_forget_to_free_it"),
        "{system}"
    );
}

/// The part of the leak report about one allocator: its header line and the indented
/// lines after it.
fn section<'a>(leaks: &'a str, header: &str) -> &'a str {
    let start = leaks
        .find(&format!("\n{header}"))
        .unwrap_or_else(|| panic!("no {header} in\n{leaks}"))
        + 1;
    let rest = &leaks[start..];
    let mut end = rest.find('\n').unwrap_or(rest.len());
    while end < rest.len() && rest[end + 1..].starts_with(' ') {
        end += 1 + rest[end + 1..].find('\n').unwrap_or(rest.len() - end - 1);
    }
    &rest[..end]
}

#[test]
fn a_scoped_tags_std_leaks_appear_at_their_call_site() {
    let path = report_path("scoped_leak");
    let _ = std::fs::remove_file(&path);
    run_child("scoped_leak", "ScopedLeaker=full", Some(&path));
    let report = std::fs::read_to_string(&path).unwrap();
    let _ = std::fs::remove_file(&path);
    let leaks = &report[report.find("-- Leaks --").expect("a leaks section")..];
    let leaker = section(leaks, "ScopedLeaker:");
    assert!(
        leaker
            .lines()
            .next()
            .unwrap()
            .ends_with(" in 2 blocks at 2 call sites"),
        "{leaker}"
    );
    assert!(
        leaker.contains("(555 B)") && leaker.contains("(70000 B)"),
        "{leaker}"
    );
    // The allocator's frames (the global allocator's, the scope's, the child's) are trimmed:
    // the leaking function is the first frame shown of each site.
    let lines: Vec<&str> = leaker.lines().collect();
    let sites: Vec<usize> = (0..lines.len())
        .filter(|&i| lines[i].starts_with("  ") && !lines[i].starts_with("   "))
        .collect();
    assert_eq!(sites.len(), 2, "{leaker}");
    for i in sites {
        let first = lines[i + 1];
        assert!(
            first.trim_start().starts_with("#1 ")
                && first.contains("leak_std_containers_inside_a_scope"),
            "{leaker}"
        );
    }
}

#[test]
fn bad_and_unknown_settings_warn_once_and_do_not_abort() {
    let out = run_child(
        "bad_settings",
        // `TidyLoader=full` is overridden by the later entry naming it by its description:
        // not an unknown name either.
        "TidyLoader=full, LeakyLoader=fulll, Tidy Loader=basic, NoSuchAllocator=full, =basic",
        None,
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    let warnings: Vec<&str> = stderr
        .lines()
        .filter(|l| l.starts_with("tagalloc:"))
        .collect();
    assert_eq!(warnings.len(), 2, "{stderr}");
    assert!(
        warnings[0].contains("TAGALLOC_RECORDS entry \"LeakyLoader=fulll\" ignored: unknown mode")
            && warnings[0].contains("(and 1 more bad entries)"),
        "{}",
        warnings[0]
    );
    assert!(
        warnings[1].contains("names no allocator that registered: \"NoSuchAllocator\" ("),
        "{}",
        warnings[1]
    );
}
