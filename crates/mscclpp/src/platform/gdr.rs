//! Host-side stores into GPU memory for signal forwarding (IB HostNoAtomic mode).
//!
//! Forwarding tries, in order: GDRCopy (`libgdrapi.so.2` and `/dev/gdrdrv`: the token's GPU page
//! mapped into this process through BAR1, stored with a volatile write and a fence),
//! `cuStreamWriteValue64` on a stream of its own, and an 8-byte `cuMemcpyHtoDAsync`; each store
//! waits for its stream. MSCCL++ refuses HostNoAtomic on CUDA without GDRCopy.
#![allow(unsafe_code)]

use std::ffi::{c_int, c_ulong, c_void};
use std::time::Duration;

use crate::error::{Error, ErrorKind, Result};
use crate::platform::cuda::{GpuRegion, Stream};

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
