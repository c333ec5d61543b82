"""The kernels of ``select.cu`` in numba-cuda, under the same names and
arguments, for NumPy arrays: how CI runs every step of a device selection
(under Numba's CUDA simulator, ``NUMBA_ENABLE_CUDASIM=1``), or numba copying
the arrays to a GPU and back.

They compute what the CUDA C kernels compute, more simply where the simulator
asks for it: it has no warp votes, so the gather reserves one slot at a time
and the marking sets every bit atomically, and each simulated thread is a
Python thread, so blocks are small. The state's slots are ``select_plan``'s.
"""
from __future__ import annotations

import functools
import math
from typing import Any, Dict, Tuple

import numpy as np
from numba import config, cuda

from .select_plan import FLOORS, SLOT

#: Threads of a block of the passes over the array and of the compaction,
#: blocks of a pass, and the bitmap words a compaction thread reads: few
#: under the simulator, where every thread is a Python thread.
THREADS = 8 if config.ENABLE_CUDASIM else 128
BLOCKS = 2 if config.ENABLE_CUDASIM else 1024
COMPACT_THREADS = 8 if config.ENABLE_CUDASIM else 256
WORDS = 2 if config.ENABLE_CUDASIM else 8

FLOOR, COUNT, SOURCE, CANDIDATES = SLOT["floor"], SLOT["count"], SLOT["source"], SLOT["candidates"]
PREFIX, PREFIX_MASK, WANTED = SLOT["prefix"], SLOT["prefix_mask"], SLOT["wanted"]
LO, HI, PREVIOUS = SLOT["lo"], SLOT["hi"], SLOT["previous"]
U0, U1 = np.uint64(0), np.uint64(1)


@cuda.jit(device=True, inline=True)
def _key(b, mask, nan_key):  # pragma: no cover - compiled
    return min(b & mask, nan_key)


@cuda.jit
def clear_slot(state, slot):  # pragma: no cover - compiled
    state[slot] = U0


@cuda.jit
def set_floor(state, slot, value):  # pragma: no cover - compiled
    state[FLOOR] = value if slot < 0 else state[slot]


@cuda.jit
def gather_at_least(bits, n, mask, nan_key, state, keys, positions, capacity):  # pragma: no cover - compiled
    floor = state[FLOOR]
    for i in range(cuda.grid(1), n, cuda.gridsize(1)):
        key = _key(bits[i], mask, nan_key)
        if key >= floor:
            slot = cuda.atomic.add(state, COUNT, U1)
            if slot < capacity:
                keys[slot] = key
                positions[slot] = i


@cuda.jit
def begin_radix(state, k, capacity, given):  # pragma: no cover - compiled
    m = np.uint64(given) if given >= 0 else state[COUNT]
    candidates = m >= k and m <= capacity
    state[SOURCE] = U1 if candidates else U0
    state[CANDIDATES] = m if candidates else U0
    state[PREFIX] = U0
    state[PREFIX_MASK] = U0
    state[WANTED] = k


@cuda.jit
def histogram(bits, n, mask, nan_key, keys, state, shift, hist):  # pragma: no cover - compiled
    local = cuda.shared.array(256, dtype=np.uint64)
    t = cuda.threadIdx.x
    for b in range(t, 256, cuda.blockDim.x):
        local[b] = U0
    cuda.syncthreads()
    candidates = state[SOURCE] != U0
    m = np.int64(state[CANDIDATES]) if candidates else n
    prefix, prefix_mask = state[PREFIX], state[PREFIX_MASK]
    for i in range(cuda.grid(1), m, cuda.gridsize(1)):
        key = np.uint64(keys[i] if candidates else _key(bits[i], mask, nan_key))
        if (key & prefix_mask) == prefix:
            cuda.atomic.add(local, (key >> np.uint64(shift)) & np.uint64(255), U1)
    cuda.syncthreads()
    for b in range(t, 256, cuda.blockDim.x):
        if local[b]:
            cuda.atomic.add(hist, b, local[b])


@cuda.jit
def choose_byte(hist, state, shift):  # pragma: no cover - compiled
    """Thread 0 alone here, from the top byte down."""
    if cuda.threadIdx.x != 0:
        return
    wanted, above, found = state[WANTED], U0, False
    for b in range(255, -1, -1):
        if not found and above + hist[b] >= wanted:
            state[PREFIX] |= np.uint64(b) << np.uint64(shift)
            state[PREFIX_MASK] |= np.uint64(255) << np.uint64(shift)
            state[WANTED] = wanted - above
            found = True
        above += hist[b]
        hist[b] = U0


@cuda.jit
def mark(bits, n, mask, nan_key, keys, positions, state, above, at):  # pragma: no cover - compiled
    kth = state[PREFIX]
    candidates = state[SOURCE] != U0
    m = np.int64(state[CANDIDATES]) if candidates else n
    for i in range(cuda.grid(1), m, cuda.gridsize(1)):
        key = np.uint64(keys[i] if candidates else _key(bits[i], mask, nan_key))
        p = positions[i] if candidates else np.int64(i)
        bit = np.uint32(1) << np.uint32(p & 31)
        if key > kth:
            cuda.atomic.or_(above, p >> 5, bit)
        elif key == kth:
            cuda.atomic.or_(at, p >> 5, bit)


@cuda.jit(device=True)
def _count_words(above, at, first, words):  # pragma: no cover - compiled
    over, tied = U0, U0
    for w in range(first, min(first + WORDS, words)):
        over += np.uint64(cuda.popc(above[w]))
        tied += np.uint64(cuda.popc(at[w]))
    return over, tied


@cuda.jit(device=True)
def _block_scan(v, buf):  # pragma: no cover - compiled
    """An inclusive scan of one value per thread across the block, in shared memory."""
    t = cuda.threadIdx.x
    buf[t] = v
    cuda.syncthreads()
    step = 1
    while step < COMPACT_THREADS:
        add = buf[t - step] if t >= step else U0
        cuda.syncthreads()
        buf[t] += add
        cuda.syncthreads()
        step *= 2
    mine = buf[t]
    cuda.syncthreads()
    return mine


@cuda.jit
def word_sums(above, at, words, sums, blocks):  # pragma: no cover - compiled
    buf = cuda.shared.array(COMPACT_THREADS, dtype=np.uint64)
    over, tied = _count_words(above, at, (cuda.blockIdx.x * COMPACT_THREADS + cuda.threadIdx.x) * WORDS, words)
    over = _block_scan(over, buf)
    tied = _block_scan(tied, buf)
    if cuda.threadIdx.x == COMPACT_THREADS - 1:
        sums[cuda.blockIdx.x] = over
        sums[blocks + cuda.blockIdx.x] = tied


@cuda.jit
def scan_sums(sums, blocks):  # pragma: no cover - compiled
    """One thread here: both halves made exclusive prefix sums, in place."""
    if cuda.threadIdx.x != 0:
        return
    for half in range(2):
        carry = U0
        for i in range(half * blocks, (half + 1) * blocks):
            v = sums[i]
            sums[i] = carry
            carry += v


@cuda.jit
def write_positions(above, at, words, sums, blocks, state, out):  # pragma: no cover - compiled
    buf = cuda.shared.array(COMPACT_THREADS, dtype=np.uint64)
    first = (cuda.blockIdx.x * COMPACT_THREADS + cuda.threadIdx.x) * WORDS
    over, tied = _count_words(above, at, first, words)
    over_before = sums[cuda.blockIdx.x] + _block_scan(over, buf) - over
    tied_before = sums[blocks + cuda.blockIdx.x] + _block_scan(tied, buf) - tied
    wanted = state[WANTED]
    for w in range(first, min(first + WORDS, words)):
        a, t = above[w], at[w]
        for j in range(32):
            bit = np.uint32(1) << np.uint32(j)
            if a & bit:
                out[over_before + min(tied_before, wanted)] = w * 32 + j
                over_before += U1
            elif t & bit:
                if tied_before < wanted:
                    out[over_before + tied_before] = w * 32 + j
                tied_before += U1


@cuda.jit
def sample_keys(bits, mask, nan_key, stride, m, keys):  # pragma: no cover - compiled
    for i in range(cuda.grid(1), m, cuda.gridsize(1)):
        keys[i] = _key(bits[i * stride], mask, nan_key)


@cuda.jit
def count_at_least(bits, n, mask, nan_key, keys, state, floors, counts):  # pragma: no cover - compiled
    """counts[j] += #(key >= floors[j]), over the candidates when the state
    says so, else the array: a key finds its bucket [f[j], f[j+1]) by binary
    search, and the block adds the buckets' suffix sums."""
    bucket = cuda.shared.array(FLOORS, dtype=np.uint64)
    t = cuda.threadIdx.x
    for j in range(t, FLOORS, cuda.blockDim.x):
        bucket[j] = U0
    cuda.syncthreads()
    candidates = state[SOURCE] != U0
    m = np.int64(state[CANDIDATES]) if candidates else n
    for i in range(cuda.grid(1), m, cuda.gridsize(1)):
        key = np.uint64(keys[i] if candidates else _key(bits[i], mask, nan_key))
        if key >= floors[0]:
            j = 0
            step = (FLOORS + 1) // 2
            while step > 0:
                if j + step < FLOORS and floors[j + step] <= key:
                    j += step
                step //= 2
            cuda.atomic.add(bucket, j, U1)
    cuda.syncthreads()
    if t == 0:
        at_or_above = U0
        for j in range(FLOORS - 1, -1, -1):
            at_or_above += bucket[j]
            if at_or_above:
                cuda.atomic.add(counts, j, at_or_above)


@cuda.jit
def regather(bits, n, mask, nan_key, keys, positions, state, keys_out, positions_out, capacity):  # pragma: no cover - compiled
    """Every key at or above the floor among the candidates (the array when
    they are not all there), one slot at a time."""
    candidates = state[SOURCE] != U0
    m = np.int64(state[CANDIDATES]) if candidates else n
    floor = state[FLOOR]
    for i in range(cuda.grid(1), m, cuda.gridsize(1)):
        key = np.uint64(keys[i] if candidates else _key(bits[i], mask, nan_key))
        if key >= floor:
            slot = cuda.atomic.add(state, COUNT, U1)
            if slot < capacity:
                keys_out[slot] = key
                positions_out[slot] = positions[i] if candidates else np.int64(i)


@cuda.jit
def steer(state, floors, counts, k, narrow):  # pragma: no cover - compiled
    """Thread 0 alone here."""
    if cuda.threadIdx.x != 0:
        return
    if narrow:
        for j in range(FLOORS):
            if counts[j] > k:
                state[LO] = floors[j]
        for j in range(FLOORS - 1, -1, -1):
            if counts[j] <= k:
                state[HI] = floors[j]
    lo = state[LO]
    width = state[HI] - lo
    parts = np.uint64(FLOORS + 1)
    step, rest = width // parts, width % parts
    for j in range(FLOORS):
        scale = np.uint64(j + 1)
        floors[j] = lo + scale * step + scale * rest // parts
        counts[j] = U0
    state[FLOOR] = lo


@cuda.jit
def settle(state, margin, k, no_floor, adapt):  # pragma: no cover - compiled
    kth, floor = state[PREFIX], state[FLOOR]
    if adapt and floor != no_floor:
        if kth < floor:
            margin[0] = margin[0] * margin[0]
        elif state[COUNT] > np.uint64(3) * k // np.uint64(2):
            margin[0] = math.sqrt(margin[0])
    state[PREVIOUS] = kth


@functools.lru_cache(maxsize=None)
def _float_kernels(width: int) -> Dict[str, Any]:
    """The kernels that read a magnitude from a key, for floats of ``width`` bits."""
    mantissa_bits, exponent_bits = {16: (10, 5), 32: (23, 8), 64: (52, 11)}[width]
    bias = (1 << (exponent_bits - 1)) - 1
    exponent_mask = np.uint64((1 << exponent_bits) - 1)
    mantissa_mask = np.uint64((1 << mantissa_bits) - 1)
    implicit = float(1 << mantissa_bits)

    @cuda.jit(device=True)
    def magnitude_of(key):  # pragma: no cover - compiled
        """The magnitude of a finite key."""
        b = np.uint64(key)
        exponent = np.int64((b >> np.uint64(mantissa_bits)) & exponent_mask)
        mantissa = float(b & mantissa_mask)
        if exponent == 0:
            return math.ldexp(mantissa, int(1 - bias - mantissa_bits))
        return math.ldexp(implicit + mantissa, int(exponent - bias - mantissa_bits))

    @cuda.jit(device=True)
    def key_at_least(v, inf_key):  # pragma: no cover - compiled
        lo, hi = U0, np.uint64(inf_key)
        while lo < hi:
            mid = lo + (hi - lo) // np.uint64(2)
            if magnitude_of(mid) >= v:
                hi = mid
            else:
                lo = mid + U1
        return lo

    @cuda.jit
    def finite_stats(bits, n, mask, inf_key, stats, state):  # pragma: no cover - compiled
        total, count, top = 0.0, 0.0, U0
        for i in range(cuda.grid(1), n, cuda.gridsize(1)):
            key = np.uint64(bits[i] & mask)
            if key < inf_key:
                total += magnitude_of(key)
                count += 1.0
                top = max(top, key)
        cuda.atomic.add(stats, 0, total)
        cuda.atomic.add(stats, 1, count)
        cuda.atomic.max(state, HI, top)

    @cuda.jit
    def mean_bracket(stats, state, inf_key):  # pragma: no cover - compiled
        top = state[HI]
        state[LO] = min(key_at_least(stats[0] / stats[1], inf_key) if stats[1] > 0.0 else U0, top)
        state[HI] = top + U1

    @cuda.jit
    def warm_floor(state, margin, inf_key, nan_key):  # pragma: no cover - compiled
        previous = state[PREVIOUS]
        if previous != np.uint64(0xFFFF_FFFF_FFFF_FFFF) and previous > U0 and previous < inf_key:
            state[FLOOR] = key_at_least(magnitude_of(previous) * margin[0], inf_key)
        else:
            state[FLOOR] = np.uint64(nan_key) + U1

    return {"finite_stats": finite_stats, "mean_bracket": mean_bracket, "warm_floor": warm_floor}


_COMMON = {name: globals()[name] for name in (
    "clear_slot", "set_floor", "gather_at_least", "begin_radix", "histogram", "choose_byte", "mark", "word_sums",
    "scan_sums", "write_positions", "sample_keys", "count_at_least", "regather", "steer", "settle")}


class NumbaKernels:
    """``select_plan.KernelSet`` over NumPy arrays, for floats of ``width`` bits."""

    xp = np
    compact_threads = COMPACT_THREADS
    words = WORDS

    def __init__(self, width: int):
        self.kernels = {**_COMMON, **_float_kernels(width)}

    def grid(self, n: int) -> Tuple[int, int]:
        return max(1, min(BLOCKS, -(-n // (4 * THREADS)))), THREADS

    def launch(self, name: str, template: str, blocks: int, threads: int, *args: Any) -> None:
        self.kernels[name][blocks, threads](*args)


@functools.lru_cache(maxsize=None)
def kernels(width: int) -> NumbaKernels:
    return NumbaKernels(width)
