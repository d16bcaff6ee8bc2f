//! The snapshot as JSON, written by hand (no serializer dependency).

use super::Snapshot;
use std::fmt::Write;

/// `text` as a JSON string literal (the virtual block's escaper: one for the crate).
pub(super) fn string(out: &mut String, text: &str) {
    crate::virtual_block::json::push_json_string(out, text);
}

/// A number, or `null` for `None`.
pub(super) fn number<T: std::fmt::Display>(out: &mut String, value: Option<T>) {
    match value {
        Some(v) => {
            let _ = write!(out, "{v}");
        }
        None => out.push_str("null"),
    }
}

pub(super) fn render(snapshot: &Snapshot) -> String {
    let mut out = String::from("{\"allocators\":[");
    for (i, a) in snapshot.allocators.iter().enumerate() {
        if i > 0 {
            out.push(',');
        }
        let s = &a.stats;
        let _ = write!(out, "{{\"index\":{},\"name\":", a.index);
        string(&mut out, a.name);
        out.push_str(",\"description\":");
        string(&mut out, a.description);
        out.push_str(",\"kind\":");
        string(&mut out, a.kind.as_str());
        out.push_str(",\"parent\":");
        match a.parent_name {
            Some(p) => string(&mut out, p),
            None => out.push_str("null"),
        }
        let _ = write!(
            out,
            ",\"depth\":{},\"used_bytes\":{},\"requested_bytes\":",
            a.depth, s.live_granted_bytes
        );
        number(&mut out, s.live_requested_bytes);
        let _ = write!(
            out,
            ",\"reserved_bytes\":{},\"consumed_bytes\":{},\"live_blocks\":{},\"allocations\":{},\
             \"frees\":{},\"reallocations\":{},\"peak_bytes\":",
            s.reserved_bytes,
            a.consumed_bytes,
            s.live_blocks,
            s.allocations,
            s.frees,
            s.reallocations
        );
        number(&mut out, s.peak_granted_bytes);
        out.push_str(",\"budget_bytes\":");
        number(&mut out, a.budget);
        let _ = write!(
            out,
            ",\"over_budget\":{},\"budget_failures\":{},\"thread_cache_lane\":{}}}",
            s.over_budget, s.budget_failures, a.thread_cache_lane
        );
    }
    let t = snapshot.totals();
    let _ = write!(
        out,
        "],\"totals\":{{\"used_bytes\":{},\"reserved_bytes\":{},\"consumed_bytes\":{}}}}}",
        t.used_bytes, t.reserved_bytes, t.consumed_bytes
    );
    out
}
