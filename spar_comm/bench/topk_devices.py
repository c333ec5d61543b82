"""Where bench_topk.py selects: NumPy arrays and the CPU selectors by the
wall clock; CuPy arrays, the device kernels and CUDA events on a GPU; or the
device kernels under numba-cuda's simulator, where there is no GPU. Each
gives its selectors, its baselines (the public top-k functions) and its
floor, one read of the data."""
from __future__ import annotations

from typing import Any, Callable, Dict, Optional, Tuple

import numpy as np

from ..kernels import SELECTORS, make_selector
from .cub_topk import CubTopK
from .timing import cuda_event_ms, wall_median


def load_torch(wanted: bool) -> Any:
    """torch where it is ``wanted`` and installed, else None (its baseline is left out)."""
    if not wanted:
        return None
    try:
        import torch
    except ImportError:
        return None
    return torch


class CpuBench:
    """NumPy arrays, the CPU selectors, wall-clock medians."""

    reference = "argpartition"
    graphs = False  # only a GPU replays CUDA graphs

    def __init__(self, torch: Any):
        self.torch = torch
        self.methods = sorted(SELECTORS)

    def put(self, x: np.ndarray) -> Any:
        """``x`` where the selectors read it."""
        return x

    def to_host(self, x: Any) -> np.ndarray:
        """A selection's positions as a NumPy array, to check against the exact set."""
        return x

    def make(self, method: str) -> Callable:
        """A selector of ``method``, called as ``selector(x, k)``."""
        return make_selector(method)

    def floor(self, x: Any) -> Callable[[], object]:
        """One read of ``x``: the unit a selection's time is counted in."""
        return lambda: x.max()  # one read of x (np.abs(x).max() also writes and reads a temporary)

    def baselines(self, x: Any, k: int) -> Dict[str, Callable[[], object]]:
        """The public top-k functions on ``x``, by name."""
        runs: Dict[str, Callable[[], object]] = {"argpartition": lambda: np.argpartition(np.abs(x), x.size - k)}
        if self.torch is not None:
            t = self.torch.from_numpy(x)
            runs["torch.topk"] = lambda: self.torch.topk(t.abs(), k, sorted=False)
        return runs

    def time(self, run: Callable[[], object], repeat: int) -> Tuple[float, float]:
        """(median, min) seconds of ``repeat`` runs after one warm-up."""
        return wall_median(run, repeat)

    def libraries(self) -> Dict[str, str]:
        """For each public top-k library: "ran", or why it did not (none on the CPU)."""
        return {}

    def describe(self) -> Dict[str, object]:
        """What the JSON's machine record adds about the device."""
        return {"device": "cpu"}


class SimulatedGpuBench(CpuBench):
    """The device kernels on NumPy arrays under numba-cuda's simulator: it runs
    the GPU benchmark's code where there is no GPU; its times mean nothing."""

    def __init__(self, torch: Any):
        super().__init__(None)
        from numba import config

        if not config.ENABLE_CUDASIM:
            raise RuntimeError("set NUMBA_ENABLE_CUDASIM=1 in the environment")
        from ..kernels import device_select

        self.kernels = device_select.METHODS
        self.methods = sorted(self.kernels)

    def make(self, method: str) -> Callable:
        return self.kernels[method]()

    def describe(self) -> Dict[str, object]:
        return {"device": "gpu-simulator"}


class GpuBench(SimulatedGpuBench):
    """CuPy arrays on GPU 0, the device kernels, and CUDA-event medians; with
    ``graphs``, every method also captured once in a CUDA graph and
    replayed; with ``cub_topk`` (a library's path), CUB's DeviceTopK on
    float32 among the baselines."""

    def __init__(self, torch: Any, graphs: bool = False, cub_topk: Optional[str] = None):
        try:
            import cupy

            from ..kernels import device_select

            cupy.cuda.runtime.getDeviceCount()
        except Exception as error:  # ImportError, or CUDARuntimeError without a GPU
            raise RuntimeError(f"needs CuPy and a GPU ({type(error).__name__}: {error})") from None
        self.cupy = cupy
        self.torch = torch if torch is not None and torch.cuda.is_available() else None  # a CPU build cannot
        self.kernels = device_select.METHODS
        self.methods = sorted(self.kernels)
        self.reference = "torch.topk" if torch is not None else "cupy.argpartition"
        self.graphs = graphs
        self.cub = CubTopK(cub_topk) if cub_topk else None

    def libraries(self) -> Dict[str, str]:
        """For each public top-k library: "ran", or why it did not."""
        return {
            "torch.topk": "ran" if self.torch is not None else "not run: no CUDA torch",
            "cub.DeviceTopK": "ran (float32)" if self.cub is not None else
            "not run: no --cub-topk library (drivers/build_cub_topk.sh builds one from the cuda-cccl wheel)",
            "cuvs.select_k": "not run: cuvs-cu13 26.10 needs libcuvs-cu13, a 241 MB wheel: more than a call to "
            "the lent GPU machine carries (64 MiB), and that machine has no package index",
            "flashinfer.top_k": "not run: flashinfer-python 0.7.2 is a 62 MB wheel with a dozen dependencies "
            "(cuda-tile, nvidia-cutlass-dsl, apache-tvm-ffi, ...): more than a call to the lent GPU machine carries",
        }

    def put(self, x: np.ndarray) -> Any:
        return self.cupy.asarray(x)

    def to_host(self, x: Any) -> np.ndarray:
        return self.cupy.asnumpy(x)

    def floor(self, x: Any) -> Callable[[], object]:
        return lambda: x.max()  # one read of x, reduced on the device

    def baselines(self, x: Any, k: int) -> Dict[str, Callable[[], object]]:
        cupy = self.cupy
        runs: Dict[str, Callable[[], object]] = {
            "cupy.argpartition": lambda: cupy.argpartition(cupy.abs(x), x.size - k)}
        if self.torch is not None:
            t = self.torch.from_dlpack(x)  # the same device memory
            runs["torch.topk"] = lambda: self.torch.topk(t.abs(), k, sorted=False)
        if self.cub is not None and x.dtype == np.float32:
            runs["cub.DeviceTopK"] = self.cub.run(cupy, x, k)
        return runs

    def graph(self, run: Callable[[], object]) -> Callable[[], object]:
        """``run`` captured once in a CUDA graph on a stream of its own; a replay
        launches the graph on the current stream's timeline."""
        cupy = self.cupy
        stream = cupy.cuda.Stream(non_blocking=False)
        with stream:
            run()  # buffers a selector keeps are made outside the capture
            stream.synchronize()
            stream.begin_capture()
            try:
                answer = run()
            finally:
                graph = stream.end_capture()

        def replay():
            graph.launch()
            return answer

        return replay

    def time(self, run: Callable[[], object], repeat: int) -> Tuple[float, float]:
        """(median, min) seconds between CUDA events around each run, after one warm-up."""
        cupy = self.cupy
        run()
        times = [ms / 1e3 for ms in cuda_event_ms(cupy, run, repeat)]
        return float(np.median(times)), float(min(times))

    def describe(self) -> Dict[str, object]:
        props = self.cupy.cuda.runtime.getDeviceProperties(0)
        return {"device": "gpu", "gpu": props["name"].decode(), "cupy": self.cupy.__version__,
                "cuda_runtime": self.cupy.cuda.runtime.runtimeGetVersion()}


#: Each --device's bench.
BENCHES = {"cpu": CpuBench, "gpu": GpuBench, "gpu-simulator": SimulatedGpuBench}
