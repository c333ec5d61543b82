"""Every allreducer against the serial reference, at the world size mpiexec
gave, for every emulated node layout that size allows."""
from __future__ import annotations

import os
import time

import numpy as np
import pytest
from mpi4py import MPI

from mpi_helpers import LAYOUT_WORLDS, REFERENCE_WORLDS, assert_all, assert_identical_bits
from reference import Reference, reproducible
from spar_comm import ALGORITHMS, make_allreducer
from spar_comm.collectives.channel import Channel, displacements
from spar_comm.collectives import shm, windows
from spar_comm.collectives.shm import (ENV_SHARED_MEMORY, BufferedReduceScatter, MessageReduceScatter,
                                       SharedAllgather, SharedReduceScatter)

COMM = MPI.COMM_WORLD
STEPS = 4


@pytest.fixture(params=["mpi", "file"])
def window(request, monkeypatch):
    """The node's windows as MPI makes them, or as files in /dev/shm (a torch.distributed group's)."""
    if request.param == "file":
        monkeypatch.setattr(shm, "open_window", windows.FileWindow)
    return request.param


def integer_grads(seed: int, step: int, p: int, n: int, dtype) -> list:
    """Every rank's gradient, known to all ranks. Multiples of 2**-6 below 2**12
    in magnitude: every sum over ranks and steps is exact in float32, so the
    reference must agree to the last bit whatever order MPI adds in. Duplicated
    magnitudes are common, which exercises the tie rule."""
    rng = np.random.default_rng([seed, step])
    return [(rng.integers(-(2**12), 2**12, n) * 2.0**-6).astype(dtype) for _ in range(p)]


@pytest.mark.openmpi
@pytest.mark.worlds(*REFERENCE_WORLDS)
@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("algorithm", reproducible())  # powersgd to rounding: test_powersgd_mpi.py
@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("n, density", [(1, 0.5), (13, 0.2), (1000, 0.01), (1037, 0.05), (300, 1.0)])
def test_matches_serial_reference(topology, algorithm, dtype, n, density):
    p, rank = COMM.size, COMM.rank
    rpn = topology.emulated_ranks_per_node
    reducer = make_allreducer(algorithm, topology, n, dtype, density=density, selector="exact")
    ref = Reference(algorithm, p, rpn, n, dtype, density)
    for step in range(STEPS):
        grads = integer_grads(n, step, p, n, dtype)
        out = reducer.allreduce(grads[rank])
        expected = ref.step(grads)
        assert_all(COMM, out.dtype == np.dtype(dtype) and out.shape == (n,), f"{out.dtype} {out.shape}")
        assert_all(COMM, np.array_equal(out, expected), f"step {step}: output differs from the reference")
        assert_all(
            COMM,
            np.array_equal(reducer.residual_full(), ref.residuals[rank]),
            f"step {step}: residual differs from the reference",
        )
        assert_identical_bits(COMM, out, "output")
    reducer.free()


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("algorithm", [name for name, cls in ALGORITHMS.items() if cls.sums])
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_conservation_on_random_gradients(topology, algorithm, dtype):
    """Applied updates plus residuals equal the raw gradients, summed over ranks
    and steps (average=False), up to rounding of the sums."""
    n, rank = 4099, COMM.rank
    reducer = make_allreducer(algorithm, topology, n, dtype, density=0.01, selector="exact", average=False)
    rng = np.random.default_rng([7, rank])
    applied = np.zeros(n, np.float64)
    raw = np.zeros(n, np.float64)
    for _ in range(STEPS):
        grad = rng.standard_normal(n).astype(dtype)
        raw += grad
        applied += reducer.allreduce(grad)
    raw_total = COMM.allreduce(raw)
    kept_total = COMM.allreduce(reducer.residual_full().astype(np.float64))
    error = np.abs(applied + kept_total - raw_total).max()
    scale = np.abs(raw_total).max()
    tolerance = (1e-5 if dtype == "float32" else 1e-12) * scale * STEPS
    assert_all(COMM, error <= tolerance, f"conservation error {error:.3g} > {tolerance:.3g}")
    assert_identical_bits(COMM, applied, "applied updates")


@pytest.mark.worlds(*REFERENCE_WORLDS)
@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("algorithm", ["topka", "gtopk", "hitopk", "hitopk_leader"])
def test_without_error_feedback_nothing_is_kept(topology, algorithm):
    n, p, rank = 500, COMM.size, COMM.rank
    reducer = make_allreducer(algorithm, topology, n, "float64", 0.05, selector="exact", error_feedback=False)
    ref = Reference(algorithm, p, topology.emulated_ranks_per_node, n, "float64", 0.05, error_feedback=False)
    for step in range(3):
        grads = integer_grads(99, step, p, n, "float64")
        out = reducer.allreduce(grads[rank])
        in_place = grads[rank].copy()  # selection reads the gradient itself here: out= must not spoil it
        reducer.allreduce(in_place, out=in_place)
        expected = ref.step(grads)
        assert_all(COMM, np.array_equal(out, expected), f"step {step}: output differs")
        assert_all(COMM, np.array_equal(in_place, expected), f"step {step}: in place differs")
    assert_all(COMM, not reducer.residual_full().any(), "a residual was kept without error feedback")


@pytest.mark.worlds(1, *LAYOUT_WORLDS)
@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("algorithm", list(ALGORITHMS))
def test_accounting(topology, algorithm):
    """``.last`` holds every figure; bytes follow the ring model's sign rules."""
    n = 2048
    reducer = make_allreducer(algorithm, topology, n, "float32", density=0.01, selector="exact")
    reducer.allreduce(np.ones(n, np.float32) * (COMM.rank + 1))
    last = reducer.last
    keys = {"k", "bytes_intra", "bytes_inter", "t_select", "t_intra", "t_inter", "threshold"}
    assert_all(COMM, keys <= set(last), f"missing {keys - set(last)}")
    assert_all(COMM, all(last[key] >= 0 for key in keys), f"negative figure in {last}")
    if topology.num_nodes == 1:
        assert_all(COMM, last["bytes_inter"] == 0, f"inter-node bytes on one node: {last}")
    if COMM.size == 1:
        assert_all(COMM, last["bytes_intra"] == 0, f"bytes sent by a lone rank: {last}")
    if algorithm == "dense" and COMM.size > 1:
        expected = 2 * (COMM.size - 1) * n * 4 // COMM.size
        key = "bytes_inter" if topology.num_nodes > 1 else "bytes_intra"
        assert_all(COMM, last[key] == expected, f"dense sent {last[key]}, ring model says {expected}")
    if algorithm == "gtopk":  # every rank but the root sends its k pairs up, and the broadcast forwards them
        sent = COMM.allreduce(last["bytes_inter"] + last["bytes_intra"])
        expected = 2 * (COMM.size - 1) * reducer.layout.nbytes
        assert_all(COMM, sent == expected, f"gtopk sent {sent} in all, a binomial tree both ways {expected}")


@pytest.mark.worlds(*REFERENCE_WORLDS)
@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("algorithm", ["hier_dense", "hitopk"])
def test_message_passing_reduce_scatter_matches_too(topology, algorithm, monkeypatch):
    """With SPAR_COMM_SHM=0 the node's Reduce_scatter is MPI's own; same bits."""
    monkeypatch.setenv(ENV_SHARED_MEMORY, "0")
    p, rank, n = COMM.size, COMM.rank, 1037
    reducer = make_allreducer(algorithm, topology, n, "float32", density=0.05, selector="exact")
    assert_all(COMM, isinstance(reducer.reduce_scatter, MessageReduceScatter), type(reducer.reduce_scatter).__name__)
    ref = Reference(algorithm, p, topology.emulated_ranks_per_node, n, "float32", 0.05)
    for step in range(3):
        grads = integer_grads(5, step, p, n, "float32")
        assert_all(COMM, np.array_equal(reducer.allreduce(grads[rank]), ref.step(grads)), f"step {step}")


@pytest.mark.openmpi
@pytest.mark.worlds(*REFERENCE_WORLDS)
@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("algorithm", reproducible())
def test_gradient_assembled_in_the_shared_buffer(topology, algorithm):
    """``shared_buffer=True``: a gradient written into ``.buffer`` (and reduced in
    place there on even ranks) gives the reference's bits; odd ranks pass an
    array of their own, which must mix with the others' in-place buffers. A new
    buffer holds zeros; after ``free()`` the allreducer still works."""
    p, rank, n = COMM.size, COMM.rank, 1037
    reducer = make_allreducer(algorithm, topology, n, "float32", density=0.05, selector="exact", shared_buffer=True)
    ref = Reference(algorithm, p, topology.emulated_ranks_per_node, n, "float32", 0.05)
    node_shares = topology.local_size > 1 and topology.local_shares_memory and os.environ.get(ENV_SHARED_MEMORY) != "0"
    buffered = isinstance(reducer.reduce_scatter, BufferedReduceScatter)
    in_place = ("hier_dense", "hitopk", "adasum")
    assert_all(COMM, buffered == (node_shares and algorithm in in_place), f"buffered: {buffered}")
    assert_all(COMM, not reducer.buffer.any(), "a new buffer is not all zeros")
    for step in range(4):
        if step == 3:  # after free(): MPI's Reduce_scatter, and a plain buffer
            old = reducer.buffer
            reducer.free()
            released = not isinstance(reducer.reduce_scatter, BufferedReduceScatter)
            assert_all(COMM, released and (reducer.buffer is not old or not buffered), "free() kept the window")
        grads = integer_grads(7, step, p, n, "float32")
        if rank % 2 == 0:
            reducer.buffer[...] = grads[rank]
            out = reducer.allreduce(reducer.buffer, out=reducer.buffer)
        else:
            out = reducer.allreduce(grads[rank].copy())
        expected = ref.step(grads)
        assert_all(COMM, np.array_equal(out, expected), f"step {step}: differs from the reference")
        assert_all(COMM, np.array_equal(reducer.residual_full(), ref.residuals[rank]), f"step {step}: residual")
    reducer.free()


@pytest.mark.openmpi
@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("n", [1, 5, 999, 10_007])
def test_shared_memory_reduce_scatter_in_several_rounds(topology, window, dtype, n):
    """A small window forces many rounds; the result must equal MPI's Reduce_scatter."""
    ledger = {"t_intra": 0.0, "bytes_intra": 0, "bytes_staged": 0}
    channel = Channel(topology.local, "intra", ledger)
    counts = topology.local_shard_counts(n)
    shared = SharedReduceScatter(channel, counts, np.dtype(dtype), slot_bytes=64 * 8)
    grad = integer_grads(n, 0, COMM.size, n, dtype)[COMM.rank]
    mine, theirs = (np.full(counts[topology.local_rank], np.nan, dtype) for _ in range(2))
    for _ in range(2):  # the window is reused from call to call
        shared(grad, mine)
    channel.reduce_scatter(grad, theirs, counts)
    residual = np.arange(theirs.size, dtype=dtype) / 4
    expected = residual + theirs
    shared(grad, residual, accumulate=True)
    shared.free()
    assert_all(COMM, np.array_equal(mine, theirs), "shared-memory Reduce_scatter differs from MPI's")
    assert_all(COMM, np.array_equal(residual, expected), "accumulate=True did not add the sum to recv")
    booked = 4 * ((topology.local_size - 1) * grad.nbytes // topology.local_size)  # four calls
    assert_all(COMM, ledger["bytes_intra"] == booked, f"bytes booked: {ledger}, expected {booked}")


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("slot_bytes", [64 * 8, None], ids=["rounds", "one round"])
def test_summed_gets_every_ranks_part_of_the_shard_in_rank_order_or_is_refused(topology, window, slot_bytes):
    """``summed=`` (hitopk's candidate pass riding on the node's sum) is handed
    every local rank's part of this rank's shard, in rank order, where the
    shard comes in one round; where it takes several, it is refused alike on
    every rank, before anything is sent."""
    ledger = {"t_intra": 0.0, "bytes_intra": 0, "bytes_staged": 0}
    channel = Channel(topology.local, "intra", ledger)
    n, dtype = 10_007, np.dtype("float32")
    counts = topology.local_shard_counts(n)
    shared = SharedReduceScatter(channel, counts, dtype, **({} if slot_bytes is None else {"slot_bytes": slot_bytes}))
    grads = [np.random.default_rng([5, r]).standard_normal(n).astype(dtype) for r in range(topology.local_size)]
    first = displacements(counts)[topology.local_rank]
    mine = slice(first, first + counts[topology.local_rank])
    if not shared.sums_whole:
        with pytest.raises(ValueError, match="one round"):
            shared(grads[topology.local_rank], np.empty(0, dtype), summed=lambda parts: None)
    else:
        handed = []
        shared(grads[topology.local_rank], np.empty(0, dtype), summed=lambda parts: handed.append(
            [part.copy() for part in parts]))  # copies: the slots are the node's to reuse
        assert_all(COMM, len(handed) == 1 and len(handed[0]) == topology.local_size and all(
            part.tobytes() == grad[mine].tobytes() for part, grad in zip(handed[0], grads)),
            "summed was not handed every rank's part of this rank's shard in rank order")
    shared.free()
    assert_all(COMM, shared.sums_whole == (slot_bytes is None), f"{shared.rounds} rounds, sums_whole {shared.sums_whole}")


@pytest.mark.openmpi
@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("make", [
    lambda channel, counts, dtype: SharedReduceScatter(channel, counts, dtype, slot_bytes=64 * 4),
    BufferedReduceScatter,
], ids=["slots", "buffer"])
def test_a_slow_owner_reads_its_pieces_before_they_are_overwritten(topology, window, monkeypatch, make):
    """Slots: one fence per round, so a slot half is written again only after
    the next fence. Buffer: the Allgather's fence ends the reads of the
    buffers, and each rank writes its buffer (here the result goes there, as
    ``out=buffer`` does) only after it. Allgather: a region is written again
    only after the next Reduce_scatter's fence. A slow rank (local rank 0
    sleeps before every sum and every copy) must still read every piece
    intact while the others run ahead."""
    if not COMM.allreduce(topology.local_size > 1 and topology.local_shares_memory, op=MPI.LAND):  # on all alike
        pytest.skip("needs two ranks sharing memory on every node")
    ledger = {"t_intra": 0.0, "bytes_intra": 0, "bytes_staged": 0}
    channel = Channel(topology.local, "intra", ledger)
    n, dtype = 999, "float32"
    counts = topology.local_shard_counts(n)
    shared = make(channel, counts, np.dtype(dtype))
    gather = SharedAllgather(channel, counts, np.dtype(dtype))
    if topology.local_rank == 0:
        summing, copying = shm.sum_parts, SharedAllgather.__call__
        monkeypatch.setattr(shm, "sum_parts", lambda *args: (time.sleep(0.002), summing(*args)))
        monkeypatch.setattr(SharedAllgather, "__call__", lambda *args: (time.sleep(0.002), copying(*args)))
    members = topology.local.allgather(COMM.rank)  # the node's ranks, in local order
    lo = sum(counts[: topology.local_rank])
    shard = slice(lo, lo + counts[topology.local_rank])
    results = []
    for step in range(3):  # no other MPI call between steps: a fast rank runs straight on
        grads = integer_grads(n, step, COMM.size, n, dtype)
        send = grads[COMM.rank]
        if shared.buffer is not None:  # assembled in place, as a training loop would
            shared.buffer[...] = send
            send = shared.buffer
        shared(send, gather.region)
        expected = np.sum([grads[r] for r in members], axis=0, dtype=dtype)
        results.append(np.array_equal(gather.region, expected[shard]))
        out = send if shared.buffer is not None else np.empty(n, dtype)
        gather(out)
        results.append(np.array_equal(out, expected))
    shared.free()
    gather.free()
    rounds = getattr(shared, "rounds", 1)
    assert_all(COMM, all(results), f"shards, then results, equal to the sums: {results} ({rounds} rounds)")


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("algorithm", list(ALGORITHMS))
def test_out_parameter_and_in_place(topology, algorithm):
    """``out=grad`` (in place) and ``out=buffer`` give the bits of a new array."""
    n, rank = 1037, COMM.rank
    fresh, into, in_place = (
        make_allreducer(algorithm, topology, n, "float32", density=0.05, selector="exact") for _ in range(3)
    )
    buffer = np.full(n, 7.0, np.float32)
    for step in range(3):
        grad = integer_grads(n, step, COMM.size, n, "float32")[rank]
        expected = fresh.allreduce(grad)
        assert_all(COMM, into.allreduce(grad, out=buffer) is buffer, "out= was not returned")
        overwritten = grad.copy()
        assert_all(COMM, in_place.allreduce(overwritten, out=overwritten) is overwritten, "out=grad not returned")
        assert_all(COMM, np.array_equal(buffer, expected) and np.array_equal(overwritten, expected),
                   f"step {step}: out= differs from a new array")
    for reducer in (fresh, into, in_place):
        reducer.free()


def test_broadcast_bytes_follow_mpichs_two_schedules():
    from spar_comm.collectives.channel import BCAST_SHORT, bcast_bytes, binomial_children

    # 0 sends to 1, 2, 4, 8; 2 to 3; 4 to 5, 6; 6 to 7; 8 to 9, 10, 12; 10 to 11; 12 to 13, 14; 14 to 15
    assert [len(binomial_children(r, 0, 16)) for r in range(16)] == [4, 0, 1, 0, 2, 0, 1, 0, 3, 0, 1, 0, 2, 0, 1, 0]
    for size in range(1, 40):
        for root in (0, size // 2, size - 1):
            short = [bcast_bytes(r, root, size, 100) for r in range(size)]
            assert sum(short) == (size - 1) * 100 and short[root] == (size - 1).bit_length() * 100
    # long, 8 ranks: the scatter sends 12 blocks of n/8 in all (the root 4 + 2 + 1), the ring 7 from every rank
    n = 8 * BCAST_SHORT
    assert bcast_bytes(0, 0, 8, n) == (7 + 7) * n // 8 and bcast_bytes(4, 0, 8, n) == (3 + 7) * n // 8
    assert sum(bcast_bytes(r, 0, 8, n) for r in range(8)) == (12 + 8 * 7) * n // 8
    assert bcast_bytes(0, 0, 7, n) == 3 * n  # fewer than 8 ranks: the tree
