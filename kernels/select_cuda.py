"""The kernels of ``select.cu`` for CuPy arrays, compiled once by NVRTC.

CuPy launches a compiled kernel in microseconds on its current stream and
never synchronises to do so, so a selection (``select_plan.Workspace``) is
a few dozen launches the host queues and the GPU runs in order. numba-cuda's
launches cost about 0.4 ms of Python dispatch each on an H100, too much to
serve here; its twins of these kernels (``select_numba.py``) are how CI runs
the same steps, under Numba's CUDA simulator.
"""
from __future__ import annotations

import functools
from pathlib import Path
from typing import Any, Tuple

from .select_plan import kernel_names

SOURCE = Path(__file__).with_name("select.cu")
#: Threads of a block of the passes over the array, and of the compaction's
#: blocks (COMPACT_THREADS and WORDS in select.cu).
THREADS = 256
COMPACT_THREADS = 256
WORDS = 8


@functools.lru_cache(maxsize=None)
def _module() -> Any:
    import cupy

    return cupy.RawModule(code=SOURCE.read_text(), options=("-std=c++17",), name_expressions=kernel_names())


@functools.lru_cache(maxsize=None)
def _blocks_to_fill(device: int) -> int:
    import cupy

    return 8 * cupy.cuda.runtime.getDeviceProperties(device)["multiProcessorCount"]


class CudaKernels:
    """``select_plan.KernelSet`` over CuPy arrays on the current device."""

    compact_threads = COMPACT_THREADS
    words = WORDS

    def __init__(self) -> None:
        import cupy

        self.xp = cupy
        self.fill = _blocks_to_fill(cupy.cuda.Device().id)

    def grid(self, n: int) -> Tuple[int, int]:
        return max(1, min(self.fill, -(-n // (4 * THREADS)))), THREADS

    def launch(self, name: str, template: str, blocks: int, threads: int, *args: Any) -> None:
        _module().get_function(f"{name}<{template}>" if template else name)((blocks,), (threads,), args)


def kernels() -> CudaKernels:
    """The kernel set of CuPy's current device."""
    import cupy

    return _kernels_of(cupy.cuda.Device().id)


@functools.lru_cache(maxsize=None)
def _kernels_of(device: int) -> CudaKernels:
    return CudaKernels()
