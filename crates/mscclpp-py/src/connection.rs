//! Host API: `Connection` (write, update_and_sync, atomic_add, flush) and the host semaphores.

use std::collections::HashMap;
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use mscclpp::Transport;
use pyo3::prelude::*;
use pyo3::types::PyBytes;

use crate::comm::{closed_error, lock};
use crate::errors::{IntoPyResult, invalid, seconds};
use crate::memory::{RegisteredMemory, py_transport};

pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<Connection>()?;
    m.add_class::<Host2HostSemaphore>()?;
    m.add_class::<Host2DeviceSemaphore>()?;
    m.add_function(wrap_pyfunction!(_time_rust_writes, m)?)?;
    Ok(())
}

/// A connection to one peer over one transport: `write`, `update_and_sync`, `atomic_add`, `flush`.
///
/// Operations are asynchronous: they are checked (bounds, transports: `InvalidUsageError`,
/// nothing sent) and queued; `flush` waits until all earlier ones landed at the peer. The
/// source memories of writes issued since the last successful `flush` are kept alive here.
/// `close()` (or leaving a `with` block) flushes what is unflushed and lets the connection go.
#[pyclass(frozen, module = "mscclpp_rs._native")]
pub(crate) struct Connection {
    /// `None` once closed.
    conn: Mutex<Option<mscclpp::Connection>>,
    transport: Transport,
    peer: Option<usize>,
    /// Sources of writes not yet covered by a successful flush.
    in_flight: Mutex<Vec<Py<RegisteredMemory>>>,
    /// Outbound copies of the words `update_and_sync` sets, by (address, offset).
    outbound: Mutex<HashMap<(u64, u64), Arc<AtomicU64>>>,
}

/// How long `close()` and garbage collection wait for unflushed writes to land.
const CLOSE_FLUSH: Duration = Duration::from_secs(5);

impl Connection {
    pub(crate) fn new(conn: mscclpp::Connection) -> Connection {
        Connection {
            transport: conn.transport(),
            peer: conn.peer_rank(),
            conn: Mutex::new(Some(conn)),
            in_flight: Mutex::new(Vec::new()),
            outbound: Mutex::new(HashMap::new()),
        }
    }

    /// The connection (a cheap clone), or `AbortedError` once closed.
    pub(crate) fn conn(&self, py: Python<'_>) -> PyResult<mscclpp::Connection> {
        lock(&self.conn).clone().ok_or_else(|| closed_error(py, "connection"))
    }

    pub(crate) fn peer_of(&self, py: Python<'_>) -> PyResult<usize> {
        self.peer.ok_or_else(|| invalid(py, "this connection has no peer rank (made outside a Communicator)"))
    }

    fn keep(&self, src: &Bound<'_, RegisteredMemory>) {
        let mut v = lock(&self.in_flight);
        if !v.iter().any(|m| m.as_ptr() == src.as_ptr()) {
            v.push(src.clone().unbind());
        }
    }
}

#[pymethods]
impl Connection {
    /// Copies `size` bytes from local `src` at `src_offset` into the peer's `dst` at
    /// `dst_offset`. Asynchronous: `src` must not change until `flush` returns.
    #[pyo3(signature = (dst, dst_offset, src, src_offset, size))]
    fn write(
        &self,
        py: Python<'_>,
        dst: &RegisteredMemory,
        dst_offset: u64,
        src: &Bound<'_, RegisteredMemory>,
        src_offset: u64,
        size: u64,
    ) -> PyResult<()> {
        let s = src.get();
        let conn = self.conn(py)?;
        py.detach(|| conn.write(&dst.mem, dst_offset, &s.mem, src_offset, size)).py(py)?;
        self.keep(src);
        Ok(())
    }

    /// Sets the peer's 8-byte word at `dst` + `dst_offset` to `value`, visible after every
    /// earlier operation of this connection (values must not decrease on IB).
    fn update_and_sync(&self, py: Python<'_>, dst: &RegisteredMemory, dst_offset: u64, value: u64) -> PyResult<()> {
        let conn = self.conn(py)?;
        let word = lock(&self.outbound).entry((dst.mem.addr(), dst_offset)).or_default().clone();
        py.detach(|| conn.update_and_sync(&dst.mem, dst_offset, &word, value)).py(py)
    }

    /// Adds `value` to the peer's 8-byte word at `dst` + `dst_offset` (wrapping), after every
    /// earlier operation; `flush` covers it.
    fn atomic_add(&self, py: Python<'_>, dst: &RegisteredMemory, dst_offset: u64, value: i64) -> PyResult<()> {
        let conn = self.conn(py)?;
        py.detach(|| conn.atomic_add(&dst.mem, dst_offset, value)).py(py)
    }

    /// Waits (GIL released) until every operation issued before it landed in the peer's memory.
    /// Raises `MscclppTimeoutError` (a `TimeoutError`) after `timeout` seconds (`0`: at once
    /// unless nothing is outstanding; `float('inf')`: no limit).
    #[pyo3(signature = (timeout = 30.0))]
    fn flush(&self, py: Python<'_>, timeout: f64) -> PyResult<()> {
        let t = seconds(py, "timeout", timeout)?;
        let conn = self.conn(py)?;
        let n = lock(&self.in_flight).len();
        py.detach(|| conn.flush(t)).py(py)?;
        // What was queued before the flush has landed: those sources may go.
        lock(&self.in_flight).drain(..n);
        Ok(())
    }

    /// `None` while the connection works; raises the error that broke it otherwise.
    fn status(&self, py: Python<'_>) -> PyResult<()> {
        self.conn(py)?.status().py(py)
    }

    /// Operations issued and not yet known complete (0 once closed).
    #[getter]
    fn outstanding(&self) -> u64 {
        lock(&self.conn).as_ref().map_or(0, |c| c.outstanding())
    }

    /// The transport, as the `mscclpp_rs.Transport` flag users pass to `connect`.
    #[getter]
    fn transport(&self, py: Python<'_>) -> PyResult<Py<PyAny>> {
        py_transport(py, self.transport.into())
    }

    /// The peer's rank.
    #[getter]
    fn peer(&self) -> Option<usize> {
        self.peer
    }

    /// Waits (GIL released, at most 5 s) for writes not yet flushed, so their sources may go,
    /// then drops this object's hold on the connection: the transport closes once the
    /// semaphores and channels made on it are gone too. Later operations raise `AbortedError`;
    /// closing twice is harmless. Errors of that last flush are not raised (call `flush` first
    /// to see them). `with comm.connect(...) as conn:` closes on leaving the block.
    fn close(&self, py: Python<'_>) {
        let Some(conn) = lock(&self.conn).take() else { return };
        if !lock(&self.in_flight).is_empty() {
            let _ = py.detach(|| conn.flush(CLOSE_FLUSH));
        }
        lock(&self.in_flight).clear();
        py.detach(move || drop(conn));
    }

    /// True once `close()` was called.
    #[getter]
    fn closed(&self) -> bool {
        lock(&self.conn).is_none()
    }

    fn __enter__(slf: Bound<'_, Self>) -> Bound<'_, Self> {
        slf
    }

    #[pyo3(signature = (_exc_type = None, _exc = None, _tb = None))]
    fn __exit__(
        &self,
        py: Python<'_>,
        _exc_type: Option<&Bound<'_, PyAny>>,
        _exc: Option<&Bound<'_, PyAny>>,
        _tb: Option<&Bound<'_, PyAny>>,
    ) -> bool {
        self.close(py);
        false
    }

    fn __repr__(&self) -> String {
        let peer = self.peer.map_or("None".to_string(), |p| p.to_string());
        let closed = if lock(&self.conn).is_none() { ", closed" } else { "" };
        format!("Connection(peer={peer}, transport={}{closed})", self.transport)
    }
}

impl Drop for Connection {
    fn drop(&mut self) {
        // Sources of unflushed writes must outlive the transfers: give them a bounded chance to
        // land before the references go.
        if let Some(conn) = lock(&self.conn).as_ref()
            && !lock(&self.in_flight).is_empty()
        {
            let _ = conn.flush(CLOSE_FLUSH);
        }
    }
}

/// A semaphore host threads signal and wait on (Ethernet or IB connections).
#[pyclass(frozen, module = "mscclpp_rs._native")]
pub(crate) struct Host2HostSemaphore {
    pub(crate) sem: mscclpp::Host2HostSemaphore,
}

#[pymethods]
impl Host2HostSemaphore {
    /// Signals the peer (after every earlier operation of the connection).
    fn signal(&self, py: Python<'_>) -> PyResult<()> {
        py.detach(|| self.sem.signal()).py(py)
    }

    /// True (and consumes it) if a signal arrived.
    fn poll(&self, py: Python<'_>) -> PyResult<bool> {
        self.sem.poll().py(py)
    }

    /// Waits (GIL released) for the peer's next signal; `MscclppTimeoutError` after `timeout` s
    /// (`0`: only a signal already there; `float('inf')`: no limit).
    #[pyo3(signature = (timeout = 30.0))]
    fn wait(&self, py: Python<'_>, timeout: f64) -> PyResult<()> {
        let t = seconds(py, "timeout", timeout)?;
        py.detach(|| self.sem.wait(t)).py(py)
    }

    /// The token the peer increments.
    #[getter]
    fn inbound_token(&self) -> u64 {
        self.sem.inbound_token()
    }
}

/// A semaphore a kernel waits on, signalled by the peer's proxy (or host). Hand it to
/// `ProxyService.add_semaphore` for a `PortChannel` (the service takes it over).
#[pyclass(frozen, module = "mscclpp_rs._native")]
pub(crate) struct Host2DeviceSemaphore {
    pub(crate) sem: Mutex<Option<Arc<mscclpp::Host2DeviceSemaphore>>>,
}

impl Host2DeviceSemaphore {
    fn with<T>(
        &self,
        py: Python<'_>,
        f: impl FnOnce(&mscclpp::Host2DeviceSemaphore) -> mscclpp::Result<T> + Send,
    ) -> PyResult<T>
    where
        T: Send,
    {
        let s = lock(&self.sem).clone();
        match s {
            Some(s) => py.detach(|| f(&s)).py(py),
            None => Err(invalid(py, "this semaphore was given to a ProxyService, which signals it now")),
        }
    }
}

#[pymethods]
impl Host2DeviceSemaphore {
    /// Signals the peer from the host.
    fn signal(&self, py: Python<'_>) -> PyResult<()> {
        self.with(py, |s| s.signal())
    }

    /// Waits on the host (GIL released) for the peer's next signal; `MscclppTimeoutError` after
    /// `timeout` s (`0`: only a signal already there; `float('inf')`: no limit).
    #[pyo3(signature = (timeout = 30.0))]
    fn wait(&self, py: Python<'_>, timeout: f64) -> PyResult<()> {
        let t = seconds(py, "timeout", timeout)?;
        self.with(py, move |s| s.wait(t))
    }

    /// The 16-byte device handle (`mscclpp::Host2DeviceSemaphoreDeviceHandle`).
    fn device_handle<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyBytes>> {
        let h = self.with(py, |s| Ok(s.device_handle().to_bytes()))?;
        Ok(PyBytes::new(py, &h))
    }
}

/// For `examples/bench_write.py`: times `iters` Rust `Connection::write` calls (a flush after
/// every `flush_every`), the loop `bench_write` runs from Python, so the difference per call is
/// the Python-side overhead. Returns seconds.
#[pyfunction]
#[allow(clippy::too_many_arguments)]
fn _time_rust_writes(
    py: Python<'_>,
    conn: &Connection,
    dst: &RegisteredMemory,
    dst_offset: u64,
    src: &RegisteredMemory,
    src_offset: u64,
    size: u64,
    iters: u64,
    flush_every: u64,
) -> PyResult<f64> {
    let flush_every = flush_every.max(1);
    let c = conn.conn(py)?;
    py.detach(|| -> mscclpp::Result<f64> {
        let t0 = std::time::Instant::now();
        for i in 0..iters {
            c.write(&dst.mem, dst_offset, &src.mem, src_offset, size)?;
            if (i + 1) % flush_every == 0 {
                c.flush(Duration::from_secs(30))?;
            }
        }
        c.flush(Duration::from_secs(30))?;
        Ok(t0.elapsed().as_secs_f64())
    })
    .py(py)
}
