//! The records as a DHAT heap profile: the JSON format `dhat-rs` writes (DHAT file version
//! 2), which DHAT's viewer (`dh_view.html`) and the Firefox Profiler load.
//!
//! One program point per call site (allocator and stack): `tb`/`tbk` (bytes and blocks
//! allocated), `tl` (summed lifetimes, µs), `mb`/`mbk` (the most live at once), `gb`/`gbk`
//! (at the global peak), `eb`/`ebk` (at the end, i.e. when the profile was taken) and
//! `fs`, the frames (indices into `ftbl`, innermost first).
//!
//! Every block counts once (see [`owners`](super::owners)): a block a child and its parent
//! both recorded is the child's program point only, and the parent's program point at that
//! call site keeps what is its own. So the viewer's totals (`t-end`, `t-gmax`, the root of
//! its tree) are the program's.
//!
//! Where the viewer shows the allocator: `dh_view` builds its tree from the first frame of
//! each program point (the innermost), then its callers. The first frames of every program
//! point are therefore its allocator's chain, outermost first (`[allocator SystemAllocator]`,
//! then `[allocator Renderer]`, ...), and its call stack follows. The tree's first level is
//! the root allocators, the next their children and the blocks they serve themselves, as
//! in the allocator tree; each node's figures include everything below it. The Firefox
//! Profiler shows the same frames as the leaves of its call tree (the roots once inverted).
//!
//! A profile without any record (records off, or nothing allocated yet) has one empty
//! program point whose only frame says why, so the viewer does not just show nothing.
//!
//! What differs from `dhat-rs`: tagalloc does not stop the world to find the global peak,
//! so `tg` is the end time and `gb`/`gbk` equal `eb`/`ebk`; `mb`/`mbk` are an upper bound
//! (see [`CallSite::max_bytes`](crate::records::CallSite::max_bytes)); sizes are granted
//! bytes (the size class); sampled sites carry estimates (weighted totals, rounded); basic
//! records do not time their frees (it would cost them a third of their time), so their
//! `tl` counts only the blocks still live.

use super::json::string;
use super::owners;
use crate::records::RecordsSnapshot;
use std::collections::HashMap;
use std::fmt::Write;

/// One `ftbl` entry per symbol, in dhat-rs's style: `0x…: name (file:line:column)`.
fn frame_text(
    ip: usize,
    name: &str,
    file: Option<&str>,
    line: Option<u32>,
    col: Option<u32>,
) -> String {
    let file = file
        .map(|f| f.rsplit(['/', '\\']).next().unwrap_or(f))
        .unwrap_or("???");
    format!(
        "{ip:#x}: {name} ({file}:{}:{})",
        line.unwrap_or(0),
        col.unwrap_or(0)
    )
}

/// The `ftbl` entry of an allocator on a program point's chain.
fn allocator_frame(name: &str) -> String {
    format!("0x0: [allocator {name}] (tagalloc:0:0)")
}

/// Renders a resolved snapshot (see [`RecordsSnapshot::to_dhat_json`]).
pub(crate) fn render(snapshot: &RecordsSnapshot) -> String {
    let mut ftbl: Vec<String> = vec!["[root]".to_string()];
    let mut index: HashMap<String, usize> = HashMap::new();
    let mut intern = |text: String| -> usize {
        *index.entry(text.clone()).or_insert_with(|| {
            ftbl.push(text);
            ftbl.len() - 1
        })
    };
    let mut out =
        String::from("{\"dhatFileVersion\":2,\"mode\":\"rust-heap\",\"verb\":\"Allocated\",");
    out.push_str("\"bklt\":true,\"bkacc\":false,\"tu\":\"µs\",\"Mtu\":\"s\",\"tuth\":10,\"cmd\":");
    let cmd: Vec<String> = std::env::args().collect();
    string(&mut out, &cmd.join(" "));
    let te = snapshot.taken_us;
    let _ = write!(
        out,
        ",\"pid\":{},\"tg\":{te},\"te\":{te},\"pps\":[",
        std::process::id()
    );
    let round = |x: f64| x.round().max(0.0) as u64;
    let sites = owners::own_sites(snapshot);
    for (i, own) in sites.iter().enumerate() {
        let site = &own.site;
        let mut fs: Vec<usize> = own
            .chain
            .iter()
            .map(|name| intern(allocator_frame(name)))
            .collect();
        if let Some(stack) = snapshot.stack(site.stack) {
            if stack.frames.is_empty() {
                for &ip in stack.ips.iter().take(stack.show.max(1)) {
                    fs.push(intern(frame_text(ip, "???", None, None, None)));
                }
            }
            for frame in &stack.frames {
                if frame.symbols.is_empty() {
                    fs.push(intern(frame_text(frame.ip, "???", None, None, None)));
                }
                for s in &frame.symbols {
                    fs.push(intern(frame_text(
                        frame.ip,
                        &s.name,
                        s.file.as_deref(),
                        s.line,
                        s.column,
                    )));
                }
            }
        }
        if i > 0 {
            out.push(',');
        }
        let (eb, ebk) = (round(site.live_bytes), round(site.live_blocks));
        let _ = write!(
            out,
            "{{\"tb\":{},\"tbk\":{},\"tl\":{},\"mb\":{},\"mbk\":{},\"gb\":{eb},\"gbk\":{ebk},\
             \"eb\":{eb},\"ebk\":{ebk},\"fs\":",
            round(site.total_bytes),
            round(site.total_blocks),
            round(site.lifetimes_us),
            round(site.max_bytes),
            round(site.max_blocks),
        );
        indices(&mut out, &fs);
        out.push('}');
    }
    if sites.is_empty() {
        let why = intern(format!(
            "0x0: [tagalloc: {}] (tagalloc:0:0)",
            owners::why_empty(snapshot)
        ));
        let _ = write!(
            out,
            "{{\"tb\":0,\"tbk\":0,\"tl\":0,\"mb\":0,\"mbk\":0,\"gb\":0,\"gbk\":0,\
             \"eb\":0,\"ebk\":0,\"fs\":[{why}]}}"
        );
    }
    out.push_str("],\"ftbl\":[");
    for (k, f) in ftbl.iter().enumerate() {
        if k > 0 {
            out.push(',');
        }
        string(&mut out, f);
    }
    out.push_str("]}");
    out
}

/// A JSON array of frame indices.
fn indices(out: &mut String, fs: &[usize]) {
    out.push('[');
    for (k, f) in fs.iter().enumerate() {
        if k > 0 {
            out.push(',');
        }
        let _ = write!(out, "{f}");
    }
    out.push(']');
}
