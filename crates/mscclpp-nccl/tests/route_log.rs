//! The routing lines reach the user: the library installs the log subscriber itself at its
//! first call (a C or Python program has no Rust code that would), so with
//! `MSCCLPP_LOG_LEVEL=INFO` every (operation, type, route) is said once per process on stderr. Without it the
//! lines went nowhere (seen on the GPU machine: torchrun logs held no route at all).
//!
//! The test runs itself again as a child (`ROUTE_LOG_CHILD=1`), two ranks over TCP with no GPU
//! and no fallback, and reads the child's stderr.

use std::ffi::c_int;
use std::process::Command;
use std::ptr::null_mut;

use mscclpp_nccl::abi::*;
use mscclpp_nccl::exports::*;

fn child() {
    let mut id = ncclUniqueId { internal: [0; NCCL_UNIQUE_ID_BYTES] };
    // SAFETY: a valid out pointer.
    assert_eq!(unsafe { ncclGetUniqueId(&mut id) }, ncclSuccess);
    std::thread::scope(|s| {
        for r in 0..2 {
            s.spawn(move || {
                let mut c: ncclComm_t = null_mut();
                // SAFETY: valid out pointer, id from ncclGetUniqueId.
                assert_eq!(unsafe { ncclCommInitRank(&mut c, 2, id, r as c_int) }, ncclSuccess);
                let p = 0x1000 as *mut std::ffi::c_void;
                // SAFETY: refused (no GPU, no fallback) before any pointer is used.
                unsafe {
                    assert_eq!(ncclAllReduce(p, p, 4, ncclFloat32, ncclSum, c, null_mut()), ncclInvalidUsage);
                    assert_eq!(ncclAllReduce(p, p, 4, ncclFloat32, ncclSum, c, null_mut()), ncclInvalidUsage);
                    assert_eq!(ncclAllGather(p, p, 4, ncclBfloat16, c, null_mut()), ncclInvalidUsage);
                }
                // SAFETY: our communicator.
                assert_eq!(unsafe { ncclCommDestroy(c) }, ncclSuccess);
            });
        }
    });
}

#[test]
fn routing_decisions_are_logged_once_each_without_a_rust_program_installing_a_subscriber() {
    if std::env::var_os("ROUTE_LOG_CHILD").is_some() {
        child();
        return;
    }
    let exe = std::env::current_exe().expect("the test binary's path");
    let out = Command::new(exe)
        .args(["--exact", "routing_decisions_are_logged_once_each_without_a_rust_program_installing_a_subscriber"])
        .args(["--nocapture", "--test-threads=1"])
        .env("ROUTE_LOG_CHILD", "1")
        .env("MSCCLPP_LOG_LEVEL", "INFO")
        // Read by this library (the fallback stays off): never called a variable with no effect.
        .env("MSCCLPP_NCCL_LIB_PATH", "/nonexistent/libnccl.so.2")
        // Not read anywhere here: named once in the warning.
        .env("MSCCLPP_NPKIT_DUMP_DIR", "/tmp")
        .env_remove("MSCCLPP_ENABLE_NCCL_FALLBACK")
        .env_remove("MSCCLPP_FORCE_NCCL_FALLBACK_OPERATION")
        .env_remove("MSCCLPP_LOG_FILE")
        .env_remove("MSCCLPP_LOG_SUBSYS")
        .env_remove("MSCCLPP_DEBUG")
        .env_remove("MSCCLPP_DEBUG_SUBSYS")
        .env_remove("RUST_LOG")
        .output()
        .expect("running the child");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "child failed: {}\n{err}", out.status);
    let lines = |needle: &str| err.lines().filter(|l| l.contains(needle)).count();
    // Once per (operation, type, route) in the process, however many ranks and calls.
    assert_eq!(lines("allreduce of ncclFloat32 -> refused"), 1, "{err}");
    assert_eq!(lines("allgather of ncclBfloat16 -> refused"), 1, "{err}");
    let unread: Vec<&str> = err.lines().filter(|l| l.contains("they have no effect here")).collect();
    assert_eq!(unread.len(), 1, "{err}");
    assert!(unread[0].contains("MSCCLPP_NPKIT_DUMP_DIR") && !unread[0].contains("MSCCLPP_NCCL_LIB_PATH"), "{err}");
}
