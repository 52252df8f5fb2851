"""Starting two ranks for the examples: under torchrun/mpirun (launcher variables), or by
spawning the second rank from the first with a fresh UniqueId."""

from __future__ import annotations

import multiprocessing as mp
import os
import sys
import traceback
from typing import Callable

import mscclpp_rs as m


def _child(fn, rank, size, uid, args, q):
    try:
        fn(m.Communicator(rank, size, uid, timeout=60.0), args)
        q.put((rank, None))
    except BaseException:  # noqa: BLE001 - reported by the parent
        q.put((rank, traceback.format_exc()))


def run_ranks(fn: Callable, args, size: int = 2) -> None:
    """Runs ``fn(comm, args)`` on ``size`` ranks; exits non-zero if any rank failed."""
    if any(k in os.environ for k in ("RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "SLURM_PROCID")):
        fn(m.Communicator.from_env(timeout=60.0), args)
        return
    uid = bytes(m.UniqueId.create())
    ctx = mp.get_context("spawn")  # never fork a process that may have CUDA initialised
    q = ctx.Queue()
    procs = [ctx.Process(target=_child, args=(fn, r, size, uid, args, q)) for r in range(1, size)]
    for p in procs:
        p.start()
    _child(fn, 0, size, uid, args, q)
    errors = [q.get(timeout=300) for _ in range(size)]
    for p in procs:
        p.join(timeout=60)
    failed = [(r, e) for r, e in sorted(errors, key=lambda x: x[0]) if e]
    for r, e in failed:
        print(f"rank {r} failed:\n{e}", file=sys.stderr)
    if failed:
        sys.exit(1)
