"""mscclpp_rs: one-sided, signalled GPU/host communication (MSCCL++'s stack in Rust) for Python.

Ranks (processes) join a job through a :class:`UniqueId` or launcher variables, register tensors
and arrays, connect over CUDA IPC, InfiniBand or Ethernet, exchange memories, and then ``write``
into each other's memory and signal semaphores; kernels launched from Python use
``PortChannel`` handles served by a :class:`ProxyService`.

Two ranks moving a tensor (run on both, ``rank`` 0 and 1, the same ``uid`` bytes)::

    import mscclpp_rs as m
    with m.Communicator(rank, 2, uid) as comm:
        mem = comm.register(t, m.Transport.CUDA_IPC)   # or ETHERNET; t stays alive while registered
        conn = comm.connect(1 - rank, m.Transport.CUDA_IPC)
        peer_mem = comm.exchange(mem, [1 - rank])[1 - rank]
        comm.barrier()                                 # t's contents are ready on both sides
        if rank == 0:
            conn.write(peer_mem, 0, mem, 0, mem.nbytes); conn.flush()
        comm.barrier()                                 # rank 1's t now holds rank 0's bytes

Collectives on GPU tensors (torch, or anything with ``__cuda_array_interface__``), on the current
stream and capturable in CUDA graphs once the first call (a collective call building the
communicator's :class:`Collectives`) is made::

    comm.all_reduce(t)                       # in place; also all_gather, reduce_scatter, broadcast

MSCCL++ execution plans (the JSON its DSL writes) run unchanged through :class:`ExecutionPlan`
and :class:`Executor` (``executor.execute(rank, send, recv, send_size, recv_size, dtype, plan,
stream)``), as MSCCL++'s executor does.

:mod:`mscclpp_rs.ext` offers MSCCL++'s ``AlgorithmCollectionBuilder`` / ``Algorithm.execute`` shape.

Every call that waits releases the GIL. Errors are :class:`MscclppError` subclasses.
"""

from __future__ import annotations

import os as _os
import tempfile as _tempfile

from . import _native
from ._errors import (
    AbortedError,
    CudaError,
    IbError,
    InternalError,
    InvalidUsageError,
    MscclppError,
    MscclppTimeoutError,
    NotAvailableError,
    PlanError,
    RemoteError,
    SystemCallError,
)
from ._native import (
    ABI_VERSION,
    HEADER_NAME,
    UNIQUE_ID_BYTES,
    Collectives,
    Communicator,
    Connection,
    DeviceHandles,
    Host2DeviceSemaphore,
    Host2HostSemaphore,
    MemoryChannel,
    MemoryDevice2DeviceSemaphore,
    PortChannel,
    ProxyService,
    Ptx,
    RegisteredMemory,
    UniqueId,
    compile_kernel,
    handle_sizes,
    header_source,
    write_header,
)
from ._types import ErrorKind, Transport
from . import ext
from .ext import DataType, ReduceOp
from ._executor import ExecutionPlan, Executor, PacketType

__version__: str = _native.__version__

__all__ = [
    "ABI_VERSION",
    "HEADER_NAME",
    "UNIQUE_ID_BYTES",
    "AbortedError",
    "Collectives",
    "Communicator",
    "Connection",
    "CudaError",
    "DataType",
    "DeviceHandles",
    "ErrorKind",
    "ExecutionPlan",
    "Executor",
    "Host2DeviceSemaphore",
    "Host2HostSemaphore",
    "IbError",
    "InternalError",
    "InvalidUsageError",
    "MemoryChannel",
    "MemoryDevice2DeviceSemaphore",
    "MscclppError",
    "MscclppTimeoutError",
    "NotAvailableError",
    "PacketType",
    "PlanError",
    "PortChannel",
    "ProxyService",
    "Ptx",
    "ReduceOp",
    "RegisteredMemory",
    "RemoteError",
    "SystemCallError",
    "Transport",
    "UniqueId",
    "compile_kernel",
    "ext",
    "handle_sizes",
    "header_path",
    "header_source",
    "include_dir",
    "write_header",
]


_include_dir: str | None = None


def include_dir() -> str:
    """An include directory holding ``mscclpp_rs/device.cuh`` (this build's header), for
    ``nvcc -I``, ``cupy.RawModule(options=("-I" + dir,))`` or ``torch.utils.cpp_extension``.

    Written once per process into ``$MSCCLPP_RS_INCLUDE_DIR`` if set, else a cache directory.
    """
    global _include_dir
    if _include_dir is None:
        base = _os.environ.get("MSCCLPP_RS_INCLUDE_DIR") or _os.path.join(
            _os.environ.get("XDG_CACHE_HOME") or _os.path.join(_os.path.expanduser("~"), ".cache"),
            "mscclpp_rs",
            f"include-abi{ABI_VERSION}-{__version__}",
        )
        try:
            write_header(base)
        except MscclppError:
            base = _tempfile.mkdtemp(prefix="mscclpp_rs-include-")
            write_header(base)
        _include_dir = base
    return _include_dir


def header_path() -> str:
    """The path of ``mscclpp_rs/device.cuh`` inside :func:`include_dir`."""
    return _os.path.join(include_dir(), HEADER_NAME)
