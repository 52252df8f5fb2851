//! Host-side stores into GPU memory for signal forwarding (IB HostNoAtomic mode), and the
//! registration of GPU memory with an RDMA device.
//!
//! Forwarding tries, in order: GDRCopy (`libgdrapi.so.2` and `/dev/gdrdrv`: the token's GPU page
//! mapped into this process through BAR1, stored with a volatile write and a fence),
//! `cuStreamWriteValue64` on a stream of its own, and an 8-byte `cuMemcpyHtoDAsync`; each store
//! waits for its stream. MSCCL++ refuses HostNoAtomic on CUDA without GDRCopy.
#![allow(unsafe_code)]

use std::ffi::{c_int, c_ulong, c_void};
use std::os::fd::{FromRawFd, OwnedFd};
use std::sync::Arc;
use std::time::Duration;

use cudarc::driver::sys;

use super::{GpuRegion, Stream, check};
use crate::error::{Error, ErrorKind, Result};
use crate::ib::dev::{IbDevice, IbMr};

/// Registers GPU memory `g` with `dev`: a dma-buf of its allocation (`cuMemGetHandleForAddressRange`
/// and `ibv_reg_dmabuf_mr`) first, then plain `ibv_reg_mr` (works with nvidia-peermem); an error
/// naming both failures otherwise.
pub(crate) fn reg_ib_mr(dev: &Arc<IbDevice>, g: &GpuRegion) -> Result<IbMr> {
    let dmabuf = (|| -> Result<IbMr> {
        g.dev.bind()?;
        let mut base: sys::CUdeviceptr = 0;
        let mut size: usize = 0;
        // SAFETY: valid out-pointers; g.ptr is a live allocation of the bound context.
        check("cuMemGetAddressRange", unsafe { sys::cuMemGetAddressRange_v2(&mut base, &mut size, g.ptr) })?;
        let mut fd: c_int = -1;
        // SAFETY: fd is a valid out-pointer for a file descriptor; [base, base + size) is the
        // whole allocation (page-granular, as the call requires).
        check("cuMemGetHandleForAddressRange(DMA_BUF_FD)", unsafe {
            sys::cuMemGetHandleForAddressRange(
                (&mut fd as *mut c_int).cast(),
                base,
                size,
                sys::CUmemRangeHandleType::CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD,
                0,
            )
        })?;
        if fd < 0 {
            return Err(Error::new(ErrorKind::Cuda, "cuMemGetHandleForAddressRange returned no file descriptor"));
        }
        // SAFETY: the driver returned a new descriptor that nothing else owns; closed on drop
        // (the MR keeps its own reference to the dma-buf).
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        use std::os::fd::AsRawFd;
        dev.reg_dmabuf_mr(g.ptr - base, g.len as u64, g.ptr, fd.as_raw_fd())
    })();
    let e1 = match dmabuf {
        Ok(mr) => {
            tracing::debug!(target: "mscclpp::ib", "GPU{} memory registered on {} through dma-buf", g.dev.ordinal, dev.name);
            return Ok(mr);
        }
        Err(e) => e,
    };
    match dev.reg_mr(g.ptr, g.len as u64) {
        Ok(mr) => {
            tracing::info!(
                target: "mscclpp::ib",
                "GPU{} memory registered on {} through ibv_reg_mr (nvidia-peermem); dma-buf failed: {e1}",
                g.dev.ordinal,
                dev.name
            );
            Ok(mr)
        }
        Err(e2) => Err(Error::new(
            ErrorKind::Ib,
            format!(
                "cannot register GPU{} memory for RDMA on {}: dma-buf: {}; ibv_reg_mr (needs nvidia-peermem): {}",
                g.dev.ordinal,
                dev.name,
                e1.message(),
                e2.message()
            ),
        )),
    }
}

type GdrOpen = unsafe extern "C" fn() -> *mut c_void;
type GdrClose = unsafe extern "C" fn(g: *mut c_void) -> c_int;
type GdrPin = unsafe extern "C" fn(
    g: *mut c_void,
    addr: c_ulong,
    size: usize,
    p2p_token: u64,
    va_space: u32,
    handle: *mut GdrMh,
) -> c_int;
type GdrUnpin = unsafe extern "C" fn(g: *mut c_void, handle: GdrMh) -> c_int;
type GdrMap = unsafe extern "C" fn(g: *mut c_void, handle: GdrMh, va: *mut *mut c_void, size: usize) -> c_int;
type GdrUnmap = unsafe extern "C" fn(g: *mut c_void, handle: GdrMh, va: *mut c_void, size: usize) -> c_int;

/// `gdr_mh_t`.
#[repr(C)]
#[derive(Clone, Copy)]
struct GdrMh {
    h: c_ulong,
}

/// GPU pages are 64 KiB; GDRCopy pins whole ones.
const GPU_PAGE: u64 = 1 << 16;

/// A token's GPU page pinned and mapped through GDRCopy.
struct Gdr {
    g: *mut c_void,
    mh: GdrMh,
    map: *mut c_void,
    size: usize,
    /// Where the token is in the mapping.
    word: *mut u64,
    close: GdrClose,
    unpin: GdrUnpin,
    unmap: GdrUnmap,
    _lib: libloading::Library,
}

// SAFETY: the mapping is process memory usable from any thread; only the forwarding thread
// stores through it, and Drop runs once.
unsafe impl Send for Gdr {}
// SAFETY: as above (stores are volatile writes of whole words).
unsafe impl Sync for Gdr {}

impl Drop for Gdr {
    fn drop(&mut self) {
        // SAFETY: map/mh/g came from gdr_map/gdr_pin_buffer/gdr_open and are released once, in
        // reverse order.
        unsafe {
            (self.unmap)(self.g, self.mh, self.map, self.size);
            (self.unpin)(self.g, self.mh);
            (self.close)(self.g);
        }
    }
}

impl Gdr {
    fn open(ptr: u64) -> std::result::Result<Gdr, String> {
        if !std::path::Path::new("/dev/gdrdrv").exists() {
            return Err("/dev/gdrdrv is absent (the gdrdrv module is not loaded)".into());
        }
        // SAFETY: loading GDRCopy's user library runs no initialisation beyond its own.
        let lib = unsafe { libloading::Library::new("libgdrapi.so.2") }.map_err(|e| format!("libgdrapi.so.2: {e}"))?;
        macro_rules! sym {
            ($t:ty, $n:literal) => {
                // SAFETY: the symbol has this C signature in gdrapi.h (GDRCopy 2.x); the pointer
                // lives as long as `lib`, which Gdr owns.
                unsafe { lib.get::<$t>(concat!($n, "\0").as_bytes()).map(|s| *s).map_err(|e| format!("{}: {e}", $n))? }
            };
        }
        let open = sym!(GdrOpen, "gdr_open");
        let close = sym!(GdrClose, "gdr_close");
        let pin = sym!(GdrPin, "gdr_pin_buffer");
        let unpin = sym!(GdrUnpin, "gdr_unpin_buffer");
        let map = sym!(GdrMap, "gdr_map");
        let unmap = sym!(GdrUnmap, "gdr_unmap");
        let base = ptr & !(GPU_PAGE - 1);
        let size = ((ptr + 8 - base).div_ceil(GPU_PAGE) * GPU_PAGE) as usize;
        // SAFETY: plain library calls with valid out-pointers; every resource acquired is
        // released on the error paths below or by Drop.
        unsafe {
            let g = open();
            if g.is_null() {
                return Err("gdr_open failed".into());
            }
            let mut mh = GdrMh { h: 0 };
            if pin(g, base as c_ulong, size, 0, 0, &mut mh) != 0 {
                close(g);
                return Err(format!("gdr_pin_buffer({base:#x}, {size}) failed"));
            }
            let mut va: *mut c_void = std::ptr::null_mut();
            if map(g, mh, &mut va, size) != 0 || va.is_null() {
                unpin(g, mh);
                close(g);
                return Err("gdr_map failed".into());
            }
            let word = va.cast::<u8>().add((ptr - base) as usize).cast::<u64>();
            Ok(Gdr { g, mh, map: va, size, word, close, unpin, unmap, _lib: lib })
        }
    }

    fn store(&self, value: u64) {
        // SAFETY: word is 8-aligned (tokens are) and inside the live mapping of the pinned page.
        unsafe { std::ptr::write_volatile(self.word, value) };
        // Write-combined BAR mappings need a store fence before the value is globally visible.
        std::sync::atomic::fence(std::sync::atomic::Ordering::SeqCst);
    }
}

enum How {
    Gdr(Gdr),
    WriteValue(Stream),
    Copy(Stream),
}

/// Stores 64-bit values into one GPU word from the host.
pub(crate) struct TokenForwarder {
    region: GpuRegion,
    how: How,
}

impl TokenForwarder {
    /// Picks GDRCopy, else `cuStreamWriteValue64`, else a copy, for the word at `region`'s start.
    pub(crate) fn new(region: &GpuRegion) -> Result<TokenForwarder> {
        let why_not_gdr = match Gdr::open(region.ptr) {
            Ok(g) => return Ok(TokenForwarder { region: region.clone(), how: How::Gdr(g) }),
            Err(e) => e,
        };
        let stream = Stream::new(&region.dev)?;
        let how = if stream.write_value64(region.ptr, 0)? { How::WriteValue(stream) } else { How::Copy(stream) };
        let me = TokenForwarder { region: region.clone(), how };
        me.wait()?;
        tracing::info!(
            target: "mscclpp::ib",
            "signal forwarding into GPU{} uses {} (no GDRCopy: {why_not_gdr})",
            region.dev.ordinal,
            me.kind()
        );
        Ok(me)
    }

    /// What carries the stores.
    pub(crate) fn kind(&self) -> &'static str {
        match self.how {
            How::Gdr(_) => "GDRCopy (BAR1 mapping)",
            How::WriteValue(_) => "cuStreamWriteValue64",
            How::Copy(_) => "cuMemcpyHtoDAsync",
        }
    }

    fn wait(&self) -> Result<()> {
        let s = match &self.how {
            How::Gdr(_) => return Ok(()),
            How::WriteValue(s) | How::Copy(s) => s,
        };
        if s.wait_idle(Duration::from_secs(10))? {
            Ok(())
        } else {
            Err(Error::new(
                ErrorKind::Timeout,
                format!("a token store into GPU{} took over 10 s", self.region.dev.ordinal),
            ))
        }
    }

    /// Makes the GPU word equal `value` (visible to the GPU when this returns).
    pub(crate) fn store(&self, value: u64) -> Result<()> {
        match &self.how {
            How::Gdr(g) => {
                g.store(value);
                return Ok(());
            }
            How::WriteValue(s) => {
                s.write_value64(self.region.ptr, value)?;
            }
            How::Copy(s) => {
                let v = value;
                s.copy_htod(self.region.ptr, (&v as *const u64).cast(), 8)?;
                // `v` must outlive the copy: wait before it goes.
                return self.wait();
            }
        }
        self.wait()
    }
}
