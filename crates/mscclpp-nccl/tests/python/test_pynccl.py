"""A PyNCCL-style client (what vLLM and SGLang do): load libmscclpp_nccl.so by path with ctypes,
ncclGetUniqueId / ncclCommInitRank / ncclAllReduce on torch tensors' pointers, one process per
rank on GPU 0. Skipped without torch, a GPU, or the library (MSCCLPP_NCCL_SO, default
../../libmscclpp_nccl.so of the GPU bundle)."""
import ctypes
import os
import pathlib

import pytest

torch = pytest.importorskip("torch")
LIB = os.environ.get("MSCCLPP_NCCL_SO", str(pathlib.Path(__file__).resolve().parent / "libmscclpp_nccl.so"))
pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.skipif(not pathlib.Path(LIB).is_file(), reason=f"no {LIB}"),
]


class UniqueId(ctypes.Structure):
    _fields_ = [("internal", ctypes.c_byte * 128)]


def load():
    lib = ctypes.CDLL(LIB)
    lib.ncclGetErrorString.restype = ctypes.c_char_p
    lib.ncclGetLastError.restype = ctypes.c_char_p
    return lib


def ok(lib, rc):
    if rc != 0:
        raise RuntimeError(f"{lib.ncclGetErrorString(rc).decode()}: {lib.ncclGetLastError(None).decode()}")


def worker(rank, world, idq, q):
    try:
        torch.cuda.set_device(0)
        lib = load()
        uid = UniqueId()
        # As vLLM does: rank 0 makes the id (its process then hosts the bootstrap root, as NCCL's
        # ncclGetUniqueId caller does) and hands it to the others.
        if rank == 0:
            ok(lib, lib.ncclGetUniqueId(ctypes.byref(uid)))
            for _ in range(world - 1):
                idq.put(bytes(uid.internal))
        else:
            ctypes.memmove(ctypes.byref(uid), idq.get(timeout=60), 128)
        comm = ctypes.c_void_p()
        ok(lib, lib.ncclCommInitRank(ctypes.byref(comm), world, uid, rank))
        stream = ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)
        for n, dtype, code in [(1024, torch.float32, 7), (100001, torch.float16, 6), (4096, torch.int32, 2)]:
            x = torch.full((n,), rank + 1, dtype=dtype, device="cuda")
            y = torch.empty_like(x)
            ok(lib, lib.ncclAllReduce(ctypes.c_void_p(x.data_ptr()), ctypes.c_void_p(y.data_ptr()),
                                      ctypes.c_size_t(n), code, 0, comm, stream))
            torch.cuda.synchronize()
            want = world * (world + 1) // 2
            assert torch.all(y.cpu() == want), f"{dtype}: {y[:4]} != {want}"
        n = ctypes.c_int()
        ok(lib, lib.ncclCommCount(comm, ctypes.byref(n)))
        assert n.value == world
        ok(lib, lib.ncclCommDestroy(comm))
        q.put((rank, None))
    except Exception as e:  # noqa: BLE001
        q.put((rank, repr(e)))


@pytest.mark.parametrize("world", [2, 3])
def test_pynccl_all_reduce(world):
    import multiprocessing as mp
    lib = load()
    v = ctypes.c_int()
    ok(lib, lib.ncclGetVersion(ctypes.byref(v)))
    assert v.value >= 22800
    ctx = mp.get_context("spawn")
    q, idq = ctx.Queue(), ctx.Queue()
    ps = [ctx.Process(target=worker, args=(r, world, idq, q)) for r in range(world)]
    for p in ps:
        p.start()
    res = dict(q.get(timeout=240) for _ in ps)
    for p in ps:
        p.join(timeout=30)
    assert all(err is None for err in res.values()), res
