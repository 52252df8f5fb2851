//! What the GPU test binaries share: kernels compiled at run time and their launches, result
//! words in device memory, and the GPU a rank uses.

use std::ffi::c_void;

use mscclpp::device::compile::{CompileOptions, Kernel, KernelModule, compile};
use mscclpp::gpu::Stream;
use std::sync::Arc;

use mscclpp::{
    Bootstrap, Communicator, Connection, Context, DeviceBuffer, EndpointConfig, Host2DeviceSemaphore, RegisteredMemory,
    TransportFlags,
};

/// `source`'s kernels, compiled by NVRTC and loaded on `device`.
pub fn module(source: &str, device: u32) -> KernelModule {
    let ptx = compile(source, &CompileOptions::default()).expect("NVRTC compile");
    KernelModule::load(device, &ptx).expect("load the kernels")
}

/// The kernel `name` of `m`.
pub fn kernel(m: &KernelModule, name: &str) -> Kernel {
    m.function(name).unwrap_or_else(|e| panic!("kernel {name}: {e}"))
}

/// Pointers to each argument, as `cuLaunchKernel` wants them (`use common::gpu::args`).
// The allows: binaries without GPU kernels include `common` too.
#[allow(unused_macros)]
macro_rules! args {
    ($($a:expr),* $(,)?) => { [$( (&mut $a) as *mut _ as *mut ::std::ffi::c_void ),*] };
}
#[allow(unused_imports)]
pub(crate) use args;

/// Launches `k` on a 1-D grid of `grid` blocks of `block` threads.
pub fn launch(k: &Kernel, grid: u32, block: u32, stream: &Stream, args: &mut [*mut c_void]) {
    // SAFETY: every test passes arguments matching its kernel's parameter list (by value, or
    // device addresses of live buffers that outlive the launch: the tests synchronize first).
    unsafe { k.launch((grid, 1, 1), (block, 1, 1), 0, stream, args) }.expect("launch");
}

/// `n` zeroed 8-byte result words on `device`.
pub fn results(n: usize, ctx: &Context, device: u32) -> DeviceBuffer {
    let b = DeviceBuffer::new(ctx, device, 8 * n, TransportFlags::NONE).unwrap();
    b.fill(0, 8 * n, 0).unwrap();
    b
}

/// Result word `i` of `b`.
pub fn read(b: &DeviceBuffer, i: usize) -> u64 {
    b.read_u64(8 * i).unwrap()
}

/// The GPU rank `rank` uses: two ranks share a GPU when there is one.
pub fn gpu_for(rank: usize) -> u32 {
    let n = mscclpp::gpu::device_count().expect("CUDA device count");
    (rank % n) as u32
}

/// Two ranks, this one and `1 - rank`, joined over `cfg`: a connection, a zeroed GPU buffer of
/// `len` bytes each (on `cfg`'s GPU, else on this rank's) registered for `cfg`'s transport and
/// exchanged, and a host-to-device semaphore; ready once the barrier at the end returns.
pub struct Pair {
    pub bs: Arc<dyn Bootstrap>,
    pub comm: Communicator,
    pub conn: Connection,
    pub local: DeviceBuffer,
    pub remote: RegisteredMemory,
    pub sem: Host2DeviceSemaphore,
}

/// See [`Pair`].
pub fn pair(bs: Arc<dyn Bootstrap>, rank: usize, cfg: EndpointConfig, len: usize) -> Pair {
    let comm = Communicator::new(bs.clone());
    let peer = 1 - rank;
    let dev = cfg.device.gpu_index().unwrap_or_else(|| gpu_for(rank));
    let local = DeviceBuffer::new(comm.context(), dev, len, cfg.transport.into()).unwrap();
    local.fill(0, len, 0).unwrap();
    let pc = comm.connect(&cfg, peer, 0).unwrap();
    comm.send_memory(local.memory(), peer, 1).unwrap();
    let pm = comm.recv_memory(peer, 1).unwrap();
    let conn = pc.wait().unwrap();
    let remote = pm.wait().unwrap();
    let sem = Host2DeviceSemaphore::new(comm.build_semaphore(&conn, peer, 2).unwrap().wait().unwrap()).unwrap();
    bs.barrier().unwrap();
    Pair { bs, comm, conn, local, remote, sem }
}
