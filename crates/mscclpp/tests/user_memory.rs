//! The user's own GPU memory (`Context::register_device`, `Context::register_cuda_slice`):
//! memory from `cuMemAlloc` registered in the middle of its allocation, pool memory, a cudarc
//! `CudaSlice`, and `cuMemCreate` (VMM) memory shared through a POSIX descriptor, each moved
//! between two processes; and the errors. GPU tests (`--ignored`); the error paths reachable
//! without a GPU run everywhere.

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::gpu::gpu_for;
use common::{Rank, pattern, spawn_ranks};
use cudarc::driver::{CudaContext, result, sys};
use mscclpp::{
    Bootstrap, Communicator, Connection, Context, Device, EndpointConfig, ErrorKind, RegisteredMemory, Transport,
    TransportFlags,
};

const T: Duration = Duration::from_secs(60);

/// Without a GPU (or with one), what needs no driver is refused with a clear error, and the rest
/// is `NotAvailable` (no driver) or `InvalidUsage` (the driver does not know the pointer).
#[test]
fn register_device_errors_without_a_gpu() {
    let ctx = Context::new();
    let ipc = TransportFlags::from(Transport::CudaIpc);
    // SAFETY: refused before anything touches memory.
    let e = unsafe { ctx.register_device(0, 4096, ipc) }.unwrap_err();
    assert_eq!(e.kind(), ErrorKind::InvalidUsage, "{e}");
    assert!(e.to_string().contains("null pointer"), "{e}");
    // SAFETY: as above.
    let e = unsafe { ctx.register_device(0x7f00_0000_0000, 0, ipc) }.unwrap_err();
    assert!(e.to_string().contains("empty range"), "{e}");
    // SAFETY: as above.
    let e = unsafe { ctx.register_device(u64::MAX - 4095, 8192, ipc) }.unwrap_err();
    assert!(e.to_string().contains("overflows"), "{e}");
    let host = vec![0u8; 4096];
    // SAFETY: refused: host memory the driver does not know (or no driver at all).
    let e = unsafe { ctx.register_device(host.as_ptr() as u64, host.len(), Transport::Ethernet.into()) }.unwrap_err();
    match e.kind() {
        ErrorKind::NotAvailable => assert!(e.to_string().contains("no CUDA driver"), "{e}"),
        ErrorKind::InvalidUsage => assert!(e.to_string().contains("not memory the CUDA driver knows"), "{e}"),
        k => panic!("unexpected {k}: {e}"),
    }
    assert!(e.to_string().contains("registering device memory"), "{e}");
}

/// A connection of `transport` to the peer, and the peer's memory (tag `tag`).
fn link(
    comm: &Communicator,
    dev: u32,
    transport: Transport,
    peer: usize,
    mem: &RegisteredMemory,
    tag: u32,
) -> (Connection, RegisteredMemory) {
    let mut cfg = EndpointConfig::new(transport).device(Device::Gpu(dev));
    if transport == Transport::Ethernet {
        cfg = cfg.ethernet_interface("127.0.0.1");
    }
    let c = comm.connect(&cfg, peer, tag).unwrap();
    comm.send_memory(mem, peer, tag + 1).unwrap();
    let m = comm.recv_memory(peer, tag + 1).unwrap().wait().unwrap();
    (c.wait().unwrap(), m)
}

/// Rank 0 writes `len` pattern bytes from its `src_ptr` (the start of its registration `src`)
/// to offset `off` of rank 1's registration over `conn` and flushes; rank 1 then reads them
/// back at `dst_ptr + off` (its own pointer) and compares.
#[allow(clippy::too_many_arguments)]
fn check_transfer(
    r: &Rank,
    bs: &dyn Bootstrap,
    cuda: &Arc<CudaContext>,
    conn: &Connection,
    src: &RegisteredMemory,
    src_ptr: u64,
    remote: &RegisteredMemory,
    dst_ptr: u64,
    off: u64,
    len: usize,
    seed: u64,
) {
    let data = pattern(seed, len);
    if r.rank == 0 {
        cuda.bind_to_thread().unwrap();
        // SAFETY: src_ptr is the test's live allocation of at least len bytes.
        unsafe { result::memcpy_htod_sync(src_ptr, &data) }.unwrap();
        cuda.synchronize().unwrap();
        conn.write(remote, off, src, 0, len as u64).unwrap();
        conn.flush(T).unwrap();
    }
    bs.barrier().unwrap();
    if r.rank == 1 {
        cuda.bind_to_thread().unwrap();
        let mut got = vec![0u8; len];
        // SAFETY: dst_ptr + off .. + len lies in the test's live allocation.
        unsafe { result::memcpy_dtoh_sync(&mut got, dst_ptr + off) }.unwrap();
        assert!(got == data, "{} bytes at offset {off} differ ({})", len, conn.transport());
        println!("RESULT {} bytes over {} into the user's memory: exact", len, conn.transport());
    }
    bs.barrier().unwrap();
}

/// `cuMemAlloc` memory registered from 64 KiB into its 4 MiB allocation (so the CUDA IPC export
/// is the allocation's handle plus an offset) carries data both over CUDA IPC and Ethernet.
#[test]
#[ignore = "needs a CUDA GPU"]
fn user_pointer_in_the_middle_of_an_allocation() {
    if let Some(r) = Rank::from_env() {
        const ALLOC: usize = 4 << 20;
        const SKIP: u64 = 64 << 10;
        const LEN: usize = 1 << 20;
        let bs: Arc<dyn Bootstrap> = Arc::new(r.bootstrap(T));
        let comm = Communicator::new(bs.clone());
        let dev = gpu_for(r.rank);
        let cuda = CudaContext::new(dev as usize).unwrap();
        // SAFETY: a plain allocation, freed at the end after every registration is gone.
        let base = unsafe { result::malloc_sync(ALLOC) }.unwrap();
        // SAFETY: [base, base + ALLOC) was just allocated.
        unsafe { result::memset_d8_sync(base, 0, ALLOC) }.unwrap();
        let ptr = base + SKIP;
        // SAFETY: the allocation outlives the registration (freed below, after the drops).
        let mem =
            unsafe { comm.context().register_device(ptr, LEN, Transport::CudaIpc | Transport::Ethernet) }.unwrap();
        assert_eq!((mem.addr(), mem.len(), mem.device()), (ptr, LEN as u64, Device::Gpu(dev)));
        // Past the end of the allocation: refused, naming the allocation.
        // SAFETY: refused before use.
        let e = unsafe { comm.context().register_device(base + ALLOC as u64 - 4096, 8192, Transport::CudaIpc.into()) }
            .unwrap_err();
        assert!(e.to_string().contains("extends past its allocation"), "{e}");
        let peer = 1 - r.rank;
        let (ipc, remote_i) = link(&comm, dev, Transport::CudaIpc, peer, &mem, 10);
        let (eth, remote_e) = link(&comm, dev, Transport::Ethernet, peer, &mem, 20);
        bs.barrier().unwrap();
        check_transfer(&r, bs.as_ref(), &cuda, &ipc, &mem, ptr, &remote_i, ptr, 4096, 256 << 10, 1);
        check_transfer(&r, bs.as_ref(), &cuda, &eth, &mem, ptr, &remote_e, ptr, 8192, 300 << 10, 2);
        drop((ipc, eth, remote_i, remote_e, mem));
        bs.barrier().unwrap();
        // SAFETY: every registration and connection using it is gone (and the peer's, by the
        // barrier).
        unsafe { result::free_sync(base) }.unwrap();
        return;
    }
    spawn_ranks("user_pointer_in_the_middle_of_an_allocation", 2, &[]).assert_success();
}

/// Pool memory (`cuMemAllocAsync`) and a cudarc `CudaSlice`: CUDA IPC is refused, naming why,
/// where the GPU has memory pools; Ethernet carries data into them.
#[test]
#[ignore = "needs a CUDA GPU"]
fn pool_memory_and_cudarc_slices() {
    if let Some(r) = Rank::from_env() {
        const LEN: usize = 1 << 20;
        let bs: Arc<dyn Bootstrap> = Arc::new(r.bootstrap(T));
        let comm = Communicator::new(bs.clone());
        let ctx = comm.context();
        let dev = gpu_for(r.rank);
        let cuda = CudaContext::new(dev as usize).unwrap();
        let stream = cuda.default_stream();
        // SAFETY: pool memory on the context's default stream, zeroed, freed at the end.
        let pool = unsafe { result::malloc_async(stream.cu_stream(), LEN) }.unwrap();
        // SAFETY: [pool, pool + LEN) was just allocated.
        unsafe { result::memset_d8_sync(pool, 0, LEN) }.unwrap();
        stream.synchronize().unwrap();
        // SAFETY: refused before use.
        let e = unsafe { ctx.register_device(pool, LEN, Transport::CudaIpc | Transport::Ethernet) }.unwrap_err();
        assert_eq!(e.kind(), ErrorKind::InvalidUsage, "{e}");
        assert!(e.to_string().contains("cuMemAllocAsync"), "{e}");
        println!("pool memory for CUDA IPC: {e}");
        // SAFETY: the pool allocation outlives the registration (freed below).
        let pmem = unsafe { ctx.register_device(pool, LEN, Transport::Ethernet.into()) }.unwrap();
        let slice = Arc::new(stream.alloc_zeros::<u8>(LEN).unwrap());
        let s_ipc = ctx.register_cuda_slice(slice.clone(), Transport::CudaIpc.into());
        if cuda.has_async_alloc() {
            let e = s_ipc.unwrap_err();
            assert!(e.to_string().contains("CudaSlice"), "{e}");
        } else {
            s_ipc.unwrap();
        }
        let smem = ctx.register_cuda_slice(slice.clone(), Transport::Ethernet.into()).unwrap();
        let slice_ptr = smem.addr();
        let peer = 1 - r.rank;
        let (eth, remote_p) = link(&comm, dev, Transport::Ethernet, peer, &pmem, 10);
        comm.send_memory(&smem, peer, 30).unwrap();
        let remote_s = comm.recv_memory(peer, 30).unwrap().wait().unwrap();
        bs.barrier().unwrap();
        check_transfer(&r, bs.as_ref(), &cuda, &eth, &pmem, pool, &remote_p, pool, 4096, 200 << 10, 3);
        check_transfer(&r, bs.as_ref(), &cuda, &eth, &pmem, pool, &remote_s, slice_ptr, 512, 100 << 10, 4);
        if r.rank == 1 {
            // The slice as cudarc sees it.
            let v = stream.clone_dtoh(slice.as_ref()).unwrap();
            assert!(v[512..512 + (100 << 10)] == pattern(4, 100 << 10)[..], "the CudaSlice differs");
        }
        drop((eth, remote_p, remote_s, pmem, smem));
        bs.barrier().unwrap();
        // SAFETY: every registration using it is gone.
        unsafe { result::free_async(pool, stream.cu_stream()) }.unwrap();
        stream.synchronize().unwrap();
        return;
    }
    spawn_ranks("pool_memory_and_cudarc_slices", 2, &[]).assert_success();
}

/// A `cuMemCreate` allocation mapped into this process, with `handle_types` requested.
struct Vmm {
    va: u64,
    size: usize,
    handle: sys::CUmemGenericAllocationHandle,
}

impl Vmm {
    fn new(dev: u32, want: usize, handle_types: sys::CUmemAllocationHandleType) -> Vmm {
        // SAFETY: plain VMM calls with out-pointers to locals; the mapping is undone in Drop.
        unsafe {
            let mut prop: sys::CUmemAllocationProp = std::mem::zeroed();
            prop.type_ = sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED;
            prop.requestedHandleTypes = handle_types;
            prop.location.type_ = sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE;
            prop.location.id = dev as i32;
            let mut gran = 0usize;
            sys::cuMemGetAllocationGranularity(
                &mut gran,
                &prop,
                sys::CUmemAllocationGranularity_flags::CU_MEM_ALLOC_GRANULARITY_MINIMUM,
            )
            .result()
            .unwrap();
            let size = want.div_ceil(gran) * gran;
            let mut handle = 0;
            sys::cuMemCreate(&mut handle, size, &prop, 0).result().unwrap();
            let mut va = 0;
            sys::cuMemAddressReserve(&mut va, size, 0, 0, 0).result().unwrap();
            sys::cuMemMap(va, size, 0, handle, 0).result().unwrap();
            let access = sys::CUmemAccessDesc {
                location: prop.location,
                flags: sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
            };
            sys::cuMemSetAccess(va, size, &access, 1).result().unwrap();
            result::memset_d8_sync(va, 0, size).unwrap();
            Vmm { va, size, handle }
        }
    }
}

impl Drop for Vmm {
    fn drop(&mut self) {
        // SAFETY: undoes Vmm::new once; no registration uses the memory any more.
        unsafe {
            let _ = sys::cuMemUnmap(self.va, self.size);
            let _ = sys::cuMemAddressFree(self.va, self.size);
            let _ = sys::cuMemRelease(self.handle);
        }
    }
}

/// `cuMemCreate` memory made with `CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR`, registered 4 KiB
/// into its allocation, is written by the peer over CUDA IPC (the peer maps it from a copy of
/// the owner's descriptor); without that handle type CUDA IPC is refused, naming why, and
/// Ethernet still works.
#[test]
#[ignore = "needs a CUDA GPU"]
fn vmm_memory_shared_through_a_posix_descriptor() {
    if let Some(r) = Rank::from_env() {
        const LEN: usize = 2 << 20;
        let bs: Arc<dyn Bootstrap> = Arc::new(r.bootstrap(T));
        let comm = Communicator::new(bs.clone());
        let ctx = comm.context();
        let dev = gpu_for(r.rank);
        let cuda = CudaContext::new(dev as usize).unwrap();
        let fd_type = sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
        let shared = Vmm::new(dev, LEN + 4096, fd_type);
        let ptr = shared.va + 4096;
        // SAFETY: the mapping outlives the registration (dropped after it).
        let mem = unsafe { ctx.register_device(ptr, LEN, Transport::CudaIpc.into()) }.unwrap();
        let plain = Vmm::new(dev, LEN, sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_NONE);
        // SAFETY: refused before use.
        let e = unsafe { ctx.register_device(plain.va, LEN, Transport::CudaIpc.into()) }.unwrap_err();
        assert_eq!(e.kind(), ErrorKind::InvalidUsage, "{e}");
        assert!(e.to_string().contains("POSIX_FILE_DESCRIPTOR"), "{e}");
        println!("VMM memory without a POSIX handle type, for CUDA IPC: {e}");
        // SAFETY: the mapping outlives the registration.
        let pmem = unsafe { ctx.register_device(plain.va, LEN, Transport::Ethernet.into()) }.unwrap();
        let peer = 1 - r.rank;
        let (ipc, remote) = link(&comm, dev, Transport::CudaIpc, peer, &mem, 10);
        let (eth, remote_p) = link(&comm, dev, Transport::Ethernet, peer, &pmem, 20);
        bs.barrier().unwrap();
        check_transfer(&r, bs.as_ref(), &cuda, &ipc, &mem, ptr, &remote, ptr, 8192, 1 << 20, 5);
        check_transfer(&r, bs.as_ref(), &cuda, &eth, &pmem, plain.va, &remote_p, plain.va, 0, 64 << 10, 6);
        drop((ipc, eth, remote, remote_p, mem, pmem));
        bs.barrier().unwrap();
        drop((shared, plain));
        return;
    }
    spawn_ranks("vmm_memory_shared_through_a_posix_descriptor", 2, &[]).assert_success();
}

/// On a GPU: page-locked host memory, managed memory for CUDA IPC, and a pointer CUDA does not
/// know are refused, each naming why.
#[test]
#[ignore = "needs a CUDA GPU"]
fn user_memory_errors_on_a_gpu() {
    let cuda = CudaContext::new(0).unwrap();
    let ctx = Context::new();
    // SAFETY: pinned host memory, freed at the end.
    let host = unsafe { result::malloc_host(4096, 0) }.unwrap();
    // SAFETY: refused before use.
    let e = unsafe { ctx.register_device(host as u64, 4096, Transport::Ethernet.into()) }.unwrap_err();
    assert!(e.to_string().contains("page-locked host memory"), "{e}");
    println!("pinned host: {e}");
    // SAFETY: managed memory, freed at the end.
    let managed = unsafe { result::malloc_managed(1 << 20, sys::CUmemAttach_flags::CU_MEM_ATTACH_GLOBAL) }.unwrap();
    // SAFETY: refused before use.
    let e = unsafe { ctx.register_device(managed, 1 << 20, Transport::CudaIpc.into()) }.unwrap_err();
    assert!(e.to_string().contains("managed"), "{e}");
    println!("managed, CUDA IPC: {e}");
    let stack = [0u8; 64];
    // SAFETY: refused before use.
    let e = unsafe { ctx.register_device(stack.as_ptr() as u64, 64, Transport::Ethernet.into()) }.unwrap_err();
    assert!(e.to_string().contains("not memory the CUDA driver knows"), "{e}");
    println!("stack: {e}");
    cuda.bind_to_thread().unwrap();
    // SAFETY: both allocations are unused now.
    unsafe {
        result::free_host(host).unwrap();
        result::free_sync(managed).unwrap();
    }
}
