"""The enums of mscclpp_rs: :class:`Transport` (flags) and :class:`ErrorKind`.

A module of its own so that the native module can return these types (a connection's
``transport``, a memory's ``transports``, an error's ``kind``) without importing the package.
"""

from __future__ import annotations

import enum

__all__ = ["ErrorKind", "Transport"]


class Transport(enum.IntFlag):
    """Transports, combinable with ``|`` (MSCCL++'s ``TransportFlags`` bits).

    What the library returns (``Connection.transport``, ``RegisteredMemory.transports``,
    ``MscclppError.transport``) is this type too, so it compares with what users pass in.
    """

    CUDA_IPC = 1 << 1
    IB0 = 1 << 2
    IB1 = 1 << 3
    IB2 = 1 << 4
    IB3 = 1 << 5
    IB4 = 1 << 6
    IB5 = 1 << 7
    IB6 = 1 << 8
    IB7 = 1 << 9
    ETHERNET = 1 << 10

    def __str__(self) -> str:
        """The member names joined by ``|`` (``"ETHERNET"``, ``"ETHERNET|IB0"``), on every Python
        version (3.11 changed ``str`` of an ``IntFlag`` to the number)."""
        names = [t.name for t in Transport if t.value & self.value and t.name]
        return "|".join(names) if names else "0"

    def __format__(self, spec: str) -> str:
        return format(str(self), spec)


class ErrorKind(enum.Enum):
    """The broad class of an error (``MscclppError.kind``), as the Rust ``mscclpp::ErrorKind``;
    the value is the text the message ends with."""

    INVALID_USAGE = "invalid usage"
    TIMEOUT = "timeout"
    REMOTE = "remote failure"
    SYSTEM = "system error"
    CUDA = "CUDA error"
    IB = "IB error"
    INTERNAL = "internal error"
    ABORTED = "aborted"
    NOT_AVAILABLE = "not available"
    OTHER = "other"
