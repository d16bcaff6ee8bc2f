//! tagalloc's warnings captured instead of printed: a test calls [`capture`] and asserts the
//! lines it expects with [`captured`], so `cargo test` shows no warning a newcomer would
//! read as a failure.

use std::sync::Mutex;

const CAPACITY: usize = 1 << 18;

struct Lines {
    bytes: [u8; CAPACITY],
    len: usize,
}

static LINES: Mutex<Lines> = Mutex::new(Lines {
    bytes: [0; CAPACITY],
    len: 0,
});

/// The hook: copies the line into the fixed buffer (no allocation: it may run inside one).
fn keep(line: &str) {
    let mut lines = LINES.lock().unwrap_or_else(|e| e.into_inner());
    if lines.len + line.len() > CAPACITY {
        // Full (a model test run with many cases warns thousands of times): keep the newer
        // half, from a line's start, so the lines a test asserts next still fit.
        let half = lines.len.saturating_sub(CAPACITY / 2);
        let cut = lines.bytes[half..lines.len]
            .iter()
            .position(|&b| b == b'\n')
            .map_or(lines.len, |i| half + i + 1);
        let len = lines.len;
        lines.bytes.copy_within(cut..len, 0);
        lines.len = len - cut;
    }
    let start = lines.len;
    let n = line.len().min(CAPACITY - start);
    lines.bytes[start..start + n].copy_from_slice(&line.as_bytes()[..n]);
    lines.len += n;
}

/// Sends tagalloc's warnings of this test binary to the buffer from now on.
pub fn capture() {
    tagalloc::messages::set_hook(Some(keep));
}

/// Everything captured so far.
pub fn text() -> String {
    // Allocated before the lock, so that nothing allocates while it is held (a warning
    // raised by that allocation would wait for it).
    let mut copy = Vec::with_capacity(CAPACITY);
    {
        let lines = LINES.lock().unwrap_or_else(|e| e.into_inner());
        copy.extend_from_slice(&lines.bytes[..lines.len]);
    }
    String::from_utf8_lossy(&copy).into_owned()
}

/// Whether a captured line contains `needle`.
pub fn captured(needle: &str) -> bool {
    text().lines().any(|l| l.contains(needle))
}
