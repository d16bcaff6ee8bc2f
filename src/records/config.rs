//! `TAGALLOC_RECORDS` and `TAGALLOC_REPORT`: parsed without allocating, kept in statics.
//!
//! The environment is read once, the first time anything needs it: the
//! `SystemAllocator`'s first allocation (its settings word starts with a "not read yet"
//! flag), the registration of a declared allocator, or a call into [`records`](super).
//! Parsing works on bytes into a fixed-size [`RecordsConfig`], which stays in a static:
//! an allocator that registers later (statics register on first use) looks its name up
//! there when it registers. Nothing here allocates, so it can run inside the global
//! allocator before `main`.
//!
//! Syntax (names match an allocator's name or its description, ignoring ASCII case, as
//! O3DE does):
//!
//! ```text
//! TAGALLOC_RECORDS = entry ( ("," | ";") entry )*
//! entry            = NAME "=" MODE        NAME: an allocator, or "*" for every other one
//! MODE             = off | basic | full [":" FRAMES] | sample [":" BYTES [":" FRAMES]]
//!                    (also O3DE's 0..3 and RECORD_NO_RECORDS, RECORD_STACK_NEVER,
//!                     RECORD_STACK_IF_NO_FILE_LINE, RECORD_FULL)
//! BYTES            = digits [B | K | KB | KiB | M | MB | MiB | G | GB | GiB | T | TB | TiB]
//!                    (binary multiples whichever spelling; 1 to 2^48 - 1)
//! FRAMES           = 1 to 64 for full, 0 to 64 for sample (0 = no stacks); default 8
//! TAGALLOC_REPORT  = a path: the allocator table and the leak report are written there
//!                    when the process exits
//! ```
//!
//! A bad entry prints one line on stderr and is ignored (that allocator stays off); the
//! other entries still apply. A name that no allocator has taken by the time the process
//! exits gets one warning line then.

use super::mode::RecordMode;
use crate::fatal::StackText;
use crate::messages::warn;
use core::fmt::Write;

/// The most entries `TAGALLOC_RECORDS` may hold.
pub const MAX_ENTRIES: usize = 32;
/// The longest allocator name an entry may hold, in bytes.
pub const MAX_NAME: usize = 63;

/// One `NAME=MODE` entry.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RecordsEntry {
    name: [u8; MAX_NAME],
    len: u8,
    mode: RecordMode,
}

impl RecordsEntry {
    const EMPTY: Self = Self {
        name: [0; MAX_NAME],
        len: 0,
        mode: RecordMode::Off,
    };

    /// The allocator name as written (or `"*"`).
    pub fn name(&self) -> &str {
        // Only valid UTF-8 is ever stored (checked by the parser).
        core::str::from_utf8(&self.name[..self.len as usize]).unwrap_or("")
    }

    /// The mode asked for.
    pub fn mode(&self) -> RecordMode {
        self.mode
    }

    /// Whether this is the `*` entry.
    pub fn is_wildcard(&self) -> bool {
        self.name() == "*"
    }

    /// Whether the entry names an allocator with this name or description.
    pub fn matches(&self, name: &str, description: &str) -> bool {
        let me = &self.name[..self.len as usize];
        me.eq_ignore_ascii_case(name.as_bytes()) || me.eq_ignore_ascii_case(description.as_bytes())
    }
}

/// The parsed `TAGALLOC_RECORDS`: up to [`MAX_ENTRIES`] entries, in a fixed-size value.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RecordsConfig {
    entries: [RecordsEntry; MAX_ENTRIES],
    len: usize,
}

impl RecordsConfig {
    /// No entries.
    pub const EMPTY: Self = Self {
        entries: [RecordsEntry::EMPTY; MAX_ENTRIES],
        len: 0,
    };

    /// The entries, in the order written.
    pub fn entries(&self) -> &[RecordsEntry] {
        &self.entries[..self.len]
    }

    /// The position of the entry that decides the mode of an allocator with this name and
    /// description: the last entry naming it, else the last `*` entry.
    pub fn find(&self, name: &str, description: &str) -> Option<usize> {
        let entries = self.entries();
        entries
            .iter()
            .rposition(|e| !e.is_wildcard() && e.matches(name, description))
            .or_else(|| entries.iter().rposition(RecordsEntry::is_wildcard))
    }

    /// The mode for an allocator with this name and description, if an entry decides it.
    ///
    /// ```
    /// use tagalloc::records::{RecordMode, config::parse_records};
    ///
    /// let (config, problems) = parse_records(b"Script Canvas=full:4, *=basic");
    /// assert_eq!(problems.bad_entries, 0);
    /// assert_eq!(config.mode_for("ScriptCanvasAllocator", "script canvas"),
    ///            Some(RecordMode::Full { frames: 4 }));
    /// assert_eq!(config.mode_for("Physics", ""), Some(RecordMode::Basic));
    /// ```
    pub fn mode_for(&self, name: &str, description: &str) -> Option<RecordMode> {
        self.find(name, description).map(|i| self.entries[i].mode)
    }
}

/// What went wrong while parsing (see [`parse_records`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ParseProblems {
    /// Entries ignored because they could not be parsed.
    pub bad_entries: usize,
    /// The first bad entry (its byte range in the input) and why it was refused.
    pub first: Option<(usize, usize, &'static str)>,
}

/// Parses a `TAGALLOC_RECORDS` value. Bad entries are left out and counted; everything
/// else is kept. An empty value is an empty configuration.
///
/// ```
/// use tagalloc::records::{RecordMode, config::parse_records};
///
/// let (config, problems) = parse_records(b"Script Canvas=full,SystemAllocator=sample:512KiB");
/// assert_eq!(problems.bad_entries, 0);
/// assert_eq!(config.entries()[1].mode(), RecordMode::Sample { interval: 512 << 10, frames: 8 });
///
/// let (config, problems) = parse_records(b"Physics=sometimes, Audio=basic");
/// assert_eq!(problems.bad_entries, 1);
/// assert_eq!(config.entries().len(), 1); // Audio still applies
/// ```
pub fn parse_records(text: &[u8]) -> (RecordsConfig, ParseProblems) {
    let mut config = RecordsConfig::EMPTY;
    let mut problems = ParseProblems::default();
    let mut start = 0;
    while start <= text.len() {
        let end = text[start..]
            .iter()
            .position(|&b| b == b',' || b == b';')
            .map_or(text.len(), |i| start + i);
        let entry = &text[start..end];
        if !entry.trim_ascii().is_empty() {
            match parse_entry(entry) {
                Ok(_) if config.len == MAX_ENTRIES => {
                    note(&mut problems, start, end, "more than 32 entries");
                }
                Ok(parsed) => {
                    config.entries[config.len] = parsed;
                    config.len += 1;
                }
                Err(why) => note(&mut problems, start, end, why),
            }
        }
        start = end + 1;
    }
    (config, problems)
}

fn note(problems: &mut ParseProblems, start: usize, end: usize, why: &'static str) {
    problems.bad_entries += 1;
    if problems.first.is_none() {
        problems.first = Some((start, end, why));
    }
}

fn parse_entry(entry: &[u8]) -> Result<RecordsEntry, &'static str> {
    let eq = entry
        .iter()
        .position(|&b| b == b'=')
        .ok_or("expected NAME=MODE")?;
    let name = entry[..eq].trim_ascii();
    if name.is_empty() {
        return Err("missing allocator name before `=`");
    }
    if name.len() > MAX_NAME {
        return Err("allocator name longer than 63 bytes");
    }
    if core::str::from_utf8(name).is_err() {
        return Err("allocator name is not UTF-8");
    }
    let mode = parse_mode(&entry[eq + 1..])?;
    let mut out = RecordsEntry::EMPTY;
    out.name[..name.len()].copy_from_slice(name);
    out.len = name.len() as u8;
    out.mode = mode;
    Ok(out)
}

/// Parses one mode: `off`, `basic`, `full[:FRAMES]`, `sample[:BYTES[:FRAMES]]` (see the
/// [module docs](self)).
///
/// ```
/// use tagalloc::records::{RecordMode, config::parse_mode};
///
/// assert_eq!(parse_mode(b"full:16"), Ok(RecordMode::Full { frames: 16 }));
/// assert_eq!(parse_mode(b"sample:1MiB:4"), Ok(RecordMode::Sample { interval: 1 << 20, frames: 4 }));
/// assert_eq!(parse_mode(b"RECORD_STACK_NEVER"), Ok(RecordMode::Basic));
/// assert!(parse_mode(b"full:0").is_err());
/// ```
pub fn parse_mode(text: &[u8]) -> Result<RecordMode, &'static str> {
    let text = text.trim_ascii();
    let mut parts = text.splitn(3, |&b| b == b':');
    let word = parts.next().unwrap_or_default().trim_ascii();
    let first = parts.next().map(<[u8]>::trim_ascii);
    let second = parts.next().map(<[u8]>::trim_ascii);
    let is = |names: &[&str]| {
        names
            .iter()
            .any(|n| word.eq_ignore_ascii_case(n.as_bytes()))
    };
    let no_args = |mode| match first {
        None => Ok(mode),
        Some(_) => Err("this mode takes no `:` argument"),
    };
    if word.is_empty() {
        Err("missing mode after `=`")
    } else if is(&["off", "none", "0", "RECORD_NO_RECORDS"]) {
        no_args(RecordMode::Off)
    } else if is(&["basic", "1", "RECORD_STACK_NEVER"]) {
        no_args(RecordMode::Basic)
    } else if is(&[
        "full",
        "2",
        "3",
        "RECORD_STACK_IF_NO_FILE_LINE",
        "RECORD_FULL",
    ]) {
        if second.is_some() {
            return Err("full takes one argument: full[:FRAMES]");
        }
        let frames = match first {
            None => RecordMode::DEFAULT_FRAMES,
            Some(f) => parse_frames(f, 1)?,
        };
        Ok(RecordMode::Full { frames })
    } else if is(&["sample", "sampled", "sampling"]) {
        let interval = match first {
            None => RecordMode::DEFAULT_SAMPLE_INTERVAL,
            Some(b) => parse_bytes(b)?,
        };
        if interval == 0 {
            return Err("sampling interval must be at least 1 byte");
        }
        if interval > RecordMode::MAX_SAMPLE_INTERVAL {
            return Err("sampling interval too large (at most 2^48 - 1 bytes)");
        }
        let frames = match second {
            None => RecordMode::DEFAULT_FRAMES,
            Some(f) => parse_frames(f, 0)?,
        };
        Ok(RecordMode::Sample { interval, frames })
    } else {
        Err("unknown mode (expected off, basic, full[:FRAMES] or sample[:BYTES[:FRAMES]])")
    }
}

fn parse_frames(text: &[u8], min: u64) -> Result<u8, &'static str> {
    let n = parse_number(text)
        .map_err(|_| "frames must be a number from 1 to 64 (0 to 64 for sample)")?;
    if n < min || n > u64::from(RecordMode::MAX_FRAMES) {
        return Err("frames must be a number from 1 to 64 (0 to 64 for sample)");
    }
    Ok(n as u8)
}

fn parse_number(text: &[u8]) -> Result<u64, &'static str> {
    if text.is_empty() {
        return Err("expected a number");
    }
    let mut n: u64 = 0;
    for &b in text {
        if !b.is_ascii_digit() {
            return Err("expected a number");
        }
        n = n
            .checked_mul(10)
            .and_then(|v| v.checked_add(u64::from(b - b'0')))
            .ok_or("number too large")?;
    }
    Ok(n)
}

/// Parses a byte count with an optional binary unit: `4096`, `64K`, `512KiB`, `1 MB`,
/// `2GiB` (K, KB and KiB all mean 1024, as in jemalloc's and O3DE's settings).
///
/// ```
/// use tagalloc::records::config::parse_bytes;
///
/// assert_eq!(parse_bytes(b"512KiB"), Ok(512 * 1024));
/// assert_eq!(parse_bytes(b"3 mb"), Ok(3 << 20));
/// assert!(parse_bytes(b"12 parsecs").is_err());
/// assert!(parse_bytes(b"99999999999999999999").is_err());
/// ```
pub fn parse_bytes(text: &[u8]) -> Result<u64, &'static str> {
    let text = text.trim_ascii();
    let digits = text.iter().take_while(|b| b.is_ascii_digit()).count();
    if digits == 0 {
        return Err("expected a byte count such as 4096, 64KiB or 1MiB");
    }
    let n = parse_number(&text[..digits])?;
    let unit = text[digits..].trim_ascii();
    let is = |names: &[&str]| {
        names
            .iter()
            .any(|u| unit.eq_ignore_ascii_case(u.as_bytes()))
    };
    let shift = if is(&["", "b"]) {
        0
    } else if is(&["k", "kb", "kib"]) {
        10
    } else if is(&["m", "mb", "mib"]) {
        20
    } else if is(&["g", "gb", "gib"]) {
        30
    } else if is(&["t", "tb", "tib"]) {
        40
    } else {
        return Err("unknown unit (expected B, KiB, MiB, GiB or TiB)");
    };
    n.checked_mul(1 << shift).ok_or("number too large")
}

/// Prints the one warning line for a `TAGALLOC_RECORDS` value with bad entries.
pub(crate) fn warn_problems(var: &str, text: &[u8], problems: &ParseProblems) {
    let Some((start, end, why)) = problems.first else {
        return;
    };
    let entry = &text[start..end.min(start + 80)];
    let shown = core::str::from_utf8(entry.trim_ascii()).unwrap_or("<not UTF-8>");
    let mut line = StackText::<384>::new();
    let _ = write!(line, "tagalloc: {var} entry {shown:?} ignored: {why}");
    if problems.bad_entries > 1 {
        let _ = write!(line, " (and {} more bad entries)", problems.bad_entries - 1);
    }
    let _ = line.write_str("; records stay off for it\n");
    warn(line.as_bytes());
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(text: &str) -> (RecordsConfig, ParseProblems) {
        parse_records(text.as_bytes())
    }

    #[test]
    fn miri_valid_lists_parse() {
        let (c, p) = parse("Script Canvas=full,SystemAllocator=sample:512KiB");
        assert_eq!(p, ParseProblems::default());
        assert_eq!(c.entries().len(), 2);
        assert_eq!(c.entries()[0].name(), "Script Canvas");
        assert_eq!(c.entries()[0].mode(), RecordMode::full());
        assert_eq!(
            c.mode_for("SystemAllocator", "General-purpose HPHA heap"),
            Some(RecordMode::Sample {
                interval: 512 * 1024,
                frames: 8
            })
        );
        // Matching is case-insensitive, on the name or the description.
        assert_eq!(
            c.mode_for("ScriptCanvasAllocator", "SCRIPT CANVAS"),
            Some(RecordMode::full())
        );
        assert_eq!(c.mode_for("Other", ""), None);

        let (c, p) = parse(" a = basic ; b=FULL:3;c=sample ;d=sample:4096:0; e=off,,");
        assert_eq!(p.bad_entries, 0);
        let modes: Vec<_> = c.entries().iter().map(|e| (e.name(), e.mode())).collect();
        assert_eq!(
            modes,
            [
                ("a", RecordMode::Basic),
                ("b", RecordMode::Full { frames: 3 }),
                ("c", RecordMode::sample()),
                (
                    "d",
                    RecordMode::Sample {
                        interval: 4096,
                        frames: 0
                    }
                ),
                ("e", RecordMode::Off),
            ]
        );
    }

    #[test]
    fn miri_o3de_names_and_numbers_parse() {
        assert_eq!(parse_mode(b"0"), Ok(RecordMode::Off));
        assert_eq!(parse_mode(b"RECORD_NO_RECORDS"), Ok(RecordMode::Off));
        assert_eq!(parse_mode(b"1"), Ok(RecordMode::Basic));
        assert_eq!(parse_mode(b"2"), Ok(RecordMode::full()));
        assert_eq!(parse_mode(b"record_full"), Ok(RecordMode::full()));
        assert_eq!(parse_mode(b"3:5"), Ok(RecordMode::Full { frames: 5 }));
    }

    #[test]
    fn miri_wildcard_loses_to_a_named_entry_and_last_entry_wins() {
        let (c, _) = parse("*=basic, Physics=full, physics=off");
        assert_eq!(c.mode_for("Physics", ""), Some(RecordMode::Off));
        assert_eq!(c.mode_for("Audio", ""), Some(RecordMode::Basic));
        let (c, _) = parse("Physics=full, *=sample");
        assert_eq!(c.mode_for("Physics", ""), Some(RecordMode::full()));
    }

    #[test]
    fn miri_empty_and_blank_values_are_empty_configurations() {
        for text in ["", "   ", ",", " ; , ;"] {
            let (c, p) = parse(text);
            assert!(c.entries().is_empty(), "{text:?}");
            assert_eq!(p.bad_entries, 0, "{text:?}");
        }
    }

    #[test]
    fn miri_bad_entries_are_dropped_and_the_rest_kept() {
        let text = "Physics=sometimes, Audio=basic, =full, Render, UI=full:0, X=sample:0";
        let (c, p) = parse(text);
        assert_eq!(p.bad_entries, 5);
        assert_eq!(c.entries().len(), 1);
        assert_eq!(c.entries()[0].name(), "Audio");
        let (start, end, why) = p.first.unwrap();
        assert_eq!(&text[start..end], "Physics=sometimes");
        assert!(why.starts_with("unknown mode"), "{why}");
    }

    #[test]
    fn miri_garbage_never_panics_and_never_yields_a_mode() {
        let garbage: [&[u8]; 8] = [
            b"\xff\xfe=\x00full",
            b"=",
            b"==",
            b"a=b=c",
            b"\x00\x01\x02",
            b"Render=full:9999999999999999999999999",
            b"Render=sample:1:2:3",
            b"Render=basic:1",
        ];
        for text in garbage {
            let (c, p) = parse_records(text);
            assert!(c.entries().is_empty(), "{text:?}");
            assert!(p.bad_entries >= 1, "{text:?}");
        }
        // Every byte value at every position of a short entry: no panic.
        for b in 0..=255u8 {
            let text = [b'A', b'=', b'f', b, b'l', b':', b];
            let _ = parse_records(&text);
        }
    }

    #[test]
    fn miri_huge_numbers_are_refused_not_wrapped() {
        assert_eq!(parse_bytes(b"18446744073709551615"), Ok(u64::MAX));
        assert!(parse_bytes(b"18446744073709551616").is_err());
        assert!(parse_bytes(b"17179869184 GiB").is_err()); // 2^64 bytes
        assert!(parse_mode(b"sample:256TiB").is_err()); // 2^48, one past the limit
        assert_eq!(
            parse_mode(b"sample:281474976710655"),
            Ok(RecordMode::Sample {
                interval: RecordMode::MAX_SAMPLE_INTERVAL,
                frames: 8
            })
        );
        assert!(parse_mode(b"full:65").is_err());
        assert!(parse_mode(b"full:256").is_err());
        assert_eq!(parse_mode(b"full:64"), Ok(RecordMode::Full { frames: 64 }));
    }

    #[test]
    fn miri_names_too_long_and_too_many_entries_are_refused() {
        let long = format!("{}=basic", "n".repeat(64));
        let (c, p) = parse(&long);
        assert!(c.entries().is_empty());
        assert_eq!(p.first.unwrap().2, "allocator name longer than 63 bytes");
        let just_fits = format!("{}=basic", "n".repeat(63));
        assert_eq!(parse(&just_fits).0.entries().len(), 1);

        let many: Vec<String> = (0..40).map(|i| format!("A{i}=basic")).collect();
        let (c, p) = parse(&many.join(","));
        assert_eq!(c.entries().len(), MAX_ENTRIES);
        assert_eq!(p.bad_entries, 40 - MAX_ENTRIES);
        assert_eq!(p.first.unwrap().2, "more than 32 entries");
    }

    #[test]
    fn miri_byte_units() {
        assert_eq!(parse_bytes(b"1"), Ok(1));
        assert_eq!(parse_bytes(b"1b"), Ok(1));
        assert_eq!(parse_bytes(b"2k"), Ok(2048));
        assert_eq!(parse_bytes(b"2 KB"), Ok(2048));
        assert_eq!(parse_bytes(b"1MiB"), Ok(1 << 20));
        assert_eq!(parse_bytes(b"1g"), Ok(1 << 30));
        assert_eq!(parse_bytes(b"1TiB"), Ok(1 << 40));
        assert!(parse_bytes(b"").is_err());
        assert!(parse_bytes(b"KiB").is_err());
        assert!(parse_bytes(b"-1").is_err());
        assert!(parse_bytes(b"1.5MiB").is_err());
    }
}
