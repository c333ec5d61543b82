"""Codecs: how the values and the indices of the (index, value) pairs look on the wire.

A codec turns k values of an allreducer's sum dtype into bytes and back.
Without one the values travel as they are (float32, or float64), the bits
the algorithms always sent. The others narrow them:

* ``float32``: a float64 sum's values narrowed to float32 (a float32 sum's
  travel as they are);
* ``float16``: IEEE half precision, saturated at +-65504, so that a large
  value never becomes Inf;
* ``bfloat16``: the top 16 bits of float32, rounded to nearest even (integer
  operations, so CuPy runs it as NumPy does);
* ``int8``: blocks of 256 values with one float32 scale each, max|v| / 127,
  every value rounded to the nearest step (the blocked quantization of
  ZeRO++'s qgZ).

An allreducer returns what a lossy codec rounded away to its residual: the
residual keeps ``value - decoded(value)`` where a selected value was sent,
so error feedback conserves exactly what was applied.

Index codecs are lossless. The k ascending positions of a record within a
span of n (a shard, or the vector) travel as:

* ``int32``: 4 bytes each;
* ``delta16``: the gaps between consecutive positions in 16 bits; a gap of
  65535 or more is broken by escapes (65535: move on, emit nothing), and the
  record has room for the most escapes a span of n can need, so its size
  depends on k and n alone;
* ``bitmap``: one bit per position of the span.

``auto`` takes whichever is smallest for k and n, which every rank of the
exchange knows, so all agree without a message.
"""
from __future__ import annotations

from typing import Any, Optional

import numpy as np

VALUES = ("float32", "float16", "bfloat16", "int8")
INDICES = ("int32", "auto")
#: The values of one int8 block share its scale.
BLOCK = 256
_FLOAT16_MAX = float(np.finfo(np.float16).max)
_BFLOAT16_MAX = 3.3895313892515355e38  # 0x7F7F: the largest finite bfloat16
_FLOAT32_MAX = float(np.finfo(np.float32).max)


class Exact:
    """The values as the sum holds them."""

    lossy = False

    def __init__(self, dtype: Any, xp: Any):
        self.dtype, self.xp = np.dtype(dtype), xp

    def nbytes(self, k: int) -> int:
        return k * self.dtype.itemsize

    def encode(self, values: Any, raw: Any) -> None:
        """Write ``values`` (k of them) into ``raw``, ``nbytes(k)`` bytes."""
        raw[: values.size * self.dtype.itemsize].view(self.dtype)[...] = values

    def decode(self, raw: Any, k: int) -> Any:
        """The values of every record of ``raw`` (records x at least nbytes(k) bytes), as (records, k)."""
        return self._part(raw, 0, self.nbytes(k)).view(self.dtype)

    def _part(self, raw: Any, start: int, stop: int) -> Any:
        return self.xp.ascontiguousarray(raw[:, start:stop])


class Cast(Exact):
    """Values cast to a narrower float type, saturated at its largest finite value."""

    lossy = True

    def __init__(self, dtype: Any, xp: Any, wire: Any, largest: float):
        super().__init__(dtype, xp)
        self.wire, self.largest = np.dtype(wire), largest

    def nbytes(self, k: int) -> int:
        return k * self.wire.itemsize

    def encode(self, values: Any, raw: Any) -> None:
        clipped = self.xp.clip(values, -self.largest, self.largest)
        raw[: self.nbytes(values.size)].view(self.wire)[...] = clipped

    def decode(self, raw: Any, k: int) -> Any:
        return self._part(raw, 0, self.nbytes(k)).view(self.wire).astype(self.dtype)


class Float16(Cast):
    """IEEE half precision by integer operations on float32's bits, rounded to
    nearest even. NumPy's own cast takes a slow path (25x here) for values
    that become float16 subnormals, below 6.1e-5, which is where most
    gradient values lie. A float64 sum is cast by NumPy (one rounding)."""

    #: Moves float32's exponent to float16's and adds the rounding bias below bit 13.
    REBIAS = np.uint32((((15 - 127) << 23) + 0xFFF) & 0xFFFFFFFF)
    #: float32 bits of 2^-14, float16's smallest normal value.
    SMALLEST_NORMAL = np.uint32(113 << 23)

    def __init__(self, dtype: Any, xp: Any):
        super().__init__(dtype, xp, np.float16, _FLOAT16_MAX)

    def encode(self, values: Any, raw: Any) -> None:
        if self.dtype != np.float32:
            return super().encode(values, raw)
        xp = self.xp  # in place where it can: every pass over the values counts
        bits = xp.clip(values, -self.largest, self.largest).view(np.uint32)
        magnitude = bits & np.uint32(0x7FFFFFFF)
        normal = magnitude >> np.uint32(13)
        normal &= np.uint32(1)  # the bit that breaks ties to even
        normal += magnitude
        normal += self.REBIAS
        normal >>= np.uint32(13)
        # Below 2^-14, adding 0.5 in float32 puts the 10 bits a subnormal half keeps
        # at the bottom of the mantissa, rounded to nearest even by the addition itself.
        tiny = magnitude < self.SMALLEST_NORMAL
        aligned = magnitude.view(np.float32)
        aligned += np.float32(0.5)
        xp.copyto(normal, aligned.view(np.uint32) - np.uint32(126 << 23), where=tiny)
        bits >>= np.uint32(16)
        bits &= np.uint32(0x8000)
        normal |= bits
        raw[: 2 * values.size].view(np.uint16)[...] = normal

    def decode(self, raw: Any, k: int) -> Any:
        xp = self.xp
        halves = self._part(raw, 0, 2 * k).view(np.uint16)
        bits = halves.astype(np.uint32)
        bits &= np.uint32(0x7FFF)
        bits <<= np.uint32(13)
        tiny = bits < np.uint32(1 << 23)  # exponent 0: zero or subnormal
        bits += np.uint32(112 << 23)
        subnormal = (bits + np.uint32(1 << 23)).view(np.float32)
        subnormal -= np.float32(2.0**-14)
        xp.copyto(bits, subnormal.view(np.uint32), where=tiny)
        bits |= (halves & np.uint16(0x8000)).astype(np.uint32) << np.uint32(16)
        return bits.view(np.float32).astype(self.dtype, copy=False)


class BFloat16(Exact):
    """float32's top 16 bits, rounded to nearest even."""

    lossy = True

    def nbytes(self, k: int) -> int:
        return 2 * k

    def encode(self, values: Any, raw: Any) -> None:
        xp = self.xp
        bits = xp.clip(values, -_BFLOAT16_MAX, _BFLOAT16_MAX).astype(np.float32).view(np.uint32)
        rounded = (bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)
        raw[: 2 * values.size].view(np.uint16)[...] = rounded.astype(np.uint16)

    def decode(self, raw: Any, k: int) -> Any:
        halves = self._part(raw, 0, 2 * k).view(np.uint16)
        return (halves.astype(np.uint32) << np.uint32(16)).view(np.float32).astype(self.dtype)


class Int8Blocks(Exact):
    """``[one float32 scale per block | k int8 steps]``."""

    lossy = True

    @staticmethod
    def blocks(k: int) -> int:
        return -(-k // BLOCK)

    def nbytes(self, k: int) -> int:
        return 4 * self.blocks(k) + k

    def encode(self, values: Any, raw: Any) -> None:
        xp, k = self.xp, values.size
        n = self.blocks(k)
        padded = xp.zeros(n * BLOCK, dtype=np.float32)
        padded[:k] = xp.clip(values, -_FLOAT32_MAX, _FLOAT32_MAX)  # a float64 value beyond float32's range
        padded = padded.reshape(n, BLOCK)
        scales = (xp.max(xp.abs(padded), axis=1) / np.float32(127)).astype(np.float32)
        steps = xp.rint(padded / xp.where(scales > 0, scales, np.float32(1))[:, None])
        raw[: 4 * n].view(np.float32)[...] = scales
        raw[4 * n : 4 * n + k].view(np.int8)[...] = xp.clip(steps, -127, 127).reshape(-1)[:k].astype(np.int8)

    def decode(self, raw: Any, k: int) -> Any:
        """Each step times its block's scale in float32, saturated: at a scale near
        float32's largest value, 127 steps round to Inf, which becomes that value."""
        xp, n, whole = self.xp, self.blocks(k), k // BLOCK
        scales = self._part(raw, 0, 4 * n).view(np.float32)
        steps = self._part(raw, 4 * n, 4 * n + k).view(np.int8)
        records = steps.shape[0]
        values = xp.empty(steps.shape, np.float32)
        full = values[:, : whole * BLOCK].reshape(records, whole, BLOCK)
        with np.errstate(over="ignore"):  # Inf is clipped below (CuPy does not warn)
            xp.multiply(steps[:, : whole * BLOCK].reshape(records, whole, BLOCK), scales[:, :whole, None], out=full)
            xp.multiply(steps[:, whole * BLOCK :], scales[:, whole:], out=values[:, whole * BLOCK :])  # a part block
        xp.clip(values, -_FLOAT32_MAX, _FLOAT32_MAX, out=values)
        return values.astype(self.dtype, copy=False)


def make_codec(name: Optional[str], dtype: Any, xp: Any) -> Exact:
    """The codec ``name`` (one of ``VALUES``, or None: as the sum holds them) for a sum of ``dtype``."""
    dtype = np.dtype(dtype)
    if name is None or name == dtype.name:
        return Exact(dtype, xp)
    if name == "float32":
        return Cast(dtype, xp, np.float32, _FLOAT32_MAX)
    if name == "float16":
        return Float16(dtype, xp)
    if name == "bfloat16":
        return BFloat16(dtype, xp)
    if name == "int8":
        return Int8Blocks(dtype, xp)
    raise ValueError(f"values must be one of {', '.join(VALUES)}, got {name!r}")


class Int32Indices:
    """Positions as int32."""

    name = "int32"

    def __init__(self, k: int, span: int, xp: Any):
        self.k, self.span, self.xp = k, span, xp

    def nbytes(self) -> int:
        return 4 * self.k

    def encode(self, indices: Any, raw: Any) -> None:
        raw[: self.nbytes()].view(np.int32)[...] = indices

    def decode(self, raw: Any) -> Any:
        """The positions of every record of ``raw`` (records x at least nbytes() bytes), as (records, k)."""
        return self.xp.ascontiguousarray(raw[:, : self.nbytes()]).view(np.int32)


class Delta16Indices(Int32Indices):
    """Gaps in 16 bits, with escapes for the long ones."""

    name = "delta16"
    ESCAPE = 0xFFFF

    def entries(self) -> int:
        return self.k + self.span // self.ESCAPE  # the k gaps, and the most escapes a span of n can need

    def nbytes(self) -> int:
        return 2 * self.entries()

    def encode(self, indices: Any, raw: Any) -> None:
        xp = self.xp
        positions = indices.astype(np.int64)
        gaps = xp.diff(positions, prepend=xp.zeros(1, dtype=np.int64))
        escapes = gaps // self.ESCAPE
        slots = xp.cumsum(escapes + 1) - 1  # where each gap's remainder goes, after its escapes
        stream = raw[: self.nbytes()].view(np.uint16)
        stream[...] = self.ESCAPE  # escapes, and the unused tail
        stream[slots] = (gaps - escapes * self.ESCAPE).astype(np.uint16)

    def decode(self, raw: Any) -> Any:
        xp = self.xp
        stream = xp.ascontiguousarray(raw[:, : self.nbytes()]).view(np.uint16)
        positions = xp.cumsum(stream.astype(np.int64), axis=1)
        return positions[stream != self.ESCAPE].reshape(stream.shape[0], self.k).astype(np.int32)


class BitmapIndices(Int32Indices):
    """One bit per position of the span."""

    name = "bitmap"

    def nbytes(self) -> int:
        return -(-self.span // 8)

    def encode(self, indices: Any, raw: Any) -> None:
        bits = self.xp.zeros(8 * self.nbytes(), dtype=np.uint8)
        bits[indices] = 1
        raw[: self.nbytes()] = self.xp.packbits(bits)

    def decode(self, raw: Any) -> Any:
        """Record by record: ``flatnonzero`` of a row of booleans is several times
        faster than ``nonzero`` of the whole (records, span) array."""
        xp = self.xp
        bits = xp.unpackbits(xp.ascontiguousarray(raw[:, : self.nbytes()]), axis=1).view(bool)
        positions = xp.empty((raw.shape[0], self.k), dtype=np.int32)
        for record, row in enumerate(bits):
            positions[record] = xp.flatnonzero(row)
        return positions


def make_index_codec(name: Optional[str], k: int, span: int, xp: Any) -> Int32Indices:
    """The index codec ``name`` (one of ``INDICES``, None meaning int32) for k positions in a span of ``span``."""
    if name is None or name == "int32":
        return Int32Indices(k, span, xp)
    if name == "auto":
        return min((cls(k, span, xp) for cls in (Int32Indices, Delta16Indices, BitmapIndices)),
                   key=lambda codec: codec.nbytes())  # ties to the earlier, simpler one
    raise ValueError(f"indices must be one of {', '.join(INDICES)}, got {name!r}")
