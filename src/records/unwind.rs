//! Stack walking for records: the platform unwinder, made cheap by remembering what it found.
//!
//! libgcc's `_Unwind_Backtrace` finds and interprets the DWARF call-frame information of
//! every frame on every walk: about 1,300 instructions a frame, 27,000 for a sampled
//! record's 8 frames plus the allocator's own — as much as the rest of sampling put together.
//! Yet at a call site of optimised x86-64 code a frame's canonical frame address (CFA) is
//! nearly always its stack pointer plus a constant. So each walk by the platform unwinder
//! also learns, per return address, that constant (the frame's CFA minus the CFA of the
//! frame it called, which is its stack pointer at the call), and later walks replay it:
//! the return address sits at CFA − 8 and the caller's stack pointer is the CFA.
//!
//! What keeps the replay right and safe:
//! - an offset is used only once two walks of the platform unwinder agreed on it; a call
//!   site whose offset ever changed always takes the platform unwinder. Frames built on a
//!   frame pointer (Rust's standard library is compiled with them) replay like the others:
//!   their size is fixed unless they realign the stack or use `alloca`, which Rust code
//!   does only for over-aligned locals;
//! - a frame after which the platform unwinder stopped (the outermost frames of a thread)
//!   is marked terminal, so a replay stops there too;
//! - the replay reads only inside the thread's own stack as pthread reports it (asked once
//!   per thread), and only while the stack pointer is in it: code running on another stack
//!   (a coroutine's) always takes the platform unwinder, so a stack switch can never lead
//!   a replay into a guard page. Anything outside, or a return address never learnt, falls
//!   back to the platform unwinder for the whole walk.
//!
//! A replay can only go wrong for a frame whose size changed after two walks agreed on it
//! (a stack realigned from a differently aligned caller, C's `alloca`) or for code loaded
//! where unloaded code was: a record may then show a wrong frame, but the reads stay
//! inside the thread's stack. Other targets, and Miri, always use the `backtrace` crate.

/// Fills `out` with the return addresses of the frames whose CFA lies above `boundary` (an
/// address in the caller's frame: the frames below are the recorder's own), innermost
/// first; returns how many it wrote (fewer than `out.len()` when the stack ends first).
#[inline(never)]
pub(crate) fn walk(boundary: usize, out: &mut [usize]) -> usize {
    if out.is_empty() {
        return 0;
    }
    imp::walk(boundary, out)
}

#[cfg(all(target_arch = "x86_64", target_os = "linux", not(miri)))]
mod imp {
    use core::cell::Cell;
    use core::ffi::{c_int, c_void};
    use core::sync::atomic::{AtomicU64, AtomicUsize, Ordering::Relaxed};

    #[allow(non_camel_case_types)]
    type _Unwind_Trace_Fn = extern "C" fn(*mut c_void, *mut c_void) -> c_int;
    const URC_NO_REASON: c_int = 0;
    const URC_END_OF_STACK: c_int = 5;
    const URC_FAILURE: c_int = 9;

    unsafe extern "C" {
        fn _Unwind_Backtrace(trace: _Unwind_Trace_Fn, arg: *mut c_void) -> c_int;
        fn _Unwind_GetIP(ctx: *mut c_void) -> usize;
        fn _Unwind_GetCFA(ctx: *mut c_void) -> usize;
    }

    /// Learnt call sites, direct-mapped by return address. An entry packs the return
    /// address (bits 16..64), a [state](SEEN_ONCE) (bits 14..16) and the offset from the
    /// stack pointer to the CFA in words (bits 0..14); 0 is an empty entry.
    static SITES: [AtomicU64; SLOTS] = [const { AtomicU64::new(0) }; SLOTS];
    const SLOTS: usize = 4096;
    const SEEN_ONCE: u64 = 0;
    const CONFIRMED: u64 = 1;
    const TERMINAL: u64 = 2;
    /// The offset changed between walks (or the frame ended a walk and had a caller in
    /// another).
    const VARIABLE: u64 = 3;
    const MAX_WORDS: usize = (1 << 14) - 1;

    /// The offset from [`walk`]'s own stack pointer to its CFA; 0 until learnt.
    static OWN_OFFSET: AtomicUsize = AtomicUsize::new(0);

    thread_local! {
        /// This thread's stack, `[low, high)` as pthread reports it; `(0, 0)` until asked,
        /// `(1, 1)` when pthread could not tell (then the thread never replays).
        static STACK: Cell<(usize, usize)> = const { Cell::new((0, 0)) };
    }

    /// Entries per set: a return address may sit in any entry of its set, so that two hot
    /// call sites hashing alike do not keep evicting each other (and never get confirmed).
    const WAYS: usize = 4;

    /// The set of entries where `ip` may be.
    fn set(ip: usize) -> &'static [AtomicU64] {
        let sets = SLOTS / WAYS;
        let h = (ip as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15) >> (64 - sets.trailing_zeros());
        &SITES[h as usize * WAYS..][..WAYS]
    }

    /// The entry holding `ip`, or else the one to put it in (an empty one, else one not
    /// confirmed, else one picked by the address), with its current value.
    fn slot(ip: usize) -> (&'static AtomicU64, u64) {
        let set = set(ip);
        let (mut empty, mut unconfirmed) = (None, None);
        for e in set {
            let v = e.load(Relaxed);
            if v != 0 && v >> 16 == ip as u64 {
                return (e, v);
            }
            if v == 0 {
                empty = empty.or(Some((e, v)));
            } else if (v >> 14) & 3 == SEEN_ONCE {
                unconfirmed = unconfirmed.or(Some((e, v)));
            }
        }
        empty.or(unconfirmed).unwrap_or_else(|| {
            let e = &set[(ip >> 4) % WAYS];
            (e, e.load(Relaxed))
        })
    }

    /// The learnt (offset in bytes, terminal) of a return address, if confirmed; a terminal
    /// frame has no offset (the walk ends there).
    fn lookup(ip: usize) -> Option<(usize, bool)> {
        let (_, e) = slot(ip);
        if e >> 16 != ip as u64 || e == 0 {
            return None;
        }
        match (e >> 14) & 3 {
            CONFIRMED => Some(((e & MAX_WORDS as u64) as usize * 8, false)),
            TERMINAL => Some((0, true)),
            _ => None,
        }
    }

    /// Packs an entry.
    fn pack(ip: usize, state: u64, words: usize) -> u64 {
        (ip as u64) << 16 | state << 14 | words as u64
    }

    /// The state of `ip`'s entry, if the slot holds `ip`.
    fn state_of(e: u64, ip: usize) -> Option<u64> {
        (e != 0 && e >> 16 == ip as u64).then_some((e >> 14) & 3)
    }

    /// Notes what the platform unwinder found at `ip`: `offset` from the stack pointer to
    /// the CFA, or `None` when the frame cannot be replayed.
    fn learn(ip: usize, offset: Option<usize>) {
        if ip == 0 || ip >> 48 != 0 {
            return;
        }
        let (s, e) = slot(ip);
        let words = match offset {
            Some(off) if off % 8 == 0 && off > 0 && off / 8 <= MAX_WORDS => off / 8,
            _ => return s.store(pack(ip, VARIABLE, 0), Relaxed),
        };
        match state_of(e, ip) {
            None => s.store(pack(ip, SEEN_ONCE, words), Relaxed),
            Some(VARIABLE) => {}
            Some(TERMINAL) => s.store(pack(ip, VARIABLE, 0), Relaxed),
            Some(_) if (e & MAX_WORDS as u64) as usize != words => {
                s.store(pack(ip, VARIABLE, 0), Relaxed);
            }
            Some(SEEN_ONCE) => s.store(pack(ip, CONFIRMED, words), Relaxed),
            Some(_) => {}
        }
    }

    /// Marks `ip` as a frame the platform unwinder cannot go past.
    fn learn_terminal(ip: usize) {
        if ip == 0 || ip >> 48 != 0 {
            return;
        }
        let (s, e) = slot(ip);
        match state_of(e, ip) {
            None => s.store(pack(ip, TERMINAL, 0), Relaxed),
            Some(TERMINAL | VARIABLE) => {}
            Some(_) => s.store(pack(ip, VARIABLE, 0), Relaxed),
        }
    }

    /// This thread's stack bounds (see [`STACK`]).
    fn thread_stack() -> (usize, usize) {
        let known = STACK.with(Cell::get);
        if known.0 != 0 {
            return known;
        }
        let bounds = ask_pthread().unwrap_or((1, 1));
        STACK.with(|s| s.set(bounds));
        bounds
    }

    /// The calling thread's stack from `pthread_getattr_np` (for the main thread glibc reads
    /// it from `/proc/self/maps`, with its own malloc, never Rust's global allocator).
    fn ask_pthread() -> Option<(usize, usize)> {
        let mut attr = core::mem::MaybeUninit::<libc::pthread_attr_t>::uninit();
        // SAFETY: `attr` is written by `pthread_getattr_np` before use and destroyed once.
        unsafe {
            if libc::pthread_getattr_np(libc::pthread_self(), attr.as_mut_ptr()) != 0 {
                return None;
            }
            let mut addr: *mut libc::c_void = core::ptr::null_mut();
            let mut size: libc::size_t = 0;
            let ok = libc::pthread_attr_getstack(attr.as_ptr(), &mut addr, &mut size) == 0;
            libc::pthread_attr_destroy(attr.as_mut_ptr());
            let low = addr as usize;
            (ok && low > 1 && size > 0).then(|| (low, low + size))
        }
    }

    #[inline(always)]
    fn stack_pointer() -> usize {
        let sp: usize;
        // SAFETY: reads the stack pointer into a register; touches no memory.
        unsafe {
            core::arch::asm!("mov {}, rsp", out(reg) sp, options(nomem, nostack, preserves_flags));
        }
        sp
    }

    #[inline(never)]
    pub(super) fn walk(boundary: usize, out: &mut [usize]) -> usize {
        let sp = stack_pointer();
        let n = match replay(sp, boundary, out) {
            Some(n) => {
                #[cfg(test)]
                REPLAYS.fetch_add(1, Relaxed);
                n
            }
            None => platform(sp, boundary, out, true),
        };
        // Keeps the call to `platform` from becoming a jump: it learns this frame's size
        // from its caller's stack pointer, which must be this function's.
        core::hint::black_box(n)
    }

    /// Walks that replayed (tests check that the learning works).
    #[cfg(test)]
    pub(super) static REPLAYS: AtomicUsize = AtomicUsize::new(0);

    /// [`walk`] with the platform unwinder only (tests compare the two).
    #[cfg(test)]
    #[inline(never)]
    pub(super) fn walk_platform(boundary: usize, out: &mut [usize]) -> usize {
        platform(stack_pointer(), boundary, out, false)
    }

    /// Walks with the learnt offsets only; `None` when it met something not learnt (then
    /// the platform unwinder must walk, and `out` is to be overwritten).
    fn replay(mut sp: usize, boundary: usize, out: &mut [usize]) -> Option<usize> {
        let own = OWN_OFFSET.load(Relaxed);
        let (low, high) = thread_stack();
        if own == 0 || sp < low || sp >= high {
            return None;
        }
        let mut n = 0;
        let mut cfa = sp + own; // the CFA of `walk`, whose frame is not reported
        for _ in 0..MAX_WALK {
            if cfa < sp + 8 || cfa > high {
                return None;
            }
            // SAFETY: `cfa - 8` lies between the stack pointer and the top of the thread's
            // stack, which the stack pointer is in: mapped stack memory.
            let ip = unsafe { ((cfa - 8) as *const usize).read() };
            sp = cfa; // the stack pointer of the frame `ip` returns into
            if ip == 0 {
                break;
            }
            if sp > boundary {
                out[n] = ip;
                n += 1;
                if n == out.len() {
                    break;
                }
            }
            let (offset, terminal) = lookup(ip)?;
            if terminal {
                break;
            }
            cfa = sp + offset;
        }
        Some(n)
    }

    /// Frames the platform unwinder visits at most (a corrupt or cyclic stack stops there).
    const MAX_WALK: usize = 256;

    struct Platform<'a> {
        out: &'a mut [usize],
        n: usize,
        boundary: usize,
        /// [`walk`]'s stack pointer, to learn [`OWN_OFFSET`] (0: called from elsewhere).
        sp: usize,
        /// The previous frame's return address and stack pointer.
        prev: Option<(usize, usize)>,
        frames: usize,
        /// `out` is full.
        stopped: bool,
        /// The next frame's return address was 0: the stack ends here.
        ended: bool,
    }

    /// Walks with the platform unwinder, learning every frame's offset on the way.
    #[inline(never)]
    fn platform(sp: usize, boundary: usize, out: &mut [usize], from_walk: bool) -> usize {
        let mut state = Platform {
            out,
            n: 0,
            boundary,
            sp: if from_walk { sp } else { 0 },
            prev: None,
            frames: 0,
            stopped: false,
            ended: false,
        };
        // SAFETY: the callback matches `_Unwind_Trace_Fn` and `arg` points at `state`,
        // alive for the whole call.
        let code = unsafe { _Unwind_Backtrace(step, (&raw mut state).cast()) };
        if state.ended || code == URC_END_OF_STACK && !state.stopped {
            if let Some((ip, _)) = state.prev {
                learn_terminal(ip);
            }
        }
        state.n
    }

    /// One frame of the platform unwinder. Its "CFA" is, in libgcc's terms, the CFA of the
    /// frame below: this frame's stack pointer.
    extern "C" fn step(ctx: *mut c_void, arg: *mut c_void) -> c_int {
        // SAFETY: `arg` is the `Platform` that `platform` passed, alive during the walk;
        // `ctx` is the unwinder's context for this frame.
        let (state, ip, sp) = unsafe {
            (
                &mut *arg.cast::<Platform>(),
                _Unwind_GetIP(ctx),
                _Unwind_GetCFA(ctx),
            )
        };
        state.frames += 1;
        if ip == 0 {
            state.ended = true;
            return URC_FAILURE;
        }
        if state.frames > MAX_WALK {
            return URC_FAILURE; // a corrupt or cyclic stack
        }
        if let Some((prev_ip, prev_sp)) = state.prev {
            // The previous frame's CFA is this frame's stack pointer.
            let offset = (sp > prev_sp).then(|| sp - prev_sp);
            learn(prev_ip, offset);
            if state.frames == 3 && prev_sp == state.sp && state.sp != 0 {
                // The previous frame is `walk`'s (frame 1 is `platform`): its offset holds
                // at every point of its body, where the replay starts.
                if let Some(off) = offset {
                    OWN_OFFSET.store(off, Relaxed);
                }
            }
        }
        state.prev = Some((ip, sp));
        // Frames 1 and 2 are `platform` and `walk` (below any boundary anyway).
        if state.frames > 2 && sp > state.boundary {
            state.out[state.n] = ip;
            state.n += 1;
            if state.n == state.out.len() {
                state.stopped = true;
                return URC_FAILURE;
            }
        }
        URC_NO_REASON
    }

    #[cfg(test)]
    mod set_tests {
        use super::*;

        #[test]
        fn call_sites_sharing_a_set_are_all_confirmed() {
            // Addresses far from any real code, all hashing to one set.
            let base = 0x7000_0000_0000usize;
            let same: Vec<usize> = (0..200_000)
                .map(|i| base + i * 16)
                .filter(|&ip| core::ptr::eq(set(ip), set(base)))
                .take(WAYS)
                .collect();
            assert_eq!(same.len(), WAYS);
            for _ in 0..2 {
                for (i, &ip) in same.iter().enumerate() {
                    learn(ip, Some(16 * (i + 1)));
                }
            }
            for (i, &ip) in same.iter().enumerate() {
                assert_eq!(lookup(ip), Some((16 * (i + 1), false)), "{ip:#x}");
            }
            // A changed offset is never replayed again; an ending frame is terminal.
            learn(same[0], Some(8));
            assert_eq!(lookup(same[0]), None);
            learn(same[0], Some(16));
            assert_eq!(lookup(same[0]), None);
            let end = base + 0x10_0000;
            learn_terminal(end);
            assert_eq!(lookup(end), Some((0, true)));
        }
    }
}

#[cfg(not(all(target_arch = "x86_64", target_os = "linux", not(miri))))]
mod imp {
    #[inline(never)]
    pub(super) fn walk(boundary: usize, out: &mut [usize]) -> usize {
        let mut n = 0;
        let mut seen = 0;
        let mut each = |frame: &backtrace::Frame| {
            seen += 1;
            let (ip, cfa) = (frame.ip() as usize, frame.sp() as usize);
            if seen > 256 || ip == 0 {
                return false; // a corrupt or cyclic stack, or its end
            }
            if cfa == 0 || cfa > boundary {
                out[n] = ip;
                n += 1;
            }
            n < out.len()
        };
        // SAFETY: unsafe only for lack of serialisation; here it calls the thread-safe
        // platform unwinder, and the callback never panics nor allocates.
        unsafe { backtrace::trace_unsynchronized(&mut each) };
        n
    }
}

#[cfg(all(test, target_arch = "x86_64", target_os = "linux", not(miri)))]
mod tests {
    use super::imp::{REPLAYS, walk_platform};
    use core::sync::atomic::Ordering::Relaxed;
    use std::hint::black_box;

    /// Walks from `depth` recursive frames deep, both ways, from the same place.
    #[inline(never)]
    fn probe(depth: usize, out: &mut Vec<(Vec<usize>, Vec<usize>)>) {
        if depth > 0 {
            probe(black_box(depth - 1), out);
            black_box(&out);
            return;
        }
        let marker = 0u8;
        let boundary = black_box(core::ptr::addr_of!(marker)) as usize;
        let mut a = [0usize; 24];
        let mut b = [0usize; 24];
        let n = super::walk(boundary, &mut a);
        let m = walk_platform(boundary, &mut b);
        out.push((a[..n].to_vec(), b[..m].to_vec()));
    }

    #[test]
    fn replayed_walks_match_the_platform_unwinder() {
        let before = REPLAYS.load(Relaxed);
        let mut seen = Vec::new();
        // One call site for every walk (a loop the compiler cannot unroll), three depths.
        for i in 0..black_box(12) {
            probe(black_box([0, 3, 30][i % 3]), &mut seen);
        }
        for (replayed, platform) in &seen {
            assert!(!platform.is_empty());
            assert_eq!(replayed, platform);
        }
        // The first two rounds learn and confirm; the later ones replay.
        let replays = REPLAYS.load(Relaxed) - before;
        assert!(replays >= 6, "the walks did not replay ({replays} of 12)");
        // From another thread (its stack is new to the walker): the same frames above the
        // thread's entry point.
        std::thread::spawn(|| {
            let mut seen = Vec::new();
            for _ in 0..black_box(4) {
                probe(black_box(5), &mut seen);
            }
            for (replayed, platform) in &seen {
                assert_eq!(replayed, platform);
            }
        })
        .join()
        .unwrap();
    }

    #[test]
    fn an_empty_buffer_walks_nothing() {
        assert_eq!(super::walk(0, &mut []), 0);
    }
}
