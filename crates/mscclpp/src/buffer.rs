//! Registered buffers that own their memory: host ([`Buffer`]), page-locked host
//! ([`PinnedBuffer`]) and device ([`DeviceBuffer`]).
//!
//! All three have one shape: a registration and the bytes behind it ([`Bytes`]: a host
//! [`Region`] or a [`GpuRegion`]), with the same `len`, `is_empty`, `memory`, `write`, `read`
//! and `fill`, written once in [`shared_buffer_api`]. Every access is checked by one range check
//! ([`check_range`](crate::platform::check_range)), inside the region it reaches.

use std::fmt;
use std::sync::Arc;
use std::sync::atomic::AtomicU64;

use crate::context::Context;
use crate::error::{Error, Result};
use crate::memory::{RegisteredMemory, check_host_transports};
use crate::platform::cuda::{self, GpuRegion, PinnedAlloc, ipc_export};
use crate::platform::hostmem::{HostAlloc, Region};
use crate::transport::{Device, Transport, TransportFlags};

/// The bytes behind a buffer. Each method checks its range (one check,
/// [`check_range`](crate::platform::check_range)) before touching memory.
pub(crate) trait Bytes: Clone + fmt::Debug {
    fn len(&self) -> usize;
    fn write(&self, offset: u64, src: &[u8]) -> Result<()>;
    fn read(&self, offset: u64, dst: &mut [u8]) -> Result<()>;
    fn fill(&self, offset: u64, n: u64, byte: u8) -> Result<()>;
}

impl Bytes for Region {
    fn len(&self) -> usize {
        Region::len(self)
    }
    fn write(&self, offset: u64, src: &[u8]) -> Result<()> {
        Region::write(self, offset, src)
    }
    fn read(&self, offset: u64, dst: &mut [u8]) -> Result<()> {
        Region::read(self, offset, dst)
    }
    fn fill(&self, offset: u64, n: u64, byte: u8) -> Result<()> {
        Region::fill(self, offset, n, byte)
    }
}

impl Bytes for GpuRegion {
    fn len(&self) -> usize {
        self.len
    }
    fn write(&self, offset: u64, src: &[u8]) -> Result<()> {
        GpuRegion::write(self, offset, src)
    }
    fn read(&self, offset: u64, dst: &mut [u8]) -> Result<()> {
        GpuRegion::read(self, offset, dst)
    }
    fn fill(&self, offset: u64, n: u64, byte: u8) -> Result<()> {
        GpuRegion::fill(self, offset, n, byte)
    }
}

/// A registration and its bytes: what every buffer is.
#[derive(Clone)]
struct Core<B: Bytes> {
    mem: RegisteredMemory,
    bytes: B,
}

/// Buffers hold at least one byte.
fn check_len(len: usize) -> Result<()> {
    if len == 0 {
        return Err(Error::invalid_usage("a registered buffer needs at least one byte"));
    }
    Ok(())
}

/// The methods every buffer has, written once.
macro_rules! shared_buffer_api {
    ($name:ident) => {
        impl fmt::Debug for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.debug_tuple(stringify!($name)).field(&self.core.bytes).field(&self.core.mem).finish()
            }
        }

        impl $name {
            /// The registration, to give to connections or send to peers.
            pub fn memory(&self) -> &RegisteredMemory {
                &self.core.mem
            }
            /// The length in bytes.
            pub fn len(&self) -> usize {
                Bytes::len(&self.core.bytes)
            }
            /// Always false: buffers hold at least one byte.
            pub fn is_empty(&self) -> bool {
                false
            }
            /// Copies `data` into the buffer at `offset` (complete when this returns).
            ///
            /// # Errors
            /// `InvalidUsage` for a range outside the buffer (nothing is written).
            pub fn write(&self, offset: usize, data: &[u8]) -> Result<()> {
                Bytes::write(&self.core.bytes, offset as u64, data)
            }
            /// Copies `out.len()` bytes from the buffer at `offset` into `out`.
            ///
            /// # Errors
            /// `InvalidUsage` for a range outside the buffer.
            pub fn read(&self, offset: usize, out: &mut [u8]) -> Result<()> {
                Bytes::read(&self.core.bytes, offset as u64, out)
            }
            /// Sets `len` bytes from `offset` to `byte` (complete when this returns).
            ///
            /// # Errors
            /// `InvalidUsage` for a range outside the buffer (nothing is written).
            pub fn fill(&self, offset: usize, len: usize, byte: u8) -> Result<()> {
                Bytes::fill(&self.core.bytes, offset as u64, len as u64, byte)
            }
        }
    };
}

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
    core: Core<Region>,
}

shared_buffer_api!(Buffer);

impl Buffer {
    /// Allocates `len` zeroed bytes of host memory and registers them for `transports`.
    ///
    /// # Errors
    /// `InvalidUsage` for `len == 0` or a transport host memory cannot use (CUDA IPC);
    /// `NotAvailable` for a transport not built yet; `System` when out of memory.
    pub fn new(ctx: &Context, len: usize, transports: TransportFlags) -> Result<Buffer> {
        check_host_transports(transports)?;
        check_len(len)?;
        let alloc = Arc::new(HostAlloc::zeroed(len)?);
        let bytes = Region::owned(alloc, len);
        let mem = RegisteredMemory::new_local(ctx, bytes.clone(), transports, Device::Cpu)?;
        Ok(Buffer { core: Core { mem, bytes } })
    }
    /// The address of the first byte (for FFI; do not free).
    pub fn as_ptr(&self) -> *const u8 {
        self.core.bytes.addr() as *const u8
    }
    /// A copy of the whole buffer.
    pub fn to_vec(&self) -> Vec<u8> {
        let mut v = vec![0u8; self.len()];
        // In bounds by construction.
        let _ = self.core.bytes.read(0, &mut v);
        v
    }
    /// The 8-byte word at `offset` (a multiple of 8) as an atomic.
    pub fn atomic_u64(&self, offset: usize) -> Result<&AtomicU64> {
        self.core.bytes.atomic_u64(offset as u64)
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
    core: Core<GpuRegion>,
}

shared_buffer_api!(DeviceBuffer);

impl DeviceBuffer {
    /// Allocates `len` zeroed bytes on GPU `device` with `cuMemAlloc` and registers them for
    /// `transports` (CUDA IPC, Ethernet, IB: a dma-buf registration, else `ibv_reg_mr` through
    /// nvidia-peermem).
    ///
    /// # Errors
    /// `NotAvailable` without a CUDA driver; `InvalidUsage` for a missing GPU or zero length;
    /// `Cuda` when allocation or export fails.
    pub fn new(ctx: &Context, device: u32, len: usize, transports: TransportFlags) -> Result<DeviceBuffer> {
        check_len(len)?;
        let dev = cuda::device(device)?;
        let bytes = GpuRegion::alloc(&dev, len)?;
        let ipc = if transports.has(Transport::CudaIpc) { Some(ipc_export(&bytes)?) } else { None };
        let mem = RegisteredMemory::new_local_gpu(ctx, bytes.clone(), transports, ipc)?;
        Ok(DeviceBuffer { core: Core { mem, bytes } })
    }
    /// A buffer over `bytes` (a window of an allocation someone else keeps, e.g. a token-pool
    /// slot), registered for `transports` with the CUDA IPC export `ipc` (None: not exported).
    pub(crate) fn from_region(
        ctx: &Context,
        bytes: GpuRegion,
        transports: TransportFlags,
        ipc: Option<crate::platform::cuda::IpcInfo>,
    ) -> Result<DeviceBuffer> {
        check_len(bytes.len)?;
        let mem = RegisteredMemory::new_local_gpu(ctx, bytes.clone(), transports, ipc)?;
        Ok(DeviceBuffer { core: Core { mem, bytes } })
    }
    pub(crate) fn region(&self) -> &GpuRegion {
        &self.core.bytes
    }
    /// The device address (for kernels; do not free).
    pub fn device_ptr(&self) -> u64 {
        self.core.bytes.ptr
    }
    /// The GPU ordinal.
    pub fn device(&self) -> u32 {
        self.core.bytes.dev.ordinal
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
    core: Core<Region>,
}

shared_buffer_api!(PinnedBuffer);

impl PinnedBuffer {
    /// Allocates `len` bytes of pinned host memory (in GPU `device`'s context, portable to all)
    /// and registers them for `transports` (host transports: Ethernet, IB).
    ///
    /// # Errors
    /// `NotAvailable` without a CUDA driver; `InvalidUsage` for zero length or a transport host
    /// memory cannot use; `Cuda` when the allocation fails.
    pub fn new(ctx: &Context, device: u32, len: usize, transports: TransportFlags) -> Result<PinnedBuffer> {
        check_host_transports(transports)?;
        check_len(len)?;
        let dev = cuda::device(device)?;
        let bytes = PinnedAlloc::region(&dev, len)?;
        bytes.fill(0, len as u64, 0)?;
        let mem = RegisteredMemory::new_local(ctx, bytes.clone(), transports, Device::Cpu)?;
        Ok(PinnedBuffer { core: Core { mem, bytes } })
    }
    /// The address of the first byte (for FFI; do not free).
    pub fn as_ptr(&self) -> *const u8 {
        self.core.bytes.as_mut_ptr()
    }
    /// The 8-byte word at `offset` (a multiple of 8) as an atomic: a word a GPU kernel writes
    /// through the buffer's unified address (an error or status word) is read with one load, no
    /// CUDA call.
    ///
    /// # Errors
    /// `InvalidUsage` for an offset that is not a multiple of 8 or past the end.
    pub fn atomic_u64(&self, offset: usize) -> Result<&AtomicU64> {
        self.core.bytes.atomic_u64(offset as u64)
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
    fn host_buffers_check_every_range_the_same_way() {
        let ctx = Context::new();
        let buf = Buffer::new(&ctx, 64, Transport::Ethernet.into()).unwrap();
        buf.fill(0, 64, 7).unwrap();
        let mut out = [0u8; 4];
        for e in [
            buf.write(62, b"abc").unwrap_err(),
            buf.read(61, &mut out).unwrap_err(),
            buf.fill(1, 64, 0).unwrap_err(),
            buf.write(usize::MAX, b"a").unwrap_err(),
        ] {
            assert_eq!(e.kind(), crate::ErrorKind::InvalidUsage, "{e}");
            assert!(e.to_string().contains("64-byte"), "{e}");
        }
        assert_eq!(buf.to_vec(), vec![7u8; 64], "a refused access changes nothing");
        buf.write(60, b"abcd").unwrap();
        buf.read(60, &mut out).unwrap();
        assert_eq!(&out, b"abcd");
        assert_eq!(buf.len(), 64);
        assert!(!buf.is_empty());
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
