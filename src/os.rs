//! The OS layer: the only code that asks the operating system for memory.
//!
//! [`OsAllocator`] maps and unmaps page runs with `mmap`/`munmap`, with any power-of-two
//! alignment (by over-mapping and trimming), gives pages back with `madvise`, and counts what
//! it holds. Nothing here allocates through the global allocator or panics: a failed map
//! returns null.
//!
//! The schemas above it take any [`PageSource`], so their algorithms can run on plain
//! memory under Miri, or on a fixed region a program hands them.

use crate::config::HugePages;
use core::ptr;
use core::sync::atomic::{AtomicU64, AtomicUsize, Ordering::Relaxed};

/// The size of a transparent huge page (x86-64 and most aarch64 Linux kernels).
#[cfg(target_os = "linux")]
const HUGE_PAGE: usize = 2 * 1024 * 1024;

/// [`HugePages::Auto`]'s threshold: small programs keep a small resident set.
const HUGE_PAGES_AUTO_FROM: usize = 8 * 1024 * 1024;

/// The heap that asks must have mapped half the process's threshold itself (4 MiB under
/// [`HugePages::Auto`], nothing under `Always`): a heap used lightly (a scoped tag's first
/// segment or chunk, in a program already past [`HUGE_PAGES_AUTO_FROM`]) would otherwise
/// turn a few KiB in use into a resident 2 MiB huge page: 64 tags, 128 MiB.
const fn owner_threshold(process_threshold: usize) -> usize {
    process_threshold / 2
}

/// This thread's CPU time in nanoseconds (0 if the clock cannot be read).
#[cfg(target_os = "linux")]
fn thread_cpu_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid out-pointer; the call has no other preconditions.
    unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    (ts.tv_sec as u64)
        .wrapping_mul(1_000_000_000)
        .wrapping_add(ts.tv_nsec as u64)
}

/// Where a schema gets its memory: runs of pages, mapped and unmapped whole.
///
/// # Safety
/// Implementations promise that a non-null pointer returned by [`PageSource::map`] is valid
/// for reads and writes of `len` bytes, is not part of any other live mapping, satisfies
/// `(ptr + offset) % align == 0`, reads as zero, and stays valid until the same range is
/// passed to [`PageSource::unmap`].
pub unsafe trait PageSource: Sync {
    /// The size that `len` and `offset` are multiples of, and the minimum alignment of maps.
    fn granularity(&self) -> usize;

    /// Maps `len` zeroed bytes at an address `p` with `(p + offset) % align == 0`, or returns
    /// null. `len` and `offset` are multiples of [`granularity`](PageSource::granularity);
    /// `align` is a power of two.
    fn map(&self, len: usize, align: usize, offset: usize) -> *mut u8;

    /// Returns a whole mapping to its source.
    ///
    /// # Safety
    /// `ptr` and `len` must be exactly a live mapping returned by [`PageSource::map`] (or
    /// [`PageSource::remap`]), and nothing may use that memory afterwards.
    unsafe fn unmap(&self, ptr: *mut u8, len: usize);

    /// Tells the source that the contents of `[ptr, ptr + len)` are no longer needed, so it
    /// may reclaim the physical pages. Returns `true` if the range now reads as zero.
    ///
    /// # Safety
    /// The range must lie inside one live mapping, be granularity-aligned, and hold no data
    /// anyone still needs.
    unsafe fn purge(&self, ptr: *mut u8, len: usize) -> bool;

    /// Asks for a mapping just made to be backed by huge pages where the system supports it
    /// and the source's policy wants them (Linux transparent huge pages). A hint: it may do
    /// nothing, or fault in the first huge page of the range at once (to learn what that
    /// costs), writing zeros. `owner_mapped`: the bytes the heap that asks had mapped before
    /// this mapping (`usize::MAX` for a mapping that is one block of its own), so that a
    /// heap used lightly is not backed by huge pages it would fill with a few blocks.
    ///
    /// # Safety
    /// The range must lie inside one live mapping from this source that nothing has
    /// written to yet and no other thread can reach.
    unsafe fn hint_huge_pages(&self, ptr: *mut u8, len: usize, owner_mapped: usize) {
        let _ = (ptr, len, owner_mapped);
    }

    /// The size of the huge pages a mapping may be backed by, where the source uses them
    /// (`None`: it does not, or they are turned off). A mapping that will hold one large
    /// block is placed on such a boundary so that whole huge pages fit in it.
    fn huge_page_size(&self) -> Option<usize> {
        None
    }

    /// Resizes a mapping, moving it if needed, keeping its contents (Linux `mremap`). Returns
    /// null if unsupported or failed, in which case the old mapping is untouched. A mapping
    /// that grows past a huge page keeps its offset from a huge-page boundary where it moves
    /// (see [`huge_page_size`](Self::huge_page_size)); otherwise the result is only
    /// granularity-aligned.
    ///
    /// # Safety
    /// `ptr`/`old_len` must be a live mapping from this source; on success the old range must
    /// not be used again.
    unsafe fn remap(&self, ptr: *mut u8, old_len: usize, new_len: usize) -> *mut u8 {
        let _ = (ptr, old_len, new_len);
        ptr::null_mut()
    }
}

/// Milliseconds of a coarse monotonic clock (`CLOCK_MONOTONIC_COARSE`: a vDSO read, no
/// system call, no allocation).
pub fn monotonic_ms() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is writable; the clock id is valid on Linux.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC_COARSE, &mut ts) };
    ts.tv_sec as u64 * 1000 + ts.tv_nsec as u64 / 1_000_000
}

/// Counters of everything the OS layer has done, read with [`OsAllocator::stats`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct OsStats {
    /// Bytes currently mapped through the OS layer.
    pub mapped_bytes: usize,
    /// The most bytes ever mapped at once.
    pub peak_mapped_bytes: usize,
    /// Successful map calls.
    pub map_calls: usize,
    /// Unmap calls.
    pub unmap_calls: usize,
    /// Maps that failed (the OS refused, or a failure was injected).
    pub failed_maps: usize,
    /// Purge (`madvise`) calls.
    pub purge_calls: usize,
    /// Bytes handed back to the OS by purges, summed over all calls.
    pub purged_bytes: usize,
    /// Mappings advised to use transparent huge pages (see `TAGALLOC_HUGE_PAGES`).
    pub huge_page_hints: usize,
    /// Of those, first huge-page faults that took over a millisecond of CPU time (the
    /// kernel compacting memory to find a free huge page). At
    /// [`HUGE_PAGE_STALLS_TO_STOP`] the OS layer stops asking for huge pages.
    pub huge_page_stalls: usize,
}

/// CPU time of a huge page's first fault above which it counts as a stall. Zeroing 2 MiB
/// takes well under this; direct compaction takes milliseconds.
const HUGE_PAGE_STALL_NS: u64 = 1_000_000;

/// [`HUGE_PAGE_STALL_NS`], unless a test lowered it.
static HUGE_PAGE_STALL_AT: AtomicU64 = AtomicU64::new(HUGE_PAGE_STALL_NS);

/// Stalls after which the process asks for no more huge pages (so a machine whose memory is
/// fragmented costs a couple of slow faults, not one per 2 MiB of heap growth).
pub const HUGE_PAGE_STALLS_TO_STOP: usize = 2;

/// Bytes the OS layer must map before it asks for huge pages; `usize::MAX`: never. The
/// default is [`HugePages::Auto`]'s.
static HUGE_PAGES_FROM: AtomicUsize = AtomicUsize::new(HUGE_PAGES_AUTO_FROM);
static HUGE_PAGE_HINTS: AtomicUsize = AtomicUsize::new(0);
static HUGE_PAGE_STALLS: AtomicUsize = AtomicUsize::new(0);

static MAPPED: AtomicUsize = AtomicUsize::new(0);
static PEAK_MAPPED: AtomicUsize = AtomicUsize::new(0);
static MAP_CALLS: AtomicUsize = AtomicUsize::new(0);
static UNMAP_CALLS: AtomicUsize = AtomicUsize::new(0);
static FAILED_MAPS: AtomicUsize = AtomicUsize::new(0);
static PURGE_CALLS: AtomicUsize = AtomicUsize::new(0);
static PURGED_BYTES: AtomicUsize = AtomicUsize::new(0);
static INJECTED_FAILURES: AtomicUsize = AtomicUsize::new(0);
static PAGE_SIZE: AtomicUsize = AtomicUsize::new(0);

/// The operating system's pages: `mmap`, `munmap`, `madvise`, `mremap`.
///
/// A unit type: every instance shares the process-wide counters.
#[derive(Clone, Copy, Debug, Default)]
pub struct OsAllocator;

impl OsAllocator {
    /// The OS page size (read once with `sysconf`, which does not allocate).
    #[inline]
    pub fn page_size() -> usize {
        let cached = PAGE_SIZE.load(Relaxed);
        if cached != 0 {
            return cached;
        }
        // SAFETY: sysconf has no preconditions.
        let size = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
        let size = if size > 0 { size as usize } else { 4096 };
        PAGE_SIZE.store(size, Relaxed);
        size
    }

    /// A snapshot of the OS layer's counters.
    pub fn stats() -> OsStats {
        OsStats {
            mapped_bytes: MAPPED.load(Relaxed),
            peak_mapped_bytes: PEAK_MAPPED.load(Relaxed),
            map_calls: MAP_CALLS.load(Relaxed),
            unmap_calls: UNMAP_CALLS.load(Relaxed),
            failed_maps: FAILED_MAPS.load(Relaxed),
            purge_calls: PURGE_CALLS.load(Relaxed),
            purged_bytes: PURGED_BYTES.load(Relaxed),
            huge_page_hints: HUGE_PAGE_HINTS.load(Relaxed),
            huge_page_stalls: HUGE_PAGE_STALLS.load(Relaxed),
        }
    }

    /// Chooses when new mappings of the heaps ask for transparent huge pages (the setting is
    /// process-wide; `TAGALLOC_HUGE_PAGES` sets it at start): [`HugePages::Auto`] once
    /// 8 MiB are mapped and the heap that grows has mapped 4 MiB itself,
    /// [`HugePages::Always`] from the first mapping.
    pub fn set_huge_pages(mode: HugePages) {
        let from = match mode {
            HugePages::Auto => HUGE_PAGES_AUTO_FROM,
            HugePages::Always => 0,
            HugePages::Never => usize::MAX,
        };
        HUGE_PAGES_FROM.store(from, Relaxed);
    }

    /// Whether a mapping of `len` bytes just made asks for huge pages: the bytes mapped
    /// before it, by the process and by the heap that asks (`owner_mapped`), reach the
    /// thresholds, and huge pages have not stalled too often.
    #[cfg(target_os = "linux")]
    fn huge_pages_wanted(len: usize, owner_mapped: usize) -> bool {
        let from = HUGE_PAGES_FROM.load(Relaxed);
        MAPPED.load(Relaxed).saturating_sub(len) >= from
            && owner_mapped >= owner_threshold(from)
            && HUGE_PAGE_STALLS.load(Relaxed) < HUGE_PAGE_STALLS_TO_STOP
    }

    /// Sets the CPU time above which a first huge-page fault counts as a stall (1 ms unless
    /// changed): for tests of the stall guard, which set it to 0 so every fault counts.
    #[doc(hidden)]
    pub fn set_huge_page_stall_ns(ns: u64) {
        HUGE_PAGE_STALL_AT.store(ns, Relaxed);
    }

    /// Makes the next `count` map requests fail as if the OS had refused them.
    ///
    /// For tests of out-of-memory handling: everything above the OS layer must turn the
    /// failure into a null pointer or an error, never a crash.
    pub fn inject_map_failures(count: usize) {
        INJECTED_FAILURES.store(count, Relaxed);
    }

    /// The resident set size of this process in bytes, read from `/proc/self/statm`
    /// without allocating. `None` where that file does not exist.
    pub fn process_resident_bytes() -> Option<usize> {
        let mut buf = [0u8; 128];
        // SAFETY: the path is NUL-terminated; `buf` is writable for its length; the fd is
        // closed before returning.
        let n = unsafe {
            let fd = libc::open(
                c"/proc/self/statm".as_ptr(),
                libc::O_RDONLY | libc::O_CLOEXEC,
            );
            if fd < 0 {
                return None;
            }
            let n = libc::read(fd, buf.as_mut_ptr().cast(), buf.len());
            libc::close(fd);
            n
        };
        if n <= 0 {
            return None;
        }
        // Second field: resident pages.
        let text = &buf[..n as usize];
        let mut fields = text.split(|b| *b == b' ');
        fields.next()?;
        let resident = fields.next()?;
        let mut pages = 0usize;
        for &digit in resident {
            if !digit.is_ascii_digit() {
                return None;
            }
            pages = pages
                .checked_mul(10)?
                .checked_add((digit - b'0') as usize)?;
        }
        pages.checked_mul(Self::page_size())
    }

    fn take_injected_failure() -> bool {
        let mut left = INJECTED_FAILURES.load(Relaxed);
        while left > 0 {
            match INJECTED_FAILURES.compare_exchange_weak(left, left - 1, Relaxed, Relaxed) {
                Ok(_) => return true,
                Err(now) => left = now,
            }
        }
        false
    }

    fn note_mapped(len: usize) {
        MAP_CALLS.fetch_add(1, Relaxed);
        let now = MAPPED.fetch_add(len, Relaxed) + len;
        PEAK_MAPPED.fetch_max(now, Relaxed);
    }

    /// Maps `len` bytes, or null. Without `MAP_NORESERVE`: that flag skips the kernel's
    /// overcommit check, so a request far beyond the machine's memory (a 64 TiB
    /// `try_reserve` on a 24 GiB machine) would succeed and the program be killed later when
    /// it touched the pages, instead of getting null (`AllocError`) now, as from glibc.
    fn raw_map(len: usize) -> *mut u8 {
        // SAFETY: an anonymous private mapping with no address hint has no preconditions.
        let p = unsafe {
            libc::mmap(
                ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if p == libc::MAP_FAILED {
            ptr::null_mut()
        } else {
            p.cast()
        }
    }

    /// Reserves `len` bytes of address space at an `align`-aligned address (a power of two,
    /// at least a page), inaccessible and not counted as mapped until parts of it are
    /// [committed](Self::commit); null if the address space is not there. For areas that
    /// grow in place inside a fixed range (guarded slots, never released) and for the place
    /// a growing mapping moves to (`grow_in_step`). `hint` (0: none)
    /// is where the caller would like it; the kernel places it elsewhere when that range is
    /// taken or out of reach.
    pub(crate) fn reserve(len: usize, align: usize, hint: usize) -> *mut u8 {
        let Some(over) = len.checked_add(align) else {
            return ptr::null_mut();
        };
        // SAFETY: an anonymous private mapping without `MAP_FIXED` has no preconditions: the
        // address is only a hint, never a range that gets replaced.
        let p = unsafe {
            libc::mmap(
                ptr::without_provenance_mut(hint),
                over,
                libc::PROT_NONE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
                -1,
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return ptr::null_mut();
        }
        let base = p.cast::<u8>();
        let start = base.addr().next_multiple_of(align);
        let head = start - base.addr();
        Self::raw_unmap(base, head);
        // SAFETY: `head <= align`, so the aligned start and the tail lie inside the mapping.
        let aligned = unsafe { base.add(head) };
        // SAFETY: as above: `head + len <= over`.
        Self::raw_unmap(unsafe { aligned.add(len) }, over - head - len);
        aligned
    }

    /// Makes `[ptr, ptr + len)` of a [reservation](Self::reserve) readable and writable
    /// (zeroed), counted as mapped; `false` if the kernel refuses (out of memory).
    ///
    /// # Safety
    /// The range is page-aligned, inside a reservation, and not committed yet.
    pub(crate) unsafe fn commit(ptr: *mut u8, len: usize) -> bool {
        if Self::take_injected_failure() {
            FAILED_MAPS.fetch_add(1, Relaxed);
            return false;
        }
        // SAFETY: forwarded from the caller: a page-aligned range of our own reservation.
        let rc = unsafe { libc::mprotect(ptr.cast(), len, libc::PROT_READ | libc::PROT_WRITE) };
        if rc != 0 {
            FAILED_MAPS.fetch_add(1, Relaxed);
            return false;
        }
        Self::note_mapped(len);
        true
    }

    fn raw_unmap(ptr: *mut u8, len: usize) {
        if len == 0 {
            return;
        }
        // SAFETY: callers pass page-aligned ranges inside mappings this layer made.
        let rc = unsafe { libc::munmap(ptr.cast(), len) };
        debug_assert_eq!(rc, 0, "munmap failed");
    }
}

// SAFETY: `map` returns fresh anonymous mappings (zeroed, unaliased) placed as asked, and
// only `unmap` releases them.
unsafe impl PageSource for OsAllocator {
    #[inline]
    fn granularity(&self) -> usize {
        Self::page_size()
    }

    fn map(&self, len: usize, align: usize, offset: usize) -> *mut u8 {
        let page = Self::page_size();
        debug_assert!(align.is_power_of_two());
        debug_assert!(len % page == 0 && offset % page == 0);
        if len == 0 || Self::take_injected_failure() {
            FAILED_MAPS.fetch_add(1, Relaxed);
            return ptr::null_mut();
        }
        if align <= page {
            let p = Self::raw_map(len);
            if p.is_null() {
                FAILED_MAPS.fetch_add(1, Relaxed);
            } else {
                Self::note_mapped(len);
            }
            return p;
        }
        // Over-map by `align` and trim both ends so that `p + offset` lands on `align`.
        let Some(over) = len.checked_add(align) else {
            FAILED_MAPS.fetch_add(1, Relaxed);
            return ptr::null_mut();
        };
        let base = Self::raw_map(over);
        if base.is_null() {
            FAILED_MAPS.fetch_add(1, Relaxed);
            return base;
        }
        let base_addr = base as usize;
        let target = (base_addr + offset).next_multiple_of(align);
        let start = target - offset;
        let start = if start < base_addr {
            start + align
        } else {
            start
        };
        let head = start - base_addr;
        // SAFETY: `head <= align`, so `start` and the tail lie inside the `over` mapping.
        let p = unsafe { base.add(head) };
        Self::raw_unmap(base, head);
        // SAFETY: `head + len <= over`.
        Self::raw_unmap(unsafe { p.add(len) }, over - head - len);
        Self::note_mapped(len);
        p
    }

    unsafe fn unmap(&self, ptr: *mut u8, len: usize) {
        Self::raw_unmap(ptr, len);
        UNMAP_CALLS.fetch_add(1, Relaxed);
        MAPPED.fetch_sub(len, Relaxed);
    }

    unsafe fn purge(&self, ptr: *mut u8, len: usize) -> bool {
        if len == 0 {
            return true;
        }
        // SAFETY: the caller passes a page-aligned range inside a live private anonymous
        // mapping; MADV_DONTNEED makes it read back as zero on next touch.
        let rc = unsafe { libc::madvise(ptr.cast(), len, libc::MADV_DONTNEED) };
        PURGE_CALLS.fetch_add(1, Relaxed);
        if rc == 0 {
            PURGED_BYTES.fetch_add(len, Relaxed);
        }
        rc == 0
    }

    #[cfg(target_os = "linux")]
    unsafe fn hint_huge_pages(&self, ptr: *mut u8, len: usize, owner_mapped: usize) {
        if !Self::huge_pages_wanted(len, owner_mapped) {
            return;
        }
        // SAFETY: the caller passes a range inside a live mapping; the advice changes only
        // how the kernel backs it.
        if unsafe { libc::madvise(ptr.cast(), len, libc::MADV_HUGEPAGE) } != 0 {
            return;
        }
        HUGE_PAGE_HINTS.fetch_add(1, Relaxed);
        // Fault the first whole huge page in now and time it: with the kernel's usual
        // `defrag=madvise`, a huge-page fault compacts memory when no free huge page is at
        // hand, which can take milliseconds each time. Thread CPU time, so that being
        // descheduled does not count.
        let first = ptr.addr().next_multiple_of(HUGE_PAGE);
        if first.saturating_add(HUGE_PAGE) > ptr.addr() + len {
            return;
        }
        let before = thread_cpu_ns();
        // SAFETY: inside the caller's fresh mapping, which nothing has written to and no
        // other thread reaches: writing a zero where the page reads as zero changes nothing
        // but its backing.
        unsafe { ptr.with_addr(first).write_volatile(0) };
        if thread_cpu_ns().saturating_sub(before) > HUGE_PAGE_STALL_AT.load(Relaxed) {
            HUGE_PAGE_STALLS.fetch_add(1, Relaxed);
        }
    }

    #[cfg(target_os = "linux")]
    fn huge_page_size(&self) -> Option<usize> {
        (HUGE_PAGES_FROM.load(Relaxed) != usize::MAX).then_some(HUGE_PAGE)
    }

    #[cfg(target_os = "linux")]
    unsafe fn remap(&self, ptr: *mut u8, old_len: usize, new_len: usize) -> *mut u8 {
        let p = if new_len > old_len && new_len >= HUGE_PAGE && self.huge_page_size().is_some() {
            // SAFETY: forwarded from the caller.
            unsafe { Self::grow_in_step(ptr, old_len, new_len) }
        } else {
            // SAFETY: the caller passes a live mapping of this layer; MREMAP_MAYMOVE keeps
            // the old mapping intact on failure.
            unsafe { libc::mremap(ptr.cast(), old_len, new_len, libc::MREMAP_MAYMOVE) }
        };
        if p == libc::MAP_FAILED {
            return ptr::null_mut();
        }
        if new_len >= old_len && Self::huge_pages_wanted(new_len, usize::MAX) {
            // A buffer that grew into huge-page sizes: its fresh part may take huge pages.
            // SAFETY: `p` is the live mapping of `new_len` bytes just made; the advice
            // changes only how the kernel backs it.
            unsafe { libc::madvise(p, new_len, libc::MADV_HUGEPAGE) };
        }
        if new_len >= old_len {
            let grown = new_len - old_len;
            let now = MAPPED.fetch_add(grown, Relaxed) + grown;
            PEAK_MAPPED.fetch_max(now, Relaxed);
        } else {
            MAPPED.fetch_sub(old_len - new_len, Relaxed);
        }
        p.cast()
    }
}

#[cfg(target_os = "linux")]
impl OsAllocator {
    /// `mremap` growth that keeps the mapping's offset from a 2 MiB boundary: in place where
    /// the address space after it is free, else into a reservation at the same offset. Where
    /// the kernel chooses the new address (`MREMAP_MAYMOVE` alone), a payload placed on a
    /// huge-page boundary lands anywhere, the huge pages already backing it are split, and
    /// its fresh part straddles the boundaries, so a buffer grown by doubling was backed by
    /// 4 KiB pages almost whole (a fault per 4 KiB). `MAP_FAILED` as `mremap` reports it.
    ///
    /// # Safety
    /// `ptr`/`old_len` is a live mapping of this layer, `new_len > old_len`.
    unsafe fn grow_in_step(ptr: *mut u8, old_len: usize, new_len: usize) -> *mut libc::c_void {
        // SAFETY: a live mapping (caller); without MREMAP_MAYMOVE it grows in place or fails
        // untouched.
        let p = unsafe { libc::mremap(ptr.cast(), old_len, new_len, 0) };
        if p != libc::MAP_FAILED {
            return p;
        }
        let moved_anywhere = || {
            // SAFETY: as above; MREMAP_MAYMOVE keeps the old mapping intact on failure.
            unsafe { libc::mremap(ptr.cast(), old_len, new_len, libc::MREMAP_MAYMOVE) }
        };
        // A reservation on a huge-page boundary, long enough for the mapping grown at the
        // same offset from it; the part before that offset goes at once.
        let offset = ptr.addr() % HUGE_PAGE;
        let Some(span) = new_len.checked_add(offset) else {
            return moved_anywhere();
        };
        let reserved = Self::reserve(span, HUGE_PAGE, 0);
        if reserved.is_null() {
            return moved_anywhere();
        }
        Self::raw_unmap(reserved, offset);
        let target = reserved.wrapping_add(offset);
        // The move keeps the size and the growth is in place after it, in two calls, because
        // valgrind's memcheck takes the part a single moving-and-growing `mremap` adds for
        // inaccessible memory (every write to it then reads as an error). The move leaves
        // the old range mapped (empty) where the kernel can (MREMAP_DONTUNMAP, Linux 5.7), so
        // that if the growth then fails (the commit limit refuses it) the mapping can go
        // back: no other thread can have mapped into its old range meanwhile.
        let move_to_target = |flags: libc::c_int| {
            // SAFETY: `target .. target + new_len` is the rest of the reservation, ours,
            // which MREMAP_FIXED replaces; the old mapping is intact if this fails.
            unsafe {
                libc::mremap(
                    ptr.cast(),
                    old_len,
                    old_len,
                    libc::MREMAP_MAYMOVE | libc::MREMAP_FIXED | flags,
                    target.cast::<libc::c_void>(),
                )
            }
        };
        let mut moved = move_to_target(libc::MREMAP_DONTUNMAP);
        let held = moved != libc::MAP_FAILED;
        if !held {
            // An older kernel, or a mapping it will not leave behind: moved outright.
            moved = move_to_target(0);
        }
        if moved == libc::MAP_FAILED {
            Self::raw_unmap(target, new_len);
            return moved_anywhere();
        }
        // The old range, left mapped by MREMAP_DONTUNMAP, once the mapping has grown.
        let release_old = |p: *mut libc::c_void| {
            if held {
                Self::raw_unmap(ptr, old_len);
            }
            p
        };
        // The reservation after the moved mapping: where it grows.
        Self::raw_unmap(target.wrapping_add(old_len), new_len - old_len);
        // SAFETY: `moved` is the live mapping of `old_len` bytes; in place or failing
        // untouched.
        let p = unsafe { libc::mremap(moved, old_len, new_len, 0) };
        if p != libc::MAP_FAILED {
            return release_old(p);
        }
        // Another thread mapped into the space just freed: anywhere, then.
        // SAFETY: as above; MREMAP_MAYMOVE keeps the mapping intact on failure.
        let p = unsafe { libc::mremap(moved, old_len, new_len, libc::MREMAP_MAYMOVE) };
        if p != libc::MAP_FAILED {
            return release_old(p);
        }
        // Out of memory or address space: a failed remap leaves the mapping where the caller
        // has it, so it goes back onto `ptr`, a range of ours that MREMAP_FIXED replaces.
        let back_onto_old_range = || {
            // SAFETY: `moved` is live with `old_len` bytes; the caller of this closure holds
            // the range at `ptr` (see each call).
            let back = unsafe {
                libc::mremap(
                    moved,
                    old_len,
                    old_len,
                    libc::MREMAP_MAYMOVE | libc::MREMAP_FIXED,
                    ptr.cast::<libc::c_void>(),
                )
            };
            back == ptr.cast()
        };
        // Held: the empty mapping MREMAP_DONTUNMAP left there.
        if held && back_onto_old_range() {
            return libc::MAP_FAILED;
        }
        // Else claimed first (MAP_FIXED_NOREPLACE fails, or on kernels before 4.17 places it
        // elsewhere, where another thread took the range).
        // SAFETY: an inaccessible anonymous mapping at `ptr` only if that range is free.
        let claim = unsafe {
            libc::mmap(
                ptr.cast(),
                old_len,
                libc::PROT_NONE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_FIXED_NOREPLACE,
                -1,
                0,
            )
        };
        if claim == ptr.cast() && back_onto_old_range() {
            return libc::MAP_FAILED;
        }
        crate::fatal::fatal!(
            "out of address space while growing the mapping at {ptr:p} ({old_len} -> \
             {new_len} bytes): it moved to {moved:p} and cannot move back"
        );
    }
}

/// A page source over ordinary heap memory, for running the schemas under Miri.
#[cfg(test)]
pub(crate) mod heap_source {
    use super::PageSource;
    use std::alloc::{GlobalAlloc, Layout, System};
    use std::sync::Mutex;

    struct Mapping {
        start: usize,
        len: usize,
        base: *mut u8,
        layout: Layout,
    }
    // SAFETY: a `Mapping` only records where a System block lives; it is freed once, under
    // the mutex.
    unsafe impl Send for Mapping {}

    /// Hands out `System` allocations as if they were page mappings; remembers each one so
    /// `unmap` can free it and tests can see what is still mapped.
    #[derive(Default)]
    pub(crate) struct HeapPages {
        live: Mutex<Vec<Mapping>>,
    }

    impl HeapPages {
        pub(crate) const GRANULE: usize = 4096;

        /// Bytes currently mapped (the `len`s asked for).
        pub(crate) fn mapped_bytes(&self) -> usize {
            self.live.lock().unwrap().iter().map(|m| m.len).sum()
        }
    }

    impl Drop for HeapPages {
        fn drop(&mut self) {
            for m in self.live.get_mut().unwrap().drain(..) {
                // SAFETY: each block was allocated with this layout and not freed yet.
                unsafe { System.dealloc(m.base, m.layout) };
            }
        }
    }

    // SAFETY: each map is a fresh zeroed System allocation, placed as asked inside a larger
    // block, and freed only by `unmap` or drop.
    unsafe impl PageSource for HeapPages {
        fn granularity(&self) -> usize {
            Self::GRANULE
        }

        fn map(&self, len: usize, align: usize, offset: usize) -> *mut u8 {
            let align = align.max(Self::GRANULE);
            let Some(size) = len.checked_add(align) else {
                return core::ptr::null_mut();
            };
            let Ok(layout) = Layout::from_size_align(size, align) else {
                return core::ptr::null_mut();
            };
            // SAFETY: the layout has a non-zero size.
            let base = unsafe { System.alloc_zeroed(layout) };
            if base.is_null() {
                return base;
            }
            let shift = (align - offset % align) % align;
            // SAFETY: `shift < align`, so `[p, p + len)` lies inside the block.
            let p = unsafe { base.add(shift) };
            self.live.lock().unwrap().push(Mapping {
                start: p.addr(),
                len,
                base,
                layout,
            });
            p
        }

        unsafe fn unmap(&self, ptr: *mut u8, len: usize) {
            let mut live = self.live.lock().unwrap();
            let i = live
                .iter()
                .position(|m| m.start == ptr.addr() && m.len == len)
                .expect("unmap of a range that is not a live mapping");
            let m = live.swap_remove(i);
            // SAFETY: the block was allocated with this layout and is freed once.
            unsafe { System.dealloc(m.base, m.layout) };
        }

        unsafe fn purge(&self, ptr: *mut u8, len: usize) -> bool {
            // SAFETY: the caller passes a range inside a live mapping.
            unsafe { ptr.write_bytes(0, len) };
            true
        }
    }
}
