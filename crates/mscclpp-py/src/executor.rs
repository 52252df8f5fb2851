//! `ExecutionPlan` and `Executor`: MSCCL++ execution plans (the JSON its DSL writes) run by
//! `mscclpp-executor`, on raw device pointers and a raw stream. The tensor side (torch tensors,
//! torch streams, MSCCL++'s argument names) is `mscclpp_rs/_executor.py`.

use std::sync::Arc;

use mscclpp::gpu::Stream;
use mscclpp_executor::{
    DataType, DeviceFailureKind, ExecError, ExecutorConfig, KernelKind, PacketType, PlanError, generate,
};
use pyo3::prelude::*;

use crate::comm::Communicator;
use crate::errors::{invalid, seconds, to_py};

pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<ExecutionPlan>()?;
    m.add_class::<Executor>()?;
    m.add_function(wrap_pyfunction!(generate_plan, m)?)?;
    Ok(())
}

/// A `PlanError` (an `InvalidUsageError`, so also a `ValueError`) with `path`: the JSON path of
/// the offending field, or `None`.
fn plan_error(py: Python<'_>, msg: String, path: Option<&str>, errno: Option<i32>) -> PyErr {
    let build = || -> PyResult<PyErr> {
        let cls = py.import("mscclpp_rs._errors")?.getattr("PlanError")?;
        let exc = cls.call1((msg.clone(),))?;
        exc.setattr("kind", py.import("mscclpp_rs._types")?.getattr("ErrorKind")?.getattr("INVALID_USAGE")?)?;
        exc.setattr("path", path)?;
        if let Some(n) = errno {
            exc.setattr("errno", n)?;
        }
        Ok(PyErr::from_value(exc))
    };
    build().unwrap_or_else(|_| pyo3::exceptions::PyValueError::new_err(msg.clone()))
}

fn from_plan_error(py: Python<'_>, e: &PlanError) -> PyErr {
    let errno = match e {
        PlanError::Io { source, .. } => source.raw_os_error(),
        _ => None,
    };
    plan_error(py, e.to_string(), e.path(), errno)
}

/// The Python exception for an execution error: plan and lowering errors as `PlanError`;
/// a kernel's failure by kind (a timeout as `MscclppTimeoutError`, an abort or a refused
/// re-run as `AbortedError`, a failed proxy as `RemoteError`) with `peer`, `block`, `op`,
/// `launch`, `signals_seen` and `signals_needed`;
/// core errors as everywhere else.
pub(crate) fn exec_to_py(py: Python<'_>, e: &ExecError) -> PyErr {
    match e {
        ExecError::Plan(p) => from_plan_error(py, p),
        ExecError::Lower(l) => plan_error(py, e.to_string(), l.path(), None),
        ExecError::Mscclpp(m) => to_py(py, m),
        ExecError::Device { kind, peer, block, op, counts, launch, .. } => {
            let (class, kname) = match kind {
                DeviceFailureKind::Timeout => ("MscclppTimeoutError", "TIMEOUT"),
                DeviceFailureKind::Proxy => ("RemoteError", "REMOTE"),
                _ => ("AbortedError", "ABORTED"),
            };
            let build = || -> PyResult<PyErr> {
                let exc = py.import("mscclpp_rs._errors")?.getattr(class)?.call1((e.to_string(),))?;
                exc.setattr("kind", py.import("mscclpp_rs._types")?.getattr("ErrorKind")?.getattr(kname)?)?;
                exc.setattr("operation", "execute")?;
                exc.setattr("peer", *peer)?;
                exc.setattr("block", *block)?;
                exc.setattr("op", *op)?;
                // The launch of these resources the block was in, and for a semaphore wait the
                // signals that had arrived and the count it needed (None when unknown).
                exc.setattr("launch", (*launch != 0).then_some(*launch))?;
                exc.setattr("signals_seen", (counts.1 != 0).then_some(counts.0))?;
                exc.setattr("signals_needed", (counts.1 != 0).then_some(counts.1))?;
                Ok(PyErr::from_value(exc))
            };
            build().unwrap_or_else(|_| pyo3::exceptions::PyRuntimeError::new_err(e.to_string()))
        }
        _ => pyo3::exceptions::PyRuntimeError::new_err(e.to_string()),
    }
}

trait ExecPy<T> {
    fn py(self, py: Python<'_>) -> PyResult<T>;
}

impl<T> ExecPy<T> for Result<T, ExecError> {
    fn py(self, py: Python<'_>) -> PyResult<T> {
        self.map_err(|e| exec_to_py(py, &e))
    }
}

/// An MSCCL++ execution plan, loaded and validated (MSCCL++'s `ExecutionPlan(path)`).
///
/// `ExecutionPlan(path)` reads the JSON file; `ExecutionPlan.from_json(text)` parses text. A plan
/// that cannot run raises `PlanError` (a `ValueError`) whose `path` names the offending field,
/// such as `gpus[1].threadblocks[0].ops[3].src_buff[0].index`.
#[pyclass(frozen, module = "mscclpp_rs._native")]
pub(crate) struct ExecutionPlan {
    inner: mscclpp_executor::ExecutionPlan,
}

#[pymethods]
impl ExecutionPlan {
    #[new]
    fn new(py: Python<'_>, path: std::path::PathBuf) -> PyResult<Self> {
        let inner =
            py.detach(|| mscclpp_executor::ExecutionPlan::from_file(&path)).map_err(|e| from_plan_error(py, &e))?;
        Ok(ExecutionPlan { inner })
    }

    /// Parses and validates plan JSON text.
    #[staticmethod]
    fn from_json(py: Python<'_>, text: &str) -> PyResult<Self> {
        let plan = mscclpp_executor::Plan::from_json_str(text).map_err(|e| from_plan_error(py, &e))?;
        Ok(ExecutionPlan { inner: mscclpp_executor::ExecutionPlan::new(plan) })
    }

    /// The plan's `name`.
    #[getter]
    fn name(&self) -> &str {
        self.inner.name()
    }

    /// The plan's `collective` (`allreduce`, `allgather`, ...).
    #[getter]
    fn collective(&self) -> &str {
        self.inner.collective()
    }

    /// `"Simple"` or `"LL"`.
    #[getter]
    fn protocol(&self) -> &'static str {
        match self.inner.plan().protocol {
            mscclpp_executor::Protocol::Simple => "Simple",
            _ => "LL",
        }
    }

    /// Whether the output buffer is the input buffer.
    #[getter]
    fn inplace(&self) -> bool {
        self.inner.plan().inplace
    }

    /// The number of ranks the plan is written for.
    #[getter]
    fn world_size(&self) -> usize {
        self.inner.plan().gpus.len()
    }

    /// The smallest message (bytes) the plan accepts.
    #[getter]
    fn min_message_size(&self) -> u64 {
        self.inner.plan().min_message_size
    }

    /// The largest message (bytes) the plan accepts (2**64 - 1: no limit).
    #[getter]
    fn max_message_size(&self) -> u64 {
        self.inner.plan().max_message_size
    }

    /// Threads per block.
    #[getter]
    fn num_threads_per_block(&self) -> u32 {
        self.inner.plan().num_threads_per_block
    }

    /// What the plan holds (ranks, thread blocks, operations by type, channels), as
    /// `mscclpp-perf --plan FILE --dry-run` prints it.
    fn summary(&self) -> String {
        self.inner.plan().summary().to_string()
    }

    /// The plan as JSON in MSCCL++'s schema.
    fn to_json(&self) -> String {
        self.inner.plan().to_json()
    }

    fn __repr__(&self) -> String {
        format!(
            "ExecutionPlan(name={:?}, collective={:?}, world_size={}, protocol={:?}, inplace={})",
            self.inner.name(),
            self.inner.collective(),
            self.world_size(),
            self.protocol(),
            self.inplace()
        )
    }
}

/// JSON text of a plan this library generates: `algorithm` one of `allpair_allreduce`,
/// `ring_allreduce`, `allgather`, `reducescatter`, `hierarchical_allreduce`; `ranks` 2..8;
/// `protocol` `"Simple"` or `"LL"`. For tests and examples.
#[pyfunction]
#[pyo3(signature = (algorithm, ranks, protocol = "LL", inplace = false))]
fn generate_plan(py: Python<'_>, algorithm: &str, ranks: usize, protocol: &str, inplace: bool) -> PyResult<String> {
    let a = match algorithm.to_ascii_lowercase().replace(['-', ' '], "_").as_str() {
        "allpair_allreduce" | "allpair" => generate::Algorithm::AllPairAllReduce,
        "ring_allreduce" | "ring" => generate::Algorithm::RingAllReduce,
        "allgather" | "all_gather" => generate::Algorithm::AllGather,
        "reducescatter" | "reduce_scatter" => generate::Algorithm::ReduceScatter,
        "hierarchical_allreduce" | "hierarchical" => generate::Algorithm::HierarchicalAllReduce,
        _ => {
            return Err(invalid(
                py,
                format!(
                    "unknown plan algorithm {algorithm:?}: use allpair_allreduce, ring_allreduce, allgather, reducescatter or hierarchical_allreduce"
                ),
            ));
        }
    };
    let p = match protocol.to_ascii_lowercase().as_str() {
        "ll" => mscclpp_executor::Protocol::LL,
        "simple" => mscclpp_executor::Protocol::Simple,
        _ => return Err(invalid(py, format!("unknown protocol {protocol:?}: use \"Simple\" or \"LL\""))),
    };
    generate::plan(a, ranks, p, inplace).map(|p| p.to_json()).ok_or_else(|| {
        invalid(py, format!("no {algorithm} plan for {ranks} ranks (2..8; hierarchical: even and at least 4)"))
    })
}

fn dtype(py: Python<'_>, s: &str) -> PyResult<DataType> {
    match s.to_ascii_lowercase().as_str() {
        "f32" | "float32" | "float" => Ok(DataType::Float32),
        "f16" | "float16" | "half" => Ok(DataType::Float16),
        "bf16" | "bfloat16" => Ok(DataType::Bfloat16),
        "i32" | "int32" => Ok(DataType::Int32),
        "u32" | "uint32" => Ok(DataType::Uint32),
        _ => Err(invalid(py, format!("unknown data type {s:?}: use float32, float16, bfloat16, int32 or uint32"))),
    }
}

fn packet_type(py: Python<'_>, s: &str) -> PyResult<PacketType> {
    match s.to_ascii_lowercase().as_str() {
        "ll16" => Ok(PacketType::LL16),
        "ll8" => Ok(PacketType::LL8),
        _ => Err(invalid(py, format!("unknown packet type {s:?}: use LL16 or LL8"))),
    }
}

/// Runs execution plans on this rank's GPU, on raw device pointers and a raw `cudaStream_t`
/// (most code uses `mscclpp_rs.Executor`, which takes tensors and torch streams).
///
/// `Executor(comm, device=0, timeout=30.0, port_transport="cuda_ipc")`. Every rank builds one and
/// makes the same `execute` calls in the same order; the first call for a (plan, buffers) is
/// collective (it connects channels, exchanges buffers and builds the device program) and must
/// not be inside a CUDA-graph capture; later ones only launch and can be captured.
#[pyclass(frozen, module = "mscclpp_rs._native")]
pub(crate) struct Executor {
    /// Dropped without the GIL (see `Drop`).
    inner: std::mem::ManuallyDrop<Arc<mscclpp_executor::Executor>>,
    device: u32,
    timeout: f64,
}

impl Drop for Executor {
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

impl Executor {
    fn stream(&self, py: Python<'_>, raw: u64) -> PyResult<Stream> {
        // SAFETY: `raw` is a stream the caller created (its context is checked to be this GPU's
        // primary one, the CUDA runtime's, as torch's is), or 0 for the legacy default stream;
        // the wrapper does not own it and lives only for this call.
        unsafe { Stream::from_raw_checked(self.device, raw) }.map_err(|e| to_py(py, &e))
    }
}

#[pymethods]
impl Executor {
    #[new]
    #[pyo3(signature = (comm, *, device = 0, timeout = 30.0, port_transport = "cuda_ipc", kernel = None))]
    fn new(
        py: Python<'_>,
        comm: &Communicator,
        device: u32,
        timeout: f64,
        port_transport: &str,
        kernel: Option<&str>,
    ) -> PyResult<Self> {
        let c = comm.comm(py)?;
        let t = seconds(py, "timeout", timeout)?;
        let transport = match port_transport.to_ascii_lowercase().replace('-', "_").as_str() {
            "cuda_ipc" | "cudaipc" => mscclpp::Transport::CudaIpc,
            "ethernet" => mscclpp::Transport::Ethernet,
            _ => {
                return Err(invalid(
                    py,
                    format!("port_transport {port_transport:?}: use \"cuda_ipc\" or \"ethernet\""),
                ));
            }
        };
        let mut cfg = ExecutorConfig::new(device).timeout(t).port_transport(transport);
        if let Some(k) = kernel {
            let Some(kind) = KernelKind::from_name(k) else {
                return Err(invalid(py, format!("kernel {k:?}: use \"interpreter\" or \"per-plan\"")));
            };
            cfg = cfg.kernel(kind);
        }
        Ok(Executor {
            inner: std::mem::ManuallyDrop::new(Arc::new(mscclpp_executor::Executor::new(&c, cfg))),
            device,
            timeout: crate::errors::to_seconds(t),
        })
    }

    /// Runs `plan` on `send` (`send_size` bytes) into `recv` (`recv_size` bytes) on `stream`
    /// (MSCCL++'s `Executor.execute`). `dtype`: `float32`, `float16`, `bfloat16`, `int32`,
    /// `uint32` (or `f32`...); `packet_type`: `"LL16"` or `"LL8"`.
    ///
    /// The buffers must be device memory of this GPU and stay allocated while this executor
    /// lives: peers map them on the first call and later calls reuse the mapping.
    #[pyo3(signature = (rank, send, recv, send_size, recv_size, dtype, plan, stream = 0, packet_type = "LL16"))]
    #[allow(clippy::too_many_arguments)]
    fn execute(
        &self,
        py: Python<'_>,
        rank: usize,
        send: u64,
        recv: u64,
        send_size: u64,
        recv_size: u64,
        dtype: &str,
        plan: &ExecutionPlan,
        stream: u64,
        packet_type: &str,
    ) -> PyResult<()> {
        let (d, p) = (self::dtype(py, dtype)?, self::packet_type(py, packet_type)?);
        let (ex, pl) = (&self.inner, &plan.inner);
        let device = self.device;
        // One detach: the build first (a cache lookup once built): its checks of the rank, the
        // plan's size and the buffers meet every rank, so a rank that gets one wrong fails all
        // of them at once, named, even where this rank could not go on to the stream.
        py.detach(|| -> Result<(), ExecError> {
            // SAFETY: on the first call for these buffers the executor checks with the driver
            // that both ranges are device memory of this GPU; that they stay allocated while the
            // executor lives and valid until the stream passes the call is the caller's promise
            // (documented), as with every CUDA library taking raw pointers.
            unsafe { ex.prepare(rank, send, recv, send_size, recv_size, pl) }?;
            // SAFETY: `stream` is a stream the caller created on this GPU's primary context (the
            // CUDA runtime's, as torch's is), or 0 for the legacy default stream; the wrapper does
            // not own it and lives only for this call.
            let s = unsafe { Stream::from_raw_checked(device, stream) }?;
            // SAFETY: as for `prepare` above.
            unsafe { ex.execute(rank, send, recv, send_size, recv_size, d, pl, &s, p) }
        })
        .py(py)
    }

    /// Builds the resources of `plan` for these buffers (a collective call) without running it.
    #[pyo3(signature = (rank, send, recv, send_size, recv_size, plan))]
    #[allow(clippy::too_many_arguments)]
    fn prepare(
        &self,
        py: Python<'_>,
        rank: usize,
        send: u64,
        recv: u64,
        send_size: u64,
        recv_size: u64,
        plan: &ExecutionPlan,
    ) -> PyResult<()> {
        let (ex, pl) = (&self.inner, &plan.inner);
        // SAFETY: as in `execute`.
        py.detach(|| unsafe { ex.prepare(rank, send, recv, send_size, recv_size, pl) }).py(py)
    }

    /// `None` while no kernel of this rank reported an error; raises it otherwise (naming the
    /// peer waited for, the thread block and the operation). Does not wait.
    fn check(&self, py: Python<'_>) -> PyResult<()> {
        self.inner.check().py(py)
    }

    /// Waits (GIL released, at most `timeout` seconds) for `stream`, then `check()`s.
    #[pyo3(signature = (stream = 0, timeout = 30.0))]
    fn synchronize(&self, py: Python<'_>, stream: u64, timeout: f64) -> PyResult<()> {
        let t = seconds(py, "timeout", timeout)?;
        let s = self.stream(py, stream)?;
        let ex = &self.inner;
        py.detach(|| ex.synchronize(&s, t)).py(py)
    }

    /// Makes every running and later kernel of this executor stop waiting and fail.
    fn abort(&self, py: Python<'_>) -> PyResult<()> {
        self.inner.abort().py(py)
    }

    /// This rank.
    #[getter]
    fn rank(&self) -> usize {
        self.inner.rank()
    }

    /// The GPU.
    #[getter]
    fn device(&self) -> u32 {
        self.device
    }

    /// The device wait limit, seconds.
    #[getter]
    fn timeout(&self) -> f64 {
        self.timeout
    }

    fn __repr__(&self) -> String {
        format!("Executor(rank={}, device={}, timeout={})", self.inner.rank(), self.device, self.timeout)
    }
}
