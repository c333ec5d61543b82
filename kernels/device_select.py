"""Exact top-k on a GPU, under the CPU's contract, in numba-cuda kernels.

The contract is the one of ``selection.py``: ``min(k, n)`` unique ascending
positions of the largest magnitude keys (``magnitude.py``: |x| by its bit
pattern, every NaN one key above Inf), ties to the lowest positions. All four
methods find the k-th largest key ``T`` and then write the same set, so they
give the same bits as the CPU methods for the same input:

* ``exact``: radix select. Each pass histograms one byte of the keys that
  share the prefix chosen so far (256 counts, one read of ``x``), and a
  one-thread kernel picks the byte holding the k-th key. The prefix never
  leaves the device, so there is no host round trip per pass.
* ``mstopk``: the paper's bisection of the threshold between the mean and the
  largest magnitude, counting ``M`` thresholds per pass (``M + 1``-way
  instead of 2-way, so its 30 halving steps take 10 passes at M = 7), steered
  by a one-thread kernel on the device. It bisects the keys rather than the
  values: they are monotone in the magnitude, need no float-to-bits
  conversion on the device, and 31 halvings end on one key. Made robust as on
  the CPU: the band it ends with is compacted and the exact top-k picked from
  it, so ties, zeros, NaN and "fewer than k above the mean" cost time, never
  correctness.
* ``threshold`` / ``threshold_warm``: a key floor from a strided sample (or
  from the last call's threshold), one compaction pass of the candidates at
  or above it, and an exact pick among them.

The compaction writes positions in ascending order without sorting: each
block counts its tile, an exclusive scan of the counts gives every block its
offset, and a scan inside the block gives every thread its own.

The kernels take CuPy arrays on a GPU (launched on CuPy's current stream) and
NumPy arrays under Numba's CUDA simulator (``NUMBA_ENABLE_CUDASIM=1``), which
is how CI runs every one of them. The simulator has no warp shuffles, so the
block scans use shared memory only.
"""
from __future__ import annotations

import functools
import math
from typing import Any, Optional, Tuple

import numpy as np
from numba import config, cuda

from .magnitude import SAMPLE, float_layout
from .mstopk import checked_steps
from .selection import check_input, namespace
from .threshold import adapted_margin, checked_margin, key_to_value

#: Threads per block, consecutive elements each thread owns in a tile, and
#: blocks of the grid-stride counting kernels (enough to fill a GPU). The
#: simulator runs each thread as a Python thread, whose start and barriers
#: cost more than its work: far fewer threads there, the same logic.
THREADS = 8 if config.ENABLE_CUDASIM else 128
ITEMS = 64 if config.ENABLE_CUDASIM else 8
TILE = THREADS * ITEMS
COUNT_BLOCKS = 2 if config.ENABLE_CUDASIM else 1024
#: Radix select: bits per pass, and bins.
RADIX_BITS = 8
BINS = 1 << RADIX_BITS
#: mstopk: thresholds counted per pass (its halving steps are the CPU method's N).
THRESHOLDS = 7


# -- keys ------------------------------------------------------------------------------
@cuda.jit(device=True, inline=True)
def _key(bits, i, mask, nan_key):  # pragma: no cover - compiled
    """The magnitude key of entry i: sign bit cleared, every NaN clamped to one key."""
    return min(np.int64(bits[i]) & mask, nan_key)


# -- counting passes ------------------------------------------------------------------
@cuda.jit
def _histogram(bits, mask, nan_key, state, shift, hist):  # pragma: no cover - compiled
    """Count, per byte at ``shift``, the keys that share the prefix ``state[0]``
    under ``state[1]``."""
    local = cuda.shared.array(BINS, dtype=np.int64)
    t = cuda.threadIdx.x
    for b in range(t, BINS, cuda.blockDim.x):
        local[b] = 0
    cuda.syncthreads()
    prefix, prefix_mask = state[0], state[1]
    start = cuda.grid(1)
    stride = cuda.gridsize(1)
    for i in range(start, bits.size, stride):
        key = _key(bits, i, mask, nan_key)
        if (key & prefix_mask) == prefix:
            cuda.atomic.add(local, (key >> shift) & (BINS - 1), 1)
    cuda.syncthreads()
    for b in range(t, BINS, cuda.blockDim.x):
        if local[b]:
            cuda.atomic.add(hist, b, local[b])


@cuda.jit
def _choose_byte(hist, state, shift):  # pragma: no cover - compiled
    """One thread: the byte that holds the ``state[2]``-th largest key of the
    histogram; extend the prefix by it and keep how many of it are still wanted."""
    if cuda.grid(1) != 0:
        return
    wanted = state[2]
    above = np.int64(0)
    for b in range(BINS - 1, -1, -1):
        if above + hist[b] >= wanted:
            state[0] |= np.int64(b) << shift
            state[1] |= np.int64(BINS - 1) << shift
            state[2] = wanted - above
            return
        above += hist[b]


@cuda.jit
def _finite_stats(x, bits, mask, inf_key, total, finite):  # pragma: no cover - compiled
    """Sum of the finite magnitudes (``total[0]``) and how many are finite
    (``finite[0]``), in one read."""
    block_total = cuda.shared.array(1, dtype=np.float64)
    block_finite = cuda.shared.array(1, dtype=np.int64)
    t = cuda.threadIdx.x
    if t == 0:
        block_total[0] = 0.0
        block_finite[0] = 0
    cuda.syncthreads()
    mine = 0.0
    count = np.int64(0)
    for i in range(cuda.grid(1), bits.size, cuda.gridsize(1)):
        if (np.int64(bits[i]) & mask) < inf_key:
            mine += abs(np.float64(x[i]))
            count += 1
    cuda.atomic.add(block_total, 0, mine)
    cuda.atomic.add(block_finite, 0, count)
    cuda.syncthreads()
    if t == 0:
        cuda.atomic.add(total, 0, block_total[0])
        cuda.atomic.add(finite, 0, block_finite[0])


@cuda.jit
def _spread_floors(search, floors):  # pragma: no cover - compiled
    """One thread: ``THRESHOLDS`` key floors evenly inside the bracket
    ``[search[0], search[1])``, the thresholds of the next counting pass."""
    if cuda.grid(1) != 0:
        return
    lo = search[0]
    step, rest = divmod(search[1] - lo, THRESHOLDS + 1)  # (j+1)*(hi-lo) would overflow for float64 keys
    for j in range(THRESHOLDS):
        floors[j] = lo + (j + 1) * step + (j + 1) * rest // (THRESHOLDS + 1)


@cuda.jit
def _count_at_least(bits, mask, nan_key, floors, counts):  # pragma: no cover - compiled
    """``counts[j] = #(key >= floors[j])`` for every floor, in one read of the keys."""
    local = cuda.shared.array(THRESHOLDS, dtype=np.int64)
    t = cuda.threadIdx.x
    if t < THRESHOLDS:
        local[t] = 0
    cuda.syncthreads()
    for i in range(cuda.grid(1), bits.size, cuda.gridsize(1)):
        key = _key(bits, i, mask, nan_key)
        for j in range(THRESHOLDS):
            if key >= floors[j]:
                cuda.atomic.add(local, j, 1)
    cuda.syncthreads()
    if t < THRESHOLDS and local[t]:
        cuda.atomic.add(counts, t, local[t])


@cuda.jit
def _bisect(floors, counts, k, search):  # pragma: no cover - compiled
    """One thread: narrow the bracket ``search = [lo, hi]`` of key floors with
    this pass's counts: ``lo`` becomes the highest floor that keeps more than
    k keys, ``hi`` the lowest that keeps at most k."""
    if cuda.grid(1) != 0:
        return
    for j in range(THRESHOLDS):
        if counts[j] > k:
            search[0] = floors[j]
    for j in range(THRESHOLDS - 1, -1, -1):
        if counts[j] <= k:
            search[1] = floors[j]


# -- ordered compaction -----------------------------------------------------------------
@cuda.jit(device=True)
def _tile_counts(bits, mask, nan_key, cut, tile_start):  # pragma: no cover - compiled
    """This thread's counts of keys above ``cut`` and equal to it in its run of the tile."""
    above = np.int64(0)
    equal = np.int64(0)
    first = tile_start + cuda.threadIdx.x * ITEMS
    for i in range(first, min(first + ITEMS, bits.size)):
        key = _key(bits, i, mask, nan_key)
        if key > cut:
            above += 1
        elif key == cut:
            equal += 1
    return above, equal


@cuda.jit
def _count_tiles(bits, mask, nan_key, cut, tiles):  # pragma: no cover - compiled
    """Per tile (one block each): how many keys lie above ``cut``, and how many equal it."""
    above, equal = _tile_counts(bits, mask, nan_key, cut, cuda.blockIdx.x * TILE)
    cuda.atomic.add(tiles, (cuda.blockIdx.x, 0), above)
    cuda.atomic.add(tiles, (cuda.blockIdx.x, 1), equal)


@cuda.jit
def _write_tiles(bits, mask, nan_key, cut, ties, offsets, positions):  # pragma: no cover - compiled
    """Write, in ascending order, every position whose key lies above ``cut``
    and the first ``ties`` positions whose key equals it. ``offsets[b]`` holds
    how many of each kind the tiles before block b have."""
    scan_above = cuda.shared.array(THREADS, dtype=np.int64)
    scan_equal = cuda.shared.array(THREADS, dtype=np.int64)
    t = cuda.threadIdx.x
    tile_start = cuda.blockIdx.x * TILE
    above, equal = _tile_counts(bits, mask, nan_key, cut, tile_start)
    scan_above[t] = above
    scan_equal[t] = equal
    cuda.syncthreads()
    step = 1
    while step < THREADS:  # inclusive Hillis-Steele scan, shared memory only
        a = scan_above[t - step] if t >= step else 0
        e = scan_equal[t - step] if t >= step else 0
        cuda.syncthreads()
        scan_above[t] += a
        scan_equal[t] += e
        cuda.syncthreads()
        step *= 2
    before_above = offsets[cuda.blockIdx.x, 0] + scan_above[t] - above
    before_equal = offsets[cuda.blockIdx.x, 1] + scan_equal[t] - equal
    first = tile_start + t * ITEMS
    for i in range(first, min(first + ITEMS, bits.size)):
        key = _key(bits, i, mask, nan_key)
        if key > cut:
            positions[before_above + min(before_equal, ties)] = i
            before_above += 1
        elif key == cut:
            if before_equal < ties:
                positions[before_above + before_equal] = i
            before_equal += 1


# -- launching --------------------------------------------------------------------------
def launch(kernel, blocks: int, threads: int, *args) -> None:
    """Run ``kernel`` on CuPy's current stream when given CuPy arrays (under the
    simulator, arrays are NumPy and there are no streams)."""
    xp = namespace(args[0])
    if xp is np:
        kernel[blocks, threads](*args)
        return
    if config.ENABLE_CUDASIM:
        raise RuntimeError("CuPy arrays need a real GPU, but NUMBA_ENABLE_CUDASIM is set: unset it or set it to 0")
    stream = cuda.external_stream(xp.cuda.get_current_stream().ptr)
    # The kernel runs on CuPy's stream, so numba need not synchronise the
    # stream each CuPy array exports (its default: a host wait per argument).
    arrays = [cuda.as_cuda_array(a, sync=False) if isinstance(a, xp.ndarray) else a for a in args]
    kernel[blocks, threads, stream](*arrays)


class Keys:
    """A float array seen as magnitude keys: its bits and the figures the kernels need."""

    def __init__(self, x: Any):
        layout = float_layout(x.dtype)
        if layout is None:
            raise TypeError(f"device top-k needs float16, float32 or float64, got {x.dtype}")
        self.xp = namespace(x)
        self.bits = x.view(layout.bits)
        self.mask = np.int64(layout.mask)
        self.inf_key = np.int64(layout.inf_key)
        self.nan_key = np.int64(layout.inf_key + 1)
        self.width = np.dtype(layout.bits).itemsize * 8
        self.n = x.size

    def count_blocks(self) -> int:
        return max(1, min(COUNT_BLOCKS, -(-self.n // (THREADS * 4))))

    def compact(self, cut: int, ties: int, total: Optional[int] = None) -> Any:
        """Ascending positions of every key above ``cut`` and the first ``ties``
        equal to it (``total`` of them when the caller knows the count)."""
        xp = self.xp
        blocks = -(-self.n // TILE)
        tiles = xp.zeros((blocks, 2), dtype=np.int64)
        launch(_count_tiles, blocks, THREADS, self.bits, self.mask, self.nan_key, np.int64(cut), tiles)
        offsets = xp.cumsum(tiles, axis=0) - tiles
        if total is None:
            sums = tiles.sum(axis=0)
            total = int(sums[0]) + min(int(sums[1]), ties)
        positions = xp.empty(total, dtype=np.int64)
        launch(_write_tiles, blocks, THREADS, self.bits, self.mask, self.nan_key, np.int64(cut), np.int64(ties),
               offsets, positions)
        return positions

    def keys_of(self, bits: Any) -> Any:
        """The keys of some of the bits (a gather or a sample), as the kernels' ``_key``."""
        return self.xp.minimum(bits.astype(np.int64) & int(self.mask), int(self.nan_key))

    def pick(self, positions: Any, k: int) -> Tuple[Any, int]:
        """The contract set among candidate ``positions`` (ascending, holding the top
        k), and the k-th largest key: an exact pick on the small candidate set."""
        xp = self.xp
        keys = self.keys_of(self.bits[positions])
        kth = int(xp.sort(keys)[keys.size - k])
        above = keys > kth
        ties = xp.flatnonzero(keys == kth)[: k - int(xp.count_nonzero(above))]
        above[ties] = True
        return positions[above], kth


# -- the methods ------------------------------------------------------------------------
def radix_select(keys: Keys, k: int) -> Tuple[int, int]:
    """The k-th largest key, and how many keys equal to it belong to the top k
    (the rest of the top k lies above it)."""
    xp = keys.xp
    state = xp.asarray(np.array([0, 0, k], dtype=np.int64))  # prefix, its mask, still wanted
    blocks = keys.count_blocks()
    for shift in range(keys.width - RADIX_BITS, -1, -RADIX_BITS):
        hist = xp.zeros(BINS, dtype=np.int64)
        launch(_histogram, blocks, THREADS, keys.bits, keys.mask, keys.nan_key, state, np.int64(shift), hist)
        launch(_choose_byte, 1, 1, hist, state, np.int64(shift))
    kth, _, ties = state.tolist()
    return int(kth), int(ties)


def all_positions(x: Any) -> Any:
    """Every position of ``x``: what each method returns for k >= n."""
    return namespace(x).arange(x.size, dtype=np.int64)


def exact(x: Any, k: int) -> Any:
    if k >= x.size:
        return all_positions(x)
    keys = Keys(x)
    kth, ties = radix_select(keys, k)
    return keys.compact(kth, ties, total=k)


def value_key(value: float, dtype: np.dtype) -> int:
    """The key of the non-negative magnitude ``value`` in ``dtype``, rounded up
    so that ``key >= value_key(t)`` means ``|x| >= t``."""
    layout = float_layout(dtype)
    cast = np.array(value, dtype=dtype)
    if float(cast) < value:
        cast = np.nextafter(cast, np.array(np.inf, dtype=dtype))
    return int(cast.view(layout.bits))


def mstopk(x: Any, k: int, N: int = 30) -> Any:
    """The paper's bisection of the threshold between the mean and the largest
    magnitude, on the keys, ``THRESHOLDS`` per pass (N halving steps in all);
    then an exact pick from the band."""
    if k >= x.size:
        return all_positions(x)
    keys = Keys(x)
    xp = keys.xp
    total = xp.zeros(1, dtype=np.float64)
    count = xp.zeros(1, dtype=np.int64)
    blocks = keys.count_blocks()
    launch(_finite_stats, blocks, THREADS, x, keys.bits, keys.mask, keys.inf_key, total, count)
    (sum_finite,), (finite,) = total.tolist(), count.tolist()  # one round trip per call
    if finite == 0:
        return from_floor(keys, k, 0)[0]
    # The bracket starts at the mean's key and ends above every key (NaN and Inf
    # included): with no finite entry above the top, the first pass finds the top.
    search = xp.asarray(np.array([value_key(sum_finite / finite, x.dtype), int(keys.nan_key) + 1], dtype=np.int64))
    floors = xp.empty(THRESHOLDS, dtype=np.int64)
    for _ in range(math.ceil(N / math.log2(THRESHOLDS + 1))):
        launch(_spread_floors, 1, 1, search, floors)
        counts = xp.zeros(THRESHOLDS, dtype=np.int64)
        launch(_count_at_least, blocks, THREADS, keys.bits, keys.mask, keys.nan_key, floors, counts)
        launch(_bisect, 1, 1, floors, counts, np.int64(k), search)
    return from_floor(keys, k, int(search[0]))[0]


def sample_floor(keys: Keys, k: int) -> int:
    """A key floor read off a strided sample, with at least k keys above it with
    high confidence (expected count plus four standard deviations)."""
    sample = keys.keys_of(keys.bits[:: max(1, keys.n // SAMPLE)])
    m = sample.size
    expected = k * m / keys.n
    rank = int(expected + 4.0 * math.sqrt(expected)) + 4
    return 0 if rank >= m else int(keys.xp.sort(sample)[m - rank])


def from_floor(keys: Keys, k: int, floor: int) -> Tuple[Any, int, int]:
    """One candidate pass at ``floor``, and the exact pick among the candidates:
    the contract set, the k-th key and how many candidates the pass admitted.
    A floor that admits fewer than k falls back to the radix select."""
    candidates = keys.compact(floor - 1, 0)
    if candidates.size < k:
        kth, ties = radix_select(keys, k)
        return keys.compact(kth, ties, total=k), kth, int(candidates.size)
    positions, kth = keys.pick(candidates, k)
    return positions, kth, int(candidates.size)


class Threshold:
    """Sampled floor, one candidate pass, exact pick; ``threshold`` is the k-th magnitude."""

    def __init__(self) -> None:
        self.threshold: Optional[float] = None
        self.kth_key: Optional[int] = None

    def __call__(self, x: Any, k: int) -> Any:
        check_input(x, k)
        if k >= x.size:
            return all_positions(x)
        keys = Keys(x)
        positions, self.kth_key, _ = from_floor(keys, k, sample_floor(keys, k))
        self.threshold = key_to_value(self.kth_key, x.dtype)
        return positions


class ThresholdWarm(Threshold):
    """Starts from the last call's k-th magnitude times ``margin``, adapted by
    the CPU method's rule (``threshold.adapted_margin``)."""

    def __init__(self, margin: float = 0.9) -> None:
        super().__init__()
        self.margin = checked_margin(margin)

    def __call__(self, x: Any, k: int) -> Any:
        previous = self.threshold
        if previous is None or not 0.0 < previous < math.inf or k >= x.size:
            return super().__call__(x, k)
        keys = Keys(x)
        floor = value_key(previous * self.margin, x.dtype)
        positions, self.kth_key, admitted = from_floor(keys, k, floor)
        self.threshold = key_to_value(self.kth_key, x.dtype)
        self.margin = adapted_margin(self.margin, self.kth_key, floor, admitted, k)
        return positions


#: Method name -> factory of a device selector, as ``selection.register`` names them.
METHODS = {
    "exact": lambda: exact,
    "mstopk": lambda N=30: functools.partial(mstopk, N=checked_steps(N)),
    "threshold": Threshold,
    "threshold_warm": ThresholdWarm,
}


def device_topk(x: Any, k: int, method: str = "mstopk", **options: Any) -> Any:
    """Positions of the ``min(k, n)`` entries of largest magnitude of a device
    array (NumPy under the simulator), ascending: the CPU contract."""
    check_input(x, k)
    if method not in METHODS:
        raise ValueError(f"unknown top-k method {method!r}; known on the device: {', '.join(sorted(METHODS))}")
    return METHODS[method](**options)(x, k)
