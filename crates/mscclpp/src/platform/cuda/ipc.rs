//! CUDA IPC: exporting a device allocation (legacy IPC handle) and mapping a peer's.
#![allow(unsafe_code)]

use std::collections::HashMap;
use std::mem::MaybeUninit;
use std::sync::{Arc, Mutex, Weak};

use cudarc::driver::sys;

use super::{GpuDevice, GpuRegion, LOG, check};
use crate::error::{Error, Result};
use crate::sync::lock;

/// What a peer process needs to map a device allocation: the legacy IPC handle of the
/// allocation's base, its size, the offset of the registered range, and the owner's device.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct IpcInfo {
    pub(crate) handle: [u8; 64],
    pub(crate) base_size: u64,
    pub(crate) offset: u64,
    pub(crate) device: u32,
}

impl IpcInfo {
    pub(crate) fn encode(&self) -> Vec<u8> {
        let mut v = Vec::with_capacity(84);
        v.extend_from_slice(&self.handle);
        v.extend_from_slice(&self.base_size.to_le_bytes());
        v.extend_from_slice(&self.offset.to_le_bytes());
        v.extend_from_slice(&self.device.to_le_bytes());
        v
    }
    pub(crate) fn decode(b: &[u8]) -> Result<IpcInfo> {
        if b.len() != 84 {
            return Err(Error::invalid_usage(format!("CUDA IPC info of {} bytes (expected 84)", b.len())));
        }
        let mut handle = [0u8; 64];
        handle.copy_from_slice(&b[..64]);
        let u = |r: std::ops::Range<usize>| u64::from_le_bytes(b[r].try_into().unwrap_or_default());
        let base_size = u(64..72);
        let offset = u(72..80);
        let device = u32::from_le_bytes(b[80..84].try_into().unwrap_or_default());
        if offset >= base_size.max(1) {
            return Err(Error::invalid_usage("CUDA IPC info: offset beyond the allocation"));
        }
        Ok(IpcInfo { handle, base_size, offset, device })
    }
}

pub(crate) fn ipc_export(r: &GpuRegion) -> Result<IpcInfo> {
    r.dev.bind()?;
    let mut base: sys::CUdeviceptr = 0;
    let mut size: usize = 0;
    // SAFETY: out-pointers to locals; ptr is a live allocation of this process.
    check("cuMemGetAddressRange", unsafe { sys::cuMemGetAddressRange_v2(&mut base, &mut size, r.ptr) })?;
    let mut h = MaybeUninit::<sys::CUipcMemHandle>::uninit();
    // SAFETY: h is written by the driver on success (checked before assume_init).
    check("cuIpcGetMemHandle", unsafe { sys::cuIpcGetMemHandle(h.as_mut_ptr(), base) })?;
    // SAFETY: initialized by the successful call above.
    let h = unsafe { h.assume_init() };
    let mut handle = [0u8; 64];
    for (d, s) in handle.iter_mut().zip(h.reserved.iter()) {
        *d = *s as u8;
    }
    Ok(IpcInfo { handle, base_size: size as u64, offset: r.ptr - base, device: r.dev.ordinal })
}

/// A peer's allocation mapped into this process; unmapped when the last user drops it.
pub(crate) struct IpcMapping {
    pub(crate) base: u64,
    pub(crate) size: u64,
    dev: Arc<GpuDevice>,
}

impl Drop for IpcMapping {
    fn drop(&mut self) {
        if self.dev.bind().is_ok() {
            // SAFETY: base came from cuIpcOpenMemHandle and is closed once (the cache holds Weak
            // references only, so this is the last user).
            let r = unsafe { sys::cuIpcCloseMemHandle(self.base) };
            IPC_LIVE.fetch_sub(1, std::sync::atomic::Ordering::Relaxed);
            if r != sys::CUresult::CUDA_SUCCESS {
                tracing::warn!(target: LOG, "cuIpcCloseMemHandle: {r:?}");
            }
        }
    }
}

/// Opens (once per process, shared by reference count) a peer's allocation on `dev`.
pub(crate) fn ipc_open(info: &IpcInfo, dev: &Arc<GpuDevice>) -> Result<Arc<IpcMapping>> {
    static CACHE: Mutex<Option<HashMap<[u8; 64], Weak<IpcMapping>>>> = Mutex::new(None);
    let mut cache = lock(&CACHE);
    let map = cache.get_or_insert_with(HashMap::new);
    if let Some(m) = map.get(&info.handle).and_then(Weak::upgrade) {
        return Ok(m);
    }
    dev.bind()?;
    let mut h = sys::CUipcMemHandle { reserved: [0; 64] };
    for (d, s) in h.reserved.iter_mut().zip(info.handle.iter()) {
        *d = *s as std::ffi::c_char;
    }
    let mut base: sys::CUdeviceptr = 0;
    // SAFETY: out-pointer to a local; the handle bytes came from cuIpcGetMemHandle in the peer.
    check("cuIpcOpenMemHandle", unsafe {
        sys::cuIpcOpenMemHandle_v2(&mut base, h, sys::CUipcMem_flags::CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS as u32)
    })?;
    IPC_LIVE.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let m = Arc::new(IpcMapping { base, size: info.base_size, dev: dev.clone() });
    map.retain(|_, w| w.strong_count() > 0);
    map.insert(info.handle, Arc::downgrade(&m));
    Ok(m)
}

/// How many peer allocations this process has mapped through CUDA IPC right now.
pub fn ipc_mapped_count() -> usize {
    IPC_LIVE.load(std::sync::atomic::Ordering::Relaxed)
}
static IPC_LIVE: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
