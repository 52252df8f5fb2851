//! Device side: the proxy service, PortChannels and their handles in device memory, the CUDA
//! header and the NVRTC compile helper.

use std::sync::{Arc, Mutex};

use mscclpp::device::{self, ProxyConfig};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict};

use crate::comm::{Communicator, lock};
use crate::connection::Host2DeviceSemaphore;
use crate::errors::{IntoPyResult, invalid};
use crate::memory::RegisteredMemory;

pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<ProxyService>()?;
    m.add_class::<PortChannel>()?;
    m.add_class::<DeviceHandles>()?;
    m.add_class::<Ptx>()?;
    m.add_class::<MemoryDevice2DeviceSemaphore>()?;
    m.add_class::<MemoryChannel>()?;
    m.add_function(wrap_pyfunction!(header_source, m)?)?;
    m.add_function(wrap_pyfunction!(write_header, m)?)?;
    m.add_function(wrap_pyfunction!(compile_kernel, m)?)?;
    m.add_function(wrap_pyfunction!(handle_sizes, m)?)?;
    m.add("HEADER_NAME", device::HEADER_NAME)?;
    m.add("ABI_VERSION", device::ABI_VERSION)?;
    Ok(())
}

/// A host thread that executes the requests kernels push through `PortChannel`s (`put`,
/// `signal`, `flush`, `atomicAdd`) on the connections of its semaphores.
///
/// Register memories and semaphores, build channels, then `start()` (or use it as a context
/// manager: `with proxy: ...` starts it and stops it on exit, raising the proxy's first error).
/// `device=None` makes a host-backed service (no GPU; for tests of the plumbing).
#[pyclass(frozen, module = "mscclpp_rs._native")]
pub(crate) struct ProxyService {
    svc: Mutex<device::ProxyService>,
    device: Option<u32>,
    ctx: mscclpp::Context,
    /// Memories and semaphores given to the service (their Python owners stay alive with it).
    keep: Mutex<Vec<Py<PyAny>>>,
}

#[pymethods]
impl ProxyService {
    /// A service on GPU `device` (FIFO of `fifo_size` slots, a power of two) using `comm`'s
    /// context.
    #[new]
    #[pyo3(signature = (comm, device = Some(0), fifo_size = 512, max_write_queue_size = None))]
    fn new(
        py: Python<'_>,
        comm: &Communicator,
        device: Option<u32>,
        fifo_size: u32,
        max_write_queue_size: Option<usize>,
    ) -> PyResult<Self> {
        let cfg = ProxyConfig::default().fifo_size(fifo_size).max_write_queue_size(max_write_queue_size);
        let ctx = comm.comm(py)?.context().clone();
        let svc = py
            .detach(|| match device {
                Some(d) => device::ProxyService::new(&ctx, d, cfg),
                None => device::ProxyService::host_backed(cfg),
            })
            .py(py)?;
        Ok(ProxyService { svc: Mutex::new(svc), device, ctx, keep: Mutex::new(Vec::new()) })
    }

    /// Registers a memory that channels name (a local source or a peer's destination); returns
    /// its ID.
    fn add_memory(&self, py: Python<'_>, memory: &Bound<'_, RegisteredMemory>) -> PyResult<u32> {
        let id = lock(&self.svc).add_memory(memory.get().mem.clone()).py(py)?;
        lock(&self.keep).push(memory.clone().into_any().unbind());
        Ok(id.0)
    }

    /// Takes over a `Host2DeviceSemaphore` (the proxy signals it from now on); returns its ID.
    fn add_semaphore(&self, py: Python<'_>, semaphore: &Bound<'_, Host2DeviceSemaphore>) -> PyResult<u32> {
        let taken = lock(&semaphore.get().sem).take();
        let Some(arc) = taken else {
            return Err(invalid(py, "this semaphore was already given to a ProxyService"));
        };
        let sem = match Arc::try_unwrap(arc) {
            Ok(s) => s,
            Err(arc) => {
                *lock(&semaphore.get().sem) = Some(arc);
                return Err(invalid(py, "the semaphore is in use by another thread; try again"));
            }
        };
        let id = lock(&self.svc).add_semaphore(sem).py(py)?;
        lock(&self.keep).push(semaphore.clone().into_any().unbind());
        Ok(id.0)
    }

    /// A channel for kernels: puts from memory `src` (local) into `dst` (the peer's) and signals
    /// and flushes on semaphore `semaphore`'s connection. Build channels before `start`.
    fn port_channel(slf: &Bound<'_, Self>, semaphore: u32, dst: u32, src: u32) -> PyResult<PortChannel> {
        let py = slf.py();
        let this = slf.get();
        let ch = py
            .detach(|| {
                lock(&this.svc).port_channel(
                    device::SemaphoreId(semaphore),
                    device::MemoryId(dst),
                    device::MemoryId(src),
                )
            })
            .py(py)?;
        Ok(PortChannel { ch, _service: slf.clone().unbind() })
    }

    /// The handles of `channels`, packed one after another (96 bytes each) into device memory
    /// on the service's GPU, at an address that stays fixed while the result lives (CUDA graphs
    /// that captured it stay valid).
    fn pack_handles(slf: &Bound<'_, Self>, channels: Vec<Bound<'_, PortChannel>>) -> PyResult<DeviceHandles> {
        let py = slf.py();
        let this = slf.get();
        let Some(dev) = this.device else {
            return Err(invalid(py, "a host-backed ProxyService has no device memory to pack handles into"));
        };
        if channels.is_empty() {
            return Err(invalid(py, "pack_handles needs at least one channel"));
        }
        let mut bytes = Vec::with_capacity(channels.len() * 96);
        for c in &channels {
            if !c.get()._service.is(slf) {
                return Err(invalid(py, "every channel must come from this ProxyService"));
            }
            bytes.extend_from_slice(&c.get().ch.device_handle().to_bytes());
        }
        let ctx = this.ctx.clone();
        let buf = py
            .detach(|| {
                let b = mscclpp::DeviceBuffer::new(&ctx, dev, bytes.len(), mscclpp::TransportFlags::NONE)?;
                b.write(0, &bytes)?;
                Ok::<_, mscclpp::Error>(b)
            })
            .py(py)?;
        let keep = channels.iter().map(|c| c.clone().into_any().unbind()).collect();
        Ok(DeviceHandles { buf, count: channels.len(), _channels: keep })
    }

    /// Starts the proxy thread.
    fn start(&self, py: Python<'_>) -> PyResult<()> {
        py.detach(|| lock(&self.svc).start()).py(py)
    }

    /// Stops the proxy thread (releasing every kernel waiting on it) and raises its first error,
    /// if it had one. Calling it again gives the same result.
    fn stop(&self, py: Python<'_>) -> PyResult<()> {
        py.detach(|| lock(&self.svc).stop()).py(py)
    }

    /// Raises the proxy's first error, if any.
    fn status(&self, py: Python<'_>) -> PyResult<()> {
        lock(&self.svc).status().py(py)
    }

    /// Triggers popped so far.
    #[getter]
    fn processed(&self) -> u64 {
        lock(&self.svc).processed()
    }

    /// The GPU it serves (`None` when host-backed).
    #[getter]
    fn device(&self) -> Option<u32> {
        self.device
    }

    fn __enter__(slf: Bound<'_, Self>) -> PyResult<Bound<'_, Self>> {
        slf.get().start(slf.py())?;
        Ok(slf)
    }

    #[pyo3(signature = (exc_type = None, _exc = None, _tb = None))]
    fn __exit__(
        &self,
        py: Python<'_>,
        exc_type: Option<Bound<'_, PyAny>>,
        _exc: Option<Bound<'_, PyAny>>,
        _tb: Option<Bound<'_, PyAny>>,
    ) -> PyResult<bool> {
        let r = self.stop(py);
        // An exception already on its way wins; the proxy's error is raised otherwise.
        match exc_type {
            Some(t) if !t.is_none() => Ok(false),
            _ => r.map(|()| false),
        }
    }
}

/// A kernel's channel to one peer through a `ProxyService` (built by `port_channel`).
#[pyclass(frozen, module = "mscclpp_rs._native")]
pub(crate) struct PortChannel {
    ch: device::PortChannel,
    _service: Py<ProxyService>,
}

#[pymethods]
impl PortChannel {
    /// The 96-byte `mscclpp::PortChannelDeviceHandle`, to pass by value as a kernel argument.
    fn device_handle<'py>(&self, py: Python<'py>) -> Bound<'py, PyBytes> {
        PyBytes::new(py, &self.ch.device_handle().to_bytes())
    }

    /// Device address of this channel's own copy of its handle (stable while the channel lives),
    /// or `None` for a host-backed service.
    #[getter]
    fn device_handle_ptr(&self) -> Option<u64> {
        self.ch.device_handle_ptr()
    }

    /// The semaphore's ID in the service.
    #[getter]
    fn semaphore_id(&self) -> u32 {
        self.ch.semaphore_id().0
    }

    /// The destination memory's ID.
    #[getter]
    fn dst(&self) -> u32 {
        self.ch.dst().0
    }

    /// The source memory's ID.
    #[getter]
    fn src(&self) -> u32 {
        self.ch.src().0
    }
}

/// Channel handles packed into device memory (`ProxyService.pack_handles`,
/// `Communicator.pack_memory_channels`): pass `ptr` as a
/// `PortChannelDeviceHandle*` kernel argument. It has `__cuda_array_interface__` (bytes), so
/// `torch.as_tensor(h, device="cuda")` or `cupy.asarray(h)` views it without a copy.
#[pyclass(frozen, module = "mscclpp_rs._native")]
pub(crate) struct DeviceHandles {
    buf: mscclpp::DeviceBuffer,
    count: usize,
    _channels: Vec<Py<PyAny>>,
}

#[pymethods]
impl DeviceHandles {
    /// Device address of the first handle.
    #[getter]
    fn ptr(&self) -> u64 {
        self.buf.device_ptr()
    }

    /// Total bytes (96 per handle).
    #[getter]
    fn nbytes(&self) -> usize {
        self.buf.len()
    }

    /// The GPU the handles are on.
    #[getter]
    fn device(&self) -> u32 {
        self.buf.device()
    }

    fn __len__(&self) -> usize {
        self.count
    }

    /// The bytes, read back from the device.
    fn to_bytes<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyBytes>> {
        let v = py.detach(|| self.buf.to_vec()).py(py)?;
        Ok(PyBytes::new(py, &v))
    }

    /// CUDA array interface v3: a read-only-by-convention 1-D `uint8` array of `nbytes`.
    #[getter]
    fn __cuda_array_interface__<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let d = PyDict::new(py);
        d.set_item("shape", (self.buf.len(),))?;
        d.set_item("typestr", "|u1")?;
        d.set_item("data", (self.buf.device_ptr(), false))?;
        d.set_item("version", 3)?;
        d.set_item("strides", py.None())?;
        Ok(d)
    }
}

/// The CUDA header (`mscclpp_rs/device.cuh`) as text: device handles byte-identical to MSCCL++'s,
/// for nvcc, NVRTC, CuPy or `torch.utils.cpp_extension` builds.
#[pyfunction]
fn header_source() -> &'static str {
    device::DEVICE_HEADER
}

/// Writes the header to `dir/mscclpp_rs/device.cuh` and returns that path (`dir` is then an
/// include directory).
#[pyfunction]
fn write_header(py: Python<'_>, dir: std::path::PathBuf) -> PyResult<std::path::PathBuf> {
    device::write_header(&dir).py(py)
}

/// Sizes in bytes of the device handles, by C++ name.
#[pyfunction]
fn handle_sizes(py: Python<'_>) -> PyResult<Bound<'_, PyDict>> {
    let d = PyDict::new(py);
    for (name, what, v) in device::handles::layout_table() {
        if what == "sizeof" {
            d.set_item(name, v)?;
        }
    }
    Ok(d)
}

/// PTX from `compile_kernel`.
#[pyclass(frozen, module = "mscclpp_rs._native")]
pub(crate) struct Ptx {
    ptx: device::compile::Ptx,
}

#[pymethods]
impl Ptx {
    /// The PTX text (load it with `cupy.RawModule(path=...)`, `cuModuleLoadData`...).
    #[getter]
    fn ptx(&self) -> &str {
        self.ptx.as_str()
    }

    /// The kernels (`.entry` names; declare kernels `extern "C"`).
    #[getter]
    fn kernels(&self) -> Vec<String> {
        self.ptx.kernels().to_vec()
    }

    /// NVRTC's log (warnings).
    #[getter]
    fn log(&self) -> &str {
        self.ptx.log()
    }

    /// The virtual architecture it was compiled for.
    #[getter]
    fn arch(&self) -> &str {
        self.ptx.arch()
    }

    fn __str__(&self) -> &str {
        self.ptx.as_str()
    }
}

/// Compiles CUDA source with NVRTC (found through `MSCCLPP_NVRTC_PATH`, CUDA_PATH, the pip
/// `nvidia-cuda-nvrtc` wheel...); `#include "mscclpp_rs/device.cuh"` works without an include
/// path. `arch` (`"compute_90"`) defaults to `device`'s, else compute_90. GIL released.
/// (Named so as not to shadow Python's built-in `compile`.)
#[pyfunction]
#[pyo3(signature = (source, arch = None, device = None, options = None, name = None))]
fn compile_kernel(
    py: Python<'_>,
    source: String,
    arch: Option<String>,
    device: Option<u32>,
    options: Option<Vec<String>>,
    name: Option<String>,
) -> PyResult<Ptx> {
    let mut o = device::compile::CompileOptions::default();
    o.arch = arch;
    o.device = device;
    o.flags = options.unwrap_or_default();
    o.name = name;
    let ptx = py.detach(|| device::compile::compile(&source, &o)).py(py)?;
    Ok(Ptx { ptx })
}

/// A device-to-device semaphore over a CUDA IPC connection: kernels on both GPUs signal and wait
/// on it directly (no host thread). Several `MemoryChannel`s may share one.
#[pyclass(frozen, module = "mscclpp_rs._native")]
pub(crate) struct MemoryDevice2DeviceSemaphore {
    pub(crate) sem: Arc<mscclpp::MemoryDevice2DeviceSemaphore>,
}

#[pymethods]
impl MemoryDevice2DeviceSemaphore {
    /// The 24-byte `mscclpp::MemoryDevice2DeviceSemaphoreDeviceHandle`.
    fn device_handle<'py>(&self, py: Python<'py>) -> Bound<'py, PyBytes> {
        PyBytes::new(py, &self.sem.device_handle().to_bytes())
    }

    /// The GPU whose kernels use it.
    #[getter]
    fn device(&self) -> u32 {
        self.sem.device()
    }
}

/// A kernel's channel to a peer GPU whose memory is mapped here (CUDA IPC): kernels `put`/`get`
/// straight into the peer's `dst` from local `src`, send LL packets into the peer's packet
/// buffer, and `signal`/`wait` on the semaphore, with no host thread.
///
/// `MemoryChannel(semaphore, dst, src, packet_buffer=None)`: `dst` a peer's memory (from
/// `exchange`), `src` and `packet_buffer` local GPU memory on the semaphore's GPU.
#[pyclass(frozen, module = "mscclpp_rs._native")]
pub(crate) struct MemoryChannel {
    ch: device::MemoryChannel,
    _keep: Vec<Py<PyAny>>,
}

#[pymethods]
impl MemoryChannel {
    #[new]
    #[pyo3(signature = (semaphore, dst, src, packet_buffer = None))]
    fn new(
        py: Python<'_>,
        semaphore: &Bound<'_, MemoryDevice2DeviceSemaphore>,
        dst: &Bound<'_, RegisteredMemory>,
        src: &Bound<'_, RegisteredMemory>,
        packet_buffer: Option<&Bound<'_, RegisteredMemory>>,
    ) -> PyResult<Self> {
        let sem = semaphore.get().sem.clone();
        let (d, s) = (dst.get(), src.get());
        let p = packet_buffer.map(|p| p.get());
        let ch = py.detach(|| device::MemoryChannel::new(sem, &d.mem, &s.mem, p.map(|p| &p.mem))).py(py)?;
        let mut keep = vec![semaphore.clone().into_any().unbind(), dst.clone().into_any().unbind()];
        keep.push(src.clone().into_any().unbind());
        if let Some(p) = packet_buffer {
            keep.push(p.clone().into_any().unbind());
        }
        Ok(MemoryChannel { ch, _keep: keep })
    }

    /// The 48-byte `mscclpp::MemoryChannelDeviceHandle`, to pass by value.
    fn device_handle<'py>(&self, py: Python<'py>) -> Bound<'py, PyBytes> {
        PyBytes::new(py, &self.ch.device_handle().to_bytes())
    }

    /// Device address of the channel's own copy of its handle (stable while the channel lives).
    #[getter]
    fn device_handle_ptr(&self) -> u64 {
        self.ch.device_handle_ptr()
    }
}

/// `Communicator.pack_memory_channels`: the handles of `channels` (48 bytes each) one after
/// another in device memory on `device`.
pub(crate) fn pack_memory_channels(
    py: Python<'_>,
    ctx: &mscclpp::Context,
    channels: Vec<Bound<'_, MemoryChannel>>,
    device: u32,
) -> PyResult<DeviceHandles> {
    if channels.is_empty() {
        return Err(invalid(py, "pack_memory_channels needs at least one channel"));
    }
    let mut bytes = Vec::with_capacity(channels.len() * 48);
    for c in &channels {
        bytes.extend_from_slice(&c.get().ch.device_handle().to_bytes());
    }
    let buf = py
        .detach(|| {
            let b = mscclpp::DeviceBuffer::new(ctx, device, bytes.len(), mscclpp::TransportFlags::NONE)?;
            b.write(0, &bytes)?;
            Ok::<_, mscclpp::Error>(b)
        })
        .py(py)?;
    let keep = channels.iter().map(|c| c.clone().into_any().unbind()).collect();
    Ok(DeviceHandles { buf, count: channels.len(), _channels: keep })
}
