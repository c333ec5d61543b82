"""Magnitude keys: the one total order every CPU selector ranks entries by.

The order is ``|x|`` with two rules for what ``|x|`` leaves open:

* **NaN** is larger than every number, ``+-Inf`` included, and all NaNs are
  equal (sign and payload ignored). A NaN in a gradient is therefore always
  selected and surfaces in the reduced result at once, instead of hiding in
  an error-feedback residual until it poisons every later step.
* **Ties** go to the lowest positions (the contract in docs/design.md, Selection).

For floats the key of an entry is its bit pattern with the sign bit cleared,
read as an unsigned integer: for non-negative IEEE numbers the bit order *is*
the numeric order, and every NaN pattern lies above the pattern of Inf, so
NaNs need only be clamped to one canonical key (``inf_key + 1``). Reading keys
from a view of the input costs no copy. For integers the key is ``|x|`` as an
unsigned integer of the same width, which is exact even for the most negative
value (whose two's-complement ``abs`` wraps to itself, i.e. ``2**(w-1)``).

The hot loop over the full array is compiled with Numba: one pass that tests
blocks of entries and writes the positions of the few blocks that reach the
floor costs about one and a half plain reductions over memory, where NumPy
needs three passes (``abs``, compare, ``flatnonzero``). Its twin ``_sweep``
adds error feedback's fresh values in the same pass (``fused.py``).
"""
from __future__ import annotations

import functools
import math
from typing import NamedTuple, Tuple, Union

import numba
import numpy as np

from . import passes

#: Entries per strided sample used to estimate where the k-th magnitude lies.
SAMPLE = 1 << 15


#: What a sweep adds: an array, or a tuple of arrays added as their sum.
Fresh = Union[np.ndarray, Tuple[np.ndarray, ...], None]


class FloatLayout(NamedTuple):
    bits: type  # unsigned integer type of the same width
    mask: int  # every bit but the sign
    inf_key: int  # key of +Inf; keys above it are NaN


_FLOAT_LAYOUTS = {
    np.dtype(np.float16): FloatLayout(np.uint16, 0x7FFF, 0x7C00),
    np.dtype(np.float32): FloatLayout(np.uint32, 0x7FFF_FFFF, 0x7F80_0000),
    np.dtype(np.float64): FloatLayout(np.uint64, 0x7FFF_FFFF_FFFF_FFFF, 0x7FF0_0000_0000_0000),
}


def native(x: np.ndarray) -> np.ndarray:
    """``x`` as a contiguous native-endian array, copied only when it is not one."""
    return np.ascontiguousarray(x, dtype=x.dtype.newbyteorder("="))


def float_layout(dtype: np.dtype) -> FloatLayout | None:
    """The bit layout of a float dtype we rank by bits, else None (integers)."""
    return _FLOAT_LAYOUTS.get(np.dtype(dtype).newbyteorder("="))


def magnitude_keys(x: np.ndarray) -> np.ndarray:
    """Keys of every entry (a new array): unsigned, ordered as the magnitudes."""
    layout = float_layout(x.dtype)
    passes.book("keys", x.size, x.size)
    if layout is not None:
        keys = native(x).view(layout.bits) & layout.bits(layout.mask)
        return canonical_nan(keys, layout)
    unsigned = np.dtype(f"u{x.dtype.itemsize}")
    if x.dtype.kind == "u":
        return native(x).astype(unsigned, copy=True)
    return np.abs(native(x)).view(unsigned)


def canonical_nan(keys: np.ndarray, layout: FloatLayout | None) -> np.ndarray:
    """Clamp every NaN key to ``inf_key + 1`` in place, so that all NaNs tie."""
    if layout is not None:
        np.minimum(keys, keys.dtype.type(layout.inf_key + 1), out=keys)
    return keys


def pick_top(keys: np.ndarray, k: int) -> tuple[np.ndarray, int]:
    """Mask of the ``k`` largest keys, ties to the lowest positions (the contract), and the k-th key.

    Needs ``1 <= k <= keys.size``.
    """
    t = kth_key(keys, k)
    chosen = keys > t
    short = k - int(np.count_nonzero(chosen))
    chosen[np.flatnonzero(keys == t)[:short]] = True
    return chosen, int(t)


def kth_key(keys: np.ndarray, k: int):
    """The k-th largest key (``k <= keys.size``)."""
    return np.partition(keys, keys.size - k)[keys.size - k]


#: Entries a sweep adds and tests at once: small enough that at density 0.001
#: most blocks hold no candidate and are passed over once added.
BLOCK = 64


@numba.njit(nogil=True, cache=True)
def _sweep(values, bits, fresh, widen, zero, mask, floor, least, positions, keys):  # pragma: no cover - compiled
    """``_scan`` of ``values`` after adding ``fresh`` into it (widened through
    the table ``widen`` when given); where ``zero`` is not empty, it is
    ``fresh`` itself, writable, added through this name and zeroed once read
    (``fresh`` may be read-only, where Numba would compile no write to it).
    ``bits`` is a view of ``values``, and ``least`` the magnitude whose key
    is ``floor``.

    Block by block: the add compares each sum with ``least`` as it goes, as
    floats, which vectorises with the add (``not |x| < least`` holds for a
    NaN too, whose key lies above every floor, and for every entry when
    ``least`` is itself a NaN pattern), and only a block that reaches it is
    searched by key, while it is in cache. A block's test on its keys instead
    (their largest, after the add) widened them to 64 bits and cost half a
    read more; a branch per entry kept the add from vectorising.
    """
    count = 0
    clear = zero.size > 0
    for start in range(0, values.size, BLOCK):
        stop = min(start + BLOCK, values.size)
        if clear:
            reached = _add_zero_reaches(values[start:stop], zero[start:stop], least)
        else:
            reached = _add_reaches(values[start:stop], fresh[start:stop], widen, least)
        if reached:
            count = _collect(bits, start, stop, mask, floor, positions, keys, count)
    return count


@numba.njit(nogil=True, cache=True)
def _scan(values, bits, mask, floor, least, positions, keys):  # pragma: no cover - compiled
    """Write each position with key ``bits & mask >= floor``, and its key; return how many.

    Keeps counting past the end of the output so that the caller can size a
    retry. Block by block, as ``_sweep``: a block's magnitudes are compared
    with ``least`` as floats, which vectorises, and only a block that reaches
    it is searched by key. ``values`` None (float16, which Numba cannot
    load as a float): the block is tested on its keys, which also
    vectorises. A branch per entry, the form before, took 2.1 to 2.3 reads
    of the array, the block tests 1.5.
    """
    count = 0
    for start in range(0, bits.size, BLOCK):
        stop = min(start + BLOCK, bits.size)
        if values is None:
            reached = _keys_reach(bits[start:stop], mask, floor)
        else:
            reached = _reaches(values[start:stop], least)
        if reached:
            count = _collect(bits, start, stop, mask, floor, positions, keys, count)
    return count


@numba.njit(nogil=True, cache=True, inline="always")
def _reaches(values, least):  # pragma: no cover - compiled
    """Whether any magnitude is not below ``least`` (a NaN is not)."""
    reached = False
    for i in range(values.size):
        reached |= not (abs(values[i]) < least)
    return reached


@numba.njit(nogil=True, cache=True, inline="always")
def _keys_reach(bits, mask, floor):  # pragma: no cover - compiled
    """Whether any key ``bits & mask`` is at least ``floor``."""
    reached = False
    for i in range(bits.size):
        reached |= (bits[i] & mask) >= floor
    return reached


@numba.njit(nogil=True, cache=True)
def _sweep_parts(values, bits, parts, mask, floor, least, positions, keys):  # pragma: no cover - compiled
    """``_sweep`` of the sum of ``parts`` (a tuple of arrays of ``values``'
    dtype), taken block by block in their order as ``sum_parts`` takes it:
    the node's sum of a shard and the candidate pass of its residual in one."""
    count = 0
    partial = np.empty(BLOCK, values.dtype)
    for start in range(0, values.size, BLOCK):
        stop = min(start + BLOCK, values.size)
        block = partial[: stop - start]
        first = parts[0][start:stop]
        for i in range(block.size):
            block[i] = first[i]
        for j in range(1, len(parts)):
            part = parts[j][start:stop]
            for i in range(block.size):
                block[i] += part[i]
        if _add_reaches(values[start:stop], block, None, least):
            count = _collect(bits, start, stop, mask, floor, positions, keys, count)
    return count


@numba.njit(nogil=True, cache=True, inline="always")
def _add_reaches(values, fresh, widen, least):  # pragma: no cover - compiled
    """``values += fresh``; whether any sum's magnitude is not below ``least``."""
    reached = False
    if widen is None:
        for i in range(values.size):
            x = values[i] + fresh[i]
            values[i] = x
            reached |= not (abs(x) < least)
    else:  # a 16-bit float's bits index the table of their float32 values
        for i in range(values.size):
            x = values[i] + widen[fresh[i]]
            values[i] = x
            reached |= not (abs(x) < least)
    return reached


@numba.njit(nogil=True, cache=True, inline="always")
def _add_zero_reaches(values, fresh, least):  # pragma: no cover - compiled
    """``_add_reaches`` of a ``fresh`` of ``values``' dtype, zeroed once read."""
    reached = False
    for i in range(values.size):
        x = values[i] + fresh[i]
        values[i] = x
        fresh[i] = 0
        reached |= not (abs(x) < least)
    return reached


@numba.njit(nogil=True, cache=True, inline="always")
def _collect(bits, start, stop, mask, floor, positions, keys, count):  # pragma: no cover - compiled
    """``_scan`` of ``bits[start:stop]``, its finds written from ``count`` on; the new count."""
    capacity = positions.size
    block = bits[start:stop]
    for i in range(block.size):
        key = block[i] & mask
        if key >= floor:
            if count < capacity:
                positions[count] = start + i
                keys[count] = key
            count += 1
    return count


@numba.njit(nogil=True, cache=True, fastmath={"reassoc", "contract"})
def _finite_stats(x, bits, mask, inf_key):  # pragma: no cover - compiled
    """Sum of the finite magnitudes, their largest key, and how many are finite.

    ``reassoc`` lets the compiler vectorise the sum (it does not permit it to
    assume that NaN or Inf are absent, which the select below relies on).
    """
    total = 0.0
    top = np.int64(0)
    finite = 0
    for i in range(x.size):
        key = np.int64(bits[i]) & mask
        ok = key < inf_key
        total += abs(np.float64(x[i])) if ok else 0.0
        top = max(top, key if ok else np.int64(0))
        finite += ok
    return total, top, finite


def scan(x: np.ndarray, layout: FloatLayout, floor: int, expect: int, fresh: Fresh = None, clear: bool = False
         ) -> tuple[np.ndarray, np.ndarray]:
    """Ascending positions and keys of every entry of float array ``x`` with key ``>= floor``;
    with ``fresh``, ``x += fresh`` first, in the same pass (``fresh`` of x's
    dtype, or a 16-bit float for a float32 ``x``, widened exactly; or a tuple
    of arrays of x's dtype, whose sum in order is added). ``clear``: zero
    ``fresh`` (an array) in the same pass, once read: it is a result array
    that would otherwise be zero-filled in a pass of its own.

    ``expect`` sizes the output; a second pass, never adding again, runs only when it was too small.
    """
    bits = x.view(layout.bits)
    floor = min(floor, layout.inf_key + 1)  # every NaN ties, whatever its payload: a NaN floor admits them all
    widen = None
    if clear and not (isinstance(fresh, np.ndarray) and fresh.dtype == x.dtype):
        raise ValueError(f"clear zeroes the {x.dtype} array it adds; got "
                         f"{getattr(fresh, 'dtype', type(fresh).__name__)}")
    if isinstance(fresh, np.ndarray) and fresh.dtype != x.dtype:
        widen = widening_table(fresh.dtype)
        fresh = fresh.view(np.uint16)
    floats = layout.bits is not np.uint16  # Numba computes in float32 and float64, not float16
    mask, least = layout.bits(layout.mask), np.array(floor, dtype=layout.bits).view(x.dtype)[()] if floats else 0.0
    size = min(x.size, max(expect, 1024))
    while True:
        positions = np.empty(size, dtype=np.int64)
        keys = np.empty(size, dtype=layout.bits)
        if fresh is None:
            count = _scan(x if floats else None, bits, mask, layout.bits(floor), least, positions, keys)
            passes.book("candidates", x.size)
        elif isinstance(fresh, tuple):
            count = _sweep_parts(x, bits, _typed_alike(fresh), mask, layout.bits(floor), least, positions, keys)
            passes.book("node sum and candidates", x.size * (1 + len(fresh)), x.size)
        else:
            zero = fresh if clear else fresh[:0].copy()  # a copy: writable
            count = _sweep(x, bits, fresh, widen, zero, mask, layout.bits(floor), least, positions, keys)
            passes.book("candidates", 2 * x.size, (1 + clear) * x.size)
        if count <= size:
            return positions[:count], keys[:count]
        size, fresh, widen = count, None, None


def _typed_alike(parts: Tuple[np.ndarray, ...]) -> Tuple[np.ndarray, ...]:
    """``parts`` as read-only, aligned views, which Numba types alike: a tuple
    it indexes by a variable must hold one type, and a caller's read-only
    gradient (a JAX array's, say) meets the node's writable shared memory."""
    views = []
    for part in parts:
        view = (part if part.flags.aligned else part.copy()).view()  # unaligned: never from NumPy's own allocations
        view.flags.writeable = False
        views.append(view)
    return tuple(views)


@functools.lru_cache(maxsize=None)
def widening_table(dtype: np.dtype) -> np.ndarray:
    """The float32 value of every bit pattern of a 16-bit float ``dtype``: widening
    by lookup, which Numba can do for float16 and bfloat16 alike."""
    return np.arange(1 << 16, dtype=np.uint16).view(dtype).astype(np.float32)


def finite_stats(x: np.ndarray, layout: FloatLayout) -> tuple[float, float]:
    """``(mean, max)`` of the finite magnitudes of ``x``; ``(0, 0)`` when none is finite."""
    if x.dtype == np.float16:  # Numba has no float16 arithmetic; a float32 copy is small
        a = np.abs(x[np.isfinite(x)], dtype=np.float32)
        return (float(a.mean(dtype=np.float64)), float(a.max())) if a.size else (0.0, 0.0)
    total, top, finite = _finite_stats(x, x.view(layout.bits), layout.mask, layout.inf_key)
    passes.book("finite stats", x.size)
    if finite == 0:
        return 0.0, 0.0
    return total / finite, float(np.array(top, dtype=layout.bits).view(x.dtype))


def sample_floors(x: np.ndarray, layout: FloatLayout, k: int, sample: np.ndarray | None = None):
    """Ever lower key floors, each likelier to have ``>= k`` entries at or above it.

    The first is a high-confidence lower bound on the k-th largest key read off
    a strided sample (the sample's expected count above it plus four standard
    deviations), so one candidate pass nearly always suffices and keeps about
    1-2k candidates. Structured data can fool a sample; each further floor
    admits eight times as many sample entries, and the last admits everything.
    ``sample``: ``x[sample_step(x.size)]`` as it will be, where ``x`` is still
    to be summed by the sweep that searches it.
    """
    n = x.size
    if sample is None:
        sample = x[sample_step(n)]
    keys = sample.view(layout.bits) & layout.bits(layout.mask)
    m = keys.size
    expected = k * m / n
    rank = int(expected + 4.0 * math.sqrt(expected)) + 4
    while rank < m:
        yield int(kth_key(keys, rank)), rank * n // m
        rank *= 8
    yield 0, n


def sample_step(n: int) -> slice:
    """The strided positions of the sample of a vector of ``n``."""
    return slice(None, None, max(1, n // SAMPLE))


def candidates_from(x: np.ndarray, layout: FloatLayout, k: int, floors) -> tuple[np.ndarray, np.ndarray]:
    """Positions and canonical keys of all entries above the first floor that yields ``>= k``.

    The set contains every entry whose key is at least the k-th largest, so the
    exact top-k set can be picked from it alone.
    """
    for floor, expect in floors:
        positions, keys = scan(x, layout, floor, 2 * expect)
        if positions.size >= k:
            return positions, canonical_nan(keys, layout)
    raise AssertionError("the last floor admits every entry")  # pragma: no cover
