//! The records as JSON: every live record, the stacks they refer to and the call-site
//! totals (schema in [`RecordsSnapshot::to_json`](crate::records::RecordsSnapshot::to_json)).

use super::json::{number, string};
use crate::records::RecordsSnapshot;
use std::fmt::Write;

pub(crate) fn render(snapshot: &RecordsSnapshot) -> String {
    let mut out = String::new();
    let _ = write!(
        out,
        "{{\"taken_us\":{},\"dropped\":{},\"incomplete\":{},\"records\":[",
        snapshot.taken_us, snapshot.dropped, snapshot.incomplete
    );
    for (i, r) in snapshot.records.iter().enumerate() {
        if i > 0 {
            out.push(',');
        }
        out.push_str("{\"allocator\":");
        string(&mut out, r.allocator);
        let _ = write!(
            out,
            ",\"allocator_index\":{},\"address\":{},\"size\":{},\"requested\":{},\"align\":{},\
             \"thread\":{},\"time_us\":{},\"weight\":{:?},\"sampled\":{},\"stack\":{}}}",
            r.allocator_index,
            r.address,
            r.size,
            r.requested,
            r.align,
            r.thread,
            r.time_us,
            r.weight,
            r.sampled,
            r.stack
        );
    }
    out.push_str("],\"stacks\":[");
    let mut first = true;
    for s in &snapshot.stacks {
        let used = snapshot.records.iter().any(|r| r.stack == s.id)
            || snapshot.sites.iter().any(|c| c.stack == s.id);
        if !used {
            continue;
        }
        if !first {
            out.push(',');
        }
        first = false;
        let ips: Vec<String> = s.ips.iter().map(|ip| ip.to_string()).collect();
        let _ = write!(
            out,
            "{{\"id\":{},\"show\":{},\"ips\":[{}],\"frames\":[",
            s.id,
            s.show,
            ips.join(",")
        );
        for (k, f) in s.frames.iter().enumerate() {
            if k > 0 {
                out.push(',');
            }
            let _ = write!(out, "{{\"ip\":{},\"symbols\":[", f.ip);
            for (j, sym) in f.symbols.iter().enumerate() {
                if j > 0 {
                    out.push(',');
                }
                out.push_str("{\"name\":");
                string(&mut out, &sym.name);
                out.push_str(",\"file\":");
                match &sym.file {
                    Some(file) => string(&mut out, file),
                    None => out.push_str("null"),
                }
                out.push_str(",\"line\":");
                number(&mut out, sym.line);
                out.push_str(",\"column\":");
                number(&mut out, sym.column);
                out.push('}');
            }
            out.push_str("]}");
        }
        out.push_str("]}");
    }
    out.push_str("],\"sites\":[");
    for (i, c) in snapshot.sites.iter().enumerate() {
        if i > 0 {
            out.push(',');
        }
        out.push_str("{\"allocator\":");
        string(&mut out, c.allocator);
        let _ = write!(
            out,
            ",\"allocator_index\":{},\"stack\":{},\"live_bytes\":{:?},\"live_blocks\":{:?},\
             \"total_bytes\":{:?},\"total_blocks\":{:?},\"max_bytes\":{:?},\"max_blocks\":{:?},\
             \"lifetimes_us\":{:?},\"sampled\":{}}}",
            c.allocator_index,
            c.stack,
            c.live_bytes,
            c.live_blocks,
            c.total_bytes,
            c.total_blocks,
            c.max_bytes,
            c.max_blocks,
            c.lifetimes_us,
            c.sampled
        );
    }
    out.push_str("]}");
    out
}
