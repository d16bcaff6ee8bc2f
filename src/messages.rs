//! Where tagalloc's warnings go: standard error by default, or a function of yours.
//!
//! tagalloc writes a line when something deserves a look but is not fatal: a pool refused
//! a request outside its range (once per pool), an allocator went over its budget (the
//! default budget hook), a setting in the environment was not understood, a pool was
//! dropped with live blocks. Each line starts with `tagalloc: ` and ends with a newline;
//! it is formatted on the stack, so writing it never allocates.
//!
//! [`set_hook`] sends those lines to a function instead: a logger, or a test that asserts
//! the warnings it expects instead of printing them. Fatal errors (a double free, a broken
//! heap) still go to standard error before the process aborts.
//!
//! ```
//! use std::sync::atomic::{AtomicUsize, Ordering};
//! static WARNINGS: AtomicUsize = AtomicUsize::new(0);
//! fn count(line: &str) {
//!     assert!(line.starts_with("tagalloc: "));
//!     WARNINGS.fetch_add(1, Ordering::Relaxed);
//! }
//! tagalloc::messages::set_hook(Some(count));
//! tagalloc::allocator!(Tiny: pool of tagalloc::SystemAllocator { page_size: 4096, min_size: 8, max_size: 64 });
//! assert!(allocator_api2::boxed::Box::try_new_in([0u8; 100], Tiny).is_err());
//! assert_eq!(WARNINGS.load(Ordering::Relaxed), 1); // "tagalloc: pool 'Tiny': request of 100 bytes ..."
//! tagalloc::messages::set_hook(None); // back to standard error
//! ```

use crate::fatal::write_stderr;
use core::sync::atomic::{AtomicPtr, Ordering::Relaxed};

/// A function that receives each of tagalloc's warning lines (newline included).
///
/// It runs where the warning arises, which may be inside an allocation (a pool's, or a
/// child's over its budget): if tagalloc is the global allocator, a hook that allocates
/// must not allocate through the allocator the warning is about (a scoped tag of a child
/// over its budget would route the hook's allocations back to it). Copying the line into
/// a fixed buffer, counting, or writing it with `write(2)` is always safe.
pub type MessageHook = fn(&str);

/// The hook, as a pointer; null means standard error.
static HOOK: AtomicPtr<()> = AtomicPtr::new(core::ptr::null_mut());

/// Sends tagalloc's warning lines to `hook` from now on (`None`: back to standard error).
pub fn set_hook(hook: Option<MessageHook>) {
    HOOK.store(
        hook.map_or(core::ptr::null_mut(), |h| h as *mut ()),
        Relaxed,
    );
}

/// Writes one warning line (formatted without allocating) to the hook or standard error.
pub(crate) fn warn(line: &[u8]) {
    let hook = HOOK.load(Relaxed);
    if hook.is_null() {
        write_stderr(line);
        return;
    }
    // SAFETY: the only non-null values stored are `MessageHook` function pointers
    // (`set_hook`), and function pointers round-trip through `*mut ()`.
    let hook: MessageHook = unsafe { core::mem::transmute::<*mut (), MessageHook>(hook) };
    // Lines are built from `&str` pieces, but a full buffer may have cut one inside a
    // character: the hook gets the valid part.
    let text = match core::str::from_utf8(line) {
        Ok(text) => text,
        // SAFETY: `valid_up_to` is the length of the longest valid UTF-8 prefix.
        Err(e) => unsafe { core::str::from_utf8_unchecked(&line[..e.valid_up_to()]) },
    };
    hook(text);
}

/// For the crate's unit tests: warnings captured instead of printed (see `set_hook`).
#[cfg(test)]
pub(crate) mod capture {
    use std::sync::Mutex;

    const CAPACITY: usize = 1 << 16;

    static LINES: Mutex<([u8; CAPACITY], usize)> = Mutex::new(([0; CAPACITY], 0));

    /// The hook: copies the line into the fixed buffer (no allocation).
    fn keep(line: &str) {
        let mut lines = LINES.lock().unwrap_or_else(|e| e.into_inner());
        let (bytes, len) = &mut *lines;
        if *len + line.len() > CAPACITY {
            // Full: keep the newer half, from a line's start, so the lines a test asserts
            // next still fit (a long run warns many times).
            let half = len.saturating_sub(CAPACITY / 2);
            let cut = bytes[half..*len]
                .iter()
                .position(|&b| b == b'\n')
                .map_or(*len, |i| half + i + 1);
            bytes.copy_within(cut..*len, 0);
            *len -= cut;
        }
        let n = line.len().min(CAPACITY - *len);
        bytes[*len..*len + n].copy_from_slice(&line.as_bytes()[..n]);
        *len += n;
    }

    /// Sends the warnings of this test binary to the buffer from now on.
    pub(crate) fn start() {
        super::set_hook(Some(keep));
    }

    /// Whether a captured line contains `needle`.
    pub(crate) fn captured(needle: &str) -> bool {
        // Allocated before the lock: nothing allocates while it is held.
        let mut copy = Vec::with_capacity(CAPACITY);
        {
            let lines = LINES.lock().unwrap_or_else(|e| e.into_inner());
            copy.extend_from_slice(&lines.0[..lines.1]);
        }
        String::from_utf8_lossy(&copy)
            .lines()
            .any(|l| l.contains(needle))
    }
}
