"""Device top-k (spar_comm.kernels.device_select): every method must return
the CPU reference's positions (exact_topk) bit for bit: ties to the lowest
positions, NaN above Inf above every number, exactly min(k, n) positions.

Under Numba's CUDA simulator (CI) the numba-cuda kernels run on NumPy arrays.
On a GPU (``make test-gpu``, NUMBA_ENABLE_CUDASIM=0) the same tests give the
methods CuPy arrays, which run select.cu's kernels."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

device_select = pytest.importorskip("spar_comm.kernels.device_select", reason="numba-cuda is not installed")
from spar_comm import kernels  # noqa: E402
from spar_comm.kernels.selection import exact_topk  # noqa: E402

from spar_comm.kernels.select_plan import SLOT, Workspace  # noqa: E402

pytestmark = pytest.mark.usefixtures("fast_simulator")
METHODS = sorted(device_select.METHODS)
#: Positions one compaction block covers under the simulator: sizes below
#: cross several blocks, and the words inside them.
TILE = 512


def _cupy_on_a_gpu():
    from numba import config

    if config.ENABLE_CUDASIM:
        return None
    try:
        import cupy

        return cupy if cupy.cuda.runtime.getDeviceCount() > 0 else None
    except Exception:  # no CuPy, or no CUDA device
        return None


CUPY = _cupy_on_a_gpu()


def on_device(x):
    """``x`` as the methods get it here: a CuPy array on a GPU, else NumPy."""
    return x if CUPY is None else CUPY.asarray(x)


def topk(x, k, method, **options):
    got = kernels.topk(on_device(x), k, method, device=True, **options)
    assert CUPY is None or isinstance(got, CUPY.ndarray)  # selected on the device, answered there
    return got if CUPY is None else CUPY.asnumpy(got)


def check(x, k, method, **options):
    got = topk(x, k, method, **options)
    want = exact_topk(x, k)
    assert got.dtype == np.int64 and got.tolist() == want.tolist(), (method, k, x.size)
    return got


@pytest.mark.slow
@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
def test_random_gradients_across_several_tiles(method, dtype):
    rng = np.random.default_rng(7)
    x = (rng.standard_normal(3 * TILE + 17) * 1e-3).astype(dtype)
    for k in (1, 5, 40):
        check(x, k, method)


@pytest.mark.slow
@pytest.mark.parametrize("method", METHODS)
def test_ties_go_to_the_lowest_positions(method):
    x = np.zeros(2 * TILE + 5, np.float32)
    x[[3, TILE + 1, TILE + 9, 2 * TILE + 2]] = [2.0, -2.0, 2.0, -2.0]  # four tied at the top
    x[[10, 20]] = [1.0, -1.0]
    assert check(x, 3, method).tolist() == [3, TILE + 1, TILE + 9]
    check(x, 5, method)  # the tie at 1.0 is split too
    assert check(np.zeros(TILE, np.float32), 4, method).tolist() == [0, 1, 2, 3]  # all equal: the first k


@pytest.mark.slow
@pytest.mark.parametrize("method", METHODS)
def test_nan_ranks_above_inf_above_every_number(method):
    x = np.linspace(-1, 1, TILE + 3).astype(np.float32)
    x[[50, 7, TILE + 1]] = [np.inf, np.nan, -np.inf]
    assert check(x, 1, method).tolist() == [7]
    assert check(x, 3, method).tolist() == [7, 50, TILE + 1]
    check(x, 6, method)
    everything = np.full(TILE, np.nan, np.float32)
    assert check(everything, 2, method).tolist() == [0, 1]


@pytest.mark.slow
@pytest.mark.parametrize("method", METHODS)
def test_k_at_or_beyond_the_size_takes_everything(method):
    x = np.arange(100, dtype=np.float32)
    assert topk(x, 100, method).tolist() == list(range(100))
    assert topk(x, 500, method).tolist() == list(range(100))
    check(x, 99, method)


@pytest.mark.slow
def test_fewer_than_k_above_the_mean_is_still_exact():
    """The published MSTopK fills such a k from below the mean regardless of
    magnitude; ours falls back to an exact pick."""
    x = np.full(4 * TILE, 1e-3, np.float32)
    x[:5] = 10.0  # the mean lies above every other entry
    x[TILE : 3 * TILE] = np.linspace(1e-4, 9e-4, 2 * TILE)
    check(x, 20, "mstopk")
    check(x, 3 * TILE, "mstopk")


def test_the_warm_start_adapts_its_margin_and_stays_exact():
    selector = device_select.DeviceThresholdWarm(margin=0.9)
    rng = np.random.default_rng(3)
    x = rng.standard_normal(256).astype(np.float32)  # the admitted counts below depend on the size
    margins = []
    for scale in (1.0, 1.0, 0.2, 5.0):  # steady, then the threshold falls below the floor, then far above it
        y = x * np.float32(scale)
        assert selector(on_device(y), 30).tolist() == exact_topk(y, 30).tolist()
        margins.append(selector.margin)
    assert margins == pytest.approx([0.9, 0.9, 0.81, 0.9])  # widened, then loosened back
    with pytest.raises(ValueError, match="margin"):
        device_select.DeviceThresholdWarm(margin=1.5)


@pytest.mark.slow
def test_the_selector_objects_check_their_input_too():
    x = on_device(np.arange(50, dtype=np.float32))
    for selector in (device_select.DeviceThreshold(), device_select.DeviceThresholdWarm()):
        assert selector(x, 60).tolist() == list(range(50))  # k beyond the size: everything
        with pytest.raises(ValueError, match="k must be >= 1"):
            selector(x, 0)
    with pytest.raises(ValueError, match="N \\(bisection steps\\) must be an integer >= 1"):
        kernels.topk(x, 3, "mstopk", N=0, device=True)
    assert kernels.topk(x, 3, "mstopk", N=6, device=True).tolist() == [47, 48, 49]
    for N in (1, 2, 7):  # a short bisection leaves a wide band: still the exact set
        check(np.linspace(-1, 1, 3 * TILE + 1).astype(np.float32), 40, "mstopk", N=N)


def test_bad_input_is_refused_with_a_message():
    with pytest.raises(ValueError, match="k must be >= 1"):
        kernels.topk(np.ones(4, np.float32), 0, device=True)
    with pytest.raises(ValueError, match="unknown top-k method 'sort'"):
        kernels.topk(np.ones(4, np.float32), 1, "sort", device=True)
    with pytest.raises(TypeError, match="float16, float32 or float64"):
        kernels.topk(np.ones(40, np.int32), 1, "exact", device=True)


@pytest.mark.slow
@settings(max_examples=12, deadline=None)
@given(n=st.integers(2, 600), k=st.integers(1, 40), seed=st.integers(0, 2**16),
       method=st.sampled_from(METHODS), levels=st.sampled_from([None, 3]))
def test_matches_the_cpu_reference(n, k, seed, method, levels):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(n).astype(np.float32)
    if levels:  # few distinct magnitudes: ties everywhere
        x = np.round(x * levels) / levels
    check(x, min(k, n), method)


@pytest.mark.skipif(CUPY is None, reason="needs CuPy and a GPU (NUMBA_ENABLE_CUDASIM=0)")
@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
def test_topk_of_a_cupy_array_selects_on_its_device(dtype):
    """At sizes the simulator cannot run, through the package's own topk."""
    from spar_comm.kernels import topk as package_topk

    rng = np.random.default_rng(11)
    x = rng.standard_normal(1 << 20).astype(dtype)
    x[[5, 77]] = [np.nan, np.inf]
    x[1000:3000] = x[999]  # a long run of ties at one magnitude
    for k in (1000, 50_000):
        for method in METHODS:
            got = package_topk(CUPY.asarray(x), k, method)
            assert isinstance(got, CUPY.ndarray), method
            assert CUPY.asnumpy(got).tolist() == exact_topk(x, k).tolist(), (method, k)


@pytest.mark.slow
def test_a_sample_larger_than_the_sample_size_fits_its_buffer():
    """From SAMPLE to 2 * SAMPLE entries the stride is 1: the whole array is
    the sample, more keys than SAMPLE, and the buffer must hold them all."""
    from spar_comm.kernels.magnitude import SAMPLE

    x = np.random.default_rng(9).standard_normal(SAMPLE + 3000).astype(np.float32)
    check(x, 5, "threshold")


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [np.float16, np.float64])
def test_a_floor_that_admits_too_many_or_too_few_still_selects_exactly(dtype):
    """The gather's room is 2k + 1024: a floor of 0 overflows it, a floor above
    every key admits nothing, and either way the radix select and the marking
    read the whole array instead, on the device."""
    rng = np.random.default_rng(5)
    x = rng.standard_normal(3 * TILE + 1100).astype(dtype)
    x[[9, 700]] = [np.nan, -np.inf]
    x[100:300] = x[99]  # ties
    device_x = on_device(x)
    for k in (1, 7, 250):
        for above_every_key in (False, True):
            workspace = Workspace(device_select.kernels_for(device_x), x.size, x.dtype, k)
            floor = int(workspace.no_floor) if above_every_key else 0
            workspace.floor_at(floor)
            got = workspace.from_floor(device_select.bits_of(device_x))
            got = got if CUPY is None else CUPY.asnumpy(got)
            assert got.tolist() == exact_topk(x, k).tolist(), (k, floor)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
def test_the_bisection_counts_its_later_passes_among_what_its_first_keeps(dtype):
    """``mstopk``'s passes after the first count the keys the first one
    gathered where they all fitted (spread values), and the array where they
    did not (a plateau of ties at the top, wider than the room of 2k + 1024) or
    where the workspace keeps none: the same positions every way."""
    rng = np.random.default_rng(11)
    spread = rng.standard_normal(3 * TILE + 1100).astype(dtype)
    spread[[9, 700]] = [np.nan, -np.inf]
    plateau = spread.copy()
    plateau[50:1250] = 8.0  # above every spread value
    k = 5
    for x, bisects, counted_among_them in ((spread, True, 1), (plateau, True, 0), (spread, False, 0)):
        device_x = on_device(x)
        bits = device_select.bits_of(device_x)
        workspace = Workspace(device_select.kernels_for(device_x), x.size, x.dtype, k, bisects)
        workspace.bisect(bits, 4)
        source = int(workspace.state[SLOT["source"]])  # which the later passes read
        got = workspace.pick(bits)
        got = got if CUPY is None else CUPY.asnumpy(got)
        assert (source, got.tolist()) == (counted_among_them, exact_topk(x, k).tolist()), (bisects, x[60])


@pytest.mark.slow
def test_a_mean_that_rounds_above_the_largest_value_leaves_the_bracket_whole():
    """float64 sums of values that nearly all tie at the top can put their
    mean a few ulps above the largest: the bracket's low end is clamped to the
    largest key, so the bisection's floors stay ascending."""
    x = np.full(2000, 0.9)
    x[[3, 1500]] = [-0.9, np.nan]
    device_x = on_device(x)
    bits = device_select.bits_of(device_x)
    workspace = Workspace(device_select.kernels_for(device_x), x.size, x.dtype, 7, bisects=True)
    workspace.bracket(bits)
    lo, hi = int(workspace.state[SLOT["lo"]]), int(workspace.state[SLOT["hi"]])
    top = int(np.float64(0.9).view(np.uint64))
    assert lo <= top < hi == top + 1, (lo, hi, top)
    check(x, 7, "mstopk")
