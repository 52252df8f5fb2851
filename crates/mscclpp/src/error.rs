//! The one error type of the crate.
//!
//! Every error says what failed (the operation), where (the peer rank and the transport, when there
//! is one) and why. The kinds follow MSCCL++'s `ErrorCode`s so that code ported from C++ can map
//! them one to one: see [`ErrorKind`].

use std::fmt;
use std::time::Duration;

use crate::transport::Transport;

/// Result alias used throughout the crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// The broad class of an [`Error`], matching MSCCL++'s `ErrorCode`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum ErrorKind {
    /// The caller used the API wrongly: bad bounds, a memory without the transport, a bad value.
    InvalidUsage,
    /// A bounded wait ran out.
    Timeout,
    /// The peer failed, closed, broke the protocol, or could not be reached.
    Remote,
    /// An operating-system call failed (sockets, files, threads).
    System,
    /// A CUDA driver call failed, or CUDA is not available.
    Cuda,
    /// A verbs call failed, or InfiniBand is not available.
    Ib,
    /// A broken invariant inside the library: a bug worth reporting.
    Internal,
    /// The operation was abandoned because the object it used had already failed or was closed.
    Aborted,
    /// A feature or platform library is not available on this machine or in this build.
    NotAvailable,
}

impl fmt::Display for ErrorKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            ErrorKind::InvalidUsage => "invalid usage",
            ErrorKind::Timeout => "timeout",
            ErrorKind::Remote => "remote failure",
            ErrorKind::System => "system error",
            ErrorKind::Cuda => "CUDA error",
            ErrorKind::Ib => "IB error",
            ErrorKind::Internal => "internal error",
            ErrorKind::Aborted => "aborted",
            ErrorKind::NotAvailable => "not available",
        })
    }
}

/// Where an error happened: the operation, and where known the peer and the transport.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct ErrorContext {
    /// The operation that failed, such as `"write"`, `"flush"` or `"bootstrap recv"`.
    pub operation: Option<String>,
    /// The peer's rank, when the operation concerned one peer.
    pub peer: Option<usize>,
    /// The transport in use, when there was one.
    pub transport: Option<Transport>,
}

impl fmt::Display for ErrorContext {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut sep = "";
        if let Some(op) = &self.operation {
            write!(f, "{op}")?;
            sep = " ";
        }
        if let Some(t) = self.transport {
            write!(f, "{sep}over {t}")?;
            sep = " ";
        }
        if let Some(p) = self.peer {
            write!(f, "{sep}with peer rank {p}")?;
        }
        Ok(())
    }
}

/// The error type of every fallible call in this crate.
///
/// `Display` gives one line: `"<context>: <message>[: <cause>] (<kind>)"`, for example
/// `"flush over ETH with peer rank 1: 3 operations still outstanding after 100ms (timeout)"`.
///
/// The structured parts are accessors too, so code can act on them without parsing text:
/// [`kind`](Self::kind), [`operation`](Self::operation), [`peer`](Self::peer),
/// [`transport`](Self::transport), [`os_error`](Self::os_error) and [`io_kind`](Self::io_kind)
/// (for operating-system failures), [`cuda_result`](Self::cuda_result) (for CUDA driver
/// failures) and [`outstanding`](Self::outstanding) (for flush timeouts). They survive
/// [`duplicate`](Self::duplicate), which a failed connection hands to every later call.
#[derive(Debug)]
pub struct Error {
    kind: ErrorKind,
    message: String,
    detail: Box<Detail>,
    source: Option<Box<dyn std::error::Error + Send + Sync + 'static>>,
}

/// The structured detail of an [`Error`] (boxed: errors stay small on the happy path).
#[derive(Clone, Debug, Default)]
struct Detail {
    context: ErrorContext,
    os_error: Option<i32>,
    io_kind: Option<std::io::ErrorKind>,
    cuda_result: Option<i32>,
    outstanding: Option<u64>,
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let ctx = self.detail.context.to_string();
        if !ctx.is_empty() {
            write!(f, "{ctx}: ")?;
        }
        f.write_str(&self.message)?;
        if let Some(e) = &self.source {
            write!(f, ": {e}")?;
        }
        write!(f, " ({})", self.kind)
    }
}

impl std::error::Error for Error {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        self.source.as_deref().map(|e| e as &(dyn std::error::Error + 'static))
    }
}

impl Error {
    /// Creates an error of `kind` with a message and no context.
    pub fn new(kind: ErrorKind, message: impl Into<String>) -> Self {
        Error { kind, message: message.into(), detail: Box::default(), source: None }
    }

    /// An [`ErrorKind::InvalidUsage`] error.
    pub fn invalid_usage(message: impl Into<String>) -> Self {
        Self::new(ErrorKind::InvalidUsage, message)
    }

    /// An [`ErrorKind::Timeout`] error after waiting `waited`.
    pub fn timeout(what: impl fmt::Display, waited: Duration) -> Self {
        Self::new(ErrorKind::Timeout, format!("{what} after {waited:?}"))
    }

    /// An [`ErrorKind::Remote`] error.
    pub fn remote(message: impl Into<String>) -> Self {
        Self::new(ErrorKind::Remote, message)
    }

    /// An [`ErrorKind::Internal`] error.
    pub fn internal(message: impl Into<String>) -> Self {
        Self::new(ErrorKind::Internal, message)
    }

    /// An [`ErrorKind::NotAvailable`] error.
    pub fn not_available(message: impl Into<String>) -> Self {
        Self::new(ErrorKind::NotAvailable, message)
    }

    /// An [`ErrorKind::System`] error wrapping an I/O error, with what was being done; the I/O
    /// error's kind and OS error number stay available ([`io_kind`](Self::io_kind),
    /// [`os_error`](Self::os_error)).
    pub fn io(what: impl Into<String>, err: std::io::Error) -> Self {
        Self::new(ErrorKind::System, what).with_source(err)
    }

    /// Attaches a cause (an [`std::io::Error`] cause also sets [`io_kind`](Self::io_kind) and
    /// [`os_error`](Self::os_error)).
    pub fn with_source(mut self, source: impl std::error::Error + Send + Sync + 'static) -> Self {
        if let Some(io) = (&source as &dyn std::any::Any).downcast_ref::<std::io::Error>() {
            self.detail.io_kind = Some(io.kind());
            self.detail.os_error = io.raw_os_error();
        }
        self.source = Some(Box::new(source));
        self
    }

    /// Sets the operation, unless one is already set (the innermost name wins).
    pub fn during(mut self, operation: impl Into<String>) -> Self {
        if self.detail.context.operation.is_none() {
            self.detail.context.operation = Some(operation.into());
        }
        self
    }

    /// Sets the peer rank, unless one is already set.
    pub fn with_peer(mut self, peer: usize) -> Self {
        if self.detail.context.peer.is_none() {
            self.detail.context.peer = Some(peer);
        }
        self
    }

    /// Sets the transport, unless one is already set.
    pub fn with_transport(mut self, transport: Transport) -> Self {
        if self.detail.context.transport.is_none() {
            self.detail.context.transport = Some(transport);
        }
        self
    }

    /// Records how many operations were still outstanding (flush timeouts).
    pub(crate) fn with_outstanding(mut self, n: u64) -> Self {
        self.detail.outstanding = Some(n);
        self
    }

    /// Records the CUDA driver's result code (`CUresult`).
    /// Appends `note` to the message (what the caller knows and the inner code did not, such as
    /// where an address came from); kind, context and cause stay.
    pub(crate) fn with_note(mut self, note: impl fmt::Display) -> Self {
        self.message = format!("{}; {note}", self.message);
        self
    }

    pub(crate) fn with_cuda_result(mut self, code: i32) -> Self {
        self.detail.cuda_result = Some(code);
        self
    }

    /// The class of this error.
    pub fn kind(&self) -> ErrorKind {
        self.kind
    }

    /// The message, without context.
    pub fn message(&self) -> &str {
        &self.message
    }

    /// Where the error happened.
    pub fn context(&self) -> &ErrorContext {
        &self.detail.context
    }

    /// The operation that failed (`"flush"`, `"bootstrap recv"`, ...), if named.
    pub fn operation(&self) -> Option<&str> {
        self.detail.context.operation.as_deref()
    }

    /// The peer rank named by this error, if any.
    pub fn peer(&self) -> Option<usize> {
        self.detail.context.peer
    }

    /// The transport in use, if there was one.
    pub fn transport(&self) -> Option<Transport> {
        self.detail.context.transport
    }

    /// The operating system's error number (`errno`) behind this error, if an OS call failed
    /// with one.
    pub fn os_error(&self) -> Option<i32> {
        self.detail.os_error
    }

    /// The kind of the I/O error behind this error, if an I/O call failed.
    pub fn io_kind(&self) -> Option<std::io::ErrorKind> {
        self.detail.io_kind
    }

    /// The CUDA driver's result code (`CUresult`, as its number: 2 is `CUDA_ERROR_OUT_OF_MEMORY`),
    /// if a driver call failed.
    pub fn cuda_result(&self) -> Option<i32> {
        self.detail.cuda_result
    }

    /// How many operations were still outstanding, for a flush that timed out.
    pub fn outstanding(&self) -> Option<u64> {
        self.detail.outstanding
    }

    /// A copy of this error for a second observer (causes are flattened into text; the
    /// structured detail is kept).
    ///
    /// Connections keep their first failure and hand a copy to every later call.
    pub fn duplicate(&self) -> Self {
        let message = match &self.source {
            Some(s) => format!("{}: {s}", self.message),
            None => self.message.clone(),
        };
        Error { kind: self.kind, message, detail: self.detail.clone(), source: None }
    }
}

impl From<std::io::Error> for Error {
    fn from(err: std::io::Error) -> Self {
        let kind = match err.kind() {
            std::io::ErrorKind::TimedOut | std::io::ErrorKind::WouldBlock => ErrorKind::Timeout,
            std::io::ErrorKind::ConnectionReset
            | std::io::ErrorKind::ConnectionAborted
            | std::io::ErrorKind::BrokenPipe
            | std::io::ErrorKind::UnexpectedEof => ErrorKind::Remote,
            _ => ErrorKind::System,
        };
        Error::new(kind, "I/O error").with_source(err)
    }
}

/// The first error of a series of steps that should all be tried even when one fails: a
/// collective setup's pairwise part sends what it owes every peer before it gives up on one, so
/// that the others are not left waiting for its messages.
///
/// ```
/// use mscclpp::{Error, FirstError};
/// let mut first = FirstError::default();
/// let got: Vec<u32> = [Ok(1), Err(Error::invalid_usage("two")), Ok(3), Err(Error::invalid_usage("four"))]
///     .into_iter()
///     .filter_map(|r| first.keep(r))
///     .collect();
/// assert_eq!(got, [1, 3]);
/// assert!(first.into_result().unwrap_err().to_string().contains("two"));
/// ```
#[derive(Debug)]
pub struct FirstError<E = Error> {
    first: Option<E>,
}

impl<E> Default for FirstError<E> {
    fn default() -> Self {
        FirstError { first: None }
    }
}

impl<E> FirstError<E> {
    /// The value of `r`, or `None` after keeping its error (unless an earlier one is kept).
    pub fn keep<T>(&mut self, r: std::result::Result<T, E>) -> Option<T> {
        match r {
            Ok(v) => Some(v),
            Err(e) => {
                self.first.get_or_insert(e);
                None
            }
        }
    }
    /// Whether an error was kept.
    pub fn failed(&self) -> bool {
        self.first.is_some()
    }
    /// `Err` with the first error kept, else `Ok`.
    ///
    /// # Errors
    /// The first error given to [`keep`](Self::keep).
    pub fn into_result(self) -> std::result::Result<(), E> {
        self.first.map_or(Ok(()), Err)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn display_carries_context_kind_and_cause() {
        let io = std::io::Error::new(std::io::ErrorKind::ConnectionReset, "reset by peer");
        let e = Error::io("reading frame header", io).during("flush").with_peer(3).with_transport(Transport::Ethernet);
        let s = e.to_string();
        assert_eq!(s, "flush over ETH with peer rank 3: reading frame header: reset by peer (system error)");
        assert_eq!(e.kind(), ErrorKind::System);
        assert_eq!(e.peer(), Some(3));
        let d = e.duplicate();
        assert_eq!(d.to_string(), s);
        assert_eq!(d.io_kind(), Some(std::io::ErrorKind::ConnectionReset));
        assert_eq!((d.operation(), d.peer(), d.transport()), (Some("flush"), Some(3), Some(Transport::Ethernet)));
    }

    /// A real failed system call: its errno and I/O kind are accessors, and survive duplicate.
    #[test]
    fn io_errors_carry_errno() {
        let err = std::fs::File::open("/nonexistent/mscclpp-test").unwrap_err();
        let e = Error::io("opening a file", err);
        assert_eq!(e.os_error(), Some(nix::errno::Errno::ENOENT as i32));
        assert_eq!(e.io_kind(), Some(std::io::ErrorKind::NotFound));
        assert_eq!(e.duplicate().os_error(), Some(nix::errno::Errno::ENOENT as i32));
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let taken = std::net::TcpListener::bind(l.local_addr().unwrap()).unwrap_err();
        let e: Error = taken.into();
        assert_eq!(e.os_error(), Some(nix::errno::Errno::EADDRINUSE as i32));
        assert_eq!(e.io_kind(), Some(std::io::ErrorKind::AddrInUse));
        assert_eq!(Error::invalid_usage("x").os_error(), None);
        assert_eq!(Error::invalid_usage("x").outstanding(), None);
    }

    #[test]
    fn innermost_context_wins() {
        let e = Error::invalid_usage("bad").during("inner").during("outer").with_peer(1).with_peer(2);
        assert_eq!(e.context().operation.as_deref(), Some("inner"));
        assert_eq!(e.peer(), Some(1));
    }

    #[test]
    fn io_kinds_map() {
        let e: Error = std::io::Error::from(std::io::ErrorKind::UnexpectedEof).into();
        assert_eq!(e.kind(), ErrorKind::Remote);
        let e: Error = std::io::Error::from(std::io::ErrorKind::TimedOut).into();
        assert_eq!(e.kind(), ErrorKind::Timeout);
    }
}
