//! Registered memory: what a peer may write into, and its serialized form.

use std::fmt;
use std::sync::{Arc, OnceLock};

use crate::context::Context;
pub(crate) use crate::context::{LocalRegion, Mem};
use crate::error::{Error, Result};
use crate::platform::cuda::IpcInfo;
use crate::platform::cuda::usermem::{VMM_INFO_BYTES, VmmInfo};
use crate::platform::hostmem::Region;
use crate::transport::{Device, Transport, TransportFlags};
use crate::wire::{Reader, WireForm, Writer};

const MAGIC: &[u8; 4] = b"MSRM";
const VERSION: u16 = 1;
/// Bytes of an [`IpcInfo`] on the wire.
const IPC_INFO_BYTES: usize = 84;

/// An IB memory region as a peer needs it: the address and the remote key.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct IbMrInfo {
    /// Address of the registered range in the owner's process.
    pub addr: u64,
    /// Remote key.
    pub rkey: u32,
}

/// What a `RegisteredMemory` says about itself on the wire.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct MemoryDesc {
    pub(crate) addr: u64,
    pub(crate) len: u64,
    pub(crate) region_id: u64,
    pub(crate) context_id: u64,
    pub(crate) host_hash: u64,
    pub(crate) process_hash: u64,
    pub(crate) transports: TransportFlags,
    pub(crate) device: Device,
    /// CUDA IPC export (filled by the CUDA transport).
    pub(crate) cuda_ipc: Option<IpcInfo>,
    /// Export of `cuMemCreate` memory through a POSIX file descriptor (instead of `cuda_ipc`).
    pub(crate) vmm: Option<VmmInfo>,
    /// Per-IB-transport MR info (filled by the IB transport).
    pub(crate) ib: [Option<IbMrInfo>; 8],
}

struct MemInner {
    desc: MemoryDesc,
    local: Option<Arc<LocalRegion>>,
    /// A peer's GPU memory mapped into this process through CUDA IPC (a legacy handle or a VMM
    /// descriptor) on first use (kept alive while this handle lives).
    import: OnceLock<Arc<dyn Send + Sync>>,
    /// The address of this GPU memory in this process, once resolved (the hot path of every
    /// CUDA IPC operation reads only this).
    resolved: OnceLock<u64>,
}

/// Memory that connections may read from or write into: a local registration, or a peer's
/// received through [`RegisteredMemory::deserialize`] (usually via
/// [`Communicator::recv_memory`](crate::Communicator::recv_memory)).
///
/// A cheap-clone handle. A local registration stays in its context's table (so peers may write
/// into it) until the last clone is dropped.
///
/// C++ MSCCL++: `RegisteredMemory`.
#[derive(Clone)]
pub struct RegisteredMemory {
    inner: Arc<MemInner>,
}

impl PartialEq for RegisteredMemory {
    /// Two handles are equal when they describe the same memory (same serialized form).
    fn eq(&self, other: &Self) -> bool {
        self.inner.desc == other.inner.desc
    }
}
impl Eq for RegisteredMemory {}

impl fmt::Debug for RegisteredMemory {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let d = &self.inner.desc;
        f.debug_struct("RegisteredMemory")
            .field("addr", &format_args!("{:#x}", d.addr))
            .field("len", &d.len)
            .field("transports", &d.transports)
            .field("device", &d.device)
            .field("local", &self.is_local())
            .finish()
    }
}

impl RegisteredMemory {
    pub(crate) fn new_local(ctx: &Context, region: Region, transports: TransportFlags, device: Device) -> Result<Self> {
        Self::new_local_mem(ctx, Mem::Host(region), transports, device, None, None)
    }

    pub(crate) fn new_local_gpu(
        ctx: &Context,
        region: crate::platform::cuda::GpuRegion,
        transports: TransportFlags,
        ipc: Option<IpcInfo>,
    ) -> Result<Self> {
        let dev = Device::Gpu(region.dev.ordinal);
        Self::new_local_mem(ctx, Mem::Gpu(region), transports, dev, ipc, None)
    }

    fn new_local_mem(
        ctx: &Context,
        region: Mem,
        transports: TransportFlags,
        device: Device,
        cuda_ipc: Option<IpcInfo>,
        vmm: Option<VmmInfo>,
    ) -> Result<Self> {
        let inner = ctx.inner();
        let id = inner.next_region_id();
        let mut ib_mrs: [Option<Arc<crate::platform::verbs::dev::IbMr>>; 8] = Default::default();
        let mut ib = [None; 8];
        for t in (transports & TransportFlags::ALL_IB).iter() {
            let i = t.ib_index().unwrap_or(0);
            let during = |e: Error| e.during(format!("registering memory for {t}"));
            let mr = match &region {
                Mem::Host(r) => {
                    let dev = inner.ib_device(t, Device::Cpu).map_err(during)?;
                    dev.reg_mr(r.addr() as u64, r.len() as u64).map_err(during)?
                }
                Mem::Gpu(g) => {
                    let dev = inner.ib_device(t, Device::Gpu(g.dev.ordinal)).map_err(during)?;
                    crate::platform::cuda::reg_ib_mr(&dev, g).map_err(during)?
                }
            };
            ib[i] = Some(IbMrInfo { addr: mr.addr, rkey: mr.rkey });
            ib_mrs[i] = Some(Arc::new(mr));
        }
        let desc = MemoryDesc {
            addr: region.addr(),
            len: region.len(),
            region_id: id,
            context_id: inner.id,
            host_hash: crate::identity::host_hash(),
            process_hash: crate::identity::process_hash(),
            transports,
            device,
            cuda_ipc,
            vmm,
            ib,
        };
        let local = Arc::new(LocalRegion { ib_mrs, mem: region, id, transports, ctx: Arc::downgrade(inner) });
        inner.remember_region(&local);
        Ok(RegisteredMemory {
            inner: Arc::new(MemInner { desc, local: Some(local), import: OnceLock::new(), resolved: OnceLock::new() }),
        })
    }

    /// The address of the memory in its owner's process.
    pub fn addr(&self) -> u64 {
        self.inner.desc.addr
    }
    /// The length in bytes.
    pub fn len(&self) -> u64 {
        self.inner.desc.len
    }
    /// Whether the length is zero.
    pub fn is_empty(&self) -> bool {
        self.inner.desc.len == 0
    }
    /// The transports peers may use to reach this memory.
    pub fn transports(&self) -> TransportFlags {
        self.inner.desc.transports
    }
    /// Where the memory lives.
    pub fn device(&self) -> Device {
        self.inner.desc.device
    }
    /// The owner's host hash (see [`host_hash`](crate::host_hash)).
    pub fn host_hash(&self) -> u64 {
        self.inner.desc.host_hash
    }
    /// The owner's process hash (see [`process_hash`](crate::process_hash)).
    pub fn process_hash(&self) -> u64 {
        self.inner.desc.process_hash
    }
    /// Whether this handle is a registration made in this process (not a received copy).
    pub fn is_local(&self) -> bool {
        self.inner.local.is_some()
    }
    /// The IB MR info for `t`, if the owner registered it.
    pub fn ib_info(&self, t: Transport) -> Option<IbMrInfo> {
        t.ib_index().and_then(|i| self.inner.desc.ib[i])
    }

    pub(crate) fn desc(&self) -> &MemoryDesc {
        &self.inner.desc
    }
    pub(crate) fn local(&self) -> Option<&Arc<LocalRegion>> {
        self.inner.local.as_ref()
    }

    /// The address of this GPU memory usable on `dev` in this process: the local pointer, the
    /// owner's pointer when the owner is this process, or a CUDA IPC mapping opened on first use
    /// (kept while any clone of this handle lives).
    pub(crate) fn gpu_ptr(&self, dev: &Arc<crate::platform::cuda::GpuDevice>) -> Result<u64> {
        if let Some(p) = self.inner.resolved.get() {
            return Ok(*p);
        }
        let p = self.resolve_gpu_ptr(dev)?;
        Ok(*self.inner.resolved.get_or_init(|| p))
    }

    fn resolve_gpu_ptr(&self, dev: &Arc<crate::platform::cuda::GpuDevice>) -> Result<u64> {
        if let Some(l) = self.local() {
            return match &l.mem {
                Mem::Gpu(g) => Ok(g.ptr),
                Mem::Host(_) => Err(Error::invalid_usage("this memory is host memory, not GPU memory")),
            };
        }
        let d = &self.inner.desc;
        if !matches!(d.device, Device::Gpu(_)) {
            return Err(Error::invalid_usage("the peer's memory is host memory; CUDA IPC needs GPU memory"));
        }
        if d.host_hash != crate::identity::host_hash() {
            return Err(Error::invalid_usage("the peer's memory is on another host; CUDA IPC works within one host"));
        }
        if d.process_hash == crate::identity::process_hash() {
            return Ok(d.addr);
        }
        let (base, offset, keep): (u64, u64, Arc<dyn Send + Sync>) = match (&d.cuda_ipc, &d.vmm) {
            (Some(info), _) => {
                let m = crate::platform::cuda::ipc_open(info, dev)?;
                if info.offset.checked_add(d.len).is_none_or(|e| e > m.size) {
                    return Err(Error::invalid_usage("the peer's memory extends past its CUDA allocation"));
                }
                (m.base, info.offset, m)
            }
            (None, Some(info)) => {
                if info.offset.checked_add(d.len).is_none_or(|e| e > info.size) {
                    return Err(Error::invalid_usage("the peer's memory extends past its cuMemCreate allocation"));
                }
                let m = crate::platform::cuda::usermem::vmm_open(info, dev)?;
                (m.base, info.offset, m)
            }
            (None, None) => {
                return Err(Error::invalid_usage(
                    "the peer's memory carries no CUDA IPC handle (registered without Transport::CudaIpc)",
                ));
            }
        };
        self.inner.import.get_or_init(|| keep);
        Ok(base + offset)
    }

    /// Checks that `[offset, offset + len)` is inside this memory.
    pub(crate) fn check_bounds(&self, offset: u64, len: u64) -> Result<()> {
        crate::platform::check_range(offset, len, self.len(), "registered memory")
    }

    /// The serialized form, to send to a peer.
    pub fn serialize(&self) -> Vec<u8> {
        let d = &self.inner.desc;
        let mut w = Writer::new(MAGIC, VERSION);
        w.u64(d.addr);
        w.u64(d.len);
        w.u64(d.region_id);
        w.u64(d.context_id);
        w.u64(d.host_hash);
        w.u64(d.process_hash);
        w.u16(d.transports.bits());
        put_device(&mut w, d.device);
        match (&d.cuda_ipc, &d.vmm) {
            (Some(info), _) => {
                w.u8(1);
                // A length in front (always IPC_INFO_BYTES today) keeps the form open to longer
                // handles (fabric handles) in a later version.
                // 84 bytes: never over the 4 GiB a length field holds.
                let _ = w.bytes(&info.to_wire());
            }
            (None, Some(info)) => {
                w.u8(2);
                // 36 bytes: never over the 4 GiB a length field holds.
                let _ = w.bytes(&info.to_wire());
            }
            (None, None) => w.u8(0),
        }
        let n = d.ib.iter().filter(|x| x.is_some()).count() as u8;
        w.u8(n);
        for (i, info) in d.ib.iter().enumerate() {
            if let Some(info) = info {
                w.u8(i as u8);
                w.u64(info.addr);
                w.u32(info.rkey);
            }
        }
        w.finish()
    }

    /// Rebuilds a peer's memory from [`serialize`](Self::serialize)d bytes.
    ///
    /// # Errors
    /// `InvalidUsage` for any input that is not a well-formed serialized memory (never panics).
    pub fn deserialize(bytes: &[u8]) -> Result<RegisteredMemory> {
        let mut r = Reader::new(bytes, "serialized RegisteredMemory", MAGIC, VERSION)?;
        let addr = r.u64()?;
        let len = r.u64()?;
        let region_id = r.u64()?;
        let context_id = r.u64()?;
        let host_hash = r.u64()?;
        let process_hash = r.u64()?;
        let bits = r.u16()?;
        let transports =
            TransportFlags::from_bits(bits).ok_or_else(|| r.err(format!("unknown transport bits {bits:#x}")))?;
        let device = get_device(&mut r)?;
        let (cuda_ipc, vmm) = match r.u8()? {
            0 => (None, None),
            1 => {
                let b = r.bytes()?;
                if b.len() != IPC_INFO_BYTES {
                    return Err(r.err(format!("CUDA IPC info of {} bytes (expected {IPC_INFO_BYTES})", b.len())));
                }
                (Some(IpcInfo::from_wire(b).map_err(|e| r.err(e.message()))?), None)
            }
            2 => {
                let b = r.bytes()?;
                if b.len() != VMM_INFO_BYTES {
                    return Err(r.err(format!("VMM info of {} bytes (expected {VMM_INFO_BYTES})", b.len())));
                }
                (None, Some(VmmInfo::from_wire(b).map_err(|e| r.err(e.message()))?))
            }
            x => return Err(r.err(format!("bad CUDA IPC presence byte {x}"))),
        };
        let mut ib = [None; 8];
        let n = r.u8()?;
        let mut next = 0;
        for _ in 0..n {
            // Entries come in increasing index order (the only order serialize writes).
            let i = r.u8()? as usize;
            if i >= 8 || i < next {
                return Err(r.err(format!("IB index {i} is out of range or out of order")));
            }
            ib[i] = Some(IbMrInfo { addr: r.u64()?, rkey: r.u32()? });
            next = i + 1;
        }
        r.finish()?;
        if addr.checked_add(len).is_none() {
            return Err(Error::invalid_usage("malformed serialized RegisteredMemory: address + length overflows"));
        }
        let desc = MemoryDesc {
            addr,
            len,
            region_id,
            context_id,
            host_hash,
            process_hash,
            transports,
            device,
            cuda_ipc,
            vmm,
            ib,
        };
        Ok(RegisteredMemory {
            inner: Arc::new(MemInner { desc, local: None, import: OnceLock::new(), resolved: OnceLock::new() }),
        })
    }
}

impl WireForm for RegisteredMemory {
    const WHAT: &'static str = "serialized RegisteredMemory";
    fn to_wire(&self) -> Vec<u8> {
        self.serialize()
    }
    fn from_wire(bytes: &[u8]) -> Result<Self> {
        Self::deserialize(bytes)
    }
}

/// The CUDA IPC export inside a serialized GPU memory: 84 bytes (handle, allocation size, offset
/// of the range, owner's device).
impl WireForm for IpcInfo {
    const WHAT: &'static str = "CUDA IPC info";
    fn to_wire(&self) -> Vec<u8> {
        self.encode()
    }
    fn from_wire(bytes: &[u8]) -> Result<Self> {
        IpcInfo::decode(bytes)
    }
}

/// The POSIX-descriptor export of `cuMemCreate` memory inside a serialized GPU memory: 36 bytes
/// (owner's pid and start time, descriptor number, mapping size, offset of the range, device).
impl WireForm for VmmInfo {
    const WHAT: &'static str = "VMM info";
    fn to_wire(&self) -> Vec<u8> {
        self.encode()
    }
    fn from_wire(bytes: &[u8]) -> Result<Self> {
        VmmInfo::decode(bytes)
    }
}

/// Registration: `Context`'s methods that make a [`RegisteredMemory`] from memory the caller owns
/// (defined here, beside `RegisteredMemory`, because `context` sits below `memory` in the layers).
impl Context {
    /// Registers caller-owned host memory for `transports`.
    ///
    /// Prefer [`Buffer::new`](crate::Buffer::new), which owns its memory and is safe.
    ///
    /// # Safety
    /// 1. `[ptr, ptr + len)` must be valid for reads and writes until the returned handle, every
    ///    clone of it, and every connection operation using it (until its `flush` returns) are
    ///    gone.
    /// 2. While it is registered, peers may write into it at any time: the caller must not hold
    ///    Rust references (`&[u8]`, `&mut [u8]`) to the memory while peers can write it.
    ///
    /// # Errors
    /// `InvalidUsage` for a null pointer, zero length, or a transport host memory cannot use.
    #[allow(unsafe_code)]
    pub unsafe fn register_host(
        &self,
        ptr: *mut u8,
        len: usize,
        transports: TransportFlags,
    ) -> Result<RegisteredMemory> {
        check_host_transports(transports)?;
        if ptr.is_null() || len == 0 {
            return Err(Error::invalid_usage("cannot register a null pointer or an empty range"));
        }
        if (ptr as usize).checked_add(len).is_none() {
            return Err(Error::invalid_usage("pointer + length overflows the address space"));
        }
        // SAFETY: the caller upholds the lifetime rule above, which is Region::from_raw's contract.
        let region = unsafe { Region::from_raw(ptr, len) };
        RegisteredMemory::new_local(self, region, transports, Device::Cpu)
    }

    /// Registers GPU memory the caller allocated (a KV cache, a torch tensor's storage, memory
    /// from `cudaMalloc`, `cuMemCreate` or a pool) for `transports`: MSCCL++'s
    /// `registerMemory(ptr, size, transports)` for device pointers.
    ///
    /// The driver is asked about `ptr` (`cuPointerGetAttribute`): its device (the registration's
    /// [`Device`]), the allocation holding it (the range must lie inside one allocation; a range
    /// in the middle of one is exported as the allocation's handle plus the offset), and how it
    /// was made, which decides whether CUDA IPC can share it:
    ///
    /// | memory | CUDA IPC | Ethernet, IB |
    /// |---|---|---|
    /// | `cuMemAlloc`, `cudaMalloc` (torch's caching allocator) | legacy IPC handle | yes |
    /// | `cuMemCreate` with `CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR` | a POSIX descriptor, taken by the peer with `pidfd_getfd(2)` (same host, and the peer may ptrace this process) | yes |
    /// | `cuMemCreate` without that handle type | refused, naming why | yes |
    /// | pool memory (`cuMemAllocAsync`, `cudaMallocAsync`), managed memory | refused, naming why | yes |
    ///
    /// Ethernet copies through the GPU (pinned staging); IB registers a dma-buf of the
    /// allocation, else the pointer itself (nvidia-peermem), as for [`DeviceBuffer`](crate::DeviceBuffer).
    ///
    /// ```no_run
    /// use mscclpp::{Context, Transport};
    /// # fn user_alloc(len: usize) -> u64 { unimplemented!() }
    /// let ctx = Context::new();
    /// let len = 1 << 20;
    /// let ptr: u64 = user_alloc(len); // e.g. torch's tensor.data_ptr(), or cuMemAlloc
    /// // SAFETY: the allocation outlives the registration and every operation that uses it.
    /// let mem = unsafe { ctx.register_device(ptr, len, Transport::CudaIpc | Transport::Ethernet)? };
    /// assert_eq!(mem.len(), len as u64);
    /// // send `mem` to peers with Communicator::send_memory
    /// # Ok::<(), mscclpp::Error>(())
    /// ```
    ///
    /// # Safety
    /// 1. `[ptr, ptr + len)` must stay allocated (not freed, not unmapped) until the returned
    ///    handle, every clone of it, every peer's use of it, and every connection operation using
    ///    it (until its `flush` returns) are gone.
    /// 2. While it is registered, peers may write into it at any time: the caller orders its own
    ///    kernels and copies against peers' writes (through semaphores), as with any registered
    ///    memory.
    ///
    /// # Errors
    /// `InvalidUsage` for a null pointer, zero length, an overflowing range, a pointer the driver
    /// does not know, host memory, a range past its allocation, or CUDA IPC asked for memory it
    /// cannot share (the message says why); `NotAvailable` without a CUDA driver; `Cuda` when an
    /// export fails.
    #[allow(unsafe_code)]
    pub unsafe fn register_device(&self, ptr: u64, len: usize, transports: TransportFlags) -> Result<RegisteredMemory> {
        register_gpu(self, ptr, len, transports, None)
    }

    /// Registers a cudarc [`CudaSlice`](cudarc::driver::CudaSlice) for `transports`, safely: the
    /// registration keeps the slice (and so its memory) alive until the last clone of the
    /// returned handle and every peer's use through it are gone. Work queued on the slice's
    /// stream is waited for first. Feature `cudarc-slice`.
    ///
    /// cudarc allocates with `cuMemAllocAsync` where the GPU has memory pools (every recent GPU),
    /// and pool memory has no CUDA IPC handle: such a slice registers for Ethernet and IB, and
    /// asking for CUDA IPC is an `InvalidUsage` error saying so (see
    /// [`register_device`](Self::register_device)).
    ///
    /// ```no_run
    /// use std::sync::Arc;
    /// use mscclpp::{Context, Transport};
    /// let cuda = cudarc::driver::CudaContext::new(0).unwrap();
    /// let slice = cuda.default_stream().alloc_zeros::<f32>(1 << 20).unwrap();
    /// let ctx = Context::new();
    /// let mem = ctx.register_cuda_slice(Arc::new(slice), Transport::Ethernet.into())?;
    /// assert_eq!(mem.len(), 4 << 20);
    /// # Ok::<(), mscclpp::Error>(())
    /// ```
    ///
    /// # Errors
    /// As [`register_device`](Self::register_device); `Cuda` when the slice's stream fails.
    #[cfg(feature = "cudarc-slice")]
    pub fn register_cuda_slice<T: 'static>(
        &self,
        slice: Arc<cudarc::driver::CudaSlice<T>>,
        transports: TransportFlags,
    ) -> Result<RegisteredMemory> {
        use cudarc::driver::DevicePtr;
        let stream = slice.stream().clone();
        stream
            .synchronize()
            .map_err(|e| crate::platform::cuda::cuda_err("cuStreamSynchronize (the slice's stream)", e))?;
        let (ptr, sync) = slice.device_ptr(&stream);
        drop(sync);
        let len = slice.num_bytes();
        register_gpu(self, ptr, len, transports, Some(slice))
    }
}

/// [`Context::register_device`], keeping `keeper` (what owns the memory) alive with the
/// registration. Crate-internal and not `unsafe`: the caller upholds `register_device`'s safety
/// contract when `keeper` is `None` (it touches no memory itself; peers and copies do later).
pub(crate) fn register_gpu(
    ctx: &Context,
    ptr: u64,
    len: usize,
    transports: TransportFlags,
    keeper: Option<Arc<dyn Send + Sync>>,
) -> Result<RegisteredMemory> {
    use crate::platform::cuda::usermem::{AllocKind, pointer_info, vmm_export};
    let during = |e: Error| e.during(format!("registering device memory {ptr:#x} (+{len} bytes)"));
    if ptr == 0 || len == 0 {
        return Err(during(Error::invalid_usage("cannot register a null pointer or an empty range")));
    }
    if ptr.checked_add(len as u64).is_none() {
        return Err(during(Error::invalid_usage("pointer + length overflows the address space")));
    }
    let info = pointer_info(ptr, len as u64).map_err(during)?;
    if transports.has(Transport::CudaIpc)
        && let Some(why) = info.ipc_refusal()
    {
        return Err(during(Error::invalid_usage(format!(
            "GPU{} memory cannot be registered for CUDA IPC: {why}",
            info.ordinal
        ))));
    }
    let (vmm_keep, vmm) = match (transports.has(Transport::CudaIpc), info.kind) {
        (true, AllocKind::Vmm { posix_fd: true }) => {
            let (keep, vi) = vmm_export(&info, ptr).map_err(during)?;
            (Some(keep), Some(vi))
        }
        _ => (None, None),
    };
    let keeper: Option<Arc<dyn Send + Sync>> = match (keeper, vmm_keep) {
        (k, None) => k,
        (k, Some(v)) => Some(Arc::new((k, v))),
    };
    let region = info.region(ptr, len, keeper).map_err(during)?;
    let ipc = match (transports.has(Transport::CudaIpc), info.kind) {
        (true, AllocKind::Plain) => Some(crate::platform::cuda::ipc_export(&region).map_err(during)?),
        _ => None,
    };
    let dev = Device::Gpu(info.ordinal);
    RegisteredMemory::new_local_mem(ctx, Mem::Gpu(region), transports, dev, ipc, vmm).map_err(during)
}

pub(crate) fn put_device(w: &mut Writer, d: Device) {
    match d {
        Device::Cpu => {
            w.u8(0);
            w.u32(0);
        }
        Device::Gpu(i) => {
            w.u8(1);
            w.u32(i);
        }
    }
}

pub(crate) fn get_device(r: &mut Reader<'_>) -> Result<Device> {
    let kind = r.u8()?;
    let id = r.u32()?;
    match kind {
        0 if id == 0 => Ok(Device::Cpu),
        1 => Ok(Device::Gpu(id)),
        _ => Err(r.err(format!("bad device ({kind}, {id})"))),
    }
}

pub(crate) fn check_host_transports(t: TransportFlags) -> Result<()> {
    if t.has(Transport::CudaIpc) {
        return Err(Error::invalid_usage("host memory cannot be registered for CUDA IPC (it needs GPU memory)"));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// Any valid CUDA IPC info: the offset lies inside the allocation.
    pub(crate) fn arb_ipc_info() -> impl Strategy<Value = IpcInfo> {
        (proptest::collection::vec(any::<u8>(), 64), 1u64.., any::<u64>(), any::<u32>()).prop_map(
            |(h, base_size, off, device)| {
                let mut handle = [0u8; 64];
                handle.copy_from_slice(&h);
                IpcInfo { handle, base_size, offset: off % base_size, device }
            },
        )
    }

    /// Any valid VMM export: the offset lies inside the mapping, the descriptor is not negative.
    pub(crate) fn arb_vmm_info() -> impl Strategy<Value = VmmInfo> {
        (any::<u32>(), any::<u64>(), 0i32.., 1u64.., any::<u64>(), any::<u32>()).prop_map(
            |(pid, start_time, fd, size, off, device)| VmmInfo {
                pid,
                start_time,
                fd,
                size,
                offset: off % size,
                device,
            },
        )
    }

    /// Any valid memory description: host or GPU, with or without IPC info, any set of IB entries.
    fn arb_desc() -> impl Strategy<Value = MemoryDesc> {
        (
            any::<u64>(),
            any::<u64>(),
            any::<[u64; 4]>(),
            0u16..(1 << 11),
            proptest::option::of(any::<u32>()),
            proptest::option::of(arb_ipc_info()),
            proptest::option::of(arb_vmm_info()),
            any::<[Option<(u64, u32)>; 8]>(),
        )
            .prop_map(|(addr, len, h, bits, gpu, ipc, vmm, ib)| MemoryDesc {
                addr: addr / 2,
                len: len / 2,
                region_id: h[0],
                context_id: h[1],
                host_hash: h[2],
                process_hash: h[3],
                transports: TransportFlags::from_bits(bits & TransportFlags::ALL.bits()).unwrap_or_default(),
                device: gpu.map(Device::Gpu).unwrap_or(Device::Cpu),
                // One export or the other, never both (the form carries one).
                vmm: if ipc.is_some() { None } else { vmm },
                cuda_ipc: ipc,
                ib: ib.map(|x| x.map(|(addr, rkey)| IbMrInfo { addr, rkey })),
            })
    }

    fn from_desc(desc: MemoryDesc) -> RegisteredMemory {
        RegisteredMemory {
            inner: Arc::new(MemInner { desc, local: None, import: OnceLock::new(), resolved: OnceLock::new() }),
        }
    }

    proptest! {
        #[test]
        fn wire_form(desc in arb_desc(), junk in proptest::collection::vec(any::<u8>(), 0..300)) {
            let m = from_desc(desc);
            crate::wire::check::check_value(&m);
            let back = RegisteredMemory::deserialize(&m.serialize()).unwrap();
            prop_assert_eq!(back.desc(), m.desc());
            crate::wire::check::check_bytes::<RegisteredMemory>(&junk);
            let mut framed = b"MSRM\x01\x00".to_vec();
            framed.extend_from_slice(&junk);
            crate::wire::check::check_bytes::<RegisteredMemory>(&framed);
        }

        #[test]
        fn vmm_info_wire_form(info in arb_vmm_info(), junk in proptest::collection::vec(any::<u8>(), 30..40)) {
            crate::wire::check::check_value(&info);
            crate::wire::check::check_bytes::<VmmInfo>(&junk);
        }

        #[test]
        fn ipc_info_wire_form(info in arb_ipc_info(), junk in proptest::collection::vec(any::<u8>(), 80..90)) {
            crate::wire::check::check_value(&info);
            crate::wire::check::check_bytes::<IpcInfo>(&junk);
        }
    }

    #[test]
    fn register_device_refuses_bad_ranges_without_a_gpu() {
        let ctx = Context::new();
        let t = TransportFlags::from(Transport::CudaIpc);
        // register_gpu is register_device without `unsafe` (crate-internal): every call below is
        // refused before anything touches memory.
        let e = register_gpu(&ctx, 0, 64, t, None).unwrap_err();
        assert_eq!(e.kind(), crate::ErrorKind::InvalidUsage, "{e}");
        assert!(e.to_string().contains("null pointer"), "{e}");
        let e = register_gpu(&ctx, 0x1000, 0, t, None).unwrap_err();
        assert!(e.to_string().contains("empty range"), "{e}");
        let e = register_gpu(&ctx, u64::MAX - 8, 64, t, None).unwrap_err();
        assert!(e.to_string().contains("overflows"), "{e}");
        assert!(e.to_string().contains("registering device memory"), "{e}");
        // A pointer that is host memory: without a driver NotAvailable, with one InvalidUsage.
        let host = [0u8; 64];
        let e = register_gpu(&ctx, host.as_ptr() as u64, 64, Transport::Ethernet.into(), None).unwrap_err();
        assert!(matches!(e.kind(), crate::ErrorKind::NotAvailable | crate::ErrorKind::InvalidUsage), "{e}");
    }

    #[test]
    fn ib_entries_must_be_in_order() {
        let mut d = MemoryDesc {
            addr: 0,
            len: 8,
            region_id: 0,
            context_id: 0,
            host_hash: 0,
            process_hash: 0,
            transports: TransportFlags::NONE,
            device: Device::Cpu,
            cuda_ipc: None,
            vmm: None,
            ib: [None; 8],
        };
        d.ib[1] = Some(IbMrInfo { addr: 1, rkey: 1 });
        d.ib[3] = Some(IbMrInfo { addr: 3, rkey: 3 });
        let mut b = from_desc(d).serialize();
        // entries are 13 bytes (index, addr, rkey) at the end: swap them
        let n = b.len();
        let (first, second) = (b[n - 26..n - 13].to_vec(), b[n - 13..].to_vec());
        b[n - 26..n - 13].copy_from_slice(&second);
        b[n - 13..].copy_from_slice(&first);
        assert!(RegisteredMemory::deserialize(&b).unwrap_err().to_string().contains("out of order"));
    }
}
