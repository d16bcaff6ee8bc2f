//! Applying `TAGALLOC_RECORDS` (parsed by [`config`](super::config)), `TAGALLOC_SAMPLE_SEED`
//! (see [`set_sample_seed`](super::set_sample_seed)) and the files written at exit:
//! `TAGALLOC_REPORT` (the text report), `TAGALLOC_DHAT` (a DHAT profile) and
//! `TAGALLOC_PPROF` (a pprof heap profile).
//!
//! The variables are read once, under a three-state flag (unread, being read, read); the
//! parsed entries stay in a static for the life of the process. When they have been read,
//! every allocator already registered gets its mode; an allocator that registers later
//! looks its name up at registration ([`on_register`]). A mode set in code is never
//! overridden.
//!
//! Everything here runs on the allocation path (inside the `SystemAllocator`'s first call or
//! a handle's registration), so it allocates nothing through Rust's allocator: `getenv`,
//! byte parsing, statics, `stat`/`access` on the exit files' paths, `atexit` (which uses the
//! C library's own memory).
//!
//! An exit file whose path cannot be written now (its directory missing or not writable,
//! the path a directory) is said at once, in one line on stderr: finding out only when the
//! program ends, possibly hours later, would waste the run. It is still tried at exit, in
//! case the program creates the directory meanwhile.

use super::config::{MAX_ENTRIES, ParseProblems, RecordsConfig, parse_records, warn_problems};
use super::guard::Busy;
use crate::config::env_bytes;
use crate::fatal::StackText;
use crate::messages::warn;
use crate::registry::{self, Registration};
use core::cell::UnsafeCell;
use core::fmt::Write;
use core::sync::atomic::{AtomicBool, AtomicU8, Ordering::*};

const UNREAD: u8 = 0;
const READING: u8 = 1;
const READ: u8 = 2;
static STATE: AtomicU8 = AtomicU8::new(UNREAD);

/// A value written once (while [`STATE`] is `READING`, by one thread) and only read after.
struct WriteOnce<T>(UnsafeCell<T>);
// SAFETY: written only by the thread that moved STATE to READING, before it publishes READ
// with release ordering; read only after an acquire load sees READ.
unsafe impl<T: Send> Sync for WriteOnce<T> {}

static CONFIG: WriteOnce<RecordsConfig> = WriteOnce(UnsafeCell::new(RecordsConfig::EMPTY));
static MATCHED: [AtomicBool; MAX_ENTRIES] = [const { AtomicBool::new(false) }; MAX_ENTRIES];

/// Longest exit-file path kept.
const MAX_PATH: usize = 4096;

/// A file written at exit, asked for with an environment variable.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum ExitFile {
    /// `TAGALLOC_REPORT`: the allocator table and tree, then the leak report.
    Report,
    /// `TAGALLOC_DHAT`: a DHAT profile of the records.
    Dhat,
    /// `TAGALLOC_PPROF`: a pprof heap profile of the records.
    Pprof,
}

impl ExitFile {
    const ALL: [ExitFile; 3] = [ExitFile::Report, ExitFile::Dhat, ExitFile::Pprof];

    fn variable(self) -> &'static core::ffi::CStr {
        match self {
            ExitFile::Report => c"TAGALLOC_REPORT",
            ExitFile::Dhat => c"TAGALLOC_DHAT",
            ExitFile::Pprof => c"TAGALLOC_PPROF",
        }
    }

    fn name(self) -> &'static str {
        match self {
            ExitFile::Report => "TAGALLOC_REPORT",
            ExitFile::Dhat => "TAGALLOC_DHAT",
            ExitFile::Pprof => "TAGALLOC_PPROF",
        }
    }
}

/// The exit files' paths (bytes, length), by [`ExitFile`].
static EXIT_PATHS: [WriteOnce<([u8; MAX_PATH], usize)>; 3] =
    [const { WriteOnce(UnsafeCell::new(([0; MAX_PATH], 0))) }; 3];

/// Reads the environment if nobody has yet; returns once it has been read.
#[inline]
pub(crate) fn ensure_read() {
    if STATE.load(Acquire) != READ {
        read_slow();
    }
}

/// Whether the environment has been read.
pub(crate) fn is_read() -> bool {
    STATE.load(Acquire) == READ
}

#[cold]
#[inline(never)]
fn read_slow() {
    loop {
        match STATE.compare_exchange(UNREAD, READING, Acquire, Acquire) {
            Ok(_) => break,
            Err(READ) => return,
            Err(_) => {
                // Another thread is reading (it allocates nothing, so it cannot be waiting
                // for us); if it is this thread, re-entered somehow, give up rather than spin.
                if super::guard::is_busy() {
                    return;
                }
                core::hint::spin_loop();
                std::thread::yield_now();
            }
        }
    }
    let _busy = Busy::enter();
    let mut wants_exit_hook = false;
    if let Some(text) = env_bytes(c"TAGALLOC_RECORDS") {
        let (config, problems): (RecordsConfig, ParseProblems) = parse_records(text);
        warn_problems("TAGALLOC_RECORDS", text, &problems);
        // SAFETY: this thread moved STATE to READING; nobody reads CONFIG before READ.
        unsafe { *CONFIG.0.get() = config };
        wants_exit_hook |= !config.entries().is_empty();
    }
    if let Some(text) = env_bytes(c"TAGALLOC_SAMPLE_SEED") {
        match parse_seed(text) {
            Some(seed) => super::sample::set_sample_seed(Some(seed)),
            None => crate::config::warn_bad_value(
                "TAGALLOC_SAMPLE_SEED",
                text,
                "expected a number (0 to 18446744073709551615)",
            ),
        }
    }
    for (i, file) in ExitFile::ALL.into_iter().enumerate() {
        let Some(path) = env_bytes(file.variable()) else {
            continue;
        };
        let path = path.trim_ascii();
        if path.is_empty() {
            crate::config::warn_bad_value(file.name(), path, "empty path");
        } else if path.len() > MAX_PATH {
            crate::config::warn_bad_value(file.name(), path, "path longer than 4096 bytes");
        } else {
            // SAFETY: as above: written before READ is published.
            unsafe {
                let slot = &mut *EXIT_PATHS[i].0.get();
                slot.0[..path.len()].copy_from_slice(path);
                slot.1 = path.len();
            }
            warn_if_unwritable(file, path);
            wants_exit_hook = true;
        }
    }
    crate::guarded::read_env();
    STATE.store(READ, Release);
    for entry in registry::allocators() {
        apply(entry);
    }
    registry::SYSTEM.records().clear_pending_env();
    registry::SYSTEM.records_changed();
    if wants_exit_hook {
        // SAFETY: `at_exit` is a plain `extern "C" fn()` that lives for the whole process.
        if unsafe { libc::atexit(at_exit) } != 0 {
            warn(b"tagalloc: atexit failed; no exit report will be written\n");
        }
    }
}

/// A decimal `u64`, spaces around it allowed.
fn parse_seed(text: &[u8]) -> Option<u64> {
    let text = text.trim_ascii();
    if text.is_empty() {
        return None;
    }
    text.iter().try_fold(0u64, |n, &b| {
        b.is_ascii_digit()
            .then(|| n.checked_mul(10)?.checked_add(u64::from(b - b'0')))?
    })
}

/// The parsed `TAGALLOC_RECORDS` (empty until read).
pub(crate) fn config() -> &'static RecordsConfig {
    if is_read() {
        // SAFETY: READ was observed with acquire ordering; CONFIG is never written again.
        unsafe { &*CONFIG.0.get() }
    } else {
        &RecordsConfig::EMPTY
    }
}

/// The path the environment gives for `file`, if any.
pub(crate) fn exit_path(file: ExitFile) -> Option<&'static [u8]> {
    if !is_read() {
        return None;
    }
    let i = ExitFile::ALL.iter().position(|&f| f == file)?;
    // SAFETY: as in `config`.
    let (bytes, len) = unsafe { &*EXIT_PATHS[i].0.get() };
    (*len > 0).then(|| &bytes[..*len])
}

/// Says on stderr, in one line and without allocating, when `path` cannot be written now.
fn warn_if_unwritable(file: ExitFile, path: &[u8]) {
    if let Err((checked, errno)) = writable(path) {
        let mut line = StackText::<512>::new();
        let _ = write!(
            line,
            "tagalloc: {}={} cannot be written: ",
            file.name(),
            Shown(path)
        );
        let _ = match errno {
            libc::EISDIR => write!(line, "it is a directory"),
            _ => {
                let mut text = [0u8; 128];
                // SAFETY: `text` is writable for its length; the XSI strerror_r writes a
                // NUL-terminated message into it (truncated if need be).
                let ok = unsafe { libc::strerror_r(errno, text.as_mut_ptr().cast(), text.len()) };
                let end = text.iter().position(|&b| b == 0).unwrap_or(text.len());
                let why = if ok == 0 {
                    core::str::from_utf8(&text[..end]).unwrap_or("error")
                } else {
                    "error"
                };
                write!(line, "{}: {why}", Shown(checked))
            }
        };
        let _ = line.write_str(" (checked at start-up; it is tried again at exit)\n");
        warn(line.as_bytes());
    }
}

/// Bytes shown as text (lossy, without allocating).
struct Shown<'a>(&'a [u8]);

impl core::fmt::Display for Shown<'_> {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        for chunk in self.0.utf8_chunks() {
            f.write_str(chunk.valid())?;
            if !chunk.invalid().is_empty() {
                f.write_str("\u{FFFD}")?;
            }
        }
        Ok(())
    }
}

/// Whether a file could be created or overwritten at `path` now: `Err((what was checked,
/// errno))` if not. An existing path must be a writable non-directory; otherwise its
/// directory must exist and allow creating files.
fn writable(path: &[u8]) -> Result<(), (&[u8], i32)> {
    let mut c_path = [0u8; MAX_PATH + 1];
    c_path[..path.len()].copy_from_slice(path);
    // SAFETY: an all-zero `stat` is a valid value for the out-parameter.
    let mut st: libc::stat = unsafe { core::mem::zeroed() };
    // SAFETY: `c_path` is NUL-terminated (path.len() <= MAX_PATH); `st` is writable.
    if unsafe { libc::stat(c_path.as_ptr().cast(), &mut st) } == 0 {
        if st.st_mode & libc::S_IFMT == libc::S_IFDIR {
            return Err((path, libc::EISDIR));
        }
        // SAFETY: as above.
        if unsafe { libc::access(c_path.as_ptr().cast(), libc::W_OK) } != 0 {
            return Err((path, errno()));
        }
        return Ok(());
    }
    let (dir, end): (&[u8], usize) = match path.iter().rposition(|&b| b == b'/') {
        Some(0) => (b"/", 1),
        Some(i) => (&path[..i], i),
        None => (b".", 0),
    };
    if end == 0 {
        c_path[..2].copy_from_slice(b".\0");
    } else {
        c_path[end] = 0; // the directory: a prefix of the path
    }
    // SAFETY: `c_path` is NUL-terminated.
    if unsafe { libc::access(c_path.as_ptr().cast(), libc::W_OK | libc::X_OK) } != 0 {
        return Err((dir, errno()));
    }
    Ok(())
}

/// The last OS error's number (reading it allocates nothing).
fn errno() -> i32 {
    std::io::Error::last_os_error().raw_os_error().unwrap_or(0)
}

/// Gives `entry` the mode the environment asks for, unless code set one. Every entry that
/// names it counts as matched (the last one decides), so none is reported as unknown at exit.
fn apply(entry: &'static Registration) {
    crate::guarded::apply_env(entry);
    let config = config();
    for (i, named) in config.entries().iter().enumerate() {
        if !named.is_wildcard() && named.matches(entry.name(), entry.description()) {
            MATCHED[i].store(true, Relaxed);
        }
    }
    if let Some(i) = config.find(entry.name(), entry.description()) {
        if entry.records_supported() {
            entry.apply_records_from_env(config.entries()[i].mode());
        }
    }
}

/// Called by a declared allocator when it registers: reads the environment if needed and
/// applies this allocator's entry.
#[cold]
pub(crate) fn on_register(entry: &'static Registration) {
    ensure_read();
    if is_read() {
        apply(entry);
    }
}

/// At exit: warns about entries that named no allocator, then writes the files asked for
/// with `TAGALLOC_REPORT`, `TAGALLOC_DHAT` and `TAGALLOC_PPROF`.
extern "C" fn at_exit() {
    let config = config();
    let mut line = StackText::<512>::new();
    let mut unknown = 0;
    for (i, entry) in config.entries().iter().enumerate() {
        if entry.is_wildcard() || MATCHED[i].load(Relaxed) {
            continue;
        }
        let _ = if unknown == 0 {
            write!(
                line,
                "tagalloc: TAGALLOC_RECORDS names no allocator that registered: {:?}",
                entry.name()
            )
        } else {
            write!(line, ", {:?}", entry.name())
        };
        unknown += 1;
    }
    if unknown > 0 {
        let _ =
            line.write_str(" (names match an allocator's name or description, ignoring case)\n");
        warn(line.as_bytes());
    }
    crate::report::exit::write_files_at_exit(
        exit_path(ExitFile::Report),
        exit_path(ExitFile::Dhat),
        exit_path(ExitFile::Pprof),
    );
}

#[cfg(test)]
mod tests {
    use super::parse_seed;

    #[test]
    fn seeds_parse_or_are_refused() {
        assert_eq!(parse_seed(b" 42 "), Some(42));
        assert_eq!(parse_seed(b"0"), Some(0));
        assert_eq!(parse_seed(b"18446744073709551615"), Some(u64::MAX));
        assert_eq!(parse_seed(b"18446744073709551616"), None);
        assert_eq!(parse_seed(b""), None);
        assert_eq!(parse_seed(b"-1"), None);
        assert_eq!(parse_seed(b"0x10"), None);
    }
}
