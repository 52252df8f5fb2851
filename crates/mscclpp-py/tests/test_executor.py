"""MSCCL++ execution plans from Python: ``ExecutionPlan`` and ``Executor``.

The first part needs no GPU (plan loading, validation errors with their JSON path, argument
checks). The GPU part runs two ranks as two threads of this process (on two GPUs when there are
two, else both on GPU 0), each on its own torch stream, runs plans this library generates and
compares the results with a CPU reference; it is skipped without torch and a CUDA GPU. On the GPU
machine: ``pytest -v test_executor.py``.
"""

from __future__ import annotations

import errno
import importlib.util
import json
import threading

import numpy as np
import pytest

import mscclpp_rs as m

# --------------------------------------------------------------------------------------------
# No GPU needed
# --------------------------------------------------------------------------------------------


def _plan_file(tmp_path, text, name="plan.json"):
    p = tmp_path / name
    p.write_text(text)
    return str(p)


def test_plan_loads_with_its_properties(tmp_path):
    text = m._native.generate_plan("allpair_allreduce", 2, "LL", inplace=False)
    plan = m.ExecutionPlan(_plan_file(tmp_path, text))
    doc = json.loads(text)
    assert plan.name == doc["name"]
    assert plan.collective == "allreduce"
    assert plan.world_size == 2 and plan.protocol == "LL" and plan.inplace is False
    assert plan.min_message_size == 0 and plan.num_threads_per_block > 0
    assert "2" in plan.summary() and "ExecutionPlan(" in repr(plan)
    again = m.ExecutionPlan.from_json(plan.to_json())
    assert again.name == plan.name and again.world_size == 2
    simple = m.ExecutionPlan.from_json(m._native.generate_plan("ring", 4, "Simple", inplace=True))
    assert simple.protocol == "Simple" and simple.inplace and simple.world_size == 4


def _broken(mutate):
    doc = json.loads(m._native.generate_plan("allpair_allreduce", 2, "Simple"))
    mutate(doc)
    return json.dumps(doc)


def _first_op_with(doc, field):
    for op in doc["gpus"][1]["threadblocks"][0]["ops"]:
        if field in op:
            return op
    raise AssertionError(f"no op with {field}")


@pytest.mark.parametrize(
    "mutate, path",
    [
        (lambda d: d.pop("gpus"), "gpus"),
        (lambda d: d.__setitem__("protocol", "Fast"), "protocol"),
        (lambda d: d["gpus"][1]["threadblocks"][0]["ops"][0].__setitem__("name", "teleport"),
         "gpus[1].threadblocks[0].ops[0].name"),
        (lambda d: d["gpus"][1].__setitem__("input_chunks", "two"), "gpus[1].input_chunks"),
        (lambda d: d["gpus"][0]["channels"][0].__setitem__("channel_type", "switch"), "gpus[0].channels[0]"),
    ],
)
def test_invalid_plans_name_the_json_path(tmp_path, mutate, path):
    text = _broken(mutate)
    for load in (lambda: m.ExecutionPlan(_plan_file(tmp_path, text)), lambda: m.ExecutionPlan.from_json(text)):
        with pytest.raises(m.PlanError) as e:
            load()
        assert isinstance(e.value, ValueError) and isinstance(e.value, m.InvalidUsageError)
        assert e.value.path is not None and e.value.path.startswith(path), (e.value.path, str(e.value))
        assert e.value.path in str(e.value)


def test_chunk_index_out_of_range_names_the_index(tmp_path):
    def mutate(d):
        op = _first_op_with(d, "src_buff")
        op["src_buff"][0]["index"] = 1000

    with pytest.raises(m.PlanError) as e:
        m.ExecutionPlan.from_json(_broken(mutate))
    assert e.value.path.startswith("gpus[1].threadblocks[0].ops[") and e.value.path.endswith("src_buff[0].index")


def test_unreadable_and_non_json_plans(tmp_path):
    with pytest.raises(m.PlanError) as e:
        m.ExecutionPlan(str(tmp_path / "missing.json"))
    assert e.value.path is None and e.value.errno == errno.ENOENT
    with pytest.raises(m.PlanError, match="not JSON") as e:
        m.ExecutionPlan(_plan_file(tmp_path, "{ nope"))
    assert e.value.path is None


def test_generate_plan_refuses_bad_arguments():
    with pytest.raises(ValueError, match="unknown plan algorithm"):
        m._native.generate_plan("tree", 2)
    with pytest.raises(ValueError, match="unknown protocol"):
        m._native.generate_plan("ring", 2, "Fast")
    with pytest.raises(ValueError, match="no hierarchical_allreduce plan"):
        m._native.generate_plan("hierarchical_allreduce", 2)


@pytest.fixture(scope="module")
def comm1():
    c = m.Communicator(0, 1, m.UniqueId.create())
    yield c
    c.close()


class FakeCuda:
    """An object with a __cuda_array_interface__ (host memory behind it: never launched on)."""

    def __init__(self, n=8, typestr="<f4"):
        self._a = np.zeros(n, dtype=np.dtype(typestr))
        self.__cuda_array_interface__ = {"shape": (n,), "typestr": typestr, "data": (self._a.ctypes.data, False),
                                         "version": 3}


def test_executor_checks_arguments_before_any_gpu_work(comm1):
    ex = m.Executor(comm1, device=0, timeout=5.0)
    assert ex.rank == 0 and ex.device == 0 and "Executor(" in repr(ex)
    plan2 = m.ExecutionPlan.from_json(m._native.generate_plan("allpair_allreduce", 2))
    with pytest.raises(m.InvalidUsageError, match="is for 2 ranks, the communicator has 1"):
        ex.execute(0, 1 << 40, 1 << 40, 1024, 1024, m.DataType.float32, plan2, 0)
    with pytest.raises(m.InvalidUsageError, match="rank 1 given"):
        ex.execute(1, 1 << 40, 1 << 40, 1024, 1024, m.DataType.float32, plan2, 0)
    with pytest.raises(m.InvalidUsageError, match="plan must be an ExecutionPlan"):
        ex.execute(0, 1 << 40, 1 << 40, 1024, 1024, m.DataType.float32, "plan.json", 0)
    # The native object, for the checks a one-rank plan would reach (none exists: generated plans
    # need two ranks); dtype and packet type are checked before the stream.
    nat = ex._native
    with pytest.raises(m.InvalidUsageError, match="unknown data type"):
        nat.execute(0, 1 << 40, 1 << 40, 1024, 1024, "int8", plan2, 0)
    with pytest.raises(m.InvalidUsageError, match="unknown packet type"):
        nat.execute(0, 1 << 40, 1 << 40, 1024, 1024, "f32", plan2, 0, "LL4")
    with pytest.raises(ValueError, match="port_transport"):
        m.Executor(comm1, device=0, port_transport="carrier-pigeon")
    with pytest.raises(ValueError, match="kernel"):
        m.Executor(comm1, device=0, kernel="jit")
    for kernel in ("interpreter", "per-plan", "per_plan", None):
        m.Executor(comm1, device=0, kernel=kernel)
    with pytest.raises(ValueError, match="timeout"):
        m.Executor(comm1, device=0, timeout=-1.0)


def test_executor_python_argument_checks(comm1):
    ex = m.Executor(comm1, device=0)
    plan = m.ExecutionPlan.from_json(m._native.generate_plan("allpair_allreduce", 2))
    # The world size is checked by the native build, after these (a two-rank plan here).
    for args, text in [
        ((0, 1 << 40, 1 << 40, -1, 1024), "send_buff_size must be >= 0"),
        ((0, 1 << 40, 1 << 40, 1024, 1.5), "recv_buff_size must be an int"),
        ((0, np.zeros(4, np.float32), 1 << 40, 16, 16), "GPU"),
        ((0, 0, 1 << 40, 16, 16), "not a device pointer"),
        ((0, FakeCuda(4), 1 << 40, 1024, 1024), "holds 16 bytes, the call says 1024"),
        ((-1, 1 << 40, 1 << 40, 16, 16), "rank"),
    ]:
        with pytest.raises(m.InvalidUsageError, match=text):
            ex.execute(*args, m.DataType.float32, plan, 0)
    with pytest.raises(m.InvalidUsageError, match="packet_type"):
        ex.execute(0, 1 << 40, 1 << 40, 16, 16, "f32", plan, 0, packet_type=16)
    assert m.PacketType.LL16.name == "LL16" and m.PacketType.LL8.name == "LL8"


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


class Ranks:
    """Two communicators and executors, each driven by its own thread on its own stream."""

    def __init__(self):
        import torch

        self.torch = torch
        uid = m.UniqueId.create()
        ndev = torch.cuda.device_count()
        self.dev = [r if ndev >= NRANKS else 0 for r in range(NRANKS)]
        self.streams = [torch.cuda.Stream(device=d) for d in self.dev]
        self.comms = [None] * NRANKS
        self.execs = [None] * NRANKS
        self.run(lambda r: self._join(r, uid))

    def _join(self, r, uid):
        self.comms[r] = m.Communicator(r, NRANKS, uid, timeout=60.0)
        self.execs[r] = m.Executor(self.comms[r], device=self.dev[r], timeout=20.0)

    def run(self, fn, timeout=180.0):
        torch = self.torch
        results, errors = [None] * NRANKS, [None] * NRANKS

        def body(r):
            try:
                torch.cuda.set_device(self.dev[r])
                with torch.cuda.stream(self.streams[r]):
                    results[r] = fn(r)
                self.streams[r].synchronize()
                if self.execs[r] is not None:
                    self.execs[r].check()
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


def _input(r, n, dev):
    import torch

    a = torch.arange(n, device=f"cuda:{dev}", dtype=torch.int64)
    return ((a * 7 + r * 3) % 9 - 4).to(torch.int32)


def _ref_input(r, n):
    return (np.arange(n, dtype=np.int64) * 7 + r * 3) % 9 - 4


@needs_gpu
@pytest.mark.parametrize("algorithm", ["allpair_allreduce", "ring_allreduce"])
@pytest.mark.parametrize("protocol", ["LL", "Simple"])
@pytest.mark.parametrize("inplace", [False, True])
def test_generated_allreduce_plans_match_cpu(ranks, algorithm, protocol, inplace):
    import torch

    plan = m.ExecutionPlan.from_json(m._native.generate_plan(algorithm, NRANKS, protocol, inplace))
    chunks = json.loads(plan.to_json())["gpus"][0]["input_chunks"]
    n = chunks * 256  # int32 elements: 1 KiB per chunk

    def body(r):
        x = _input(r, n, ranks.dev[r])
        y = x if inplace else torch.empty_like(x)
        for _ in range(3):  # the first call builds, the next ones run on cached resources
            if inplace:
                x.copy_(_input(r, n, ranks.dev[r]))
            ranks.execs[r].execute(r, x, y, x.nbytes, y.nbytes, m.DataType.int32, plan)
        return y.cpu().numpy()

    out = ranks.run(body)
    want = sum(_ref_input(r, n) for r in range(NRANKS))
    for r in range(NRANKS):
        np.testing.assert_array_equal(out[r], want, err_msg=f"rank {r}")


@needs_gpu
def test_allgather_plan_with_raw_pointers_and_a_torch_stream(ranks):
    import torch

    plan = m.ExecutionPlan.from_json(m._native.generate_plan("allgather", NRANKS, "LL"))
    g = json.loads(plan.to_json())["gpus"][0]
    n_in = g["input_chunks"] * 256

    def body(r):
        x = _input(r, n_in, ranks.dev[r])
        y = torch.zeros(n_in * NRANKS, dtype=torch.int32, device=f"cuda:{ranks.dev[r]}")
        ex = ranks.execs[r]
        ex.execute(r, x.data_ptr(), y.data_ptr(), x.nbytes, y.nbytes, "int32", plan,
                   torch.cuda.current_stream(), packet_type=m.PacketType.LL8)
        ex.synchronize(torch.cuda.current_stream())
        keep = (x, y)  # raw pointers: the caller keeps the tensors
        return keep[1].cpu().numpy()

    out = ranks.run(body)
    want = np.concatenate([_ref_input(r, n_in) for r in range(NRANKS)])
    for r in range(NRANKS):
        np.testing.assert_array_equal(out[r], want, err_msg=f"rank {r}")


@needs_gpu
def test_size_errors_name_the_plan(ranks):
    import torch

    plan = m.ExecutionPlan.from_json(m._native.generate_plan("allpair_allreduce", NRANKS, "LL"))

    def body(r):
        x = torch.zeros(3, dtype=torch.int32, device=f"cuda:{ranks.dev[r]}")
        with pytest.raises(m.PlanError):
            ranks.execs[r].execute(r, x, x, 12, 12, m.DataType.int32, plan)

    ranks.run(body)
