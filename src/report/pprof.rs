//! The records as a pprof heap profile: a gzip-compressed `profile.proto`
//! (<https://github.com/google/pprof/blob/main/proto/profile.proto>) laid out as Go's runtime
//! writes its heap profiles, so `go tool pprof` and the services that ingest Go heap
//! profiles (Parca, Pyroscope, Grafana) read it as one.
//!
//! - Sample types `alloc_objects/count`, `alloc_space/bytes`, `inuse_objects/count`,
//!   `inuse_space/bytes` (pprof shows the last, in-use space, by default); `period_type`
//!   `space/bytes`, and `period` the sampling interval (1 when every allocation is
//!   recorded).
//! - One sample per call site and allocator, from the sites' own figures: each block counts
//!   once, under the innermost allocator that recorded it (see [`owners`](super::owners)).
//!   Sizes are granted bytes, as Go's are size classes. Sampled records are already weighted
//!   by 1/(1 − e^(−size/interval)) each, the factor Go's runtime scales its samples by, so the
//!   values are estimates of the true totals; exact records count as themselves.
//! - Labels: `allocator` (the allocator's name: `-tagfocus=allocator=Renderer`, `-tags`),
//!   `allocator_path` (its chain, outermost first: `SystemAllocator/Renderer`, so
//!   `-tagfocus=allocator_path=SystemAllocator` keeps everything under it) and, as Go writes,
//!   the numeric label `bytes` (the average block size).
//! - Locations carry their addresses, the executable mapping they lie in (from
//!   `/proc/self/maps`) and their functions, files and lines as the `backtrace` crate resolved
//!   them (inlined calls as several lines, innermost first), so pprof needs no symbols.
//!   Records without a call stack (basic records) get one location named after that.
//! - Comments (`go tool pprof -comments`) say what each allocator records, or why the
//!   profile is empty.

use super::owners::{self, OwnSite};
use crate::records::{RecordMode, RecordsSnapshot};
use flate2::{Compression, write::GzEncoder};
use prost::Message;
use std::collections::HashMap;
use std::io::Write;

// The profile.proto messages, with the fields this profile uses (tags as in the .proto).

#[derive(Clone, PartialEq, Message)]
struct Profile {
    #[prost(message, repeated, tag = "1")]
    sample_type: Vec<ValueType>,
    #[prost(message, repeated, tag = "2")]
    sample: Vec<Sample>,
    #[prost(message, repeated, tag = "3")]
    mapping: Vec<Mapping>,
    #[prost(message, repeated, tag = "4")]
    location: Vec<Location>,
    #[prost(message, repeated, tag = "5")]
    function: Vec<Function>,
    #[prost(string, repeated, tag = "6")]
    string_table: Vec<String>,
    #[prost(int64, tag = "9")]
    time_nanos: i64,
    #[prost(int64, tag = "10")]
    duration_nanos: i64,
    #[prost(message, optional, tag = "11")]
    period_type: Option<ValueType>,
    #[prost(int64, tag = "12")]
    period: i64,
    #[prost(int64, repeated, tag = "13")]
    comment: Vec<i64>,
}

#[derive(Clone, PartialEq, Message)]
struct ValueType {
    #[prost(int64, tag = "1")]
    r#type: i64,
    #[prost(int64, tag = "2")]
    unit: i64,
}

#[derive(Clone, PartialEq, Message)]
struct Sample {
    /// Innermost first.
    #[prost(uint64, repeated, tag = "1")]
    location_id: Vec<u64>,
    #[prost(int64, repeated, tag = "2")]
    value: Vec<i64>,
    #[prost(message, repeated, tag = "3")]
    label: Vec<Label>,
}

#[derive(Clone, PartialEq, Message)]
struct Label {
    #[prost(int64, tag = "1")]
    key: i64,
    #[prost(int64, tag = "2")]
    str: i64,
    #[prost(int64, tag = "3")]
    num: i64,
}

#[derive(Clone, PartialEq, Message)]
struct Mapping {
    #[prost(uint64, tag = "1")]
    id: u64,
    #[prost(uint64, tag = "2")]
    memory_start: u64,
    #[prost(uint64, tag = "3")]
    memory_limit: u64,
    #[prost(uint64, tag = "4")]
    file_offset: u64,
    #[prost(int64, tag = "5")]
    filename: i64,
    #[prost(bool, tag = "7")]
    has_functions: bool,
    #[prost(bool, tag = "8")]
    has_filenames: bool,
    #[prost(bool, tag = "9")]
    has_line_numbers: bool,
    #[prost(bool, tag = "10")]
    has_inline_frames: bool,
}

#[derive(Clone, PartialEq, Message)]
struct Location {
    #[prost(uint64, tag = "1")]
    id: u64,
    #[prost(uint64, tag = "2")]
    mapping_id: u64,
    #[prost(uint64, tag = "3")]
    address: u64,
    /// Innermost first: the last line is the caller the others were inlined into.
    #[prost(message, repeated, tag = "4")]
    line: Vec<Line>,
}

#[derive(Clone, PartialEq, Message)]
struct Line {
    #[prost(uint64, tag = "1")]
    function_id: u64,
    #[prost(int64, tag = "2")]
    line: i64,
}

#[derive(Clone, PartialEq, Message)]
struct Function {
    #[prost(uint64, tag = "1")]
    id: u64,
    #[prost(int64, tag = "2")]
    name: i64,
    #[prost(int64, tag = "3")]
    system_name: i64,
    #[prost(int64, tag = "4")]
    filename: i64,
}

/// The profile's string table (entry 0 is the empty string, as the format requires).
struct Strings {
    table: Vec<String>,
    index: HashMap<String, i64>,
}

impl Strings {
    fn new() -> Self {
        Self {
            table: vec![String::new()],
            index: HashMap::from([(String::new(), 0)]),
        }
    }

    fn id(&mut self, text: &str) -> i64 {
        if let Some(&i) = self.index.get(text) {
            return i;
        }
        let i = self.table.len() as i64;
        self.table.push(text.to_string());
        self.index.insert(text.to_string(), i);
        i
    }
}

/// One executable mapping of this process: (start, limit, file offset, path).
type Region = (u64, u64, u64, String);

/// The executable mappings of this process, from `/proc/self/maps` (none elsewhere).
fn executable_regions() -> Vec<Region> {
    let Ok(maps) = std::fs::read_to_string("/proc/self/maps") else {
        return Vec::new();
    };
    maps.lines()
        .filter_map(|line| {
            let mut fields = line.split_ascii_whitespace();
            let (range, perms, offset) = (fields.next()?, fields.next()?, fields.next()?);
            if !perms.contains('x') {
                return None;
            }
            let (start, end) = range.split_once('-')?;
            let path = fields.nth(2).unwrap_or("").to_string();
            Some((
                u64::from_str_radix(start, 16).ok()?,
                u64::from_str_radix(end, 16).ok()?,
                u64::from_str_radix(offset, 16).ok()?,
                path,
            ))
        })
        .collect()
}

/// Builds the profile's locations, functions and mappings as samples need them.
struct Frames {
    regions: Vec<Region>,
    /// Mapping id (region position + 1) of each region used.
    mappings: Vec<Mapping>,
    mapping_ids: HashMap<usize, u64>,
    locations: Vec<Location>,
    location_ids: HashMap<usize, u64>,
    functions: Vec<Function>,
    function_ids: HashMap<(String, String), u64>,
}

impl Frames {
    fn new() -> Self {
        Self {
            regions: executable_regions(),
            mappings: Vec::new(),
            mapping_ids: HashMap::new(),
            locations: Vec::new(),
            location_ids: HashMap::new(),
            functions: Vec::new(),
            function_ids: HashMap::new(),
        }
    }

    fn mapping(&mut self, strings: &mut Strings, address: u64) -> u64 {
        let Some(r) = self
            .regions
            .iter()
            .position(|&(start, limit, ..)| (start..limit).contains(&address))
        else {
            return 0;
        };
        if let Some(&id) = self.mapping_ids.get(&r) {
            return id;
        }
        let id = self.mappings.len() as u64 + 1;
        let (start, limit, offset, ref path) = self.regions[r];
        self.mappings.push(Mapping {
            id,
            memory_start: start,
            memory_limit: limit,
            file_offset: offset,
            filename: strings.id(path),
            has_functions: true,
            has_filenames: true,
            has_line_numbers: true,
            has_inline_frames: true,
        });
        self.mapping_ids.insert(r, id);
        id
    }

    fn function(&mut self, strings: &mut Strings, name: &str, file: &str) -> u64 {
        let key = (name.to_string(), file.to_string());
        if let Some(&id) = self.function_ids.get(&key) {
            return id;
        }
        let id = self.functions.len() as u64 + 1;
        let name = strings.id(name);
        self.functions.push(Function {
            id,
            name,
            system_name: name,
            filename: strings.id(file),
        });
        self.function_ids.insert(key, id);
        id
    }

    /// The location of one frame of a resolved stack.
    fn location(&mut self, strings: &mut Strings, frame: &crate::records::Frame) -> u64 {
        if let Some(&id) = self.location_ids.get(&frame.ip) {
            return id;
        }
        let address = frame.ip as u64;
        let mapping_id = self.mapping(strings, address);
        let line = frame
            .symbols
            .iter()
            .map(|s| Line {
                function_id: self.function(strings, &s.name, s.file.as_deref().unwrap_or("")),
                line: i64::from(s.line.unwrap_or(0)),
            })
            .collect();
        let id = self.locations.len() as u64 + 1;
        self.locations.push(Location {
            id,
            mapping_id,
            address,
            line,
        });
        self.location_ids.insert(frame.ip, id);
        id
    }

    /// A location for samples without a call stack, named after why there is none.
    fn no_stack(&mut self, strings: &mut Strings) -> u64 {
        const KEY: usize = 0;
        if let Some(&id) = self.location_ids.get(&KEY) {
            return id;
        }
        let function_id = self.function(strings, "[no call stack: basic records]", "");
        let id = self.locations.len() as u64 + 1;
        self.locations.push(Location {
            id,
            mapping_id: 0,
            address: 0,
            line: vec![Line {
                function_id,
                line: 0,
            }],
        });
        self.location_ids.insert(KEY, id);
        id
    }
}

/// What an allocator records, for the comments.
fn describe(mode: RecordMode) -> String {
    match mode {
        RecordMode::Off => "records off now".to_string(),
        RecordMode::Basic => "every allocation (basic, no call stacks)".to_string(),
        RecordMode::Full { frames } => format!("every allocation, {frames} frames"),
        RecordMode::Sample { interval, frames } => {
            format!("one allocation per {interval} bytes on average (sampled), {frames} frames")
        }
    }
}

fn value(x: f64) -> i64 {
    x.round().max(0.0) as i64
}

/// Renders a resolved snapshot as gzip-compressed `profile.proto` bytes.
pub(crate) fn render(snapshot: &RecordsSnapshot) -> Vec<u8> {
    let mut strings = Strings::new();
    let mut frames = Frames::new();
    let value_type = |strings: &mut Strings, t: &str, u: &str| ValueType {
        r#type: strings.id(t),
        unit: strings.id(u),
    };
    let sample_type = vec![
        value_type(&mut strings, "alloc_objects", "count"),
        value_type(&mut strings, "alloc_space", "bytes"),
        value_type(&mut strings, "inuse_objects", "count"),
        value_type(&mut strings, "inuse_space", "bytes"),
    ];
    let period_type = Some(value_type(&mut strings, "space", "bytes"));
    let (allocator, path, bytes) = (
        strings.id("allocator"),
        strings.id("allocator_path"),
        strings.id("bytes"),
    );

    let sites: Vec<OwnSite> = owners::own_sites(snapshot);
    let mut samples = Vec::with_capacity(sites.len());
    for own in &sites {
        let site = &own.site;
        let mut location_id: Vec<u64> = snapshot
            .stack(site.stack)
            .map(|s| {
                s.frames
                    .iter()
                    .map(|f| frames.location(&mut strings, f))
                    .collect()
            })
            .unwrap_or_default();
        if location_id.is_empty() {
            location_id.push(frames.no_stack(&mut strings));
        }
        let mut label = vec![
            Label {
                key: allocator,
                str: strings.id(site.allocator),
                num: 0,
            },
            Label {
                key: path,
                str: strings.id(&own.chain.join("/")),
                num: 0,
            },
        ];
        if site.total_blocks > 0.0 {
            label.push(Label {
                key: bytes,
                str: 0,
                num: value(site.total_bytes / site.total_blocks),
            });
        }
        samples.push(Sample {
            location_id,
            value: vec![
                value(site.total_blocks),
                value(site.total_bytes),
                value(site.live_blocks),
                value(site.live_bytes),
            ],
            label,
        });
    }

    // The sampling interval of the allocators whose samples count (the smallest if they
    // differ); 1 when none samples (every allocation recorded).
    let counted: std::collections::HashSet<usize> =
        sites.iter().map(|s| s.site.allocator_index).collect();
    let period = snapshot
        .allocators
        .iter()
        .filter(|a| owners::counts(snapshot, a.index))
        .filter_map(|a| match a.mode {
            RecordMode::Sample { interval, .. } => Some(interval),
            _ => None,
        })
        .min()
        .unwrap_or(1);

    let mut comments = vec![
        "tagalloc heap profile: each block counted once, under the innermost \
                             allocator that recorded it (label allocator)"
            .to_string(),
    ];
    if sites.is_empty() {
        comments.push(format!("tagalloc: {}", owners::why_empty(snapshot)));
    }
    for a in &snapshot.allocators {
        if a.mode.is_on() || counted.contains(&a.index) {
            comments.push(format!("{}: {}", a.name, describe(a.mode)));
        }
    }
    let comment = comments.iter().map(|c| strings.id(c)).collect();

    let time_nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as i64);
    let profile = Profile {
        sample_type,
        sample: samples,
        mapping: frames.mappings,
        location: frames.locations,
        function: frames.functions,
        string_table: strings.table,
        time_nanos,
        duration_nanos: snapshot.taken_us.saturating_mul(1000) as i64,
        period_type,
        period: period as i64,
        comment,
    };
    let mut gz = GzEncoder::new(Vec::new(), Compression::default());
    // Writing to a Vec cannot fail.
    let _ = gz.write_all(&profile.encode_to_vec());
    gz.finish().unwrap_or_default()
}
