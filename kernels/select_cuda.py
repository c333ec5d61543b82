"""The device selection's passes on a real GPU: ``select.cu`` through CuPy.

``device_select`` runs the same algorithms in numba-cuda kernels, which is
how CI runs them (under Numba's CUDA simulator). On an H100 each numba-cuda
launch cost about 0.4 ms of Python dispatch, so a selection of a dozen
launches took 2 to 13 ms whatever the size; CuPy launches a compiled kernel
in microseconds. These passes take a ``device_select.Keys`` of a CuPy array
and run on CuPy's current stream; the GPU tests check them against the CPU
reference on the device.
"""
from __future__ import annotations

import functools
from pathlib import Path
from typing import Any, Tuple

import numpy as np

SOURCE = Path(__file__).with_name("select.cu")
THREADS = 256
#: Key floors a bisection pass counts (fixed in select.cu): 6 halvings a pass.
FLOORS = 63
#: The C types of a float's bits and of its keys, by the width of the float.
C_TYPES = {2: ("unsigned short", "unsigned int"), 4: ("unsigned int", "unsigned int"),
           8: ("unsigned long long", "unsigned long long")}


def kernel_names() -> list:
    """Every kernel of ``select.cu`` the passes launch, with its template arguments."""
    names = {"choose_byte"}
    for bits, key in C_TYPES.values():
        names |= {f"at_least<{bits}, {key}>", f"count_at_least<{bits}, {key}>", f"finite_stats<{bits}, {key}>",
                  f"histogram<{bits}, {key}>", f"steer<{key}>"}
        if key == "unsigned int":
            names.add(f"rank_keys<{bits}>")
    return sorted(names)


@functools.lru_cache(maxsize=None)
def _module() -> Any:
    import cupy

    return cupy.RawModule(code=SOURCE.read_text(), options=("-std=c++17",), name_expressions=kernel_names())


@functools.lru_cache(maxsize=None)
def _blocks_to_fill(device: int) -> int:
    import cupy

    return 8 * cupy.cuda.runtime.getDeviceProperties(device)["multiProcessorCount"]


class Passes:
    """The kernels for one array's keys, with their scalar arguments typed."""

    floors = FLOORS

    def __init__(self, keys: Any):
        self.keys, self.xp = keys, keys.xp
        bits_type, key_type = C_TYPES[keys.bits.dtype.itemsize]
        self.key = np.uint64 if key_type == "unsigned long long" else np.uint32
        self.types = f"{bits_type}, {key_type}"
        self.bits_type, self.key_type = bits_type, key_type
        #: Whether the pick can sort (key, position) packed in 64 bits, in one sort.
        self.packs = key_type == "unsigned int" and keys.n < 1 << 32
        self.n = np.int64(keys.n)
        self.mask, self.nan_key, self.inf_key = (self.key(v) for v in (keys.mask, keys.nan_key, keys.inf_key))
        self.grid = max(1, min(_blocks_to_fill(keys.bits.device.id), -(-keys.n // (4 * THREADS))))

    def _run(self, name: str, blocks: int, threads: int, *args: Any) -> None:
        _module().get_function(name)((blocks,), (threads,), args)

    def at_least(self, floor: int, capacity: int) -> Any:
        """Positions of every key >= ``floor``, in one read: in any order where
        ``pick`` packs, else ascending (sorted once found)."""
        xp = self.xp
        count = xp.zeros(1, dtype=np.uint64)
        while True:
            out = xp.empty(max(capacity, 1), dtype=np.int64)
            self._run(f"at_least<{self.types}>", self.grid, THREADS, self.keys.bits, self.n, self.mask,
                      self.nan_key, self.key(floor), out, np.uint64(out.size), count)
            found = int(count.get()[0])
            if found <= out.size:
                return out[:found] if self.packs else xp.sort(out[:found])
            capacity = found  # too many for the room guessed: once more, with room for all
            count[...] = 0

    def pick(self, candidates: Any, k: int) -> Tuple[Any, int]:
        """The contract set among ``candidates`` (any order, holding the top k) and
        the k-th largest key: one sort of (key, position) packed in 64 bits."""
        xp, m = self.xp, candidates.size
        ranked = xp.empty(m, dtype=np.uint64)
        self._run(f"rank_keys<{self.bits_type}>", -(-m // THREADS), THREADS, self.keys.bits, candidates,
                  np.int64(m), self.mask, self.nan_key, ranked)
        top = xp.sort(ranked)[m - k:]
        positions = xp.sort((np.uint64(0xFFFF_FFFF) - (top & np.uint64(0xFFFF_FFFF))).astype(np.int64))
        return positions, int(top[0].get()) >> 32

    def bisect(self, k: int, lo: int, hi: int, passes: int) -> int:
        """The bracket's lower floor after ``passes`` counting passes from ``[lo, hi)``:
        the highest floor seen that keeps more than k keys (``lo`` if none does)."""
        xp = self.xp
        search = xp.asarray(np.array([lo, hi], dtype=self.key))
        floors = xp.empty(FLOORS, dtype=self.key)
        counts = xp.zeros(FLOORS, dtype=np.uint64)
        steer = f"steer<{self.key_type}>"
        self._run(steer, 1, 1, search, floors, counts, np.uint64(k), np.int32(0))
        for _ in range(passes):
            self._run(f"count_at_least<{self.types}>", self.grid, THREADS, self.keys.bits, self.n, self.mask,
                      self.nan_key, floors, counts)
            self._run(steer, 1, 1, search, floors, counts, np.uint64(k), np.int32(1))
        return int(search[0].get())

    def finite_stats(self) -> Tuple[float, int]:
        """The sum of the finite magnitudes and how many entries are finite."""
        stats = self.xp.zeros(2, dtype=np.float64)
        self._run(f"finite_stats<{self.types}>", self.grid, THREADS, self.keys.bits, self.n, self.mask,
                  self.inf_key, stats)
        total, finite = stats.get().tolist()  # one round trip
        return total, int(finite)

    def kth_key(self, k: int, width: int, radix_bits: int) -> int:
        """Radix select: the k-th largest key, a byte a pass, the prefix kept on the device."""
        xp = self.xp
        state = xp.asarray(np.array([0, 0, k], dtype=np.uint64))  # prefix, its mask, still wanted
        hist = xp.zeros(1 << radix_bits, dtype=np.uint64)
        for shift in range(width - radix_bits, -1, -radix_bits):
            self._run(f"histogram<{self.types}>", self.grid, THREADS, self.keys.bits, self.n, self.mask,
                      self.nan_key, state, np.int32(shift), hist)
            self._run("choose_byte", 1, 1, hist, state, np.int32(shift))
        return int(state[0].get())
