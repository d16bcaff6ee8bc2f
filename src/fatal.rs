//! Ending the process with a clear message, without allocating.
//!
//! Unwinding out of `GlobalAlloc` is undefined behaviour and formatting with `format!` would
//! re-enter the allocator, so a detected misuse (double free, wrong free) formats into a
//! fixed stack buffer, writes it to stderr with one `write(2)` and aborts.

use core::fmt::{self, Write};

/// A fixed-capacity text buffer on the stack; text beyond its capacity is dropped.
pub(crate) struct StackText<const N: usize> {
    bytes: [u8; N],
    len: usize,
}

impl<const N: usize> StackText<N> {
    pub(crate) const fn new() -> Self {
        Self {
            bytes: [0; N],
            len: 0,
        }
    }

    pub(crate) fn as_bytes(&self) -> &[u8] {
        &self.bytes[..self.len]
    }
}

impl<const N: usize> Write for StackText<N> {
    fn write_str(&mut self, s: &str) -> fmt::Result {
        let room = N - self.len;
        let take = s.len().min(room);
        self.bytes[self.len..self.len + take].copy_from_slice(&s.as_bytes()[..take]);
        self.len += take;
        Ok(())
    }
}

/// Writes `bytes` to standard error with `write(2)`, retrying on short writes.
pub(crate) fn write_stderr(mut bytes: &[u8]) {
    while !bytes.is_empty() {
        // SAFETY: `bytes` is a valid readable slice for its whole length.
        let n = unsafe { libc::write(2, bytes.as_ptr().cast(), bytes.len()) };
        if n <= 0 {
            return;
        }
        bytes = &bytes[n as usize..];
    }
}

/// Prints `tagalloc: <message>` on stderr and aborts the process. Never allocates.
#[cold]
#[inline(never)]
pub(crate) fn abort_with(args: fmt::Arguments<'_>) -> ! {
    let mut text = StackText::<512>::new();
    let _ = text.write_str("tagalloc: fatal: ");
    let _ = text.write_fmt(args);
    let _ = text.write_str("\n");
    write_stderr(text.as_bytes());
    std::process::abort()
}

/// How a misuse message names the allocator that owns a tag: a function the allocator
/// layer installs when it hands out its first tag (the schemas below it cannot ask the
/// registry themselves). Null until then.
static TAG_NAMER: core::sync::atomic::AtomicPtr<()> =
    core::sync::atomic::AtomicPtr::new(core::ptr::null_mut());

/// Installs the function that names a tag's allocator in misuse messages.
pub(crate) fn set_tag_namer(namer: fn(u16) -> Option<&'static str>) {
    TAG_NAMER.store(namer as *mut (), core::sync::atomic::Ordering::Release);
}

/// The name of the allocator that owns `tag` (`SystemAllocator` for 0), for a misuse
/// message; never allocates.
pub(crate) fn tag_name(tag: u16) -> &'static str {
    if tag == 0 {
        return "SystemAllocator";
    }
    let f = TAG_NAMER.load(core::sync::atomic::Ordering::Acquire);
    if f.is_null() {
        return "?";
    }
    // SAFETY: only `set_tag_namer` stores here, always a `fn(u16) -> Option<&'static str>`.
    let namer: fn(u16) -> Option<&'static str> = unsafe { core::mem::transmute(f) };
    namer(tag).unwrap_or("?")
}

/// Aborts with a formatted message, without allocating. See [`abort_with`].
macro_rules! fatal {
    ($($arg:tt)*) => {
        $crate::fatal::abort_with(format_args!($($arg)*))
    };
}
pub(crate) use fatal;

#[cfg(test)]
mod tests {
    use super::StackText;
    use core::fmt::Write;

    #[test]
    fn miri_stack_text_truncates_instead_of_overflowing() {
        let mut t = StackText::<8>::new();
        write!(t, "{}-{}", 1234, 56789).unwrap();
        assert_eq!(t.as_bytes(), b"1234-567");
    }
}
