"""Residuals carried to another world (redistribute.py), against a serial
model: the new ranks' total is the saved ranks' total, bit for bit, and each
position goes to exactly one new rank that covers it."""
from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from spar_comm.redistribute import kept_by, lost, redistributed, total_over, uncovered


def spans_of(size: int, node_sizes: list, sharded: bool) -> list:
    """Every rank's span: a shard of the node's vector by its place in the node
    (as hitopk keeps it), or the whole vector (as topka keeps it)."""
    spans = []
    for node in node_sizes:
        for place in range(node):
            spans.append((size * place // node, size * (place + 1) // node) if sharded else (0, size))
    return spans


layouts = st.lists(st.integers(1, 3), min_size=1, max_size=4)


@settings(max_examples=200, deadline=None)
@given(size=st.integers(1, 200), before=layouts, after=layouts, sharded_before=st.booleans(),
       sharded_after=st.booleans(), seed=st.integers(0, 2**32 - 1))
def test_the_total_is_kept_and_each_position_has_one_owner(size, before, after, sharded_before, sharded_after, seed):
    rng = np.random.default_rng(seed)
    saved = spans_of(size, before, sharded_before)
    values = [rng.standard_normal(hi - lo).astype(np.float32) for lo, hi in saved]
    reference = np.zeros(size, np.float32)  # the serial model: every saved residual added in rank order
    for (lo, hi), v in zip(saved, values):
        reference[lo:hi] += v
    spans = spans_of(size, after, sharded_after)
    total, owners = np.zeros(size, np.float32), np.zeros(size, int)
    for rank, (lo, hi) in enumerate(spans):
        mine = redistributed(rank, spans, saved, values.__getitem__, np.dtype(np.float32))
        assert mine.shape == (hi - lo,) and mine.dtype == np.float32
        total[lo:hi] += mine  # at most one nonzero term a position: exact
        owners[lo:hi] += kept_by(rank, spans)
    assert total.tobytes() == reference.tobytes()
    assert (owners == 1).all()


def test_the_same_partition_gives_every_rank_its_own_residual_back():
    saved = spans_of(10, [3], sharded=True)
    values = [np.arange(lo, hi, dtype=np.float32) + 0.5 for lo, hi in saved]
    for rank, v in enumerate(values):
        assert redistributed(rank, saved, saved, values.__getitem__, np.dtype(np.float32)).tobytes() == v.tobytes()


def test_whole_vectors_spread_by_position_and_only_overlapping_parts_are_read():
    read = []

    def part(rank: int) -> np.ndarray:
        read.append(rank)
        return np.full(4, rank + 1.0, np.float32)

    saved = [(0, 4), (4, 8)]
    assert total_over((0, 4), saved, part, np.dtype(np.float32)).tolist() == [1.0] * 4 and read == [0]
    whole = [(0, 8), (0, 8)]
    assert kept_by(0, whole).tolist() == [True, False] * 4 and kept_by(1, whole).tolist() == [False, True] * 4


def test_uncovered_ranges():
    assert uncovered([(0, 0), (0, 0)], 5) == [(0, 5)]
    assert uncovered([(2, 4), (0, 3)], 6) == [(4, 6)]
    assert uncovered([(0, 6)], 6) == []
    assert uncovered([(1, 2), (4, 5)], 6) == [(0, 1), (2, 4), (5, 6)]


def test_lost_ranges_are_the_uncovered_ones_that_hold_values():
    saved = [(0, 3), (3, 6)]
    values = {0: np.array([0.0, 0.0, 1.0], np.float32), 1: np.zeros(3, np.float32)}
    assert lost([(2, 3)], 6, saved, values.__getitem__, np.dtype(np.float32)) == []  # (0, 2) and (3, 6) hold zeros
    assert lost([(0, 1), (4, 6)], 6, saved, values.__getitem__, np.dtype(np.float32)) == [(1, 4)]
