//! The user's own device memory: what the driver says about a pointer (`cuPointerGetAttribute`),
//! and sharing memory from `cuMemCreate` (the VMM API) with another process of this host through
//! a POSIX file descriptor.
#![allow(unsafe_code)]

use std::ffi::c_void;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::Arc;

use cudarc::driver::sys;

use super::{GpuDevice, GpuRegion, LOG, check, cuda_err, device, init};
use crate::error::{Error, ErrorKind, Result};

/// How a device allocation was made, as far as sharing it is concerned.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum AllocKind {
    /// `cuMemAlloc` / `cudaMalloc`: a legacy CUDA IPC handle exports it.
    Plain,
    /// Stream-ordered pool memory (`cuMemAllocAsync` / `cudaMallocAsync`, cudarc's `CudaSlice`
    /// on devices with memory pools).
    Pool,
    /// Managed (unified) memory (`cuMemAllocManaged`).
    Managed,
    /// `cuMemCreate` + `cuMemMap`; `posix_fd` when the allocation was created with
    /// `CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR`.
    Vmm { posix_fd: bool },
}

/// What the driver says about a device pointer.
#[derive(Clone, Debug)]
pub(crate) struct PointerInfo {
    pub(crate) ordinal: u32,
    /// The allocation (for VMM memory: the mapping) holding the pointer.
    pub(crate) base: u64,
    pub(crate) size: u64,
    pub(crate) kind: AllocKind,
}

/// Reads one attribute into a zeroed 8-byte word (every attribute asked for here is at most
/// 8 bytes: ints, booleans, pointers, sizes, bit masks).
fn attr(a: sys::CUpointer_attribute, ptr: u64) -> std::result::Result<u64, sys::CUresult> {
    let mut v: u64 = 0;
    // SAFETY: v is an 8-byte writable word, at least as large as any attribute read here.
    let r = unsafe { sys::cuPointerGetAttribute((&mut v as *mut u64).cast::<c_void>(), a, ptr) };
    if r == sys::CUresult::CUDA_SUCCESS { Ok(v) } else { Err(r) }
}

/// What the driver knows of `[ptr, ptr + len)`: its device, its allocation, how it was made.
///
/// # Errors
/// `NotAvailable` without a driver; `InvalidUsage` for a pointer the driver does not know (not
/// device memory of this process), host memory, or a range past the end of its allocation.
pub(crate) fn pointer_info(ptr: u64, len: u64) -> Result<PointerInfo> {
    use sys::CUpointer_attribute as A;
    init()?;
    // Pointer queries need a current context (any: addresses are unified); bind GPU 0's primary
    // context where the calling thread has none.
    if cudarc::driver::result::ctx::get_current().ok().flatten().is_none() {
        device(0)?.bind()?;
    }
    let mt = match attr(A::CU_POINTER_ATTRIBUTE_MEMORY_TYPE, ptr) {
        Ok(v) => v,
        Err(r) => {
            return Err(Error::invalid_usage(format!(
                "{ptr:#x} is not memory the CUDA driver knows in this process ({r:?}): register device memory \
                 allocated here (cuMemAlloc, cudaMalloc, cuMemCreate+cuMemMap, torch, cudarc), and host memory \
                 with register_host"
            )));
        }
    };
    let managed = attr(A::CU_POINTER_ATTRIBUTE_IS_MANAGED, ptr).unwrap_or(0) != 0;
    if mt == sys::CUmemorytype::CU_MEMORYTYPE_HOST as u64 && !managed {
        return Err(Error::invalid_usage(format!(
            "{ptr:#x} is page-locked host memory, not device memory: register it with register_host"
        )));
    }
    let ordinal = attr(A::CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL, ptr)
        .map_err(|r| Error::new(ErrorKind::Cuda, format!("cuPointerGetAttribute(DEVICE_ORDINAL) of {ptr:#x}: {r:?}")))?
        as u32;
    let pool = attr(A::CU_POINTER_ATTRIBUTE_MEMPOOL_HANDLE, ptr).unwrap_or(0) != 0;
    let legacy = attr(A::CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE, ptr).unwrap_or(0) != 0;
    let kind = if managed {
        AllocKind::Managed
    } else if pool {
        AllocKind::Pool
    } else if legacy {
        AllocKind::Plain
    } else {
        let types = attr(A::CU_POINTER_ATTRIBUTE_ALLOWED_HANDLE_TYPES, ptr).unwrap_or(0);
        let fd = sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR.0 as u64;
        AllocKind::Vmm { posix_fd: types & fd != 0 }
    };
    let dev = device(ordinal)?;
    dev.bind()?;
    let (base, size) = match kind {
        // The mapping of the one allocation handle that holds the pointer.
        AllocKind::Vmm { .. } => match (
            attr(A::CU_POINTER_ATTRIBUTE_MAPPING_BASE_ADDR, ptr),
            attr(A::CU_POINTER_ATTRIBUTE_MAPPING_SIZE, ptr),
        ) {
            (Ok(b), Ok(s)) if s > 0 => (b, s),
            _ => address_range(ptr)?,
        },
        _ => address_range(ptr)?,
    };
    let end = ptr.checked_add(len);
    if ptr < base || end.is_none_or(|e| e > base + size) {
        let what =
            if matches!(kind, AllocKind::Vmm { .. }) { "mapping (one cuMemCreate handle)" } else { "allocation" };
        return Err(Error::invalid_usage(format!(
            "[{ptr:#x}, +{len}) extends past its {what} [{base:#x}, +{size}) on GPU{ordinal}: register each \
             allocation separately"
        )));
    }
    Ok(PointerInfo { ordinal, base, size, kind })
}

fn address_range(ptr: u64) -> Result<(u64, u64)> {
    let mut base: sys::CUdeviceptr = 0;
    let mut size: usize = 0;
    // SAFETY: out-pointers to locals; the driver checks ptr.
    check("cuMemGetAddressRange", unsafe { sys::cuMemGetAddressRange_v2(&mut base, &mut size, ptr) })?;
    Ok((base, size as u64))
}

impl PointerInfo {
    /// Why this memory cannot be shared through CUDA IPC, if it cannot.
    pub(crate) fn ipc_refusal(&self) -> Option<String> {
        match self.kind {
            AllocKind::Plain | AllocKind::Vmm { posix_fd: true } => None,
            AllocKind::Pool => Some(
                "it is stream-ordered pool memory (cuMemAllocAsync / cudaMallocAsync, also what cudarc's CudaSlice \
                 uses on GPUs with memory pools), which has no legacy CUDA IPC handle: register it for Ethernet or \
                 IB only, or allocate with cuMemAlloc / cudaMalloc, or with cuMemCreate and \
                 CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR"
                    .into(),
            ),
            AllocKind::Managed => Some(
                "it is managed (unified) memory (cuMemAllocManaged), which CUDA IPC cannot export: register it \
                 for Ethernet or IB only"
                    .into(),
            ),
            AllocKind::Vmm { posix_fd: false } => Some(
                "it was created with cuMemCreate without CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR in \
                 requestedHandleTypes, so no process can import it: create it with that handle type, or \
                 register it for Ethernet or IB only"
                    .into(),
            ),
        }
    }

    /// A region over `[ptr, ptr + len)` that keeps `keeper` alive (the registration's owner).
    pub(crate) fn region(&self, ptr: u64, len: usize, keeper: Option<Arc<dyn Send + Sync>>) -> Result<GpuRegion> {
        let dev = device(self.ordinal)?;
        Ok(GpuRegion::user(dev, ptr, len, keeper))
    }
}

/// A `cuMemCreate` allocation exported as a POSIX file descriptor, kept open while the
/// registration lives: a peer of this host takes a copy with `pidfd_getfd`.
#[derive(Debug)]
pub(crate) struct VmmExport {
    /// Open while the registration lives (a peer copies it by number).
    _fd: OwnedFd,
}

/// What a peer needs to map VMM memory: the owner's pid and start time (to find the process),
/// the exported descriptor's number there, the mapping's size, the registered range's offset in
/// it, and the owner's device.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct VmmInfo {
    pub(crate) pid: u32,
    pub(crate) start_time: u64,
    pub(crate) fd: i32,
    pub(crate) size: u64,
    pub(crate) offset: u64,
    pub(crate) device: u32,
}

/// Bytes of a [`VmmInfo`] on the wire.
pub(crate) const VMM_INFO_BYTES: usize = 36;

impl VmmInfo {
    pub(crate) fn encode(&self) -> Vec<u8> {
        let mut v = Vec::with_capacity(VMM_INFO_BYTES);
        v.extend_from_slice(&self.pid.to_le_bytes());
        v.extend_from_slice(&self.start_time.to_le_bytes());
        v.extend_from_slice(&self.fd.to_le_bytes());
        v.extend_from_slice(&self.size.to_le_bytes());
        v.extend_from_slice(&self.offset.to_le_bytes());
        v.extend_from_slice(&self.device.to_le_bytes());
        v
    }

    pub(crate) fn decode(b: &[u8]) -> Result<VmmInfo> {
        if b.len() != VMM_INFO_BYTES {
            return Err(Error::invalid_usage(format!("VMM info of {} bytes (expected {VMM_INFO_BYTES})", b.len())));
        }
        let u32_at = |i: usize| u32::from_le_bytes([b[i], b[i + 1], b[i + 2], b[i + 3]]);
        let u64_at = |i: usize| {
            let mut w = [0u8; 8];
            w.copy_from_slice(&b[i..i + 8]);
            u64::from_le_bytes(w)
        };
        let info = VmmInfo {
            pid: u32_at(0),
            start_time: u64_at(4),
            fd: u32_at(12) as i32,
            size: u64_at(16),
            offset: u64_at(24),
            device: u32_at(32),
        };
        if info.fd < 0 || info.offset >= info.size.max(1) {
            return Err(Error::invalid_usage("VMM info: negative descriptor or offset beyond the mapping"));
        }
        Ok(info)
    }
}

/// Exports the `cuMemCreate` allocation behind `ptr` (described by `info`) as a POSIX file
/// descriptor, and says what a peer needs to map `[ptr, ..)`.
pub(crate) fn vmm_export(info: &PointerInfo, ptr: u64) -> Result<(VmmExport, VmmInfo)> {
    let dev = device(info.ordinal)?;
    dev.bind()?;
    let mut h: sys::CUmemGenericAllocationHandle = 0;
    // SAFETY: h is an out-pointer to a local; ptr lies in a live cuMemMap mapping (checked by
    // pointer_info). The retained handle is released below.
    check("cuMemRetainAllocationHandle", unsafe { sys::cuMemRetainAllocationHandle(&mut h, ptr as *mut c_void) })?;
    let mut fd: i32 = -1;
    // SAFETY: for POSIX_FILE_DESCRIPTOR the driver writes an int descriptor through the pointer;
    // fd is a writable local int.
    let r = unsafe {
        sys::cuMemExportToShareableHandle(
            (&mut fd as *mut i32).cast::<c_void>(),
            h,
            sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
            0,
        )
    };
    // SAFETY: h was retained above and is released once; the user's mapping keeps the
    // allocation alive.
    let rel = unsafe { sys::cuMemRelease(h) };
    check("cuMemExportToShareableHandle(POSIX_FILE_DESCRIPTOR)", r)?;
    if rel != sys::CUresult::CUDA_SUCCESS {
        tracing::warn!(target: LOG, "cuMemRelease of a retained handle: {rel:?}");
    }
    if fd < 0 {
        return Err(Error::new(ErrorKind::Cuda, "cuMemExportToShareableHandle returned no file descriptor"));
    }
    // SAFETY: the driver returned a new descriptor that nothing else owns.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    let vi = VmmInfo {
        pid: std::process::id(),
        start_time: crate::platform::pidfd::start_time(std::process::id()).unwrap_or(0),
        fd: fd.as_raw_fd(),
        size: info.size,
        offset: ptr - info.base,
        device: info.ordinal,
    };
    Ok((VmmExport { _fd: fd }, vi))
}

/// A peer's `cuMemCreate` allocation mapped into this process; unmapped and released on drop.
pub(crate) struct VmmMapping {
    pub(crate) base: u64,
    size: u64,
    handle: sys::CUmemGenericAllocationHandle,
    dev: Arc<GpuDevice>,
}

// SAFETY: the mapping is a device address range and a driver handle, usable from any thread
// with the context bound (Drop binds it).
unsafe impl Send for VmmMapping {}
// SAFETY: as above; nothing is mutated after creation.
unsafe impl Sync for VmmMapping {}

impl Drop for VmmMapping {
    fn drop(&mut self) {
        if self.dev.bind().is_ok() {
            // SAFETY: base..base+size was reserved and mapped by vmm_open and is unmapped, freed
            // and released once here (the last user holds the only Arc).
            unsafe {
                let r1 = sys::cuMemUnmap(self.base, self.size as usize);
                let r2 = sys::cuMemAddressFree(self.base, self.size as usize);
                let r3 = sys::cuMemRelease(self.handle);
                if [r1, r2, r3].iter().any(|r| *r != sys::CUresult::CUDA_SUCCESS) {
                    tracing::warn!(target: LOG, "unmapping a peer's VMM memory: {r1:?} {r2:?} {r3:?}");
                }
            }
        }
    }
}

/// A copy of the owner's exported descriptor: `pidfd_getfd(2)`, else opening
/// `/proc/<pid>/fd/<n>` (which needs only ptrace read access, allowed where attaching is not).
fn take_fd(owner: &crate::platform::pidfd::PidFd, info: &VmmInfo) -> Result<OwnedFd> {
    let e1 = match owner.get_fd(info.fd) {
        Ok(fd) => return Ok(fd),
        Err(e) => e,
    };
    let path = format!("/proc/{}/fd/{}", info.pid, info.fd);
    match std::fs::OpenOptions::new().read(true).write(true).open(&path) {
        Ok(f) => {
            tracing::debug!(target: LOG, "VMM descriptor taken by opening {path} ({e1})");
            Ok(OwnedFd::from(f))
        }
        Err(e2) => Err(Error::new(
            ErrorKind::System,
            format!("cannot take the owner's descriptor: {}; opening {path}: {e2}", e1.message()),
        )),
    }
}

/// Maps a peer's VMM allocation on `dev`: takes a copy of its descriptor (`pidfd_getfd`),
/// imports it, reserves an address range, maps it and grants `dev` read-write access.
pub(crate) fn vmm_open(info: &VmmInfo, dev: &Arc<GpuDevice>) -> Result<Arc<VmmMapping>> {
    let during = |e: Error| e.during(format!("mapping the peer's cuMemCreate memory (process {})", info.pid));
    let owner =
        crate::platform::pidfd::PidFd::open(info.pid, Some(info.start_time).filter(|s| *s != 0)).map_err(during)?;
    let fd = take_fd(&owner, info).map_err(during)?;
    dev.bind()?;
    let mut handle: sys::CUmemGenericAllocationHandle = 0;
    // SAFETY: for POSIX_FILE_DESCRIPTOR the "OS handle" argument is the descriptor's value cast
    // to a pointer (the driver's convention); fd stays open during the call and is closed after
    // (the import holds its own reference).
    check("cuMemImportFromShareableHandle(POSIX_FILE_DESCRIPTOR)", unsafe {
        sys::cuMemImportFromShareableHandle(
            &mut handle,
            fd.as_raw_fd() as isize as *mut c_void,
            sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
        )
    })
    .map_err(during)?;
    drop(fd);
    let size = info.size as usize;
    let mut va: sys::CUdeviceptr = 0;
    // SAFETY: va is an out-pointer to a local; a fresh reservation of `size` bytes.
    let r = unsafe { sys::cuMemAddressReserve(&mut va, size, 0, 0, 0) };
    if let Err(e) = r.result() {
        // SAFETY: handle was imported above and is released once on this error path.
        unsafe { sys::cuMemRelease(handle) };
        return Err(during(cuda_err("cuMemAddressReserve", e)));
    }
    // SAFETY: [va, va+size) is our fresh reservation; the handle's allocation is `size` bytes.
    let r = unsafe { sys::cuMemMap(va, size, 0, handle, 0) };
    if let Err(e) = r.result() {
        // SAFETY: undo the reservation and import once on this error path.
        unsafe {
            sys::cuMemAddressFree(va, size);
            sys::cuMemRelease(handle);
        }
        return Err(during(cuda_err("cuMemMap", e)));
    }
    let m = Arc::new(VmmMapping { base: va, size: info.size, handle, dev: dev.clone() });
    let access = sys::CUmemAccessDesc {
        location: sys::CUmemLocation {
            type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE,
            id: dev.ordinal as i32,
        },
        flags: sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
    };
    // SAFETY: [va, va+size) is mapped (m unmaps it on error by Drop); one access descriptor.
    check("cuMemSetAccess", unsafe { sys::cuMemSetAccess(va, size, &access, 1) }).map_err(during)?;
    Ok(m)
}

/// The GPU holding `[ptr, ptr + len)`, checked with three driver queries (memory type, device,
/// allocation range): the light check a collective makes of every buffer it is handed.
///
/// # Errors
/// `NotAvailable` without a driver; `InvalidUsage` (naming `what`) for a pointer the driver does
/// not know, host memory, or a range that runs past its allocation.
pub fn check_device_range(ptr: u64, len: u64, what: &str) -> Result<u32> {
    use sys::CUpointer_attribute as A;
    init()?;
    if cudarc::driver::result::ctx::get_current().ok().flatten().is_none() {
        device(0)?.bind()?;
    }
    let mt = attr(A::CU_POINTER_ATTRIBUTE_MEMORY_TYPE, ptr).map_err(|r| {
        Error::invalid_usage(format!(
            "{what} {ptr:#x} is not device memory the CUDA driver knows in this process ({r:?})"
        ))
    })?;
    if mt != sys::CUmemorytype::CU_MEMORYTYPE_DEVICE as u64 {
        return Err(Error::invalid_usage(format!("{what} {ptr:#x} is host memory, not device memory")));
    }
    let ordinal = attr(A::CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL, ptr)
        .map_err(|r| Error::new(ErrorKind::Cuda, format!("cuPointerGetAttribute(DEVICE_ORDINAL) of {ptr:#x}: {r:?}")))?
        as u32;
    let (base, size) = address_range(ptr)?;
    if ptr.checked_add(len).is_none_or(|e| e > base + size) {
        return Err(Error::invalid_usage(format!(
            "{what} [{ptr:#x}, +{len}) runs past the end of its allocation [{base:#x}, +{size}) on GPU{ordinal}"
        )));
    }
    Ok(ordinal)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn vmm_info_round_trip_and_checks() {
        let i = VmmInfo { pid: 42, start_time: 7, fd: 9, size: 2 << 20, offset: 4096, device: 1 };
        assert_eq!(VmmInfo::decode(&i.encode()).unwrap(), i);
        assert!(VmmInfo::decode(&i.encode()[1..]).is_err());
        let bad = VmmInfo { offset: 2 << 20, ..i.clone() };
        assert!(VmmInfo::decode(&bad.encode()).is_err());
        let neg = VmmInfo { fd: -1, ..i };
        assert!(VmmInfo::decode(&neg.encode()).is_err());
    }

    #[test]
    fn every_refusal_names_why() {
        let p = |kind| PointerInfo { ordinal: 0, base: 0, size: 1, kind };
        assert!(p(AllocKind::Plain).ipc_refusal().is_none());
        assert!(p(AllocKind::Vmm { posix_fd: true }).ipc_refusal().is_none());
        assert!(p(AllocKind::Pool).ipc_refusal().unwrap().contains("cuMemAllocAsync"));
        assert!(p(AllocKind::Managed).ipc_refusal().unwrap().contains("managed"));
        assert!(p(AllocKind::Vmm { posix_fd: false }).ipc_refusal().unwrap().contains("POSIX_FILE_DESCRIPTOR"));
    }
}
