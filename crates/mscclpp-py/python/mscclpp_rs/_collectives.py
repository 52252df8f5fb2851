"""The tensor side of the collectives: ``Communicator.all_reduce``, ``all_gather`` (of tensors),
``reduce_scatter`` and ``broadcast`` come here (the native methods call these functions).

A tensor is a torch tensor or anything with ``__cuda_array_interface__`` (CuPy, Numba...): its
data pointer, element count, dtype and device are read here, checked, and handed to the
communicator's :class:`Collectives` as raw values. Nothing here synchronizes or allocates device
memory (except ``out`` tensors allocated when the caller gives none, through torch's allocator),
so calls after the first one can be captured in a CUDA graph.
"""

from __future__ import annotations

import math
import sys
from typing import Any, NamedTuple

from ._errors import InvalidUsageError
from ._memory import _c_contiguous

__all__: list[str] = []

# typestr of __cuda_array_interface__ -> our dtype names (bf16 has no typestr: torch only).
_TYPESTRS = {"<f4": "f32", "<f2": "f16", "<i4": "i32", "<u4": "u32"}
_ITEMSIZE = {"f32": 4, "f16": 2, "bf16": 2, "i32": 4, "u32": 4}
_SUPPORTED = "torch.float32, float16, bfloat16, int32 and uint32 (typestr <f4, <f2, <i4, <u4)"

_torch_dtypes: dict | None = None


def _torch():
    """The torch module if it is imported (never imports it: that takes seconds)."""
    return sys.modules.get("torch")


def _torch_dtype_map(torch) -> dict:
    global _torch_dtypes
    if _torch_dtypes is None:
        m = {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16", torch.int32: "i32"}
        if hasattr(torch, "uint32"):
            m[torch.uint32] = "u32"
        _torch_dtypes = m
    return _torch_dtypes


class _Desc(NamedTuple):
    ptr: int
    count: int
    dtype: str
    device: int | None
    stream: int | None  # the array's own stream (__cuda_array_interface__ v3), if it says
    shape: tuple


def _describe(t: Any, what: str, writable: bool) -> _Desc:
    """Pointer, element count, dtype, device and stream of a GPU tensor; ``InvalidUsageError``
    (a ``ValueError``) for anything that cannot take part in a collective."""
    torch = _torch()
    if torch is not None and isinstance(t, torch.Tensor):
        dt = _torch_dtype_map(torch).get(t.dtype)
        if dt is None:
            raise InvalidUsageError(f"{what}: dtype {t.dtype} is not supported; use {_SUPPORTED}")
        if not t.is_cuda:
            raise InvalidUsageError(f"{what}: the tensor is on {t.device}, not on a GPU (use .cuda())")
        if not t.is_contiguous():
            raise InvalidUsageError(f"{what}: the tensor is not contiguous (shape {tuple(t.shape)}); use .contiguous()")
        return _Desc(t.data_ptr(), t.numel(), dt, t.device.index, None, tuple(t.shape))
    if isinstance(t, (bytes, bytearray, memoryview, str, int, float, list, tuple)) or t is None:
        raise InvalidUsageError(
            f"{what}: expected a GPU tensor (a torch CUDA tensor or an array with __cuda_array_interface__), "
            f"not {type(t).__name__}"
        )
    try:
        cai = t.__cuda_array_interface__
    except AttributeError:
        cai = None
    if not isinstance(cai, dict):
        raise InvalidUsageError(
            f"{what}: {type(t).__name__} is not on a GPU (it has no __cuda_array_interface__); give a torch "
            "CUDA tensor or a CuPy/Numba device array"
        )
    try:
        shape = tuple(int(n) for n in cai["shape"])
        typestr = str(cai["typestr"])
        ptr, readonly = cai["data"]
    except (KeyError, TypeError, ValueError) as e:
        raise InvalidUsageError(f"{what}: malformed __cuda_array_interface__: {e!r}") from None
    dt = _TYPESTRS.get(typestr.replace("=", "<").replace("|", "<"))
    if dt is None:
        raise InvalidUsageError(f"{what}: typestr {typestr!r} is not supported; use {_SUPPORTED}")
    if writable and readonly:
        raise InvalidUsageError(f"{what}: the array is read-only and this collective writes into it")
    if cai.get("mask") is not None:
        raise InvalidUsageError(f"{what}: masked arrays are not supported")
    strides = cai.get("strides")
    if strides is not None and not _c_contiguous(shape, strides, _ITEMSIZE[dt]):
        raise InvalidUsageError(
            f"{what}: the array is not contiguous (shape {shape}, strides {tuple(strides)}); "
            "use cupy.ascontiguousarray first"
        )
    stream = cai.get("stream")
    if stream is not None:
        stream = int(stream)
        # v3: 1 is the legacy default stream (handle 0), 2 the per-thread one (handle 2 works).
        stream = 0 if stream == 1 else stream
    return _Desc(int(ptr or 0), math.prod(shape), dt, None, stream, shape)


def _current_device() -> int:
    """torch's current device when torch is imported and has CUDA, else 0."""
    torch = _torch()
    if torch is not None:
        try:
            if torch.cuda.is_available():
                return int(torch.cuda.current_device())
        except Exception:  # noqa: BLE001 - a broken CUDA setup shows at the call
            pass
    return 0


def _stream_of(stream: Any, desc: _Desc | None, device: int) -> int:
    """The raw stream a call runs on: the caller's ``stream``, else the array's own, else torch's
    current stream (when torch is imported), else 0 (the legacy default stream)."""
    if stream is not None:
        if isinstance(stream, int):
            return stream
        raw = getattr(stream, "cuda_stream", None)  # torch.cuda.Stream; CuPy has .ptr
        if raw is None:
            raw = getattr(stream, "ptr", None)
        if raw is None:
            raise InvalidUsageError(
                f"stream must be an int cudaStream_t or a stream object (torch/CuPy), not {type(stream).__name__}"
            )
        return int(raw)
    if desc is not None and desc.stream is not None:
        return desc.stream
    torch = _torch()
    if torch is not None:
        return int(torch.cuda.current_stream(device).cuda_stream)
    return 0


def _device_of(desc: _Desc) -> int:
    if desc.device is not None:
        return desc.device
    from ._native import pointer_device

    return pointer_device(desc.ptr, max(desc.count * _ITEMSIZE[desc.dtype], 1))


def _op_name(op: Any) -> str:
    """The canonical reduction name for a string or an enum (``mscclpp_rs.ReduceOp``, MSCCL++'s or
    ``torch.distributed.ReduceOp``); ``InvalidUsageError`` for an unknown one."""
    from ._native import parse_op

    if op is None:
        return "sum"
    if not isinstance(op, str):
        name = getattr(op, "name", None)
        op = name if isinstance(name, str) else str(op).rsplit(".", 1)[-1]
    return parse_op(op)


def _algo_name(algorithm: Any) -> str | None:
    """The native algorithm name for a name (ours or MSCCL++'s) or an ``ext.Algorithm``."""
    from ._native import parse_algorithm

    if algorithm is None:
        return None
    if isinstance(algorithm, str):
        from .ext import ALGORITHM_MAP

        mapped = ALGORITHM_MAP.get(algorithm)
        if mapped is not None:
            return mapped[1]
    else:
        name = getattr(algorithm, "native_algorithm", None) or getattr(algorithm, "name", None)
        if not isinstance(name, str):
            raise InvalidUsageError(f"algorithm must be a name, not {type(algorithm).__name__}")
        algorithm = name
    return parse_algorithm(algorithm)


def _coll(comm, device: int):
    """The communicator's Collectives (built on first use: a collective call)."""
    return comm.collectives(device=device)


def _check_out(out_desc: _Desc, want: int, in_desc: _Desc, what: str) -> None:
    if out_desc.dtype != in_desc.dtype:
        raise InvalidUsageError(f"{what}: out has dtype {out_desc.dtype}, the input {in_desc.dtype}")
    if out_desc.count != want:
        raise InvalidUsageError(f"{what}: out holds {out_desc.count} elements, the call needs {want}")


def all_reduce(comm, tensor, op, out, algorithm, accumulate_f32, blocks, threads, stream):
    op, algorithm = _op_name(op), _algo_name(algorithm)
    d = _describe(tensor, "all_reduce", writable=out is None)
    o = d
    if out is not None:
        o = _describe(out, "all_reduce out", writable=True)
        _check_out(o, d.count, d, "all_reduce")
    dev = _device_of(d)
    s = _stream_of(stream, d, dev)
    _coll(comm, dev).all_reduce(
        d.ptr,
        o.ptr,
        d.count,
        d.dtype,
        op,
        s,
        algorithm=algorithm,
        blocks=blocks,
        threads=threads,
        accumulate_f32=bool(accumulate_f32),
    )
    return tensor if out is None else out


def all_gather(comm, tensor, out, algorithm, blocks, threads, stream):
    algorithm = _algo_name(algorithm)
    d = _describe(tensor, "all_gather", writable=False)
    n = comm.size
    if out is None:
        torch = _torch()
        if torch is None or not isinstance(tensor, torch.Tensor):
            raise InvalidUsageError("all_gather: pass out= (size x the input's elements) for non-torch arrays")
        shape = (n * d.shape[0], *d.shape[1:]) if d.shape else (n,)
        out = tensor.new_empty(shape)
    o = _describe(out, "all_gather out", writable=True)
    _check_out(o, n * d.count, d, "all_gather")
    dev = _device_of(d)
    s = _stream_of(stream, d, dev)
    _coll(comm, dev).all_gather(
        d.ptr, o.ptr, d.count, d.dtype, s, algorithm=algorithm, blocks=blocks, threads=threads
    )
    return out


def reduce_scatter(comm, tensor, out, op, algorithm, accumulate_f32, blocks, threads, stream):
    op, algorithm = _op_name(op), _algo_name(algorithm)
    d = _describe(tensor, "reduce_scatter", writable=False)
    n = comm.size
    if d.count % n:
        raise InvalidUsageError(f"reduce_scatter: the input's {d.count} elements do not split into {n} equal segments")
    if out is None:
        torch = _torch()
        if torch is None or not isinstance(tensor, torch.Tensor):
            raise InvalidUsageError("reduce_scatter: pass out= (the input's elements / size) for non-torch arrays")
        if d.shape and d.shape[0] % n == 0:
            shape = (d.shape[0] // n, *d.shape[1:])
        else:
            shape = (d.count // n,)
        out = tensor.new_empty(shape)
    o = _describe(out, "reduce_scatter out", writable=True)
    _check_out(o, d.count // n, d, "reduce_scatter")
    dev = _device_of(d)
    s = _stream_of(stream, d, dev)
    _coll(comm, dev).reduce_scatter(
        d.ptr,
        o.ptr,
        d.count // n,
        d.dtype,
        op,
        s,
        algorithm=algorithm,
        blocks=blocks,
        threads=threads,
        accumulate_f32=bool(accumulate_f32),
    )
    return out


def broadcast(comm, tensor, root, algorithm, blocks, threads, stream):
    algorithm = _algo_name(algorithm)
    d = _describe(tensor, "broadcast", writable=True)
    if not 0 <= root < comm.size:
        raise InvalidUsageError(f"broadcast: root {root} is not a rank of 0..{comm.size}")
    dev = _device_of(d)
    s = _stream_of(stream, d, dev)
    _coll(comm, dev).broadcast(
        d.ptr, d.ptr, d.count, d.dtype, root, s, algorithm=algorithm, blocks=blocks, threads=threads
    )
    return tensor
