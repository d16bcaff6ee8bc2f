//! `report::html()`: one self-contained page (no network, no script, no other file) with
//! the treemap, the timeline charts with budget lines, the top call sites of allocators
//! with records, and virtual blocks' memory maps; opened in headless Chromium (Debian's
//! `chromium`), which must raise no error and show every allocator's name. With
//! `UPDATE_SCREENSHOTS=1` the test saves its screenshot as `docs/report.png` (the README's
//! picture); otherwise in a scratch directory. Skips the browser with one line when
//! Chromium is not installed (`.ci/run` installs it where it can).

mod common;

use allocator_api2::boxed::Box;
use allocator_api2::vec::Vec as AVec;
use std::path::{Path, PathBuf};
use std::process::Command;
use tagalloc::report::{HtmlReport, Snapshot};
use tagalloc::virtual_block::{MapRow, Request, Tag, VirtualBlock};
use tagalloc::{BudgetMode, RecordMode, SystemAllocator};

#[global_allocator]
static GLOBAL: SystemAllocator = SystemAllocator::new();

tagalloc::allocator!(Renderer: child of SystemAllocator, "Meshes, draw lists");
tagalloc::allocator!(Textures: child of Renderer, "Texture pixels");
tagalloc::allocator!(Audio: child of SystemAllocator, "Voices");
tagalloc::allocator!(Events: pool of SystemAllocator, "UI events");

#[inline(never)]
fn load_texture(side: usize) -> AVec<u8, Textures> {
    let mut pixels = AVec::with_capacity_in(side * side * 4, Textures);
    pixels.resize(side * side * 4, 7);
    pixels
}

fn chromium() -> Option<&'static str> {
    ["chromium", "chromium-browser"].into_iter().find(|c| {
        Command::new(c)
            .arg("--version")
            .output()
            .is_ok_and(|o| o.status.success())
    })
}

/// Runs headless Chromium on `page` with `extra` arguments; returns (stdout, stderr).
fn run_chromium(browser: &str, page: &Path, dir: &Path, extra: &[String]) -> (String, String) {
    let out = Command::new("timeout")
        .args(["120", browser])
        .args([
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--no-first-run",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            "--hide-scrollbars",
            "--force-device-scale-factor=1",
            "--enable-logging=stderr",
            "--v=0",
        ])
        .arg(format!("--user-data-dir={}", dir.join("profile").display()))
        .args(extra)
        .arg(format!("file://{}", page.display()))
        .output()
        .expect("chromium runs");
    assert!(out.status.success(), "chromium failed: {out:?}");
    (
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn the_html_report_shows_every_allocator_and_opens_cleanly_in_a_browser() {
    common::messages::capture();
    Textures.set_records(RecordMode::full());
    Audio.set_budget(Some(256 << 10), BudgetMode::Warn);
    let mut textures = Vec::new();
    let mut voices: Vec<AVec<f32, Audio>> = Vec::new();
    let mut events = Vec::new();
    for frame in 0..40 {
        if frame % 4 == 0 {
            textures.push(load_texture(128 << (frame % 3)));
        }
        voices.push(AVec::with_capacity_in(4800, Audio));
        if voices.len() > 16 {
            voices.remove(0);
        }
        events.push(Box::new_in([frame as u32; 6], Events));
        let _draw_list: AVec<u32, Renderer> = AVec::with_capacity_in(1000 + frame * 10, Renderer);
        tagalloc::report::mark_frame();
    }
    let mut gpu = VirtualBlock::<()>::new(64 << 20);
    for i in 0..20 {
        gpu.allocate(&Request::new((i + 1) << 16).tag(Tag::new("meshes")), ())
            .unwrap();
    }
    let page = HtmlReport::new()
        .memory_map("GPU heaps", &[MapRow::new("GPU heap 0", &gpu)])
        .render();

    // Self-contained: no script, nothing fetched.
    assert!(page.starts_with("<!DOCTYPE html>"));
    assert!(!page.contains("<script"), "no script");
    for fetch in ["src=", "href=", "url(http", "@import"] {
        assert!(!page.contains(fetch), "nothing fetched: {fetch}");
    }
    let names: Vec<&str> = Snapshot::take().allocators.iter().map(|a| a.name).collect();
    for name in &names {
        assert!(page.contains(name), "{name} in the page");
    }
    assert!(page.contains("budget 256.0 KiB"), "the budget line");
    assert!(
        page.contains("load_texture"),
        "the top call site of Textures"
    );
    assert!(
        page.contains("GPU heap 0") && page.contains("meshes"),
        "the memory map"
    );
    assert!(page.contains("Audio — "), "a chart per allocator");

    let Some(browser) = chromium() else {
        println!("skipped the browser: chromium is not installed (apt-get install chromium)");
        return;
    };
    let dir = common::viewers::scratch_dir("report-html");
    let file = dir.join("report.html");
    std::fs::write(&file, &page).unwrap();
    let (dom, log) = run_chromium(browser, &file, &dir, &["--dump-dom".to_string()]);
    for line in log.lines() {
        assert!(
            !(line.contains("CONSOLE") || line.contains("Uncaught")),
            "the page raised an error: {line}"
        );
    }
    for name in &names {
        assert!(dom.contains(name), "{name} in the rendered page");
    }
    let shot: PathBuf = if std::env::var_os("UPDATE_SCREENSHOTS").is_some() {
        Path::new(env!("CARGO_MANIFEST_DIR")).join("docs/report.png")
    } else {
        dir.join("report.png")
    };
    let _ = std::fs::remove_file(&shot);
    run_chromium(
        browser,
        &file,
        &dir,
        &[
            "--window-size=1100,1400".to_string(),
            format!("--screenshot={}", shot.display()),
        ],
    );
    let decoder = png::Decoder::new(std::io::BufReader::new(
        std::fs::File::open(&shot).expect("a screenshot"),
    ));
    let mut reader = decoder.read_info().unwrap();
    let mut pixels = vec![0; reader.output_buffer_size().unwrap()];
    let info = reader.next_frame(&mut pixels).unwrap();
    assert_eq!((info.width, info.height), (1100, 1400));
    let distinct: std::collections::HashSet<&[u8]> = pixels
        .chunks(info.color_type.samples())
        .step_by(97)
        .collect();
    assert!(distinct.len() > 20, "a picture, not a blank page");
    println!("screenshot: {}", shot.display());
    if !shot.starts_with(env!("CARGO_MANIFEST_DIR")) {
        let _ = std::fs::remove_dir_all(&dir);
    }
    drop((textures, voices, events));
}
