//! `PortChannel`: a kernel's channel to one peer through a [`ProxyService`]: the kernel pushes
//! `put`/`signal`/`flush` into the service's FIFO and waits on a [`Host2DeviceSemaphore`] the
//! peer's proxy signals.
//!
//! [`Host2DeviceSemaphore`]: crate::Host2DeviceSemaphore

use super::handles::{BasePortChannelDeviceHandle, PortChannelDeviceHandle};
use super::proxy::{MemoryId, ProxyService, SemaphoreId};
use crate::buffer::DeviceBuffer;
use crate::error::{Error, Result};

/// A channel between two memories registered in a [`ProxyService`], over the connection of one
/// of its semaphores. Built by [`ProxyService::port_channel`].
///
/// Kernels take the [`PortChannelDeviceHandle`] either by value ([`device_handle`](Self::device_handle))
/// or through a pointer to a copy in device memory that lives as long as the channel
/// ([`device_handle_ptr`](Self::device_handle_ptr)): the address never changes, so a CUDA graph
/// that captured it stays valid.
///
/// C++ MSCCL++: `PortChannel`.
#[derive(Debug)]
pub struct PortChannel {
    handle: PortChannelDeviceHandle,
    stored: Option<DeviceBuffer>,
    semaphore: SemaphoreId,
    dst: MemoryId,
    src: MemoryId,
}

impl PortChannel {
    /// The handle, by value (96 bytes, MSCCL++'s layout).
    pub fn device_handle(&self) -> PortChannelDeviceHandle {
        self.handle
    }

    /// Device address of a copy of the handle in device memory, stable for the channel's life
    /// (`None` for a host-backed service, which has no device).
    pub fn device_handle_ptr(&self) -> Option<u64> {
        self.stored.as_ref().map(DeviceBuffer::device_ptr)
    }

    /// The semaphore's ID in the service.
    pub fn semaphore_id(&self) -> SemaphoreId {
        self.semaphore
    }
    /// The destination memory's ID in the service.
    pub fn dst(&self) -> MemoryId {
        self.dst
    }
    /// The source memory's ID in the service.
    pub fn src(&self) -> MemoryId {
        self.src
    }
}

impl ProxyService {
    /// A channel for kernels: puts from `src` (local) into `dst` (the peer's), signals and
    /// flushes on semaphore `sem`'s connection. Build channels before [`start`](Self::start).
    ///
    /// # Errors
    /// `InvalidUsage` for IDs not registered here or a semaphore that is not a
    /// [`Host2DeviceSemaphore`](crate::Host2DeviceSemaphore); CUDA errors placing the handle.
    ///
    /// C++ MSCCL++: `ProxyService::portChannel(semaphoreId, dst, src)`.
    pub fn port_channel(&self, sem: SemaphoreId, dst: MemoryId, src: MemoryId) -> Result<PortChannel> {
        for (m, what) in [(dst, "destination"), (src, "source")] {
            if !self.memory_registered(m) {
                return Err(Error::invalid_usage(format!(
                    "port_channel: {what} memory {} is not registered in this proxy service",
                    m.0
                )));
            }
        }
        let handle = PortChannelDeviceHandle {
            base: BasePortChannelDeviceHandle {
                semaphore_id: sem.0,
                _pad: 0,
                semaphore: self.semaphore_handle(sem)?,
                fifo: self.fifo().device_handle(),
                flush_done_pos: self.flush_done_pos_ptr(sem)?,
            },
            dst: dst.0,
            src: src.0,
        };
        let stored = match (self.device(), self.context()) {
            (Some(d), Some(ctx)) => {
                let b = DeviceBuffer::new(ctx, d, 96, crate::TransportFlags::NONE)?;
                b.write(0, &handle.to_bytes())?;
                Some(b)
            }
            _ => None,
        };
        Ok(PortChannel { handle, stored, semaphore: sem, dst, src })
    }
}
