"""NCCL send/recv between two GPUs through torch.distributed: the NCCL column of the multi-GPU
comparison (issue: multi-GPU run). One process per GPU:

    NCCL_NVLS_ENABLE=0 torchrun --nproc_per_node=2 scripts/nccl_sendrecv.py [--max-bytes 1G] [--json out.json]

Reports, like mscclpp-perf, one-way bandwidth (rank 0 sends, rank 1 receives) and per-direction
bandwidth with both directions at once, plus the small-message round trip.
"""
import argparse, json, os, time

import torch
import torch.distributed as dist


def size_arg(s):
    m = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(s[:-1]) * m[s[-1].upper()] if s[-1].upper() in m else int(s)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--min-bytes", type=size_arg, default=8)
    ap.add_argument("--max-bytes", type=size_arg, default=1 << 30)
    ap.add_argument("--json")
    a = ap.parse_args()
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    assert world == 2, "run with exactly two processes"
    torch.cuda.set_device(rank % torch.cuda.device_count())
    peer = 1 - rank
    buf = torch.empty(a.max_bytes, dtype=torch.uint8, device="cuda")
    rbuf = torch.empty(a.max_bytes, dtype=torch.uint8, device="cuda")
    recs = []
    size = a.min_bytes
    while size <= a.max_bytes:
        iters = max(10, min(2000, (512 << 20) // size))
        s, r = buf[:size], rbuf[:size]

        def one_way(n):
            for _ in range(n):
                if rank == 0:
                    dist.send(s, 1)
                else:
                    dist.recv(r, 0)
            torch.cuda.synchronize()

        def both(n):
            for _ in range(n):
                ops = [dist.P2POp(dist.isend, s, peer), dist.P2POp(dist.irecv, r, peer)]
                for w in dist.batch_isend_irecv(ops):
                    w.wait()
            torch.cuda.synchronize()

        def ping(n):
            for _ in range(n):
                if rank == 0:
                    dist.send(s, 1)
                    dist.recv(r, 1)
                else:
                    dist.recv(r, 0)
                    dist.send(s, 0)
            torch.cuda.synchronize()

        out = {"size": size}
        for name, fn, n in (("uni_gbps", one_way, iters), ("bidir_gbps", both, iters), ("rtt_us", ping, min(iters, 200))):
            fn(5)
            dist.barrier()
            t0 = time.perf_counter()
            fn(n)
            dist.barrier()
            dt = time.perf_counter() - t0
            out[name] = dt / n * 1e6 if name == "rtt_us" else size * n / dt / 1e9
        recs.append(out)
        if rank == 0:
            print(f"{size:>12}  uni {out['uni_gbps']:10.3f} GB/s  bidir {out['bidir_gbps']:10.3f} GB/s/dir  rtt {out['rtt_us']:9.1f} us", flush=True)
        size *= 2
    if rank == 0 and a.json:
        with open(a.json, "w") as f:
            json.dump(recs, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
