//! Start-up configuration from the environment, read without allocating.
//!
//! The global allocator reads its settings the first time it needs memory, which can be
//! before `main` and before std has anything set up, so the variables are read with
//! `getenv` and parsed from bytes: no `String`, no `std::env`. A bad value prints one line
//! on stderr and the default stays in force; it never aborts the program.
//!
//! | variable | meaning | default |
//! |---|---|---|
//! | `TAGALLOC_PURGE_DELAY_MS` | milliseconds free memory stays mapped before it goes back to the OS; `0` = at once, `never` = only on `garbage_collect` | 1000 |
//! | `TAGALLOC_HUGE_PAGES` | transparent huge pages for the heaps' new mappings: `never`, `auto` (once 8 MiB are mapped, for heaps with 4 MiB of their own; stops after two faults stalled on compaction), `always` | `auto` |
//! | `TAGALLOC_THREAD_POINTER` | `off` reaches the thread caches only through `thread_local!` (a little slower), as in a shared library; an escape hatch for unusual loaders | `auto` |
//! | `TAGALLOC_RECORDS` | allocation records per allocator, e.g. `Script Canvas=full,SystemAllocator=sample:512KiB` (syntax in [`records::config`](crate::records::config)) | all off |
//! | `TAGALLOC_REPORT` | a path: the allocator table and the leak report are written there at exit | none |
//! | `TAGALLOC_DHAT` | a path: a DHAT profile of the records is written there at exit (open it in DHAT's `dh_view.html` or the Firefox Profiler) | none |
//! | `TAGALLOC_SAMPLE_SEED` | a number: sampled records draw from generators seeded from it instead of the clock, so a single-threaded program samples the same blocks in every run | clock |
//! | `TAGALLOC_PPROF` | a path: a pprof heap profile of the records is written there at exit (`go tool pprof -http=:8080 <path>`) | none |
//!
//! A path given to `TAGALLOC_REPORT`, `TAGALLOC_DHAT` or `TAGALLOC_PPROF` that cannot be
//! written (its directory missing or not writable) is said on stderr when the variables are
//! read, not only at exit.

use crate::fatal::StackText;
use crate::messages::warn;
use core::ffi::CStr;
use core::fmt::Write;
use core::time::Duration;

/// Default purge delay of the global allocator, in milliseconds (mimalloc's v3 default too).
pub const DEFAULT_PURGE_DELAY_MS: u64 = 1000;

/// A purge-delay setting: `Some(delay)`, or `None` for "only on `garbage_collect`".
pub type PurgeDelay = Option<Duration>;

/// Parses a purge delay: a number of milliseconds, or `never` / `off`.
pub fn parse_purge_delay(text: &[u8]) -> Result<PurgeDelay, &'static str> {
    let text = text.trim_ascii();
    if text.eq_ignore_ascii_case(b"never") || text.eq_ignore_ascii_case(b"off") {
        return Ok(None);
    }
    if text.is_empty() {
        return Err("empty value");
    }
    let mut ms: u64 = 0;
    for &b in text {
        if !b.is_ascii_digit() {
            return Err("expected a number of milliseconds or `never`");
        }
        ms = ms
            .checked_mul(10)
            .and_then(|v| v.checked_add(u64::from(b - b'0')))
            .ok_or("number too large")?;
    }
    Ok(Some(Duration::from_millis(ms)))
}

/// The value of an environment variable as bytes, without allocating. `name` must end in
/// a NUL byte.
pub(crate) fn env_bytes(name: &CStr) -> Option<&'static [u8]> {
    // SAFETY: `name` is NUL-terminated; getenv returns null or a NUL-terminated string that
    // stays valid as long as nobody modifies the environment (the usual getenv caveat).
    unsafe {
        let p = libc::getenv(name.as_ptr());
        (!p.is_null()).then(|| CStr::from_ptr(p).to_bytes())
    }
}

/// Prints `tagalloc: <name>=<value> ignored: <why>` on stderr without allocating.
pub(crate) fn warn_bad_value(name: &str, value: &[u8], why: &str) {
    let mut text = StackText::<256>::new();
    let shown = core::str::from_utf8(&value[..value.len().min(64)]).unwrap_or("<not UTF-8>");
    let _ = writeln!(text, "tagalloc: {name}={shown:?} ignored: {why}");
    warn(text.as_bytes());
}

/// The purge delay the environment asks for, or the default; warns about bad values.
pub(crate) fn purge_delay_from_env() -> PurgeDelay {
    const NAME: &CStr = c"TAGALLOC_PURGE_DELAY_MS";
    let default = Some(Duration::from_millis(DEFAULT_PURGE_DELAY_MS));
    match env_bytes(NAME) {
        None => default,
        Some(value) => parse_purge_delay(value).unwrap_or_else(|why| {
            warn_bad_value("TAGALLOC_PURGE_DELAY_MS", value, why);
            default
        }),
    }
}

/// When the heaps' new mappings (small-block segments, large-block chunks, blocks with their
/// own mapping) ask for transparent huge pages. Whatever the setting, the OS layer stops
/// asking after two first faults of a huge page each took over a millisecond of CPU time
/// (the kernel compacting memory to find one; see `OsStats::huge_page_stalls`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HugePages {
    /// Once the process has mapped 8 MiB through the OS layer, for a heap that has mapped
    /// 4 MiB itself (the default): big heaps get fewer TLB misses, small programs and heaps
    /// used lightly (scoped tags with a few blocks) keep a small resident set.
    Auto,
    /// From the first mapping.
    Always,
    /// Never: the smallest resident set for heaps that are sparse or short-lived.
    Never,
}

/// Parses `auto`, `always`/`1`/`on` or `never`/`0`/`off`.
pub fn parse_huge_pages(text: &[u8]) -> Result<HugePages, &'static str> {
    let t = text.trim_ascii();
    let is = |words: &[&str]| words.iter().any(|w| t.eq_ignore_ascii_case(w.as_bytes()));
    if is(&["auto"]) {
        Ok(HugePages::Auto)
    } else if is(&["always", "1", "on", "yes"]) {
        Ok(HugePages::Always)
    } else if is(&["never", "0", "off", "no"]) {
        Ok(HugePages::Never)
    } else {
        Err("expected `auto`, `always` or `never`")
    }
}

/// The huge-page setting the environment asks for (default `Auto`, as mimalloc backs its
/// heap with huge pages by default: measured in docs/performance.md); warns about bad values.
pub(crate) fn huge_pages_from_env() -> HugePages {
    match env_bytes(c"TAGALLOC_HUGE_PAGES") {
        None => HugePages::Auto,
        Some(value) => parse_huge_pages(value).unwrap_or_else(|why| {
            warn_bad_value("TAGALLOC_HUGE_PAGES", value, why);
            HugePages::Auto
        }),
    }
}

/// Parses `TAGALLOC_THREAD_POINTER`: whether the fast paths may reach the thread cache
/// from the thread pointer (`auto`, the default) or only through `thread_local!` (`off`).
pub fn parse_thread_pointer(text: &[u8]) -> Result<bool, &'static str> {
    let text = text.trim_ascii();
    let is = |words: &[&str]| {
        words
            .iter()
            .any(|w| text.eq_ignore_ascii_case(w.as_bytes()))
    };
    if is(&["auto", "on", "1", "yes"]) {
        Ok(true)
    } else if is(&["off", "0", "no", "never"]) {
        Ok(false)
    } else {
        Err("expected `auto` or `off`")
    }
}

/// Whether the environment allows the thread-pointer fast path; warns about bad values.
pub(crate) fn thread_pointer_from_env() -> bool {
    match env_bytes(c"TAGALLOC_THREAD_POINTER") {
        None => true,
        Some(value) => parse_thread_pointer(value).unwrap_or_else(|why| {
            warn_bad_value("TAGALLOC_THREAD_POINTER", value, why);
            true
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn thread_pointer_settings_parse_or_explain() {
        assert_eq!(parse_thread_pointer(b"auto"), Ok(true));
        assert_eq!(parse_thread_pointer(b" OFF "), Ok(false));
        assert_eq!(parse_thread_pointer(b"0"), Ok(false));
        assert!(parse_thread_pointer(b"").is_err());
        assert!(parse_thread_pointer(b"fast").is_err());
    }

    #[test]
    fn purge_delays_parse_or_explain() {
        assert_eq!(
            parse_purge_delay(b"250"),
            Ok(Some(Duration::from_millis(250)))
        );
        assert_eq!(parse_purge_delay(b" 0 "), Ok(Some(Duration::ZERO)));
        assert_eq!(parse_purge_delay(b"never"), Ok(None));
        assert_eq!(parse_purge_delay(b"OFF"), Ok(None));
        assert!(parse_purge_delay(b"").is_err());
        assert!(parse_purge_delay(b"12ms").is_err());
        assert!(parse_purge_delay(b"-5").is_err());
        assert!(parse_purge_delay(b"99999999999999999999999").is_err());
        assert!(parse_purge_delay("\u{1F600}".as_bytes()).is_err());
    }

    #[test]
    fn huge_page_settings_parse_or_explain() {
        assert_eq!(parse_huge_pages(b"auto"), Ok(HugePages::Auto));
        assert_eq!(parse_huge_pages(b" ALWAYS"), Ok(HugePages::Always));
        assert_eq!(parse_huge_pages(b"0"), Ok(HugePages::Never));
        assert!(parse_huge_pages(b"").is_err());
        assert!(parse_huge_pages(b"sometimes").is_err());
    }
}
