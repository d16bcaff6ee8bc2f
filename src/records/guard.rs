//! Per-thread state of the recorder: the re-entrancy guard, the thread id, the sampler and
//! the thread's record table (`buffer.rs`).
//!
//! One `const`-initialised `thread_local!` with no destructor, so reaching it is a plain TLS
//! access that never allocates and never fails, even while the thread's other TLS
//! destructors run.
//!
//! The guard ("busy") is set while this thread records an allocation or writes a report.
//! An allocation made while it is set passes unrecorded: that is what keeps the recorder
//! from recursing into itself, and report code (which allocates freely) out of the records.
//! Frees are not affected: a free always removes its record, so a record never outlives
//! its block.

use super::buffer::{self, Buf};
use super::sample::Sampler;
use core::cell::{Cell, UnsafeCell};

struct ThreadState {
    busy: Cell<bool>,
    tid: Cell<u32>,
    /// The thread's record table: null before its first basic record, [`GONE`] once
    /// the thread's exit hook retired it (or none could be had).
    buf: Cell<*const Buf>,
    /// `buf` while it is a claimed buffer and the thread is not busy, else null: the one
    /// word the fast paths test.
    fast: Cell<*const Buf>,
    sampler: UnsafeCell<Sampler>,
}

impl ThreadState {
    fn set_busy(&self, busy: bool) {
        self.busy.set(busy);
        self.update_fast();
    }

    fn set_buf(&self, buf: *const Buf) {
        self.buf.set(buf);
        self.update_fast();
    }

    fn update_fast(&self) {
        let p = self.buf.get();
        let usable = !self.busy.get() && p.addr() > GONE.addr();
        self.fast.set(if usable { p } else { core::ptr::null() });
    }
}

/// The buffer pointer of a thread that records straight into the table.
const GONE: *const Buf = core::ptr::dangling::<Buf>();

thread_local! {
    static STATE: ThreadState = const {
        ThreadState {
            busy: Cell::new(false),
            tid: Cell::new(0),
            buf: Cell::new(core::ptr::null()),
            fast: Cell::new(core::ptr::null()),
            sampler: UnsafeCell::new(Sampler::new()),
        }
    };
}

/// The guard held while this thread records or reports; see the [module docs](self).
pub(crate) struct Busy {
    /// Whether this guard set the flag (an inner guard leaves it to the outer one).
    outer: bool,
}

impl Busy {
    /// Sets the guard, or returns `None` if this thread is already busy (a re-entrant call:
    /// record nothing).
    #[inline]
    pub(crate) fn try_enter() -> Option<Busy> {
        STATE.with(|s| {
            if s.busy.get() {
                return None;
            }
            s.set_busy(true);
            Some(Busy { outer: true })
        })
    }

    /// Sets the guard for a report, nesting inside another guard if there is one.
    pub(crate) fn enter() -> Busy {
        STATE.with(|s| {
            let outer = !s.busy.get();
            if outer {
                s.set_busy(true);
            }
            Busy { outer }
        })
    }
}

impl Drop for Busy {
    #[inline]
    fn drop(&mut self) {
        if self.outer {
            STATE.with(|s| s.set_busy(false));
        }
    }
}

/// Whether this thread is recording or reporting right now.
pub(crate) fn is_busy() -> bool {
    STATE.with(|s| s.busy.get())
}

/// The calling thread's OS id (`gettid` on Linux), read once per thread.
#[inline]
pub(crate) fn thread_id() -> u32 {
    STATE.with(|s| {
        let id = s.tid.get();
        if id != 0 {
            return id;
        }
        let id = os_thread_id();
        s.tid.set(id);
        id
    })
}

#[cfg(all(target_os = "linux", not(miri)))]
fn os_thread_id() -> u32 {
    // SAFETY: gettid takes no arguments and cannot fail.
    let id = unsafe { libc::syscall(libc::SYS_gettid) };
    (id as u32).max(1)
}

#[cfg(any(not(target_os = "linux"), miri))]
fn os_thread_id() -> u32 {
    use core::sync::atomic::{AtomicU32, Ordering::Relaxed};
    static NEXT: AtomicU32 = AtomicU32::new(1);
    NEXT.fetch_add(1, Relaxed)
}

/// Where an allocation's basic record goes.
pub(crate) enum Target {
    /// Nowhere: this thread is recording or reporting (see the [module docs](self)).
    Busy,
    /// This thread's buffer.
    Buffer(&'static Buf),
    /// The shared table (the thread is exiting, or has no buffer).
    Table,
}

/// Where this thread's next basic record goes (one TLS access).
#[inline(always)]
pub(crate) fn target() -> Target {
    STATE.with(|s| {
        if s.busy.get() {
            return Target::Busy;
        }
        let p = s.buf.get();
        if p.addr() > GONE.addr() {
            // SAFETY: a claimed buffer, never freed.
            return Target::Buffer(unsafe { &*p });
        }
        if p.is_null() {
            return claim(s);
        }
        Target::Table
    })
}

/// This thread's buffer while it is not busy, read through the thread pointer when the
/// state's offset is known (see `allocator::thread_pointer`: a `thread_local!` access in
/// position-independent code is planned as a call, which makes an inlining fast path save
/// registers); null otherwise.
#[inline(always)]
pub(crate) fn own_buffer_quick() -> *const Buf {
    match crate::allocator::thread_pointer::records_address() {
        // SAFETY: the offset was learnt from this `thread_local!` (see `claim`) and is the
        // same in every thread: this thread's state, alive as long as the thread.
        Some(addr) => unsafe { (*(addr as *const ThreadState)).fast.get() },
        None => core::ptr::null(),
    }
}

/// [`own_buffer_quick`] as a reference; `None` sends the record to [`target`] (calls
/// nothing).
#[inline(always)]
pub(crate) fn own_buffer() -> Option<&'static Buf> {
    // SAFETY: a non-null `fast` is a claimed buffer, never freed.
    unsafe { own_buffer_quick().as_ref() }
}

#[cold]
#[inline(never)]
fn claim(s: &ThreadState) -> Target {
    crate::allocator::thread_pointer::learn_records(core::ptr::from_ref(s).addr());
    let tid = thread_id();
    match buffer::claim(tid) {
        Some(b) => {
            s.set_buf(b);
            Target::Buffer(b)
        }
        None => {
            s.set_buf(GONE);
            Target::Table
        }
    }
}

/// This thread's buffer, or null (none yet, or gone).
#[inline(always)]
pub(crate) fn current_buffer() -> *const Buf {
    STATE.with(|s| {
        let p = s.buf.get();
        if p.addr() > GONE.addr() {
            p
        } else {
            core::ptr::null()
        }
    })
}

/// The thread's buffer was retired (it exits): later records go to the table.
pub(crate) fn buffer_gone() {
    STATE.with(|s| s.set_buf(GONE));
}

/// Runs `f` on this thread's sampler. `f` must not call back into this module.
#[inline]
pub(crate) fn with_sampler<R>(f: impl FnOnce(&mut Sampler) -> R) -> R {
    // SAFETY: only this thread touches its sampler, and `f` (the sampler's own arithmetic)
    // calls nothing that could come back here, so the reference is unique while it lives.
    STATE.with(|s| f(unsafe { &mut *s.sampler.get() }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_guard_refuses_reentry_and_nests_for_reports() {
        assert!(!is_busy());
        let outer = Busy::try_enter().expect("not busy yet");
        assert!(is_busy());
        assert!(Busy::try_enter().is_none());
        {
            let _inner = Busy::enter();
        }
        assert!(is_busy(), "an inner guard leaves the flag to the outer one");
        drop(outer);
        assert!(!is_busy());
        let t = thread_id();
        assert_ne!(t, 0);
        assert_eq!(t, thread_id());
        let other = std::thread::spawn(thread_id).join().unwrap();
        assert_ne!(other, t);
    }
}
