//! The real NCCL, loaded at run time, for what the native path does not serve: `dlopen` with
//! `RTLD_LOCAL` (its symbols never replace ours) and `RTLD_DEEPBIND` (ours never replace its
//! own: under `LD_PRELOAD` this library's `nccl*` functions come first in the global scope, and
//! without deep binding the real NCCL's calls to its own exported functions would land here and
//! fail; MSCCL++ loads its fallback the same way).

use std::sync::OnceLock;

use crate::error::{Failure, Res};
use crate::route::Settings;

/// A loaded NCCL library.
pub struct Nccl {
    lib: libloading::Library,
    /// The path it was loaded from.
    pub path: String,
}

impl std::fmt::Debug for Nccl {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Nccl({})", self.path)
    }
}

static LOADED: OnceLock<Result<Nccl, String>> = OnceLock::new();

/// The process's NCCL: loaded on first use from `MSCCLPP_NCCL_LIB_PATH` when
/// `MSCCLPP_ENABLE_NCCL_FALLBACK` is on; `Err` says why there is none.
pub fn nccl() -> Result<&'static Nccl, String> {
    nccl_with(&Settings::current())
}

/// [`nccl`] with explicit settings (the first caller's settings decide for the process).
pub fn nccl_with(s: &Settings) -> Result<&'static Nccl, String> {
    if !s.fallback_enabled {
        return Err("MSCCLPP_ENABLE_NCCL_FALLBACK is not set".into());
    }
    LOADED.get_or_init(|| load(&s.lib_path)).as_ref().map_err(Clone::clone)
}

/// Loads the NCCL at `path` now, uncached (what [`nccl`] does once per process).
///
/// # Errors
/// Why it cannot be used: it does not load, is no NCCL, or is this library itself.
pub fn load(path: &str) -> Result<Nccl, String> {
    use libloading::os::unix::{RTLD_LOCAL, RTLD_NOW};
    // glibc's RTLD_DEEPBIND (bits/dlfcn.h): the library's own symbols before the global scope.
    const RTLD_DEEPBIND: std::ffi::c_int = 0x0008;
    // SAFETY: loading a shared library runs its initializers; NCCL's are benign (it is the
    // library the user asked for). Local scope, so its symbols do not join the global namespace;
    // deep binding, so its references to its own functions are not taken by ours.
    let lib = unsafe { libloading::os::unix::Library::open(Some(path), RTLD_NOW | RTLD_LOCAL | RTLD_DEEPBIND) }
        .map(libloading::Library::from)
        .map_err(|e| format!("loading the NCCL fallback {path:?} (MSCCLPP_NCCL_LIB_PATH) failed: {e}"))?;
    let n = Nccl { lib, path: path.to_string() };
    // Refuse our own library: forwarding to it would call ourselves forever.
    type GetVersion = unsafe extern "C" fn(*mut std::ffi::c_int) -> std::ffi::c_int;
    // SAFETY: ncclGetVersion has this signature in every NCCL.
    let theirs = unsafe { n.lib.get::<GetVersion>(b"ncclGetVersion\0") }
        .map_err(|e| format!("{path:?} is no NCCL (no ncclGetVersion): {e}"))?;
    // SAFETY: only the symbol's presence is checked.
    if unsafe { n.lib.get::<*const u8>(b"mscclpp_nccl_library\0") }.is_ok() {
        return Err(format!(
            "MSCCLPP_NCCL_LIB_PATH={path:?} is this library (libmscclpp_nccl) itself, not a real NCCL"
        ));
    }
    let mut v = 0;
    // SAFETY: a valid out pointer.
    unsafe { theirs(&mut v) };
    tracing::info!(target: "mscclpp::nccl", path, version = v, "loaded the NCCL fallback");
    Ok(n)
}

impl Nccl {
    /// The function `name` with the C signature `T`.
    ///
    /// # Errors
    /// `ncclInvalidUsage` naming the function when this NCCL lacks it (an older release).
    ///
    /// # Safety
    /// `T` is the function's signature in `nccl.h`.
    pub unsafe fn sym<T: Copy>(&self, name: &str) -> Res<T> {
        let mut z = name.as_bytes().to_vec();
        z.push(0);
        // SAFETY: the caller's contract on T.
        let s = unsafe { self.lib.get::<T>(z.as_slice()) }
            .map_err(|e| Failure::usage(format!("{name}: the NCCL fallback {} lacks it: {e}", self.path)))?;
        Ok(*s)
    }
}

/// Calls NCCL function `$name` of `$nccl` with signature `fn($($t),*) -> c_int` and turns its
/// result into [`Res`]; its `ncclGetLastError` text joins the message on failure.
#[macro_export]
#[doc(hidden)]
macro_rules! forward {
    ($nccl:expr, $name:expr, ($($a:expr => $t:ty),* $(,)?)) => {(|| -> $crate::error::Res {
        let n: &$crate::fallback::Nccl = $nccl;
        type F = unsafe extern "C" fn($($t),*) -> std::ffi::c_int;
        // SAFETY: F is the signature of $name in nccl.h (the export of the same name has it).
        let f: F = unsafe { n.sym::<F>($name) }?;
        tracing::debug!(target: "mscclpp::nccl", op = $name, "forwarded to NCCL");
        // SAFETY: the arguments are the caller's, passed on unchanged (or our translations of
        // handles to the real NCCL's, which the real NCCL made).
        let r = unsafe { f($($a),*) };
        $crate::fallback::check(n, $name, r)
    })()};
}

/// The result `r` of NCCL's `name` as a [`Res`].
pub fn check(n: &Nccl, name: &str, r: std::ffi::c_int) -> Res {
    if r == 0 || r == crate::abi::ncclInProgress {
        return Ok(());
    }
    let mut msg = format!("{name} (forwarded to NCCL {}) failed with {r}", n.path);
    type LastError = unsafe extern "C" fn(*mut std::ffi::c_void) -> *const std::ffi::c_char;
    // SAFETY: the header's signature.
    if let Ok(le) = unsafe { n.sym::<LastError>("ncclGetLastError") } {
        // SAFETY: NULL is accepted; the result is a NUL-terminated string or NULL.
        let p = unsafe { le(std::ptr::null_mut()) };
        if !p.is_null() {
            // SAFETY: non-null, NUL-terminated, owned by NCCL and valid now.
            let s = unsafe { std::ffi::CStr::from_ptr(p) }.to_string_lossy();
            if !s.is_empty() {
                msg.push_str(": ");
                msg.push_str(&s);
            }
        }
    }
    Err(Failure::new(r, msg))
}
