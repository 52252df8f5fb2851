"""Python-side overhead per ``Connection.write``, next to the same loop in Rust.

    python -m mscclpp_rs.examples.bench_write [--size 8] [--iters 200000] [--flush-every 64]

One process, an Ethernet self-connection, host memory (NumPy). The same loop (``write``, and a
``flush`` after every ``--flush-every`` writes) runs once through the Python binding and once
inside the extension calling the Rust ``Connection::write`` directly; the difference per call is
what Python adds (argument conversion, the GIL release, the keep-alive of the source). Medians of
``--rounds`` rounds.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

import mscclpp_rs as m
from mscclpp_rs import _native


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", type=int, default=8)
    p.add_argument("--iters", type=int, default=100_000)
    p.add_argument("--flush-every", type=int, default=64)
    p.add_argument("--rounds", type=int, default=5)
    a = p.parse_args(argv)
    comm = m.Communicator(0, 1, m.UniqueId.create())
    conn = comm.connect(0, m.Transport.ETHERNET)
    src = np.ones(max(a.size, 8), dtype=np.uint8)
    dst = np.zeros(max(a.size, 8), dtype=np.uint8)
    msrc = comm.register(src, m.Transport.ETHERNET)
    mdst = comm.register(dst, m.Transport.ETHERNET)
    rdst = comm.exchange(mdst, [0])[0]

    def python_loop() -> float:
        write, flush, fe = conn.write, conn.flush, a.flush_every
        t0 = time.perf_counter()
        for i in range(a.iters):
            write(rdst, 0, msrc, 0, a.size)
            if (i + 1) % fe == 0:
                flush(30.0)
        flush(30.0)
        return time.perf_counter() - t0

    def rust_loop() -> float:
        return _native._time_rust_writes(conn, rdst, 0, msrc, 0, a.size, a.iters, a.flush_every)

    python_loop(), rust_loop()  # warm-up
    py_t, rs_t = [], []
    for _ in range(a.rounds):
        py_t.append(python_loop() / a.iters * 1e9)
        rs_t.append(rust_loop() / a.iters * 1e9)
    py_ns, rs_ns = statistics.median(py_t), statistics.median(rs_t)
    print(f"write of {a.size} B over ETH (flush every {a.flush_every}), medians of {a.rounds} x {a.iters}:")
    print(f"  Rust loop   {rs_ns:8.0f} ns/write")
    print(f"  Python loop {py_ns:8.0f} ns/write")
    print(f"  Python-side overhead {py_ns - rs_ns:8.0f} ns/write")


if __name__ == "__main__":
    main()
