"""Two ranks move a torch tensor (one KV-cache block) over CUDA IPC or Ethernet, byte-exact.

    python -m mscclpp_rs.examples.kv_cache --transport cuda_ipc   # GPU memory, same host
    python -m mscclpp_rs.examples.kv_cache --transport ethernet   # GPU memory over TCP
    python -m mscclpp_rs.examples.kv_cache --transport ethernet --cpu   # host tensors

Rank 0 (the "prefill" side) writes its block into rank 1's (the "decode" side) registered
block, flushes, and both meet at a barrier; rank 1 checks every byte against the same seeded
tensor. Both ranks use GPU ``rank % device_count`` (both GPU 0 on a one-GPU machine).
"""

from __future__ import annotations

import argparse
import time

import mscclpp_rs as m

from ._launch import run_ranks


def block(torch, shape, device, fill: bool):
    g = torch.Generator(device="cpu").manual_seed(1234)
    t = torch.randn(shape, generator=g, dtype=torch.float32).to(torch.float16)
    return t.to(device) if fill else torch.zeros(shape, dtype=torch.float16, device=device)


def main(comm: m.Communicator, args) -> None:
    import torch

    rank, peer = comm.rank, 1 - comm.rank
    device = "cpu" if args.cpu else f"cuda:{rank % max(1, torch.cuda.device_count())}"
    if device != "cpu":
        torch.cuda.set_device(device)
    # (layers, K/V, block tokens, heads, head dim) in fp16
    shape = (args.layers, 2, args.tokens, 8, 128)
    kv = block(torch, shape, device, fill=(rank == 0))
    transport = m.Transport.CUDA_IPC if args.transport == "cuda_ipc" else m.Transport.ETHERNET
    mem = comm.register(kv, transport)  # keeps kv alive while registered
    conn = comm.connect(peer, transport, device=None if args.cpu else torch.cuda.current_device())
    peer_mem = comm.exchange(mem, [peer])[peer]
    if device != "cpu":
        torch.cuda.synchronize()  # the tensor's contents are written before anyone copies them
    comm.barrier()
    if rank == 0:
        t0 = time.perf_counter()
        conn.write(peer_mem, 0, mem, 0, mem.nbytes)
        conn.flush(timeout=60.0)
        dt = time.perf_counter() - t0
        print(f"rank 0: wrote {mem.nbytes} bytes over {conn.transport} in {dt * 1e6:.0f} us "
              f"({mem.nbytes / dt / 1e9:.2f} GB/s)", flush=True)
    comm.barrier()
    if rank == 1:
        want = block(torch, shape, device, fill=True)
        same = torch.equal(kv.view(torch.uint8), want.view(torch.uint8))
        print(f"rank 1: received KV block {tuple(kv.shape)} {kv.dtype} on {kv.device}: "
              f"{'byte-exact' if same else 'MISMATCH'} (sum {kv.float().sum().item():.4f})", flush=True)
        if not same:
            raise SystemExit("the received block differs")
    comm.barrier()


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--transport", choices=["cuda_ipc", "ethernet"], default="cuda_ipc")
    p.add_argument("--cpu", action="store_true", help="host tensors (Ethernet only)")
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--tokens", type=int, default=16)
    return p.parse_args(argv)


if __name__ == "__main__":
    run_ranks(main, parse())
