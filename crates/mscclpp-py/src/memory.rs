//! Registered memory: tensors and arrays registered with a communicator's context, kept alive
//! while registered, and memories received from peers.
//!
//! One of the two places with `unsafe` (the other is `collectives.rs`: raw-pointer collectives):
//! registering a pointer that Python code described (`mscclpp_rs._memory.describe`), under the
//! rule that the object owning it lives as long as the registration (the [`RegisteredMemory`]
//! object holds it).

use mscclpp::{Context, Transport, TransportFlags};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyString};

use crate::errors::{IntoPyResult, invalid};

pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<RegisteredMemory>()?;
    Ok(())
}

/// Transport flags from an `int` (a `Transport` flag or an OR of them), a transport name
/// (`"ETH"`, `"CUDA_IPC"`, `"IB0"`...) or a list of either.
pub(crate) fn transport_flags(py: Python<'_>, v: &Bound<'_, PyAny>) -> PyResult<TransportFlags> {
    if let Ok(bits) = v.extract::<i64>() {
        return u16::try_from(bits)
            .ok()
            .and_then(TransportFlags::from_bits)
            .ok_or_else(|| invalid(py, format!("{bits:#x} is not a set of transports (use mscclpp_rs.Transport)")));
    }
    if let Ok(s) = v.cast::<PyString>() {
        return Ok(s.to_str()?.replace('_', "-").parse::<Transport>().py(py)?.into());
    }
    if let Ok(items) = v.try_iter() {
        let mut flags = TransportFlags::NONE;
        for item in items {
            flags |= transport_flags(py, &item?)?;
        }
        return Ok(flags);
    }
    Err(pyo3::exceptions::PyTypeError::new_err(format!(
        "transports must be a mscclpp_rs.Transport, an int, a name or a list of them, not {}",
        v.get_type().name()?
    )))
}

/// `flags` as the Python `mscclpp_rs.Transport` flag users pass in (a plain `int` when the package
/// is not importable, as when the native module is imported alone).
pub(crate) fn py_transport(py: Python<'_>, flags: TransportFlags) -> PyResult<Py<PyAny>> {
    let bits = flags.bits();
    match py.import("mscclpp_rs._types").and_then(|m| m.getattr("Transport")) {
        Ok(cls) => Ok(cls.call1((bits,))?.unbind()),
        Err(_) => Ok(bits.into_pyobject(py)?.into_any().unbind()),
    }
}

/// Exactly one transport.
pub(crate) fn one_transport(py: Python<'_>, v: &Bound<'_, PyAny>) -> PyResult<Transport> {
    let f = transport_flags(py, v)?;
    let mut it = f.iter();
    match (it.next(), it.next()) {
        (Some(t), None) => Ok(t),
        _ => Err(invalid(py, format!("give exactly one transport here, not {f}"))),
    }
}

/// A registered memory: local (a tensor or array registered by [`Communicator.register`]) or a
/// peer's (received by `recv_memory` / `exchange`).
///
/// A local one keeps the Python object it was registered from alive (and, for host memory, the
/// buffer export: a `bytearray` cannot be resized meanwhile) for as long as this object or
/// anything using it (a connection with unflushed writes, a proxy service) lives.
#[pyclass(frozen, module = "mscclpp_rs._native")]
pub(crate) struct RegisteredMemory {
    pub(crate) mem: mscclpp::RegisteredMemory,
    /// What keeps the memory valid: the object and the export/capsule `describe` returned.
    owner: Option<Py<PyAny>>,
}

impl RegisteredMemory {
    pub(crate) fn remote(mem: mscclpp::RegisteredMemory) -> Self {
        RegisteredMemory { mem, owner: None }
    }
}

#[pymethods]
impl RegisteredMemory {
    /// Length in bytes.
    #[getter]
    fn nbytes(&self) -> u64 {
        self.mem.len()
    }

    fn __len__(&self) -> usize {
        self.mem.len() as usize
    }

    /// Start address (in the owning process; a device address for GPU memory).
    #[getter]
    fn addr(&self) -> u64 {
        self.mem.addr()
    }

    /// True for memory of this process.
    #[getter]
    fn is_local(&self) -> bool {
        self.mem.is_local()
    }

    /// The transports it is registered for, as a `mscclpp_rs.Transport` flag.
    #[getter]
    fn transports(&self, py: Python<'_>) -> PyResult<Py<PyAny>> {
        py_transport(py, self.mem.transports())
    }

    /// The GPU index for GPU memory, `None` for host memory.
    #[getter]
    fn device(&self) -> Option<u32> {
        self.mem.device().gpu_index()
    }

    /// The object registered (`None` for a peer's memory).
    #[getter]
    fn obj(&self, py: Python<'_>) -> PyResult<Option<Py<PyAny>>> {
        match &self.owner {
            Some(o) => Ok(Some(o.bind(py).get_item(0)?.unbind())),
            None => Ok(None),
        }
    }

    /// The description peers receive (what `send_memory` sends), as bytes.
    fn to_bytes<'py>(&self, py: Python<'py>) -> Bound<'py, PyBytes> {
        PyBytes::new(py, &self.mem.serialize())
    }

    /// A peer's memory from `to_bytes()` output (bytes received by other means).
    #[staticmethod]
    fn from_bytes(py: Python<'_>, data: &[u8]) -> PyResult<RegisteredMemory> {
        Ok(RegisteredMemory::remote(mscclpp::RegisteredMemory::deserialize(data).py(py)?))
    }

    fn __repr__(&self) -> String {
        format!(
            "RegisteredMemory({} bytes at {:#x}, {}, {}, {})",
            self.mem.len(),
            self.mem.addr(),
            self.mem.transports(),
            match self.mem.device().gpu_index() {
                Some(i) => format!("GPU{i}"),
                None => "host".into(),
            },
            if self.mem.is_local() { "local" } else { "remote" }
        )
    }
}

/// Registers the memory of `obj` (anything `describe` accepts) for `transports`.
pub(crate) fn register_object(
    py: Python<'_>,
    ctx: &Context,
    obj: &Bound<'_, PyAny>,
    transports: TransportFlags,
) -> PyResult<RegisteredMemory> {
    let described = py.import("mscclpp_rs._memory")?.call_method1("describe", (obj,))?;
    // (kind, ptr, nbytes, device, keep): keep = (obj, export...) holds the memory valid.
    let (kind, ptr, nbytes, _device, keep): (String, u64, u64, Option<u32>, Py<PyAny>) = described.extract()?;
    let len = usize::try_from(nbytes).map_err(|_| invalid(py, format!("{nbytes} bytes is too large")))?;
    if ptr == 0 || len == 0 {
        return Err(invalid(py, "cannot register an empty tensor or array (0 bytes or a null pointer)"));
    }
    let mem = match kind.as_str() {
        "host" => {
            let p = usize::try_from(ptr).map_err(|_| invalid(py, "host pointer out of range"))?;
            // SAFETY: `describe` took the pointer and length from a writable, C-contiguous buffer
            // export of `obj` (or a DLPack capsule of it) that `keep` holds; `keep` is stored in
            // the returned object, whose lifetime bounds every use of this registration from
            // Python (connections and proxy services keep the RegisteredMemory object alive while
            // they hold the registration). Python code never holds Rust references into it.
            py.detach(move || unsafe { ctx.register_host(p as *mut u8, len, transports) }).py(py)?
        }
        "cuda" => register_gpu(py, ctx, ptr, len, transports)?,
        other => return Err(invalid(py, format!("unknown memory kind {other:?} from describe()"))),
    };
    Ok(RegisteredMemory { mem, owner: Some(keep) })
}

/// GPU memory (a device pointer from `__cuda_array_interface__` or DLPack).
fn register_gpu(
    py: Python<'_>,
    ctx: &Context,
    ptr: u64,
    len: usize,
    transports: TransportFlags,
) -> PyResult<mscclpp::RegisteredMemory> {
    // SAFETY: the pointer and length come from the object's CUDA array interface or DLPack
    // capsule, which `keep` holds in the returned RegisteredMemory object for as long as the
    // registration is usable from Python (see register_object); register_device checks with the
    // driver that the range lies inside one live device allocation.
    py.detach(move || unsafe { ctx.register_device(ptr, len, transports) }).py(py)
}
