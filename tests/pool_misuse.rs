//! Wrong frees into the pool schemas end in a message naming the pool and an abort, never
//! silent corruption.
//!
//! Each case runs in a child process (this test binary, re-run with an environment variable
//! naming the case), because the expected outcome is the process aborting.

mod common;

use allocator_api2::alloc::Allocator;
use core::alloc::Layout;
use std::alloc::System;
use tagalloc::SystemAllocator;
use tagalloc::schema::{PoolConfig, PoolSchema, ThreadPoolSchema};

tagalloc::allocator!(VictimPool: pool of SystemAllocator
    { page_size: 65536, min_size: 16, max_size: 256 }, "victim handle pool");
tagalloc::allocator!(VictimThreadPool: thread_pool of SystemAllocator
    { page_size: 65536, min_size: 16, max_size: 256 }, "victim handle thread pool");

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
            "handle_pool_double_free" => {
                let a = VictimPool.allocate(small).unwrap().cast::<u8>();
                let _keep = VictimPool.allocate(small).unwrap();
                VictimPool.deallocate(a, small);
                VictimPool.deallocate(a, small);
                // Without the check, the block would now be handed out twice.
                let x = VictimPool.allocate(small).unwrap();
                let y = VictimPool.allocate(small).unwrap();
                assert_ne!(x, y, "the same block handed out twice");
            }
            "handle_thread_pool_double_free" => {
                let a = VictimThreadPool.allocate(small).unwrap().cast::<u8>();
                let _keep = VictimThreadPool.allocate(small).unwrap();
                VictimThreadPool.deallocate(a, small);
                VictimThreadPool.deallocate(a, small);
                let x = VictimThreadPool.allocate(small).unwrap();
                let y = VictimThreadPool.allocate(small).unwrap();
                assert_ne!(x, y, "the same block handed out twice");
            }
            "handle_thread_pool_double_remote_free" => {
                let a = VictimThreadPool.allocate(small).unwrap().cast::<u8>();
                let addr = a.as_ptr() as usize;
                std::thread::scope(|s| {
                    s.spawn(|| {
                        let p = core::ptr::NonNull::new(addr as *mut u8).unwrap();
                        VictimThreadPool.deallocate(p, small);
                        VictimThreadPool.deallocate(p, small);
                    });
                });
                // The owner takes its remote frees back before it hands any block out again.
                let mut seen = std::collections::HashSet::new();
                for _ in 0..5000 {
                    let p = VictimThreadPool.allocate(small).unwrap();
                    assert!(seen.insert(p), "the same block handed out twice");
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

/// Double frees are caught by the per-slot bitmap, in every build.
#[test]
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

/// Double frees are caught by the per-slot bitmap, in every build.
#[test]
fn thread_pool_double_free_is_reported() {
    let err = run_child("thread_pool_double_free_on_owner");
    assert!(err.contains("pool 'victim': double free"), "{err}");
}

/// Double frees are caught by the per-slot bitmap, in every build.
#[test]
fn thread_pool_double_free_from_another_thread_is_reported_when_drained() {
    let err = run_child("thread_pool_double_remote_free");
    assert!(err.contains("pool 'victim': double free"), "{err}");
}

#[test]
fn thread_pool_free_of_a_foreign_block_is_reported() {
    let err = run_child("thread_pool_block_of_another_pool");
    assert!(err.contains("not a live block of this pool"), "{err}");
}

/// Through a `pool of` handle, in every build: the second free aborts, before the block
/// could be handed out twice.
#[test]
fn handle_pool_double_free_is_reported_with_the_allocator_name() {
    let err = run_child("handle_pool_double_free");
    assert!(
        err.contains("pool 'VictimPool': double free of 0x"),
        "{err}"
    );
}

#[test]
fn handle_thread_pool_double_free_is_reported_with_the_allocator_name() {
    let err = run_child("handle_thread_pool_double_free");
    assert!(
        err.contains("pool 'VictimThreadPool': double free of 0x"),
        "{err}"
    );
}

/// A double free from another thread: caught when the owner takes its remote frees back,
/// which it does before handing a block out again.
#[test]
fn handle_thread_pool_double_remote_free_is_reported_before_reuse() {
    let err = run_child("handle_thread_pool_double_remote_free");
    assert!(
        err.contains("pool 'VictimThreadPool': double free of 0x"),
        "{err}"
    );
}
