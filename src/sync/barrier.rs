//! A process-wide memory barrier (Linux `membarrier`), for *asymmetric* fences: a hot path
//! that runs often orders its store and load with only a compiler barrier, and the rare
//! path that must see its store calls [`process_barrier`], which makes every running thread
//! of the process execute a full barrier (a thread not running crossed one when it was
//! switched out). The records buffers use it around `fork()`, the lanes under a `Fail`
//! budget when a thread decides at the limit.

use core::sync::atomic::{AtomicU8, Ordering::*, fence};

const MEMBARRIER_CMD_GLOBAL: libc::c_long = 1;
const MEMBARRIER_CMD_PRIVATE_EXPEDITED: libc::c_long = 8;
const MEMBARRIER_CMD_REGISTER_PRIVATE_EXPEDITED: libc::c_long = 16;

/// [`STATE`]: not tried yet.
const UNTRIED: u8 = 0;
/// [`STATE`]: the expedited barrier is registered (microseconds a call).
const EXPEDITED: u8 = 1;
/// [`STATE`]: only the global barrier works (it waits for every CPU: milliseconds).
const GLOBAL: u8 = 2;
/// [`STATE`]: no `membarrier` here (not Linux, an old kernel, a sandbox, Miri).
const NONE: u8 = 3;

static STATE: AtomicU8 = AtomicU8::new(UNTRIED);

/// Registers for the expedited barrier, once (registering can take milliseconds, which no
/// allocation should wait for: callers do it ahead, outside the allocation paths). Returns
/// whether [`process_barrier`] is a real barrier on every thread: if not, the hot paths
/// must fence for themselves.
pub(crate) fn prepare_process_barrier() -> bool {
    let state = match STATE.load(Acquire) {
        UNTRIED => {
            let state = probe();
            STATE.store(state, Release);
            state
        }
        state => state,
    };
    state != NONE
}

/// Whether [`prepare_process_barrier`] found a working barrier (false until it was called).
#[inline]
pub(crate) fn process_barrier_ready() -> bool {
    matches!(STATE.load(Acquire), EXPEDITED | GLOBAL)
}

#[cfg(all(target_os = "linux", not(miri)))]
fn probe() -> u8 {
    // SAFETY: membarrier takes plain integers and touches no memory of ours.
    let membarrier = |cmd: libc::c_long| unsafe { libc::syscall(libc::SYS_membarrier, cmd, 0) };
    if membarrier(MEMBARRIER_CMD_REGISTER_PRIVATE_EXPEDITED) == 0 {
        EXPEDITED
    } else if membarrier(MEMBARRIER_CMD_GLOBAL) == 0 {
        GLOBAL
    } else {
        NONE
    }
}

#[cfg(not(all(target_os = "linux", not(miri))))]
fn probe() -> u8 {
    NONE
}

/// A full memory barrier on every running thread of the process (after
/// [`prepare_process_barrier`]; without a working `membarrier`, only on the caller's).
pub(crate) fn process_barrier() {
    #[cfg(all(target_os = "linux", not(miri)))]
    {
        let cmd = match STATE.load(Acquire) {
            EXPEDITED => Some(MEMBARRIER_CMD_PRIVATE_EXPEDITED),
            GLOBAL => Some(MEMBARRIER_CMD_GLOBAL),
            _ => None,
        };
        if let Some(cmd) = cmd {
            // SAFETY: as in `probe`.
            unsafe { libc::syscall(libc::SYS_membarrier, cmd, 0) };
        }
    }
    fence(SeqCst);
}
