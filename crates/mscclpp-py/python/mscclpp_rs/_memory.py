"""Where a tensor's or array's bytes are: the memory description behind ``Communicator.register``.

``describe(obj)`` returns ``(kind, ptr, nbytes, device, keep)``: ``kind`` is ``"host"`` or
``"cuda"``, ``keep`` a tuple holding everything that keeps the memory valid (the object, its buffer
export or DLPack capsule). Sources, in order: ``__cuda_array_interface__`` (torch CUDA tensors,
CuPy, Numba), the buffer protocol (NumPy, ``bytearray``, ``memoryview``, ``array.array``), DLPack
(``__dlpack__``: CPU torch tensors, JAX...). The memory must be writable (peers write into it),
C-contiguous and non-empty.
"""

from __future__ import annotations

import ctypes
import math
from typing import Any

from ._errors import InvalidUsageError

# DLPack device types (dlpack.h)
_DL_CPU, _DL_CUDA, _DL_CUDA_HOST, _DL_CUDA_MANAGED = 1, 2, 3, 13


def _c_contiguous(shape, strides, itemsize: int) -> bool:
    """Whether byte `strides` describe a C-contiguous layout of `shape` (size-1 dims ignored)."""
    expected = itemsize
    for n, s in zip(reversed(shape), reversed(strides)):
        if n != 1 and s != expected:
            return False
        expected *= n
    return True


def _from_cai(obj: Any, cai: dict) -> tuple:
    try:
        shape = tuple(int(n) for n in cai["shape"])
        typestr = str(cai["typestr"])
        ptr, readonly = cai["data"]
    except (KeyError, TypeError, ValueError) as e:
        raise InvalidUsageError(f"malformed __cuda_array_interface__: {e!r}") from None
    if readonly:
        raise InvalidUsageError("cannot register a read-only CUDA array (peers write into registered memory)")
    if cai.get("mask") is not None:
        raise InvalidUsageError("cannot register a masked CUDA array")
    try:
        itemsize = int(typestr[2:])
    except ValueError:
        raise InvalidUsageError(f"unknown typestr {typestr!r} in __cuda_array_interface__") from None
    strides = cai.get("strides")
    if strides is not None and not _c_contiguous(shape, strides, itemsize):
        raise InvalidUsageError(
            f"cannot register a non-contiguous CUDA array (shape {shape}, strides {tuple(strides)}); "
            "use .contiguous() / cupy.ascontiguousarray first"
        )
    nbytes = math.prod(shape) * itemsize
    device = None
    if hasattr(obj, "__dlpack_device__"):
        try:
            dev_type, dev_id = obj.__dlpack_device__()
            if int(dev_type) == _DL_CUDA:
                device = int(dev_id)
        except Exception:  # noqa: BLE001 - the device is only a hint
            device = None
    return ("cuda", int(ptr or 0), nbytes, device, (obj,))


def _from_buffer(obj: Any, mv: memoryview) -> tuple:
    if mv.readonly:
        mv.release()
        raise InvalidUsageError(
            f"cannot register a read-only buffer ({type(obj).__name__}): peers write into registered memory"
        )
    if not mv.c_contiguous:
        strides = mv.strides
        mv.release()
        raise InvalidUsageError(
            f"cannot register a non-contiguous buffer ({type(obj).__name__}, strides {strides}); "
            "use numpy.ascontiguousarray first"
        )
    if mv.nbytes == 0:
        mv.release()
        raise InvalidUsageError("cannot register an empty buffer (0 bytes)")
    # ctypes holds a writable export of the buffer for as long as `arr` lives: a bytearray
    # cannot be resized (reallocated) while registered.
    arr = (ctypes.c_char * mv.nbytes).from_buffer(mv)
    return ("host", ctypes.addressof(arr), mv.nbytes, None, (obj, mv, arr))


class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):
    _fields_ = [
        ("data", ctypes.c_void_p),
        ("device", _DLDevice),
        ("ndim", ctypes.c_int32),
        ("dtype", _DLDataType),
        ("shape", ctypes.POINTER(ctypes.c_int64)),
        ("strides", ctypes.POINTER(ctypes.c_int64)),
        ("byte_offset", ctypes.c_uint64),
    ]


_get_pointer = ctypes.pythonapi.PyCapsule_GetPointer
_get_pointer.restype = ctypes.c_void_p
_get_pointer.argtypes = [ctypes.py_object, ctypes.c_char_p]
_is_valid = ctypes.pythonapi.PyCapsule_IsValid
_is_valid.restype = ctypes.c_int
_is_valid.argtypes = [ctypes.py_object, ctypes.c_char_p]


def _from_dlpack(obj: Any) -> tuple:
    capsule = obj.__dlpack__()
    if not _is_valid(capsule, b"dltensor"):
        raise InvalidUsageError(f"{type(obj).__name__}.__dlpack__() did not return a 'dltensor' capsule")
    # The capsule is not consumed (not renamed): when `keep` goes, its destructor calls the
    # producer's deleter, so the capsule keeps the memory valid while registered.
    t = _DLTensor.from_address(_get_pointer(capsule, b"dltensor"))
    shape = [t.shape[i] for i in range(t.ndim)]
    bits = t.dtype.bits * t.dtype.lanes
    if bits % 8:
        raise InvalidUsageError(f"cannot register a DLPack tensor of {bits}-bit elements")
    itemsize = bits // 8
    if t.strides and not _c_contiguous(shape, [t.strides[i] * itemsize for i in range(t.ndim)], itemsize):
        raise InvalidUsageError(f"cannot register a non-contiguous tensor ({type(obj).__name__}, shape {shape})")
    nbytes = math.prod(shape) * itemsize
    ptr = (t.data or 0) + t.byte_offset
    dev = t.device.device_type
    if dev in (_DL_CPU, _DL_CUDA_HOST):
        return ("host", ptr, nbytes, None, (obj, capsule))
    if dev in (_DL_CUDA, _DL_CUDA_MANAGED):
        return ("cuda", ptr, nbytes, int(t.device.device_id), (obj, capsule))
    raise InvalidUsageError(f"cannot register memory of DLPack device type {dev}")


def describe(obj: Any) -> tuple:
    """``(kind, ptr, nbytes, device, keep)`` for ``obj``; raises for anything not registrable."""
    if isinstance(obj, (bytes, str)):
        raise InvalidUsageError(f"cannot register {type(obj).__name__}: it is immutable (use bytearray)")
    try:
        cai = obj.__cuda_array_interface__
    except AttributeError:
        cai = None
    if cai is not None:
        if not isinstance(cai, dict):
            raise InvalidUsageError("__cuda_array_interface__ is not a dict")
        return _from_cai(obj, cai)
    try:
        mv = memoryview(obj)
    except TypeError:
        mv = None
    if mv is not None:
        return _from_buffer(obj, mv)
    if hasattr(obj, "__dlpack__"):
        return _from_dlpack(obj)
    raise TypeError(
        f"cannot register a {type(obj).__name__}: expected a tensor or array with __cuda_array_interface__, "
        "the buffer protocol (numpy, bytearray) or __dlpack__"
    )
