"""MSCCL++'s Python executor API: :class:`ExecutionPlan` (native) and :class:`Executor`.

Plans are the JSON MSCCL++'s DSL (``mscclpp.language``) writes, loaded unchanged::

    import mscclpp_rs as m
    plan = m.ExecutionPlan("allreduce.json")     # PlanError (a ValueError) names the bad field
    ex = m.Executor(comm)                         # every rank; GPU: torch's current device
    ex.execute(rank, t.data_ptr(), t.data_ptr(), t.nbytes, t.nbytes, m.DataType.float16, plan,
               torch.cuda.current_stream().cuda_stream)   # or tensors and a torch stream

Buffers are torch CUDA tensors (or anything with ``__cuda_array_interface__``) or ints (device
pointers); ``stream`` an int ``cudaStream_t``, a torch/CuPy stream object, or ``None`` for torch's
current stream. The first call for a (plan, buffers) is a collective call that builds the channels;
later calls only launch and can be captured in a CUDA graph. Tensors passed are kept alive by the
executor (peers map them); for raw pointers that is the caller's job.
"""

from __future__ import annotations

import enum
from typing import Any

from . import _native
from ._collectives import _current_device, _describe, _ITEMSIZE, _stream_of, _torch, _torch_dtype_map
from ._errors import InvalidUsageError

__all__ = ["ExecutionPlan", "Executor", "PacketType"]

ExecutionPlan = _native.ExecutionPlan


class PacketType(enum.Enum):
    """LL packet formats (MSCCL++'s ``PacketType``): LL16 carries 8 data bytes and two flags in 16
    bytes, LL8 4 data bytes and a flag in 8."""

    LL8 = "LL8"
    LL16 = "LL16"


def _dtype_name(dtype: Any) -> str:
    """Our dtype name for an ``ext.DataType``, a torch dtype or a string."""
    if isinstance(dtype, str):
        return dtype
    if isinstance(dtype, enum.Enum):
        v = dtype.value
        if isinstance(v, str):
            return v
        return dtype.name  # MSCCL++'s own DataType enum: float16, bfloat16...
    torch = _torch()
    if torch is not None and isinstance(dtype, torch.dtype):
        name = _torch_dtype_map(torch).get(dtype)
        if name is None:
            raise InvalidUsageError(f"dtype {dtype} is not supported; use float32, float16, bfloat16, int32 or uint32")
        return name
    raise InvalidUsageError(f"dtype must be a DataType, a torch dtype or a name, not {type(dtype).__name__}")


def _packet_name(packet_type: Any) -> str:
    if isinstance(packet_type, str):
        return packet_type
    if isinstance(packet_type, enum.Enum):
        return packet_type.name
    raise InvalidUsageError(f"packet_type must be PacketType.LL16 or PacketType.LL8, not {packet_type!r}")


def _size(v: Any, what: str) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        raise InvalidUsageError(f"{what} must be an int number of bytes, not {type(v).__name__}")
    if v < 0:
        raise InvalidUsageError(f"{what} must be >= 0, not {v}")
    return v


def _buffer(b: Any, size: int, what: str) -> tuple[int, Any, int | None]:
    """(pointer, the object to keep alive or None, its device or None) for an int or a tensor;
    a tensor must hold at least ``size`` bytes."""
    if isinstance(b, bool):
        raise InvalidUsageError(f"{what} must be a device pointer (int) or a GPU tensor, not bool")
    if isinstance(b, int):
        if b <= 0:
            raise InvalidUsageError(f"{what}: {b:#x} is not a device pointer")
        return b, None, None
    d = _describe(b, what, writable=what == "recv_buff")
    nbytes = d.count * _ITEMSIZE[d.dtype]
    if nbytes < size:
        raise InvalidUsageError(f"{what}: the tensor holds {nbytes} bytes, the call says {size}")
    return d.ptr, b, d.device


class Executor:
    """Runs execution plans on this rank's GPU (MSCCL++'s ``Executor(comm)``).

    ``Executor(comm, device=None, timeout=30.0, port_transport="cuda_ipc", kernel=None)``:
    ``device`` defaults to torch's current device (0 without torch); ``timeout`` bounds every
    device wait (seconds), after which the call's kernels stop and ``check()``, ``synchronize()``
    or the next ``execute`` raise ``MscclppTimeoutError`` naming the peer (``.peer``);
    ``port_transport`` carries the plan's port channels (``"cuda_ipc"`` or ``"ethernet"``);
    ``kernel`` runs plans with the interpreter (``"interpreter"``) or with a kernel generated per
    plan shape (``"per-plan"``, compiled in the first call of each shape); ``None`` follows
    ``MSCCLPP_EXECUTOR_KERNEL`` (default: per-plan).
    """

    def __init__(
        self,
        comm,
        device: int | None = None,
        timeout: float = 30.0,
        port_transport: Any = "cuda_ipc",
        kernel: str | None = None,
    ):
        if device is None:
            device = _current_device()
        if not isinstance(port_transport, str):
            name = getattr(port_transport, "name", None)
            port_transport = name if isinstance(name, str) else str(port_transport)
        self._native = _native.Executor(
            comm, device=device, timeout=timeout, port_transport=port_transport, kernel=kernel
        )
        self._keep: dict[tuple, tuple] = {}

    @property
    def rank(self) -> int:
        return self._native.rank

    @property
    def device(self) -> int:
        return self._native.device

    def execute(
        self,
        rank: int,
        send_buff: Any,
        recv_buff: Any,
        send_buff_size: int,
        recv_buff_size: int,
        dtype: Any,
        plan: ExecutionPlan,
        stream: Any = None,
        packet_type: Any = PacketType.LL16,
    ) -> None:
        """Runs ``plan`` from ``send_buff`` (``send_buff_size`` bytes) into ``recv_buff``
        (``recv_buff_size`` bytes) on ``stream`` (MSCCL++'s argument order)."""
        if not isinstance(plan, ExecutionPlan):
            raise InvalidUsageError(f"plan must be an ExecutionPlan, not {type(plan).__name__}")
        if isinstance(rank, bool) or not isinstance(rank, int) or rank < 0:
            raise InvalidUsageError(f"rank must be an int >= 0, not {rank!r}")
        # The rank, the plan's world size and the buffers' GPU are checked by the native build,
        # at its first meeting of the ranks: a rank that gets one wrong fails every rank's call
        # there, named (a check here would fail this rank alone and leave the others waiting
        # for it until the bootstrap timeout). What cannot be passed on at all (a wrong type, a
        # tensor smaller than the size given) is still refused here, on this rank alone.
        ss, rs = _size(send_buff_size, "send_buff_size"), _size(recv_buff_size, "recv_buff_size")
        sp, skeep, _ = _buffer(send_buff, ss, "send_buff")
        rp, rkeep, _ = _buffer(recv_buff, rs, "recv_buff")
        s = _stream_of(stream, None, self.device)
        self._native.execute(rank, sp, rp, ss, rs, _dtype_name(dtype), plan, s, _packet_name(packet_type))
        if skeep is not None or rkeep is not None:
            # Peers map these buffers until the executor goes: keep the tensors as long.
            key = (id(plan), sp, rp, ss, rs)
            if key not in self._keep:
                self._keep[key] = (plan, skeep, rkeep)

    def prepare(self, rank: int, send_buff: Any, recv_buff: Any, send_buff_size: int, recv_buff_size: int, plan) -> None:
        """Builds the resources of ``plan`` for these buffers (a collective call) without running."""
        ss, rs = _size(send_buff_size, "send_buff_size"), _size(recv_buff_size, "recv_buff_size")
        sp, skeep, _ = _buffer(send_buff, ss, "send_buff")
        rp, rkeep, _ = _buffer(recv_buff, rs, "recv_buff")
        self._native.prepare(rank, sp, rp, ss, rs, plan)
        if skeep is not None or rkeep is not None:
            self._keep.setdefault((id(plan), sp, rp, ss, rs), (plan, skeep, rkeep))

    def check(self) -> None:
        """Raises the error a kernel of this rank reported, if any (does not wait).

        A kernel's error (``MscclppTimeoutError`` for a wait past the timeout) carries ``peer``
        (the rank waited for), ``block`` and ``op`` (where in the plan), ``launch`` (which launch
        on these buffers, 1 for the first) and, for a semaphore wait, ``signals_seen`` and
        ``signals_needed`` (how far the peer got); each ``None`` when unknown.
        """
        self._native.check()

    def synchronize(self, stream: Any = None, timeout: float = 30.0) -> None:
        """Waits (at most ``timeout`` seconds, GIL released) for ``stream``, then ``check()``s."""
        self._native.synchronize(_stream_of(stream, None, self.device), timeout)

    def abort(self) -> None:
        """Makes every running and later kernel of this executor stop waiting and fail."""
        self._native.abort()

    def __repr__(self) -> str:
        return repr(self._native)
