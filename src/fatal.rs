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
