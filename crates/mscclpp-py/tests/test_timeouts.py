"""Timeouts in seconds, through the one conversion every ``timeout`` argument takes: ``0`` answers
at once, ``float('inf')`` means no limit (and so does a value too large to be a time), a negative
number or NaN raises ``InvalidUsageError``, a ``ValueError``."""

import math

import numpy as np
import pytest

import mscclpp_rs as m

ETH = m.Transport.ETHERNET
INF = float("inf")
BAD = [-1.0, -1e-9, -INF, float("nan")]


@pytest.fixture(scope="module")
def comm():
    return m.Communicator(0, 1, m.UniqueId.create(), timeout=INF)


@pytest.fixture(scope="module")
def conn(comm):
    return comm.connect(0, ETH)


def test_a_communicator_without_limit_works(comm):
    assert comm.timeout == INF
    comm.barrier()
    assert comm.all_gather(b"x") == [b"x"]


@pytest.mark.parametrize(
    "given, read",
    [(0, 0.0), (0.0, 0.0), (2.5, 2.5), (1e12, 1e12), (INF, INF), (1e300, INF), (2**70, INF)],
)
def test_the_timeout_property_round_trips(comm, given, read):
    comm.timeout = given
    try:
        assert comm.timeout == read
        comm.barrier()  # works with any limit on one rank
    finally:
        comm.timeout = INF


@pytest.mark.parametrize("bad", BAD)
def test_negative_and_nan_timeouts_raise_value_error(comm, conn, bad):
    comm.timeout = 7.0
    try:
        with pytest.raises(ValueError, match="timeout must be a number of seconds >= 0"):
            comm.timeout = bad
        assert comm.timeout == 7.0, "a refused timeout changes nothing"
    finally:
        comm.timeout = INF
    with pytest.raises(m.InvalidUsageError):
        conn.flush(timeout=bad)
    sem = comm.host_semaphore(conn, tag=100)
    with pytest.raises(m.InvalidUsageError):
        sem.wait(timeout=bad)
    with pytest.raises(ValueError):
        m.Communicator(0, 1, m.UniqueId.create(), timeout=bad)
    with pytest.raises(ValueError):
        m.Communicator.from_env(timeout=bad)


def test_zero_answers_at_once(comm, conn):
    conn.flush(timeout=0)  # nothing outstanding
    sem = comm.host_semaphore(conn, tag=11)
    with pytest.raises(m.MscclppTimeoutError):
        sem.wait(timeout=0)  # no signal yet
    sem.signal()
    conn.flush(timeout=INF)  # the signal has landed ...
    sem.wait(timeout=0)  # ... so a zero wait takes it
    assert not sem.poll()


def test_inf_means_no_limit(comm, conn):
    words = np.zeros(2, dtype=np.uint64)
    local = comm.register(words, ETH)  # kept: a dropped registration is refused as a target
    remote = comm.exchange(local, [0])[0]
    conn.update_and_sync(remote, 8, 7)
    conn.flush(timeout=INF)
    assert words[1] == 7
    sem = comm.host_semaphore(conn, tag=12)
    sem.signal()
    sem.wait(timeout=INF)
    sem.signal()
    sem.wait(timeout=math.inf)


def test_a_communicator_with_a_zero_timeout_answers_at_once():
    # One rank hosting its own root, both with a zero limit: joined, or an immediate timeout.
    try:
        c = m.Communicator(0, 1, m.UniqueId.create(), timeout=0)
    except m.MscclppTimeoutError:
        return
    assert c.timeout == 0.0
