"""MSCCL++'s algorithm-object API (``mscclpp.ext``) over mscclpp_rs's collectives.

Code written for MSCCL++'s Python ``ext`` API moves over by changing the import::

    from mscclpp_rs.ext import AlgorithmCollectionBuilder, DataType, ReduceOp

    algos = AlgorithmCollectionBuilder().build_default_algorithms(
        scratch_buffer=scratch.data_ptr(), scratch_buffer_size=scratch.nbytes, rank=rank)
    algo = algos["default_allreduce_packet"]          # or [a for a in algos if a.name == ...][0]
    rc = algo.execute(comm=comm, input_buffer=t.data_ptr(), output_buffer=t.data_ptr(),
                      input_size=t.nbytes, output_size=t.nbytes, dtype=DataType.bfloat16,
                      op=ReduceOp.SUM, stream=torch.cuda.current_stream().cuda_stream,
                      nblocks=8, nthreads_per_block=512)  # 0 on success, as MSCCL++

What differs, and why:

* ``comm`` is a :class:`mscclpp_rs.Communicator`. Every algorithm runs on that communicator's own
  :class:`Collectives` (``comm.collectives()``), built on the first ``execute`` (or tensor call):
  a collective call every rank must make, before any CUDA-graph capture.
* ``build_default_algorithms`` takes MSCCL++'s arguments but does not use the scratch buffer: the
  collectives allocate and map their own scratch when they are built (``Collectives.scratch_bytes``,
  80 MiB by default). The buffer can be freed or reused.
* The names are MSCCL++'s, each mapped to one of this library's three algorithms
  (:data:`ALGORITHM_MAP`): ``allpair`` (one-hop LL packets), ``packet`` (two-hop LL packets) and
  ``simple`` (staged copies). There is no NVLS (NVLink SHARP) here: the NVLS names run the
  closest non-NVLS algorithm so that code selecting them by name keeps working.
* ``execute`` returns 0 on success and a :class:`CommResult` code for a call the algorithm cannot
  serve (a message too large for packets, a thread count over 512...), as MSCCL++ does; the
  exception behind the code is kept in ``algo.last_error`` (``raise_errors=True`` raises it).
* ``executor``, ``symmetric_memory`` and ``extras`` are accepted and ignored (``extras["root"]``
  gives a broadcast's root). ``accum_dtype=DataType.float32`` reduces f16/bf16 in f32.
* No DSL algorithms and no custom algorithm builders (``add_algorithm_builder`` raises).
"""

from __future__ import annotations

import enum
import sys
from typing import Any, Iterator

from ._errors import (
    AbortedError,
    CudaError,
    InvalidUsageError,
    MscclppError,
    MscclppTimeoutError,
    RemoteError,
    SystemCallError,
)

__all__ = [
    "ALGORITHM_MAP",
    "Algorithm",
    "AlgorithmCollection",
    "AlgorithmCollectionBuilder",
    "CommResult",
    "DataType",
    "ReduceOp",
    "is_nvls_supported",
]


class DataType(enum.Enum):
    """Element types, with MSCCL++'s member names; the value is this library's name."""

    float32 = "f32"
    float16 = "f16"
    bfloat16 = "bf16"
    int32 = "i32"
    uint32 = "u32"


class ReduceOp(enum.Enum):
    """Reductions, with MSCCL++'s member names (``SUM``, ``MIN``, ``NOP``) and this library's
    others. ``NOP`` (MSCCL++'s default) is taken as ``SUM`` by reducing collectives."""

    SUM = "sum"
    PROD = "prod"
    MIN = "min"
    MAX = "max"
    AVG = "avg"
    NOP = "nop"


class CommResult(enum.IntEnum):
    """What ``Algorithm.execute`` returns (MSCCL++'s codes)."""

    COMM_SUCCESS = 0
    COMM_UNHANDLED_CUDA_ERROR = 1
    COMM_SYSTEM_ERROR = 2
    COMM_INTERNAL_ERROR = 3
    COMM_INVALID_ARGUMENT = 4
    COMM_INVALID_USAGE = 5
    COMM_REMOTE_ERROR = 6
    COMM_IN_PROGRESS = 7


def is_nvls_supported() -> bool:
    """Always False: these collectives do not use NVLink SHARP."""
    return False


_MAX = (1 << 64) - 1

# MSCCL++ name -> (collective, this library's algorithm, default message size range in bytes).
ALGORITHM_MAP: dict[str, tuple[str, str, tuple[int, int]]] = {
    "default_allreduce_allpair_packet": ("allreduce", "allpair", (0, 16 << 10)),
    "default_allreduce_packet": ("allreduce", "packet", (0, 1 << 20)),
    "default_allreduce_nvls_packet": ("allreduce", "packet", (0, 1 << 20)),
    "default_allreduce_fullmesh": ("allreduce", "simple", (0, _MAX)),
    "default_allreduce_rsag": ("allreduce", "simple", (0, _MAX)),
    "default_allreduce_rsag_pipeline": ("allreduce", "simple", (0, _MAX)),
    "default_allreduce_rsag_zero_copy": ("allreduce", "simple", (0, _MAX)),
    "default_allreduce_nvls_zero_copy": ("allreduce", "simple", (0, _MAX)),
    "default_allreduce_nvls_warp_pipeline": ("allreduce", "simple", (0, _MAX)),
    "default_allreduce_nvls_block_pipeline": ("allreduce", "simple", (0, _MAX)),
    "default_allgather_fullmesh": ("allgather", "simple", (0, _MAX)),
    "default_allgather_fullmesh2": ("allgather", "simple", (0, _MAX)),
    # Collectives MSCCL++ has no native algorithm for (named in its style).
    "default_allgather_packet": ("allgather", "packet", (0, 1 << 20)),
    "default_reducescatter_packet": ("reducescatter", "packet", (0, 1 << 20)),
    "default_reducescatter_simple": ("reducescatter", "simple", (0, _MAX)),
    "default_broadcast_packet": ("broadcast", "packet", (0, 1 << 20)),
    "default_broadcast_simple": ("broadcast", "simple", (0, _MAX)),
}


def _dtype_name(dtype: Any) -> str:
    """This library's dtype name for a :class:`DataType`, MSCCL++'s enum, a torch dtype or a name."""
    from ._native import parse_dtype

    if isinstance(dtype, DataType):
        return dtype.value
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(dtype, torch.dtype):
        from ._collectives import _torch_dtype_map

        name = _torch_dtype_map(torch).get(dtype)
        if name is None:
            raise InvalidUsageError(f"dtype {dtype} is not supported; use float32, float16, bfloat16, int32, uint32")
        return name
    if not isinstance(dtype, str):
        name = getattr(dtype, "name", None)
        dtype = name if isinstance(name, str) else str(dtype).rsplit(".", 1)[-1]
    return parse_dtype(dtype)


def _op_name(op: Any) -> str:
    if op is None or op is ReduceOp.NOP or (getattr(op, "name", None) == "NOP"):
        return "sum"
    if isinstance(op, ReduceOp):
        return op.value
    from ._collectives import _op_name as parse

    return parse(op)


def _code(e: MscclppError) -> CommResult:
    if isinstance(e, InvalidUsageError):
        return CommResult.COMM_INVALID_ARGUMENT
    if isinstance(e, CudaError):
        return CommResult.COMM_UNHANDLED_CUDA_ERROR
    if isinstance(e, SystemCallError):
        return CommResult.COMM_SYSTEM_ERROR
    if isinstance(e, (RemoteError, MscclppTimeoutError, AbortedError)):
        return CommResult.COMM_REMOTE_ERROR
    return CommResult.COMM_INTERNAL_ERROR


def _pointer(buf: Any) -> int:
    if isinstance(buf, int):
        return buf
    from ._collectives import _describe

    return _describe(buf, "execute", writable=False).ptr


class Algorithm:
    """One named algorithm of the collection (MSCCL++'s ``Algorithm`` shape).

    ``name`` is MSCCL++'s name, ``collective`` one of ``"allreduce"``, ``"allgather"``,
    ``"reducescatter"``, ``"broadcast"``, ``native_algorithm`` what runs here (``allpair``,
    ``packet`` or ``simple``)."""

    def __init__(self, name: str, collective: str, native_algorithm: str, message_size_range: tuple[int, int]):
        self.name = name
        self.collective = collective
        self.native_algorithm = native_algorithm
        self._range = (int(message_size_range[0]), int(message_size_range[1]))
        self.tags: dict[str, int] = {}
        self.buffer_mode = "ANY"  # in place and out of place both work
        self.last_error: MscclppError | None = None

    def __repr__(self) -> str:
        return f"Algorithm({self.name!r}, collective={self.collective!r}, runs={self.native_algorithm!r})"

    @property
    def message_size_range(self) -> tuple[int, int]:
        """``(min, max)`` bytes this algorithm is meant for (a hint for selectors; ``execute``
        runs any size the algorithm can serve)."""
        return self._range

    def set_message_size_range(self, min_message_size: int, max_message_size: int) -> None:
        self._range = (int(min_message_size), int(max_message_size))

    def is_dsl_algorithm(self) -> bool:
        return False

    def is_native_algorithm(self) -> bool:
        return True

    def reset(self) -> None:
        """Nothing to reset: the collectives' state lives on the GPU and advances by itself."""

    def execute(
        self,
        comm: Any,
        input_buffer: Any,
        output_buffer: Any,
        input_size: int,
        output_size: int,
        dtype: Any,
        op: Any = ReduceOp.NOP,
        stream: Any = None,
        executor: Any = None,
        nblocks: int = 0,
        nthreads_per_block: int = 0,
        symmetric_memory: bool = False,
        extras: dict[str, int] | None = None,
        accum_dtype: Any = None,
        *,
        raise_errors: bool = False,
    ) -> int:
        """Runs the collective on ``comm`` (a :class:`mscclpp_rs.Communicator`) on ``stream``.

        ``input_buffer``/``output_buffer``: device pointers (ints) or GPU tensors (their data
        pointers are used); ``input_size``/``output_size``: bytes (AllGather: output = size x
        input; ReduceScatter: input = size x output). ``nblocks``/``nthreads_per_block``: 0 lets
        the selector choose. ``accum_dtype``: ``DataType.float32`` reduces f16/bf16 in f32.
        ``stream``: a raw ``cudaStream_t`` or a torch/CuPy stream; by default torch's current
        stream on the buffer's GPU (MSCCL++ defaults to 0, the legacy stream, which does not
        order with the non-blocking streams torch hands out: results read on torch's stream
        could be read before the collective wrote them; pass ``0`` to get MSCCL++'s default).
        Returns 0, or a :class:`CommResult` code with the exception in ``last_error``."""
        from ._collectives import _stream_of
        from ._native import Communicator, pointer_device

        if not isinstance(comm, Communicator):
            raise TypeError(f"comm must be a mscclpp_rs.Communicator, not {type(comm).__name__}")
        self.last_error = None
        try:
            dt = _dtype_name(dtype)
            acc_name = dt if accum_dtype is None else _dtype_name(accum_dtype)
            acc = acc_name == "f32" and dt in ("f16", "bf16")
            if acc_name not in (dt, "f32") or (acc_name == "f32" and dt not in ("f16", "bf16", "f32")):
                raise InvalidUsageError(f"accum_dtype {accum_dtype} is not supported for {dt}: use float32 or the dtype")
            itemsize = 2 if dt in ("f16", "bf16") else 4
            src, dst = _pointer(input_buffer), _pointer(output_buffer)
            n = comm.size
            input_size, output_size = int(input_size), int(output_size)
            if input_size % itemsize or output_size % itemsize:
                raise InvalidUsageError(f"sizes {input_size} and {output_size} are not whole {dt} elements")
            if self.collective == "allgather" and output_size < n * input_size:
                raise InvalidUsageError(f"allgather output_size {output_size} < {n} x input_size {input_size}")
            if self.collective == "reducescatter" and input_size < n * output_size:
                raise InvalidUsageError(f"reducescatter input_size {input_size} < {n} x output_size {output_size}")
            dev = pointer_device(src, max(input_size, 1))
        except MscclppError as e:
            return self._fail(e, raise_errors)
        # Built on first use: a collective call, whose errors are raised (every rank must make it).
        coll = comm.collectives(device=dev)
        raw = _stream_of(stream, None, dev)
        shape = {
            "algorithm": self.native_algorithm,
            "blocks": int(nblocks) or None,
            "threads": int(nthreads_per_block) or None,
        }
        try:
            if self.collective == "allreduce":
                coll.all_reduce(src, dst, input_size // itemsize, dt, _op_name(op), raw, accumulate_f32=acc, **shape)
            elif self.collective == "allgather":
                coll.all_gather(src, dst, input_size // itemsize, dt, raw, **shape)
            elif self.collective == "reducescatter":
                coll.reduce_scatter(
                    src, dst, output_size // itemsize, dt, _op_name(op), raw, accumulate_f32=acc, **shape
                )
            else:
                root = int((extras or {}).get("root", 0))
                coll.broadcast(src, dst, input_size // itemsize, dt, root, raw, **shape)
        except MscclppError as e:
            return self._fail(e, raise_errors)
        return int(CommResult.COMM_SUCCESS)

    def _fail(self, e: MscclppError, raise_errors: bool) -> int:
        self.last_error = e
        if raise_errors:
            raise e
        return int(_code(e))


class AlgorithmCollection:
    """The algorithms, iterable and indexable by position or by name."""

    def __init__(self, algorithms: list[Algorithm]):
        self._algorithms = list(algorithms)

    def __iter__(self) -> Iterator[Algorithm]:
        return iter(self._algorithms)

    def __len__(self) -> int:
        return len(self._algorithms)

    def __getitem__(self, key: int | str) -> Algorithm:
        if isinstance(key, str):
            for a in self._algorithms:
                if a.name == key:
                    return a
            raise KeyError(f"no algorithm named {key!r}; names: {', '.join(self.names())}")
        return self._algorithms[key]

    def __contains__(self, name: object) -> bool:
        return any(a.name == name for a in self._algorithms)

    def names(self) -> list[str]:
        return [a.name for a in self._algorithms]

    def get(self, name: str, default: Algorithm | None = None) -> Algorithm | None:
        return next((a for a in self._algorithms if a.name == name), default)

    def get_by_collective(self, collective: str) -> list[Algorithm]:
        return [a for a in self._algorithms if a.collective == collective]

    def register_algorithm(self, collective: str, algo_name: str, algorithm: Algorithm) -> None:
        """Adds ``algorithm`` (an :class:`Algorithm` of this module) under ``algo_name``."""
        if not isinstance(algorithm, Algorithm):
            raise TypeError("only mscclpp_rs.ext.Algorithm objects can be registered")
        if algorithm.collective != collective:
            raise InvalidUsageError(f"{algorithm.name} implements {algorithm.collective}, not {collective}")
        algorithm.name = algo_name
        self._algorithms.append(algorithm)


class AlgorithmCollectionBuilder:
    """Builds the collection of default algorithms (a process-wide singleton, as in MSCCL++)."""

    _instance: AlgorithmCollectionBuilder | None = None

    def __new__(cls) -> AlgorithmCollectionBuilder:
        if cls._instance is None:
            cls._instance = super().__new__(cls)
            cls._instance._selector = None
            cls._instance._fallback_selector = None
        return cls._instance

    @classmethod
    def reset(cls) -> None:
        cls._instance = None

    def add_algorithm_builder(self, algorithm_builder: Any) -> None:
        raise NotImplementedError(
            "mscclpp_rs runs its own algorithms only: custom and DSL algorithm builders are not supported"
        )

    def set_algorithm_selector(self, selector: Any) -> None:
        """Kept for compatibility; the selector is not consulted (``Communicator.all_reduce``
        and friends choose with the collectives' own selector and tuning)."""
        self._selector = selector

    def set_fallback_algorithm_selector(self, selector: Any) -> None:
        """Kept for compatibility; not consulted."""
        self._fallback_selector = selector

    def build(self) -> AlgorithmCollection:
        return self.build_default_algorithms(0, 0, 0)

    def build_default_algorithms(
        self,
        scratch_buffer: int = 0,
        scratch_buffer_size: int = 0,
        rank: int = 0,
        flag_buffer: int | None = None,
        flag_buffer_size: int | None = None,
    ) -> AlgorithmCollection:
        """Every algorithm of :data:`ALGORITHM_MAP`. The arguments are MSCCL++'s and are not used:
        the collectives bring their own scratch and flags, and the rank comes from ``comm``."""
        return AlgorithmCollection(
            [Algorithm(name, coll, native, rng) for name, (coll, native, rng) in ALGORITHM_MAP.items()]
        )
