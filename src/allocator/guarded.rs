//! Guarded sampling: overflow detection cheap enough for production, per allocator.
//!
//! One allocation in `N` of an allocator (chosen at random, `N` apart on average) gets a
//! block that ends against an inaccessible page. A read or write past its end faults on
//! the first byte over; the fault handler prints which allocator the block belongs to,
//! where it is, how big it is and how far past its end the access went, then passes the
//! fault on to whatever handler was there before (by default the process dies of
//! `SIGSEGV`, leaving a core dump). Bugs that corrupt memory far from where they happen
//! are caught where they happen, in the field, at a rate you choose per subsystem.
//!
//! ```text
//! TAGALLOC_GUARDED="Renderer=1/1000,Network=1/200" ./game
//! ```
//!
//! or in code: [`Registration::set_guarded`](crate::Registration::set_guarded), the
//! handles' `set_guarded`, [`SystemAllocator::set_guarded`](crate::SystemAllocator::set_guarded)
//! (the `SystemAllocator`'s rate covers every allocation, its children's too). Entries name
//! an allocator (or its description, ignoring case); `*` names every one that can guard;
//! a rate is `1/N`, `N`, or `off`.
//!
//! What else a guarded block catches, when it is freed or its slot reused: a write into
//! the padding between its end and the guard page (a block whose size is not a multiple
//! of its alignment), a double free, a free of a pointer inside it, and a write after it
//! was freed (its slot rests in a queue, filled with a pattern that is checked when the
//! slot is handed out again). Each ends the program with a message naming the allocator.
//!
//! What it does not cover: blocks over 4 KiB or aligned to more than 4 KiB; accesses
//! before a block's start; pools and thread pools (they carve their own pages) and their
//! children; the `SystemAllocator` used directly as an `Allocator` handle; and allocations
//! of the `SystemAllocator` while it records every block (`basic` or `full` records; its
//! sampled records combine with guarding).
//!
//! Cost: nothing while no allocator has ever guarded. Once one has, a small free tells
//! an ordinary block from a guarded one with the compare it makes anyway (the guarded area
//! is reserved low in the address space, below the heap), and each guarded allocation
//! takes a lock and a slot
//! (a data page, committed once and kept, and an address-space guard page: 4 KiB of memory
//! per live guarded block, and per resting slot until
//! [`SystemAllocator::garbage_collect`](crate::SystemAllocator::garbage_collect) gives
//! those back). The area holds 65,280 slots; when it is full, allocations are simply not
//! guarded. docs/guarded.md has the measured cost.

use super::registry::{Registration, SYSTEM};
use super::{lanes, thread_cache};
use crate::fatal::{StackText, fatal, write_stderr};
use crate::records::config::{MAX_ENTRIES, MAX_NAME, ParseProblems, warn_problems};
use crate::schema::guarded::{
    GuardedArea, GuardedBlock, GuardedFault, GuardedMisuse, WrittenAfterFree,
};
use crate::schema::hpha::{MAX_TAGS, Tag};
use crate::sync::OnceFlag;
use core::alloc::Layout;
use core::cell::UnsafeCell;
use core::fmt::Write;
use core::ptr::NonNull;
use core::sync::atomic::{AtomicBool, AtomicU32, Ordering::*};

pub use crate::schema::guarded::GuardedStats;

/// The guarded slots behind the `SystemAllocator` and its children.
pub(crate) static AREA: GuardedArea = GuardedArea::new();

/// Set (never cleared) when some allocator first guards: from then on frees ask whether a
/// block is a guarded one.
static EVER: AtomicBool = AtomicBool::new(false);

/// Per tag, the general path's count of small allocations (see [`wanted`]).
static GENERAL_COUNTS: [AtomicU32; MAX_TAGS] = [const { AtomicU32::new(0) }; MAX_TAGS];

/// The guarded area's figures: live guarded blocks, their bytes, blocks guarded so far,
/// and the memory the area holds.
///
/// ```
/// let s = tagalloc::guarded::stats();
/// assert!(s.frees <= s.allocations);
/// ```
pub fn stats() -> GuardedStats {
    AREA.stats()
}

/// Whether `ptr` is the start of a live guarded block.
///
/// ```
/// let b = Box::new(1u8);
/// // No allocator guards in this example.
/// assert!(!tagalloc::guarded::is_guarded(&*b as *const u8));
/// ```
pub fn is_guarded(ptr: *const u8) -> bool {
    AREA.block(ptr).is_some()
}

/// Whether guarded sampling was ever turned on in this process.
#[inline(always)]
pub(crate) fn ever() -> bool {
    EVER.load(Relaxed)
}

/// Turns the machinery on before the first rate is set: the fault handler, and lane 0's
/// free filter in every thread cache.
#[cold]
pub(crate) fn enable() {
    if EVER.load(Acquire) {
        return;
    }
    install_fault_handler();
    // The area's place is settled before any lane's free path compares with its end (see
    // `Lane::plain_from`); if it cannot be reserved now, those paths ask every free.
    AREA.reserve();
    EVER.store(true, Release);
    // Lane 0's hooks are rebuilt from the flag (and every class's mark closed).
    thread_cache::system_records_changed();
}

/// One allocation in how many the `SystemAllocator`'s own lane guards (0: none).
pub(crate) fn system_interval() -> u32 {
    SYSTEM.guard_every().unwrap_or(0)
}

/// One allocation in how many of tag `tag` are guarded (0: none).
fn interval(tag: Tag) -> u32 {
    match tag {
        0 => system_interval(),
        tag => lanes::guard_interval(tag),
    }
}

/// Whether the general path's small allocation of `layout` for `tag` is to be guarded: a
/// lane's countdown chose it (and sent it here), or, for calls that only the general path
/// sees (a lane closed for records or a budget), one in the tag's rate of them.
#[inline]
pub(crate) fn wanted(tag: Tag, layout: Layout) -> bool {
    if !ever() || !GuardedArea::fits(layout) {
        return false;
    }
    if thread_cache::take_guard_request(tag) {
        return true;
    }
    let every = interval(tag);
    every != 0 && GENERAL_COUNTS[usize::from(tag)].fetch_add(1, Relaxed) % every == 0
}

/// A guarded block of `layout` for allocator tag `tag`; `None` when the layout does not
/// fit a slot or the area is full (the caller allocates as usual). A write after free
/// found in the slot about to be reused ends the program.
pub(crate) fn allocate(layout: Layout, tag: Tag) -> Option<NonNull<u8>> {
    match AREA.allocate(layout, tag) {
        Ok(block) => block,
        Err(found) => report_written_after_free(found),
    }
}

/// Frees the guarded block at `ptr`, allocated with `layout` (or a size up to its usable
/// one); returns it as it was. Misuse ends the program with a message.
///
/// # Safety
/// `ptr` lies in the guarded area ([`GuardedArea::contains`]).
pub(crate) unsafe fn free(ptr: *mut u8, layout: Layout) -> GuardedBlock {
    if let Some(block) = AREA.block(ptr) {
        if layout.size() < block.size
            || layout.size() > block.usable
            || block.start % layout.align() != 0
        {
            fatal!(
                "free of {:p} with a wrong layout ({} bytes, aligned to {}): a guarded block of {} bytes (usable {}) allocated through {}",
                ptr,
                layout.size(),
                layout.align(),
                block.size,
                block.usable,
                Named(block.tag)
            );
        }
    }
    match AREA.free(ptr) {
        Ok(block) => block,
        Err(GuardedMisuse::NotABlock) => fatal!(
            "free of {:p}: not the start of a block (it lies in tagalloc's guarded area, inside a block or a guard page)",
            ptr
        ),
        Err(GuardedMisuse::DoubleFree(block)) => fatal!(
            "double free of {:p}: a guarded block of {} bytes allocated through {}, already free",
            ptr,
            block.size,
            Named(block.tag)
        ),
        Err(GuardedMisuse::WrittenPastEnd { block, at }) => fatal!(
            "guarded block {:#x} of {} bytes allocated through {} was written {} byte(s) past its end (in its alignment padding), found when it was freed",
            block.start,
            block.size,
            Named(block.tag),
            at + 1
        ),
    }
}

/// Ends the program with the diagnosis of a call on `ptr` (in the guarded area, with
/// `layout`) that is not a live guarded block: a double free, or not a block's start.
#[cold]
pub(crate) fn not_live(ptr: *mut u8, layout: Layout) -> ! {
    // SAFETY: `ptr` is not a live block, so the area's free only diagnoses it.
    unsafe { free(ptr, layout) };
    fatal!(
        "{:p} is not a live block (it lies in tagalloc's guarded area)",
        ptr
    )
}

/// The usable size of the live guarded block at `ptr`, if `ptr` is one: the size it was
/// requested with. The alignment padding after it is checked at free, so a caller told it
/// could use the padding (and zeroing it for `alloc_zeroed`) would be reported as a write
/// past the end.
#[inline]
pub(crate) fn usable(ptr: *const u8) -> Option<usize> {
    AREA.block(ptr).map(|b| b.size)
}

/// The tag of the live guarded block at `ptr`; `None` when `ptr` is not one.
#[inline]
pub(crate) fn live_tag(ptr: *const u8) -> Option<Tag> {
    AREA.block(ptr).filter(|b| b.live).map(|b| b.tag)
}

#[cold]
fn report_written_after_free(found: WrittenAfterFree) -> ! {
    fatal!(
        "guarded block {:#x} of {} bytes allocated through {} was written after it was freed ({} bytes from its start), found when its slot was reused",
        found.block.start,
        found.block.size,
        Named(found.block.tag),
        found.at
    )
}

/// An allocator named by its tag, for messages written without allocating.
struct Named(Tag);

impl core::fmt::Display for Named {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        match self.0 {
            0 => f.write_str("`SystemAllocator`"),
            tag => match lanes::owner(tag) {
                Some(r) => write!(f, "`{}`", r.name()),
                None => write!(f, "tag {tag}"),
            },
        }
    }
}

// ---- The fault handler ----

/// The handlers that were in place for `SIGSEGV` and `SIGBUS` before ours.
struct Previous(UnsafeCell<[libc::sigaction; 2]>);
// SAFETY: written once, under `INSTALLED`, before our handler can run; read only after.
unsafe impl Sync for Previous {}

// SAFETY: an all-zero `sigaction` is a valid value (no handler, no flags).
static PREVIOUS: Previous = Previous(UnsafeCell::new(unsafe { core::mem::zeroed() }));
static INSTALLED: OnceFlag = OnceFlag::new();
const SIGNALS: [libc::c_int; 2] = [libc::SIGSEGV, libc::SIGBUS];

fn install_fault_handler() {
    INSTALLED.call(|| {
        for (i, &signal) in SIGNALS.iter().enumerate() {
            // SAFETY: a zeroed `sigaction` is valid; we fill in a handler of the
            // `SA_SIGINFO` shape and an empty mask; the old action is written into our
            // static, which nothing reads until the handler is installed.
            unsafe {
                let mut action: libc::sigaction = core::mem::zeroed();
                action.sa_sigaction = on_fault as *const () as libc::sighandler_t;
                action.sa_flags = libc::SA_SIGINFO | libc::SA_ONSTACK;
                libc::sigemptyset(&mut action.sa_mask);
                let previous = &mut (*PREVIOUS.0.get())[i];
                if libc::sigaction(signal, &action, previous) != 0 {
                    write_stderr(b"tagalloc: guarded sampling could not install its fault handler; overruns will crash without a message\n");
                }
            }
        }
        true
    });
}

/// Says what a fault in the guarded area hit, then passes the fault on.
extern "C" fn on_fault(
    signal: libc::c_int,
    info: *mut libc::siginfo_t,
    context: *mut libc::c_void,
) {
    // SAFETY: the kernel passes a valid `siginfo_t` to an `SA_SIGINFO` handler.
    let addr = unsafe { (*info).si_addr() }.addr();
    if let Some(fault) = AREA.fault_at(addr) {
        let mut text = StackText::<512>::new();
        let access = access_kind(context);
        let _ = match fault {
            GuardedFault::PastEnd { block, past_end } => write!(
                text,
                "tagalloc: guarded block overrun: {access} at {addr:#x}, {} byte(s) past the end of the {}-byte block at {:#x} ({}) allocated through {}",
                past_end + 1,
                block.size,
                block.start,
                if block.live { "live" } else { "freed" },
                Named(block.tag),
            ),
            GuardedFault::Elsewhere => write!(
                text,
                "tagalloc: {access} at {addr:#x}, inside tagalloc's guarded area but in no block"
            ),
        };
        let _ = text.write_char('\n');
        write_stderr(text.as_bytes());
    }
    // SAFETY: the arguments are the kernel's, passed on unchanged.
    unsafe { pass_on(signal, info, context) }
}

/// `"read"` or `"write"` where the machine says which, else `"access"`.
#[allow(unused_variables)]
fn access_kind(context: *mut libc::c_void) -> &'static str {
    #[cfg(all(target_os = "linux", target_arch = "x86_64"))]
    {
        // SAFETY: the kernel passes a `ucontext_t` as the third argument of an
        // `SA_SIGINFO` handler; the page-fault error code's bit 1 says "write".
        let error = unsafe {
            (*context.cast::<libc::ucontext_t>()).uc_mcontext.gregs[libc::REG_ERR as usize]
        };
        return if error & 2 != 0 { "write" } else { "read" };
    }
    #[allow(unreachable_code)]
    "access"
}

/// Hands a fault to the handler that was in place before ours: calls it, or (the
/// default action, or ignoring) restores it and returns, so that the faulting instruction
/// runs again under it.
///
/// # Safety
/// Called from our handler with its arguments.
unsafe fn pass_on(signal: libc::c_int, info: *mut libc::siginfo_t, context: *mut libc::c_void) {
    let index = usize::from(signal != libc::SIGSEGV);
    // SAFETY: written before our handler was installed, never again.
    let previous = unsafe { &(*PREVIOUS.0.get())[index] };
    let handler = previous.sa_sigaction;
    if handler == libc::SIG_DFL || handler == libc::SIG_IGN {
        // SAFETY: a zeroed `sigaction` is valid; SIG_DFL with an empty mask.
        unsafe {
            let mut default: libc::sigaction = core::mem::zeroed();
            default.sa_sigaction = libc::SIG_DFL;
            libc::sigemptyset(&mut default.sa_mask);
            libc::sigaction(signal, &default, core::ptr::null_mut());
        }
        return;
    }
    // SAFETY: a handler installed by someone else, called with the signature its flags
    // declare.
    unsafe {
        if previous.sa_flags & libc::SA_SIGINFO != 0 {
            let f: extern "C" fn(libc::c_int, *mut libc::siginfo_t, *mut libc::c_void) =
                core::mem::transmute(handler);
            f(signal, info, context);
        } else {
            let f: extern "C" fn(libc::c_int) = core::mem::transmute(handler);
            f(signal);
        }
    }
}

// ---- TAGALLOC_GUARDED ----

/// One `NAME=RATE` entry.
#[derive(Clone, Copy)]
struct Entry {
    name: [u8; MAX_NAME],
    len: u8,
    every: u32,
}

impl Entry {
    const EMPTY: Self = Self {
        name: [0; MAX_NAME],
        len: 0,
        every: 0,
    };

    fn name(&self) -> &[u8] {
        &self.name[..usize::from(self.len)]
    }

    fn is_wildcard(&self) -> bool {
        self.name() == b"*"
    }

    fn matches(&self, r: &Registration) -> bool {
        let me = self.name();
        me.eq_ignore_ascii_case(r.name().as_bytes())
            || me.eq_ignore_ascii_case(r.description().as_bytes())
    }
}

/// The parsed `TAGALLOC_GUARDED`.
#[derive(Clone, Copy)]
pub(crate) struct GuardedConfig {
    entries: [Entry; MAX_ENTRIES],
    len: usize,
}

impl GuardedConfig {
    const EMPTY: Self = Self {
        entries: [Entry::EMPTY; MAX_ENTRIES],
        len: 0,
    };

    fn entries(&self) -> &[Entry] {
        &self.entries[..self.len]
    }

    /// The rate for `r` (0: off), if an entry decides it: the last naming it, else the last
    /// `*`.
    fn rate_for(&self, r: &Registration) -> Option<u32> {
        let entries = self.entries();
        entries
            .iter()
            .rposition(|e| !e.is_wildcard() && e.matches(r))
            .or_else(|| entries.iter().rposition(Entry::is_wildcard))
            .map(|i| entries[i].every)
    }
}

/// Parses `NAME=1/N`, `NAME=N` or `NAME=off` entries separated by `,` or `;`. Bad entries
/// are left out and counted.
pub(crate) fn parse(text: &[u8]) -> (GuardedConfig, ParseProblems) {
    let mut config = GuardedConfig::EMPTY;
    let mut problems = ParseProblems::default();
    let mut note = |start: usize, end: usize, why: &'static str| {
        problems.bad_entries += 1;
        if problems.first.is_none() {
            problems.first = Some((start, end, why));
        }
    };
    let mut start = 0;
    while start <= text.len() {
        let end = text[start..]
            .iter()
            .position(|&b| b == b',' || b == b';')
            .map_or(text.len(), |i| start + i);
        let entry = &text[start..end];
        if !entry.trim_ascii().is_empty() {
            match parse_entry(entry) {
                Ok(_) if config.len == MAX_ENTRIES => note(start, end, "more than 32 entries"),
                Ok(parsed) => {
                    config.entries[config.len] = parsed;
                    config.len += 1;
                }
                Err(why) => note(start, end, why),
            }
        }
        start = end + 1;
    }
    (config, problems)
}

fn parse_entry(entry: &[u8]) -> Result<Entry, &'static str> {
    let eq = entry
        .iter()
        .position(|&b| b == b'=')
        .ok_or("expected NAME=1/N")?;
    let name = entry[..eq].trim_ascii();
    if name.is_empty() {
        return Err("missing allocator name before `=`");
    }
    if name.len() > MAX_NAME {
        return Err("allocator name longer than 63 bytes");
    }
    let mut out = Entry::EMPTY;
    out.name[..name.len()].copy_from_slice(name);
    out.len = name.len() as u8;
    out.every = parse_rate(&entry[eq + 1..])?;
    Ok(out)
}

/// `1/N`, `N` (one in `N`) or `off` (0).
fn parse_rate(text: &[u8]) -> Result<u32, &'static str> {
    let text = text.trim_ascii();
    if text.eq_ignore_ascii_case(b"off") || text == b"0" {
        return Ok(0);
    }
    let n = match text.iter().position(|&b| b == b'/') {
        Some(slash) => {
            if text[..slash].trim_ascii() != b"1" {
                return Err("a rate is 1/N");
            }
            &text[slash + 1..]
        }
        None => text,
    }
    .trim_ascii();
    if n.is_empty() || !n.iter().all(u8::is_ascii_digit) {
        return Err("a rate is 1/N, N a whole number from 1 to 4294967295, or `off`");
    }
    n.iter()
        .try_fold(0u32, |acc, &d| {
            acc.checked_mul(10)?.checked_add(u32::from(d - b'0'))
        })
        .filter(|&n| n > 0)
        .ok_or("a rate is 1/N, N a whole number from 1 to 4294967295, or `off`")
}

/// Written once while the environment is being read (by one thread), read after.
struct EnvConfig(UnsafeCell<GuardedConfig>);
// SAFETY: written only by the thread reading the environment, before it publishes that
// it has (release); read only after observing that (acquire), see `records::env`.
unsafe impl Sync for EnvConfig {}
static ENV: EnvConfig = EnvConfig(UnsafeCell::new(GuardedConfig::EMPTY));
static MATCHED: [AtomicBool; MAX_ENTRIES] = [const { AtomicBool::new(false) }; MAX_ENTRIES];

/// Reads `TAGALLOC_GUARDED`; called by `records::env` while it reads the environment
/// (once, on one thread, before any allocator gets its settings from it).
pub(crate) fn read_env() {
    let Some(text) = crate::config::env_bytes(c"TAGALLOC_GUARDED") else {
        return;
    };
    let (config, problems) = parse(text);
    warn_problems("TAGALLOC_GUARDED", text, &problems);
    // SAFETY: see `EnvConfig`: this thread is the only one reading the environment.
    unsafe { *ENV.0.get() = config };
    if config.len > 0 {
        // SAFETY: `warn_unmatched` is a plain `extern "C" fn()` living for the process.
        if unsafe { libc::atexit(warn_unmatched) } != 0 {
            write_stderr(b"tagalloc: atexit failed; TAGALLOC_GUARDED names are not checked\n");
        }
    }
}

/// Gives `r` the rate `TAGALLOC_GUARDED` sets for it (after [`read_env`]).
pub(crate) fn apply_env(r: &'static Registration) {
    // SAFETY: read after the environment was read (see `EnvConfig`).
    let config = unsafe { &*ENV.0.get() };
    for (i, entry) in config.entries().iter().enumerate() {
        if !entry.is_wildcard() && entry.matches(r) {
            MATCHED[i].store(true, Relaxed);
        }
    }
    if let Some(every) = config.rate_for(r) {
        r.apply_guarded_from_env(every);
    }
}

/// At exit: names the `TAGALLOC_GUARDED` entries that matched no allocator.
extern "C" fn warn_unmatched() {
    // SAFETY: as in `apply_env`.
    let config = unsafe { &*ENV.0.get() };
    let mut line = StackText::<512>::new();
    let mut unknown = 0;
    for (i, entry) in config.entries().iter().enumerate() {
        if entry.is_wildcard() || MATCHED[i].load(Relaxed) {
            continue;
        }
        let name = core::str::from_utf8(entry.name()).unwrap_or("?");
        let _ = if unknown == 0 {
            write!(
                line,
                "tagalloc: TAGALLOC_GUARDED names no allocator that registered: {name:?}"
            )
        } else {
            write!(line, ", {name:?}")
        };
        unknown += 1;
    }
    if unknown > 0 {
        let _ = line.write_str("\n");
        write_stderr(line.as_bytes());
    }
}

#[cfg(test)]
mod tests {
    use super::{parse, parse_rate};

    #[test]
    fn miri_rates_parse_or_are_refused() {
        assert_eq!(parse_rate(b"1/1000"), Ok(1000));
        assert_eq!(parse_rate(b" 1 / 7 "), Ok(7));
        assert_eq!(parse_rate(b"250"), Ok(250));
        assert_eq!(parse_rate(b"off"), Ok(0));
        assert_eq!(parse_rate(b"1/4294967295"), Ok(u32::MAX));
        assert!(parse_rate(b"1/4294967296").is_err());
        assert!(parse_rate(b"2/1000").is_err());
        assert!(parse_rate(b"1/0").is_err());
        assert!(parse_rate(b"sometimes").is_err());
        assert!(parse_rate(b"").is_err());
    }

    #[test]
    fn miri_entries_parse_and_bad_ones_are_counted() {
        let (config, problems) = parse(b"Renderer=1/1000, Network=200; *=off, Audio=often");
        assert_eq!(problems.bad_entries, 1);
        let rates: Vec<_> = config
            .entries()
            .iter()
            .map(|e| (e.name().to_vec(), e.every))
            .collect();
        assert_eq!(
            rates,
            [
                (b"Renderer".to_vec(), 1000),
                (b"Network".to_vec(), 200),
                (b"*".to_vec(), 0)
            ]
        );
    }
}
