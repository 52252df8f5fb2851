//! `MemoryChannel` and `BaseMemoryChannel`: a kernel's channel to a peer GPU whose memory is
//! mapped into this process (CUDA IPC): the kernel loads and stores straight into the peer's
//! memory (`put`/`get`/`read`/`write`, LL packets) and synchronizes with a
//! [`MemoryDevice2DeviceSemaphore`], with no host thread.
//!
//! ```no_run
//! # fn f(comm: &mscclpp::Communicator, conn: &mscclpp::Connection, peer: usize,
//! #      mine: &mscclpp::DeviceBuffer, theirs: &mscclpp::RegisteredMemory) -> mscclpp::Result<()> {
//! use mscclpp::{MemoryChannel, MemoryDevice2DeviceSemaphore};
//! let sem = MemoryDevice2DeviceSemaphore::new(comm.build_semaphore(conn, peer, 0)?.wait()?)?;
//! let ch = MemoryChannel::new(sem, theirs, mine.memory(), None)?;
//! let handle_ptr = ch.device_handle_ptr(); // pass to a kernel as `mscclpp::MemoryChannelDeviceHandle*`
//! # Ok(()) }
//! ```

use std::sync::Arc;

use super::handles::{
    BaseMemoryChannelDeviceHandle, MemoryChannelDeviceHandle, MemoryDevice2DeviceSemaphoreDeviceHandle,
};
use crate::buffer::DeviceBuffer;
use crate::context::Context;
use crate::error::{Error, Result};
use crate::memory::RegisteredMemory;
use crate::semaphore::MemoryDevice2DeviceSemaphore;
use crate::transport::{Device, TransportFlags};

/// A device-to-device semaphore as a channel holds it: the semaphore (kept alive as long as the
/// channel, and shared by every channel made from the same `Arc`) and its device handle. Made
/// from a [`MemoryDevice2DeviceSemaphore`], owned or in an `Arc`, with `into()`.
///
/// ```no_run
/// # fn f(a: mscclpp::MemoryDevice2DeviceSemaphore) {
/// use mscclpp::device::{BaseMemoryChannel, ChannelSemaphore};
/// use std::sync::Arc;
/// let shared = Arc::new(a);
/// let one = BaseMemoryChannel::new(shared.clone()); // two channels, one semaphore
/// let two = BaseMemoryChannel::new(shared);
/// assert_eq!(one.device_handle(), two.device_handle());
/// # }
/// ```
#[derive(Debug, Clone)]
pub struct ChannelSemaphore {
    handle: MemoryDevice2DeviceSemaphoreDeviceHandle,
    sem: Arc<MemoryDevice2DeviceSemaphore>,
}

impl ChannelSemaphore {
    /// The semaphore's device handle.
    pub fn device_handle(&self) -> MemoryDevice2DeviceSemaphoreDeviceHandle {
        self.handle
    }
    /// The GPU the semaphore's kernels run on.
    pub fn device(&self) -> u32 {
        self.sem.device()
    }
    /// The semaphore.
    pub fn semaphore(&self) -> &Arc<MemoryDevice2DeviceSemaphore> {
        &self.sem
    }
    fn context(&self) -> &Context {
        self.sem.connection().context()
    }
}

impl From<MemoryDevice2DeviceSemaphore> for ChannelSemaphore {
    fn from(s: MemoryDevice2DeviceSemaphore) -> Self {
        Arc::new(s).into()
    }
}

impl From<Arc<MemoryDevice2DeviceSemaphore>> for ChannelSemaphore {
    /// Several channels may share one semaphore.
    fn from(sem: Arc<MemoryDevice2DeviceSemaphore>) -> Self {
        ChannelSemaphore { handle: sem.device_handle(), sem }
    }
}

/// A MemoryChannel without fixed memories: the semaphore only (MSCCL++'s expert-parallel kernels
/// use it for synchronization next to raw peer pointers).
///
/// C++ MSCCL++: `BaseMemoryChannel`.
#[derive(Debug)]
pub struct BaseMemoryChannel {
    sem: ChannelSemaphore,
}

impl BaseMemoryChannel {
    /// A channel over `sem`.
    pub fn new(sem: impl Into<ChannelSemaphore>) -> BaseMemoryChannel {
        BaseMemoryChannel { sem: sem.into() }
    }
    /// The handle, by value (24 bytes, MSCCL++'s layout).
    pub fn device_handle(&self) -> BaseMemoryChannelDeviceHandle {
        BaseMemoryChannelDeviceHandle { semaphore: self.sem.handle }
    }
}

/// A channel for kernels between a peer's memory (mapped here), a local memory and an optional
/// local packet buffer, synchronized by a device-to-device semaphore. See the header's
/// `MemoryChannelDeviceHandle` for the device methods and the copy contract.
///
/// Kernels take the handle by value ([`device_handle`](Self::device_handle)) or through a
/// pointer to a copy in device memory that lives as long as the channel
/// ([`device_handle_ptr`](Self::device_handle_ptr); stable, so CUDA graphs may capture it).
///
/// C++ MSCCL++: `MemoryChannel(semaphore, dst, src, packetBuffer)`.
#[derive(Debug)]
pub struct MemoryChannel {
    sem: ChannelSemaphore,
    handle: MemoryChannelDeviceHandle,
    stored: DeviceBuffer,
    // Kept alive: `dst` holds the CUDA IPC mapping the handle points into.
    _dst: RegisteredMemory,
    _src: RegisteredMemory,
    _packets: Option<RegisteredMemory>,
}

impl MemoryChannel {
    /// A channel whose kernels copy from `src` (local GPU memory) into `dst` (a peer's GPU
    /// memory, registered for CUDA IPC, received with `recv_memory`; or memory of this process)
    /// and unpack packets from `packet_buffer` (local GPU memory the peer's channel uses as its
    /// `dst`), synchronized by `sem`. `dst` is mapped into this process here (once per peer
    /// allocation).
    ///
    /// # Errors
    /// `InvalidUsage` when `src` or `packet_buffer` is not local GPU memory on the semaphore's
    /// GPU, or `dst` cannot be mapped (host memory, another host, no CUDA IPC export); CUDA
    /// errors mapping `dst` or storing the handle.
    pub fn new(
        sem: impl Into<ChannelSemaphore>,
        dst: &RegisteredMemory,
        src: &RegisteredMemory,
        packet_buffer: Option<&RegisteredMemory>,
    ) -> Result<MemoryChannel> {
        let sem = sem.into();
        let dev = sem.device();
        let gpu = crate::platform::cuda::device(dev)?;
        let local = |m: &RegisteredMemory, what: &str| -> Result<u64> {
            if !m.is_local() || m.device() != Device::Gpu(dev) {
                return Err(Error::invalid_usage(format!(
                    "MemoryChannel: the {what} must be GPU memory of this process on GPU {dev} (it is {:?}, {})",
                    m.device(),
                    if m.is_local() { "local" } else { "a peer's" }
                )));
            }
            m.gpu_ptr(&gpu)
        };
        let src_ptr = local(src, "source")?;
        let packet_ptr = match packet_buffer {
            Some(p) => local(p, "packet buffer")?,
            None => 0,
        };
        let dst_ptr = dst.gpu_ptr(&gpu).map_err(|e| e.during("MemoryChannel: mapping the destination"))?;
        let handle =
            MemoryChannelDeviceHandle { semaphore: sem.handle, dst: dst_ptr, src: src_ptr, packet_buffer: packet_ptr };
        let stored = DeviceBuffer::new(sem.context(), dev, 48, TransportFlags::NONE)?;
        stored.write(0, &handle.to_bytes())?;
        Ok(MemoryChannel {
            sem,
            handle,
            stored,
            _dst: dst.clone(),
            _src: src.clone(),
            _packets: packet_buffer.cloned(),
        })
    }

    /// The handle, by value (48 bytes, MSCCL++'s layout).
    pub fn device_handle(&self) -> MemoryChannelDeviceHandle {
        self.handle
    }

    /// Device address of a copy of the handle in device memory, stable for the channel's life
    /// (what CUDA graphs want). Kernels whose threads each copy only a few elements are faster
    /// with [`device_handle`](Self::device_handle) passed by value: through this pointer every
    /// thread first waits for a load of the handle.
    pub fn device_handle_ptr(&self) -> u64 {
        self.stored.device_ptr()
    }

    /// The semaphore-only view of this channel.
    pub fn base_handle(&self) -> BaseMemoryChannelDeviceHandle {
        BaseMemoryChannelDeviceHandle { semaphore: self.sem.handle }
    }
}
