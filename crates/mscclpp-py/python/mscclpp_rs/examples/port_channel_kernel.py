"""A kernel launched from Python moves data through a PortChannel handle.

    python -m mscclpp_rs.examples.port_channel_kernel [--transport cuda_ipc|ethernet]
                                                      [--compiler mscclpp|cupy]

Each of two ranks registers a CuPy source and destination, builds a device semaphore and a
PortChannel on its ProxyService, packs the channel's handle into device memory, and launches a
kernel that ``putWithSignal``s its source into the peer's destination, ``flush_for``s it, and
``wait_for``s the peer's signal. The kernel is compiled by ``mscclpp_rs.compile_kernel`` (NVRTC, the
header built in) and loaded with CuPy, or (``--compiler cupy``) compiled by CuPy with
``-I mscclpp_rs.include_dir()``. Each rank checks the received bytes against the peer's pattern.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

import mscclpp_rs as m

from ._launch import run_ranks

KERNEL = r"""
#include "mscclpp_rs/device.cuh"

// bit 0: our put is flushed; bit 1: the peer's signal arrived (its data is in dst)
extern "C" __global__ void put_flush_wait(mscclpp::PortChannelDeviceHandle* chans, unsigned long long bytes,
                                          unsigned long long timeout_ns, int* result) {
  if (threadIdx.x != 0 || blockIdx.x != 0) return;
  mscclpp::PortChannelDeviceHandle& ch = chans[0];
  ch.putWithSignal(0, bytes);
  int r = ch.flush_for(timeout_ns) ? 1 : 0;
  r |= ch.wait_for(timeout_ns) ? 2 : 0;
  *result = r;
}
"""


def pattern(cp, rank: int, n: int):
    return ((cp.arange(n, dtype=cp.uint64) * 131 + 7 * rank + 1) % 253).astype(cp.uint8)


def load_kernel(cp, compiler: str, device: int):
    if compiler == "cupy":
        mod = cp.RawModule(code=KERNEL, options=("-I" + m.include_dir(), "--std=c++17"), backend="nvrtc")
        return mod.get_function("put_flush_wait"), "CuPy NVRTC"
    ptx = m.compile_kernel(KERNEL, device=device)
    path = os.path.join(tempfile.mkdtemp(prefix="mscclpp_rs-"), "kernel.ptx")
    with open(path, "w") as f:
        f.write(ptx.ptx)
    return cp.RawModule(path=path).get_function("put_flush_wait"), f"mscclpp_rs.compile_kernel ({ptx.arch})"


def main(comm: m.Communicator, args) -> None:
    import cupy as cp

    rank, peer = comm.rank, 1 - comm.rank
    dev = rank % cp.cuda.runtime.getDeviceCount()
    cp.cuda.Device(dev).use()
    n = args.bytes
    src = pattern(cp, rank, n)
    dst = cp.zeros(n, dtype=cp.uint8)
    cp.cuda.Device(dev).synchronize()
    transport = m.Transport.CUDA_IPC if args.transport == "cuda_ipc" else m.Transport.ETHERNET
    msrc = comm.register(src, transport)
    mdst = comm.register(dst, transport)
    conn = comm.connect(peer, transport, device=dev)
    remote_dst = comm.exchange(mdst, [peer])[peer]
    sem = comm.device_semaphore(conn)

    proxy = m.ProxyService(comm, device=dev)
    ch = proxy.port_channel(proxy.add_semaphore(sem), proxy.add_memory(remote_dst), proxy.add_memory(msrc))
    handles = proxy.pack_handles([ch])  # 96 bytes in device memory, address fixed while it lives
    kernel, how = load_kernel(cp, args.compiler, dev)
    result = cp.zeros(1, dtype=cp.int32)
    stream = cp.cuda.Stream(non_blocking=True)  # never the legacy stream while a proxy serves
    with proxy:  # start; stop (and raise the proxy's first error) on exit
        comm.barrier()
        t0 = time.perf_counter()
        with stream:
            kernel((1,), (1,), (cp.uint64(handles.ptr), cp.uint64(n), cp.uint64(args.timeout_ms * 1_000_000), result))
        stream.synchronize()
        dt = time.perf_counter() - t0
        comm.barrier()  # the peer's kernel is done with our proxy's signals too
    r = int(result.get()[0])
    same = bool((dst == pattern(cp, peer, n)).all())
    print(f"rank {rank}: kernel ({how}) over {conn.transport}: flushed={bool(r & 1)} signalled={bool(r & 2)} "
          f"{n} bytes {'byte-exact' if same else 'MISMATCH'} in {dt * 1e3:.2f} ms; proxy processed {proxy.processed} "
          f"triggers; handle at {handles.ptr:#x}", flush=True)
    if r != 3 or not same:
        raise SystemExit(f"rank {rank}: result {r}, data {'ok' if same else 'differs'}")


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--transport", choices=["cuda_ipc", "ethernet"], default="cuda_ipc")
    p.add_argument("--compiler", choices=["mscclpp", "cupy"], default="mscclpp")
    p.add_argument("--bytes", type=int, default=1 << 20)
    p.add_argument("--timeout-ms", type=int, default=20_000)
    return p.parse_args(argv)


if __name__ == "__main__":
    run_ranks(main, parse())
