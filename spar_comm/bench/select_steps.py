"""Where a device selection's time goes (bench_select_steps.py): one
selector's calls timed launch by launch, an event before and after each
kernel of ``select.cu`` (the events themselves cost a little), summed by
kernel; beside it the whole call without the events and one read of x
(``x.max()``) for scale. Needs CuPy and a GPU."""
from __future__ import annotations

import statistics
from collections import defaultdict
from typing import Any, Dict, Iterator, List, Sequence

import numpy as np

from .timing import cuda_event_ms

METHODS = ("exact", "mstopk", "threshold", "threshold_warm")


def kernel_times(cupy: Any, sizes: Sequence[int], densities: Sequence[float], methods: Sequence[str],
                 dtypes: Sequence[str], warmup: int, repeat: int) -> Iterator[Dict[str, Any]]:
    """A record per (dtype, n, density, method) in turn, on Gaussian data: the
    median milliseconds of a call, of one read, and of each kernel summed
    over its launches in a call, and the launches a call makes."""
    from ..kernels import device_select, select_cuda  # the device kernels: only where there is a GPU

    kernels = select_cuda.kernels()
    plain_launch = kernels.launch
    timings: List[tuple] = []

    def timed_launch(name, template, blocks, threads, *launch_args):
        start, end = cupy.cuda.Event(), cupy.cuda.Event()
        start.record()
        plain_launch(name, template, blocks, threads, *launch_args)
        end.record()
        timings.append((name, start, end))

    rng = np.random.default_rng(0)
    for dtype in dtypes:
        for n in sizes:
            x = cupy.asarray(rng.standard_normal(n, dtype=np.float32).astype(dtype))
            read = cuda_event_ms(cupy, x.max, repeat)
            for density in densities:
                k = max(1, round(density * n))
                for method in methods:
                    selector = device_select.METHODS[method]()
                    for _ in range(warmup):
                        selector(x, k)
                    whole = cuda_event_ms(cupy, lambda: selector(x, k), repeat)
                    per_kernel: Dict[str, List[float]] = defaultdict(list)
                    kernels.launch = timed_launch
                    try:
                        for _ in range(repeat):
                            timings.clear()
                            selector(x, k)
                            cupy.cuda.get_current_stream().synchronize()
                            sums: Dict[str, float] = defaultdict(float)
                            for name, start, end in timings:
                                sums[name] += cupy.cuda.get_elapsed_time(start, end)
                            for name, ms in sums.items():
                                per_kernel[name].append(ms)
                    finally:
                        kernels.launch = plain_launch
                    yield {"method": method, "n": n, "k": k, "density": density, "dtype": dtype,
                           "call_ms": statistics.median(whole), "read_ms": statistics.median(read),
                           "launches": len(timings),
                           "kernels_ms": {name: statistics.median(v) for name, v in per_kernel.items()}}
