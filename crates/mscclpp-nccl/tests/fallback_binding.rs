//! The NCCL fallback binds to its own functions even when ours come first in the process's
//! global scope (as under `LD_PRELOAD`): a real NCCL calls some of its exported functions
//! itself, and those calls must not land in this library. A fake NCCL (compiled here with
//! `cc`; skipped without one) exports `ncclCommCount` and a probe that calls it through its
//! PLT; our library is loaded with `RTLD_GLOBAL` first, so without deep binding the probe would
//! reach our `ncclCommCount` (which refuses the foreign null communicator).

use std::ffi::{c_int, c_void};
use std::process::Command;

use mscclpp_nccl::fallback;

const FAKE: &str = r#"
int ncclGetVersion(int* v) { *v = 99999; return 0; }
int ncclCommCount(const void* comm, int* count) { (void)comm; *count = 4242; return 0; }
int fake_probe(void) { int c = 0; if (ncclCommCount((const void*)0, &c) != 0) return -1; return c; }
"#;

#[test]
fn the_fallback_calls_its_own_functions_not_ours() {
    let dir = std::env::temp_dir().join(format!("mscclpp-fake-nccl-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let src = dir.join("fake_nccl.c");
    let so = dir.join("libfake_nccl.so");
    std::fs::write(&src, FAKE).unwrap();
    let built = Command::new("cc").args(["-shared", "-fPIC", "-O0", "-o"]).arg(&so).arg(&src).status();
    if !matches!(built, Ok(s) if s.success()) {
        eprintln!("SKIPPED: no C compiler (cc) to build the fake NCCL");
        return;
    }
    // Ours first, in the global scope, as LD_PRELOAD puts it.
    let ours = std::env::current_exe().unwrap().parent().unwrap().join("libmscclpp_nccl.so");
    assert!(ours.is_file(), "no {}", ours.display());
    // SAFETY: our own library; its initializers are benign.
    let ours = unsafe {
        libloading::os::unix::Library::open(
            Some(&ours),
            libloading::os::unix::RTLD_NOW | libloading::os::unix::RTLD_GLOBAL,
        )
    }
    .unwrap();
    let nccl = fallback::load(so.to_str().unwrap()).unwrap();
    // SAFETY: fake_probe has this signature (above).
    let probe = unsafe { nccl.sym::<unsafe extern "C" fn() -> c_int>("fake_probe") }.unwrap();
    // SAFETY: a plain C function without arguments.
    let got = unsafe { probe() };
    assert_eq!(got, 4242, "the fake NCCL's call to its own ncclCommCount went elsewhere ({got})");
    // And our ncclCommCount is really in the global scope, refusing the null communicator: the
    // test would fail without deep binding.
    type Count = unsafe extern "C" fn(*const c_void, *mut c_int) -> c_int;
    // SAFETY: ncclCommCount's signature.
    let theirs_in_global = unsafe { ours.get::<Count>(b"ncclCommCount\0") }.unwrap();
    let mut n = 0;
    // SAFETY: valid out pointer; a null communicator is refused, not dereferenced.
    let rc = unsafe { theirs_in_global(std::ptr::null(), &mut n) };
    assert_ne!(rc, 0, "our ncclCommCount accepted a null communicator");
    let _ = std::fs::remove_dir_all(&dir);
}
