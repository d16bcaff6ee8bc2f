//! Reads a pprof profile (gzip-compressed `profile.proto`) back, with message structs of its
//! own (the fields the tests check), and runs `go tool pprof` on one when Go is installed.

use prost::Message;
use std::io::Read;
use std::process::Command;

#[derive(Clone, PartialEq, Message)]
struct Profile {
    #[prost(message, repeated, tag = "1")]
    sample_type: Vec<ValueType>,
    #[prost(message, repeated, tag = "2")]
    sample: Vec<Sample>,
    #[prost(string, repeated, tag = "6")]
    string_table: Vec<String>,
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

/// One sample: its values and its string labels (key, value).
pub type DecodedSample = (Vec<i64>, Vec<(String, String)>);

/// A decoded profile, its strings looked up.
#[derive(Debug)]
pub struct Decoded {
    /// `type/unit` of each value.
    pub sample_types: Vec<String>,
    /// `type/unit` of the period, and the period.
    pub period: (String, i64),
    pub samples: Vec<DecodedSample>,
    pub comments: Vec<String>,
}

impl Decoded {
    /// The sum of value `i` over the samples whose label `key` is `value` (any with `None`).
    pub fn total(&self, i: usize, label: Option<(&str, &str)>) -> i64 {
        self.samples
            .iter()
            .filter(|(_, labels)| {
                label.is_none_or(|(k, v)| labels.iter().any(|(lk, lv)| lk == k && lv == v))
            })
            .map(|(values, _)| values[i])
            .sum()
    }
}

/// Decompresses and decodes `gz`; panics if it is not a gzip-compressed `profile.proto`.
pub fn decode(gz: &[u8]) -> Decoded {
    let mut bytes = Vec::new();
    flate2::read::GzDecoder::new(gz)
        .read_to_end(&mut bytes)
        .expect("gzip");
    let p = Profile::decode(&bytes[..]).expect("profile.proto");
    let s = |i: i64| p.string_table[i as usize].clone();
    let vt = |v: &ValueType| format!("{}/{}", s(v.r#type), s(v.unit));
    Decoded {
        sample_types: p.sample_type.iter().map(vt).collect(),
        period: (p.period_type.as_ref().map(vt).unwrap_or_default(), p.period),
        samples: p
            .sample
            .iter()
            .map(|x| {
                let labels = x
                    .label
                    .iter()
                    .filter(|l| l.str != 0)
                    .map(|l| (s(l.key), s(l.str)))
                    .collect();
                (x.value.clone(), labels)
            })
            .collect(),
        comments: p.comment.iter().map(|&c| s(c)).collect(),
    }
}

/// Whether `go tool pprof` runs here; prints one line when it does not.
pub fn go_pprof_installed() -> bool {
    let ok = Command::new("go")
        .args(["tool", "pprof", "-h"])
        .output()
        .is_ok_and(|o| !o.stdout.is_empty() || !o.stderr.is_empty());
    if !ok {
        eprintln!("skipped: the go tool pprof checks need Go (Debian: apt-get install golang-go)");
    }
    ok
}

/// The output of `go tool pprof <args> <file>`; panics if it fails.
pub fn go_pprof(args: &[&str], file: &std::path::Path) -> String {
    let out = Command::new("go")
        .args(["tool", "pprof"])
        .args(args)
        .arg(file)
        .output()
        .expect("go runs");
    assert!(
        out.status.success(),
        "go tool pprof {args:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}
