"""Several processes over Ethernet with NumPy and bytearray memory, byte-exact."""

import multiprocessing as mp
import traceback

import numpy as np
import pytest

import mscclpp_rs as m

N = 1 << 16  # bytes each rank writes into each peer


def pattern(rank: int, n: int) -> np.ndarray:
    return ((np.arange(n, dtype=np.uint64) * 2654435761 + rank * 97) % 251).astype(np.uint8)


def rank_main(rank, size, uid_bytes, q):
    try:
        comm = m.Communicator(rank, size, uid_bytes, timeout=60.0)
        peers = [p for p in range(size) if p != rank]
        src = pattern(rank, N)  # numpy source
        dst = bytearray(N * size)  # bytearray destination: block p is written by rank p
        words = np.zeros(size, dtype=np.uint64)  # atomic_add targets, one word per writer
        msrc = comm.register(src, m.Transport.ETHERNET)
        mdst = comm.register(dst, m.Transport.ETHERNET)
        mwords = comm.register(words, m.Transport.ETHERNET)
        conns = comm.connect_all(peers, m.Transport.ETHERNET)
        remote_dst = comm.exchange(mdst, peers, tag=1)
        remote_words = comm.exchange(mwords, peers, tag=2)
        sems = {p: comm.host_semaphore(conns[p]) for p in peers}
        for p in peers:
            c = conns[p]
            # two halves, the second from a numpy offset
            c.write(remote_dst[p], rank * N, msrc, 0, N // 2)
            c.write(remote_dst[p], rank * N + N // 2, msrc, N // 2, N // 2)
            c.atomic_add(remote_words[p], rank * 8, 1000 + rank)
            c.atomic_add(remote_words[p], rank * 8, 5)
            sems[p].signal()  # ordered after the writes and adds
        for p in peers:
            sems[p].wait(timeout=60.0)
        for p in peers:
            conns[p].flush(timeout=60.0)
        ok = True
        for p in peers:
            got = bytes(dst[p * N : (p + 1) * N])
            if got != pattern(p, N).tobytes():
                ok = False
            if int(words[p]) != 1005 + p:
                ok = False
        if bytes(dst[rank * N : (rank + 1) * N]) != bytes(N):
            ok = False  # nobody writes our own block
        comm.barrier()
        q.put((rank, ok, None))
    except Exception:  # noqa: BLE001 - reported to the parent
        q.put((rank, False, traceback.format_exc()))


@pytest.mark.parametrize("size", [2, 3])
def test_ethernet_numpy_and_bytearray_byte_exact(size):
    ctx = mp.get_context("spawn")
    uid = m.UniqueId.create()
    q = ctx.Queue()
    procs = [ctx.Process(target=rank_main, args=(r, size, bytes(uid), q)) for r in range(1, size)]
    for p in procs:
        p.start()
    rank_main(0, size, bytes(uid), q)
    results = [q.get(timeout=120) for _ in range(size)]
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    for rank, ok, err in sorted(results, key=lambda r: r[0]):
        assert err is None, f"rank {rank}:\n{err}"
        assert ok, f"rank {rank}: data or atomic words differ"


def peer_dies(uid_bytes):
    comm = m.Communicator(1, 2, uid_bytes, timeout=30.0)
    # Kept until the exit: a connection dropped at once closes its endpoint, and rank 0, still
    # dialling it, would fail its connect instead of the barrier this test is about.
    conn = comm.connect(0, m.Transport.ETHERNET)  # noqa: F841
    comm.barrier()
    # exit without flushing or saying goodbye


def test_peer_gone_is_an_exception_naming_the_peer():
    ctx = mp.get_context("spawn")
    uid = m.UniqueId.create()
    p = ctx.Process(target=peer_dies, args=(bytes(uid),))
    p.start()
    comm = m.Communicator(0, 2, uid, timeout=30.0)
    conn = comm.connect(1, m.Transport.ETHERNET)
    comm.barrier()
    p.join(timeout=60)
    with pytest.raises(m.MscclppError) as ei:
        comm.barrier()  # the peer is gone: the bootstrap says so instead of hanging
    assert "1" in str(ei.value)
    del conn
