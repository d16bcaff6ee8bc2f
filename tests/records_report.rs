//! Records and their reports, in one process with no global allocator of tagalloc's: the
//! handles record through their own hooks. Each test uses allocators of its own, since the
//! record table is process-wide.

use allocator_api2::boxed::Box as ABox;
use allocator_api2::vec::Vec as AVec;
use serde_json::Value;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Duration;
use tagalloc::records::{self, RecordMode, RecordsSnapshot};
use tagalloc::{SystemAllocator, report};

tagalloc::allocator!(DhatChild: child of SystemAllocator, "DHAT child");
tagalloc::allocator!(JsonChild: child of SystemAllocator, "JSON child");
tagalloc::allocator!(BusyChild: child of SystemAllocator, "Busy child");
tagalloc::allocator!(BusyPool: thread_pool of SystemAllocator, "Busy thread pool");
tagalloc::allocator!(RangeChild: child of SystemAllocator, "Range child");
tagalloc::allocator!(SampledChild: child of SystemAllocator, "Sampled child");
tagalloc::allocator!(ToggledChild: child of SystemAllocator, "Toggled child");
tagalloc::allocator!(ReallocPool: pool of SystemAllocator, "Realloc pool");
tagalloc::allocator!(ReallocChild: child of SystemAllocator, "Realloc child");
tagalloc::allocator!(TableChild: child of SystemAllocator, "Table child");

#[inline(never)]
fn make_meshes(n: usize) -> Vec<AVec<u32, DhatChild>> {
    (0..n)
        .map(|i| {
            let mut v = AVec::with_capacity_in(100 + i, DhatChild);
            v.push(i as u32);
            v
        })
        .collect()
}

#[inline(never)]
fn make_scratch(n: usize) {
    for i in 0..n {
        let b = ABox::new_in([i as u8; 64], DhatChild);
        std::hint::black_box(&b);
    }
}

/// The DHAT profile has the fields and structure DHAT's viewer reads, as dhat-rs writes
/// them: top-level metadata, program points with tb/tbk/tl/mb/mbk/gb/gbk/eb/ebk/fs, and a
/// frame table whose entry 0 is "[root]".
#[test]
// Checks resolved file:line in frames, which needs the debug info of the default test profile.
#[cfg_attr(
    not(debug_assertions),
    ignore = "needs debug info (file:line in resolved frames)"
)]
fn the_dhat_profile_has_the_fields_dhats_viewer_reads() {
    DhatChild.set_records(RecordMode::full());
    let meshes = make_meshes(10);
    make_scratch(25);
    let json = report::dhat_profile();
    let v: Value = serde_json::from_str(&json).expect("valid JSON");

    assert_eq!(v["dhatFileVersion"], 2);
    assert_eq!(v["mode"], "rust-heap");
    assert_eq!(v["verb"], "Allocated");
    assert_eq!(v["bklt"], true);
    assert_eq!(v["bkacc"], false);
    assert_eq!(v["tu"], "µs");
    assert_eq!(v["Mtu"], "s");
    assert_eq!(v["tuth"], 10);
    assert!(v["cmd"].is_string());
    assert_eq!(v["pid"], std::process::id());
    let (tg, te) = (v["tg"].as_u64().unwrap(), v["te"].as_u64().unwrap());
    assert!(tg <= te);
    let ftbl = v["ftbl"].as_array().unwrap();
    assert_eq!(ftbl[0], "[root]");
    assert!(ftbl.iter().all(Value::is_string));
    let pps = v["pps"].as_array().unwrap();
    assert!(!pps.is_empty());
    for pp in pps {
        for field in ["tb", "tbk", "tl", "mb", "mbk", "gb", "gbk", "eb", "ebk"] {
            assert!(pp[field].is_u64(), "{field} in {pp}");
        }
        let n = |f: &str| pp[f].as_u64().unwrap();
        assert!(
            n("eb") <= n("tb") && n("ebk") <= n("tbk") && n("mb") <= n("tb"),
            "{pp}"
        );
        assert!(n("eb") <= n("mb") && n("gb") <= n("tb"), "{pp}");
        let fs = pp["fs"].as_array().unwrap();
        assert!(!fs.is_empty());
        for f in fs {
            let i = f.as_u64().unwrap() as usize;
            assert!(i > 0 && i < ftbl.len(), "frame index {i}");
        }
    }
    // The meshes: 10 blocks live and allocated; the scratch boxes: 25 allocated, 0 live.
    let frames_of = |pp: &Value| -> Vec<String> {
        pp["fs"]
            .as_array()
            .unwrap()
            .iter()
            .map(|f| {
                ftbl[f.as_u64().unwrap() as usize]
                    .as_str()
                    .unwrap()
                    .to_string()
            })
            .collect()
    };
    let point = |function: &str| {
        pps.iter()
            .find(|pp| {
                let frames = frames_of(pp);
                frames.iter().any(|f| f.contains(function))
                    && frames[1].contains("[allocator DhatChild]")
            })
            .unwrap_or_else(|| panic!("no program point at {function}"))
    };
    let meshes_pp = point("make_meshes");
    assert_eq!(
        (meshes_pp["tbk"].as_u64(), meshes_pp["ebk"].as_u64()),
        (Some(10), Some(10))
    );
    let scratch_pp = point("make_scratch");
    assert_eq!(
        (scratch_pp["tbk"].as_u64(), scratch_pp["ebk"].as_u64()),
        (Some(25), Some(0))
    );
    assert_eq!(scratch_pp["tb"].as_u64(), Some(25 * 64));
    // The viewer's tree splits on the first frames: the allocator chain, outermost first.
    assert!(frames_of(scratch_pp)[0].contains("[allocator SystemAllocator]"));
    // Frames look like dhat-rs's: "0x…: name (file:line:column)".
    let f = frames_of(scratch_pp)[2].clone();
    assert!(
        f.starts_with("0x") && f.contains(": ") && f.contains("records_report.rs:"),
        "{f}"
    );
    drop(meshes);
}

#[inline(never)]
fn make_documents() -> Vec<AVec<u8, JsonChild>> {
    (0..5)
        .map(|i| AVec::with_capacity_in(10 * (i + 1), JsonChild))
        .collect()
}

/// The JSON dump parses with serde_json and gives back every field of every record.
#[test]
// Checks resolved file:line in frames, which needs the debug info of the default test profile.
#[cfg_attr(
    not(debug_assertions),
    ignore = "needs debug info (file:line in resolved frames)"
)]
fn the_json_record_dump_round_trips_through_serde_json() {
    JsonChild.set_records(RecordMode::Full { frames: 3 });
    let docs = make_documents();
    let mut snapshot = records::snapshot();
    snapshot.resolve();
    let json = snapshot.to_json();
    let v: Value = serde_json::from_str(&json).expect("valid JSON");
    let parsed: Vec<records::Record> = v["records"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| records::Record {
            allocator: snapshot
                .records
                .iter()
                .find(|x| x.allocator == r["allocator"].as_str().unwrap())
                .unwrap()
                .allocator,
            allocator_index: r["allocator_index"].as_u64().unwrap() as usize,
            address: r["address"].as_u64().unwrap() as usize,
            size: r["size"].as_u64().unwrap() as usize,
            requested: r["requested"].as_u64().unwrap() as usize,
            align: r["align"].as_u64().unwrap() as usize,
            thread: r["thread"].as_u64().unwrap() as u32,
            time_us: r["time_us"].as_u64().unwrap(),
            weight: r["weight"].as_f64().unwrap(),
            sampled: r["sampled"].as_bool().unwrap(),
            stack: r["stack"].as_u64().unwrap() as u32,
        })
        .collect();
    assert_eq!(parsed, snapshot.records);
    // And back: the parsed document serialises to the same value.
    let again: Value = serde_json::from_str(&serde_json::to_string(&v).unwrap()).unwrap();
    assert_eq!(again, v);

    let mine: Vec<_> = snapshot.records_of("JsonChild").collect();
    assert_eq!(mine.len(), 5);
    let stacks = v["stacks"].as_array().unwrap();
    for r in &mine {
        let s = stacks
            .iter()
            .find(|s| s["id"].as_u64() == Some(u64::from(r.stack)))
            .expect("the record's stack is in the dump");
        let frames = s["frames"].as_array().unwrap();
        assert!(!frames.is_empty() && frames.len() <= 3);
        let first = &frames[0]["symbols"][0];
        assert!(
            first["name"].as_str().unwrap().contains("make_documents"),
            "{first}"
        );
        assert!(first["line"].is_u64());
    }
    let site = v["sites"]
        .as_array()
        .unwrap()
        .iter()
        .find(|s| s["allocator"] == "JsonChild")
        .unwrap();
    assert_eq!(site["live_blocks"].as_f64(), Some(5.0));
    drop(docs);
}

/// Threads allocate and free (recording with stacks and without) while another thread
/// writes every report over and over: nothing deadlocks, and the records end exact.
#[test]
fn recording_never_deadlocks_while_another_thread_writes_reports() {
    BusyChild.set_records(RecordMode::Full { frames: 6 });
    BusyPool.set_records(RecordMode::Basic);
    let done = Arc::new(AtomicBool::new(false));
    // A watchdog: a deadlock fails the test instead of hanging it.
    {
        let done = Arc::clone(&done);
        std::thread::spawn(move || {
            for _ in 0..1200 {
                std::thread::sleep(Duration::from_millis(100));
                if done.load(Ordering::Relaxed) {
                    return;
                }
            }
            eprintln!("records_report: no progress for 120 s: deadlock");
            std::process::abort();
        });
    }
    let stop = Arc::new(AtomicBool::new(false));
    let reports = Arc::new(AtomicUsize::new(0));
    let reporter = {
        let (stop, reports) = (Arc::clone(&stop), Arc::clone(&reports));
        std::thread::spawn(move || {
            while !stop.load(Ordering::Relaxed) || reports.load(Ordering::Relaxed) < 3 {
                let mut sink = Vec::new();
                report::dump_records(&mut sink).unwrap();
                report::dump_call_sites(&mut sink).unwrap();
                report::dump_leaks(&mut sink).unwrap();
                let _ = report::dhat_profile();
                let _ = report::records_json();
                report::write_exit_report(&mut sink).unwrap();
                reports.fetch_add(1, Ordering::Relaxed);
            }
        })
    };
    let workers: Vec<_> = (0..3)
        .map(|t| {
            std::thread::spawn(move || {
                let mut kept: Vec<AVec<u8, BusyChild>> = Vec::new();
                let mut pooled: Vec<ABox<[u8; 48], BusyPool>> = Vec::new();
                for i in 0..4000 {
                    let mut v = AVec::with_capacity_in(8 + (i * 13 + t) % 900, BusyChild);
                    v.push(i as u8);
                    if i % 3 == 0 {
                        v.reserve(2000); // a realloc
                    }
                    kept.push(v);
                    pooled.push(ABox::new_in([t as u8; 48], BusyPool));
                    if kept.len() > 50 {
                        kept.swap_remove((i * 7) % kept.len());
                        pooled.swap_remove((i * 5) % pooled.len());
                    }
                }
                (kept, pooled)
            })
        })
        .collect();
    let held: Vec<_> = workers.into_iter().map(|w| w.join().unwrap()).collect();
    stop.store(true, Ordering::Relaxed);
    reporter.join().unwrap();
    done.store(true, Ordering::Relaxed);
    assert!(reports.load(Ordering::Relaxed) >= 3);

    let child_blocks: usize = held.iter().map(|(k, _)| k.len()).sum();
    let pool_blocks: usize = held.iter().map(|(_, p)| p.len()).sum();
    let totals = records::live_totals(BusyChild::registration());
    assert_eq!(totals.records, child_blocks);
    assert_eq!(totals.records, BusyChild.stats().live_blocks);
    assert_eq!(totals.bytes, BusyChild.stats().live_granted_bytes);
    assert_eq!(
        records::live_totals(BusyPool::registration()).records,
        pool_blocks
    );
    drop(held);
    assert_eq!(records::live_totals(BusyChild::registration()).records, 0);
}

/// O3DE's `sys_DumpAllocationRecordsInRange`: only the records of blocks in the range.
#[test]
fn the_records_dump_lists_a_range_with_its_fields() {
    RangeChild.set_records(RecordMode::Basic);
    let blocks: Vec<ABox<[u8; 200], RangeChild>> =
        (0..6).map(|_| ABox::new_in([0; 200], RangeChild)).collect();
    let mut addresses: Vec<usize> = blocks.iter().map(|b| &**b as *const _ as usize).collect();
    addresses.sort_unstable();
    let (start, end) = (addresses[1], addresses[3] + 1);
    let mut out = Vec::new();
    report::dump_records_in_range(start, end, &mut out).unwrap();
    let text = String::from_utf8(out).unwrap();
    let lines: Vec<&str> = text
        .lines()
        .filter(|l| l.starts_with("Allocation Addr:"))
        .filter(|l| addresses.iter().any(|a| l.contains(&format!("{a:#x} "))))
        .collect();
    assert_eq!(lines.len(), 3, "{text}");
    for (line, a) in lines.iter().zip(&addresses[1..4]) {
        assert!(
            line.starts_with(&format!(
                "Allocation Addr: {a:#x} Size: 200 Alignment: 1 Requested: 200 Thread: "
            )),
            "{line}"
        );
    }
    assert!(text.contains("Printing allocation records for allocator RangeChild (3 records)"));
    assert!(text.contains("Printed 3 allocations for allocator \"RangeChild\""));
    drop(blocks);
}

/// Sampling records a fraction of the blocks, and the weights estimate the true totals.
#[test]
fn sampled_records_estimate_the_true_totals() {
    SampledChild.set_records(RecordMode::Sample {
        interval: 4096,
        frames: 0,
    });
    let blocks: Vec<ABox<[u8; 256], SampledChild>> = (0..4000)
        .map(|_| ABox::new_in([0; 256], SampledChild))
        .collect();
    let snapshot: RecordsSnapshot = records::snapshot();
    let sampled: Vec<_> = snapshot.records_of("SampledChild").collect();
    // p(256 B at 4 KiB) = 6.1 %: about 240 samples of 4000.
    assert!(
        sampled.len() > 120 && sampled.len() < 400,
        "{} samples",
        sampled.len()
    );
    assert!(
        sampled
            .iter()
            .all(|r| r.sampled && r.weight > 15.0 && r.weight < 18.0)
    );
    let blocks_estimate: f64 = sampled.iter().map(|r| r.weight).sum();
    let bytes_estimate: f64 = sampled.iter().map(|r| r.weight * r.size as f64).sum();
    let true_bytes = SampledChild.stats().live_granted_bytes as f64;
    assert!(
        (blocks_estimate - 4000.0).abs() / 4000.0 < 0.3,
        "{blocks_estimate}"
    );
    assert!(
        (bytes_estimate - true_bytes).abs() / true_bytes < 0.3,
        "{bytes_estimate}"
    );
    // The leak report says how precise the estimate is: √(N/T) = √(4096 / 1 MB), 6.3%,
    // estimated from the samples (the only sampled records in this binary).
    let mut leaks = Vec::new();
    report::dump_leaks(&mut leaks).unwrap();
    let leaks = String::from_utf8(leaks).unwrap();
    let at = leaks
        .find("(estimated from samples: the bytes within ±")
        .unwrap_or_else(|| panic!("{leaks}"))
        + "(estimated from samples: the bytes within ±".len();
    let percent: f64 = leaks[at..leaks[at..].find('%').unwrap() + at]
        .parse()
        .unwrap();
    assert!(percent > 4.0 && percent < 9.0, "{percent}% in\n{leaks}");
    drop(blocks);
    assert_eq!(
        records::live_totals(SampledChild::registration()).records,
        0
    );
}

/// Turning records off stops new records; the records made while on still leave exactly.
/// Blocks allocated before records were on simply miss the table when freed.
#[test]
fn turning_records_off_and_on_keeps_the_table_exact() {
    let before = ABox::new_in([1u8; 32], ToggledChild);
    ToggledChild.set_records(RecordMode::Basic);
    let during = ABox::new_in([2u8; 32], ToggledChild);
    ToggledChild.set_records(RecordMode::Off);
    let after = ABox::new_in([3u8; 32], ToggledChild);
    assert_eq!(
        records::live_totals(ToggledChild::registration()).records,
        1
    );
    drop(before);
    drop(during);
    assert_eq!(
        records::live_totals(ToggledChild::registration()).records,
        0
    );
    drop(after);
    assert_eq!(records::set_by_name("toggled CHILD", RecordMode::Basic), 1);
    assert_eq!(ToggledChild.record_mode(), RecordMode::Basic);
}

/// A realloc moves the record along: same stack and time, new address and size.
#[test]
fn realloc_updates_the_record() {
    ReallocChild.set_records(RecordMode::full());
    ReallocPool.set_records(RecordMode::full());
    let mut v: AVec<u8, ReallocChild> = AVec::with_capacity_in(16, ReallocChild);
    let mut p: AVec<u8, ReallocPool> = AVec::with_capacity_in(16, ReallocPool);
    let first = records::snapshot();
    let r0 = first.records_of("ReallocChild").next().unwrap().clone();
    let p0 = first.records_of("ReallocPool").next().unwrap().clone();
    v.reserve_exact(100_000);
    p.reserve_exact(300);
    let second = records::snapshot();
    let r1: Vec<_> = second.records_of("ReallocChild").collect();
    let p1: Vec<_> = second.records_of("ReallocPool").collect();
    assert_eq!(r1.len(), 1);
    assert_eq!(p1.len(), 1);
    assert_eq!(
        (r1[0].address, r1[0].requested),
        (v.as_ptr() as usize, v.capacity())
    );
    assert_eq!(
        (p1[0].address, p1[0].requested),
        (p.as_ptr() as usize, p.capacity())
    );
    assert_eq!((r1[0].stack, r1[0].time_us), (r0.stack, r0.time_us));
    assert_eq!((p1[0].stack, p1[0].time_us), (p0.stack, p0.time_us));
    assert_eq!(
        records::live_totals(ReallocChild::registration()).bytes,
        ReallocChild.stats().live_granted_bytes
    );
    drop((v, p));
    assert_eq!(
        records::live_totals(ReallocChild::registration()).records,
        0
    );
    assert_eq!(records::live_totals(ReallocPool::registration()).records, 0);
}

/// The records' own memory shows in the allocator table, on the OS layer.
#[test]
fn the_records_heap_is_in_the_allocator_table() {
    TableChild.set_records(RecordMode::Basic);
    let keep = ABox::new_in([0u8; 8], TableChild);
    let snapshot = report::Snapshot::take();
    let heap = snapshot
        .find("AllocationRecords")
        .expect("registered once records are on");
    assert_eq!(heap.parent_name, Some("OSAllocator"));
    assert!(heap.stats.reserved_bytes > 0);
    drop(keep);
}
