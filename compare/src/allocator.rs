//! The `#[global_allocator]` of this build, chosen by exactly one `alloc-*` feature, and its
//! optional "give memory back" hook.
//!
//! The choice lives in the library (not in each binary) so that `workload` and `pairs` are
//! guaranteed to measure the same allocator configuration. Without any `alloc-*` feature no
//! global allocator is declared and Rust's default (System) is used: that is how the `compare`
//! driver itself is built, and the workload binaries refuse to run in that state so a
//! misconfigured build cannot be mistaken for a measurement.

#[cfg(any(
    all(feature = "alloc-tagalloc", feature = "alloc-system"),
    all(feature = "alloc-tagalloc", feature = "alloc-mimalloc"),
    all(feature = "alloc-tagalloc", feature = "alloc-jemalloc"),
    all(feature = "alloc-tagalloc", feature = "alloc-tracking"),
    all(feature = "alloc-system", feature = "alloc-mimalloc"),
    all(feature = "alloc-system", feature = "alloc-jemalloc"),
    all(feature = "alloc-system", feature = "alloc-tracking"),
    all(feature = "alloc-mimalloc", feature = "alloc-jemalloc"),
    all(feature = "alloc-mimalloc", feature = "alloc-tracking"),
    all(feature = "alloc-jemalloc", feature = "alloc-tracking"),
    all(feature = "alloc-tagalloc-child", feature = "alloc-tagalloc-scoped"),
    all(feature = "alloc-tagalloc-child", feature = "alloc-tagalloc-nothp"),
    all(feature = "alloc-tagalloc-scoped", feature = "alloc-tagalloc-nothp"),
    all(feature = "alloc-tagalloc-guarded", feature = "alloc-tagalloc-nothp"),
    all(feature = "alloc-tagalloc-guarded", feature = "alloc-tagalloc-scoped"),
    all(feature = "alloc-tagalloc-guarded", feature = "alloc-tagalloc-child"),
))]
compile_error!(
    "enable exactly one of the features alloc-tagalloc, alloc-system, alloc-mimalloc, alloc-jemalloc"
);

/// The allocators the harness knows, in the order the tables show them. Each name is also the
/// suffix of its cargo feature (`alloc-<name>`) and of its binaries (`workload-<name>`).
pub const ALL: [&str; 4] = ["tagalloc", "system", "mimalloc", "jemalloc"];

/// Allocators run only when named with `--allocators`: `tagalloc-child` is tagalloc with
/// every allocation of the program made through one child allocator of the
/// `SystemAllocator` (a whole program tagged as one subsystem), to measure what a child
/// costs over its parent on real workloads. (There is no build of tagalloc without its
/// per-thread counts to compare: they are also its thread caches' bookkeeping.)
/// `tagalloc-scoped` is tagalloc with every thread of the workload inside one scoped tag
/// (`Program.enter()`), and `tracking` its peer: tracking-allocator 0.4 over the system
/// allocator, every thread inside one allocation group, whose tracker counts live bytes.
/// `tagalloc-nothp` is tagalloc without transparent huge pages (`TAGALLOC_HUGE_PAGES=never`;
/// the default is `auto`: past 8 MiB mapped), to keep measuring what they bring.
/// `tagalloc-guarded` is tagalloc with guarded sampling of the `SystemAllocator` at one
/// allocation in 1000 (what `TAGALLOC_GUARDED="SystemAllocator=1/1000"` sets), to measure
/// what it costs.
pub const EXTRA: [&str; 5] = [
    "tagalloc-child",
    "tagalloc-scoped",
    "tracking",
    "tagalloc-nothp",
    "tagalloc-guarded",
];

#[cfg(all(
    feature = "alloc-tagalloc",
    not(feature = "alloc-tagalloc-child"),
    not(feature = "alloc-tagalloc-scoped"),
    not(feature = "alloc-tagalloc-nothp"),
    not(feature = "alloc-tagalloc-guarded")
))]
mod chosen {
    #[global_allocator]
    static GLOBAL: tagalloc::SystemAllocator = tagalloc::SystemAllocator::new();

    pub const NAME: &str = "tagalloc";
    pub const NOTE: &str = "";

    /// `SystemAllocator::garbage_collect` returns empty pages, segments and chunks and the
    /// pages inside large free blocks to the OS.
    pub fn trim() -> bool {
        GLOBAL.garbage_collect();
        true
    }
}

#[cfg(feature = "alloc-tagalloc-child")]
mod chosen {
    tagalloc::allocator!(pub Program: child of tagalloc::SystemAllocator, "the whole workload");

    #[global_allocator]
    static GLOBAL: Program = Program;

    pub const NAME: &str = "tagalloc-child";
    pub const NOTE: &str = "";

    /// The parent's `garbage_collect` (a child holds nothing of its own to give back).
    pub fn trim() -> bool {
        tagalloc::SystemAllocator::new().garbage_collect();
        true
    }
}

#[cfg(feature = "alloc-tagalloc-scoped")]
mod chosen {
    tagalloc::allocator!(pub Program: child of tagalloc::SystemAllocator, "the whole workload");

    #[global_allocator]
    static GLOBAL: tagalloc::SystemAllocator = tagalloc::SystemAllocator::new();

    pub const NAME: &str = "tagalloc-scoped";
    pub const NOTE: &str = "";

    /// The `SystemAllocator`'s `garbage_collect`, as for plain tagalloc.
    pub fn trim() -> bool {
        GLOBAL.garbage_collect();
        true
    }

    /// Runs `f` inside the tag.
    pub fn in_thread<R>(f: impl FnOnce() -> R) -> R {
        Program.scope(f)
    }
}

#[cfg(feature = "alloc-tagalloc-guarded")]
mod chosen {
    #[global_allocator]
    static GLOBAL: tagalloc::SystemAllocator = tagalloc::SystemAllocator::new();

    pub const NAME: &str = "tagalloc-guarded";
    pub const NOTE: &str = "";

    /// The `SystemAllocator`'s `garbage_collect`, as for plain tagalloc.
    pub fn trim() -> bool {
        GLOBAL.garbage_collect();
        true
    }

    /// Guarded sampling on (once) before the workload's first thread runs.
    pub fn in_thread<R>(f: impl FnOnce() -> R) -> R {
        static ON: std::sync::Once = std::sync::Once::new();
        ON.call_once(|| GLOBAL.set_guarded(core::num::NonZeroU32::new(1000)));
        f()
    }
}

#[cfg(feature = "alloc-tagalloc-nothp")]
mod chosen {
    #[global_allocator]
    static GLOBAL: tagalloc::SystemAllocator = tagalloc::SystemAllocator::new();

    pub const NAME: &str = "tagalloc-nothp";
    pub const NOTE: &str = "";

    /// The `SystemAllocator`'s `garbage_collect`, as for plain tagalloc.
    pub fn trim() -> bool {
        GLOBAL.garbage_collect();
        true
    }

    /// Huge pages off before the workload (its heap is still small then).
    pub fn in_thread<R>(f: impl FnOnce() -> R) -> R {
        tagalloc::schema::HphaSchema::<tagalloc::os::OsAllocator>::set_huge_pages(
            tagalloc::config::HugePages::Never,
        );
        f()
    }
}

#[cfg(feature = "alloc-tracking")]
mod chosen {
    use std::sync::atomic::{AtomicIsize, Ordering};
    use tracking_allocator::{
        AllocationGroupId, AllocationGroupToken, AllocationRegistry, AllocationTracker, Allocator,
    };

    #[global_allocator]
    static GLOBAL: Allocator<std::alloc::System> = Allocator::system();

    pub const NAME: &str = "tracking";
    pub const NOTE: &str = "";

    /// Live bytes per group, as a minimal useful tracker keeps them (groups 0..16).
    static LIVE: [AtomicIsize; 16] = [const { AtomicIsize::new(0) }; 16];

    struct LiveBytes;

    impl AllocationTracker for LiveBytes {
        fn allocated(
            &self,
            _addr: usize,
            object_size: usize,
            _wrapped_size: usize,
            group_id: AllocationGroupId,
        ) {
            LIVE[group_id.as_usize().get() % 16].fetch_add(object_size as isize, Ordering::Relaxed);
        }

        fn deallocated(
            &self,
            _addr: usize,
            object_size: usize,
            _wrapped_size: usize,
            source_group_id: AllocationGroupId,
            _current_group_id: AllocationGroupId,
        ) {
            LIVE[source_group_id.as_usize().get() % 16]
                .fetch_sub(object_size as isize, Ordering::Relaxed);
        }
    }

    /// The group every thread enters, registered once (its id; tokens are per thread).
    static GROUP: std::sync::OnceLock<()> = std::sync::OnceLock::new();

    /// glibc's trim, as for the system allocator underneath.
    pub fn trim() -> bool {
        // SAFETY: malloc_trim takes no pointers and may be called at any time.
        unsafe { libc::malloc_trim(0) };
        true
    }

    /// Runs `f` inside the allocation group (one token per thread, as the crate wants).
    pub fn in_thread<R>(f: impl FnOnce() -> R) -> R {
        GROUP.get_or_init(|| {
            let _ = AllocationRegistry::set_global_tracker(LiveBytes);
            AllocationRegistry::enable_tracking();
        });
        // `register` can return `None` when two threads register at once (tracking-allocator
        // 0.4 compares its new id with the highest one handed out, which the other thread may
        // just have raised); the id space never runs out on 64 bits, so ask again.
        let mut token = loop {
            if let Some(token) = AllocationGroupToken::register() {
                break token;
            }
        };
        let _guard = token.enter();
        f()
    }
}

#[cfg(feature = "alloc-system")]
mod chosen {
    #[global_allocator]
    static GLOBAL: std::alloc::System = std::alloc::System;

    pub const NAME: &str = "system";
    pub const NOTE: &str = "";

    /// glibc's `malloc_trim(0)` returns free heap tops and free pages inside the heap.
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    pub fn trim() -> bool {
        // SAFETY: malloc_trim takes no pointers and may be called at any time.
        unsafe { libc::malloc_trim(0) };
        true
    }

    /// Other C libraries have no standard trim call.
    #[cfg(not(all(target_os = "linux", target_env = "gnu")))]
    pub fn trim() -> bool {
        false
    }
}

#[cfg(feature = "alloc-mimalloc")]
mod chosen {
    #[global_allocator]
    static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

    pub const NAME: &str = "mimalloc";
    pub const NOTE: &str = "";

    /// `mi_collect(true)` frees the calling thread's cached pages and purges what it can.
    pub fn trim() -> bool {
        // SAFETY: mi_collect takes no pointers and may be called from any thread at any time.
        unsafe { libmimalloc_sys::mi_collect(true) };
        true
    }
}

#[cfg(feature = "alloc-jemalloc")]
mod chosen {
    use std::ffi::CStr;

    #[global_allocator]
    static GLOBAL: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

    pub const NAME: &str = "jemalloc";
    pub const NOTE: &str = "";

    /// Runs one "void" mallctl (no input, no output), such as a flush or a purge.
    fn mallctl_void(name: &CStr) {
        // SAFETY: `name` is NUL-terminated; the commands used here read and write no values,
        // so null old/new pointers with zero lengths are what jemalloc expects.
        unsafe {
            tikv_jemalloc_sys::mallctl(
                name.as_ptr(),
                std::ptr::null_mut(),
                std::ptr::null_mut(),
                std::ptr::null_mut(),
                0,
            );
        }
    }

    /// Flushes this thread's tcache into the arenas, then purges every arena (4096 is
    /// jemalloc's `MALLCTL_ARENAS_ALL`), so dirty and muzzy pages go back to the OS now rather
    /// than after the decay time.
    pub fn trim() -> bool {
        mallctl_void(c"thread.tcache.flush");
        mallctl_void(c"arena.4096.purge");
        true
    }
}

#[cfg(not(any(
    feature = "alloc-tagalloc",
    feature = "alloc-system",
    feature = "alloc-mimalloc",
    feature = "alloc-jemalloc",
    feature = "alloc-tracking"
)))]
mod chosen {
    pub const NAME: &str = "none";
    pub const NOTE: &str = "";

    pub fn trim() -> bool {
        false
    }
}

/// The name of the allocator this build uses (one of [`ALL`]), or `"none"` when no `alloc-*`
/// feature is enabled.
pub const NAME: &str = chosen::NAME;

/// A warning to print with every result of this build; empty for a genuine build.
pub const NOTE: &str = chosen::NOTE;

/// Asks the allocator to return cached free memory to the OS, if it has a way to be asked.
/// Returns whether a hook was called.
pub fn trim() -> bool {
    chosen::trim()
}

/// Runs `f` as a thread of the workload: inside the tag (`tagalloc-scoped`) or group
/// (`tracking`) every thread enters; plainly for the other allocators.
#[cfg(any(
    feature = "alloc-tagalloc-scoped",
    feature = "alloc-tracking",
    feature = "alloc-tagalloc-nothp",
    feature = "alloc-tagalloc-guarded"
))]
pub fn in_thread<R>(f: impl FnOnce() -> R) -> R {
    chosen::in_thread(f)
}

/// Runs `f` as a thread of the workload (see the other builds' `in_thread`).
#[cfg(not(any(
    feature = "alloc-tagalloc-scoped",
    feature = "alloc-tracking",
    feature = "alloc-tagalloc-nothp",
    feature = "alloc-tagalloc-guarded"
)))]
pub fn in_thread<R>(f: impl FnOnce() -> R) -> R {
    f()
}

/// `std::thread::spawn` for the workloads: the new thread runs `f` through [`in_thread`].
pub fn spawn<F, T>(f: F) -> std::thread::JoinHandle<T>
where
    F: FnOnce() -> T + Send + 'static,
    T: Send + 'static,
{
    std::thread::spawn(move || in_thread(f))
}
