"""One exact top-k selection on a device as a fixed sequence of launches.

A selection never waits for the host: what a step needs from the one
before (the floor, how many the gather admitted, the k-th key, how many of
its ties are wanted) stays in ``Workspace.state`` on the device, and the
buffers are sized before the call from what the host knows (n, k, the
gather's room). Where the CPU methods branch on a count, a kernel reads the
state instead: the radix select and the marking read the gathered
candidates when there are at least k of them and all fitted, else the whole
array. So a poor floor costs passes, never correctness, and a selection can
be captured in a CUDA graph and replayed.

The steps, each a kernel of ``select.cu`` (CuPy) or of its twin in
``select_numba.py`` (numba-cuda, under Numba's simulator in CI):

1. a floor: the mean's bisection (``mstopk``), a strided sample's radix
   select (``threshold``), or the last k-th key times a margin
   (``threshold_warm``); ``exact`` needs none;
2. a gather of every key at or above the floor, with its position, in any
   order (one read of the array; the bisection gathers after its first pass
   and counts its later passes, and takes its last floor, among those);
3. a radix select of the k-th largest key T, a byte a pass, over the
   candidates (or the array);
4. two bitmaps, of the positions above T and of those at T, compacted in
   order: every position above T, and the lowest positions at T up to k.
   That is the contract of ``selection.py``, ties and NaN included.
"""
from __future__ import annotations

import math
from typing import Any, Protocol, Tuple

import numpy as np

from .magnitude import SAMPLE, float_layout

#: Slots of ``Workspace.state``, as ``select.cu``'s ``enum Slot`` names them.
STATE = ("floor", "count", "source", "candidates", "prefix", "prefix_mask", "wanted", "lo", "hi", "previous")
SLOT = {name: index for index, name in enumerate(STATE)}
#: ``previous`` before a first call.
NO_KEY = np.uint64(0xFFFF_FFFF_FFFF_FFFF)
#: Floors a bisection pass counts (8 halvings a pass), and the radix select's bits a pass.
FLOORS = 255
RADIX_BITS = 8
#: The C types of a float's bits and of its keys, by the width of the float.
C_TYPES = {2: ("unsigned short", "unsigned int"), 4: ("unsigned int", "unsigned int"),
           8: ("unsigned long long", "unsigned long long")}


class KernelSet(Protocol):
    """The kernels of ``select.cu`` (or their twins) and how to launch them."""

    xp: Any
    #: Threads of a block of the compaction kernels, and bitmap words each reads.
    compact_threads: int
    words: int

    def grid(self, n: int) -> Tuple[int, int]:
        """Blocks and threads of a pass over ``n`` entries."""

    def launch(self, name: str, template: str, blocks: int, threads: int, *args: Any) -> None:
        """Run kernel ``name`` (``template``: its C template arguments, or "")."""


class Workspace:
    """The device buffers and state of selections of ``k`` from ``n`` entries
    of one float type, allocated once and reused call after call."""

    def __init__(self, kernels: KernelSet, n: int, dtype: np.dtype, k: int, bisects: bool = False):
        layout = float_layout(dtype)
        if layout is None:
            raise TypeError(f"device top-k needs float16, float32 or float64, got {dtype}")
        xp = self.xp = kernels.xp
        self.kernels, self.n, self.k, self.dtype = kernels, n, k, np.dtype(dtype)
        bits_type, key_type = C_TYPES[np.dtype(layout.bits).itemsize]
        self.pair, self.key_type = f"{bits_type}, {key_type}", key_type
        self.key = np.uint64 if key_type == "unsigned long long" else np.uint32
        self.width = np.dtype(layout.bits).itemsize * 8
        self.mask, self.inf_key, self.nan_key = (self.key(v) for v in (layout.mask, layout.inf_key, layout.inf_key + 1))
        #: A floor above every key: the gather admits nothing.
        self.no_floor = np.uint64(layout.inf_key + 2)
        #: The gather's room: k and a margin, what a floor here usually admits.
        self.capacity = 2 * k + 1024
        self.state = xp.zeros(len(STATE), dtype=np.uint64)
        self.state[SLOT["previous"]] = NO_KEY
        self.margin = xp.zeros(1, dtype=np.float64)
        #: The strided sample ``threshold`` starts from: every stride-th entry, up to 2 * SAMPLE of them.
        self.stride = max(1, n // SAMPLE)
        self.sampled = -(-n // self.stride)
        room = max(self.capacity, self.sampled)
        self.keys = xp.empty(room, dtype=self.key)
        self.positions = xp.empty(room, dtype=np.int64)
        #: What the bisection's first pass keeps, which its later passes count over (``bisect``).
        self.kept_keys = xp.empty(self.capacity if bisects else 0, dtype=self.key)
        self.kept_positions = xp.empty(self.capacity if bisects else 0, dtype=np.int64)
        self.hist = xp.zeros(1 << RADIX_BITS, dtype=np.uint64)
        self.floors = xp.empty(FLOORS, dtype=self.key)
        self.counts = xp.zeros(FLOORS, dtype=np.uint64)
        self.stats = xp.zeros(2, dtype=np.float64)
        self.words = -(-n // 32)
        self.blocks = max(1, -(-self.words // (kernels.compact_threads * kernels.words)))
        self.bitmaps = xp.empty(2 * self.words, dtype=np.uint32)
        self.sums = xp.empty(2 * self.blocks, dtype=np.uint64)
        self.grid = kernels.grid(n)

    def fits(self, n: int, dtype: np.dtype, k: int) -> bool:
        return (n, np.dtype(dtype), k) == (self.n, self.dtype, self.k)

    def keep_warm_start(self, other: "Workspace") -> None:
        """Carry ``other``'s last k-th key and margin over (same float type), on the device."""
        if other.dtype == self.dtype:
            self.state[SLOT["previous"]:SLOT["previous"] + 1] = other.state[SLOT["previous"]:SLOT["previous"] + 1]
        self.margin[...] = other.margin

    # -- launching ---------------------------------------------------------------------
    def _pass(self, name: str, *args: Any) -> None:
        """A kernel that walks the array (grid-stride), with the float's template."""
        self.kernels.launch(name, self.pair, *self.grid, *args)

    def _one(self, name: str, template: str, *args: Any) -> None:
        """A one-thread kernel."""
        self.kernels.launch(name, template, 1, 1, *args)

    def _block(self, name: str, template: str, *args: Any) -> None:
        """A one-block kernel (a thread a byte, or a floor)."""
        self.kernels.launch(name, template, 1, self.kernels.compact_threads, *args)

    # -- the steps ---------------------------------------------------------------------
    def radix(self, bits: Any, k: int, capacity: int, given: int) -> None:
        """The k-th largest key into ``state["prefix"]`` and how many of its ties are
        wanted into ``state["wanted"]``: over the candidates (``given``: how many,
        or -1 for the gather's count) when there are k to ``capacity`` of them."""
        self._one("begin_radix", "", self.state, np.uint64(k), np.uint64(capacity), np.int64(given))
        for shift in range(self.width - RADIX_BITS, -1, -RADIX_BITS):
            self._pass("histogram", bits, np.int64(self.n), self.mask, self.nan_key, self.keys, self.state,
                       np.int32(shift), self.hist)
            self._block("choose_byte", "", self.hist, self.state, np.int32(shift))

    def gather(self, bits: Any) -> None:
        """Every key at or above ``state["floor"]``, with its position, counted."""
        self._one("clear_slot", "", self.state, np.int32(SLOT["count"]))
        self._pass("gather_at_least", bits, np.int64(self.n), self.mask, self.nan_key, self.state, self.keys,
                   self.positions, np.uint64(self.capacity))

    def compact(self, bits: Any) -> Any:
        """The answer: ascending positions of every key above the k-th and the
        lowest of those at it, k in all."""
        kernels, words = self.kernels, self.words
        out = self.xp.empty(self.k, dtype=np.int64)
        self.bitmaps.fill(0)
        above, at = self.bitmaps[:words], self.bitmaps[words:]
        self._pass("mark", bits, np.int64(self.n), self.mask, self.nan_key, self.keys, self.positions, self.state,
                   above, at)
        threads = kernels.compact_threads
        kernels.launch("word_sums", "", self.blocks, threads, above, at, np.int64(words), self.sums,
                       np.int64(self.blocks))
        kernels.launch("scan_sums", "", 1, threads, self.sums, np.int64(self.blocks))
        kernels.launch("write_positions", "", self.blocks, threads, above, at, np.int64(words), self.sums,
                       np.int64(self.blocks), self.state, out)
        return out

    def pick(self, bits: Any) -> Any:
        """Select among the gathered candidates (or the array), compact."""
        self.radix(bits, self.k, self.capacity, -1)
        return self.compact(bits)

    def from_floor(self, bits: Any) -> Any:
        """Gather at the floor, then ``pick``."""
        self.gather(bits)
        return self.pick(bits)

    # -- where the floor comes from ----------------------------------------------------
    def exact(self, bits: Any) -> Any:
        """Radix select over the whole array, then compact: no floor."""
        self.radix(bits, self.k, 0, 0)
        return self.compact(bits)

    def sample_floor(self, bits: Any) -> None:
        """A floor with at least k keys above it with high confidence: a strided
        sample's key at the expected count plus four standard deviations."""
        stride, m = self.stride, self.sampled
        expected = self.k * m / self.n
        rank = int(expected + 4.0 * math.sqrt(expected)) + 4
        if rank >= m:
            self.floor_at(0)
            return
        self._pass("sample_keys", bits, self.mask, self.nan_key, np.int64(stride), np.int64(m), self.keys)
        self.radix(bits, rank, m, m)
        self._one("set_floor", "", self.state, np.int32(SLOT["prefix"]), np.uint64(0))

    def floor_at(self, key: int) -> None:
        """A floor the host chose (0: every key)."""
        self._one("set_floor", "", self.state, np.int32(-1), np.uint64(key))

    def bisect(self, bits: Any, passes: int) -> None:
        """The paper's bisection between the mean and the largest finite
        magnitude, on the keys, 255 floors a pass; then a gather at the floor
        it ends on, the highest that keeps more than k.

        Only the first pass counts over the array. Every key at or above the
        floor it leaves is gathered then, and the later passes, whose floors
        all lie above, count those alone: the same counts, so the same
        bisection, for the price of a read. When they did not all fit, the
        later passes and the last gather read the array."""
        count, source = np.int32(SLOT["count"]), np.int32(SLOT["source"])
        kept = np.uint64(self.kept_keys.size)  # 0 in a workspace made without ``bisects``: the array, always
        self.bracket(bits)
        steer = ("steer", self.key_type, self.state, self.floors, self.counts, np.uint64(self.k))
        self._block(*steer, np.int32(0))
        self._one("clear_slot", "", self.state, source)  # the first pass reads the array
        for done in range(passes):
            self._pass("count_at_least", bits, np.int64(self.n), self.mask, self.nan_key, self.kept_keys, self.state,
                       self.floors, self.counts)
            self._block(*steer, np.int32(1))
            if done == 0:
                self._one("clear_slot", "", self.state, count)
                self._pass("gather_at_least", bits, np.int64(self.n), self.mask, self.nan_key, self.state,
                           self.kept_keys, self.kept_positions, kept)
                # the candidates when all fitted, however few: the counts over them are the array's
                self._one("begin_radix", "", self.state, np.uint64(0), kept, np.int64(-1))
        self._one("clear_slot", "", self.state, count)
        self._pass("regather", bits, np.int64(self.n), self.mask, self.nan_key, self.kept_keys, self.kept_positions,
                   self.state, self.keys, self.positions, np.uint64(self.capacity))

    def bracket(self, bits: Any) -> None:
        """The bisection's bracket [LO, HI): from the key of the mean finite
        magnitude to just above the largest finite key (``mean_bracket``)."""
        self.stats.fill(0)
        self._one("clear_slot", "", self.state, np.int32(SLOT["hi"]))
        self._pass("finite_stats", bits, np.int64(self.n), self.mask, self.inf_key, self.stats, self.state)
        self._one("mean_bracket", self.pair, self.stats, self.state, self.inf_key)

    def warm_floor(self) -> None:
        """The last k-th magnitude times the margin, or no floor after a k-th
        magnitude of 0, Inf or NaN."""
        self._one("warm_floor", self.pair, self.state, self.margin, self.inf_key, self.nan_key)

    def settle(self, adapt: bool) -> None:
        """Keep the k-th key for the next call; with ``adapt``, move the margin."""
        self._one("settle", "", self.state, self.margin, np.uint64(self.k), self.no_floor, np.int32(adapt))


def kernel_names() -> list:
    """Every kernel of ``select.cu`` a workspace launches, with its template arguments."""
    names = {"begin_radix", "choose_byte", "scan_sums", "set_floor", "clear_slot", "settle", "word_sums",
             "write_positions"}
    for bits, key in C_TYPES.values():
        names |= {f"{name}<{bits}, {key}>" for name in ("count_at_least", "finite_stats", "gather_at_least",
                                                        "histogram", "mark", "mean_bracket", "regather",
                                                        "sample_keys", "warm_floor")}
        names.add(f"steer<{key}>")
    return sorted(names)
