"""Collectives from Python: ``Communicator.all_reduce/all_gather/reduce_scatter/broadcast`` on
tensors, the raw ``Collectives`` class and the MSCCL++-style ``mscclpp_rs.ext`` API.

The first part needs no GPU (argument checks, name mapping). The GPU part runs two ranks as two
threads of this process (on two GPUs when there are two, else both on GPU 0), each on its own
torch stream, and compares every result with a CPU reference; it is skipped without torch and a
CUDA GPU. On the GPU machine: ``pytest -v test_collectives.py``.
"""

from __future__ import annotations

import importlib.util
import threading

import numpy as np
import pytest

import mscclpp_rs as m
from mscclpp_rs import ext

# --------------------------------------------------------------------------------------------
# No GPU needed
# --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def comm1():
    c = m.Communicator(0, 1, m.UniqueId.create())
    yield c
    c.close()


class FakeCuda:
    """An object with a __cuda_array_interface__ (host memory behind it: never launched on)."""

    def __init__(self, n=8, typestr="<f4", strides=None, readonly=False, stream=None):
        self._a = np.zeros(n, dtype=np.dtype(typestr))
        self.__cuda_array_interface__ = {
            "shape": (n,),
            "typestr": typestr,
            "data": (self._a.ctypes.data, readonly),
            "strides": strides,
            "version": 3,
        }
        if stream is not None:
            self.__cuda_array_interface__["stream"] = stream


def test_names_parse_like_the_rust_types():
    assert m._native.parse_dtype("bfloat16") == "bf16"
    assert m._native.parse_dtype("FP16") == "f16"
    assert m._native.parse_op("MAX") == "max"
    assert m._native.parse_algorithm("default_allreduce_rsag") == "simple"
    assert m._native.parse_algorithm("default_allreduce_allpair_packet") == "allpair"
    for fn, bad, text in [
        (m._native.parse_dtype, "int8", "unknown data type"),
        (m._native.parse_op, "xor", "unknown reduction"),
        (m._native.parse_algorithm, "ring", "unknown algorithm"),
    ]:
        with pytest.raises(m.InvalidUsageError, match=text) as e:
            fn(bad)
        assert isinstance(e.value, ValueError)


@pytest.mark.parametrize("bad", [np.zeros(4, np.float32), [1.0, 2.0], 3, None, "text"])
def test_non_gpu_objects_are_refused_with_value_error(comm1, bad):
    with pytest.raises(ValueError, match="GPU"):
        comm1.all_reduce(bad)
    with pytest.raises(ValueError, match="GPU"):
        comm1.broadcast(bad)
    with pytest.raises(ValueError, match="GPU"):
        comm1.reduce_scatter(bad)


def test_all_gather_of_bytes_still_gathers_bytes(comm1):
    assert comm1.all_gather(b"hi") == [b"hi"]
    assert comm1.all_gather(bytearray(b"xy")) == [b"xy"]
    with pytest.raises(ValueError, match="takes no out"):
        comm1.all_gather(b"hi", out=bytearray(2))
    with pytest.raises(ValueError, match="GPU"):
        comm1.all_gather(np.zeros(4, np.float32))


def test_bad_op_and_algorithm_strings(comm1):
    with pytest.raises(ValueError, match="unknown reduction"):
        comm1.all_reduce(FakeCuda(), op="xor")
    with pytest.raises(ValueError, match="unknown reduction"):
        comm1.reduce_scatter(FakeCuda(), op="bitand")
    with pytest.raises(ValueError, match="unknown algorithm"):
        comm1.all_reduce(FakeCuda(), algorithm="ring")
    with pytest.raises(ValueError, match="unknown algorithm"):
        comm1.broadcast(FakeCuda(), algorithm="tree")


def test_cuda_array_interface_checks(comm1):
    with pytest.raises(ValueError, match="typestr '<f8' is not supported"):
        comm1.all_reduce(FakeCuda(typestr="<f8"))
    with pytest.raises(ValueError, match="not supported"):
        comm1.all_reduce(FakeCuda(typestr="|u1"))
    with pytest.raises(ValueError, match="not contiguous"):
        comm1.all_reduce(FakeCuda(n=8, strides=(8,)))
    with pytest.raises(ValueError, match="read-only"):
        comm1.all_reduce(FakeCuda(readonly=True))
    with pytest.raises(ValueError, match="read-only"):
        comm1.all_reduce(FakeCuda(), out=FakeCuda(readonly=True))
    with pytest.raises(ValueError, match="out has dtype i32"):
        comm1.all_reduce(FakeCuda(), out=FakeCuda(typestr="<i4"))
    with pytest.raises(ValueError, match="out holds 4 elements, the call needs 8"):
        comm1.all_reduce(FakeCuda(), out=FakeCuda(n=4))
    with pytest.raises(ValueError, match="out holds 8 elements, the call needs 16"):
        comm1.all_gather(FakeCuda(n=16), out=FakeCuda(n=8))
    with pytest.raises(ValueError, match="pass out="):
        comm1.all_gather(FakeCuda())
    with pytest.raises(ValueError, match="pass out="):
        comm1.reduce_scatter(FakeCuda())
    with pytest.raises(ValueError, match="root 3"):
        comm1.broadcast(FakeCuda(), root=3)


class _Recorder:
    """Stands in for a Collectives: records the raw calls the tensor methods make."""

    def __init__(self):
        self.calls = []

    def __getattr__(self, name):
        return lambda *a, **k: self.calls.append((name, a, k))


class _FakeComm:
    size = 2

    def __init__(self):
        self.rec = _Recorder()
        self.devices = []

    def collectives(self, device=None):
        self.devices.append(device)
        return self.rec


def _ptr(f):
    return f.__cuda_array_interface__["data"][0]


def test_tensor_methods_pass_the_right_raw_arguments(monkeypatch):
    """The Python layer on its own (no GPU): pointers, counts, dtype, op, stream and options."""
    from mscclpp_rs import _collectives as c

    monkeypatch.setattr(m._native, "pointer_device", lambda ptr, nbytes=1: 3)
    comm = _FakeComm()
    x = FakeCuda(n=8)
    assert c.all_reduce(comm, x, "MAX", None, "default_allreduce_rsag", True, 4, 256, 123) is x
    assert comm.rec.calls[-1] == (
        "all_reduce",
        (_ptr(x), _ptr(x), 8, "f32", "max", 123),
        {"algorithm": "simple", "blocks": 4, "threads": 256, "accumulate_f32": True},
    )
    assert comm.devices[-1] == 3  # the collectives are built on the data's GPU
    y, out = FakeCuda(n=8, typestr="<i4", stream=5), FakeCuda(n=8, typestr="<i4")
    assert c.all_reduce(comm, y, None, out, None, False, None, None, None) is out
    name, args, kw = comm.rec.calls[-1]
    assert (name, args) == ("all_reduce", (_ptr(y), _ptr(out), 8, "i32", "sum", 5))  # the array's own stream
    assert kw == {"algorithm": None, "blocks": None, "threads": None, "accumulate_f32": False}

    g_out = FakeCuda(n=16, typestr="<f2")
    h = FakeCuda(n=8, typestr="<f2")
    assert c.all_gather(comm, h, g_out, "packet", None, None, 7) is g_out
    assert comm.rec.calls[-1] == (
        "all_gather",
        (_ptr(h), _ptr(g_out), 8, "f16", 7),
        {"algorithm": "packet", "blocks": None, "threads": None},
    )
    rs_out = FakeCuda(n=4, typestr="<u4")
    u = FakeCuda(n=8, typestr="<u4")
    assert c.reduce_scatter(comm, u, rs_out, "min", None, False, 2, None, 0) is rs_out
    assert comm.rec.calls[-1] == (
        "reduce_scatter",
        (_ptr(u), _ptr(rs_out), 4, "u32", "min", 0),
        {"algorithm": None, "blocks": 2, "threads": None, "accumulate_f32": False},
    )
    with pytest.raises(ValueError, match="out holds 8 elements, the call needs 4"):
        c.reduce_scatter(comm, u, FakeCuda(n=8, typestr="<u4"), None, None, False, None, None, 0)
    with pytest.raises(ValueError, match="do not split into 2"):
        c.reduce_scatter(comm, FakeCuda(n=7), None, None, None, False, None, None, 0)
    assert c.broadcast(comm, x, 1, None, None, 64, 9) is x
    assert comm.rec.calls[-1] == (
        "broadcast",
        (_ptr(x), _ptr(x), 8, "f32", 1, 9),
        {"algorithm": None, "blocks": None, "threads": 64},
    )


def test_stream_choice():
    from mscclpp_rs._collectives import _describe, _stream_of

    d = _describe(FakeCuda(stream=1), "x", writable=True)
    assert d.stream == 0  # v3's 1 is the legacy default stream
    assert _stream_of(None, d, 0) == 0
    assert _stream_of(1234, d, 0) == 1234
    assert _stream_of(None, _describe(FakeCuda(stream=99), "x", True), 0) == 99

    class S:
        cuda_stream = 77

    assert _stream_of(S(), d, 0) == 77
    with pytest.raises(ValueError, match="stream must be"):
        _stream_of("s", d, 0)


@pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="needs torch")
def test_torch_cpu_tensors_and_dtypes_are_refused(comm1):
    import torch

    with pytest.raises(ValueError, match="not on a GPU"):
        comm1.all_reduce(torch.zeros(4))
    with pytest.raises(ValueError, match="dtype torch.float64 is not supported"):
        comm1.all_reduce(torch.zeros(4, dtype=torch.float64))
    with pytest.raises(ValueError, match="dtype torch.int8 is not supported"):
        comm1.all_gather(torch.zeros(4, dtype=torch.int8))
    assert ext._dtype_name(torch.bfloat16) == "bf16"


def test_collectives_settings_are_checked_before_building(comm1):
    with pytest.raises(ValueError, match="timeout"):
        m.Collectives(comm1, device=0, timeout=-1.0)
    with pytest.raises(TypeError):
        m.Collectives(comm1, 0)  # settings are keyword-only
    assert comm1.has_collectives is False


def test_closed_communicator_refuses_collectives():
    c = m.Communicator(0, 1, m.UniqueId.create())
    c.close()
    with pytest.raises(m.AbortedError):
        c.collectives(device=0)
    with pytest.raises(m.AbortedError):
        m.Collectives(c)


def test_ext_collection_maps_mscclpp_names():
    algos = ext.AlgorithmCollectionBuilder().build_default_algorithms(
        scratch_buffer=0, scratch_buffer_size=1 << 27, rank=0
    )
    expected = {
        "default_allreduce_allpair_packet": ("allreduce", "allpair"),
        "default_allreduce_packet": ("allreduce", "packet"),
        "default_allreduce_nvls_packet": ("allreduce", "packet"),
        "default_allreduce_rsag": ("allreduce", "simple"),
        "default_allreduce_rsag_zero_copy": ("allreduce", "simple"),
        "default_allreduce_nvls_zero_copy": ("allreduce", "simple"),
        "default_allreduce_fullmesh": ("allreduce", "simple"),
        "default_allgather_fullmesh": ("allgather", "simple"),
        "default_allgather_fullmesh2": ("allgather", "simple"),
        "default_reducescatter_packet": ("reducescatter", "packet"),
        "default_broadcast_simple": ("broadcast", "simple"),
    }
    for name, (coll, native) in expected.items():
        a = algos[name]
        assert (a.name, a.collective, a.native_algorithm) == (name, coll, native)
        assert a.is_native_algorithm() and not a.is_dsl_algorithm()
        assert name in algos
    # MSCCL++'s idiom: a list comprehension over the collection.
    assert [a for a in algos if a.collective == "allreduce" and a.name == "default_allreduce_packet"][0] is algos[
        "default_allreduce_packet"
    ]
    assert {a.collective for a in algos.get_by_collective("allgather")} == {"allgather"}
    assert algos[0] is list(algos)[0] and len(algos) == len(ext.ALGORITHM_MAP)
    assert algos.get("nope") is None
    with pytest.raises(KeyError, match="no algorithm named"):
        algos["default_allreduce_ring"]
    a = algos["default_allreduce_packet"]
    a.set_message_size_range(0, 2 << 20)
    assert a.message_size_range == (0, 2 << 20)
    a.reset()
    # every name is accepted as `algorithm=` of the tensor methods too, meaning the same
    from mscclpp_rs._collectives import _algo_name

    for name, (_, native, _) in ext.ALGORITHM_MAP.items():
        assert _algo_name(name) == native
        assert _algo_name(algos[name]) == native
    assert _algo_name("packet") == "packet" and _algo_name("default_allgather_fullmesh") == "simple"
    # The builder is a singleton, as in MSCCL++, and reset() forgets it.
    assert ext.AlgorithmCollectionBuilder() is ext.AlgorithmCollectionBuilder()
    b = ext.AlgorithmCollectionBuilder()
    ext.AlgorithmCollectionBuilder.reset()
    assert ext.AlgorithmCollectionBuilder() is not b
    with pytest.raises(NotImplementedError):
        b.add_algorithm_builder(object())
    assert ext.is_nvls_supported() is False


def test_ext_execute_reports_bad_calls_as_codes(comm1):
    algos = ext.AlgorithmCollectionBuilder().build_default_algorithms(0, 0, 0)
    a = algos["default_allreduce_packet"]
    with pytest.raises(TypeError, match="Communicator"):
        a.execute(object(), 0, 0, 16, 16, ext.DataType.float32)
    rc = a.execute(comm1, 0, 0, 16, 16, "float64")
    assert rc == ext.CommResult.COMM_INVALID_ARGUMENT
    assert isinstance(a.last_error, m.InvalidUsageError)
    with pytest.raises(m.InvalidUsageError):
        a.execute(comm1, 0, 0, 16, 16, "float64", raise_errors=True)
    rc = a.execute(comm1, 0, 0, 18, 18, ext.DataType.float32)  # not whole elements
    assert rc == ext.CommResult.COMM_INVALID_ARGUMENT and "whole" in str(a.last_error)
    rc = a.execute(comm1, 0, 0, 16, 16, ext.DataType.int32, accum_dtype=ext.DataType.float16)
    assert rc == ext.CommResult.COMM_INVALID_ARGUMENT and "accum_dtype" in str(a.last_error)
    g = algos["default_allgather_fullmesh2"]
    assert g.execute(comm1, 0, 0, 16, 8, ext.DataType.float32) == ext.CommResult.COMM_INVALID_ARGUMENT
    assert ext._op_name(ext.ReduceOp.NOP) == "sum" and ext._op_name(ext.ReduceOp.MAX) == "max"
    assert ext._dtype_name(ext.DataType.bfloat16) == "bf16" and ext._dtype_name("float16") == "f16"


# --------------------------------------------------------------------------------------------
# GPU: two ranks as threads
# --------------------------------------------------------------------------------------------


def _have_gpu() -> bool:
    if importlib.util.find_spec("torch") is None:
        return False
    import torch

    return torch.cuda.is_available()


needs_gpu = pytest.mark.skipif(not _have_gpu(), reason="needs a CUDA GPU and torch")

NRANKS = 2
SMALL, LARGE = 1000, (3 << 18) + 5  # LL packets; staged (over 1 MiB for every type)
DTYPES = ["float32", "float16", "bfloat16", "int32"]


class Ranks:
    """Two communicators, each driven by its own thread on its own stream."""

    def __init__(self):
        import torch

        self.torch = torch
        uid = m.UniqueId.create()
        ndev = torch.cuda.device_count()
        self.dev = [r if ndev >= NRANKS else 0 for r in range(NRANKS)]
        self.streams = [torch.cuda.Stream(device=d) for d in self.dev]
        self.comms = [None] * NRANKS
        self.run(lambda r, _c: self._join(r, uid), setup=True)

    def _join(self, r, uid):
        c = m.Communicator(r, NRANKS, uid, timeout=60.0)
        # Tuning off (quick); the device waits bounded so that a bug fails instead of hanging.
        c.collectives(device=self.dev[r], timeout=20.0, tune=False)
        self.comms[r] = c

    def run(self, fn, setup=False, timeout=180.0):
        """fn(rank, comm) on every rank at once, each in its own thread under its own stream;
        returns the results after the streams are idle."""
        torch = self.torch
        results, errors = [None] * NRANKS, [None] * NRANKS

        def body(r):
            try:
                torch.cuda.set_device(self.dev[r])
                with torch.cuda.stream(self.streams[r]):
                    results[r] = fn(r, self.comms[r])
                self.streams[r].synchronize()
                if not setup:
                    self.comms[r].collectives().check()
            except BaseException as e:  # noqa: BLE001 - re-raised in the test's thread
                errors[r] = e

        threads = [threading.Thread(target=body, args=(r,), daemon=True) for r in range(NRANKS)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout)
            if t.is_alive():
                pytest.fail(f"a rank did not finish within {timeout} s")
        for e in errors:
            if e is not None:
                raise e
        return results


@pytest.fixture(scope="module")
def ranks():
    r = Ranks()
    yield r
    for c in r.comms:
        c.close()


def _tdtype(name):
    import torch

    return getattr(torch, name)


def _input(r, n, dtype, dev, salt=0):
    """Rank r's input: small integers (-4..4), exact in every type and in sums of a few ranks."""
    import torch

    a = torch.arange(n, device=f"cuda:{dev}", dtype=torch.int64)
    return ((a * 7 + r * 3 + salt) % 9 - 4).to(_tdtype(dtype))


def _ref(n, salt=0):
    return [((np.arange(n, dtype=np.int64) * 7 + r * 3 + salt) % 9 - 4).astype(np.float64) for r in range(NRANKS)]


def _np(t):
    return t.float().cpu().numpy().astype(np.float64) if t.dtype != _tdtype("int32") else t.cpu().numpy().astype(np.float64)


@needs_gpu
@pytest.mark.parametrize("n", [SMALL, LARGE])
@pytest.mark.parametrize("inplace", [True, False])
@pytest.mark.parametrize("dtype", DTYPES)
def test_all_reduce_matches_cpu(ranks, dtype, inplace, n):
    def fn(r, c):
        x = _input(r, n, dtype, ranks.dev[r])
        if inplace:
            y = c.all_reduce(x)
            assert y is x
        else:
            out = ranks.torch.empty_like(x)
            y = c.all_reduce(x, out=out, accumulate_f32=dtype in ("float16", "bfloat16"))
            assert y is out
        return _np(y)

    want = sum(_ref(n))
    for got in ranks.run(fn):
        np.testing.assert_array_equal(got, want)


@needs_gpu
@pytest.mark.parametrize("op", ["sum", "prod", "min", "max", "avg"])
def test_all_reduce_operations(ranks, op):
    refs = _ref(SMALL)
    want = {
        "sum": sum(refs),
        "prod": np.prod(refs, axis=0),
        "min": np.min(refs, axis=0),
        "max": np.max(refs, axis=0),
        "avg": sum(refs) / NRANKS,
    }[op]

    def fn(r, c):
        return _np(c.all_reduce(_input(r, SMALL, "float32", ranks.dev[r]), op=op))

    for got in ranks.run(fn):
        np.testing.assert_array_equal(got, want)


@needs_gpu
@pytest.mark.parametrize("algorithm", ["allpair", "packet", "simple", "default_allreduce_rsag_zero_copy"])
def test_all_reduce_algorithm_and_shape(ranks, algorithm):
    def fn(r, c):
        x = _input(r, SMALL, "bfloat16", ranks.dev[r])
        return _np(c.all_reduce(x, algorithm=algorithm, blocks=2, threads=256))

    for got in ranks.run(fn):
        np.testing.assert_array_equal(got, sum(_ref(SMALL)))


@needs_gpu
@pytest.mark.parametrize("n", [SMALL, LARGE])
@pytest.mark.parametrize("mode", ["new", "out", "inplace"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_all_gather_matches_cpu(ranks, dtype, mode, n):
    torch = ranks.torch

    def fn(r, c):
        x = _input(r, n, dtype, ranks.dev[r])
        if mode == "new":
            y = c.all_gather(x)
        elif mode == "out":
            y = c.all_gather(x, out=torch.empty(NRANKS * n, dtype=x.dtype, device=x.device))
        else:  # the input is this rank's slot of the output
            y = torch.zeros(NRANKS * n, dtype=x.dtype, device=x.device)
            y[r * n : (r + 1) * n].copy_(x)
            assert c.all_gather(y[r * n : (r + 1) * n], out=y) is y
        assert tuple(y.shape) == (NRANKS * n,)
        return _np(y)

    want = np.concatenate(_ref(n))
    for got in ranks.run(fn):
        np.testing.assert_array_equal(got, want)


@needs_gpu
@pytest.mark.parametrize("n", [SMALL, LARGE])
@pytest.mark.parametrize("mode", ["new", "out", "inplace"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_reduce_scatter_matches_cpu(ranks, dtype, mode, n):
    torch = ranks.torch
    total = NRANKS * n

    def fn(r, c):
        x = _input(r, total, dtype, ranks.dev[r])
        if mode == "new":
            y = c.reduce_scatter(x)
        elif mode == "out":
            y = c.reduce_scatter(x, out=torch.empty(n, dtype=x.dtype, device=x.device))
        else:  # the output is this rank's segment of the input
            y = x[r * n : (r + 1) * n]
            assert c.reduce_scatter(x, out=y) is y
        assert tuple(y.shape) == (n,)
        return _np(y)

    full = sum(_ref(total))
    for r, got in enumerate(ranks.run(fn)):
        np.testing.assert_array_equal(got, full[r * n : (r + 1) * n])


@needs_gpu
@pytest.mark.parametrize("n", [SMALL, LARGE])
@pytest.mark.parametrize("root", [0, 1])
@pytest.mark.parametrize("dtype", DTYPES)
def test_broadcast_matches_cpu(ranks, dtype, root, n):
    def fn(r, c):
        x = _input(r, n, dtype, ranks.dev[r])
        assert c.broadcast(x, root=root) is x
        return _np(x)

    for got in ranks.run(fn):
        np.testing.assert_array_equal(got, _ref(n)[root])


@needs_gpu
def test_two_dimensional_tensors_keep_their_shape(ranks):
    torch = ranks.torch

    def fn(r, c):
        x = _input(r, 64 * 8, "float32", ranks.dev[r]).view(64, 8)
        g = c.all_gather(x)
        s = c.reduce_scatter(x)
        return tuple(g.shape), tuple(s.shape), _np(s)

    for r, (g, s, vals) in enumerate(ranks.run(fn)):
        assert g == (NRANKS * 64, 8) and s == (64 // NRANKS, 8)
        full = sum(_ref(64 * 8)).reshape(64, 8)
        np.testing.assert_array_equal(vals, full[r * 32 : (r + 1) * 32])
    del torch


@needs_gpu
def test_gpu_argument_errors(ranks):
    torch = ranks.torch
    c = ranks.comms[0]
    dev = f"cuda:{ranks.dev[0]}"
    with pytest.raises(ValueError, match="not contiguous"):
        c.all_reduce(torch.zeros(8, 8, device=dev).t())
    with pytest.raises(ValueError, match="float64"):
        c.all_reduce(torch.zeros(8, device=dev, dtype=torch.float64))
    with pytest.raises(ValueError, match="out holds"):
        c.all_reduce(torch.zeros(8, device=dev), out=torch.zeros(9, device=dev))
    with pytest.raises(ValueError, match="out holds"):
        c.all_gather(torch.zeros(8, device=dev), out=torch.zeros(8, device=dev))
    with pytest.raises(ValueError, match="equal segments"):
        c.reduce_scatter(torch.zeros(7, device=dev))
    with pytest.raises(ValueError, match="out has dtype"):
        c.all_reduce(torch.zeros(8, device=dev), out=torch.zeros(8, device=dev, dtype=torch.int32))


@needs_gpu
def test_raw_collectives_and_plan(ranks):
    coll = ranks.comms[0].collectives()
    assert coll is ranks.comms[0].collectives()  # one per communicator
    assert ranks.comms[0].has_collectives
    assert (coll.rank, coll.size, coll.device) == (0, NRANKS, ranks.dev[0])
    assert coll.scratch_bytes > 0 and coll.max_blocks >= 1 and coll.timeout == 20.0
    assert coll.tuning is None and not coll.failed
    algo, blocks, threads = coll.plan("all_reduce", 1024)
    assert algo in ("allpair", "packet", "simple") and blocks >= 1 and threads % 32 == 0
    assert coll.plan("all_reduce", 1024, algorithm="simple", blocks=3, threads=128) == ("simple", 3, 128)
    with pytest.raises(ValueError, match="does not implement"):
        coll.plan("all_gather", 1024, algorithm="allpair")
    with pytest.raises(ValueError, match="multiple of 32"):
        coll.plan("all_reduce", 1024, threads=100)
    with pytest.raises(ValueError, match="unknown collective"):
        coll.plan("gather", 1024)
    torch = ranks.torch

    def fn(r, c):
        x = _input(r, SMALL, "int32", ranks.dev[r])
        y = torch.empty_like(x)
        s = torch.cuda.current_stream().cuda_stream
        c.collectives().all_reduce(x.data_ptr(), y.data_ptr(), SMALL, "i32", "sum", s)
        c.collectives().synchronize(s, 30.0)
        return _np(y)

    for got in ranks.run(fn):
        np.testing.assert_array_equal(got, sum(_ref(SMALL)))


@needs_gpu
def test_ext_execute_matches_cpu(ranks):
    torch = ranks.torch
    algos = ext.AlgorithmCollectionBuilder().build_default_algorithms(
        scratch_buffer=0, scratch_buffer_size=0, rank=0
    )

    def fn(r, c):
        out = {}
        for name in ["default_allreduce_allpair_packet", "default_allreduce_packet", "default_allreduce_rsag_zero_copy"]:
            x = _input(r, SMALL, "bfloat16", ranks.dev[r])
            rc = algos[name].execute(
                comm=c,
                input_buffer=x.data_ptr(),
                output_buffer=x.data_ptr(),
                input_size=x.nbytes,
                output_size=x.nbytes,
                dtype=ext.DataType.bfloat16,
                op=ext.ReduceOp.SUM,
                stream=torch.cuda.current_stream().cuda_stream,
                nblocks=4,
                nthreads_per_block=512,
                accum_dtype=ext.DataType.float32,
            )
            assert rc == 0, algos[name].last_error
            out[name] = _np(x)
        x = _input(r, SMALL, "float32", ranks.dev[r])
        y = torch.empty(NRANKS * SMALL, dtype=x.dtype, device=x.device)
        assert algos["default_allgather_fullmesh2"].execute(c, x, y, x.nbytes, y.nbytes, torch.float32) == 0
        out["ag"] = _np(y)
        # A call the algorithm cannot serve is a code on every rank, and nothing runs.
        big = torch.zeros(8 << 20, dtype=torch.float32, device=x.device)
        rc = algos["default_allreduce_allpair_packet"].execute(c, big, big, big.nbytes, big.nbytes, "float32")
        out["big"] = rc
        return out

    for got in ranks.run(fn):
        for name in ["default_allreduce_allpair_packet", "default_allreduce_packet", "default_allreduce_rsag_zero_copy"]:
            np.testing.assert_array_equal(got[name], sum(_ref(SMALL)))
        np.testing.assert_array_equal(got["ag"], np.concatenate(_ref(SMALL)))
        assert got["big"] == ext.CommResult.COMM_INVALID_ARGUMENT


@needs_gpu
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_cuda_graph_captured_all_reduce_replays_with_new_inputs(ranks, dtype):
    torch = ranks.torch
    n = 4096
    graphs = [None] * NRANKS

    def setup(r, c):
        x = _input(r, n, dtype, ranks.dev[r])
        y = torch.empty_like(x)
        c.all_reduce(x, out=y)  # warm-up (eager): the collectives exist before capture
        return x, y

    bufs = ranks.run(setup)
    for c in ranks.comms:
        assert c.has_collectives

    def capture(r, c):
        x, y = bufs[r]
        g = torch.cuda.CUDAGraph()
        # thread_local: the other rank's thread keeps working while this one captures.
        with torch.cuda.graph(g, stream=ranks.streams[r], capture_error_mode="thread_local"):
            c.all_reduce(x, out=y)
        graphs[r] = g

    ranks.run(capture)  # both captured (and idle) before either replays

    def replay(r, c):
        x, y = bufs[r]
        base = _input(r, n, dtype, ranks.dev[r])
        want0 = torch.tensor(sum(_ref(n)), dtype=torch.float32, device=x.device)
        bad = []
        for i in range(100):
            x.copy_(base + (i % 7))  # new inputs in the captured buffer
            graphs[r].replay()
            if not torch.equal(y.float(), want0 + NRANKS * (i % 7)):
                bad.append(i)
        return bad

    assert ranks.run(replay) == [[], []]
