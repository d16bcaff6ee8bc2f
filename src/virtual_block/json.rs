//! JSON in the shape of VMA's `vmaBuildVirtualBlockStatsString`, written by hand.
//!
//! ```text
//! {"Stats": {"BlockCount", "BlockBytes", "AllocationCount", "AllocationBytes", "UnusedRangeCount",
//!            "AllocationSizeMin"/"Max" (when more than one allocation),
//!            "UnusedRangeSizeMin"/"Max" (when more than one free range)},
//!  "Details": {"TotalBytes", "UnusedBytes", "Allocations", "UnusedRanges",
//!              "Suballocations": [{"Offset", "Size", "CustomData"?, "Name"?, "Tag"?},
//!                                 {"Offset", "Type": "FREE", "Size"}, ...]}}
//! ```
//!
//! `Details` is written only when asked for. Beyond VMA: an allocation's `Name` (as VMA writes
//! for real allocations) and `Tag`, and `"Type": "RESERVED"` for pending defragmentation
//! destinations.

use std::fmt::Write;

use super::{Range, VirtualBlock};

/// Appends `s` as a JSON string literal, escaping quotes, backslashes and control characters.
pub(crate) fn push_json_string(out: &mut String, s: &str) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if (c as u32) < 0x20 => {
                let _ = write!(out, "\\u{:04x}", c as u32);
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

impl<U> VirtualBlock<U> {
    /// The block's statistics as JSON in VMA's virtual-block shape; with `detailed`, every
    /// range too. O(n).
    ///
    /// ```
    /// use tagalloc::virtual_block::{Request, VirtualBlock};
    /// let mut b = VirtualBlock::<()>::new(100);
    /// b.allocate(&Request::new(10).name("a \"quoted\" name"), ())?;
    /// let json = b.to_json(true);
    /// assert!(json.contains(r#""AllocationBytes": 10"#));
    /// assert!(json.contains(r#""Name": "a \"quoted\" name""#));
    /// # Ok::<(), tagalloc::virtual_block::Error>(())
    /// ```
    pub fn to_json(&self, detailed: bool) -> String {
        self.write_json(detailed, None)
    }

    /// Like [`to_json`](Self::to_json), and each allocation's `CustomData` is
    /// `custom_data(&user_data)` (VMA writes the user pointer there).
    pub fn to_json_with(&self, detailed: bool, custom_data: impl Fn(&U) -> u64) -> String {
        self.write_json(detailed, Some(&custom_data))
    }

    fn write_json(&self, detailed: bool, custom: Option<&dyn Fn(&U) -> u64>) -> String {
        let d = self.detailed_statistics();
        let s = d.statistics;
        let mut o = String::with_capacity(256);
        o.push_str("{\n  \"Stats\": {\n");
        let _ = write!(
            o,
            "    \"BlockCount\": {},\n    \"BlockBytes\": {},\n    \"AllocationCount\": {},\n    \
             \"AllocationBytes\": {},\n    \"UnusedRangeCount\": {}",
            s.block_count,
            s.block_bytes,
            s.allocation_count,
            s.allocation_bytes,
            d.unused_range_count
        );
        if s.allocation_count > 1 {
            let _ = write!(
                o,
                ",\n    \"AllocationSizeMin\": {},\n    \"AllocationSizeMax\": {}",
                d.allocation_size_min, d.allocation_size_max
            );
        }
        if d.unused_range_count > 1 {
            let _ = write!(
                o,
                ",\n    \"UnusedRangeSizeMin\": {},\n    \"UnusedRangeSizeMax\": {}",
                d.unused_range_size_min, d.unused_range_size_max
            );
        }
        o.push_str("\n  }");
        if detailed {
            let _ = write!(
                o,
                ",\n  \"Details\": {{\n    \"TotalBytes\": {},\n    \"UnusedBytes\": {},\n    \
                 \"Allocations\": {},\n    \"UnusedRanges\": {},\n    \"Suballocations\": [",
                s.block_bytes,
                s.block_bytes - s.allocation_bytes,
                s.allocation_count,
                d.unused_range_count
            );
            for (i, r) in self.ranges().enumerate() {
                o.push_str(if i == 0 { "\n      {" } else { ",\n      {" });
                match r {
                    Range::Allocation(a) => {
                        let _ = write!(o, "\"Offset\": {}, \"Size\": {}", a.offset, a.size);
                        if let Some(f) = custom {
                            let _ = write!(o, ", \"CustomData\": {}", f(a.user));
                        }
                        if let Some(name) = a.name {
                            o.push_str(", \"Name\": ");
                            push_json_string(&mut o, name);
                        }
                        if let Some(tag) = a.tag {
                            o.push_str(", \"Tag\": ");
                            push_json_string(&mut o, tag.name());
                        }
                    }
                    Range::Reserved { offset, size } => {
                        let _ = write!(
                            o,
                            "\"Offset\": {offset}, \"Type\": \"RESERVED\", \"Size\": {size}"
                        );
                    }
                    Range::Free { offset, size } => {
                        let _ = write!(
                            o,
                            "\"Offset\": {offset}, \"Type\": \"FREE\", \"Size\": {size}"
                        );
                    }
                }
                o.push('}');
            }
            o.push_str("\n    ]\n  }");
        }
        o.push_str("\n}\n");
        o
    }
}
