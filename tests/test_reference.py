"""The serial reference's own shortcut against its definition: the top k by
the k-th largest magnitude picks what a stable sort picks, ties included."""
from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from reference import sorted_top_positions, top_positions

#: Few distinct magnitudes, both signs, zeros and the odd infinity or NaN: ties everywhere.
VALUES = st.sampled_from([0.0, -0.0, 1.0, -1.0, 2.5, -2.5, 3.0, 1e-30, -1e30, np.inf, -np.inf, np.nan])


@settings(max_examples=300, deadline=None)
@given(values=st.lists(VALUES, min_size=1, max_size=60), k=st.integers(1, 70),
       dtype=st.sampled_from(["float16", "float32", "float64"]))
def test_the_k_th_magnitude_picks_what_a_stable_sort_picks(values, k, dtype):
    with np.errstate(over="ignore"):  # -1e30 is -inf in float16
        a = np.array(values, dtype=dtype)
    assert np.array_equal(top_positions(a, k), sorted_top_positions(a, k))


def test_ties_go_to_the_lowest_positions():
    assert top_positions(np.array([1.0, -2.0, 2.0, 1.0, -1.0]), 3).tolist() == [0, 1, 2]
