"""Type stubs of the native module ``mscclpp_rs._native`` (re-exported by ``mscclpp_rs``)."""

from os import PathLike
from pathlib import Path
from typing import Any, Literal, Sequence, TypeVar, Union, overload

from typing_extensions import Self

from ._types import Transport

__version__: str
UNIQUE_ID_BYTES: int
HEADER_NAME: str
ABI_VERSION: int

# A Transport flag (or an OR of them), an int of flag bits, a name ("eth", "cuda-ipc", "ib0"),
# or a list of those.
TransportLike = Union[int, str, Sequence[Union[int, str]]]

# A GPU tensor or array: a torch CUDA tensor or anything with __cuda_array_interface__.
_T = TypeVar("_T")
# A reduction: "sum", "prod", "min", "max", "avg" (any case), or an enum member with that name
# (mscclpp_rs.ReduceOp, MSCCL++'s ReduceOp, torch.distributed.ReduceOp).
OpLike = Any
# A stream: an int cudaStream_t, or an object with .cuda_stream (torch) or .ptr (CuPy).
StreamLike = Any

class UniqueId:
    """What a job's ranks share to find each other (128 bytes; pickles as its bytes)."""

    def __init__(self, data: bytes | bytearray | str) -> None:
        """From ``bytes(uid)`` or ``str(uid)``; ``InvalidUsageError`` for anything else."""
    @staticmethod
    def create() -> UniqueId:
        """A fresh id whose root will be rank 0 of this process."""
    @property
    def root_addr(self) -> str:
        """``host:port`` of the root."""
    def to_bytes(self) -> bytes:
        """The 128 bytes every rank passes to ``Communicator`` (also ``bytes(uid)``)."""
    @staticmethod
    def from_bytes(data: bytes) -> UniqueId:
        """The id of ``to_bytes()`` output; ``InvalidUsageError`` for anything else."""
    def __bytes__(self) -> bytes: ...
    def __eq__(self, other: object) -> bool: ...
    def __hash__(self) -> int: ...

class RegisteredMemory:
    """A registered tensor/array (local; keeps the object alive) or a peer's memory."""

    @property
    def nbytes(self) -> int: ...
    @property
    def addr(self) -> int:
        """Start address in the owning process (a device address for GPU memory)."""
    @property
    def is_local(self) -> bool: ...
    @property
    def transports(self) -> Transport:
        """The transports it is registered for."""
    @property
    def device(self) -> int | None:
        """GPU index, ``None`` for host memory."""
    @property
    def obj(self) -> Any | None:
        """The registered object (``None`` for a peer's memory)."""
    def to_bytes(self) -> bytes:
        """The description peers receive (what ``send_memory`` sends)."""
    @staticmethod
    def from_bytes(data: bytes) -> RegisteredMemory:
        """A peer's memory from ``to_bytes()`` output (bytes received by other means)."""
    def __len__(self) -> int: ...

class Connection:
    """A connection to one peer over one transport. Operations are asynchronous until ``flush``.
    A context manager: leaving ``with`` calls ``close()``."""

    def write(self, dst: RegisteredMemory, dst_offset: int, src: RegisteredMemory, src_offset: int, size: int) -> None:
        """Copies ``size`` bytes of local ``src`` into the peer's ``dst`` (``src`` unchanged until ``flush``)."""
    def update_and_sync(self, dst: RegisteredMemory, dst_offset: int, value: int) -> None:
        """Sets the peer's 8-byte word, after every earlier operation."""
    def atomic_add(self, dst: RegisteredMemory, dst_offset: int, value: int) -> None:
        """Adds to the peer's 8-byte word (wrapping), after every earlier operation."""
    def flush(self, timeout: float = 30.0) -> None:
        """Waits (GIL released) until every earlier operation landed; ``MscclppTimeoutError`` otherwise.

        ``timeout`` is in seconds: ``0`` answers at once, ``float('inf')`` means no limit, a negative
        number or NaN raises ``InvalidUsageError`` (a ``ValueError``)."""
    def status(self) -> None:
        """Raises the error that broke the connection, if any."""
    @property
    def outstanding(self) -> int: ...
    @property
    def transport(self) -> Transport:
        """The transport, as passed to ``connect``."""
    @property
    def peer(self) -> int | None: ...
    def close(self) -> None:
        """Waits (at most 5 s) for unflushed writes, then lets the connection go; later operations
        raise ``AbortedError``. Closing twice is harmless."""
    @property
    def closed(self) -> bool: ...
    def __enter__(self) -> Self: ...
    def __exit__(self, exc_type: Any = None, exc: Any = None, tb: Any = None) -> bool: ...

class Host2HostSemaphore:
    """A semaphore host threads signal and wait on (Ethernet, IB)."""

    def signal(self) -> None: ...
    def poll(self) -> bool: ...
    def wait(self, timeout: float = 30.0) -> None:
        """Waits (GIL released) for the peer's next signal; ``MscclppTimeoutError`` after ``timeout``
        seconds (``0``: only a signal already there; ``float('inf')``: no limit; negative or NaN:
        ``InvalidUsageError``, a ``ValueError``)."""
    @property
    def inbound_token(self) -> int: ...

class Host2DeviceSemaphore:
    """A semaphore kernels wait on; give it to ``ProxyService.add_semaphore`` for a PortChannel."""

    def signal(self) -> None: ...
    def wait(self, timeout: float = 30.0) -> None:
        """Waits on the host (GIL released) for the peer's next signal; ``timeout`` as in
        ``Host2HostSemaphore.wait``."""
    def device_handle(self) -> bytes:
        """The 16-byte ``mscclpp::Host2DeviceSemaphoreDeviceHandle``."""

class Communicator:
    """The ranks of a job: registration, exchange, connections, semaphores, barrier.
    A context manager: leaving ``with`` calls ``close()``.

    Every ``timeout`` of this module is in seconds: ``0`` answers at once (``MscclppTimeoutError``
    when the answer is not already there), ``float('inf')`` means no limit (so does a value too
    large to be a time), and a negative number or NaN raises ``InvalidUsageError`` (a ``ValueError``)."""

    def __init__(self, rank: int, size: int, unique_id: UniqueId | bytes | str, timeout: float = 30.0) -> None:
        """Joins the job of ``unique_id`` as ``rank`` of ``size``; ``timeout`` bounds every later
        bootstrap wait too."""
    @staticmethod
    def from_env(unique_id: UniqueId | bytes | str | None = None, timeout: float = 30.0) -> Communicator:
        """Rank/size from torchrun, mpirun, PMI, srun or RANK/WORLD_SIZE variables, by ``mscclpp::launcher``'s
        rules; root from ``unique_id``, else MSCCLPP_ROOT_ADDR, else MASTER_ADDR with MSCCLPP_ROOT_PORT,
        or MASTER_PORT + 1 under torchrun (its store holds MASTER_PORT), or MASTER_PORT."""
    @property
    def rank(self) -> int: ...
    @property
    def size(self) -> int: ...
    @property
    def ranks_per_node(self) -> int: ...
    timeout: float
    """The bootstrap's wait limit in seconds (``float('inf')``: no limit); settable."""
    def barrier(self) -> None: ...
    @overload
    def all_gather(self, data: bytes | bytearray | memoryview) -> list[bytes]:
        """Every rank's bytes, in rank order, through the bootstrap (GIL released)."""
    @overload
    def all_gather(
        self,
        data: _T,
        out: _T | None = None,
        *,
        algorithm: str | None = None,
        blocks: int | None = None,
        threads: int | None = None,
        stream: StreamLike | None = None,
    ) -> _T:
        """AllGather of a GPU tensor into ``out`` (``size`` x its elements, rank order; allocated
        with torch when ``None``); returns ``out``. See ``all_reduce``."""
    def all_reduce(
        self,
        tensor: _T,
        op: OpLike = "sum",
        out: _T | None = None,
        *,
        algorithm: str | None = None,
        accumulate_f32: bool = False,
        blocks: int | None = None,
        threads: int | None = None,
        stream: StreamLike | None = None,
    ) -> _T:
        """AllReduce of a GPU tensor (torch, or ``__cuda_array_interface__``), in place unless
        ``out`` is given; returns the tensor written.

        Contiguous f32/f16/bf16/i32/u32 only (``InvalidUsageError``, a ``ValueError``, otherwise).
        Runs on ``stream``, else the array's own stream, else torch's current stream, else the
        legacy default stream. The first tensor call builds the communicator's ``Collectives``: a
        collective call every rank makes, before any CUDA-graph capture; later calls can be
        captured. ``algorithm``: ``allpair``, ``packet``, ``simple`` or an MSCCL++ name."""
    def reduce_scatter(
        self,
        tensor: _T,
        out: _T | None = None,
        op: OpLike = "sum",
        *,
        algorithm: str | None = None,
        accumulate_f32: bool = False,
        blocks: int | None = None,
        threads: int | None = None,
        stream: StreamLike | None = None,
    ) -> _T:
        """ReduceScatter: rank r gets the reduction of segment r of ``tensor`` in ``out``
        (allocated with torch, first dimension / ``size``, when ``None``); returns ``out``."""
    def broadcast(
        self,
        tensor: _T,
        root: int = 0,
        *,
        algorithm: str | None = None,
        blocks: int | None = None,
        threads: int | None = None,
        stream: StreamLike | None = None,
    ) -> _T:
        """Broadcast of ``root``'s tensor into every rank's ``tensor`` (in place); returns it."""
    def collectives(
        self,
        *,
        device: int | None = None,
        timeout: float = 30.0,
        tune: bool | None = None,
        packet_bytes: int | None = None,
        simple_bytes: int | None = None,
    ) -> Collectives:
        """The ``Collectives`` the tensor methods use, built on the first call with these settings
        (a collective call; ``device`` defaults to torch's current device, else 0); later calls
        return the same object and ignore the settings."""
    @property
    def has_collectives(self) -> bool:
        """Whether ``collectives()`` was built."""
    def register(self, obj: Any, transports: TransportLike) -> RegisteredMemory:
        """Registers a CUDA tensor/array (``__cuda_array_interface__``, DLPack) or host memory
        (buffer protocol, DLPack); writable, C-contiguous, non-empty. Keeps ``obj`` alive."""
    def send_memory(self, memory: RegisteredMemory, peer: int, tag: int = 0) -> None: ...
    def recv_memory(self, peer: int, tag: int = 0) -> RegisteredMemory: ...
    def exchange(self, memory: RegisteredMemory, peers: Sequence[int], tag: int = 0) -> dict[int, RegisteredMemory]: ...
    def connect(
        self,
        peer: int,
        transport: TransportLike,
        tag: int = 0,
        device: int | None = None,
        interface: str | None = None,
        max_write_queue_size: int | None = None,
    ) -> Connection: ...
    def connect_all(
        self,
        peers: Sequence[int],
        transport: TransportLike,
        tag: int = 0,
        device: int | None = None,
        interface: str | None = None,
        max_write_queue_size: int | None = None,
    ) -> dict[int, Connection]: ...
    def host_semaphore(self, connection: Connection, tag: int = 0) -> Host2HostSemaphore: ...
    def memory_semaphore(self, connection: Connection, tag: int = 0) -> MemoryDevice2DeviceSemaphore:
        """A device-to-device semaphore over a CUDA IPC connection (for MemoryChannels)."""
    def pack_handles(self, channels: Sequence[MemoryChannel], device: int = 0) -> DeviceHandles:
        """MemoryChannel handles (48 B each) packed into device memory at a stable address."""
    def device_semaphore(self, connection: Connection, tag: int = 0) -> Host2DeviceSemaphore: ...
    def close(self) -> None:
        """Leaves the job (the bootstrap closes once what was made through it is done with it);
        later calls raise ``AbortedError``. Closing twice is harmless."""
    @property
    def closed(self) -> bool: ...
    def __enter__(self) -> Self: ...
    def __exit__(self, exc_type: Any = None, exc: Any = None, tb: Any = None) -> bool: ...

class Collectives:
    """AllReduce, AllGather, ReduceScatter and Broadcast over a communicator's ranks (one host),
    on raw device pointers and an int ``cudaStream_t`` (0: the legacy default stream).

    Building is a collective call (every rank). Calls are asynchronous and capturable in CUDA
    graphs; every rank makes the same calls in the same order. Every device wait is bounded by
    ``timeout``: a rank that never arrives or makes a different call makes ``check()`` (or the next
    call) raise naming it, and the object refuses further calls. Pointers must stay valid until
    the stream passes the call (the driver-known size, device and alignment are checked)."""

    def __init__(
        self,
        comm: Communicator,
        *,
        device: int = 0,
        timeout: float = 30.0,
        tune: bool | None = None,
        packet_bytes: int | None = None,
        simple_bytes: int | None = None,
    ) -> None: ...
    def all_reduce(
        self,
        send: int,
        recv: int,
        count: int,
        dtype: str,
        op: str = "sum",
        stream: int = 0,
        *,
        algorithm: str | None = None,
        blocks: int | None = None,
        threads: int | None = None,
        accumulate_f32: bool = False,
    ) -> None:
        """``count`` elements of ``dtype`` (``f32``, ``f16``, ``bf16``, ``i32``, ``u32`` or their long
        names) from ``send`` into ``recv`` (equal: in place)."""
    def all_gather(
        self,
        send: int,
        recv: int,
        count: int,
        dtype: str,
        stream: int = 0,
        *,
        algorithm: str | None = None,
        blocks: int | None = None,
        threads: int | None = None,
    ) -> None:
        """``count`` elements per rank into ``recv`` (``size`` x ``count``, rank order)."""
    def reduce_scatter(
        self,
        send: int,
        recv: int,
        count: int,
        dtype: str,
        op: str = "sum",
        stream: int = 0,
        *,
        algorithm: str | None = None,
        blocks: int | None = None,
        threads: int | None = None,
        accumulate_f32: bool = False,
    ) -> None:
        """``send`` holds ``size`` x ``count`` elements; rank r gets segment r's reduction."""
    def broadcast(
        self,
        send: int,
        recv: int,
        count: int,
        dtype: str,
        root: int = 0,
        stream: int = 0,
        *,
        algorithm: str | None = None,
        blocks: int | None = None,
        threads: int | None = None,
    ) -> None:
        """``root``'s ``send`` into every rank's ``recv`` (``send`` read on the root only)."""
    def check(self) -> None:
        """Raises the error a kernel of this rank reported, if any (does not wait)."""
    def synchronize(self, stream: int = 0, timeout: float = 30.0) -> None:
        """Waits (GIL released, bounded) for ``stream``, then ``check()``."""
    def abort(self) -> None:
        """Makes running and future kernels of this rank stop waiting and fail."""
    def plan(
        self,
        collective: Literal["all_reduce", "all_gather", "reduce_scatter", "broadcast"] | str,
        nbytes: int,
        *,
        algorithm: str | None = None,
        blocks: int | None = None,
        threads: int | None = None,
    ) -> tuple[str, int, int]:
        """``(algorithm, blocks, threads)`` a call of ``nbytes`` (one rank's buffer; one segment
        for AllGather/ReduceScatter) would run."""
    @property
    def tuning(self) -> list[tuple[int, str, int, int, float]] | None:
        """``[(bytes, algorithm, blocks, threads, microseconds)]`` chosen by setup-time tuning."""
    @property
    def failed(self) -> bool: ...
    @property
    def scratch_bytes(self) -> int: ...
    @property
    def max_blocks(self) -> int: ...
    @property
    def rank(self) -> int: ...
    @property
    def size(self) -> int: ...
    @property
    def device(self) -> int: ...
    @property
    def timeout(self) -> float: ...

def pointer_device(ptr: int, nbytes: int = 1) -> int:
    """The GPU holding ``nbytes`` from ``ptr``; ``InvalidUsageError`` when it is not device memory."""

def parse_dtype(name: str) -> str:
    """The canonical dtype name (``f32``, ``f16``, ``bf16``, ``i32``, ``u32``)."""

def parse_op(name: str) -> str:
    """The canonical reduction name (``sum``, ``prod``, ``min``, ``max``, ``avg``)."""

def parse_algorithm(name: str) -> str:
    """The algorithm (``allpair``, ``packet``, ``simple``) a name selects."""

class MemoryDevice2DeviceSemaphore:
    """Signalled and waited on by kernels on both GPUs (CUDA IPC); MemoryChannels share it."""

    def device_handle(self) -> bytes:
        """The 24-byte ``mscclpp::MemoryDevice2DeviceSemaphoreDeviceHandle``."""
    @property
    def device(self) -> int: ...

class MemoryChannel:
    """A kernel's channel into a peer GPU's mapped memory (CUDA IPC), no host thread."""

    def __init__(
        self,
        semaphore: MemoryDevice2DeviceSemaphore,
        dst: RegisteredMemory,
        src: RegisteredMemory,
        packet_buffer: RegisteredMemory | None = None,
    ) -> None: ...
    def device_handle(self) -> bytes:
        """The 48-byte ``mscclpp::MemoryChannelDeviceHandle`` (pass by value)."""
    @property
    def device_handle_ptr(self) -> int:
        """Device address of the channel's own copy of its handle (stable)."""

class PortChannel:
    """A kernel's channel to one peer through a ProxyService."""

    def device_handle(self) -> bytes:
        """The 96-byte ``mscclpp::PortChannelDeviceHandle`` (pass by value)."""
    @property
    def device_handle_ptr(self) -> int | None:
        """Device address of the channel's own copy of its handle (stable)."""
    @property
    def semaphore_id(self) -> int: ...
    @property
    def dst(self) -> int: ...
    @property
    def src(self) -> int: ...

class DeviceHandles:
    """Channel handles packed in device memory by ``pack_handles`` (``__cuda_array_interface__``: uint8)."""

    @property
    def ptr(self) -> int: ...
    @property
    def nbytes(self) -> int: ...
    @property
    def device(self) -> int: ...
    def to_bytes(self) -> bytes: ...
    @property
    def __cuda_array_interface__(self) -> dict[str, Any]: ...
    def __len__(self) -> int: ...

class ProxyService:
    """Executes the requests kernels push through PortChannels (a context manager: start/stop)."""

    def __init__(
        self, comm: Communicator, device: int | None = 0, fifo_size: int = 512, max_write_queue_size: int | None = None
    ) -> None: ...
    def add_memory(self, memory: RegisteredMemory) -> int: ...
    def add_semaphore(self, semaphore: Host2DeviceSemaphore) -> int: ...
    def port_channel(self, semaphore: int, dst: int, src: int) -> PortChannel: ...
    def pack_handles(self, channels: Sequence[PortChannel]) -> DeviceHandles: ...
    def start(self) -> None: ...
    def stop(self) -> None:
        """Stops the thread; raises the proxy's first error, if any."""
    def status(self) -> None: ...
    @property
    def processed(self) -> int: ...
    @property
    def device(self) -> int | None: ...
    def __enter__(self) -> Self: ...
    def __exit__(self, exc_type: Any = None, exc: Any = None, tb: Any = None) -> bool: ...

class Ptx:
    """PTX compiled by ``compile_kernel``."""

    @property
    def ptx(self) -> str: ...
    @property
    def kernels(self) -> list[str]: ...
    @property
    def log(self) -> str: ...
    @property
    def arch(self) -> str: ...

def header_source() -> str:
    """The CUDA header ``mscclpp_rs/device.cuh``."""

def write_header(dir: str | PathLike[str]) -> Path:
    """Writes ``dir/mscclpp_rs/device.cuh`` and returns its path."""

def handle_sizes() -> dict[str, int]:
    """Sizes of the device handles by C++ name."""

def compile_kernel(
    source: str,
    arch: str | None = None,
    device: int | None = None,
    options: Sequence[str] | None = None,
    name: str | None = None,
) -> Ptx:
    """NVRTC compile (GIL released); ``#include "mscclpp_rs/device.cuh"`` works without ``-I``."""

class ExecutionPlan:
    """An MSCCL++ execution plan, loaded and validated (``PlanError`` names the bad field)."""

    def __init__(self, path: str | PathLike[str]) -> None: ...
    @staticmethod
    def from_json(text: str) -> ExecutionPlan: ...
    @property
    def name(self) -> str: ...
    @property
    def collective(self) -> str: ...
    @property
    def protocol(self) -> str: ...
    @property
    def inplace(self) -> bool: ...
    @property
    def world_size(self) -> int: ...
    @property
    def min_message_size(self) -> int: ...
    @property
    def max_message_size(self) -> int: ...
    @property
    def num_threads_per_block(self) -> int: ...
    def summary(self) -> str: ...
    def to_json(self) -> str: ...

class Executor:
    """Runs execution plans on raw device pointers and an int ``cudaStream_t``
    (``mscclpp_rs.Executor`` takes tensors and torch streams)."""

    def __init__(
        self,
        comm: Communicator,
        *,
        device: int = 0,
        timeout: float = 30.0,
        port_transport: str = "cuda_ipc",
        kernel: str | None = None,
    ) -> None: ...
    def execute(
        self,
        rank: int,
        send: int,
        recv: int,
        send_size: int,
        recv_size: int,
        dtype: str,
        plan: ExecutionPlan,
        stream: int = 0,
        packet_type: str = "LL16",
    ) -> None: ...
    def prepare(self, rank: int, send: int, recv: int, send_size: int, recv_size: int, plan: ExecutionPlan) -> None: ...
    def check(self) -> None: ...
    def synchronize(self, stream: int = 0, timeout: float = 30.0) -> None: ...
    def abort(self) -> None: ...
    @property
    def rank(self) -> int: ...
    @property
    def device(self) -> int: ...
    @property
    def timeout(self) -> float: ...

def generate_plan(algorithm: str, ranks: int, protocol: str = "LL", inplace: bool = False) -> str: ...
