"""Exceptions raised by mscclpp_rs.

Every error of the library is a :class:`MscclppError`; the subclass says the kind, and the
message says the operation, the transport and the peer rank where there is one (also as the
attributes ``kind``, an :class:`ErrorKind`; ``operation``; ``transport``, a :class:`Transport`;
``peer``; and ``errno`` where an operating-system call failed). A timeout is also a built-in
:class:`TimeoutError`, invalid usage also a :class:`ValueError`, a failed peer also a
:class:`ConnectionError`, a failed system call also an :class:`OSError` (with its ``errno``).
"""

from __future__ import annotations

from ._types import ErrorKind, Transport

__all__ = [
    "MscclppError",
    "InvalidUsageError",
    "MscclppTimeoutError",
    "RemoteError",
    "SystemCallError",
    "CudaError",
    "IbError",
    "InternalError",
    "AbortedError",
    "NotAvailableError",
    "PlanError",
]


class MscclppError(Exception):
    """Base class of every mscclpp_rs error."""

    kind: ErrorKind | None = None
    operation: str | None = None
    peer: int | None = None
    transport: Transport | None = None
    errno: int | None = None


class InvalidUsageError(MscclppError, ValueError):
    """Bad arguments: bounds, a memory without the transport, a read-only or non-contiguous buffer."""


class MscclppTimeoutError(MscclppError, TimeoutError):
    """A bounded wait ran out (flush, semaphore wait, bootstrap)."""


class RemoteError(MscclppError, ConnectionError):
    """The peer failed, closed, broke the protocol or could not be reached."""


class SystemCallError(MscclppError, OSError):
    """An operating-system call failed; ``errno`` is its error number (``errno.ECONNREFUSED``...)
    when the system gave one, else ``None``."""


class CudaError(MscclppError):
    """A CUDA driver call failed."""


class IbError(MscclppError):
    """An InfiniBand verbs call failed."""


class InternalError(MscclppError):
    """A broken invariant inside the library (please report it)."""


class AbortedError(MscclppError):
    """The operation was abandoned because its object had already failed or was closed."""


class NotAvailableError(MscclppError):
    """A feature or platform library (CUDA, libibverbs, NVRTC) is not available here."""


class PlanError(InvalidUsageError):
    """An execution plan that cannot be read, parsed, validated or run with the given sizes;
    ``path`` is the JSON path of the offending field (``gpus[1].threadblocks[0].ops[3].src_buff[0]
    .index``), or ``None`` when the error is not about one field (unreadable file, not JSON)."""

    path: str | None = None
