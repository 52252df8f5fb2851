//! `Collectives`: AllReduce, AllGather, ReduceScatter and Broadcast of `mscclpp-collectives` on
//! raw device pointers and a raw stream, and the communicator's own lazily built instance that
//! the tensor methods (`Communicator.all_reduce`...) use.
//!
//! The raw-pointer calls are `unsafe` in Rust: the caller vouches that the pointers stay valid
//! until the stream passes the call. Python cannot vouch for that, so the calls check what can be
//! checked (the driver must know every pointer as device memory of this GPU, large enough for the
//! call, and aligned) and leave the lifetime to the caller, as every CUDA library does.

use std::sync::{Arc, Mutex};

use mscclpp::gpu::Stream;
use mscclpp_collectives::{Algorithm, CallOptions, Collective, Config, DataType, ReduceOp};
use pyo3::prelude::*;

use crate::comm::{Communicator, lock};
use crate::errors::{IntoPyResult, invalid, seconds, to_seconds};

pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<Collectives>()?;
    m.add_function(wrap_pyfunction!(pointer_device, m)?)?;
    m.add_function(wrap_pyfunction!(parse_dtype, m)?)?;
    m.add_function(wrap_pyfunction!(parse_op, m)?)?;
    m.add_function(wrap_pyfunction!(parse_algorithm, m)?)?;
    Ok(())
}

/// The GPU whose memory holds `nbytes` (at least 1) from `ptr`; `InvalidUsageError` (a
/// `ValueError`) when the driver does not know the range as device memory (host memory, a freed
/// or foreign pointer).
#[pyfunction]
#[pyo3(signature = (ptr, nbytes = 1))]
fn pointer_device(py: Python<'_>, ptr: u64, nbytes: u64) -> PyResult<u32> {
    mscclpp::gpu::check_device_range(ptr, nbytes.max(1), "memory").py(py)
}

/// The canonical name (`f32`, `f16`, `bf16`, `i32`, `u32`) of a data type name;
/// `InvalidUsageError` for an unknown one.
#[pyfunction]
fn parse_dtype(py: Python<'_>, name: &str) -> PyResult<&'static str> {
    Ok(dtype(py, name)?.name())
}

/// The canonical name (`sum`, `prod`, `min`, `max`, `avg`) of a reduction; `InvalidUsageError`
/// for an unknown one.
#[pyfunction]
fn parse_op(py: Python<'_>, name: &str) -> PyResult<&'static str> {
    Ok(op(py, name)?.name())
}

/// The algorithm (`allpair`, `packet`, `simple`) a name selects, MSCCL++'s names included;
/// `InvalidUsageError` for an unknown one.
#[pyfunction]
fn parse_algorithm(py: Python<'_>, name: &str) -> PyResult<&'static str> {
    Ok(name.parse::<Algorithm>().py(py)?.name())
}

fn dtype(py: Python<'_>, s: &str) -> PyResult<DataType> {
    s.parse().py(py)
}

fn op(py: Python<'_>, s: &str) -> PyResult<ReduceOp> {
    s.parse().py(py)
}

fn collective(py: Python<'_>, s: &str) -> PyResult<Collective> {
    match s.to_ascii_lowercase().replace('_', "").as_str() {
        "allreduce" => Ok(Collective::AllReduce),
        "allgather" => Ok(Collective::AllGather),
        "reducescatter" => Ok(Collective::ReduceScatter),
        "broadcast" => Ok(Collective::Broadcast),
        _ => Err(invalid(
            py,
            format!("unknown collective {s:?}: use all_reduce, all_gather, reduce_scatter or broadcast"),
        )),
    }
}

fn options(
    py: Python<'_>,
    algorithm: Option<&str>,
    blocks: Option<u32>,
    threads: Option<u32>,
    accumulate_f32: bool,
) -> PyResult<CallOptions> {
    let mut o = CallOptions::default().accumulate_f32(accumulate_f32);
    if let Some(a) = algorithm {
        o.algorithm = Some(a.parse::<Algorithm>().py(py)?);
    }
    if blocks == Some(0) || threads == Some(0) {
        return Err(invalid(py, "blocks and threads must be positive (or None for the selector's choice)"));
    }
    o.blocks = blocks;
    o.threads = threads;
    Ok(o)
}

/// Collectives over the ranks of a `Communicator`, one GPU per rank (ranks may share a GPU), on
/// raw device pointers and a raw `cudaStream_t`.
///
/// `Collectives(comm, device=0, timeout=30.0, tune=None, packet_bytes=None, simple_bytes=None)` is
/// a collective call: every rank makes it (it maps every peer's scratch over CUDA IPC, so all
/// ranks are on one host; and compiles the kernels once per process). Most code uses the tensor
/// methods of `Communicator` instead, which build one for the communicator on first use.
///
/// Calls are stream-ordered and capturable in a CUDA graph; every rank makes the same calls in
/// the same order. Every device wait is bounded by `timeout`: a rank that never arrives, or one
/// making a different call, makes the others' kernels stop, and `check()` (or the next call)
/// raises the error naming it; after that the object refuses further calls.
#[pyclass(frozen, module = "mscclpp_rs._native")]
pub(crate) struct Collectives {
    /// Dropped without the GIL (see `Drop`).
    pub(crate) inner: std::mem::ManuallyDrop<Arc<mscclpp_collectives::Collectives>>,
    timeout: f64,
}

impl Drop for Collectives {
    /// The last reference frees GPU memory, which waits for the GPU (a kernel still running ends
    /// by its timeout): without the GIL, so that other Python threads (ranks as threads of this
    /// process) can make the calls such a kernel waits for, instead of waiting behind this drop.
    fn drop(&mut self) {
        // SAFETY: `inner` is taken once, here, and never used again (the object is being
        // destroyed; no method can run on it any more).
        let inner = unsafe { std::mem::ManuallyDrop::take(&mut self.inner) };
        Python::attach(|py| py.detach(move || drop(inner)));
    }
}

impl Collectives {
    /// The configuration for these settings, and the timeout in seconds as kept.
    fn config(
        py: Python<'_>,
        device: u32,
        timeout: f64,
        tune: Option<bool>,
        packet_bytes: Option<u64>,
        simple_bytes: Option<u64>,
    ) -> PyResult<(Config, f64)> {
        let t = seconds(py, "timeout", timeout)?;
        let mut cfg = Config::new(device).timeout(t);
        if let Some(y) = tune {
            cfg = cfg.tune(y);
        }
        if let Some(n) = packet_bytes {
            cfg = cfg.packet_bytes(n);
        }
        if let Some(n) = simple_bytes {
            cfg = cfg.simple_bytes(n);
        }
        Ok((cfg, to_seconds(t)))
    }

    /// A borrowed wrapper of the caller's stream on this GPU.
    fn stream(&self, py: Python<'_>, raw: u64) -> PyResult<Stream> {
        // SAFETY: `raw` is a stream the caller created (its context is checked to be this GPU's
        // primary one, the CUDA runtime's, as torch's and CuPy's are), or 0 for the legacy
        // default stream; the wrapper
        // does not own it and lives only for this call. A stale handle is the caller's error, as
        // with any CUDA API taking a stream.
        unsafe { Stream::from_raw_checked(self.inner.device(), raw) }.py(py)
    }
}

#[pymethods]
impl Collectives {
    /// Builds the collectives of `comm` on GPU `device` (a collective call, GIL released).
    ///
    /// `timeout`: seconds a device wait may last before the call fails naming the peer
    /// (`float('inf')`: no limit). `tune`: time AllReduce plans at setup (default: on unless
    /// `MSCCLPP_COLLECTIVES_TUNE=0`). `packet_bytes`, `simple_bytes`: scratch sizes (8 MiB and
    /// 32 MiB by default).
    #[new]
    #[pyo3(signature = (comm, *, device = 0, timeout = 30.0, tune = None, packet_bytes = None, simple_bytes = None))]
    fn new(
        py: Python<'_>,
        comm: &Communicator,
        device: u32,
        timeout: f64,
        tune: Option<bool>,
        packet_bytes: Option<u64>,
        simple_bytes: Option<u64>,
    ) -> PyResult<Self> {
        let c = comm.comm(py)?;
        let (cfg, timeout) = Self::config(py, device, timeout, tune, packet_bytes, simple_bytes)?;
        let inner = py.detach(|| mscclpp_collectives::Collectives::new(&c, cfg)).py(py)?;
        Ok(Collectives { inner: std::mem::ManuallyDrop::new(Arc::new(inner)), timeout })
    }

    /// AllReduce of `count` elements of `dtype` from `send` into `recv` (equal for in place) on
    /// `stream` (a `cudaStream_t` value; 0: the legacy default stream).
    #[pyo3(signature = (send, recv, count, dtype, op = "sum", stream = 0, *, algorithm = None, blocks = None, threads = None, accumulate_f32 = false))]
    #[allow(clippy::too_many_arguments)]
    fn all_reduce(
        &self,
        py: Python<'_>,
        send: u64,
        recv: u64,
        count: usize,
        dtype: &str,
        op: &str,
        stream: u64,
        algorithm: Option<&str>,
        blocks: Option<u32>,
        threads: Option<u32>,
        accumulate_f32: bool,
    ) -> PyResult<()> {
        let (d, o) = (self::dtype(py, dtype)?, self::op(py, op)?);
        let opts = options(py, algorithm, blocks, threads, accumulate_f32)?;
        let s = self.stream(py, stream)?;
        let c = &self.inner;
        // SAFETY: the collectives check that the driver knows both ranges as device memory of
        // this GPU holding `count` elements; that they stay valid until the stream passes the
        // call is the caller's promise (documented).
        py.detach(|| unsafe { c.all_reduce(send, recv, count, d, o, &s, &opts) }).py(py)
    }

    /// AllGather: `count` elements from every rank's `send` into every rank's `recv` (`size` x
    /// `count` elements, in rank order). In place: `send == recv + rank * count * itemsize`.
    #[pyo3(signature = (send, recv, count, dtype, stream = 0, *, algorithm = None, blocks = None, threads = None))]
    #[allow(clippy::too_many_arguments)]
    fn all_gather(
        &self,
        py: Python<'_>,
        send: u64,
        recv: u64,
        count: usize,
        dtype: &str,
        stream: u64,
        algorithm: Option<&str>,
        blocks: Option<u32>,
        threads: Option<u32>,
    ) -> PyResult<()> {
        let d = self::dtype(py, dtype)?;
        let opts = options(py, algorithm, blocks, threads, false)?;
        let s = self.stream(py, stream)?;
        let c = &self.inner;
        // SAFETY: as in `all_reduce`, with `recv` holding `size * count` elements (checked).
        py.detach(|| unsafe { c.all_gather(send, recv, count, d, &s, &opts) }).py(py)
    }

    /// ReduceScatter: every rank's `send` holds `size` x `count` elements; rank r gets segment r
    /// of their reduction (`count` elements) in `recv`. In place: `recv == send + rank * count *
    /// itemsize`.
    #[pyo3(signature = (send, recv, count, dtype, op = "sum", stream = 0, *, algorithm = None, blocks = None, threads = None, accumulate_f32 = false))]
    #[allow(clippy::too_many_arguments)]
    fn reduce_scatter(
        &self,
        py: Python<'_>,
        send: u64,
        recv: u64,
        count: usize,
        dtype: &str,
        op: &str,
        stream: u64,
        algorithm: Option<&str>,
        blocks: Option<u32>,
        threads: Option<u32>,
        accumulate_f32: bool,
    ) -> PyResult<()> {
        let (d, o) = (self::dtype(py, dtype)?, self::op(py, op)?);
        let opts = options(py, algorithm, blocks, threads, accumulate_f32)?;
        let s = self.stream(py, stream)?;
        let c = &self.inner;
        // SAFETY: as in `all_reduce`, with `send` holding `size * count` elements (checked).
        py.detach(|| unsafe { c.reduce_scatter(send, recv, count, d, o, &s, &opts) }).py(py)
    }

    /// Broadcast of `count` elements from `root`'s `send` into every rank's `recv` (`send` is
    /// read on the root only; equal to `recv` for in place).
    #[pyo3(signature = (send, recv, count, dtype, root = 0, stream = 0, *, algorithm = None, blocks = None, threads = None))]
    #[allow(clippy::too_many_arguments)]
    fn broadcast(
        &self,
        py: Python<'_>,
        send: u64,
        recv: u64,
        count: usize,
        dtype: &str,
        root: usize,
        stream: u64,
        algorithm: Option<&str>,
        blocks: Option<u32>,
        threads: Option<u32>,
    ) -> PyResult<()> {
        let d = self::dtype(py, dtype)?;
        let opts = options(py, algorithm, blocks, threads, false)?;
        let s = self.stream(py, stream)?;
        let c = &self.inner;
        // SAFETY: as in `all_reduce`.
        py.detach(|| unsafe { c.broadcast(send, recv, count, d, root, &s, &opts) }).py(py)
    }

    /// `None` while no kernel of this rank reported an error; raises it otherwise
    /// (`MscclppTimeoutError` naming the rank that never arrived, `InvalidUsageError` naming the
    /// rank whose call differed, `RemoteError` after `abort()`). Does not wait.
    fn check(&self, py: Python<'_>) -> PyResult<()> {
        self.inner.check().py(py)
    }

    /// Waits (GIL released, at most `timeout` seconds) for `stream` to finish, then `check()`s.
    #[pyo3(signature = (stream = 0, timeout = 30.0))]
    fn synchronize(&self, py: Python<'_>, stream: u64, timeout: f64) -> PyResult<()> {
        let t = seconds(py, "timeout", timeout)?;
        let s = self.stream(py, stream)?;
        let c = &self.inner;
        py.detach(|| c.synchronize(&s, t)).py(py)
    }

    /// Makes every running and future kernel of this rank stop waiting and fail (within about a
    /// millisecond); later calls raise.
    fn abort(&self, py: Python<'_>) -> PyResult<()> {
        self.inner.abort().py(py)
    }

    /// Whether a kernel of this rank reported an error, or `abort()` was called.
    #[getter]
    fn failed(&self) -> bool {
        self.inner.has_failed()
    }

    /// The plan for a call: `(algorithm, blocks, threads)`. `collective`: `"all_reduce"`,
    /// `"all_gather"`, `"reduce_scatter"` or `"broadcast"`; `nbytes`: the bytes of one rank's
    /// buffer (AllReduce, Broadcast) or of one rank's segment (AllGather, ReduceScatter).
    #[pyo3(signature = (collective, nbytes, *, algorithm = None, blocks = None, threads = None))]
    fn plan(
        &self,
        py: Python<'_>,
        collective: &str,
        nbytes: u64,
        algorithm: Option<&str>,
        blocks: Option<u32>,
        threads: Option<u32>,
    ) -> PyResult<(&'static str, u32, u32)> {
        let c = self::collective(py, collective)?;
        let opts = options(py, algorithm, blocks, threads, false)?;
        let p = self.inner.plan(c, nbytes, &opts).py(py)?;
        Ok((p.algorithm.name(), p.blocks, p.threads))
    }

    /// The AllReduce plans chosen by setup-time tuning, `[(bytes, algorithm, blocks, threads,
    /// microseconds)]` by increasing size (a call uses the first entry at least as large), or
    /// `None` when not tuned.
    #[getter]
    #[allow(clippy::type_complexity)]
    fn tuning(&self) -> Option<Vec<(u64, &'static str, u32, u32, f32)>> {
        self.inner.tuning().map(|t| {
            t.entries
                .iter()
                .zip(t.micros.iter().copied().chain(std::iter::repeat(f32::NAN)))
                .map(|((b, p), us)| (*b, p.algorithm.name(), p.blocks, p.threads, us))
                .collect()
        })
    }

    /// GPU memory this rank's scratch takes, bytes.
    #[getter]
    fn scratch_bytes(&self) -> u64 {
        self.inner.scratch_bytes()
    }

    /// The most blocks a call launches per rank (capped so that every rank sharing a GPU is
    /// resident at once).
    #[getter]
    fn max_blocks(&self) -> u32 {
        self.inner.limits().max_blocks
    }

    /// This rank.
    #[getter]
    fn rank(&self) -> usize {
        self.inner.rank()
    }

    /// The number of ranks.
    #[getter]
    fn size(&self) -> usize {
        self.inner.size()
    }

    /// The GPU.
    #[getter]
    fn device(&self) -> u32 {
        self.inner.device()
    }

    /// The device wait limit, seconds.
    #[getter]
    fn timeout(&self) -> f64 {
        self.timeout
    }

    fn __repr__(&self) -> String {
        format!(
            "Collectives(rank={}, size={}, device={}, scratch_bytes={})",
            self.inner.rank(),
            self.inner.size(),
            self.inner.device(),
            self.inner.scratch_bytes()
        )
    }
}

/// The communicator's own `Collectives`, built on first use.
#[derive(Default)]
pub(crate) struct Lazy {
    /// The Python object, once built (locked only briefly, with the GIL held).
    obj: Mutex<Option<Py<Collectives>>>,
    /// The collectives and their timeout; locked without the GIL while building (which waits
    /// for the other ranks), so a second thread waits for the first's and takes it.
    built: Mutex<Option<(Arc<mscclpp_collectives::Collectives>, f64)>>,
}

impl Lazy {
    /// The communicator's collectives, built with these settings if there are none yet (every
    /// rank must then make this call).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn get(
        &self,
        py: Python<'_>,
        comm: &Communicator,
        device: u32,
        timeout: f64,
        tune: Option<bool>,
        packet_bytes: Option<u64>,
        simple_bytes: Option<u64>,
    ) -> PyResult<Py<Collectives>> {
        if let Some(c) = lock(&self.obj).as_ref() {
            return Ok(c.clone_ref(py));
        }
        let c = comm.comm(py)?;
        let (cfg, t) = Collectives::config(py, device, timeout, tune, packet_bytes, simple_bytes)?;
        let (inner, timeout) = py
            .detach(|| -> mscclpp::Result<_> {
                let mut g = lock(&self.built);
                if let Some(b) = g.as_ref() {
                    return Ok(b.clone());
                }
                let b = (Arc::new(mscclpp_collectives::Collectives::new(&c, cfg)?), t);
                *g = Some(b.clone());
                Ok(b)
            })
            .py(py)?;
        let mut o = lock(&self.obj);
        if let Some(c) = o.as_ref() {
            return Ok(c.clone_ref(py));
        }
        let made = Py::new(py, Collectives { inner: std::mem::ManuallyDrop::new(inner), timeout })?;
        *o = Some(made.clone_ref(py));
        Ok(made)
    }

    /// The collectives if built.
    pub(crate) fn peek(&self, py: Python<'_>) -> Option<Py<Collectives>> {
        lock(&self.obj).as_ref().map(|c| c.clone_ref(py))
    }

    /// Takes them (on `close()`): the caller drops them without the GIL.
    #[allow(clippy::type_complexity)]
    pub(crate) fn take(&self) -> (Option<Py<Collectives>>, Option<(Arc<mscclpp_collectives::Collectives>, f64)>) {
        (lock(&self.obj).take(), lock(&self.built).take())
    }
}
