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
  instead of 2-way, so its 30 halving steps take 10 passes at M = 7, and 5
  at the GPU's M = 63), steered by a one-thread kernel on the device. It
  bisects the keys rather than the values: they are monotone in the
  magnitude, need no float-to-bits conversion on the device, and 31 halvings
  end on one key. Made robust as on the CPU: the band it ends with is
  gathered and the exact top-k picked from it, so ties, zeros, NaN and "fewer
  than k above the mean" cost time, never correctness.
* ``threshold`` / ``threshold_warm``: a key floor from a strided sample (or
  from the last call's threshold), one pass that gathers the candidates at
  or above it, and an exact pick among them.

The kernels here are numba-cuda's, on NumPy arrays: under Numba's CUDA
simulator (``NUMBA_ENABLE_CUDASIM=1``), which is how CI runs every one of
them, or copied to a GPU by numba. Their gather writes positions in
ascending order without sorting: each block counts its tile, an exclusive
scan of the counts gives every block its offset, and a scan inside the block
gives every thread its own. The simulator has no warp shuffles, so the block
scans use shared memory only.

CuPy arrays on a GPU take the same steps through ``select_cuda`` (CUDA C in
``select.cu``, launched by CuPy): numba-cuda's launches cost too much there
to serve. Its gather writes in any order and sorts the few it found.
"""
from __future__ import annotations

import functools
import math
from typing import Any, Optional, Tuple

import numpy as np
from numba import config, cuda

from .magnitude import SAMPLE, float_layout
from .mstopk import checked_steps
from .selection import check_input, namespace, register
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
def _tile_count(bits, mask, nan_key, floor, tile_start):  # pragma: no cover - compiled
    """How many keys of this thread's run of the tile are at least ``floor``."""
    count = np.int64(0)
    first = tile_start + cuda.threadIdx.x * ITEMS
    for i in range(first, min(first + ITEMS, bits.size)):
        if _key(bits, i, mask, nan_key) >= floor:
            count += 1
    return count


@cuda.jit
def _count_tiles(bits, mask, nan_key, floor, tiles):  # pragma: no cover - compiled
    """Per tile (one block each): how many keys are at least ``floor``."""
    cuda.atomic.add(tiles, cuda.blockIdx.x, _tile_count(bits, mask, nan_key, floor, cuda.blockIdx.x * TILE))


@cuda.jit
def _write_tiles(bits, mask, nan_key, floor, offsets, positions):  # pragma: no cover - compiled
    """Write, in ascending order, every position whose key is at least
    ``floor``; ``offsets[b]`` holds how many the tiles before block b have."""
    scan = cuda.shared.array(THREADS, dtype=np.int64)
    t = cuda.threadIdx.x
    tile_start = cuda.blockIdx.x * TILE
    mine = _tile_count(bits, mask, nan_key, floor, tile_start)
    scan[t] = mine
    cuda.syncthreads()
    step = 1
    while step < THREADS:  # inclusive Hillis-Steele scan, shared memory only
        before = scan[t - step] if t >= step else 0
        cuda.syncthreads()
        scan[t] += before
        cuda.syncthreads()
        step *= 2
    slot = offsets[cuda.blockIdx.x] + scan[t] - mine
    first = tile_start + t * ITEMS
    for i in range(first, min(first + ITEMS, bits.size)):
        if _key(bits, i, mask, nan_key) >= floor:
            positions[slot] = i
            slot += 1


# -- launching --------------------------------------------------------------------------
def launch(kernel, blocks: int, threads: int, *args) -> None:
    """Run a numba-cuda ``kernel`` on NumPy arrays (under the simulator, or
    copied to a GPU and back by numba). CuPy arrays go to ``select_cuda``."""
    kernel[blocks, threads](*args)


class Keys:
    """A float array seen as magnitude keys: its bits, the figures the kernels
    need, and on a real GPU the compiled passes of ``select_cuda``."""

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
        self.cuda = None
        if self.xp is not np:
            from . import select_cuda

            self.cuda = select_cuda.Passes(self)

    def count_blocks(self) -> int:
        return max(1, min(COUNT_BLOCKS, -(-self.n // (THREADS * 4))))

    def at_least(self, floor: int, expected: int) -> Any:
        """Ascending positions of every key at least ``floor`` (``expected``: about
        how many, the room a GPU's unordered pass starts with)."""
        if self.cuda is not None:
            return self.cuda.at_least(floor, expected)
        blocks = -(-self.n // TILE)
        tiles = np.zeros(blocks, dtype=np.int64)
        launch(_count_tiles, blocks, THREADS, self.bits, self.mask, self.nan_key, np.int64(floor), tiles)
        positions = np.empty(int(tiles.sum()), dtype=np.int64)
        launch(_write_tiles, blocks, THREADS, self.bits, self.mask, self.nan_key, np.int64(floor),
               np.cumsum(tiles) - tiles, positions)
        return positions

    def keys_of(self, bits: Any) -> Any:
        """The keys of some of the bits (a gather or a sample), as the kernels' ``_key``."""
        return self.xp.minimum(bits.astype(np.int64) & int(self.mask), int(self.nan_key))

    def pick(self, positions: Any, k: int) -> Tuple[Any, int]:
        """The contract set among candidate ``positions`` (as ``at_least`` gives
        them, holding the top k), and the k-th largest key: an exact pick on the
        small candidate set."""
        if self.cuda is not None and self.cuda.packs:
            return self.cuda.pick(positions, k)
        xp = self.xp
        keys = self.keys_of(self.bits[positions])
        kth = int(xp.sort(keys)[keys.size - k])
        above = keys > kth
        ties = xp.flatnonzero(keys == kth)[: k - int(xp.count_nonzero(above))]
        above[ties] = True
        return positions[above], kth


# -- the methods ------------------------------------------------------------------------
def kth_key(keys: Keys, k: int) -> int:
    """The k-th largest key, by radix select."""
    if keys.cuda is not None:
        return keys.cuda.kth_key(k, keys.width, RADIX_BITS)
    state = np.array([0, 0, k], dtype=np.int64)  # prefix, its mask, still wanted
    blocks = keys.count_blocks()
    for shift in range(keys.width - RADIX_BITS, -1, -RADIX_BITS):
        hist = np.zeros(BINS, dtype=np.int64)
        launch(_histogram, blocks, THREADS, keys.bits, keys.mask, keys.nan_key, state, np.int64(shift), hist)
        launch(_choose_byte, 1, 1, hist, state, np.int64(shift))
    return int(state[0])


def all_positions(x: Any) -> Any:
    """Every position of ``x``: what each method returns for k >= n."""
    return namespace(x).arange(x.size, dtype=np.int64)


def exact(x: Any, k: int) -> Any:
    if k >= x.size:
        return all_positions(x)
    keys = Keys(x)
    return from_floor(keys, k, kth_key(keys, k))[0]


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
    magnitude, on the keys, several thresholds per pass (N halving steps in
    all); then an exact pick from the band."""
    if k >= x.size:
        return all_positions(x)
    keys = Keys(x)
    sum_finite, finite = finite_stats(x, keys)
    if finite == 0:
        return from_floor(keys, k, 0)[0]
    # The bracket starts at the mean's key and ends above every key (NaN and Inf
    # included): with no finite entry above the top, the first pass finds the top.
    lo, hi = value_key(sum_finite / finite, x.dtype), int(keys.nan_key) + 1
    if keys.cuda is not None:
        floor = keys.cuda.bisect(k, lo, hi, passes=math.ceil(N / math.log2(keys.cuda.floors + 1)))
        return from_floor(keys, k, floor)[0]
    search = np.array([lo, hi], dtype=np.int64)
    floors = np.empty(THRESHOLDS, dtype=np.int64)
    blocks = keys.count_blocks()
    for _ in range(math.ceil(N / math.log2(THRESHOLDS + 1))):
        launch(_spread_floors, 1, 1, search, floors)
        counts = np.zeros(THRESHOLDS, dtype=np.int64)
        launch(_count_at_least, blocks, THREADS, keys.bits, keys.mask, keys.nan_key, floors, counts)
        launch(_bisect, 1, 1, floors, counts, np.int64(k), search)
    return from_floor(keys, k, int(search[0]))[0]


def finite_stats(x: Any, keys: Keys) -> Tuple[float, int]:
    """The sum of the finite magnitudes of ``x`` and how many are finite, in one read."""
    if keys.cuda is not None:
        return keys.cuda.finite_stats()
    total = np.zeros(1, dtype=np.float64)
    count = np.zeros(1, dtype=np.int64)
    launch(_finite_stats, keys.count_blocks(), THREADS, x, keys.bits, keys.mask, keys.inf_key, total, count)
    return float(total[0]), int(count[0])


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
    room = 2 * k + 1024  # what the floors here usually admit: k and a margin
    candidates = keys.at_least(floor, room)
    admitted = int(candidates.size)
    if admitted < k:
        candidates = keys.at_least(kth_key(keys, k), room)
    positions, kth = keys.pick(candidates, k)
    return positions, kth, admitted


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


#: Method name -> factory of a device selector, as the host methods are named.
METHODS = {
    "exact": lambda: exact,
    "mstopk": lambda N=30: functools.partial(mstopk, N=checked_steps(N)),
    "threshold": Threshold,
    "threshold_warm": ThresholdWarm,
}
for _name, _factory in METHODS.items():
    register(_name, _factory, exact=True, device=True)
