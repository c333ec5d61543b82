"""``sum_parts``: the chunked sum behind the node's Reduce_scatter gives the bits
of summing whole arrays in order, whatever the chunk boundaries."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from spar_comm.collectives import shm


@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(0, 300),
    parts=st.integers(1, 5),
    chunk=st.integers(1, 64),
    accumulate=st.booleans(),
    dtype=st.sampled_from(["float32", "float64"]),
    seed=st.integers(0, 2**16),
)
def test_sum_parts_equals_the_sum_in_order(n, parts, chunk, accumulate, dtype, seed):
    rng = np.random.default_rng(seed)
    arrays = [(rng.standard_normal(n) * 10.0 ** rng.integers(-3, 4)).astype(dtype) for _ in range(parts)]
    start = rng.standard_normal(n).astype(dtype)
    expected = arrays[0].copy()
    for part in arrays[1:]:
        expected += part
    if accumulate:
        expected = start + expected
    out = start.copy()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(shm, "SUM_CHUNK", chunk)
        shm.sum_parts(arrays, out, accumulate)
    assert out.tobytes() == expected.tobytes()
