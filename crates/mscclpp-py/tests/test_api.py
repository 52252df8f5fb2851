"""One process, a self-connection: the API, bad inputs (always exceptions, never crashes) and
the GIL being released in blocking calls."""

import array
import builtins
import errno
import gc
import os
import re
import pickle
import threading

import numpy as np
import pytest

import mscclpp_rs as m

ETH = m.Transport.ETHERNET


@pytest.fixture(scope="module")
def comm():
    return m.Communicator(0, 1, m.UniqueId.create(), timeout=20.0)


@pytest.fixture(scope="module")
def conn(comm):
    return comm.connect(0, ETH)


@pytest.fixture()
def pair(comm, conn):
    """A local source (numpy) and the 'peer' view of a local bytearray destination."""
    src = np.arange(256, dtype=np.uint8)
    dst = bytearray(256)
    msrc = comm.register(src, ETH)
    mdst = comm.register(dst, ETH)
    rdst = comm.exchange(mdst, [0])[0]
    return src, dst, msrc, mdst, rdst


def test_unique_id_round_trips(comm):
    uid = m.UniqueId.create()
    b = bytes(uid)
    assert len(b) == m.UNIQUE_ID_BYTES == 128
    assert m.UniqueId(b) == uid
    assert m.UniqueId(str(uid)) == uid
    assert pickle.loads(pickle.dumps(uid)) == uid
    assert ":" in uid.root_addr
    assert uid.to_bytes() == b and m.UniqueId.from_bytes(b) == uid


def test_unique_id_is_hashable():
    a, b = m.UniqueId.create(), m.UniqueId.create()
    a2 = m.UniqueId(a.to_bytes())
    assert a2 == a and a2 is not a and hash(a2) == hash(a)
    assert a != b
    assert len({a, a2, b}) == 2
    assert {a: "job"}[a2] == "job"


@pytest.mark.parametrize("bad", [b"", b"garbage", b"\xff" * 200, "not an id", bytearray(3)])
def test_bad_unique_id_raises(bad):
    with pytest.raises(m.InvalidUsageError):
        m.UniqueId(bad)


@pytest.mark.parametrize("bad", [123, None, 1.5, [1, 2]])
def test_unique_id_of_wrong_type_raises(bad):
    with pytest.raises(TypeError):
        m.UniqueId(bad)


def test_communicator_bad_arguments():
    uid = m.UniqueId.create()
    with pytest.raises(m.InvalidUsageError):
        m.Communicator(1, 1, uid)  # rank not below size
    with pytest.raises(OverflowError):
        m.Communicator(-1, 2, uid)
    with pytest.raises(TypeError):
        m.Communicator("0", 2, uid)
    with pytest.raises(m.InvalidUsageError):
        m.Communicator(0, 1, uid, timeout=-1.0)
    with pytest.raises(m.InvalidUsageError):
        m.Communicator(0, 1, uid, timeout=float("nan"))


LAUNCHER_VARS = [
    "TORCHELASTIC_RUN_ID", "RANK", "WORLD_SIZE", "LOCAL_RANK",
    "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "PMI_RANK", "PMI_SIZE",
    "SLURM_PROCID", "SLURM_NTASKS", "MASTER_ADDR", "MASTER_PORT",
    "MSCCLPP_ROOT_ADDR", "MSCCLPP_ROOT_PORT",
]


@pytest.fixture
def clean_env(monkeypatch):
    for k in LAUNCHER_VARS:
        monkeypatch.delenv(k, raising=False)
    return monkeypatch


def _free_port_pair():
    """A listening socket on some port p - 1 (torchrun's store stands in) with p free just now."""
    import socket

    for _ in range(50):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        p = s.getsockname()[1]
        s.close()
        store = socket.socket()
        try:
            store.bind(("127.0.0.1", p - 1))
        except OSError:
            store.close()
            continue
        store.listen()
        return store, p
    pytest.skip("no free pair of adjacent ports")


def _free_port():
    """A port nobody listens on just now."""
    import socket

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def _set(env, **variables):
    for k, v in variables.items():
        env.setenv(k, v)


def _join_from_env(env, **variables):
    """Sets `variables` (on top of what `env` holds), joins a one-rank job from the environment
    and checks that it runs."""
    _set(env, **variables)
    c = m.Communicator.from_env(timeout=10.0)
    assert (c.rank, c.size) == (0, 1)
    c.barrier()
    return c


ONE_RANK = {"RANK": "0", "WORLD_SIZE": "1"}
# The rules are mscclpp::launcher's: torchrun without RANK is an error, MASTER_ADDR without a
# port is an error, and MASTER_PORT + 1 past 65535 under torchrun says to set MSCCLPP_ROOT_PORT.
TORCHRUN = {"TORCHELASTIC_RUN_ID": "job"}
TORCHRUN_NO_PORT = {**TORCHRUN, **ONE_RANK, "MASTER_ADDR": "127.0.0.1"}
TORCHRUN_LAST_PORT = {**TORCHRUN_NO_PORT, "MASTER_PORT": "65535"}


@pytest.mark.parametrize(
    "variables, error",
    [
        ({}, "RANK"),  # no launcher at all
        (ONE_RANK, "MASTER_ADDR"),
        ({**ONE_RANK, "RANK": "x"}, "RANK"),
        ({**ONE_RANK, "RANK": "1"}, "below the size"),
        (TORCHRUN, "TORCHELASTIC_RUN_ID"),
        (TORCHRUN_NO_PORT, "MASTER_PORT"),
        (TORCHRUN_LAST_PORT, "MSCCLPP_ROOT_PORT"),
        # Open MPI's variables are ignored under torchrun (they describe the agents).
        ({**TORCHRUN_LAST_PORT, "OMPI_COMM_WORLD_RANK": "5", "OMPI_COMM_WORLD_SIZE": "2"}, "MSCCLPP_ROOT_PORT"),
    ],
)
def test_from_env_follows_the_rust_launcher_rules(clean_env, variables, error):
    _set(clean_env, **variables)
    with pytest.raises(m.InvalidUsageError, match=error):
        m.Communicator.from_env()


def test_from_env_under_torchrun_uses_master_port_plus_one(clean_env):
    store, p = _free_port_pair()
    with store:
        # MASTER_PORT is held by the "store": binding it would fail.
        _join_from_env(clean_env, **TORCHRUN, **ONE_RANK, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(p - 1))
        # Without torchrun the same variables mean MASTER_PORT itself, which is taken.
        clean_env.delenv("TORCHELASTIC_RUN_ID")
        with pytest.raises(m.MscclppError, match="MASTER_PORT"):
            m.Communicator.from_env(timeout=10.0)


def test_from_env_with_master_addr(clean_env):
    c = _join_from_env(clean_env, **ONE_RANK, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
    assert [bytes(x) for x in c.all_gather(b"hi")] == [b"hi"]


def test_from_env_with_mscclpp_root_addr(clean_env):
    _join_from_env(
        clean_env,
        SLURM_PROCID="0",
        SLURM_NTASKS="1",
        MASTER_ADDR="192.0.2.1",  # MSCCLPP_ROOT_ADDR wins
        MASTER_PORT="1",
        MSCCLPP_ROOT_ADDR=f"127.0.0.1:{_free_port()}",
    )


def test_write_is_byte_exact_and_keeps_sources_alive(comm, conn, pair):
    src, dst, msrc, mdst, rdst = pair
    conn.write(rdst, 10, msrc, 3, 100)
    conn.flush(timeout=10)
    assert bytes(dst[10:110]) == src[3:103].tobytes()
    assert bytes(dst[:10]) == bytes(10) and bytes(dst[110:]) == bytes(146)
    assert msrc.obj is src and msrc.nbytes == 256 and msrc.is_local and msrc.device is None
    assert rdst.obj is None and rdst.nbytes == 256
    assert msrc.transports == ETH and isinstance(msrc.transports, m.Transport)


def test_transport_values_are_the_type_users_pass(conn):
    assert conn.transport == ETH and isinstance(conn.transport, m.Transport)
    assert conn.transport in m.Transport.ETHERNET | m.Transport.IB0
    assert str(conn.transport) == f"{conn.transport}" == "ETHERNET"
    assert str(m.Transport.ETHERNET | m.Transport.IB0) == "IB0|ETHERNET"


def test_registered_memory_to_bytes_round_trips(comm):
    mem = comm.register(bytearray(48), ETH)
    back = m.RegisteredMemory.from_bytes(mem.to_bytes())
    assert (back.nbytes, back.addr, back.transports) == (48, mem.addr, ETH)
    assert not back.is_local and back.obj is None
    with pytest.raises(m.InvalidUsageError):
        m.RegisteredMemory.from_bytes(b"not a memory")


def test_registration_keeps_the_object_alive(comm, conn):
    dst = bytearray(64)
    mdst = comm.register(dst, ETH)  # the destination's registration must stay while peers write
    rdst = comm.exchange(mdst, [0])[0]
    msrc = comm.register(np.full(64, 7, dtype=np.uint8), ETH)  # only the registration holds it
    gc.collect()
    conn.write(rdst, 0, msrc, 0, 64)
    del msrc
    gc.collect()
    conn.flush(timeout=10)
    assert bytes(dst) == bytes([7]) * 64


def test_registered_bytearray_cannot_be_resized(comm):
    b = bytearray(16)
    r = comm.register(b, ETH)
    with pytest.raises(BufferError):
        b.extend(b"x" * 4096)
    del r
    gc.collect()
    b.extend(b"x")  # released with the registration
    assert len(b) == 17


def test_other_buffers_register(comm):
    for obj in [array.array("d", [1.0] * 8), memoryview(bytearray(8)), np.zeros((4, 4), dtype=np.float32)]:
        r = comm.register(obj, ETH)
        assert r.nbytes == memoryview(obj).nbytes


class OnlyDlpack:
    """A producer with DLPack only (as a CPU torch tensor is)."""

    def __init__(self, a):
        self.a = a

    def __dlpack__(self, **kw):
        return self.a.__dlpack__(**kw)

    def __dlpack_device__(self):
        return self.a.__dlpack_device__()


def test_dlpack_memory_is_registered_and_written(comm, conn, pair):
    src, _, msrc, _, _ = pair
    target = np.zeros(256, dtype=np.uint8)
    r = comm.register(OnlyDlpack(target), ETH)  # kept below while written
    assert r.nbytes == 256 and r.addr == target.ctypes.data
    rr = comm.exchange(r, [0])[0]
    conn.write(rr, 0, msrc, 0, 256)
    conn.flush(timeout=10)
    assert target.tobytes() == src.tobytes()
    with pytest.raises(m.InvalidUsageError, match="non-contiguous"):
        comm.register(OnlyDlpack(np.zeros((8, 8), dtype=np.uint8)[:, ::2]), ETH)


class FakeCuda:
    def __init__(self, **cai):
        self.__cuda_array_interface__ = dict(shape=(16,), typestr="<f4", data=(0x7F0000000000, False), version=3)
        self.__cuda_array_interface__.update(cai)


def test_cuda_array_interface_is_checked(comm):
    with pytest.raises(m.InvalidUsageError, match="read-only"):
        comm.register(FakeCuda(data=(0x7F0000000000, True)), m.Transport.CUDA_IPC)
    with pytest.raises(m.InvalidUsageError, match="non-contiguous"):
        comm.register(FakeCuda(shape=(4, 4), strides=(32, 4)), m.Transport.CUDA_IPC)
    with pytest.raises(m.InvalidUsageError, match="malformed"):
        comm.register(FakeCuda(shape=None), m.Transport.CUDA_IPC)
    with pytest.raises(m.InvalidUsageError, match="empty"):
        comm.register(FakeCuda(shape=(0,)), m.Transport.CUDA_IPC)


@pytest.mark.parametrize(
    "obj,exc",
    [
        (b"immutable", m.InvalidUsageError),
        ("a string", m.InvalidUsageError),
        (123, TypeError),
        (None, TypeError),
        (object(), TypeError),
        (bytearray(), m.InvalidUsageError),
        (np.zeros(0), m.InvalidUsageError),
        (np.zeros((4, 4))[:, 1], m.InvalidUsageError),  # non-contiguous
        (np.zeros((4, 4)).T, m.InvalidUsageError),  # Fortran order
        (memoryview(b"read-only"), m.InvalidUsageError),
    ],
)
def test_bad_registrations_raise(comm, obj, exc):
    with pytest.raises(exc):
        comm.register(obj, ETH)


def test_read_only_numpy_raises(comm):
    a = np.zeros(8)
    a.flags.writeable = False
    with pytest.raises(ValueError, match="read-only"):
        comm.register(a, ETH)


@pytest.mark.parametrize("bad", [0, 1, 1 << 11, -1, 3.5, "nope", [ETH, "nope"], None])
def test_bad_transports_raise(comm, bad):
    with pytest.raises((m.InvalidUsageError, TypeError)):
        comm.register(bytearray(8), bad)


def test_transport_forms(comm):
    for t in [ETH, int(ETH), "eth", "ETHERNET", "tcp", [ETH], [m.Transport.ETHERNET, "eth"]]:
        assert comm.register(bytearray(8), t).transports == ETH
    try:
        both = comm.register(bytearray(8), m.Transport.ETHERNET | m.Transport.IB0)
        assert both.transports == ETH | m.Transport.IB0
    except m.NotAvailableError as e:  # no RDMA device here
        assert "IB0" in str(e)


def test_host_memory_for_cuda_ipc_raises(comm):
    with pytest.raises(m.InvalidUsageError, match="CUDA IPC"):
        comm.register(bytearray(8), m.Transport.CUDA_IPC)


def test_out_of_bounds_and_wrong_arguments_raise(comm, conn, pair):
    src, dst, msrc, mdst, rdst = pair
    before = bytes(dst)
    for args in [
        (rdst, 200, msrc, 0, 100),  # past the destination
        (rdst, 0, msrc, 200, 100),  # past the source
        (rdst, 0, msrc, 0, 257),
        (rdst, (1 << 64) - 1, msrc, 0, 2),  # offset + size overflows
        (rdst, 0, msrc, (1 << 64) - 1, 2),
        (msrc, 0, rdst, 0, 8),  # a peer's memory as the source
    ]:
        with pytest.raises(m.InvalidUsageError) as ei:
            conn.write(*args)
        assert ei.value.operation == "write" and ei.value.peer == 0
        assert ei.value.kind is m.ErrorKind.INVALID_USAGE and ei.value.transport == ETH
        assert isinstance(ei.value.transport, m.Transport) and ei.value.errno is None
        assert "peer rank 0" in str(ei.value)
    for args in [(rdst, -1, msrc, 0, 8), (rdst, 0, msrc, 0, 1 << 64)]:
        with pytest.raises(OverflowError):
            conn.write(*args)
    for args in [("x", 0, msrc, 0, 8), (rdst, 0, src, 0, 8), (rdst, "0", msrc, 0, 8), (rdst, 0, msrc, 0, 1.5)]:
        with pytest.raises(TypeError):
            conn.write(*args)
    with pytest.raises(m.InvalidUsageError):
        conn.atomic_add(rdst, 3, 1)  # not 8-byte aligned
    with pytest.raises(m.InvalidUsageError):
        conn.atomic_add(rdst, 256, 1)
    with pytest.raises(m.InvalidUsageError):
        conn.update_and_sync(rdst, 252, 1)
    with pytest.raises(m.InvalidUsageError):
        conn.flush(timeout=-1)
    conn.flush(timeout=10)
    assert bytes(dst) == before  # nothing was written
    conn.status()


def test_update_and_sync_and_atomic_add(comm, conn):
    words = np.zeros(4, dtype=np.uint64)
    mw = comm.register(words, ETH)
    rw = comm.exchange(mw, [0])[0]
    conn.update_and_sync(rw, 8, 41)
    conn.update_and_sync(rw, 8, 42)
    conn.atomic_add(rw, 16, 5)
    conn.atomic_add(rw, 16, -2)
    conn.flush(timeout=10)
    assert list(words) == [0, 42, 3, 0]


def test_connect_bad_arguments(comm):
    with pytest.raises(m.InvalidUsageError, match="not in 0..1"):
        comm.connect(5, ETH)
    with pytest.raises(m.InvalidUsageError, match="exactly one"):
        comm.connect(0, ETH | m.Transport.IB0)
    with pytest.raises(TypeError):
        comm.connect("0", ETH)
    with pytest.raises(m.InvalidUsageError):
        comm.exchange(comm.register(bytearray(8), ETH), [1])
    with pytest.raises(m.InvalidUsageError):
        comm.recv_memory(3)


def test_semaphore_timeout_is_a_timeout_error_naming_the_peer(comm, conn):
    sem = comm.host_semaphore(conn, tag=7)
    with pytest.raises(TimeoutError) as ei:
        sem.wait(timeout=0.05)
    assert isinstance(ei.value, m.MscclppTimeoutError) and isinstance(ei.value, m.MscclppError)
    assert ei.value.peer == 0 and "peer rank 0" in str(ei.value)
    assert ei.value.kind is m.ErrorKind.TIMEOUT and ei.value.kind.value in str(ei.value)
    sem.signal()
    sem.wait(timeout=10)
    assert not sem.poll()


def test_a_second_thread_runs_while_one_waits(comm, conn):
    """The wait can only end because the other Python thread signals: with the GIL held by the
    waiter, that thread could not run and the wait would time out."""
    sem = comm.host_semaphore(conn, tag=8)
    started = threading.Event()
    ticks = []

    def other():
        started.set()
        for i in range(1000):
            ticks.append(i)  # Python bytecode: needs the GIL
        sem.signal()

    t = threading.Thread(target=other)
    t.start()
    started.wait()
    sem.wait(timeout=30)  # blocks in Rust with the GIL released
    t.join()
    assert len(ticks) == 1000


def test_barrier_releases_the_gil():
    uid = m.UniqueId.create()
    out = {}

    def rank1():
        out[1] = m.Communicator(1, 2, uid, timeout=30.0)
        out[1].barrier()

    t = threading.Thread(target=rank1)
    t.start()
    c0 = m.Communicator(0, 2, uid, timeout=30.0)  # waits for rank 1, which needs the GIL to start
    c0.barrier()
    t.join()
    assert out[1].size == 2


def test_proxy_service_host_backed(comm):
    ps = m.ProxyService(comm, device=None)
    assert ps.device is None
    mid = ps.add_memory(comm.register(bytearray(64), ETH))
    assert mid == 0 and ps.add_memory(comm.register(bytearray(64), ETH)) == 1
    with pytest.raises(m.InvalidUsageError):
        ps.port_channel(0, 0, 1)  # no semaphore 0
    with ps:
        ps.status()
        with pytest.raises(m.InvalidUsageError):
            ps.add_memory(comm.register(bytearray(8), ETH))  # after start
    ps.stop()  # again: same result
    assert ps.processed == 0
    with pytest.raises(m.InvalidUsageError):
        ps.pack_handles([])
    with pytest.raises(m.InvalidUsageError, match="power of two"):
        m.ProxyService(comm, device=None, fifo_size=3)


def test_context_manager_does_not_hide_the_body_error(comm):
    ps = m.ProxyService(comm, device=None)
    with pytest.raises(KeyError):
        with ps:
            raise KeyError("body")


def test_device_semaphore_without_gpu_raises(comm, conn):
    if os.path.exists("/dev/nvidiactl"):
        pytest.skip("a GPU machine")
    with pytest.raises(m.MscclppError):
        comm.device_semaphore(conn, tag=9)


def test_header_and_sizes():
    src = m.header_source()
    assert "PortChannelDeviceHandle" in src and "MSCCLPP_RS_ABI_VERSION" in src
    assert m.handle_sizes()["PortChannelDeviceHandle"] == 96
    with open(m.header_path()) as f:
        assert f.read() == src
    assert m.header_path().startswith(m.include_dir())


KERNEL = r"""
#include "mscclpp_rs/device.cuh"
extern "C" __global__ void put_signal(mscclpp::PortChannelDeviceHandle* ch, unsigned long long n) {
  if (threadIdx.x == 0 && blockIdx.x == 0) { ch[0].putWithSignal(0, n); ch[0].flush(); }
}
"""


def test_compile_with_nvrtc():
    try:
        ptx = m.compile_kernel(KERNEL, arch="compute_90")
    except m.NotAvailableError as e:
        pytest.skip(f"no NVRTC here: {e}")
    assert ptx.kernels == ["put_signal"] and ptx.arch == "compute_90"
    assert ".entry put_signal" in ptx.ptx
    with pytest.raises(m.MscclppError):
        m.compile_kernel("this is not CUDA", arch="compute_90")


def test_memory_semaphore_needs_cuda_ipc(comm, conn):
    with pytest.raises(m.MscclppError):
        comm.memory_semaphore(conn, tag=10)  # an Ethernet connection between host memories
    with pytest.raises(m.InvalidUsageError):
        comm.pack_handles([])


def test_system_call_error_carries_errno(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_bytes(b"")
    with pytest.raises(m.SystemCallError) as ei:
        m.write_header(blocker / "include")  # a directory inside a regular file
    e = ei.value
    assert isinstance(e, OSError) and e.errno == errno.ENOTDIR
    assert e.kind is m.ErrorKind.SYSTEM and "a-file" in str(e)


def test_connection_close_and_with_block(comm):
    dst = bytearray(32)
    mdst = comm.register(dst, ETH)  # stays registered while the peer writes
    rdst = comm.exchange(mdst, [0], tag=20)[0]
    src = comm.register(bytearray(b"x" * 32), ETH)
    with comm.connect(0, ETH, tag=20) as c:
        assert not c.closed
        c.write(rdst, 0, src, 0, 32)  # not flushed: close() waits for it
    assert c.closed and bytes(dst) == b"x" * 32
    assert c.transport == ETH and c.peer == 0 and c.outstanding == 0 and "closed" in repr(c)
    for op in (lambda: c.write(rdst, 0, src, 0, 8), lambda: c.flush(timeout=1), c.status):
        with pytest.raises(m.AbortedError, match="closed"):
            op()
    with pytest.raises(m.AbortedError):
        comm.host_semaphore(c, tag=20)
    c.close()  # again: nothing happens


def test_communicator_close_and_with_block():
    with m.Communicator(0, 1, m.UniqueId.create(), timeout=20.0) as c:
        assert not c.closed
        c.barrier()
        conn = c.connect(0, ETH)
    assert c.closed and (c.rank, c.size) == (0, 1) and "closed" in repr(c)
    for op in (c.barrier, lambda: c.all_gather(b"x"), lambda: c.connect(0, ETH), lambda: c.register(bytearray(8), ETH)):
        with pytest.raises(m.AbortedError, match="communicator is closed"):
            op()
    with pytest.raises(m.AbortedError):
        m.ProxyService(c, device=None)
    c.close()
    conn.status()  # a connection made before outlives the communicator's close
    conn.close()


def test_a_with_block_error_is_not_hidden_by_close():
    with pytest.raises(KeyError):
        with m.Communicator(0, 1, m.UniqueId.create(), timeout=20.0):
            raise KeyError("body")


def test_public_names_shadow_no_builtin_and_exist():
    assert not set(m.__all__) & set(dir(builtins))
    for name in m.__all__:
        assert hasattr(m, name), name
    assert not hasattr(m, "compile")


def test_stubs_name_no_private_helpers():
    stubs = os.path.join(os.path.dirname(m.__file__), "_native.pyi")
    with open(stubs) as f:
        text = f.read()
    names = re.findall(r"^\s*(?:def|class)\s+(\w+)", text, re.M)
    assert "UniqueId" in names and "__hash__" in names
    assert [n for n in names if n.startswith("_") and not (n.startswith("__") and n.endswith("__"))] == []
    assert "def compile_kernel(" in text and "def to_bytes(" in text
