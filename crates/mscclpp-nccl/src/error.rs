//! Errors at the C boundary: every failure becomes an `ncclResult_t` and a message that
//! `ncclGetLastError` returns: the calling thread's last one (as NCCL keeps it per thread), or
//! the process's last when this thread has none. Failures are logged at `warn`.

use std::ffi::{CStr, CString};
use std::sync::Mutex;

use mscclpp::ErrorKind;

use crate::abi::*;

/// A failure of one call: the code the C caller gets and the message for `ncclGetLastError`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Failure {
    /// The result code.
    pub code: ncclResult_t,
    /// What went wrong, naming the operation and rank where known.
    pub message: String,
}

impl Failure {
    /// A failure with `code`.
    pub fn new(code: ncclResult_t, message: impl Into<String>) -> Failure {
        Failure { code, message: message.into() }
    }
    /// `ncclInvalidArgument`.
    pub fn arg(message: impl Into<String>) -> Failure {
        Failure::new(ncclInvalidArgument, message)
    }
    /// `ncclInvalidUsage`.
    pub fn usage(message: impl Into<String>) -> Failure {
        Failure::new(ncclInvalidUsage, message)
    }
    /// Prefixes the message with what was being done.
    pub fn during(mut self, what: &str) -> Failure {
        self.message = format!("{what}: {}", self.message);
        self
    }
}

/// The NCCL code of an mscclpp error kind.
pub fn code_of(kind: ErrorKind) -> ncclResult_t {
    match kind {
        ErrorKind::InvalidUsage | ErrorKind::NotAvailable => ncclInvalidUsage,
        ErrorKind::Timeout => ncclTimeout,
        ErrorKind::Remote | ErrorKind::Aborted => ncclRemoteError,
        ErrorKind::System | ErrorKind::Ib => ncclSystemError,
        ErrorKind::Cuda => ncclUnhandledCudaError,
        _ => ncclInternalError,
    }
}

impl From<mscclpp::Error> for Failure {
    fn from(e: mscclpp::Error) -> Failure {
        Failure { code: code_of(e.kind()), message: e.to_string() }
    }
}

/// The result of a call made for the C API.
pub type Res<T = ()> = std::result::Result<T, Failure>;

/// Kept strings: `ncclGetLastError` hands out a pointer, so the last few stay alive.
struct LastErrors {
    ring: Vec<CString>,
    next: usize,
}

const KEPT: usize = 32;

static LAST: Mutex<LastErrors> = Mutex::new(LastErrors { ring: Vec::new(), next: 0 });

thread_local! {
    static MINE: std::cell::RefCell<Option<CString>> = const { std::cell::RefCell::new(None) };
}

/// Records `f` as the last error (and logs it); returns its code.
pub fn record(f: &Failure) -> ncclResult_t {
    tracing::warn!(target: "mscclpp::nccl", code = f.code, "{}", f.message);
    let c = CString::new(f.message.replace('\0', " ")).unwrap_or_default();
    MINE.with(|m| *m.borrow_mut() = Some(c.clone()));
    let mut l = LAST.lock().unwrap_or_else(|p| p.into_inner());
    if l.ring.len() < KEPT {
        l.ring.push(c);
        l.next = l.ring.len() % KEPT;
    } else {
        let i = l.next;
        l.ring[i] = c;
        l.next = (i + 1) % KEPT;
    }
    f.code
}

/// The calling thread's last message (valid until its next failure), else the process's last
/// (valid until 32 more failures), else empty.
pub fn last_error_ptr() -> *const std::ffi::c_char {
    let mine = MINE.with(|m| m.borrow().as_ref().map(|c| c.as_ptr()));
    if let Some(p) = mine {
        return p;
    }
    let l = LAST.lock().unwrap_or_else(|p| p.into_inner());
    if l.ring.is_empty() {
        return c"".as_ptr();
    }
    let i = (l.next + KEPT - 1) % KEPT;
    match l.ring.get(i.min(l.ring.len() - 1)) {
        Some(s) => s.as_ptr(),
        None => c"".as_ptr(),
    }
}

/// The last recorded message, as a Rust string (for tests).
pub fn last_error() -> String {
    // SAFETY: last_error_ptr returns a NUL-terminated string kept alive in LAST (or a static).
    unsafe { CStr::from_ptr(last_error_ptr()) }.to_string_lossy().into_owned()
}

/// Installs the log subscriber (`mscclpp::init_logging`: `MSCCLPP_LOG_LEVEL`, `MSCCLPP_LOG_FILE`
/// and the rest) at the first call of any export. The library is what a C or Python program
/// loads, so there is no Rust program around it to install one, and without it the routing lines
/// (which operation ran natively, which went to the NCCL fallback) and every warning went
/// nowhere. A bad setting is said once on stderr; the calls go on.
fn logging_once() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        // The NCCL fallback's variables are this library's (the core library would call them
        // MSCCL++ variables that have no effect here).
        mscclpp::env::read_elsewhere(&[
            crate::route::ENABLE_FALLBACK_VAR,
            crate::route::LIB_PATH_VAR,
            crate::route::FORCE_VAR,
        ]);
        if let Err(e) = mscclpp::init_logging() {
            // Another subscriber in this library's copy of `tracing` is not possible from C;
            // a bad variable is the user's to fix, and said where they look.
            eprintln!("libmscclpp_nccl: logging is off: {e}");
        }
    });
}

/// Runs `f` for an export: its failure is recorded and returned as a code, a panic becomes
/// `ncclInternalError` (never unwinding into C).
pub fn guard(name: &str, f: impl FnOnce() -> Res) -> ncclResult_t {
    match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        logging_once();
        f()
    })) {
        Ok(Ok(())) => ncclSuccess,
        Ok(Err(e)) => record(&e),
        Err(p) => {
            let why = p
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| p.downcast_ref::<String>().cloned())
                .unwrap_or_default();
            record(&Failure::new(ncclInternalError, format!("{name}: internal panic: {why}")))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn guard_records_and_catches() {
        assert_eq!(guard("t", || Ok(())), ncclSuccess);
        assert_eq!(guard("t", || Err(Failure::usage("ncclX: nope"))), ncclInvalidUsage);
        assert_eq!(last_error(), "ncclX: nope");
        let r = guard("ncclBoom", || panic!("kaboom"));
        assert_eq!(r, ncclInternalError);
        assert!(last_error().contains("ncclBoom: internal panic: kaboom"));
        for i in 0..100 {
            record(&Failure::arg(format!("e{i}")));
        }
        assert_eq!(last_error(), "e99");
    }
}
