"""Which form of a collective a rank calls: nonblocking up to the size limit,
blocking past it, and the same on every rank whatever its own share; and the
deadline every wait has."""
from __future__ import annotations

import os
import signal
import threading
import time

import numpy as np
import pytest

from spar_comm import waiting
from spar_comm.collectives.channel import Channel
from spar_comm.memory import SimulatedGpuMemory

pytestmark = pytest.mark.alone  # it times deadlines


class Done:
    """A request that is complete."""

    def Test(self) -> bool:
        return True

    def Wait(self) -> None:
        pass


class Recorder:
    """A communicator of ``size`` ranks seen from ``rank`` that records which MPI calls are made."""

    def __init__(self, rank: int, size: int):
        self.rank, self.size, self.calls = rank, size, []

    def __getattr__(self, name: str):
        def call(*args, **kwargs):
            self.calls.append(name)
            return Done() if name.startswith("I") else None
        return call


@pytest.mark.parametrize("name", ["Barrier", "Allgather", "Allgatherv", "Allreduce", "Reduce_scatter", "Bcast"])
def test_small_goes_nonblocking_and_large_blocking(name):
    comm = Recorder(0, 2)
    waiting.collective(comm, name, nbytes=waiting.SMALL_BYTES)
    waiting.collective(comm, name, nbytes=waiting.SMALL_BYTES + 1)
    assert comm.calls == ["I" + name.lower(), name]


def channel_calls(rank: int, size: int, elements: int) -> list:
    """The MPI calls rank ``rank`` of ``size`` makes for one of each collective,
    its own share of the unequal ones depending on its rank."""
    comm = Recorder(rank, size)
    channel = Channel(comm, "intra", {"t_intra": 0.0, "bytes_intra": 0})
    counts = [elements * (r + 1) for r in range(size)]  # unequal blocks
    channel.allreduce(np.zeros(elements, np.float32))
    channel.allgather(np.zeros(elements, np.float32), np.zeros(size * elements, np.float32))
    channel.reduce_scatter(np.zeros(sum(counts), np.float32), np.zeros(counts[rank], np.float32), counts)
    channel.allgatherv(np.zeros(counts[rank], np.float32), np.zeros(sum(counts), np.float32), counts)
    channel.alltoall(np.zeros(size * elements, np.float32), np.zeros(size * elements, np.float32))
    channel.bcast(np.zeros(elements, np.float32), root=size - 1)
    channel.reduce(np.zeros(elements, np.float32), np.zeros(elements, np.float32) if rank == 0 else None)
    return comm.calls


@pytest.mark.parametrize("elements", [1, 1000, waiting.SMALL_BYTES // 16, waiting.SMALL_BYTES // 4])
def test_every_rank_of_a_channel_chooses_alike(elements):
    """MPI never matches a blocking collective with a nonblocking one."""
    size = 5
    calls = [channel_calls(rank, size, elements) for rank in range(size)]
    assert all(c == calls[0] for c in calls), calls
    assert len(calls[0]) == 7


def test_the_limit_is_where_the_docstring_says():
    small = channel_calls(0, 2, waiting.SMALL_BYTES // 4)  # float32: exactly the limit a rank
    large = channel_calls(0, 2, waiting.SMALL_BYTES // 4 + 1)
    assert small[:2] == ["Iallreduce", "Iallgather"] and large[:2] == ["Allreduce", "Allgather"]


@pytest.mark.parametrize("cuda_aware, first", [(False, "Iallreduce"), (True, "Allreduce")])
def test_device_buffers_in_place_wait_in_mpi(cuda_aware, first):
    """MPI reads device memory in place only where it is CUDA-aware, and then
    moves the bytes only while it is polled: the blocking call, however small.
    Staged through host buffers, a small collective sleeps as on the host."""
    comm = Recorder(0, 2)
    channel = Channel(comm, "intra", {"t_intra": 0.0, "bytes_intra": 0}, SimulatedGpuMemory(cuda_aware=cuda_aware))
    channel.allreduce(np.zeros(4, np.float32))
    assert comm.calls == [first]


def test_read_environment(monkeypatch):
    monkeypatch.setattr(waiting, "SLEEP", True)
    monkeypatch.setenv(waiting.ENV_WAIT, "spin")
    assert waiting.read_environment() is None and waiting.SLEEP is False
    monkeypatch.setenv(waiting.ENV_WAIT, " sleep ")
    assert waiting.read_environment() is None and waiting.SLEEP is True
    monkeypatch.setenv(waiting.ENV_WAIT, "yield")
    assert waiting.read_environment() == "SPAR_COMM_WAIT='yield': expected 'sleep' or 'spin'"
    assert waiting.SLEEP is True  # unchanged by a bad value


@pytest.mark.parametrize("text, seconds", [("", 600.0), (" 5 ", 5.0), ("0.5", 0.5), ("0", None)])
def test_the_timeout_is_read_from_the_environment(monkeypatch, text, seconds):
    monkeypatch.setattr(waiting, "TIMEOUT", 1.0)
    monkeypatch.setenv(waiting.ENV_WAIT, "sleep")
    monkeypatch.setenv(waiting.ENV_TIMEOUT, text)
    assert waiting.read_environment() is None and waiting.TIMEOUT == seconds


@pytest.mark.parametrize("text", ["ten", "-1", "nan", "inf", "1e999"])
def test_a_bad_timeout_is_refused_naming_it(monkeypatch, text):
    monkeypatch.setattr(waiting, "TIMEOUT", 1.0)
    monkeypatch.setenv(waiting.ENV_WAIT, "sleep")
    monkeypatch.setenv(waiting.ENV_TIMEOUT, text)
    assert waiting.read_environment() == (f"SPAR_COMM_TIMEOUT={text!r}: expected seconds, a number > 0 "
                                          "(0: no deadline)")
    assert waiting.TIMEOUT == 1.0  # unchanged by a bad value


class Named(Recorder):
    """A communicator as ``Topology`` names them."""

    def Get_name(self) -> str:
        return "between nodes"


class Endings(list):
    """(message, status, when) of each ending, and ``done``, set at the first."""

    def __init__(self):
        super().__init__()
        self.done = threading.Event()


@pytest.fixture
def endings(monkeypatch):
    """What the watchdog ends the job with, recorded instead."""
    seen = Endings()

    def end_job(message: str, status: int, comm=None) -> None:
        seen.append((message, status, time.monotonic()))
        seen.done.set()
        threading.Event().wait(1)  # as the real one, it does not return at once

    monkeypatch.setattr(waiting, "end_job", end_job)
    monkeypatch.setattr(waiting, "TIMEOUT", 0.6)
    return seen


def test_a_wait_past_its_deadline_ends_the_job_naming_it(endings, capfd):
    start = time.monotonic()
    with waiting.watched("Allgather", Named(0, 2)):
        assert endings.done.wait(5), "the deadline passed unnoticed"
    message, status, when = endings[0]
    assert status == waiting.EXIT_TIMEOUT
    assert message.startswith("spar_comm: no answer past the deadline (SPAR_COMM_TIMEOUT=0.6): "
                              "Allgather over between nodes (2 ranks), waiting 0.")
    assert 0.6 <= when - start < 0.6 + 2 * waiting.TICK
    assert "still waiting, half-way to the deadline: Allgather over between nodes (2 ranks)" in capfd.readouterr().err


def test_nested_waits_keep_the_outer_deadline_and_patience_extends_it(endings):
    with waiting.watched("saving a checkpoint", Named(0, 2), patient=True):
        with waiting.watched("Barrier", Named(0, 2)):
            time.sleep(0.6 + 3 * waiting.TICK)
    assert endings == []
    with waiting.watched("Barrier", Named(0, 2)):
        pass
    time.sleep(0.6 + 2 * waiting.TICK)  # nothing is waited for any more
    assert endings == []


def test_a_signal_ends_a_wait_that_goes_on_after_it(endings, monkeypatch):
    monkeypatch.setattr(waiting, "TIMEOUT", 60.0)
    monkeypatch.setattr(waiting, "SIGNAL_GRACE_S", 0.3)
    held = signal.signal(signal.SIGUSR1, lambda *_: None)  # as train()'s clean stop: a Python handler
    try:
        with waiting.watched("Allreduce", Named(0, 2)):
            os.kill(os.getpid(), signal.SIGUSR1)
            assert endings.done.wait(5), "the signal went unnoticed"
    finally:
        signal.signal(signal.SIGUSR1, held)
    message, status, _ = endings[0]
    assert status == 128 + signal.SIGUSR1
    assert message.startswith("spar_comm: SIGUSR1 while stuck: Allreduce over between nodes (2 ranks)")


class Pending:
    """A request that completes at its ``tests``-th test."""

    def __init__(self, tests: int):
        self.left = tests

    def Test(self) -> bool:
        self.left -= 1
        return self.left == 0


@pytest.mark.parametrize("size, longest", [(1, 2e-4), (2, 2e-4), (3, 1e-4), (4, 1e-4), (5, 2e-4 / 3),
                                           (128, 2e-4 / 7), (129, 2e-4 / 8), (1 << 30, 1e-5)])
def test_the_pauses_double_up_to_the_maximum_shared_by_the_rounds(monkeypatch, size, longest):
    """MPI moves a small collective on in about log2(size) rounds, each in a
    rank's own MPI call: a wait sleeps at most MAX_PAUSE over all of them."""
    assert waiting.longest_pause(size) == pytest.approx(longest)
    pauses = []
    monkeypatch.setattr(waiting, "time", type("Clock", (), {"sleep": staticmethod(pauses.append)}))
    monkeypatch.setattr(waiting, "TIMEOUT", None)  # no watchdog: its clock is not this test's
    monkeypatch.setattr(waiting, "SLEEP", True)
    comm = Recorder(0, size)
    comm.Ibarrier = lambda: Pending(16)
    waiting.collective(comm, "Barrier")
    assert len(pauses) == 15
    assert pauses == pytest.approx([min(waiting.FIRST_PAUSE * 2 ** i, longest) for i in range(15)])


def test_sleeping_sets_the_way_inside_its_block_only(monkeypatch):
    monkeypatch.setattr(waiting, "SLEEP", True)
    with waiting.sleeping(False):
        assert waiting.SLEEP is False
    assert waiting.SLEEP is True
    with pytest.raises(RuntimeError):
        with waiting.sleeping(False):
            raise RuntimeError("a failing step")
    assert waiting.SLEEP is True  # restored after an error too


def test_deadlines_off_inside_its_block_only(endings):
    """A wait past the deadline inside ``deadlines(False)`` ends nothing; the
    same wait after the block does."""
    with waiting.deadlines(False):
        with waiting.watched("Allgather", Named(0, 2)):
            time.sleep(0.6 + 3 * waiting.TICK)
    assert endings == [] and waiting.TIMEOUT == 0.6
    with waiting.watched("Allgather", Named(0, 2)):
        assert endings.done.wait(5), "the deadline passed unnoticed after the block"
