"""CUB's ``DeviceTopK`` through a small shared library of our own
(``drivers/build_cub_topk.sh`` builds it from the cuda-cccl wheel): a public
GPU top-k for bench_topk.py to time the device kernels against. ctypes
only; the arrays are CuPy's."""
from __future__ import annotations

import ctypes
import os
from typing import Any, Callable

import numpy as np


class CubTopK:
    """The library at ``path``: ``cub_topk_scratch(n, k)`` gives the scratch
    bytes a call needs, ``cub_topk(...)`` selects k float32 keys and their
    int64 positions on a stream, returning a cudaError code."""

    def __init__(self, path: str):
        self.library = ctypes.CDLL(os.path.abspath(path))
        self.library.cub_topk_scratch.restype = ctypes.c_size_t
        self.library.cub_topk_scratch.argtypes = [ctypes.c_longlong, ctypes.c_longlong]
        self.library.cub_topk.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p, ctypes.c_longlong,
                                          ctypes.c_longlong, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]

    def run(self, cupy: Any, x: Any, k: int) -> Callable[[], Any]:
        """A call that selects the ``k`` largest of the float32 CuPy array ``x``
        on CuPy's current stream and returns their positions; its buffers are
        made once, here."""
        scratch_bytes = self.library.cub_topk_scratch(x.size, k)
        if scratch_bytes == 0:
            raise RuntimeError(f"cub_topk_scratch failed for n={x.size}, k={k}")
        scratch = cupy.empty(scratch_bytes, dtype=np.uint8)
        keys, positions = cupy.empty(k, dtype=np.float32), cupy.empty(k, dtype=np.int64)

        def run():
            code = self.library.cub_topk(scratch.data.ptr, scratch_bytes, x.data.ptr, x.size, k, keys.data.ptr,
                                         positions.data.ptr, cupy.cuda.get_current_stream().ptr)
            if code != 0:
                raise RuntimeError(f"cub::DeviceTopK::MaxPairs failed with cudaError {code}")
            return positions

        return run
