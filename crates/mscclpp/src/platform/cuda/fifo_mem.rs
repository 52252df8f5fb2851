//! The memory behind a [`Fifo`](crate::device::fifo::Fifo): the trigger ring and the control page
//! (`tail`, `proxy_error`) in mapped pinned host memory, `head` and `tailCache` in device memory
//! (or, for tests without a GPU, all four in plain host memory). This module owns the raw
//! pointers and hands out atomics; the FIFO protocol itself is safe code in `device::fifo`.
#![allow(unsafe_code)]

use std::sync::Arc;
use std::sync::atomic::AtomicU64;

use cudarc::driver::{result, sys};

use super::{DeviceAlloc, GpuDevice, cuda_err};
use crate::error::{Error, Result};
use crate::platform::hostmem::HostAlloc;

/// Bytes reserved for the control page (`tail` at word 0, `proxy_error` at word 1), on its own
/// cache lines after the ring.
const CONTROL: usize = 128;
/// Offset of `tailCache` from `head` in host-backed mode (separate cache lines).
const CACHE_OFF: usize = 64;
/// Offset of `tailCache` from `head` in device memory: a line (128 bytes on the GPU's L1 and L2)
/// of its own. Every push does an atomic on `head` (performed in L2) and then a plain, L1-cached
/// load of `tailCache`; with both words in one line (as before: 8 bytes apart) the load can miss
/// L1 after each atomic on the line. MSCCL++ allocates the two separately.
const DEVICE_CACHE_OFF: u64 = 128;

/// Device addresses of the four FIFO areas (host addresses in host-backed mode).
#[derive(Clone, Copy, Debug)]
pub(crate) struct FifoAddrs {
    pub(crate) triggers: u64,
    pub(crate) head: u64,
    pub(crate) tail: u64,
    pub(crate) tail_cache: u64,
}

enum Owner {
    Gpu { _mapped: MappedHost, _dev: DeviceAlloc },
    Host { _alloc: HostAlloc },
}

/// Mapped, pinned host memory (`cuMemHostAlloc` with DEVICEMAP | PORTABLE).
struct MappedHost {
    ptr: *mut u8,
    dev: Arc<GpuDevice>,
}

impl Drop for MappedHost {
    fn drop(&mut self) {
        if self.dev.bind().is_ok() {
            super::serializing(|| "cuMemFreeHost (FIFO)".into(), self.dev.ordinal, None);
            // SAFETY: ptr came from cuMemHostAlloc and is freed once; FifoMem (its only owner)
            // hands out borrows tied to itself, so none is left.
            if let Err(e) = unsafe { result::free_host(self.ptr.cast()) } {
                tracing::warn!(target: "mscclpp::gpu", "cuMemFreeHost (FIFO): {e}");
            }
        }
    }
}

/// The FIFO's memory; see the module documentation.
pub(crate) struct FifoMem {
    /// Host view of the ring: `2 * slots` words.
    ring: *const AtomicU64,
    slots: usize,
    /// Host view of the control page: `tail`, `proxy_error`.
    control: *const AtomicU64,
    /// Host view of `head` and `tailCache` (host-backed mode only).
    head: Option<*const AtomicU64>,
    addrs: FifoAddrs,
    _owner: Owner,
}

// SAFETY: the pointers refer to memory owned by `_owner` for the FifoMem's lifetime, and are only
// ever turned into shared references to atomics, which may be used from any thread.
unsafe impl Send for FifoMem {}
// SAFETY: as above: every access is through `&AtomicU64`.
unsafe impl Sync for FifoMem {}

impl std::fmt::Debug for FifoMem {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FifoMem").field("slots", &self.slots).field("addrs", &self.addrs).finish()
    }
}

fn ring_bytes(slots: usize) -> Result<usize> {
    slots
        .checked_mul(16)
        .map(|b| b.next_multiple_of(CONTROL))
        .ok_or_else(|| Error::invalid_usage(format!("a FIFO of {slots} slots is too large")))
}

impl FifoMem {
    /// Ring and control page in mapped pinned memory of device `ordinal`'s context, head and
    /// tailCache in its device memory; all zeroed.
    pub(crate) fn gpu(ordinal: u32, slots: usize) -> Result<FifoMem> {
        let dev = super::device(ordinal)?;
        let ring_len = ring_bytes(slots)?;
        let len = ring_len + CONTROL;
        // On the GPU's NUMA node (the GPU writes triggers into it across PCIe; the proxy polls
        // it), zeroed there; the address comes back as a number (raw pointers are not Send) and
        // `mapped` owns it from then on.
        let addr = super::near_gpu(&dev, || {
            dev.bind()?;
            super::serializing(|| format!("cuMemHostAlloc(FIFO, {len})"), dev.ordinal, None);
            let flags = sys::CU_MEMHOSTALLOC_DEVICEMAP | sys::CU_MEMHOSTALLOC_PORTABLE;
            // SAFETY: a plain allocation, owned by `mapped` below and freed once in its Drop.
            let p = unsafe { result::malloc_host(len, flags) }
                .map_err(|e| cuda_err(&format!("cuMemHostAlloc(FIFO, {len} bytes, mapped)"), e))?
                .cast::<u8>();
            // SAFETY: [p, p+len) was just allocated and nothing else refers to it yet.
            unsafe { std::ptr::write_bytes(p, 0, len) };
            Ok(p as usize)
        })?;
        let p = addr as *mut u8;
        let mapped = MappedHost { ptr: p, dev: dev.clone() };
        dev.bind()?;
        let mut base: sys::CUdeviceptr = 0;
        // SAFETY: p is a live mapped allocation of the bound context; base is a valid out pointer.
        let r = unsafe { sys::cuMemHostGetDevicePointer_v2(&mut base, p.cast(), 0) };
        r.result().map_err(|e| cuda_err("cuMemHostGetDevicePointer(FIFO)", e))?;
        let devmem = DeviceAlloc::new(&dev, 2 * DEVICE_CACHE_OFF as usize)?;
        let addrs = FifoAddrs {
            triggers: base,
            head: devmem.ptr,
            tail: base + ring_len as u64,
            tail_cache: devmem.ptr + DEVICE_CACHE_OFF,
        };
        Ok(FifoMem {
            ring: p.cast::<AtomicU64>().cast_const(),
            slots,
            // SAFETY: ring_len < len, so the control page is inside the allocation.
            control: unsafe { p.add(ring_len) }.cast::<AtomicU64>().cast_const(),
            head: None,
            addrs,
            _owner: Owner::Gpu { _mapped: mapped, _dev: devmem },
        })
    }

    /// All four areas in one zeroed, page-aligned host allocation (for CPU producers in tests).
    pub(crate) fn host(slots: usize) -> Result<FifoMem> {
        let ring_len = ring_bytes(slots)?;
        let alloc = HostAlloc::zeroed(ring_len + 2 * CONTROL)?;
        let p = alloc.as_ptr();
        let a = p as u64;
        let addrs = FifoAddrs {
            triggers: a,
            head: a + (ring_len + CONTROL) as u64,
            tail: a + ring_len as u64,
            tail_cache: a + (ring_len + CONTROL + CACHE_OFF) as u64,
        };
        Ok(FifoMem {
            ring: p.cast::<AtomicU64>().cast_const(),
            slots,
            // SAFETY: both offsets are inside the ring_len + 2 * CONTROL bytes allocated.
            control: unsafe { p.add(ring_len) }.cast::<AtomicU64>().cast_const(),
            // SAFETY: as above.
            head: Some(unsafe { p.add(ring_len + CONTROL) }.cast::<AtomicU64>().cast_const()),
            addrs,
            _owner: Owner::Host { _alloc: alloc },
        })
    }

    /// The ring as `2 * slots` words: slot `i` is words `2i` (`fst`) and `2i + 1` (`snd`).
    pub(crate) fn ring(&self) -> &[AtomicU64] {
        // SAFETY: the ring holds 2 * slots 8-byte-aligned words (page-aligned allocation), valid
        // while `self` (which owns it) lives; all accesses are atomic (the GPU's writes are PCIe
        // posted writes of whole 16-byte slots).
        unsafe { std::slice::from_raw_parts(self.ring, 2 * self.slots) }
    }

    /// The control page: `[tail, proxy_error]`.
    pub(crate) fn control(&self) -> &[AtomicU64; 2] {
        // SAFETY: two aligned words inside the allocation owned by self (see the constructors).
        unsafe { &*self.control.cast::<[AtomicU64; 2]>() }
    }

    /// `(head, tailCache)` where they are host memory (host-backed mode), else `None`.
    pub(crate) fn host_head(&self) -> Option<(&AtomicU64, &AtomicU64)> {
        // SAFETY: host mode only: head and tailCache are aligned words of the owned allocation,
        // CACHE_OFF bytes apart (see `host`).
        self.head.map(|h| unsafe { (&*h, &*h.cast::<u8>().add(CACHE_OFF).cast::<AtomicU64>()) })
    }

    /// Device addresses of the four areas.
    pub(crate) fn addrs(&self) -> FifoAddrs {
        self.addrs
    }
}
