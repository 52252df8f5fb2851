"""A MemoryChannel from Python: rank 0's kernel stores straight into rank 1's GPU buffer (CUDA
IPC mapping) and signals; rank 1's kernel waits for the signal and checks every byte. No host
thread moves data or signals.

    python -m mscclpp_rs.examples.memory_channel_put [--bytes N]
"""

from __future__ import annotations

import argparse
import time

import mscclpp_rs as m

from ._launch import run_ranks

KERNELS = r"""
#include "mscclpp_rs/device.cuh"
using mscclpp::u64;

extern "C" __global__ void send(mscclpp::MemoryChannelDeviceHandle* ch, u64 bytes) {
  unsigned int tid = threadIdx.x, n = blockDim.x;
  ch->put(0, bytes, tid, n);
  __syncthreads();
  if (tid == 0) ch->signal();
}

// *bad: wrong bytes, or ~0 when the wait timed out.
extern "C" __global__ void receive(mscclpp::MemoryChannelDeviceHandle* ch, u64 bytes, u64 timeout_ns, u64* bad) {
  __shared__ bool ok;
  if (threadIdx.x == 0) ok = ch->wait_for(timeout_ns);
  __syncthreads();
  if (!ok) { if (threadIdx.x == 0) *bad = ~0ull; return; }
  u64 n = 0;
  for (u64 i = threadIdx.x; i < bytes; i += blockDim.x)
    n += ((unsigned char*)ch->src_)[i] != (unsigned char)(i * 7 + 3);
  if (n) atomicAdd((unsigned long long*)bad, (unsigned long long)n);
}
"""


def main(comm: m.Communicator, args) -> None:
    import os
    import tempfile

    import cupy as cp

    rank, peer = comm.rank, 1 - comm.rank
    dev = rank % cp.cuda.runtime.getDeviceCount()
    cp.cuda.Device(dev).use()
    n = args.bytes
    buf = ((cp.arange(n, dtype=cp.uint64) * 7 + 3) % 256).astype(cp.uint8) if rank == 0 else cp.zeros(n, cp.uint8)
    cp.cuda.Device(dev).synchronize()
    mem = comm.register(buf, m.Transport.CUDA_IPC)
    conn = comm.connect(peer, m.Transport.CUDA_IPC, device=dev)
    remote = comm.exchange(mem, [peer])[peer]
    sem = comm.memory_semaphore(conn)
    ch = m.MemoryChannel(sem, remote, mem)
    handles = comm.pack_handles([ch], device=dev)
    ptx = m.compile_kernel(KERNELS, device=dev)
    path = os.path.join(tempfile.mkdtemp(prefix="mscclpp_rs-"), "memchan.ptx")
    with open(path, "w") as f:
        f.write(ptx.ptx)
    mod = cp.RawModule(path=path)
    stream = cp.cuda.Stream(non_blocking=True)
    bad = cp.zeros(1, dtype=cp.uint64)
    comm.barrier()
    t0 = time.perf_counter()
    with stream:
        if rank == 0:
            mod.get_function("send")((1,), (512,), (cp.uint64(handles.ptr), cp.uint64(n)))
        else:
            mod.get_function("receive")((1,), (512,), (cp.uint64(handles.ptr), cp.uint64(n), cp.uint64(20_000_000_000), bad))
    stream.synchronize()
    dt = time.perf_counter() - t0
    comm.barrier()
    if rank == 1:
        b = int(bad.get()[0])
        print(f"rank 1: MemoryChannel put of {n} bytes from rank 0's kernel: "
              f"{'timed out' if b == 2**64 - 1 else ('byte-exact' if b == 0 else f'{b} wrong bytes')} "
              f"({dt * 1e3:.2f} ms incl. launch)", flush=True)
        if b:
            raise SystemExit("MemoryChannel data differ or the wait timed out")
    else:
        print(f"rank 0: MemoryChannel handle at {ch.device_handle_ptr:#x}, packed at {handles.ptr:#x}", flush=True)


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--bytes", type=int, default=1 << 20)
    return p.parse_args(argv)


if __name__ == "__main__":
    run_ranks(main, parse())
