//! `mscclpp::Error` to Python exceptions (classes defined in `mscclpp_rs/_errors.py`, where
//! multiple bases are plain Python).

use std::time::Duration;

use mscclpp::ErrorKind;
use pyo3::prelude::*;

/// The exception class name for an error kind.
fn class_name(kind: ErrorKind) -> &'static str {
    match kind {
        ErrorKind::InvalidUsage => "InvalidUsageError",
        ErrorKind::Timeout => "MscclppTimeoutError",
        ErrorKind::Remote => "RemoteError",
        ErrorKind::System => "SystemCallError",
        ErrorKind::Cuda => "CudaError",
        ErrorKind::Ib => "IbError",
        ErrorKind::Internal => "InternalError",
        ErrorKind::Aborted => "AbortedError",
        ErrorKind::NotAvailable => "NotAvailableError",
        _ => "MscclppError",
    }
}

/// The member name of `mscclpp_rs.ErrorKind` for an error kind.
fn kind_name(kind: ErrorKind) -> &'static str {
    match kind {
        ErrorKind::InvalidUsage => "INVALID_USAGE",
        ErrorKind::Timeout => "TIMEOUT",
        ErrorKind::Remote => "REMOTE",
        ErrorKind::System => "SYSTEM",
        ErrorKind::Cuda => "CUDA",
        ErrorKind::Ib => "IB",
        ErrorKind::Internal => "INTERNAL",
        ErrorKind::Aborted => "ABORTED",
        ErrorKind::NotAvailable => "NOT_AVAILABLE",
        _ => "OTHER",
    }
}

/// The Python exception for `e`: its class by kind, the one-line message (operation, transport,
/// peer, cause, kind) and the structured parts as attributes: `kind` (an `ErrorKind`),
/// `operation`, `peer`, `transport` (a `Transport` flag, as users pass in) and, where an
/// operating-system call failed, `errno` (an `OSError`'s too, for `SystemCallError`).
pub(crate) fn to_py(py: Python<'_>, e: &mscclpp::Error) -> PyErr {
    let build = || -> PyResult<PyErr> {
        let module = py.import("mscclpp_rs._errors")?;
        let cls = module.getattr(class_name(e.kind()))?;
        let exc = cls.call1((e.to_string(),))?;
        let kinds = py.import("mscclpp_rs._types")?.getattr("ErrorKind")?;
        exc.setattr("kind", kinds.getattr(kind_name(e.kind()))?)?;
        exc.setattr("operation", e.operation())?;
        exc.setattr("peer", e.peer())?;
        let transport = match e.transport() {
            Some(t) => Some(crate::memory::py_transport(py, t.into())?),
            None => None,
        };
        exc.setattr("transport", transport)?;
        if let Some(n) = e.os_error() {
            exc.setattr("errno", n)?;
        }
        Ok(PyErr::from_value(exc))
    };
    // Without the package (the native module imported alone), a plain RuntimeError still says it.
    build().unwrap_or_else(|_| pyo3::exceptions::PyRuntimeError::new_err(e.to_string()))
}

/// `Result` of the library into `PyResult`.
pub(crate) trait IntoPyResult<T> {
    /// Maps the error with [`to_py`].
    fn py(self, py: Python<'_>) -> PyResult<T>;
}

impl<T> IntoPyResult<T> for mscclpp::Result<T> {
    fn py(self, py: Python<'_>) -> PyResult<T> {
        self.map_err(|e| to_py(py, &e))
    }
}

/// An `InvalidUsageError` (also a `ValueError`) for bad arguments found on the Python side.
pub(crate) fn invalid(py: Python<'_>, msg: impl Into<String>) -> PyErr {
    to_py(py, &mscclpp::Error::invalid_usage(msg))
}

/// A timeout given in seconds from Python, as the `Duration` the library takes. The one
/// conversion every `timeout` argument goes through:
/// * `0` gives an answer at once (success where it is already there, `MscclppTimeoutError`
///   otherwise);
/// * `float('inf')` means no limit (`Duration::MAX`), and so does a finite value too large for a
///   `Duration` (over 584 billion years);
/// * a negative number or NaN raises `InvalidUsageError` (a `ValueError`) naming `what`.
pub(crate) fn seconds(py: Python<'_>, what: &str, s: f64) -> PyResult<Duration> {
    if s.is_nan() || s < 0.0 {
        return Err(invalid(
            py,
            format!("{what} must be a number of seconds >= 0, or float('inf') for no limit; not {s}"),
        ));
    }
    Ok(Duration::try_from_secs_f64(s).unwrap_or(Duration::MAX))
}

/// A `Duration` as Python seconds, the inverse of [`seconds`]: no limit (`Duration::MAX`) is
/// `float('inf')`.
pub(crate) fn to_seconds(d: Duration) -> f64 {
    if d == Duration::MAX { f64::INFINITY } else { d.as_secs_f64() }
}
