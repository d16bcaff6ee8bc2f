//! The files written when the process exits: the text report (the allocator table and the
//! leak report), a DHAT profile, a pprof heap profile.
//!
//! Asked for with `TAGALLOC_REPORT=<path>`, `TAGALLOC_DHAT=<path>` and
//! `TAGALLOC_PPROF=<path>` (registered with `atexit` when the environment is read), or for
//! the report from code with [`write_report_at_exit`](super::write_report_at_exit). They are
//! written in an `atexit` handler, after `main` has returned: allocation still works (the
//! allocators are statics and never torn down), and the files' own allocations are not
//! recorded. One records snapshot, resolved once, serves all three; each file gets one line
//! on stderr saying where it went, or why it could not be written, or why a profile is
//! empty.

use super::owners;
use crate::fatal::StackText;
use crate::messages::warn;
use crate::records::RecordsSnapshot;
use crate::records::guard::Busy;
use core::fmt::Write as _;
use std::io::{self, Write};
use std::sync::Mutex;

fn path_of(bytes: &[u8]) -> std::path::PathBuf {
    std::path::PathBuf::from(<std::ffi::OsStr as std::os::unix::ffi::OsStrExt>::from_bytes(bytes))
}

/// Writes `what` to `path` with `write`; one line on stderr either way (`empty`: why the
/// profile has no call site, said after the path).
fn write_file(
    what: &str,
    path: &[u8],
    empty: Option<&str>,
    write: impl FnOnce(&mut dyn Write) -> io::Result<()>,
) {
    let path = path_of(path);
    let result = std::fs::File::create(&path).and_then(|file| {
        let mut out = io::BufWriter::new(file);
        write(&mut out)?;
        out.flush()
    });
    let mut line = StackText::<1024>::new();
    let _ = match (result, empty) {
        (Ok(()), None) => writeln!(line, "tagalloc: wrote the {what} to {}", path.display()),
        (Ok(()), Some(why)) => writeln!(
            line,
            "tagalloc: wrote an empty {what} to {}: {why}",
            path.display()
        ),
        (Err(e), _) => writeln!(
            line,
            "tagalloc: could not write the {what} to {}: {e}",
            path.display()
        ),
    };
    warn(line.as_bytes());
}

/// Writes the exit report to `path` (bytes of a file name); one line on stderr either way.
pub(crate) fn write_at_exit(path: &[u8]) {
    write_files_at_exit(Some(path), None, None);
}

/// Writes the files whose paths are given, from one resolved records snapshot.
pub(crate) fn write_files_at_exit(
    report: Option<&[u8]>,
    dhat: Option<&[u8]>,
    pprof: Option<&[u8]>,
) {
    if report.is_none() && dhat.is_none() && pprof.is_none() {
        return;
    }
    let _busy = Busy::enter();
    let mut records = crate::records::snapshot();
    records.resolve();
    let empty = owners::own_sites(&records)
        .is_empty()
        .then(|| owners::why_empty(&records));
    if let Some(path) = report {
        write_file("exit report", path, None, |out| {
            write_report_with(out, &records)
        });
    }
    if let Some(path) = dhat {
        write_file("DHAT profile", path, empty, |out| {
            out.write_all(records.to_dhat_json().as_bytes())
        });
    }
    if let Some(path) = pprof {
        write_file("pprof profile", path, empty, |out| {
            out.write_all(&records.to_pprof())
        });
    }
}

/// The exit report's contents.
pub(crate) fn write_report(out: &mut dyn Write) -> io::Result<()> {
    let mut records = crate::records::snapshot();
    records.resolve();
    write_report_with(out, &records)
}

/// The exit report's contents, with the leaks from `records` (resolved).
fn write_report_with(out: &mut dyn Write, records: &RecordsSnapshot) -> io::Result<()> {
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
