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
#[derive(Debug, thiserror::Error)]
#[error("{}{message}{} ({kind})", prefix(.context), cause_suffix(.source))]
pub struct Error {
    kind: ErrorKind,
    message: String,
    context: Box<ErrorContext>,
    #[source]
    source: Option<Box<dyn std::error::Error + Send + Sync + 'static>>,
}

fn prefix(ctx: &ErrorContext) -> String {
    let s = ctx.to_string();
    if s.is_empty() { s } else { format!("{s}: ") }
}

fn cause_suffix(src: &Option<Box<dyn std::error::Error + Send + Sync + 'static>>) -> String {
    match src {
        Some(e) => format!(": {e}"),
        None => String::new(),
    }
}

impl Error {
    /// Creates an error of `kind` with a message and no context.
    pub fn new(kind: ErrorKind, message: impl Into<String>) -> Self {
        Error { kind, message: message.into(), context: Box::default(), source: None }
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

    /// An [`ErrorKind::System`] error wrapping an I/O error, with what was being done.
    pub fn io(what: impl Into<String>, err: std::io::Error) -> Self {
        Error { kind: ErrorKind::System, message: what.into(), context: Box::default(), source: Some(Box::new(err)) }
    }

    /// Attaches a cause.
    pub fn with_source(mut self, source: impl std::error::Error + Send + Sync + 'static) -> Self {
        self.source = Some(Box::new(source));
        self
    }

    /// Sets the operation, unless one is already set (the innermost name wins).
    pub fn during(mut self, operation: impl Into<String>) -> Self {
        if self.context.operation.is_none() {
            self.context.operation = Some(operation.into());
        }
        self
    }

    /// Sets the peer rank, unless one is already set.
    pub fn with_peer(mut self, peer: usize) -> Self {
        if self.context.peer.is_none() {
            self.context.peer = Some(peer);
        }
        self
    }

    /// Sets the transport, unless one is already set.
    pub fn with_transport(mut self, transport: Transport) -> Self {
        if self.context.transport.is_none() {
            self.context.transport = Some(transport);
        }
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
        &self.context
    }

    /// The peer rank named by this error, if any.
    pub fn peer(&self) -> Option<usize> {
        self.context.peer
    }

    /// A copy of this error for a second observer (causes are flattened into text).
    ///
    /// Connections keep their first failure and hand a copy to every later call.
    pub fn duplicate(&self) -> Self {
        let message = match &self.source {
            Some(s) => format!("{}: {s}", self.message),
            None => self.message.clone(),
        };
        Error { kind: self.kind, message, context: self.context.clone(), source: None }
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
        Error { kind, message: "I/O error".into(), context: Box::default(), source: Some(Box::new(err)) }
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
