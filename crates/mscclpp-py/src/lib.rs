//! Python bindings for `mscclpp`: the extension module `mscclpp_rs._native`.
//!
//! The Python package `mscclpp_rs` (in `python/`) re-exports these classes and adds what is
//! easier in Python: the `Transport` flags, the exception classes and the description of a
//! tensor's memory (`_memory.describe`: `__cuda_array_interface__`, the buffer protocol, DLPack).
//! The collectives (`Collectives`, and `Communicator.all_reduce`... on tensors) wrap
//! `mscclpp-collectives`; the tensor side of them is `mscclpp_rs/_collectives.py`, and the
//! MSCCL++-shaped algorithm objects are `mscclpp_rs/ext.py`.
//!
//! Rules kept throughout:
//! - every call that can wait (bootstrap, connect, exchange, flush, semaphore waits, proxy stop)
//!   runs inside `py.detach`, so other Python threads keep running;
//! - every `mscclpp::Error` becomes an exception of `mscclpp_rs._errors` carrying its kind,
//!   operation, peer and transport; a timeout is also a `TimeoutError`, invalid usage also a
//!   `ValueError`;
//! - Python objects whose memory Rust uses are kept alive by the objects that use it (a
//!   registration keeps the tensor, a connection keeps the sources of unflushed writes, a proxy
//!   service keeps the memories and semaphores it was given).

mod collectives;
mod comm;
mod connection;
mod device;
mod errors;
mod executor;
mod memory;

use pyo3::prelude::*;

/// The native module (`mscclpp_rs._native`).
#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    comm::register(m)?;
    memory::register(m)?;
    device::register(m)?;
    collectives::register(m)?;
    executor::register(m)?;
    Ok(())
}
