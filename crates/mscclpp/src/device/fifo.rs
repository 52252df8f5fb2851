//! STAND-IN (deviceb): the minimal `Fifo` API that `proxy.rs` is written against, until
//! devicea's `fifo.rs` is merged (which replaces this file whole).
//!
//! The trigger ring and a control page (word 0 tail, word 1 proxy error) in (mapped pinned) host
//! memory; head and tail cache in device memory for a GPU FIFO.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use super::handles::FifoDeviceHandle;
use super::trigger::{COMMIT_BIT, ProxyTrigger};
use crate::context::Context;
use crate::error::{Error, Result};
use crate::platform::hostmem::{HostAlloc, Region};

/// MSCCL++'s default FIFO size.
pub const DEFAULT_FIFO_SIZE: u32 = 512;

/// The trigger ring between kernels (producers) and one proxy thread (the consumer).
pub struct Fifo {
    ring: Region,
    ctrl: Region,
    /// Host-backed FIFOs: the head counter (device memory otherwise).
    host_head: Arc<AtomicU64>,
    dev: Option<(crate::buffer::DeviceBuffer, crate::buffer::DeviceBuffer)>,
    size: u32,
    shift: u32,
}

impl std::fmt::Debug for Fifo {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Fifo").field("size", &self.size).finish()
    }
}

fn check_size(size: u32) -> Result<u32> {
    if size == 0 || !size.is_power_of_two() {
        return Err(Error::invalid_usage(format!("a FIFO size must be a power of two, not {size}")));
    }
    Ok(size.trailing_zeros())
}

impl Fifo {
    /// A FIFO for kernels on GPU `device`.
    pub fn new(ctx: &Context, device: u32, size: u32) -> Result<Fifo> {
        let shift = check_size(size)?;
        let dev = crate::platform::cuda::device(device)?;
        let ring = crate::platform::cuda::PinnedAlloc::region(&dev, size as usize * 16)?;
        ring.fill(0, size as u64 * 16, 0)?;
        let ctrl = crate::platform::cuda::PinnedAlloc::region(&dev, 4096)?;
        ctrl.fill(0, 4096, 0)?;
        let head = crate::buffer::DeviceBuffer::new(ctx, device, 8, crate::TransportFlags::NONE)?;
        let cache = crate::buffer::DeviceBuffer::new(ctx, device, 8, crate::TransportFlags::NONE)?;
        Ok(Fifo { ring, ctrl, host_head: Arc::new(AtomicU64::new(0)), dev: Some((head, cache)), size, shift })
    }

    /// A FIFO in plain host memory, fed by [`HostProducer`]s.
    pub fn host_backed(size: u32) -> Result<Fifo> {
        let shift = check_size(size)?;
        let ring = Region::owned(Arc::new(HostAlloc::zeroed(size as usize * 16)?), size as usize * 16);
        let ctrl = Region::owned(Arc::new(HostAlloc::zeroed(4096)?), 4096);
        Ok(Fifo { ring, ctrl, host_head: Arc::new(AtomicU64::new(0)), dev: None, size, shift })
    }

    /// Slots in the ring.
    pub fn size(&self) -> u32 {
        self.size
    }

    fn word(r: &Region, i: u64) -> &AtomicU64 {
        // In bounds and aligned by construction.
        r.atomic_u64(i * 8).unwrap_or_else(|_| unreachable!())
    }

    /// The next position to pop.
    pub fn tail(&self) -> u64 {
        Self::word(&self.ctrl, 0).load(Ordering::Relaxed)
    }

    /// The trigger at the tail, if it was pushed.
    pub fn poll(&self) -> Option<ProxyTrigger> {
        let t = self.tail();
        let slot = (t & (self.size as u64 - 1)) * 2;
        let snd = Self::word(&self.ring, slot + 1).load(Ordering::Acquire);
        let lap = ((t >> self.shift) & 1) ^ 1;
        if (snd >> 63) != lap {
            return None;
        }
        let fst = Self::word(&self.ring, slot).load(Ordering::Relaxed);
        Some(ProxyTrigger { fst, snd: snd & !COMMIT_BIT })
    }

    /// Frees the tail slot.
    pub fn pop(&self) {
        let t = self.tail();
        Self::word(&self.ctrl, 0).store(t + 1, Ordering::Release);
    }

    /// Publishes the proxy's state to producers.
    pub fn set_proxy_error(&self, code: u64) {
        Self::word(&self.ctrl, 1).store(code, Ordering::Release);
    }

    /// The proxy's published state.
    pub fn proxy_error(&self) -> u64 {
        Self::word(&self.ctrl, 1).load(Ordering::Acquire)
    }

    /// What kernels push with.
    pub fn device_handle(&self) -> FifoDeviceHandle {
        let (head, cache) = self.dev.as_ref().map_or((0, 0), |(h, c)| (h.device_ptr(), c.device_ptr()));
        FifoDeviceHandle {
            triggers: self.ring.addr() as u64,
            head,
            tail: self.ctrl.addr() as u64,
            tail_cache: cache,
            size: self.size as i32,
            _pad: 0,
            size_mask: self.size as u64 - 1,
            size_shift: self.shift as u64,
        }
    }

    /// A producer pushing like a kernel (host-backed FIFOs).
    pub fn host_producer(&self) -> Option<HostProducer<'_>> {
        self.dev.is_none().then_some(HostProducer { fifo: self })
    }
}

/// Pushes triggers from host threads with the device's protocol.
#[derive(Clone, Copy)]
pub struct HostProducer<'a> {
    fifo: &'a Fifo,
}

impl HostProducer<'_> {
    /// Pushes `t`, waiting while the ring is full; returns its position.
    pub fn push(&self, t: ProxyTrigger, timeout: std::time::Duration) -> Result<u64> {
        let f = self.fifo;
        let pos = f.host_head.fetch_add(1, Ordering::Relaxed);
        let t0 = std::time::Instant::now();
        while pos >= f.size as u64 + Fifo::word(&f.ctrl, 0).load(Ordering::Acquire) {
            if t0.elapsed() > timeout {
                return Err(Error::invalid_usage("FIFO full"));
            }
            std::thread::yield_now();
        }
        let slot = (pos & (f.size as u64 - 1)) * 2;
        let lap = ((pos >> f.shift) & 1) ^ 1;
        Fifo::word(&f.ring, slot).store(t.fst, Ordering::Relaxed);
        Fifo::word(&f.ring, slot + 1).store((t.snd & !COMMIT_BIT) | (lap << 63), Ordering::Release);
        Ok(pos)
    }
}
