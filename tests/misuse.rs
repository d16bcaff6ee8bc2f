//! Wrong frees end in a clear message and an abort, never silent corruption.
//!
//! Each case runs in a child process (this same test binary, re-run with an environment
//! variable naming the case), because the expected outcome is the process aborting.

mod common;

use core::alloc::Layout;
use tagalloc::os::OsAllocator;
use tagalloc::schema::HphaSchema;
use tagalloc::{BlockAllocator, SystemAllocator};

tagalloc::allocator!(Tagged: child of SystemAllocator, "misuse through a child's lane");

const CASE_VAR: &str = "TAGALLOC_MISUSE_CASE";

/// Runs `case` in a child process and returns its stderr; asserts it did not exit cleanly.
fn run_child(case: &str) -> String {
    common::run_aborting_child(CASE_VAR, case)
}

/// The child side: performs the misuse named in the environment.
#[test]
fn child_entry_point() {
    let Ok(case) = std::env::var(CASE_VAR) else {
        return; // Not a child: nothing to do.
    };
    let heap = HphaSchema::new(OsAllocator);
    let small = Layout::from_size_align(48, 8).unwrap();
    let large = Layout::from_size_align(100_000, 8).unwrap();
    // SAFETY: none — each case deliberately breaks the contract to test detection.
    unsafe {
        match case.as_str() {
            "double_free_large" => {
                let a = heap.allocate(large).unwrap();
                let _keep = heap.allocate(large).unwrap();
                heap.deallocate(a.ptr, large);
                heap.deallocate(a.ptr, large);
            }
            "wrong_class" => {
                let a = heap.allocate(small).unwrap();
                heap.deallocate(a.ptr, Layout::from_size_align(300, 8).unwrap());
            }
            "large_freed_as_small" => {
                let a = heap.allocate(large).unwrap();
                heap.deallocate(a.ptr, small);
            }
            "double_free_small" => {
                let a = heap.allocate(small).unwrap();
                let _keep = heap.allocate(small).unwrap();
                heap.deallocate(a.ptr, small);
                heap.deallocate(a.ptr, small);
            }
            "interior_pointer_small" => {
                let a = heap.allocate(small).unwrap();
                heap.deallocate(a.ptr.add(8), small);
            }
            // Through a child of the `SystemAllocator`: its small blocks come from its
            // lane of the thread cache (or its general path, without the thread pointer).
            "double_free_child" => {
                let a = Tagged.allocate_block(small).unwrap();
                let _keep = Tagged.allocate_block(small).unwrap();
                Tagged.deallocate_block(a.ptr, small);
                Tagged.deallocate_block(a.ptr, small);
            }
            "interior_pointer_child" => {
                let a = Tagged.allocate_block(small).unwrap();
                Tagged.deallocate_block(a.ptr.add(8), small);
            }
            other => panic!("unknown case {other}"),
        }
    }
    // Reaching this line means the misuse went unnoticed.
    std::process::exit(0);
}

#[test]
fn double_free_of_a_large_block_is_reported() {
    let err = run_child("double_free_large");
    assert!(err.contains("tagalloc: fatal: double free"), "{err}");
}

#[test]
fn freeing_with_the_wrong_size_class_is_reported() {
    let err = run_child("wrong_class");
    assert!(
        err.contains("the layout passed to dealloc differs"),
        "{err}"
    );
}

#[test]
fn freeing_a_large_block_as_small_is_reported() {
    let err = run_child("large_freed_as_small");
    assert!(
        err.contains("wrong layout") && err.contains("large-block heap"),
        "{err}"
    );
}

/// Needs the per-slot bitmap: debug builds or feature `checked`.
#[test]
#[cfg(any(debug_assertions, feature = "checked"))]
fn double_free_of_a_small_block_is_reported_in_checked_builds() {
    let err = run_child("double_free_small");
    assert!(err.contains("tagalloc: fatal: double free"), "{err}");
}

#[test]
#[cfg(any(debug_assertions, feature = "checked"))]
fn double_free_through_a_child_is_reported_in_checked_builds() {
    let err = run_child("double_free_child");
    assert!(
        err.contains("tagalloc: fatal: double free") && err.contains("allocator 'Tagged'"),
        "{err}"
    );
}

#[test]
#[cfg(any(debug_assertions, feature = "checked"))]
fn freeing_an_interior_pointer_through_a_child_is_reported_in_checked_builds() {
    let err = run_child("interior_pointer_child");
    assert!(
        err.contains("not at its start") && err.contains("allocator 'Tagged'"),
        "{err}"
    );
}

#[test]
#[cfg(any(debug_assertions, feature = "checked"))]
fn freeing_an_interior_pointer_is_reported_in_checked_builds() {
    let err = run_child("interior_pointer_small");
    assert!(err.contains("not at its start"), "{err}");
}
