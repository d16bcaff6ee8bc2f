//! Wrong frees into the pool schemas end in a message naming the pool and an abort, never
//! silent corruption.
//!
//! Each case runs in a child process (this test binary, re-run with an environment variable
//! naming the case), because the expected outcome is the process aborting.

mod common;

use core::alloc::Layout;
use std::alloc::System;
use tagalloc::schema::{PoolConfig, PoolSchema, ThreadPoolSchema};

const CASE_VAR: &str = "TAGALLOC_POOL_MISUSE_CASE";

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
    let cfg = PoolConfig::DEFAULT.with_name("victim");
    let pool = PoolSchema::with_config(System, cfg);
    let other = PoolSchema::with_config(System, cfg.with_name("other"));
    let tpool = ThreadPoolSchema::with_config(System, cfg);
    let small = Layout::from_size_align(48, 8).unwrap();
    // SAFETY: none — each case deliberately breaks the contract to test detection.
    unsafe {
        match case.as_str() {
            "double_free" => {
                let a = pool.allocate(small).unwrap();
                let _keep = pool.allocate(small).unwrap();
                pool.deallocate(a.ptr, small);
                pool.deallocate(a.ptr, small);
            }
            "wrong_class" => {
                let a = pool.allocate(small).unwrap();
                pool.deallocate(a.ptr, Layout::from_size_align(300, 8).unwrap());
            }
            "other_pool" => {
                let _mine = other.allocate(small).unwrap();
                let a = pool.allocate(small).unwrap();
                other.deallocate(a.ptr, small);
            }
            "never_granted" => {
                let a = pool.allocate(small).unwrap();
                pool.deallocate(a.ptr, Layout::from_size_align(4096, 8).unwrap());
            }
            "thread_pool_double_free_on_owner" => {
                let a = tpool.allocate(small).unwrap();
                let _keep = tpool.allocate(small).unwrap();
                tpool.deallocate(a.ptr, small);
                tpool.deallocate(a.ptr, small);
            }
            "thread_pool_double_remote_free" => {
                let a = tpool.allocate(small).unwrap();
                let addr = a.ptr.as_ptr() as usize;
                std::thread::scope(|s| {
                    s.spawn(|| {
                        let p = core::ptr::NonNull::new(addr as *mut u8).unwrap();
                        tpool.deallocate(p, small);
                        tpool.deallocate(p, small);
                    });
                });
                // The owner finds it when it takes its remote frees back (when it runs out).
                for _ in 0..1000 {
                    let _ = tpool.allocate(small).unwrap();
                }
            }
            "thread_pool_block_of_another_pool" => {
                let a = pool.allocate(small).unwrap();
                let _t = tpool.allocate(small).unwrap();
                tpool.deallocate(a.ptr, small);
            }
            other => panic!("unknown case {other}"),
        }
    }
    // Reaching this line means the misuse went unnoticed.
    std::process::exit(0);
}

/// Double frees are caught by the per-slot check of debug builds or feature `checked`.
#[test]
#[cfg(any(debug_assertions, feature = "checked"))]
fn double_free_is_reported_with_the_pool_name() {
    let err = run_child("double_free");
    assert!(
        err.contains("tagalloc: fatal: pool 'victim': double free"),
        "{err}"
    );
}

#[test]
fn freeing_with_another_class_is_reported() {
    let err = run_child("wrong_class");
    assert!(err.contains("the layout passed to free differs"), "{err}");
}

#[test]
fn freeing_into_another_pool_is_reported() {
    let err = run_child("other_pool");
    assert!(
        err.contains("pool 'other'") && err.contains("not a live block of this pool"),
        "{err}"
    );
}

#[test]
fn freeing_with_a_layout_the_pool_never_grants_is_reported() {
    let err = run_child("never_granted");
    assert!(err.contains("this pool never grants"), "{err}");
}

/// Double frees are caught by the per-slot check of debug builds or feature `checked`.
#[test]
#[cfg(any(debug_assertions, feature = "checked"))]
fn thread_pool_double_free_is_reported() {
    let err = run_child("thread_pool_double_free_on_owner");
    assert!(err.contains("pool 'victim': double free"), "{err}");
}

/// Double frees are caught by the per-slot check of debug builds or feature `checked`.
#[test]
#[cfg(any(debug_assertions, feature = "checked"))]
fn thread_pool_double_free_from_another_thread_is_reported_when_drained() {
    let err = run_child("thread_pool_double_remote_free");
    assert!(err.contains("pool 'victim': double free"), "{err}");
}

#[test]
fn thread_pool_free_of_a_foreign_block_is_reported() {
    let err = run_child("thread_pool_block_of_another_pool");
    assert!(err.contains("not a live block of this pool"), "{err}");
}
