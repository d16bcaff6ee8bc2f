//! Applying `TAGALLOC_RECORDS` and `TAGALLOC_REPORT` (parsed by [`config`](super::config)).
//!
//! The variables are read once, under a three-state flag (unread, being read, read); the
//! parsed entries stay in a static for the life of the process. When they have been read,
//! every allocator already registered gets its mode; an allocator that registers later
//! looks its name up at registration ([`on_register`]). A mode set in code is never
//! overridden.
//!
//! Everything here runs on the allocation path (inside the `SystemAllocator`'s first call or
//! a handle's registration), so it allocates nothing through Rust's allocator: `getenv`,
//! byte parsing, statics, `atexit` (which uses the C library's own memory).

use super::config::{MAX_ENTRIES, ParseProblems, RecordsConfig, parse_records, warn_problems};
use super::guard::Busy;
use crate::config::env_bytes;
use crate::fatal::{StackText, write_stderr};
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

/// Longest `TAGALLOC_REPORT` path kept.
const MAX_PATH: usize = 4096;
static REPORT_PATH: WriteOnce<([u8; MAX_PATH], usize)> =
    WriteOnce(UnsafeCell::new(([0; MAX_PATH], 0)));

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
    if let Some(path) = env_bytes(c"TAGALLOC_REPORT") {
        let path = path.trim_ascii();
        if path.is_empty() {
            crate::config::warn_bad_value("TAGALLOC_REPORT", path, "empty path");
        } else if path.len() > MAX_PATH {
            crate::config::warn_bad_value("TAGALLOC_REPORT", path, "path longer than 4096 bytes");
        } else {
            // SAFETY: as above: written before READ is published.
            unsafe {
                let slot = &mut *REPORT_PATH.0.get();
                slot.0[..path.len()].copy_from_slice(path);
                slot.1 = path.len();
            }
            wants_exit_hook = true;
        }
    }
    STATE.store(READ, Release);
    for entry in registry::allocators() {
        apply(entry);
    }
    registry::SYSTEM.records().clear_pending_env();
    registry::SYSTEM.records_changed();
    if wants_exit_hook {
        // SAFETY: `at_exit` is a plain `extern "C" fn()` that lives for the whole process.
        if unsafe { libc::atexit(at_exit) } != 0 {
            write_stderr(b"tagalloc: atexit failed; no exit report will be written\n");
        }
    }
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

/// The `TAGALLOC_REPORT` path, if one was given.
pub(crate) fn report_path() -> Option<&'static [u8]> {
    if !is_read() {
        return None;
    }
    // SAFETY: as in `config`.
    let (bytes, len) = unsafe { &*REPORT_PATH.0.get() };
    (*len > 0).then(|| &bytes[..*len])
}

/// Gives `entry` the mode the environment asks for, unless code set one. Every entry that
/// names it counts as matched (the last one decides), so none is reported as unknown at exit.
fn apply(entry: &'static Registration) {
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

/// At exit: warns about entries that named no allocator, then writes the report asked for
/// with `TAGALLOC_REPORT`.
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
        write_stderr(line.as_bytes());
    }
    if let Some(path) = report_path() {
        crate::report::exit::write_at_exit(path);
    }
}
