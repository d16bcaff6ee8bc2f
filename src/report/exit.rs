//! The report written when the process exits: the allocator table and the leak report.
//!
//! Asked for with `TAGALLOC_REPORT=<path>` (registered with `atexit` when the environment
//! is read) or from code with [`write_report_at_exit`](super::write_report_at_exit). It
//! runs in an `atexit` handler, after `main` has returned: allocation still works (the
//! allocators are statics and never torn down), and the report's own allocations are not
//! recorded.

use crate::fatal::{StackText, write_stderr};
use crate::records::guard::Busy;
use core::fmt::Write as _;
use std::io::{self, Write};
use std::sync::Mutex;

/// Writes the exit report to `path` (bytes of a file name); one line on stderr either way.
pub(crate) fn write_at_exit(path: &[u8]) {
    let _busy = Busy::enter();
    let path = std::path::PathBuf::from(
        <std::ffi::OsStr as std::os::unix::ffi::OsStrExt>::from_bytes(path),
    );
    let result = std::fs::File::create(&path).and_then(|file| {
        let mut out = io::BufWriter::new(file);
        write_report(&mut out)?;
        out.flush()
    });
    let mut line = StackText::<512>::new();
    let _ = match result {
        Ok(()) => writeln!(
            line,
            "tagalloc: wrote the exit report to {}",
            path.display()
        ),
        Err(e) => writeln!(
            line,
            "tagalloc: could not write the exit report to {}: {e}",
            path.display()
        ),
    };
    write_stderr(line.as_bytes());
}

/// The exit report's contents.
pub(crate) fn write_report(out: &mut dyn Write) -> io::Result<()> {
    writeln!(
        out,
        "== tagalloc report at exit (pid {}) ==",
        std::process::id()
    )?;
    writeln!(out)?;
    writeln!(out, "-- Allocators (sys_DumpAllocators) --")?;
    let allocators = super::Snapshot::take();
    allocators.write_csv(out)?;
    writeln!(out)?;
    allocators.write_tree(out)?;
    writeln!(out)?;
    writeln!(out, "-- Leaks --")?;
    let mut records = crate::records::snapshot();
    records.resolve();
    records.write_leaks(out)
}

/// Paths registered from code, written in order at exit.
static PATHS: Mutex<Vec<std::path::PathBuf>> = Mutex::new(Vec::new());

extern "C" fn at_exit_from_code() {
    let paths = match PATHS.lock() {
        Ok(mut paths) => core::mem::take(&mut *paths),
        Err(_) => return,
    };
    for path in paths {
        write_at_exit(path.as_os_str().as_encoded_bytes());
    }
}

/// See [`write_report_at_exit`](super::write_report_at_exit).
pub(crate) fn register(path: std::path::PathBuf) -> io::Result<()> {
    let mut paths = PATHS.lock().map_err(|_| io::Error::other("poisoned"))?;
    if paths.is_empty() {
        // SAFETY: a plain `extern "C" fn()` that lives for the whole process.
        if unsafe { libc::atexit(at_exit_from_code) } != 0 {
            return Err(io::Error::other("atexit refused the handler"));
        }
    }
    paths.push(path);
    Ok(())
}
