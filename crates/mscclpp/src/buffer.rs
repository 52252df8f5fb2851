//! Registered buffers that own their memory: host ([`Buffer`]), page-locked host
//! ([`PinnedBuffer`]) and device ([`DeviceBuffer`]).

use std::fmt;
use std::sync::Arc;
use std::sync::atomic::AtomicU64;

use crate::context::Context;
use crate::error::{Error, Result};
use crate::memory::{RegisteredMemory, check_host_transports};
use crate::platform::cuda::{self, GpuRegion, PinnedAlloc, ipc_export};
use crate::platform::hostmem::{HostAlloc, Region};
use crate::transport::{Device, Transport, TransportFlags};

/// An owned, page-aligned, zeroed host buffer, registered with a context at allocation.
///
/// Remote peers write into it while it is shared, so access goes through copies
/// ([`read`](Self::read), [`write`](Self::write), [`to_vec`](Self::to_vec)) and atomics
/// ([`atomic_u64`](Self::atomic_u64)) rather than `&[u8]`.
///
/// ```
/// use mscclpp::{Buffer, Context, Transport};
/// let ctx = Context::new();
/// let buf = Buffer::new(&ctx, 4096, Transport::Ethernet.into()).unwrap();
/// buf.write(0, b"hello").unwrap();
/// assert_eq!(&buf.to_vec()[..5], b"hello");
/// let mem = buf.memory().clone(); // what peers get, via Communicator::send_memory
/// assert_eq!(mem.len(), 4096);
/// ```
#[derive(Clone)]
pub struct Buffer {
    mem: RegisteredMemory,
    region: Region,
}

impl fmt::Debug for Buffer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_tuple("Buffer").field(&self.mem).finish()
    }
}

impl Buffer {
    /// Allocates `len` zeroed bytes of host memory and registers them for `transports`.
    ///
    /// # Errors
    /// `InvalidUsage` for `len == 0` or a transport host memory cannot use (CUDA IPC);
    /// `NotAvailable` for a transport not built yet; `System` when out of memory.
    pub fn new(ctx: &Context, len: usize, transports: TransportFlags) -> Result<Buffer> {
        check_host_transports(transports)?;
        if len == 0 {
            return Err(Error::invalid_usage("a registered buffer needs at least one byte"));
        }
        let alloc = Arc::new(HostAlloc::zeroed(len)?);
        let region = Region::owned(alloc, len);
        let mem = RegisteredMemory::new_local(ctx, region.clone(), transports, Device::Cpu)?;
        Ok(Buffer { mem, region })
    }

    /// The registration, to give to connections or send to peers.
    pub fn memory(&self) -> &RegisteredMemory {
        &self.mem
    }
    fn region(&self) -> &Region {
        &self.region
    }
    /// The length in bytes.
    pub fn len(&self) -> usize {
        self.mem.len() as usize
    }
    /// Always false: buffers hold at least one byte.
    pub fn is_empty(&self) -> bool {
        false
    }
    /// The address of the first byte (for FFI; do not free).
    pub fn as_ptr(&self) -> *const u8 {
        self.region().addr() as *const u8
    }
    /// Copies `data` into the buffer at `offset`.
    pub fn write(&self, offset: usize, data: &[u8]) -> Result<()> {
        self.region().write(offset as u64, data)
    }
    /// Copies `out.len()` bytes from `offset` into `out`.
    pub fn read(&self, offset: usize, out: &mut [u8]) -> Result<()> {
        self.region().read(offset as u64, out)
    }
    /// Sets `len` bytes from `offset` to `byte`.
    pub fn fill(&self, offset: usize, len: usize, byte: u8) -> Result<()> {
        self.region().fill(offset as u64, len as u64, byte)
    }
    /// A copy of the whole buffer.
    pub fn to_vec(&self) -> Vec<u8> {
        let mut v = vec![0u8; self.len()];
        // In bounds by construction.
        let _ = self.region().read(0, &mut v);
        v
    }
    /// The 8-byte word at `offset` (a multiple of 8) as an atomic.
    pub fn atomic_u64(&self, offset: usize) -> Result<&AtomicU64> {
        self.region().atomic_u64(offset as u64)
    }
}

/// Owned device memory, registered with a context at allocation.
///
/// ```no_run
/// use mscclpp::{Context, DeviceBuffer, Transport};
/// let ctx = Context::new();
/// let buf = DeviceBuffer::new(&ctx, 0, 1 << 20, Transport::CudaIpc | Transport::Ethernet)?;
/// buf.write(0, b"to the GPU")?;
/// # Ok::<(), mscclpp::Error>(())
/// ```
#[derive(Clone)]
pub struct DeviceBuffer {
    mem: RegisteredMemory,
    region: GpuRegion,
}

impl std::fmt::Debug for DeviceBuffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("DeviceBuffer").field(&self.region).finish()
    }
}

impl DeviceBuffer {
    /// Allocates `len` zeroed bytes on GPU `device` with `cuMemAlloc` and registers them for
    /// `transports` (CUDA IPC, Ethernet, IB: a dma-buf registration, else `ibv_reg_mr` through
    /// nvidia-peermem).
    ///
    /// # Errors
    /// `NotAvailable` without a CUDA driver; `InvalidUsage` for a missing GPU or zero length;
    /// `Cuda` when allocation or export fails.
    pub fn new(ctx: &Context, device: u32, len: usize, transports: TransportFlags) -> Result<DeviceBuffer> {
        if len == 0 {
            return Err(Error::invalid_usage("a registered buffer needs at least one byte"));
        }
        let dev = cuda::device(device)?;
        let region = GpuRegion::alloc(&dev, len)?;
        let ipc = if transports.has(Transport::CudaIpc) { Some(ipc_export(&region)?) } else { None };
        let mem = RegisteredMemory::new_local_gpu(ctx, region.clone(), transports, ipc)?;
        Ok(DeviceBuffer { mem, region })
    }

    /// The registration, to give to connections or send to peers.
    pub fn memory(&self) -> &RegisteredMemory {
        &self.mem
    }
    /// The length in bytes.
    pub fn len(&self) -> usize {
        self.region.len
    }
    /// Always false: buffers hold at least one byte.
    pub fn is_empty(&self) -> bool {
        false
    }
    pub(crate) fn region(&self) -> &GpuRegion {
        &self.region
    }
    /// The device address (for kernels; do not free).
    pub fn device_ptr(&self) -> u64 {
        self.region.ptr
    }
    /// The GPU ordinal.
    pub fn device(&self) -> u32 {
        self.region.dev.ordinal
    }
    /// Copies `data` to the buffer at `offset` (synchronous).
    pub fn write(&self, offset: usize, data: &[u8]) -> Result<()> {
        self.region.write(offset as u64, data)
    }
    /// Copies from the buffer at `offset` into `out` (synchronous).
    pub fn read(&self, offset: usize, out: &mut [u8]) -> Result<()> {
        self.region.read(offset as u64, out)
    }
    /// Sets `len` bytes at `offset` to `byte` (synchronous).
    pub fn fill(&self, offset: usize, len: usize, byte: u8) -> Result<()> {
        self.region.fill(offset as u64, len as u64, byte)
    }
    /// Reads the 8-byte word at `offset` (synchronous).
    pub fn read_u64(&self, offset: usize) -> Result<u64> {
        let mut b = [0u8; 8];
        self.read(offset, &mut b)?;
        Ok(u64::from_le_bytes(b))
    }
    /// A copy of the whole buffer.
    pub fn to_vec(&self) -> Result<Vec<u8>> {
        let mut v = vec![0u8; self.len()];
        self.read(0, &mut v)?;
        Ok(v)
    }
}

/// Page-locked host memory (`cuMemHostAlloc`), registered with a context like a
/// [`Buffer`](crate::Buffer): host memory the GPU copy engines reach directly, for staging.
///
/// ```no_run
/// use mscclpp::{Context, Transport, gpu::PinnedBuffer};
/// let pinned = PinnedBuffer::new(&Context::new(), 0, 1 << 20, Transport::Ethernet.into())?;
/// pinned.write(0, b"staged")?;
/// # Ok::<(), mscclpp::Error>(())
/// ```
#[derive(Clone)]
pub struct PinnedBuffer {
    mem: RegisteredMemory,
    region: Region,
}

impl std::fmt::Debug for PinnedBuffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("PinnedBuffer").field(&self.region).finish()
    }
}

impl PinnedBuffer {
    /// Allocates `len` bytes of pinned host memory (in GPU `device`'s context, portable to all)
    /// and registers them for `transports` (host transports: Ethernet, IB).
    ///
    /// # Errors
    /// `NotAvailable` without a CUDA driver; `InvalidUsage` for zero length or a transport host
    /// memory cannot use; `Cuda` when the allocation fails.
    pub fn new(ctx: &Context, device: u32, len: usize, transports: TransportFlags) -> Result<PinnedBuffer> {
        check_host_transports(transports)?;
        if len == 0 {
            return Err(Error::invalid_usage("a registered buffer needs at least one byte"));
        }
        let dev = cuda::device(device)?;
        let region = PinnedAlloc::region(&dev, len)?;
        region.fill(0, len as u64, 0)?;
        let mem = RegisteredMemory::new_local(ctx, region.clone(), transports, Device::Cpu)?;
        Ok(PinnedBuffer { mem, region })
    }
    /// The registration.
    pub fn memory(&self) -> &RegisteredMemory {
        &self.mem
    }
    /// The length in bytes.
    pub fn len(&self) -> usize {
        self.region.len()
    }
    /// Always false: buffers hold at least one byte.
    pub fn is_empty(&self) -> bool {
        false
    }
    /// Copies `data` into the buffer at `offset`.
    pub fn write(&self, offset: usize, data: &[u8]) -> Result<()> {
        self.region.write(offset as u64, data)
    }
    /// Copies from the buffer at `offset` into `out`.
    pub fn read(&self, offset: usize, out: &mut [u8]) -> Result<()> {
        self.region.read(offset as u64, out)
    }
    /// The address of the first byte (for FFI; do not free).
    pub fn as_ptr(&self) -> *const u8 {
        self.region.as_mut_ptr()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buffer_registers_and_unregisters() {
        let ctx = Context::new();
        let buf = Buffer::new(&ctx, 64, Transport::Ethernet.into()).unwrap();
        let id = buf.memory().desc().region_id;
        assert!(ctx.inner().lookup_region(id).is_some());
        let copy = RegisteredMemory::deserialize(&buf.memory().serialize()).unwrap();
        assert_eq!(&copy, buf.memory());
        assert!(!copy.is_local());
        drop(buf);
        assert!(ctx.inner().lookup_region(id).is_none(), "dropping the last handle unregisters");
        assert!(Buffer::new(&ctx, 0, Transport::Ethernet.into()).is_err());
        assert_eq!(Buffer::new(&ctx, 8, Transport::CudaIpc.into()).unwrap_err().kind(), crate::ErrorKind::InvalidUsage);
    }

    #[test]
    fn gpu_buffers_without_a_driver_fail_cleanly() {
        if cuda::init().err().map(|e| e.kind()) != Some(crate::ErrorKind::NotAvailable) {
            return; // a machine with CUDA: covered by the GPU tests
        }
        let ctx = Context::new();
        let e = DeviceBuffer::new(&ctx, 0, 64, Transport::CudaIpc.into()).unwrap_err();
        assert!(e.to_string().contains("no CUDA driver found"), "{e}");
        let e = PinnedBuffer::new(&ctx, 0, 64, Transport::Ethernet.into()).unwrap_err();
        assert!(e.to_string().contains("no CUDA driver found"), "{e}");
    }
}
