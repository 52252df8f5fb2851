"""torch.distributed with backend "nccl" on libmscclpp_nccl.so (LD_PRELOAD), started by torchrun.

    LD_PRELOAD=$PWD/libmscclpp_nccl.so MSCCLPP_LOG_LEVEL=INFO \
        torchrun --nproc-per-node=N torch_nccl.py

Every rank uses GPU 0 (run with MPS so the ranks' kernels are resident together). Each check
compares with a CPU reference built from every rank's inputs; each rank prints PASS/FAIL lines
and exits 1 on any failure.
"""
import os
import sys
import traceback

import torch
import torch.distributed as dist

rank = int(os.environ["RANK"])
world = int(os.environ["WORLD_SIZE"])
dev = torch.device("cuda", int(os.environ.get("MSCCLPP_TEST_GPU", "0")))
torch.cuda.set_device(dev)
failures = []


def check(name, fn):
    try:
        fn()
        print(f"PASS rank {rank} {name}", flush=True)
    except Exception as e:  # noqa: BLE001
        failures.append(name)
        print(f"FAIL rank {rank} {name}: {e!r}", flush=True)
        traceback.print_exc()


def inputs(r, n, dtype):
    """Rank r's input: small integers, exact in every type."""
    x = (torch.arange(n, dtype=torch.float64) * (r + 1) + r) % 13 - 3
    return x.to(dtype)


def same(got, want, name):
    got = got.cpu()
    want = want.to(got.dtype)
    tol = {torch.float16: 1e-2, torch.bfloat16: 5e-2}.get(got.dtype, 1e-5)
    if got.is_floating_point():
        ok = torch.allclose(got.double(), want.double(), rtol=tol, atol=tol)
    else:
        ok = torch.equal(got, want)
    if not ok:
        bad = (got.double() - want.double()).abs().argmax().item()
        raise AssertionError(f"{name}: element {bad} is {got.flatten()[bad].item()}, expected {want.flatten()[bad].item()}")


dist.init_process_group("nccl", device_id=dev)
N = 4099  # odd: not a multiple of any vector width

for dtype in (torch.float32, torch.float16, torch.bfloat16, torch.int32):
    ops = [("sum", dist.ReduceOp.SUM), ("max", dist.ReduceOp.MAX)]
    if dtype.is_floating_point:
        ops.append(("avg", dist.ReduceOp.AVG))
    for oname, op in ops:
        def t(dtype=dtype, op=op, oname=oname):
            x = inputs(rank, N, dtype).to(dev)
            dist.all_reduce(x, op=op)
            every = torch.stack([inputs(r, N, dtype).double() for r in range(world)])
            want = {"sum": every.sum(0), "max": every.max(0).values, "avg": every.mean(0)}[oname]
            same(x, want, f"all_reduce {oname} {dtype}")
        check(f"all_reduce {oname} {dtype}", t)

for n in (1, 1000, 1 << 20):
    def t(n=n):
        x = inputs(rank, n, torch.float32).to(dev)
        dist.all_reduce(x)
        same(x, sum(inputs(r, n, torch.float32).double() for r in range(world)), "all_reduce")
    check(f"all_reduce sum f32 x{n}", t)


def t_all_gather():
    x = inputs(rank, N, torch.float16).to(dev)
    out = torch.empty(world * N, dtype=torch.float16, device=dev)
    dist.all_gather_into_tensor(out, x)
    same(out, torch.cat([inputs(r, N, torch.float16) for r in range(world)]), "all_gather")


def t_reduce_scatter():
    x = inputs(rank, world * N, torch.float32).to(dev)
    out = torch.empty(N, dtype=torch.float32, device=dev)
    dist.reduce_scatter_tensor(out, x)
    full = sum(inputs(r, world * N, torch.float32).double() for r in range(world))
    same(out, full[rank * N:(rank + 1) * N], "reduce_scatter")


def t_broadcast():
    for root in range(world):
        x = inputs(rank, N, torch.bfloat16).to(dev)
        dist.broadcast(x, src=root)
        same(x, inputs(root, N, torch.bfloat16), f"broadcast from {root}")


def t_reduce():
    x = inputs(rank, N, torch.float32).to(dev)
    dist.reduce(x, dst=world - 1)
    if rank == world - 1:
        same(x, sum(inputs(r, N, torch.float32).double() for r in range(world)), "reduce")


def t_barrier():
    for _ in range(3):
        dist.barrier()


def t_send_recv():
    # a ring with batch_isend_irecv (one group), then blocking send/recv between 0 and 1
    x = inputs(rank, N, torch.float32).to(dev)
    y = torch.empty_like(x)
    ops = [dist.P2POp(dist.isend, x, (rank + 1) % world), dist.P2POp(dist.irecv, y, (rank - 1) % world)]
    for w in dist.batch_isend_irecv(ops):
        w.wait()
    torch.cuda.synchronize()
    same(y, inputs((rank - 1) % world, N, torch.float32), "ring")
    if rank == 0:
        dist.send(x, dst=1)
    elif rank == 1:
        z = torch.empty_like(x)
        dist.recv(z, src=0)
        same(z, inputs(0, N, torch.float32), "send/recv")


def t_all_to_all():
    n = 1000
    x = torch.cat([inputs(rank * world + p, n, torch.float32) for p in range(world)]).to(dev)
    out = torch.empty_like(x)
    dist.all_to_all_single(out, x)
    same(out, torch.cat([inputs(p * world + rank, n, torch.float32) for p in range(world)]), "all_to_all")


def t_graph():
    x = inputs(rank, N, torch.float32).to(dev)
    dist.all_reduce(x.clone())  # warm up outside the capture
    torch.cuda.synchronize()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    g = torch.cuda.CUDAGraph()
    buf = torch.zeros_like(x)
    with torch.cuda.stream(s), torch.cuda.graph(g, stream=s):
        dist.all_reduce(buf)
    want = sum(inputs(r, N, torch.float32).double() for r in range(world))
    for i in range(3):
        buf.copy_(inputs(rank, N, torch.float32).to(dev) * (i + 1))
        g.replay()
        torch.cuda.synchronize()
        same(buf, want * (i + 1), f"graph replay {i}")


def ring_ops(x, y):
    return [dist.P2POp(dist.isend, x, (rank + 1) % world), dist.P2POp(dist.irecv, y, (rank - 1) % world)]


def t_send_recv_large():
    # several rounds of the device path's staging ring, odd element counts, f16 and i32
    for dtype, n in [(torch.float16, (3 << 20) // 2 + 7), (torch.int32, 300_001)]:
        x = inputs(rank, n, dtype).to(dev)
        y = torch.zeros_like(x)
        for w in dist.batch_isend_irecv(ring_ops(x, y)):
            w.wait()
        torch.cuda.synchronize()
        same(y, inputs((rank - 1) % world, n, dtype), f"ring {dtype} x{n}")


def t_all_to_all_uneven():
    # all_to_all_single with split sizes: ncclSend/ncclRecv per peer inside one group
    split = lambda src, dst: 100 * (src + 1) + 7 * dst + 1
    ins = [split(rank, p) for p in range(world)]
    outs = [split(p, rank) for p in range(world)]
    x = torch.cat([inputs(rank * world + p, ins[p], torch.float32) for p in range(world)]).to(dev)
    out = torch.empty(sum(outs), dtype=torch.float32, device=dev)
    dist.all_to_all_single(out, x, output_split_sizes=outs, input_split_sizes=ins)
    want = torch.cat([inputs(p * world + rank, outs[p], torch.float32) for p in range(world)])
    same(out, want, "all_to_all_single uneven")


def t_graph_send_recv():
    # a send/recv ring and an all_to_all_single captured in one CUDA graph, replayed on new data
    n = 70_000
    x = inputs(rank, n, torch.float32).to(dev)
    y = torch.zeros_like(x)
    a = torch.zeros(world * 1000, dtype=torch.float32, device=dev)
    b = torch.zeros_like(a)
    for w in dist.batch_isend_irecv(ring_ops(x, y)):  # warm up outside the capture
        w.wait()
    dist.all_to_all_single(b, a)
    torch.cuda.synchronize()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    g = torch.cuda.CUDAGraph()
    with torch.cuda.stream(s), torch.cuda.graph(g, stream=s):
        for w in dist.batch_isend_irecv(ring_ops(x, y)):
            w.wait()
        dist.all_to_all_single(b, a)
    for i in range(3):
        x.copy_(inputs(rank + 10 * i, n, torch.float32).to(dev))
        a.copy_(torch.cat([inputs(rank * world + p + 10 * i, 1000, torch.float32) for p in range(world)]).to(dev))
        torch.cuda.synchronize()
        dist.barrier()
        g.replay()
        torch.cuda.synchronize()
        same(y, inputs((rank - 1) % world + 10 * i, n, torch.float32), f"graph send/recv replay {i}")
        want = torch.cat([inputs(p * world + rank + 10 * i, 1000, torch.float32) for p in range(world)])
        same(b, want, f"graph all_to_all replay {i}")
        dist.barrier()


def t_new_group():
    members = list(range(0, world, 2)) if world > 2 else [0, 1]
    g = dist.new_group(members)
    if rank in members:
        x = inputs(rank, N, torch.float32).to(dev)
        dist.all_reduce(x, group=g)
        same(x, sum(inputs(r, N, torch.float32).double() for r in members), "new_group all_reduce")
    dist.destroy_process_group(g)
    # split_group (ncclCommSplit)
    if hasattr(dist, "split_group"):
        halves = [list(range(0, world // 2)), list(range(world // 2, world))]
        halves = [h for h in halves if h]
        sg = dist.split_group(split_ranks=halves)
        mine = next(h for h in halves if rank in h)
        x = inputs(rank, N, torch.float32).to(dev)
        dist.all_reduce(x, group=sg)
        same(x, sum(inputs(r, N, torch.float32).double() for r in mine), "split_group all_reduce")


for name, fn in [("all_gather_into_tensor", t_all_gather), ("reduce_scatter_tensor", t_reduce_scatter),
                 ("broadcast", t_broadcast), ("reduce", t_reduce), ("barrier", t_barrier),
                 ("send/recv", t_send_recv), ("all_to_all_single", t_all_to_all),
                 ("send/recv large", t_send_recv_large), ("all_to_all_single uneven", t_all_to_all_uneven),
                 ("cuda graph all_reduce", t_graph), ("cuda graph send/recv + all_to_all", t_graph_send_recv),
                 ("new_group/split", t_new_group)]:
    check(name, fn)

torch.cuda.synchronize()
check("destroy_process_group", dist.destroy_process_group)
print(f"RESULT rank {rank}: {len(failures)} failed {failures}", flush=True)
sys.exit(1 if failures else 0)
