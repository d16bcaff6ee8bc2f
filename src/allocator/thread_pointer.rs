//! Reaching the calling thread's cache (and the records' per-thread state) from the thread
//! pointer, without a TLS helper call.
//!
//! Rust compiles a `thread_local!` access in position-independent code (every rlib, and
//! every executable built as PIE) for the general-dynamic TLS model: a call to
//! `__tls_get_addr`. The linker rewrites that call into two plain instructions when the
//! variable ends up in the executable, but the compiler has already planned for a call,
//! which clobbers every caller-saved register: the allocator's fast paths then save and
//! restore four registers per call (about a dozen instructions per alloc+free pair).
//!
//! When tagalloc is linked into the main executable, its TLS block sits at a fixed offset
//! from the thread pointer in every thread (the ELF TLS ABI's "static TLS", on which the
//! local-exec model relies). The offset of the thread cache is learnt when the first cache
//! registers, and the fast paths then compute the cache's address as `%fs:0 + offset`: one
//! load, no call. Anywhere else (a shared library, whose TLS may be allocated per thread
//! on demand; another architecture; Miri; `TAGALLOC_THREAD_POINTER=off`) the offset stays
//! unknown and the fast paths take the ordinary `thread_local!` access instead.

#[cfg(all(target_arch = "x86_64", target_os = "linux", not(miri)))]
mod imp {
    use crate::fatal::fatal;
    use core::sync::atomic::{AtomicU8, AtomicUsize, Ordering::Relaxed};

    /// A thread-local's address minus the thread pointer, the same in every thread; 0 while
    /// unknown (a static TLS block lies below the thread pointer, never at it).
    struct Offset(AtomicUsize);

    impl Offset {
        #[inline(always)]
        fn address(&self) -> Option<usize> {
            let offset = self.0.load(Relaxed);
            (offset != 0).then(|| thread_pointer().wrapping_add(offset))
        }

        fn learn(&self, address: usize, what: &str) {
            let offset = address.wrapping_sub(thread_pointer());
            match self.0.load(Relaxed) {
                0 if offset != 0 && linked_into_main_executable() => {
                    self.0.store(offset, Relaxed);
                }
                0 => {}
                known if known != offset => fatal!(
                    "tagalloc: this thread's {what} is not at the static TLS offset the others \
                     use ({offset:#x} vs {known:#x}); the thread-pointer fast path cannot be used"
                ),
                _ => {}
            }
        }
    }

    /// The thread cache's offset.
    static CACHE_OFFSET: Offset = Offset(AtomicUsize::new(0));
    /// The offset of the records' per-thread state.
    static RECORDS_OFFSET: Offset = Offset(AtomicUsize::new(0));

    const UNKNOWN: u8 = 0;
    const MAIN: u8 = 1;
    const ELSEWHERE: u8 = 2;
    static LINKED: AtomicU8 = AtomicU8::new(UNKNOWN);

    /// The thread pointer: on x86-64 Linux (glibc and musl) the word at `%fs:0` holds it.
    #[inline(always)]
    fn thread_pointer() -> usize {
        let tp: usize;
        // SAFETY: reading `%fs:0` is valid in every thread of a Linux x86-64 process (the
        // thread control block's self pointer); it has no other effect.
        unsafe {
            core::arch::asm!(
                "mov {}, qword ptr fs:[0]",
                out(reg) tp,
                options(nostack, preserves_flags, readonly, pure)
            );
        }
        tp
    }

    /// The calling thread's cache address, once the offset is known.
    #[inline(always)]
    pub(crate) fn cache_address() -> Option<usize> {
        CACHE_OFFSET.address()
    }

    /// The thread cache's offset from the thread pointer, once known (the same in every
    /// thread).
    pub(crate) fn cache_offset() -> Option<usize> {
        let offset = CACHE_OFFSET.0.load(Relaxed);
        (offset != 0).then_some(offset)
    }

    /// The calling thread's copy of a thread-cache field whose offset from the thread
    /// pointer is `offset` (a child's lane: [`cache_offset`] plus the lane's offset in the
    /// cache); `None` for 0, "no such field".
    #[inline(always)]
    pub(crate) fn address_at(offset: usize) -> Option<usize> {
        (offset != 0).then(|| thread_pointer().wrapping_add(offset))
    }

    /// Called by each thread's cache as it registers, with its own address: learns the
    /// offset the first time (if tagalloc is in the main executable) and checks it after.
    pub(crate) fn learn(cache: usize) {
        CACHE_OFFSET.learn(cache, "cache");
    }

    /// The calling thread's records state (see `records::guard`), once its offset is known.
    #[inline(always)]
    pub(crate) fn records_address() -> Option<usize> {
        RECORDS_OFFSET.address()
    }

    /// As [`learn`], for the records' per-thread state.
    pub(crate) fn learn_records(state: usize) {
        RECORDS_OFFSET.learn(state, "records state");
    }

    /// Whether this code is part of the main executable (rather than a shared library):
    /// the auxiliary vector's program headers of the main program are searched for the
    /// loaded segment that holds this very function. Reads memory only, allocates nothing.
    /// `TAGALLOC_THREAD_POINTER=off` answers no.
    fn linked_into_main_executable() -> bool {
        match LINKED.load(Relaxed) {
            MAIN => return true,
            ELSEWHERE => return false,
            _ => {}
        }
        let found = crate::config::thread_pointer_from_env()
            && search_main_program(linked_into_main_executable as *const () as usize);
        LINKED.store(if found { MAIN } else { ELSEWHERE }, Relaxed);
        found
    }

    pub(super) fn search_main_program(address: usize) -> bool {
        // SAFETY: `getauxval` only reads the auxiliary vector.
        let (phdr, count) = unsafe {
            (
                libc::getauxval(libc::AT_PHDR) as usize,
                libc::getauxval(libc::AT_PHNUM) as usize,
            )
        };
        if phdr == 0 || count == 0 {
            return false;
        }
        let table = phdr as *const libc::Elf64_Phdr;
        // SAFETY: the kernel's AT_PHDR/AT_PHNUM describe the main program's program header
        // table, mapped for the life of the process.
        let headers = unsafe { core::slice::from_raw_parts(table, count) };
        // The load bias: where the table is minus where the program said it would be.
        let Some(bias) = headers
            .iter()
            .find(|h| h.p_type == libc::PT_PHDR)
            .map(|h| phdr.wrapping_sub(h.p_vaddr as usize))
        else {
            return false;
        };
        headers.iter().any(|h| {
            let start = bias.wrapping_add(h.p_vaddr as usize);
            h.p_type == libc::PT_LOAD && address >= start && address - start < h.p_memsz as usize
        })
    }
}

#[cfg(not(all(target_arch = "x86_64", target_os = "linux", not(miri))))]
mod imp {
    /// Unknown on this platform: the fast paths use the `thread_local!` access.
    #[inline(always)]
    pub(crate) fn cache_address() -> Option<usize> {
        None
    }

    /// Unknown on this platform, as [`cache_address`].
    pub(crate) fn cache_offset() -> Option<usize> {
        None
    }

    /// Never known on this platform (no offset is ever learnt).
    #[inline(always)]
    pub(crate) fn address_at(_offset: usize) -> Option<usize> {
        None
    }

    /// Nothing to learn on this platform.
    pub(crate) fn learn(_cache: usize) {}

    /// Unknown on this platform, as [`cache_address`].
    #[inline(always)]
    pub(crate) fn records_address() -> Option<usize> {
        None
    }

    /// Nothing to learn on this platform.
    pub(crate) fn learn_records(_state: usize) {}
}

pub(crate) use imp::{
    address_at, cache_address, cache_offset, learn, learn_records, records_address,
};

#[cfg(all(test, target_arch = "x86_64", target_os = "linux", not(miri)))]
mod tests {
    #[test]
    fn a_test_binary_is_the_main_executable() {
        assert!(super::imp::search_main_program(
            super::imp::search_main_program as *const () as usize
        ));
        // A libc function lives in a shared library, not in the main program.
        assert!(!super::imp::search_main_program(
            libc::getauxval as *const () as usize
        ));
    }
}
