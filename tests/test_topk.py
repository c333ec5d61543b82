"""Top-k selectors (docs/design.md, Selection): the contract, MSTopK's robustness, bad input.

Sizes stay small except where a test must exercise the sampled candidate pass
(more than ``4 * SAMPLE`` entries); no test asserts a time.
"""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from spar_comm.kernels import SELECTORS, add_and_select, make_selector, topk
from spar_comm.kernels.magnitude import SAMPLE
from spar_comm.kernels.selection import exact_topk

METHODS = sorted(SELECTORS)
EXACT = [m for m in METHODS if SELECTORS[m]]
FLOATS = [np.float16, np.float32, np.float64]
LARGE = 4 * SAMPLE + 12345  # above this the sampled candidate pass runs


def contract_set(x: np.ndarray, k: int) -> np.ndarray:
    """The contract's set written out independently: sort by (magnitude desc, position)."""
    a = np.abs(x.astype(np.float64)) if x.dtype.kind == "f" else np.abs(x.astype(object))
    if x.dtype.kind == "f":
        a = np.where(np.isnan(a), np.inf, a)  # rank NaN above ...
        rank = np.where(np.isnan(x), 2, np.where(np.isinf(x), 1, 0))  # ... Inf, above numbers
        order = np.lexsort((np.arange(x.size), -a, -rank))
    else:
        order = sorted(range(x.size), key=lambda i: (-a[i], i))
    return np.sort(np.asarray(order[:k], dtype=np.int64))


def check_shape(idx: np.ndarray, n: int, k: int) -> None:
    assert idx.dtype == np.int64 and idx.ndim == 1
    assert idx.size == min(k, n)
    assert np.all(np.diff(idx) > 0), "unique and ascending"
    assert idx.size == 0 or (idx[0] >= 0 and idx[-1] < n)


def recall(got: np.ndarray, want: np.ndarray) -> float:
    return np.intersect1d(got, want).size / want.size


arrays = st.sampled_from(FLOATS + [np.int16, np.int64, np.uint8]).flatmap(
    lambda dt: hnp.arrays(dt, st.integers(1, 300), elements=hnp.from_dtype(np.dtype(dt), allow_nan=True))
)


@settings(max_examples=150, deadline=None)
@given(x=arrays, k=st.integers(1, 320), method=st.sampled_from(METHODS))
def test_every_method_returns_the_contract_set(x, k, method):
    idx = topk(x, k, method)
    check_shape(idx, x.size, k)
    if SELECTORS[method]:
        np.testing.assert_array_equal(idx, contract_set(x, k))


@settings(max_examples=40, deadline=None)
@given(
    x=hnp.arrays(np.float32, st.integers(1, 2000), elements=st.floats(-4, 4, width=32)),
    k=st.integers(1, 100),
)
def test_no_unselected_magnitude_exceeds_a_selected_one(x, k):
    for method in EXACT:
        idx = topk(x, k, method)
        rest = np.ones(x.size, dtype=bool)
        rest[idx] = False
        if rest.any():
            assert np.abs(x[rest]).max() <= np.abs(x[idx]).min()


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("density", [0.001, 0.01, 0.2])
def test_large_inputs_take_the_sampled_path_and_stay_exact(dtype, density):
    x = np.random.default_rng(3).standard_normal(LARGE).astype(dtype)
    k = max(1, int(density * x.size))
    want = exact_topk(x, k)
    for method in EXACT:
        np.testing.assert_array_equal(topk(x, k, method), want)


def test_a_fooled_sample_falls_back_to_the_exact_set():
    """Large entries exactly where the strided sample never looks."""
    n = LARGE
    x = np.zeros(n, dtype=np.float32)
    step = n // SAMPLE
    off = np.arange(n)[np.arange(n) % step != 0]
    x[off[::97]] = np.arange(1, off[::97].size + 1, dtype=np.float32)
    k = 300
    for method in EXACT:
        np.testing.assert_array_equal(topk(x, k, method), contract_set(x, k))


@pytest.mark.parametrize("heavy", [False, True])
def test_mstopk_recall_against_exact(heavy):
    rng = np.random.default_rng(7)
    x = (rng.standard_cauchy(LARGE) if heavy else rng.standard_normal(LARGE)).astype(np.float32)
    for k in (LARGE // 1000, LARGE // 100):
        assert recall(topk(x, k, "mstopk"), exact_topk(x, k)) >= 0.99
    # few bisection steps leave a wide band, which the magnitude fill still resolves
    assert recall(topk(x, LARGE // 1000, "mstopk", N=3), exact_topk(x, LARGE // 1000)) == 1.0


@pytest.mark.slow
@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize(
    "case",
    ["zeros", "all_equal", "tied_max", "two_levels", "nan_inf", "n1"],
)
def test_degenerate_inputs(method, dtype, case):
    n = 1 if case == "n1" else LARGE if dtype == np.float32 else 1000
    x = {
        "zeros": lambda: np.zeros(n),
        "all_equal": lambda: np.full(n, -2.5),
        "tied_max": lambda: np.r_[np.full(50, 9.0), np.random.default_rng(0).uniform(-1, 1, n - 50)],
        "two_levels": lambda: np.where(np.arange(n) % 3 == 0, 1.0, -0.5),
        "nan_inf": lambda: np.r_[np.random.default_rng(1).standard_normal(n - 6), [np.nan, np.inf, -np.nan, -np.inf, 6e4, -0.0]],
        "n1": lambda: np.array([-3.0]),
    }[case]().astype(dtype)
    for k in (1, 7, n // 10 + 1, n - 1, n, n + 3):
        if k < 1:
            continue
        idx = topk(x, k, method)
        check_shape(idx, n, k)
        if SELECTORS[method]:
            np.testing.assert_array_equal(idx, contract_set(x, k))


def test_nan_and_inf_are_selected_first():
    x = np.array([0.5, np.nan, -np.inf, 3.0, -np.nan, np.inf, -7.0], dtype=np.float32)
    for method in METHODS:
        np.testing.assert_array_equal(topk(x, 2, method), [1, 4])  # NaNs, lowest first
        np.testing.assert_array_equal(topk(x, 3, method), [1, 2, 4])  # then the first Inf
        np.testing.assert_array_equal(topk(x, 5, method), [1, 2, 4, 5, 6])


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("k", [1, 100, 1000])
def test_nans_of_every_payload_tie_on_the_sampled_path(dtype, k):
    """A NaN's payload and sign are no part of its rank: the floor a sample of
    NaNs gives must admit every NaN, or later ones displace the lowest."""
    n = LARGE
    x = np.random.default_rng(k).standard_normal(n).astype(dtype)
    bits = np.dtype(dtype).itemsize * 8
    unsigned = np.dtype(f"u{bits // 8}")
    inf = np.array(np.inf, dtype).view(unsigned)
    payloads = np.random.default_rng(0).integers(1, 1000, (n + 2) // 3).astype(unsigned)
    x.view(unsigned)[::3] = inf | payloads  # a NaN every third entry, payloads high and low
    with np.errstate(invalid="ignore"):  # widening a signalling NaN says so
        want = contract_set(x, k)
    for method in EXACT:
        np.testing.assert_array_equal(topk(x, k, method), want, err_msg=method)
    if dtype == np.float16:
        return  # a residual is float32 or float64: the sweep below adds float16 widened
    for method in ("mstopk", "threshold"):  # the same NaNs added by the sweep into a residual of zeros
        picked = add_and_select(make_selector(method), np.zeros(n, dtype), x, k)
        np.testing.assert_array_equal(picked, want, err_msg=f"{method}, in the sweep")


def test_integer_magnitudes_are_exact_at_the_extremes():
    x = np.array([5, np.iinfo(np.int64).min, -6, np.iinfo(np.int64).max, 0], dtype=np.int64)
    for method in METHODS:
        np.testing.assert_array_equal(topk(x, 1, method), [1])
        np.testing.assert_array_equal(topk(x, 3, method), [1, 2, 3])


def test_views_and_byte_order_are_read_without_harm():
    x = np.random.default_rng(5).standard_normal(2 * LARGE)
    want = exact_topk(np.ascontiguousarray(x[::2]), 500)
    swapped = x.astype(x.dtype.newbyteorder(">"))
    for method in METHODS:
        np.testing.assert_array_equal(topk(x[::2], 500, method), want)
        np.testing.assert_array_equal(topk(swapped, 500, method), exact_topk(x, 500))


@pytest.mark.parametrize("method", ["threshold_warm"])
def test_warm_selector_over_a_drifting_gradient(method):
    """State carries over calls: slow drift, a jump up, a jump down, a new k."""
    rng = np.random.default_rng(11)
    sel = make_selector(method)
    g = rng.standard_normal(LARGE).astype(np.float32)
    scales = [1.0, 1.02, 1.05, 10.0, 0.1, 0.1, 1.0]
    thresholds, margins = [], []
    for step, scale in enumerate(scales):
        g = (g + 0.05 * rng.standard_normal(g.size).astype(np.float32)) * np.float32(scale)
        k = 400 if step < 5 else 2000
        np.testing.assert_array_equal(sel(g, k), exact_topk(g, k))
        thresholds.append(sel.threshold)
        margins.append(sel.margin)
    assert all(t > 0 for t in thresholds)
    assert len(set(margins)) > 1, "the jumps must have moved the warm-start margin"
    other = make_selector(method)  # a second call site starts cold
    assert other.threshold is None


def test_selectors_report_the_kth_magnitude():
    x = np.array([1.0, -4.0, 3.0, 2.0], dtype=np.float32)
    for method in ("threshold", "threshold_warm", "mstopk"):
        sel = make_selector(method)
        sel(x, 2)
        assert sel.threshold == 3.0


@pytest.mark.parametrize("method", METHODS)
def test_bad_input_names_the_problem(method):
    x = np.arange(10.0)
    with pytest.raises(ValueError, match="k must be >= 1"):
        topk(x, 0, method)
    with pytest.raises(TypeError, match="k must be an integer"):
        topk(x, 2.0, method)
    with pytest.raises(TypeError, match="complex"):
        topk(x.astype(np.complex64), 2, method)
    with pytest.raises(TypeError, match="real numeric"):
        topk(np.array(["a", "b"]), 1, method)
    with pytest.raises(TypeError, match="real numeric"):
        topk(np.ones(3, dtype=bool), 1, method)
    with pytest.raises(ValueError, match="flat"):
        topk(x.reshape(2, 5), 2, method)
    with pytest.raises(ValueError, match="flat"):
        topk([1.0, 2.0], 1, method)


def test_bad_options_and_methods():
    with pytest.raises(ValueError, match="unknown top-k method 'nope'"):
        topk(np.ones(3), 1, "nope")
    with pytest.raises(ValueError, match="N"):
        make_selector("mstopk", N=0)
    with pytest.raises(ValueError, match="margin"):
        make_selector("threshold_warm", margin=1.5)
    with pytest.raises(TypeError):
        make_selector("threshold", N=3)


@pytest.mark.parametrize("method", EXACT)
@pytest.mark.parametrize("dtypes, clear", [
    (("float32", "float32"), False), (("float32", "float32"), True), (("float32", "float16"), False),
    (("float32", "bfloat16"), False), (("float64", "float64"), False), (("float64", "float64"), True)])
def test_the_add_and_the_selection_in_one_sweep_are_the_add_then_the_selection(method, dtypes, clear):
    """``add_and_select`` leaves the sum's bits in ``values`` and picks the
    contract set of the sum, whether the floor it swept from was right, too
    high (a warm start above the k-th key: the selector searches the sum)
    or too low (more candidates than expected: the sweep's count sizes a
    second, read-only pass); a 16-bit ``fresh`` is widened exactly; a NaN or
    Inf in ``fresh``, or a sum that overflows, is picked first. With
    ``clear``, ``fresh`` ends all zeros, and nothing else changes."""
    import ml_dtypes  # noqa: F401  (bfloat16)

    from spar_comm.kernels import add_and_select

    values_dtype, fresh_dtype = dtypes
    rng = np.random.default_rng(41)
    k = LARGE // 1000
    selector = make_selector(method)
    values = rng.standard_normal(LARGE).astype(values_dtype)
    big = np.finfo(values_dtype).max
    scales = (1.0, 2.0**-10, 2.0**12, 1.0, 1.0)  # a floor as found, then far above, then far below the k-th key
    for call, scale in enumerate(scales):
        values *= scale  # exact: a power of two
        fresh = (rng.standard_normal(LARGE) * scale).astype(fresh_dtype)
        if call == len(scales) - 1:  # not finite, at the ends of blocks and inside
            fresh[[5, 63, 64, 70000, LARGE - 1]] = np.array([np.nan, -np.inf, np.inf, np.nan, -np.inf], fresh_dtype)
            values[[200, 201]] = big
            with np.errstate(over="ignore"):  # in 16 bits, the largest float32 is an Inf already
                fresh[[200, 201]] = np.array([big, -big]).astype(fresh_dtype)  # sums past the largest, and to 0
        with np.errstate(over="ignore", invalid="ignore"):
            total = values + fresh.astype(values_dtype)
        given = fresh.copy()
        chosen = add_and_select(selector, values, fresh, k, clear)
        assert values.tobytes() == total.tobytes()
        assert np.array_equal(chosen, contract_set(total, k))
        assert fresh.tobytes() == (np.zeros_like(given) if clear else given).tobytes()
        values[chosen] = 0  # as error feedback forgets what was sent


def test_the_sweep_zeroes_only_what_it_adds_as_it_is():
    """A widened or summed ``fresh`` is no result array: zeroing it is refused
    before anything changes."""
    from spar_comm.kernels.magnitude import float_layout, scan

    values = np.ones(LARGE, np.float32)
    for fresh in (np.ones(LARGE, np.float16), (np.ones(LARGE, np.float32), np.ones(LARGE, np.float32))):
        with pytest.raises(ValueError, match="clear zeroes the float32 array it adds"):
            scan(values, float_layout(values.dtype), 0, 10, fresh, clear=True)
        assert (values == 1).all()


@pytest.mark.parametrize("method", EXACT)
@pytest.mark.parametrize("count", [1, 2, 3])
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_the_sum_of_a_nodes_parts_and_the_selection_in_one_sweep_are_sum_parts_then_the_selection(method, count,
                                                                                                    dtype):
    """``add_and_select`` given a tuple of parts (a node's parts of a shard)
    leaves in ``values`` the bits ``sum_parts(parts, values, accumulate=True)``
    leaves, and picks the contract set of that sum, a NaN or Inf in any part
    first; a read-only part (a caller's gradient) among writable ones is read alike."""
    from spar_comm.collectives.shm import sum_parts
    from spar_comm.kernels import add_and_select

    rng = np.random.default_rng(count)
    k = LARGE // 1000
    selector = make_selector(method)
    values = rng.standard_normal(LARGE).astype(dtype)
    for call, scale in enumerate((1.0, 2.0**-10, 2.0**12, 1.0)):
        values *= scale
        parts = tuple((rng.standard_normal(LARGE) * scale / 3).astype(dtype) for _ in range(count))
        if call == 3:
            parts[-1][[0, 64, 100000]] = [np.nan, np.inf, -np.inf]
        parts[0].flags.writeable = False
        total = values.copy()
        with np.errstate(invalid="ignore"):
            sum_parts(list(parts), total, accumulate=True)
        kept = [part.copy() for part in parts]
        chosen = add_and_select(selector, values, parts, k)
        assert values.tobytes() == total.tobytes()
        assert all(part.tobytes() == copy.tobytes() for part, copy in zip(parts, kept)), "the parts are read only"
        assert np.array_equal(chosen, contract_set(total, k))
        values[chosen] = 0
