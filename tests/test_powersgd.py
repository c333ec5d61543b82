"""PowerSGD's plan of a bucket (spar_comm/collectives/powersgd.py) and the
training settings that choose it, without MPI."""
from __future__ import annotations

import pytest

from spar_comm.collectives.powersgd import as_matrix, plan, square_ish
from spar_comm.training.config import TrainConfig


def test_tensors_become_matrices_and_vectors_stay_dense():
    assert as_matrix((64, 3, 3, 3)) == (64, 27) and as_matrix((10,)) is None
    matrices, dense = plan(64 * 27 + 10 + 6 * 6 + 3 * 3, 2, [(64, 3, 3, 3), (10,), (6, 6), (3, 3)])
    assert matrices == [(0, 64, 27), (1738, 6, 6)]  # rank 2: 2 x (64 + 27) values instead of 1,728; 24 for 36
    assert dense == [(1728, 10), (1774, 9)]  # the vector, and a 3 x 3 that rank 2 would not make smaller (12 for 9)


@pytest.mark.parametrize("n, shape", [(1200, (30, 40)), (97, (1, 97)), (4096, (64, 64))])
def test_without_shapes_the_vector_is_one_matrix_as_square_as_it_divides(n, shape):
    assert square_ish(n) == shape
    matrices, dense = plan(n, 1, None)
    assert (matrices, dense) == (([(0, *shape)], []) if sum(shape) < n else ([], [(0, n)]))


@pytest.mark.parametrize("changes, words", [
    (dict(algorithm="powersgd", rank=0), "--rank must be >= 1, got 0"),
    (dict(algorithm="hitopk", rank=4), "--rank applies to --algorithm powersgd, not to --algorithm hitopk"),
])
def test_bad_rank_settings_are_named(changes, words):
    assert words in "; ".join(TrainConfig(**changes).problems())
