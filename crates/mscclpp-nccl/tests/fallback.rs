//! The NCCL fallback's loading rules, and forwarding to a real NCCL on CPU (the parameter API
//! needs no GPU) when the wheel's `libnccl.so.2` is at `MSCCLPP_TEST_NCCL_LIB` (default
//! `/tmp/mscclpp-nccl/nvidia/nccl/lib/libnccl.so.2`; skipped without it). One test: it sets the
//! process's environment.

use std::ffi::{CStr, c_char, c_int};

use mscclpp_nccl::abi::*;
use mscclpp_nccl::exports::*;
use mscclpp_nccl::fallback;

#[test]
fn loading_rules_and_forwarding() {
    let ours = std::env::current_exe().unwrap().parent().unwrap().join("libmscclpp_nccl.so");
    let e = fallback::load(ours.to_str().unwrap()).unwrap_err();
    assert!(e.contains("is this library (libmscclpp_nccl) itself"), "{e}");
    let e = fallback::load("/nonexistent/libnccl.so.2").unwrap_err();
    assert!(e.contains("loading the NCCL fallback") && e.contains("MSCCLPP_NCCL_LIB_PATH"), "{e}");
    let real = std::env::var("MSCCLPP_TEST_NCCL_LIB")
        .unwrap_or_else(|_| "/tmp/mscclpp-nccl/nvidia/nccl/lib/libnccl.so.2".into());
    if !std::path::Path::new(&real).is_file() {
        eprintln!("skipped the forwarding half: no {real}");
        return;
    }
    // SAFETY: this test binary has one test, so nothing else reads the environment meanwhile.
    unsafe {
        std::env::set_var("MSCCLPP_ENABLE_NCCL_FALLBACK", "1");
        std::env::set_var("MSCCLPP_NCCL_LIB_PATH", &real);
    }
    let mut v: *const c_char = std::ptr::null();
    let mut n: c_int = 0;
    // SAFETY: valid pointers; forwarded to the real NCCL's ncclParamGetParameter.
    let rc = unsafe { ncclParamGetParameter(c"NCCL_DEBUG".as_ptr(), &mut v, &mut n) };
    assert_eq!(rc, ncclSuccess);
    assert!(!v.is_null() && n > 0);
    // SAFETY: NCCL returned a NUL-terminated string.
    eprintln!("NCCL_DEBUG via the real NCCL: {:?}", unsafe { CStr::from_ptr(v) });
}
