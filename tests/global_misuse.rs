//! Misuse of the `SystemAllocator` (the global allocator's paths: thread caches, the large
//! heap, blocks with their own mapping) ends in an abort with a message that names the
//! misuse and the address, in the default build and with feature `checked` (see
//! `docs/misuse.md`, which lists these cases).
//!
//! Each case runs in a child process (this test binary, re-run with an environment variable
//! naming the case), because the expected outcome is the process aborting. The allocator
//! is called through `GlobalAlloc` directly, so the test harness itself does not run on it.

mod common;

use core::alloc::{GlobalAlloc, Layout};
use tagalloc::SystemAllocator;

const CASE_VAR: &str = "TAGALLOC_GLOBAL_MISUSE_CASE";
static A: SystemAllocator = SystemAllocator::new();

tagalloc::allocator!(Scoped: child of tagalloc::SystemAllocator, "a tag entered around misuse");

fn layout(size: usize, align: usize) -> Layout {
    Layout::from_size_align(size, align).unwrap()
}

/// Runs `case` in a child process and returns its stderr; asserts it aborted (SIGABRT, not
/// a segmentation fault or a clean exit) and that the message names the address `0x…`.
fn run_child(case: &str) -> String {
    let err = common::run_aborting_child(CASE_VAR, case);
    assert!(err.contains("tagalloc: fatal: "), "case {case}: {err}");
    assert!(err.contains("0x"), "case {case} names no address: {err}");
    err
}

/// Allocates `l` and writes into every byte, so its memory holds data when misused.
fn filled(l: Layout) -> *mut u8 {
    // SAFETY: a non-zero layout.
    let p = unsafe { A.alloc(l) };
    assert!(!p.is_null());
    // SAFETY: the block holds `l.size()` bytes.
    unsafe { p.write_bytes(0x5a, l.size()) };
    p
}

/// The child side: performs the misuse named in the environment.
#[test]
fn child_entry_point() {
    let Ok(case) = std::env::var(CASE_VAR) else {
        return; // Not a child: nothing to do.
    };
    let small = layout(64, 8);
    let mib = layout(1 << 20, 8);
    // SAFETY: none — each case deliberately breaks the contract to test detection.
    unsafe {
        match case.as_str() {
            "small_freed_as_4096" => {
                let p = filled(small);
                let _keep = filled(small);
                A.dealloc(p, layout(4096, 8));
            }
            "small_freed_with_a_larger_alignment" => {
                let p = filled(small);
                A.dealloc(p, layout(64, 4096));
            }
            "large_freed_as_small" => {
                let p = filled(mib);
                A.dealloc(p, small);
            }
            "small_freed_as_large" => {
                let p = filled(small);
                A.dealloc(p, mib);
            }
            "own_mapping_double_free" => {
                let l = layout(32 << 20, 8);
                let p = filled(l);
                A.dealloc(p, l);
                A.dealloc(p, l);
            }
            "large_double_free_after_gc" => {
                let p = filled(mib);
                A.dealloc(p, mib);
                A.garbage_collect();
                A.dealloc(p, mib);
            }
            "large_double_free_purge_delay_zero" => {
                A.set_purge_delay(Some(core::time::Duration::ZERO));
                let p = filled(mib);
                A.dealloc(p, mib);
                A.dealloc(p, mib);
            }
            "large_double_free" => {
                let p = filled(mib);
                let _keep = filled(mib);
                A.dealloc(p, mib);
                A.dealloc(p, mib);
            }
            "large_interior_pointer" => {
                let p = filled(mib);
                let _keep = filled(mib);
                A.dealloc(p.add(4096), mib);
            }
            "own_mapping_interior_pointer" => {
                let l = layout(32 << 20, 8);
                let p = filled(l);
                A.dealloc(p.add(4096), l);
            }
            "own_mapping_length_overwritten" => {
                // The 16 bytes before the block's header once held its mapping's start and
                // length: a write there must not change what is unmapped.
                let l = layout(32 << 20, 8);
                let p = filled(l);
                p.sub(32).cast::<usize>().write(0x1000);
                p.sub(24).cast::<usize>().write(usize::MAX / 2);
                A.dealloc(p, l);
                // The block is gone and the allocator still works.
                let q = filled(l);
                A.dealloc(q, l);
                A.dealloc(q, l);
            }
            "stack_freed_as_large" => {
                let mut on_stack = [0u8; 64];
                A.dealloc(on_stack.as_mut_ptr(), mib);
            }
            "libc_freed_as_large" => {
                let p = libc::malloc(64).cast::<u8>();
                A.dealloc(p, mib);
            }
            "stack_freed_as_small" => {
                let mut on_stack = [0u8; 64];
                A.dealloc(on_stack.as_mut_ptr(), small);
            }
            "libc_freed_as_small" => {
                let p = libc::malloc(64).cast::<u8>();
                A.dealloc(p, small);
            }
            "stack_freed_as_small_in_a_scope" => {
                // Inside a scope the free compares the block's segment tag with the route
                // first: checked builds must judge the pointer before that read.
                let _tag = Scoped.enter();
                let mut on_stack = [0u8; 64];
                A.dealloc(on_stack.as_mut_ptr(), small);
            }
            "libc_freed_as_small_in_a_scope" => {
                let _tag = Scoped.enter();
                let p = libc::malloc(64).cast::<u8>();
                A.dealloc(p, small);
            }
            "small_written_after_free" => {
                let p = filled(small);
                A.dealloc(p, small);
                p.add(40).write(1);
                // The bin is LIFO: the same slot comes back, and its fill is checked.
                let q = A.alloc(small);
                assert_eq!(q, p);
            }
            other => panic!("unknown case {other}"),
        }
    }
    // Reaching this line means the misuse went unnoticed.
    std::process::exit(0);
}

/// The class check of the thread caches' frees: checked builds or feature `class-check`.
#[test]
#[cfg(any(debug_assertions, feature = "checked", feature = "class-check"))]
fn a_small_block_freed_as_4096_bytes_is_a_wrong_layout() {
    let err = run_child("small_freed_as_4096");
    assert!(
        err.contains("wrong layout") && err.contains("64-byte class"),
        "{err}"
    );
}

/// The class check of the thread caches' frees: checked builds or feature `class-check`.
#[test]
#[cfg(any(debug_assertions, feature = "checked", feature = "class-check"))]
fn a_small_block_freed_with_a_larger_alignment_is_a_wrong_layout() {
    let err = run_child("small_freed_with_a_larger_alignment");
    assert!(
        err.contains("wrong layout") && err.contains("64-byte class"),
        "{err}"
    );
}

/// The class check of the thread caches' frees: checked builds or feature `class-check`.
#[test]
#[cfg(any(debug_assertions, feature = "checked", feature = "class-check"))]
fn a_large_block_freed_as_small_is_a_wrong_layout() {
    let err = run_child("large_freed_as_small");
    assert!(
        err.contains("wrong layout") && err.contains("large-block heap"),
        "{err}"
    );
}

#[test]
fn a_small_block_freed_as_large_is_a_wrong_layout() {
    let err = run_child("small_freed_as_large");
    assert!(
        err.contains("wrong layout") && err.contains("it is a small block"),
        "{err}"
    );
}

#[test]
fn double_free_of_a_block_with_its_own_mapping_is_reported() {
    let err = run_child("own_mapping_double_free");
    assert!(
        err.contains("double free") && err.contains("own mapping"),
        "{err}"
    );
}

#[test]
fn double_free_after_garbage_collect_is_reported() {
    let err = run_child("large_double_free_after_gc");
    assert!(
        err.contains("double free") && err.contains("returned to the OS"),
        "{err}"
    );
}

#[test]
fn double_free_with_a_purge_delay_of_zero_is_reported() {
    let err = run_child("large_double_free_purge_delay_zero");
    assert!(
        err.contains("double free") && err.contains("returned to the OS"),
        "{err}"
    );
}

#[test]
fn double_free_of_a_large_block_is_reported() {
    let err = run_child("large_double_free");
    assert!(err.contains("double free"), "{err}");
}

#[test]
fn an_interior_pointer_of_a_large_block_is_reported() {
    let err = run_child("large_interior_pointer");
    assert!(
        err.contains("inside the large block") && err.contains("not at its start"),
        "{err}"
    );
}

#[test]
fn an_interior_pointer_of_a_block_with_its_own_mapping_is_not_a_block() {
    let err = run_child("own_mapping_interior_pointer");
    assert!(err.contains("not a block of this heap"), "{err}");
}

#[test]
fn the_unmapped_length_does_not_come_from_user_memory() {
    // The first free unmaps what the registry says; the second free of the second block is
    // then caught as a double free (a free that had unmapped a length read from the
    // overwritten words would have crashed or unmapped other memory first).
    let err = run_child("own_mapping_length_overwritten");
    assert!(
        err.contains("double free") && err.contains("own mapping"),
        "{err}"
    );
}

#[test]
fn a_stack_address_freed_as_large_is_not_a_block() {
    let err = run_child("stack_freed_as_large");
    assert!(err.contains("not a block of this heap"), "{err}");
}

#[test]
fn a_libc_pointer_freed_as_large_is_not_a_block() {
    let err = run_child("libc_freed_as_large");
    assert!(err.contains("not a block of this heap"), "{err}");
}

/// The default build reads the page header of a small free without asking the address map
/// (see `docs/misuse.md`), so these two need debug assertions or feature `checked`.
#[test]
#[cfg(any(debug_assertions, feature = "checked"))]
fn a_stack_address_freed_as_small_is_not_a_block() {
    let err = run_child("stack_freed_as_small");
    assert!(err.contains("not a block of this heap"), "{err}");
}

#[test]
#[cfg(any(debug_assertions, feature = "checked"))]
fn a_libc_pointer_freed_as_small_is_not_a_block() {
    let err = run_child("libc_freed_as_small");
    assert!(err.contains("not a block of this heap"), "{err}");
}

/// The same inside a scope, where the free reads the block's segment tag before pushing it.
#[test]
#[cfg(any(debug_assertions, feature = "checked"))]
fn a_stack_address_freed_as_small_in_a_scope_is_not_a_block() {
    let err = run_child("stack_freed_as_small_in_a_scope");
    assert!(err.contains("not a block of this heap"), "{err}");
}

#[test]
#[cfg(any(debug_assertions, feature = "checked"))]
fn a_libc_pointer_freed_as_small_in_a_scope_is_not_a_block() {
    let err = run_child("libc_freed_as_small_in_a_scope");
    assert!(err.contains("not a block of this heap"), "{err}");
}

/// Checked builds fill freed small blocks and verify the fill when the slot is handed out
/// again.
#[test]
#[cfg(any(debug_assertions, feature = "checked"))]
fn a_write_after_free_is_reported_when_the_slot_is_reused() {
    let err = run_child("small_written_after_free");
    assert!(
        err.contains("written after free: the 64-byte block at 0x")
            && err.contains("size class 64 B, allocator 'SystemAllocator'")
            && err.contains("offset 40"),
        "{err}"
    );
}
