//! Host API: `UniqueId` and `Communicator` (connections and semaphores: `connection.rs`).

use std::sync::{Arc, Mutex, MutexGuard};

use mscclpp::launcher::LaunchInfo;
use mscclpp::{Bootstrap, Device, EndpointConfig, ErrorKind, EthernetConfig, TcpBootstrap, Transport};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyTuple};

use crate::connection::{Connection, Host2DeviceSemaphore, Host2HostSemaphore};
use crate::errors::{IntoPyResult, invalid, seconds, to_py, to_seconds};
use crate::memory::{RegisteredMemory, one_transport, register_object, transport_flags};

pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<UniqueId>()?;
    m.add_class::<Communicator>()?;
    m.add("UNIQUE_ID_BYTES", mscclpp::UniqueId::BYTES)?;
    crate::connection::register(m)?;
    Ok(())
}

/// A lock that survives a panicking holder (the data are plain lists).
pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// What a job's ranks share to find each other: the root's address and a random secret.
///
/// Create it on one process (`UniqueId.create()`), send `bytes(uid)` (128 bytes) to every rank by
/// any means (`torch.distributed.broadcast_object_list`, mpi4py, a file), and pass it to
/// `Communicator(rank, size, uid)`. Pickles as its bytes; hashable (equal ids hash equal).
#[pyclass(frozen, eq, module = "mscclpp_rs._native")]
#[derive(Clone, PartialEq)]
pub(crate) struct UniqueId {
    pub(crate) id: mscclpp::UniqueId,
}

#[pymethods]
impl UniqueId {
    /// From the bytes of `bytes(uid)` (or its text form `str(uid)`).
    #[new]
    fn new(py: Python<'_>, data: &Bound<'_, PyAny>) -> PyResult<UniqueId> {
        if let Ok(s) = data.extract::<String>() {
            return Ok(UniqueId { id: s.parse().py(py)? });
        }
        let b: Vec<u8> = match data.extract::<Vec<u8>>() {
            Ok(b) if !data.is_instance_of::<pyo3::types::PyList>() => b,
            _ => {
                return Err(pyo3::exceptions::PyTypeError::new_err(format!(
                    "a UniqueId is made from bytes or str, not {}",
                    data.get_type().name()?
                )));
            }
        };
        Ok(UniqueId { id: mscclpp::UniqueId::from_bytes(&b).py(py)? })
    }

    /// A fresh id whose root will be rank 0 of this process (its port is reserved now).
    #[staticmethod]
    fn create(py: Python<'_>) -> PyResult<UniqueId> {
        Ok(UniqueId { id: py.detach(TcpBootstrap::create_unique_id).py(py)? })
    }

    /// The 128 bytes every rank passes to `Communicator` (also `bytes(uid)`).
    fn to_bytes<'py>(&self, py: Python<'py>) -> Bound<'py, PyBytes> {
        PyBytes::new(py, &self.id.to_bytes())
    }

    /// The id of `to_bytes()` output; `InvalidUsageError` for anything else.
    #[staticmethod]
    fn from_bytes(py: Python<'_>, data: &[u8]) -> PyResult<UniqueId> {
        Ok(UniqueId { id: mscclpp::UniqueId::from_bytes(data).py(py)? })
    }

    fn __bytes__<'py>(&self, py: Python<'py>) -> Bound<'py, PyBytes> {
        self.to_bytes(py)
    }

    fn __hash__(&self) -> u64 {
        use std::hash::{Hash, Hasher};
        let mut h = std::collections::hash_map::DefaultHasher::new();
        self.id.to_bytes().hash(&mut h);
        h.finish()
    }

    fn __str__(&self) -> String {
        self.id.to_string()
    }

    fn __repr__(&self) -> String {
        format!("UniqueId(root={})", self.id.root_addr())
    }

    /// `"host:port"` of the root.
    #[getter]
    fn root_addr(&self) -> String {
        self.id.root_addr().to_string()
    }

    fn __reduce__<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyTuple>> {
        let cls = py.get_type::<UniqueId>();
        PyTuple::new(py, [cls.into_any(), PyTuple::new(py, [PyBytes::new(py, &self.id.to_bytes())])?.into_any()])
    }
}

/// The ranks of a job, connected through a TCP bootstrap: registration, memory exchange,
/// connections, semaphores and a barrier.
///
/// `Communicator(rank, size, unique_id, timeout=30.0)` joins the job of `unique_id`;
/// `Communicator.from_env()` joins from launcher variables. Every call that waits releases the GIL.
///
/// Every `timeout` in this module is in seconds: `0` answers at once (`MscclppTimeoutError` when
/// the answer is not already there), `float('inf')` means no limit, and a negative number or NaN
/// raises `InvalidUsageError` (a `ValueError`).
#[pyclass(frozen, module = "mscclpp_rs._native")]
pub(crate) struct Communicator {
    /// The communicator and its bootstrap; `None` once closed.
    state: Mutex<Option<(mscclpp::Communicator, Arc<TcpBootstrap>)>>,
    rank: usize,
    size: usize,
    /// The collectives the tensor methods use, built on first use.
    collectives: crate::collectives::Lazy,
}

/// The `AbortedError` of an object used after `close()`.
pub(crate) fn closed_error(py: Python<'_>, what: &str) -> PyErr {
    to_py(py, &mscclpp::Error::new(ErrorKind::Aborted, format!("this {what} is closed")))
}

impl Communicator {
    fn from_bootstrap(bs: TcpBootstrap) -> Communicator {
        let bs = Arc::new(bs);
        let (rank, size) = (bs.rank(), bs.size());
        Communicator {
            state: Mutex::new(Some((mscclpp::Communicator::new(bs.clone()), bs))),
            rank,
            size,
            collectives: Default::default(),
        }
    }

    /// The communicator (a cheap clone), or `AbortedError` once closed.
    pub(crate) fn comm(&self, py: Python<'_>) -> PyResult<mscclpp::Communicator> {
        lock(&self.state).as_ref().map(|(c, _)| c.clone()).ok_or_else(|| closed_error(py, "communicator"))
    }

    /// The bootstrap, or `AbortedError` once closed.
    fn bs(&self, py: Python<'_>) -> PyResult<Arc<TcpBootstrap>> {
        lock(&self.state).as_ref().map(|(_, b)| b.clone()).ok_or_else(|| closed_error(py, "communicator"))
    }

    fn check_peer(&self, py: Python<'_>, peer: usize) -> PyResult<()> {
        if peer >= self.size {
            return Err(invalid(py, format!("peer rank {peer} is not in 0..{}", self.size)));
        }
        Ok(())
    }

    fn endpoint_config(
        py: Python<'_>,
        transport: &Bound<'_, PyAny>,
        device: Option<u32>,
        interface: Option<String>,
        max_write_queue_size: Option<usize>,
    ) -> PyResult<EndpointConfig> {
        let t = one_transport(py, transport)?;
        let mut cfg = EndpointConfig::new(t);
        if let Some(d) = device {
            cfg = cfg.device(Device::Gpu(d));
        } else if t == Transport::CudaIpc {
            cfg = cfg.device(Device::Gpu(0));
        }
        if let Some(i) = interface {
            cfg = cfg.ethernet(EthernetConfig::default().interface(i));
        }
        if let Some(q) = max_write_queue_size {
            cfg = cfg.max_write_queue_size(q);
        }
        Ok(cfg)
    }
}

#[pymethods]
impl Communicator {
    /// Joins the job of `unique_id` (a `UniqueId`, its bytes or text) as `rank` of `size`;
    /// `timeout` (seconds) bounds every later bootstrap wait too.
    #[new]
    #[pyo3(signature = (rank, size, unique_id, timeout = 30.0))]
    fn new(py: Python<'_>, rank: usize, size: usize, unique_id: &Bound<'_, PyAny>, timeout: f64) -> PyResult<Self> {
        let id = match unique_id.cast::<UniqueId>() {
            Ok(u) => u.get().id.clone(),
            Err(_) => UniqueId::new(py, unique_id)?.id,
        };
        if rank >= size {
            return Err(invalid(py, format!("rank {rank} is not below size {size}")));
        }
        let t = seconds(py, "timeout", timeout)?;
        let bs = py.detach(|| TcpBootstrap::config(rank, size).timeout(t).initialize(&id)).py(py)?;
        Ok(Self::from_bootstrap(bs))
    }

    /// Joins from launcher variables by `mscclpp::launcher`'s rules (the same as Rust programs and
    /// `mscclpp-perf`): the rank and size from torchrun's `RANK/WORLD_SIZE` (with
    /// `TORCHELASTIC_RUN_ID`), `OMPI_COMM_WORLD_RANK/SIZE`, `PMI_RANK/SIZE`, `SLURM_PROCID/NTASKS`
    /// or plain `RANK/WORLD_SIZE`; the root from `unique_id` if given, else `MSCCLPP_ROOT_ADDR`,
    /// else `MASTER_ADDR` with `MSCCLPP_ROOT_PORT`, or `MASTER_PORT + 1` under torchrun (its agent's
    /// store holds `MASTER_PORT`), or `MASTER_PORT` (rank 0 listens there).
    #[staticmethod]
    #[pyo3(signature = (unique_id = None, timeout = 30.0))]
    fn from_env(py: Python<'_>, unique_id: Option<&Bound<'_, PyAny>>, timeout: f64) -> PyResult<Self> {
        let t = seconds(py, "timeout", timeout)?;
        let Some(info) = LaunchInfo::from_env().py(py)? else {
            return Err(invalid(
                py,
                "no launcher variables: set RANK and WORLD_SIZE (or run under mpirun, srun or torchrun)",
            ));
        };
        if let Some(u) = unique_id {
            return Self::new(py, info.rank, info.size, u, timeout);
        }
        let bs = py.detach(|| info.bootstrap(t)).py(py)?;
        Ok(Self::from_bootstrap(bs))
    }

    /// This process's rank.
    #[getter]
    fn rank(&self) -> usize {
        self.rank
    }

    /// The number of ranks.
    #[getter]
    fn size(&self) -> usize {
        self.size
    }

    /// Ranks on this host.
    #[getter]
    fn ranks_per_node(&self, py: Python<'_>) -> PyResult<usize> {
        Ok(self.bs(py)?.ranks_per_node())
    }

    /// The bootstrap's wait limit in seconds (settable; `float('inf')`: no limit).
    #[getter]
    fn get_timeout(&self, py: Python<'_>) -> PyResult<f64> {
        Ok(to_seconds(self.bs(py)?.timeout()))
    }

    #[setter]
    fn set_timeout(&self, py: Python<'_>, timeout: f64) -> PyResult<()> {
        self.bs(py)?.set_timeout(seconds(py, "timeout", timeout)?);
        Ok(())
    }

    /// Waits until every rank has called `barrier` (GIL released).
    fn barrier(&self, py: Python<'_>) -> PyResult<()> {
        let bs = self.bs(py)?;
        py.detach(|| bs.barrier()).py(py)
    }

    /// Two uses, told apart by `data`:
    ///
    /// * bytes (`bytes`, `bytearray`, `memoryview`): every rank's bytes, in rank order, through
    ///   the bootstrap (GIL released; any sizes; returns a list of `bytes`);
    /// * a GPU tensor or array: AllGather on the GPU into `out` (`size` times `data`'s elements,
    ///   rank r's at the r-th place; allocated like `data` when `None`, torch tensors only), on the
    ///   current stream; returns `out`. See `all_reduce` for the rules.
    #[pyo3(signature = (data, out = None, *, algorithm = None, blocks = None, threads = None, stream = None))]
    #[allow(clippy::too_many_arguments)]
    fn all_gather<'py>(
        slf: &Bound<'py, Self>,
        py: Python<'py>,
        data: &Bound<'py, PyAny>,
        out: Option<&Bound<'py, PyAny>>,
        algorithm: Option<&Bound<'py, PyAny>>,
        blocks: Option<u32>,
        threads: Option<u32>,
        stream: Option<&Bound<'py, PyAny>>,
    ) -> PyResult<Bound<'py, PyAny>> {
        use pyo3::types::{PyByteArray, PyList, PyMemoryView};
        let is_bytes = data.is_instance_of::<PyBytes>()
            || data.is_instance_of::<PyByteArray>()
            || data.is_instance_of::<PyMemoryView>();
        if !is_bytes {
            return tensor_call(py, "all_gather", (slf, data, out, algorithm, blocks, threads, stream));
        }
        if out.is_some() || algorithm.is_some() || blocks.is_some() || threads.is_some() || stream.is_some() {
            return Err(invalid(py, "all_gather of bytes takes no out, algorithm, blocks, threads or stream"));
        }
        let data: Vec<u8> = data.extract()?;
        let bs = slf.get().bs(py)?;
        let all = py.detach(|| bs.all_gather(&data)).py(py)?;
        Ok(PyList::new(py, all.iter().map(|b| PyBytes::new(py, b)))?.into_any())
    }

    /// AllReduce of a GPU tensor (torch, or anything with `__cuda_array_interface__`) across the
    /// ranks, in place when `out` is `None` (else into `out`: same type and element count);
    /// returns the tensor written. `op`: `"sum"`, `"prod"`, `"min"`, `"max"`, `"avg"`.
    ///
    /// Runs on `stream` (an int `cudaStream_t`, or an object with `.cuda_stream`), else on the
    /// array's own `stream` (`__cuda_array_interface__`), else torch's current stream when torch
    /// is imported, else the legacy default stream. Contiguous f32/f16/bf16/i32/u32 only.
    ///
    /// The first tensor call of a communicator builds its `Collectives` (see `collectives()`): a
    /// collective call every rank must make, before any CUDA-graph capture. Later calls neither
    /// synchronize nor allocate device memory, so they can be captured.
    #[pyo3(signature = (tensor, op = None, out = None, *, algorithm = None, accumulate_f32 = false, blocks = None, threads = None, stream = None))]
    #[allow(clippy::too_many_arguments)]
    fn all_reduce<'py>(
        slf: &Bound<'py, Self>,
        py: Python<'py>,
        tensor: &Bound<'py, PyAny>,
        op: Option<&Bound<'py, PyAny>>,
        out: Option<&Bound<'py, PyAny>>,
        algorithm: Option<&Bound<'py, PyAny>>,
        accumulate_f32: bool,
        blocks: Option<u32>,
        threads: Option<u32>,
        stream: Option<&Bound<'py, PyAny>>,
    ) -> PyResult<Bound<'py, PyAny>> {
        tensor_call(py, "all_reduce", (slf, tensor, op, out, algorithm, accumulate_f32, blocks, threads, stream))
    }

    /// ReduceScatter of a GPU tensor: `tensor` holds `size` equal segments; rank r gets the
    /// reduction of segment r in `out` (allocated like `tensor`, its first dimension divided by
    /// `size`, when `None`; torch tensors only); returns `out`. See `all_reduce` for the rules.
    #[pyo3(signature = (tensor, out = None, op = None, *, algorithm = None, accumulate_f32 = false, blocks = None, threads = None, stream = None))]
    #[allow(clippy::too_many_arguments)]
    fn reduce_scatter<'py>(
        slf: &Bound<'py, Self>,
        py: Python<'py>,
        tensor: &Bound<'py, PyAny>,
        out: Option<&Bound<'py, PyAny>>,
        op: Option<&Bound<'py, PyAny>>,
        algorithm: Option<&Bound<'py, PyAny>>,
        accumulate_f32: bool,
        blocks: Option<u32>,
        threads: Option<u32>,
        stream: Option<&Bound<'py, PyAny>>,
    ) -> PyResult<Bound<'py, PyAny>> {
        tensor_call(py, "reduce_scatter", (slf, tensor, out, op, algorithm, accumulate_f32, blocks, threads, stream))
    }

    /// Broadcast of `root`'s GPU tensor into every rank's `tensor` (in place); returns it. See
    /// `all_reduce` for the rules.
    #[pyo3(signature = (tensor, root = 0, *, algorithm = None, blocks = None, threads = None, stream = None))]
    #[allow(clippy::too_many_arguments)]
    fn broadcast<'py>(
        slf: &Bound<'py, Self>,
        py: Python<'py>,
        tensor: &Bound<'py, PyAny>,
        root: usize,
        algorithm: Option<&Bound<'py, PyAny>>,
        blocks: Option<u32>,
        threads: Option<u32>,
        stream: Option<&Bound<'py, PyAny>>,
    ) -> PyResult<Bound<'py, PyAny>> {
        tensor_call(py, "broadcast", (slf, tensor, root, algorithm, blocks, threads, stream))
    }

    /// The `Collectives` the tensor methods use, built on the first call with these settings (a
    /// collective call: every rank makes it, GIL released); later calls return the same object
    /// and ignore the settings. `device`: the GPU (default: torch's current device when torch is
    /// imported, else 0). Other settings as in `Collectives(...)`.
    #[pyo3(signature = (*, device = None, timeout = 30.0, tune = None, packet_bytes = None, simple_bytes = None))]
    fn collectives(
        &self,
        py: Python<'_>,
        device: Option<u32>,
        timeout: f64,
        tune: Option<bool>,
        packet_bytes: Option<u64>,
        simple_bytes: Option<u64>,
    ) -> PyResult<Py<crate::collectives::Collectives>> {
        if let Some(c) = self.collectives.peek(py) {
            return Ok(c);
        }
        let device = match device {
            Some(d) => d,
            None => py.import("mscclpp_rs._collectives")?.getattr("_current_device")?.call0()?.extract()?,
        };
        self.collectives.get(py, self, device, timeout, tune, packet_bytes, simple_bytes)
    }

    /// Whether this communicator's `Collectives` were built.
    #[getter]
    fn has_collectives(&self, py: Python<'_>) -> bool {
        self.collectives.peek(py).is_some()
    }

    /// Registers the memory of `obj` for `transports` and returns the registration, which keeps
    /// `obj` alive.
    ///
    /// `obj`: a CUDA tensor or array (`__cuda_array_interface__` or DLPack: torch, CuPy), or host
    /// memory through the buffer protocol (NumPy, `bytearray`, `memoryview`) or DLPack (CPU
    /// torch tensors). It must be writable and C-contiguous and hold at least one byte.
    fn register(
        &self,
        py: Python<'_>,
        obj: &Bound<'_, PyAny>,
        transports: &Bound<'_, PyAny>,
    ) -> PyResult<RegisteredMemory> {
        let t = transport_flags(py, transports)?;
        if t.is_empty() {
            return Err(invalid(py, "register needs at least one transport"));
        }
        register_object(py, self.comm(py)?.context(), obj, t)
    }

    /// Sends `memory`'s description to `peer` under `tag` (returns at once).
    #[pyo3(signature = (memory, peer, tag = 0))]
    fn send_memory(&self, py: Python<'_>, memory: &RegisteredMemory, peer: usize, tag: u32) -> PyResult<()> {
        self.check_peer(py, peer)?;
        let comm = self.comm(py)?;
        py.detach(|| comm.send_memory(&memory.mem, peer, tag)).py(py)
    }

    /// Receives a memory description `peer` sent under `tag` (GIL released while waiting).
    #[pyo3(signature = (peer, tag = 0))]
    fn recv_memory(&self, py: Python<'_>, peer: usize, tag: u32) -> PyResult<RegisteredMemory> {
        self.check_peer(py, peer)?;
        let comm = self.comm(py)?;
        let m = py.detach(|| comm.recv_memory(peer, tag)?.wait()).py(py)?;
        Ok(RegisteredMemory::remote(m))
    }

    /// Sends `memory` to every rank of `peers` and receives theirs: `{peer: RegisteredMemory}`.
    #[pyo3(signature = (memory, peers, tag = 0))]
    fn exchange<'py>(
        &self,
        py: Python<'py>,
        memory: &RegisteredMemory,
        peers: Vec<usize>,
        tag: u32,
    ) -> PyResult<Bound<'py, PyDict>> {
        for &p in &peers {
            self.check_peer(py, p)?;
        }
        let comm = self.comm(py)?;
        let got = py
            .detach(|| -> mscclpp::Result<Vec<(usize, mscclpp::RegisteredMemory)>> {
                let mut pend = Vec::new();
                for &p in &peers {
                    comm.send_memory(&memory.mem, p, tag)?;
                    pend.push((p, comm.recv_memory(p, tag)?));
                }
                pend.into_iter().map(|(p, w)| Ok((p, w.wait()?))).collect()
            })
            .py(py)?;
        let d = PyDict::new(py);
        for (p, m) in got {
            d.set_item(p, RegisteredMemory::remote(m))?;
        }
        Ok(d)
    }

    /// Connects to `peer` over `transport` (GIL released while waiting for the peer's side).
    ///
    /// `device`: the GPU of the local endpoint (CUDA IPC defaults to GPU 0); `interface`: the
    /// network interface or address for Ethernet; `max_write_queue_size`: operations in flight.
    #[pyo3(signature = (peer, transport, tag = 0, device = None, interface = None, max_write_queue_size = None))]
    #[allow(clippy::too_many_arguments)]
    fn connect(
        &self,
        py: Python<'_>,
        peer: usize,
        transport: &Bound<'_, PyAny>,
        tag: u32,
        device: Option<u32>,
        interface: Option<String>,
        max_write_queue_size: Option<usize>,
    ) -> PyResult<Connection> {
        self.check_peer(py, peer)?;
        let cfg = Self::endpoint_config(py, transport, device, interface, max_write_queue_size)?;
        let comm = self.comm(py)?;
        let c = py.detach(|| comm.connect(&cfg, peer, tag)?.wait()).py(py)?;
        Ok(Connection::new(c))
    }

    /// Connects to every rank of `peers` (all endpoints sent before any wait): `{peer: Connection}`.
    #[pyo3(signature = (peers, transport, tag = 0, device = None, interface = None, max_write_queue_size = None))]
    #[allow(clippy::too_many_arguments)]
    fn connect_all<'py>(
        &self,
        py: Python<'py>,
        peers: Vec<usize>,
        transport: &Bound<'_, PyAny>,
        tag: u32,
        device: Option<u32>,
        interface: Option<String>,
        max_write_queue_size: Option<usize>,
    ) -> PyResult<Bound<'py, PyDict>> {
        for &p in &peers {
            self.check_peer(py, p)?;
        }
        let cfg = Self::endpoint_config(py, transport, device, interface, max_write_queue_size)?;
        let comm = self.comm(py)?;
        let got = py
            .detach(|| -> mscclpp::Result<Vec<(usize, mscclpp::Connection)>> {
                let pend =
                    peers.iter().map(|&p| Ok((p, comm.connect(&cfg, p, tag)?))).collect::<mscclpp::Result<Vec<_>>>()?;
                pend.into_iter().map(|(p, w)| Ok((p, w.wait()?))).collect()
            })
            .py(py)?;
        let d = PyDict::new(py);
        for (p, c) in got {
            d.set_item(p, Connection::new(c))?;
        }
        Ok(d)
    }

    /// A semaphore host threads signal and wait on, over `connection` (both ranks call this).
    #[pyo3(signature = (connection, tag = 0))]
    fn host_semaphore(&self, py: Python<'_>, connection: &Connection, tag: u32) -> PyResult<Host2HostSemaphore> {
        let peer = connection.peer_of(py)?;
        let (comm, conn) = (self.comm(py)?, connection.conn(py)?);
        let s =
            py.detach(|| mscclpp::Host2HostSemaphore::new(comm.build_semaphore(&conn, peer, tag)?.wait()?)).py(py)?;
        Ok(Host2HostSemaphore { sem: s })
    }

    /// A semaphore a kernel waits on (and the peer's proxy or host signals), over `connection`:
    /// give it to a `ProxyService` for a `PortChannel` (both ranks call this).
    #[pyo3(signature = (connection, tag = 0))]
    fn device_semaphore(&self, py: Python<'_>, connection: &Connection, tag: u32) -> PyResult<Host2DeviceSemaphore> {
        let peer = connection.peer_of(py)?;
        let (comm, conn) = (self.comm(py)?, connection.conn(py)?);
        let s =
            py.detach(|| mscclpp::Host2DeviceSemaphore::new(comm.build_semaphore(&conn, peer, tag)?.wait()?)).py(py)?;
        Ok(Host2DeviceSemaphore { sem: Mutex::new(Some(Arc::new(s))) })
    }

    /// A device-to-device semaphore over a CUDA IPC `connection`, for `MemoryChannel`s (both
    /// ranks call this).
    #[pyo3(signature = (connection, tag = 0))]
    fn memory_semaphore(
        &self,
        py: Python<'_>,
        connection: &Connection,
        tag: u32,
    ) -> PyResult<crate::device::MemoryDevice2DeviceSemaphore> {
        let peer = connection.peer_of(py)?;
        let (comm, conn) = (self.comm(py)?, connection.conn(py)?);
        let s = py
            .detach(|| mscclpp::MemoryDevice2DeviceSemaphore::new(comm.build_semaphore(&conn, peer, tag)?.wait()?))
            .py(py)?;
        Ok(crate::device::MemoryDevice2DeviceSemaphore { sem: Arc::new(s) })
    }

    /// The handles of `channels` (MemoryChannels) packed into device memory on GPU `device`, at
    /// a stable address (pass `.ptr` as a `MemoryChannelDeviceHandle*`).
    #[pyo3(signature = (channels, device = 0))]
    fn pack_handles(
        &self,
        py: Python<'_>,
        channels: Vec<Bound<'_, crate::device::MemoryChannel>>,
        device: u32,
    ) -> PyResult<crate::device::DeviceHandles> {
        crate::device::pack_memory_channels(py, self.comm(py)?.context(), channels, device)
    }

    /// Leaves the job: drops this object's hold on the bootstrap (its sockets close, with a
    /// goodbye to each peer, once the connections and semaphores made through it are done with
    /// it). Later calls raise `AbortedError`; closing twice is harmless. `with Communicator(...)
    /// as comm:` closes on leaving the block.
    fn close(&self, py: Python<'_>) {
        let state = lock(&self.state).take();
        // Taken without the GIL: a build in progress on another thread holds the lock.
        let (obj, built) = py.detach(|| self.collectives.take());
        drop(obj);
        // The bootstrap's goodbye writes are bounded, and freeing the collectives' scratch waits
        // for the GPU; let other threads run meanwhile.
        py.detach(move || drop((built, state)));
    }

    /// True once `close()` was called.
    #[getter]
    fn closed(&self) -> bool {
        lock(&self.state).is_none()
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
        let closed = if lock(&self.state).is_none() { ", closed" } else { "" };
        format!("Communicator(rank={}, size={}{closed})", self.rank, self.size)
    }
}

/// Calls `mscclpp_rs._collectives.<name>(*args)`, where the tensor methods live.
fn tensor_call<'py>(
    py: Python<'py>,
    name: &str,
    args: impl pyo3::call::PyCallArgs<'py>,
) -> PyResult<Bound<'py, PyAny>> {
    py.import("mscclpp_rs._collectives")?.getattr(name)?.call1(args)
}
