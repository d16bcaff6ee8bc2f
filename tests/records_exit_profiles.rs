//! Profiles at exit without code: with `TAGALLOC_DHAT` and `TAGALLOC_PPROF` set, a program
//! gets a DHAT profile and a pprof heap profile when it exits; with records off they say
//! why they are empty; a path that cannot be written is said at start-up.
//!
//! Each case runs in a child process (this test binary re-executed with the environment
//! set before its first allocation), since the files are written at process exit.

mod common;

use allocator_api2::vec::Vec as AVec;
use common::pprof;
use common::viewers::{dh_view_text, scratch_dir};
use serde_json::Value;
use std::path::Path;
use std::process::{Command, Output};
use tagalloc::SystemAllocator;

#[global_allocator]
static GLOBAL: SystemAllocator = SystemAllocator::new();

tagalloc::allocator!(pub Renderer: child of SystemAllocator, "Renderer");

const CASE_VAR: &str = "TAGALLOC_EXIT_PROFILES_CASE";

/// Runs `case` in a child with `vars` set; asserts it exited cleanly.
fn run_child(case: &str, vars: &[(&str, &Path)], records: Option<&str>) -> Output {
    let mut command = Command::new(std::env::current_exe().unwrap());
    command
        .args([
            "child_entry_point",
            "--exact",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(CASE_VAR, case)
        .env_remove("TAGALLOC_RECORDS");
    for (k, v) in vars {
        command.env(k, v);
    }
    if let Some(records) = records {
        command.env("TAGALLOC_RECORDS", records);
    }
    let out = command.output().unwrap();
    assert!(
        out.status.success(),
        "child {case} failed:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

/// Leaks meshes through the `Renderer`.
#[inline(never)]
fn upload_meshes() {
    for i in 0..3 {
        let mut mesh = AVec::<u32, Renderer>::with_capacity_in(1250, Renderer);
        mesh.push(i);
        std::mem::forget(mesh);
    }
}

/// The child side: runs the case named in the environment, then exits normally.
#[test]
fn child_entry_point() {
    let Ok(case) = std::env::var(CASE_VAR) else {
        return; // Not a child: nothing to do.
    };
    eprintln!("child: started");
    match case.as_str() {
        "leak" => upload_meshes(),
        "off" => {
            let kept: Vec<String> = (0..100).map(|i| i.to_string()).collect();
            std::hint::black_box(kept);
        }
        other => panic!("unknown case {other}"),
    }
}

/// The DHAT profile's program points as (frames as text, the point).
fn dhat_points(json: &str) -> Vec<(Vec<String>, Value)> {
    let v: Value = serde_json::from_str(json).expect("valid JSON");
    assert_eq!(v["dhatFileVersion"], 2);
    assert_eq!(v["mode"], "rust-heap");
    for field in [
        "verb", "cmd", "pid", "tg", "te", "tu", "Mtu", "tuth", "bklt",
    ] {
        assert!(!v[field].is_null(), "{field} missing");
    }
    let ftbl = v["ftbl"].as_array().unwrap();
    assert_eq!(ftbl[0], "[root]");
    v["pps"]
        .as_array()
        .unwrap()
        .iter()
        .map(|pp| {
            for field in ["tb", "tbk", "tl", "mb", "mbk", "gb", "gbk", "eb", "ebk"] {
                assert!(pp[field].is_u64(), "{field} in {pp}");
            }
            let frames = pp["fs"]
                .as_array()
                .unwrap()
                .iter()
                .map(|f| {
                    ftbl[f.as_u64().unwrap() as usize]
                        .as_str()
                        .unwrap()
                        .to_string()
                })
                .collect();
            (frames, pp.clone())
        })
        .collect()
}

#[test]
fn the_environment_asks_for_profiles_written_at_exit() {
    let dir = scratch_dir("exit-profiles");
    let (dhat, heap) = (dir.join("dhat-heap.json"), dir.join("heap.pb.gz"));
    let out = run_child(
        "leak",
        &[("TAGALLOC_DHAT", &dhat), ("TAGALLOC_PPROF", &heap)],
        Some("Renderer=full,SystemAllocator=sample:64KiB"),
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains(&format!(
            "tagalloc: wrote the DHAT profile to {}\n",
            dhat.display()
        )) && stderr.contains(&format!(
            "tagalloc: wrote the pprof profile to {}\n",
            heap.display()
        )),
        "{stderr}"
    );

    // DHAT: the Renderer's leak under the allocator chain, at the leaking function.
    let points = dhat_points(&std::fs::read_to_string(&dhat).unwrap());
    // The Renderer's program points only (one, or one per call when the loop is unrolled):
    // the SystemAllocator's samples of the Renderer's blocks are the Renderer's, which
    // records them all.
    let at_meshes: Vec<_> = points
        .iter()
        .filter(|(frames, _)| frames.iter().any(|f| f.contains("upload_meshes")))
        .collect();
    assert!(
        !at_meshes.is_empty(),
        "no program point at the leaking call site"
    );
    for (frames, _) in &at_meshes {
        assert!(
            frames[0].contains("[allocator SystemAllocator]"),
            "{frames:?}"
        );
        assert!(frames[1].contains("[allocator Renderer]"), "{frames:?}");
    }
    let live: u64 = at_meshes
        .iter()
        .map(|(_, pp)| pp["ebk"].as_u64().unwrap())
        .sum();
    assert_eq!(live, 3, "{at_meshes:?}");

    // pprof: decoded here, then read by the pprof tool itself.
    let profile = std::fs::read(&heap).unwrap();
    let decoded = pprof::decode(&profile);
    assert_eq!(decoded.sample_types[3], "inuse_space/bytes");
    assert_eq!(decoded.period, ("space/bytes".to_string(), 64 * 1024));
    assert_eq!(decoded.total(2, Some(("allocator", "Renderer"))), 3);
    assert!(decoded.total(3, Some(("allocator", "Renderer"))) >= 3 * 5000);
    if pprof::go_pprof_installed() {
        let top = pprof::go_pprof(&["-top", "-tagfocus=allocator=Renderer"], &heap);
        assert!(top.contains("upload_meshes"), "{top}");
        let tags = pprof::go_pprof(&["-tags"], &heap);
        assert!(tags.contains("): Renderer"), "{tags}");
        assert!(tags.contains("): SystemAllocator"), "{tags}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn profiles_written_with_records_off_say_why_they_are_empty() {
    let dir = scratch_dir("exit-profiles-off");
    let (dhat, heap) = (dir.join("dhat-heap.json"), dir.join("heap.pb.gz"));
    let out = run_child(
        "off",
        &[("TAGALLOC_DHAT", &dhat), ("TAGALLOC_PPROF", &heap)],
        None,
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    for (what, path) in [("DHAT", &dhat), ("pprof", &heap)] {
        assert!(
            stderr.contains(&format!(
                "tagalloc: wrote an empty {what} profile to {}: no allocation records: \
                 records are off in every allocator",
                path.display()
            )),
            "{stderr}"
        );
    }

    let json = std::fs::read_to_string(&dhat).unwrap();
    let points = dhat_points(&json);
    assert_eq!(points.len(), 1, "{points:?}");
    assert!(
        points[0].0[0].contains("records are off in every allocator"),
        "{points:?}"
    );
    assert_eq!(points[0].1["tbk"], 0);
    if let Some(text) = dh_view_text(&json) {
        assert!(
            text.contains("records are off in every allocator"),
            "{text}"
        );
    }

    let profile = std::fs::read(&heap).unwrap();
    let decoded = pprof::decode(&profile);
    assert!(decoded.samples.is_empty());
    assert!(
        decoded
            .comments
            .iter()
            .any(|c| c.contains("records are off in every allocator")),
        "{:?}",
        decoded.comments
    );
    if pprof::go_pprof_installed() {
        let comments = pprof::go_pprof(&["-comments"], &heap);
        assert!(
            comments.contains("records are off in every allocator"),
            "{comments}"
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn an_exit_file_that_cannot_be_written_is_said_at_start_up() {
    let dir = scratch_dir("exit-profiles-bad");
    let missing = dir.join("no-such-directory");
    let (report, heap) = (missing.join("report.txt"), missing.join("heap.pb.gz"));
    let out = run_child(
        "off",
        &[
            ("TAGALLOC_REPORT", &report),
            ("TAGALLOC_DHAT", &dir), // a directory
            ("TAGALLOC_PPROF", &heap),
        ],
        None,
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    let started = stderr.find("child: started").expect("the child ran");
    let (before, after) = stderr.split_at(started);
    let warnings: Vec<&str> = before
        .lines()
        .filter(|l| l.starts_with("tagalloc:"))
        .collect();
    assert_eq!(warnings.len(), 3, "{stderr}");
    let m = missing.display();
    assert_eq!(
        warnings[0],
        format!(
            "tagalloc: TAGALLOC_REPORT={} cannot be written: {m}: No such file or directory \
             (checked at start-up; it is tried again at exit)",
            report.display()
        )
    );
    assert_eq!(
        warnings[1],
        format!(
            "tagalloc: TAGALLOC_DHAT={} cannot be written: it is a directory \
             (checked at start-up; it is tried again at exit)",
            dir.display()
        )
    );
    assert!(
        warnings[2].starts_with(&format!(
            "tagalloc: TAGALLOC_PPROF={} cannot be written: {m}: ",
            heap.display()
        )),
        "{}",
        warnings[2]
    );
    // And at exit, each says it could not be written.
    for what in ["the exit report", "the DHAT profile", "the pprof profile"] {
        assert!(
            after.contains(&format!("tagalloc: could not write {what} to ")),
            "{stderr}"
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
}
