//! The tools people open profiles with, run headless on a profile a test wrote. A test whose
//! tool is not installed prints one line and skips that check.

use std::path::{Path, PathBuf};
use std::process::Command;

/// Where valgrind's Debian package installs DHAT's viewer.
const DH_VIEW_JS: &str = "/usr/libexec/valgrind/dh_view.js";

/// Whether `program` runs (`program --version` exits).
fn installed(program: &str) -> bool {
    Command::new(program)
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success())
}

/// A scratch directory of this process.
pub fn scratch_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("tagalloc-{name}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// The text DHAT's viewer (`dh_view.js`, as `dh_view.html` loads it) shows for `profile`,
/// rendered by headless Chromium; `None` (after one line on stderr) when Chromium or the
/// viewer is not installed (Debian: `apt-get install chromium valgrind`).
pub fn dh_view_text(profile: &str) -> Option<String> {
    if !Path::new(DH_VIEW_JS).exists() || !installed("chromium") {
        eprintln!("skipped: the DHAT viewer check needs chromium and {DH_VIEW_JS}");
        return None;
    }
    let dir = scratch_dir("dh-view");
    let page = dir.join("view.html");
    // The viewer's own page loads a file the user picks; this one hands it the profile and
    // runs the same two steps (build the tree, display it).
    let html = format!(
        "<!DOCTYPE html><html><head><meta charset=\"UTF-8\">\
         <script src=\"file://{DH_VIEW_JS}\"></script>\
         <script>const PROFILE = {profile};</script></head>\
         <body onload=\"onLoad(); tryFunc(() => {{ gData = PROFILE; buildTree(); displayTree(); }});\">\
         </body></html>"
    );
    std::fs::write(&page, html).unwrap();
    let out = Command::new("timeout")
        .args([
            "120",
            "chromium",
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
        ])
        .arg("--allow-file-access-from-files")
        .arg(format!(
            "--user-data-dir={}",
            dir.join("chromium").display()
        ))
        .arg("--dump-dom")
        .arg(format!("file://{}", page.display()))
        .output()
        .expect("chromium runs");
    let _ = std::fs::remove_dir_all(&dir);
    assert!(out.status.success(), "chromium failed: {out:?}");
    let dom = String::from_utf8_lossy(&out.stdout);
    // The page's text: tags dropped, the few entities the viewer writes decoded.
    let mut text = String::new();
    let mut in_tag = false;
    for c in dom.chars() {
        match c {
            '<' => in_tag = true,
            '>' if in_tag => in_tag = false,
            _ if !in_tag => text.push(c),
            _ => {}
        }
    }
    let text = text
        .replace("&gt;", ">")
        .replace("&lt;", "<")
        .replace("&amp;", "&");
    // Only what the viewer displayed, not the profile in the page's script.
    let shown = text.find("Invocation {").map_or(&text[..], |i| &text[i..]);
    Some(shown.to_string())
}
