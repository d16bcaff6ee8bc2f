//! `report::mark_frame` and the timeline: a row per mark, Used and the peak between marks
//! per allocator, kept across a fork. One test: the marks are process-global.

use allocator_api2::vec::Vec as AVec;
use tagalloc::SystemAllocator;
use tagalloc::report::{self, TIMELINE_FRAMES};

#[global_allocator]
static GLOBAL: SystemAllocator = SystemAllocator::new();

tagalloc::allocator!(Frames: child of SystemAllocator, "per-frame scratch");
tagalloc::allocator!(Bullets: pool of SystemAllocator, "a pool");

/// The (used, peak) cells of `name` in the timeline, oldest first.
fn column(timeline: &report::Timeline, name: &str) -> Vec<Option<(usize, usize)>> {
    let k = timeline
        .allocators
        .iter()
        .position(|a| a.name == name)
        .unwrap_or_else(|| panic!("{name} in the timeline"));
    timeline.frames.iter().map(|f| f.figures[k]).collect()
}

#[test]
fn marks_record_used_and_the_peak_between_marks() {
    report::mark_frame(); // before the allocators exist: no column for them yet
    // Frame 1: 64 KiB held across the mark. Frame 2: a 1 MiB spike freed before the mark.
    let held: AVec<u8, Frames> = AVec::with_capacity_in(64 << 10, Frames);
    let bullet = allocator_api2::boxed::Box::new_in([0u8; 48], Bullets);
    report::mark_frame();
    let spike: AVec<u8, Frames> = AVec::with_capacity_in(1 << 20, Frames);
    drop(spike);
    report::mark_frame();
    drop((held, bullet));
    report::mark_frame();

    let timeline = report::timeline();
    assert_eq!(timeline.frames.len(), 4);
    assert_eq!(
        timeline.frames.iter().map(|f| f.mark).collect::<Vec<_>>(),
        [0, 1, 2, 3]
    );
    assert!(
        timeline
            .frames
            .windows(2)
            .all(|w| w[0].time_ns <= w[1].time_ns)
    );
    let frames = column(&timeline, "Frames");
    assert_eq!(frames[0], None, "not registered at the first mark");
    let (used1, peak1) = frames[1].unwrap();
    assert!((64 << 10..(64 << 10) + 4096).contains(&used1), "{used1}");
    assert_eq!(peak1, used1);
    let (used2, peak2) = frames[2].unwrap();
    assert_eq!(used2, used1, "the spike was freed before the mark");
    // Within the peak's tolerance for this thread (the 64 KiB may not be published yet).
    assert!(
        (1 << 20..=used1 + (1 << 20) + 4096).contains(&peak2),
        "the spike is in the peak: {peak2}"
    );
    let (used3, peak3) = frames[3].unwrap();
    assert_eq!(used3, 0);
    assert_eq!(peak3, used2, "the peak of the last interval is its start");
    let bullets = column(&timeline, "Bullets");
    assert_eq!(bullets[1], Some((48, 48)));
    assert_eq!(bullets[3].unwrap().0, 0);
    // The OS layer and the SystemAllocator are there from the first mark.
    assert!(
        column(&timeline, "SystemAllocator")
            .iter()
            .all(Option::is_some)
    );
    assert!(column(&timeline, "OSAllocator")[0].unwrap().0 > 0);

    // The CSV: a header, then a row per mark; empty cells before registration.
    let csv = report::timeline_csv();
    let lines: Vec<&str> = csv.lines().collect();
    assert_eq!(lines.len(), 5);
    let header: Vec<&str> = lines[0].split(',').collect();
    assert_eq!(header[..2], ["mark", "time_ms"]);
    let at = header.iter().position(|&h| h == "Frames").unwrap();
    assert_eq!(header[at + 1], "Frames peak");
    let row = |i: usize| -> Vec<String> { lines[i].split(',').map(str::to_owned).collect() };
    assert_eq!(row(1)[at], "");
    assert_eq!(row(3)[at], used2.to_string());
    assert_eq!(row(3)[at + 1], peak2.to_string());
    assert_eq!(row(4)[0], "3");

    // Across a fork: the child keeps the parent's marks and adds its own.
    // SAFETY: the child only marks, reads the timeline (tagalloc, the global allocator,
    // is fork-safe) and leaves with `_exit`.
    let pid = unsafe { libc::fork() };
    assert!(pid >= 0, "fork failed");
    if pid == 0 {
        report::mark_frame();
        let timeline = report::timeline();
        let ok = timeline.frames.len() == 5 && timeline.frames[4].mark == 4;
        // SAFETY: ends the child without running the parent's test harness.
        unsafe { libc::_exit(if ok { 0 } else { 1 }) };
    }
    let mut status = 0;
    // SAFETY: waits for the child just forked.
    assert_eq!(unsafe { libc::waitpid(pid, &mut status, 0) }, pid);
    assert!(
        libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0,
        "{status}"
    );
    assert_eq!(
        report::timeline().frames.len(),
        4,
        "the child's mark stays in the child"
    );

    // The ring keeps the most recent marks.
    for _ in 0..TIMELINE_FRAMES {
        report::mark_frame();
    }
    let timeline = report::timeline();
    assert_eq!(timeline.frames.len(), TIMELINE_FRAMES);
    assert_eq!(timeline.frames[0].mark, 4);
    assert_eq!(
        timeline.frames.last().unwrap().mark,
        (TIMELINE_FRAMES + 3) as u64
    );
}
