#!/usr/bin/env python3
"""Benchmark the top-k selectors of spar_comm.kernels against their baselines.

For every size n, density d (k = max(1, round(d * n))) and dtype, on Gaussian
data, it times as the median of --repeat runs after one warm-up run:

* every selected method of ``spar_comm.kernels`` (default: all registered);
* the baselines: ``numpy.argpartition`` of ``|x|`` on the CPU,
  ``cupy.argpartition`` (a full sort at these k) on the GPU, and
  ``torch.topk`` of ``|x|`` on either when torch can be imported;
* the floor: one read of the same data (``x.max()``, on the CPU or reduced
  on the GPU): the "x floor" column counts a method in reads (NumPy does
  not vectorise float16's, so on the CPU a float16 floor is slower than a read).

``--device gpu`` runs the device kernels (``kernels.device_select``) on CuPy
arrays, timed by CUDA events; ``--device gpu-simulator`` runs the same
kernels under numba-cuda's simulator (for tests: its times mean nothing).
On the GPU, ``--graphs`` also times each method captured once in a CUDA
graph and replayed (``<method>+graph``), and ``--cub-topk LIB`` adds CUB's
``DeviceTopK`` on float32 (``drivers/build_cub_topk.sh`` builds LIB). The
JSON's ``libraries`` says, for each public top-k library, whether it ran
and, if not, why.

It prints one table row per (n, d, dtype, method) with the speed-up over the
reference baseline (argpartition on the CPU, torch.topk on the GPU), the
multiple of the floor, the bandwidth of one read of x in that time, and the
recall against the exact top-k set, and writes every figure as JSON (``--out``)
for the cost model: ``{"machine": {...}, "records": [{"n", "k", "density",
"dtype", "method", "median_s", ...}, ...]}``. Stateful methods (``*_warm``)
see the same array on every run, i.e. their best case of a gradient that did
not change.

Example:
    python drivers/bench_topk.py --sizes 1048576,16777216 --densities 0.001,0.01 --out topk.json
    python drivers/bench_topk.py --device gpu --sizes 1048576,67108864 --dtype float32,float16 --out gpu.json
"""
from __future__ import annotations

import argparse
import datetime
import functools
import os
import platform
import socket
import sys
import time
from typing import Callable, Dict, List, Optional, Tuple

import numpy as np

from spar_comm.bench.timing import cuda_event_ms
from spar_comm.cli import comma_list, positive_int
from spar_comm.files import write_json
from spar_comm.kernels import SELECTORS, make_selector
from spar_comm.kernels.selection import exact_topk

BASELINES = ("argpartition", "cupy.argpartition", "torch.topk", "floor")
DEVICES = ("cpu", "gpu", "gpu-simulator")
DTYPES = ("float16", "float32", "float64")


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog=__doc__.split("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--sizes", type=comma_list(int, lambda v: v >= 1, "an integer >= 1"),
        default=[1 << 20, 1 << 22, 1 << 24], help="comma-separated array lengths (default: 2^20,2^22,2^24)",
    )
    parser.add_argument(
        "--densities", type=comma_list(float, lambda v: 0 < v <= 1, "in (0, 1]"),
        default=[0.001, 0.01], help="comma-separated k/n ratios (default: 0.001,0.01)",
    )
    parser.add_argument(
        "--methods", type=comma_list(str, lambda m: m in SELECTORS, f"one of {', '.join(sorted(SELECTORS))}"),
        default=sorted(SELECTORS), help=f"comma-separated selector methods (default: all: {','.join(sorted(SELECTORS))})",
    )
    parser.add_argument("--repeat", type=positive_int, default=7, help="timed runs per figure, after one warm-up (default: 7)")
    parser.add_argument("--dtype", type=comma_list(str, lambda d: d in DTYPES, f"one of {', '.join(DTYPES)}"),
                        default=["float32"], help="comma-separated element types (default: float32)")
    parser.add_argument("--device", choices=DEVICES, default="cpu",
                        help="cpu; gpu: the device kernels on CuPy arrays, CUDA-event times; gpu-simulator: "
                        "the device kernels under numba-cuda's simulator, for tests (default: cpu)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the Gaussian test data (default: 0)")
    parser.add_argument("--out", metavar="FILE.json", help="write the records and machine metadata here as JSON")
    parser.add_argument("--no-torch", action="store_true", help="leave torch.topk out even when torch is installed")
    parser.add_argument("--graphs", action="store_true",
                        help="gpu: also time every method captured in a CUDA graph and replayed")
    parser.add_argument("--cub-topk", metavar="LIB.so",
                        help="gpu: add CUB's DeviceTopK from this library (drivers/build_cub_topk.sh builds it)")
    args = parser.parse_args(argv)
    if args.out and not os.path.isdir(os.path.dirname(os.path.abspath(args.out))):
        parser.error(f"--out: the folder of {args.out!r} does not exist")
    if (args.graphs or args.cub_topk) and args.device != "gpu":
        parser.error("--graphs and --cub-topk need --device gpu")
    if args.cub_topk and not os.path.isfile(args.cub_topk):
        parser.error(f"--cub-topk: no such file {args.cub_topk!r}")
    try:
        args.bench = BENCHES[args.device](load_torch(not args.no_torch))
        if args.device == "gpu":
            args.bench.configure(args.graphs, args.cub_topk)
    except RuntimeError as error:
        parser.error(f"--device {args.device}: {error}")
    unknown = [m for m in args.methods if m not in args.bench.methods]
    if unknown:
        parser.error(f"--device {args.device} has no kernel for {', '.join(unknown)}")
    return args


def median_time(run: Callable[[], object], repeat: int) -> tuple[float, float]:
    """(median, min) seconds of ``repeat`` runs after one warm-up run."""
    run()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return float(np.median(times)), float(min(times))


def load_torch(wanted: bool):
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

    def __init__(self, torch):
        self.torch = torch
        self.methods = sorted(SELECTORS)

    def put(self, x: np.ndarray):
        return x

    def to_host(self, x) -> np.ndarray:
        return x

    def make(self, method: str) -> Callable:
        return make_selector(method)

    def floor(self, x) -> Callable[[], object]:
        return lambda: x.max()  # one read of x (np.abs(x).max() also writes and reads a temporary)

    def baselines(self, x, k: int) -> Dict[str, Callable[[], object]]:
        runs: Dict[str, Callable[[], object]] = {"argpartition": lambda: np.argpartition(np.abs(x), x.size - k)}
        if self.torch is not None:
            t = self.torch.from_numpy(x)
            runs["torch.topk"] = lambda: self.torch.topk(t.abs(), k, sorted=False)
        return runs

    def time(self, run: Callable[[], object], repeat: int) -> Tuple[float, float]:
        return median_time(run, repeat)

    def describe(self) -> Dict[str, object]:
        return {"device": "cpu"}


class SimulatedGpuBench(CpuBench):
    """The device kernels on NumPy arrays under numba-cuda's simulator: it runs
    the GPU benchmark's code where there is no GPU; its times mean nothing."""

    def __init__(self, torch):
        super().__init__(None)
        from numba import config

        if not config.ENABLE_CUDASIM:
            raise RuntimeError("set NUMBA_ENABLE_CUDASIM=1 in the environment")
        from spar_comm.kernels import device_select

        self.kernels = device_select.METHODS
        self.methods = sorted(self.kernels)

    def make(self, method: str) -> Callable:
        return self.kernels[method]()

    def describe(self) -> Dict[str, object]:
        return {"device": "gpu-simulator"}


class GpuBench(SimulatedGpuBench):
    """CuPy arrays on GPU 0, the device kernels, and CUDA-event medians."""

    def __init__(self, torch):
        try:
            import cupy
            from spar_comm.kernels import device_select

            cupy.cuda.runtime.getDeviceCount()
        except Exception as error:  # ImportError, or CUDARuntimeError without a GPU
            raise RuntimeError(f"needs CuPy and a GPU ({type(error).__name__}: {error})") from None
        self.cupy = cupy
        self.torch = torch if torch is not None and torch.cuda.is_available() else None  # a CPU build cannot
        self.kernels = device_select.METHODS
        self.methods = sorted(self.kernels)
        self.reference = "torch.topk" if torch is not None else "cupy.argpartition"

    def configure(self, graphs: bool, cub_topk: Optional[str]) -> None:
        """Graph replays of every method, and CUB's DeviceTopK from ``cub_topk``."""
        self.graphs = graphs
        self.cub = None
        if cub_topk:
            import ctypes

            self.cub = ctypes.CDLL(os.path.abspath(cub_topk))
            self.cub.cub_topk_scratch.restype = ctypes.c_size_t
            self.cub.cub_topk_scratch.argtypes = [ctypes.c_longlong, ctypes.c_longlong]
            self.cub.cub_topk.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p, ctypes.c_longlong,
                                          ctypes.c_longlong, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]

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

    def put(self, x: np.ndarray):
        return self.cupy.asarray(x)

    def to_host(self, x) -> np.ndarray:
        return self.cupy.asnumpy(x)

    def floor(self, x) -> Callable[[], object]:
        return lambda: x.max()  # one read of x, reduced on the device

    def baselines(self, x, k: int) -> Dict[str, Callable[[], object]]:
        cupy = self.cupy
        runs: Dict[str, Callable[[], object]] = {
            "cupy.argpartition": lambda: cupy.argpartition(cupy.abs(x), x.size - k)}
        if self.torch is not None:
            t = self.torch.from_dlpack(x)  # the same device memory
            runs["torch.topk"] = lambda: self.torch.topk(t.abs(), k, sorted=False)
        if self.cub is not None and x.dtype == np.float32:
            runs["cub.DeviceTopK"] = self._cub_run(x, k)
        return runs

    def _cub_run(self, x, k: int) -> Callable[[], object]:
        cupy = self.cupy
        scratch_bytes = self.cub.cub_topk_scratch(x.size, k)
        if scratch_bytes == 0:
            raise RuntimeError(f"cub_topk_scratch failed for n={x.size}, k={k}")
        scratch = cupy.empty(scratch_bytes, dtype=np.uint8)
        keys, positions = cupy.empty(k, dtype=np.float32), cupy.empty(k, dtype=np.int64)

        def run():
            code = self.cub.cub_topk(scratch.data.ptr, scratch_bytes, x.data.ptr, x.size, k, keys.data.ptr,
                                     positions.data.ptr, cupy.cuda.get_current_stream().ptr)
            if code != 0:
                raise RuntimeError(f"cub::DeviceTopK::MaxPairs failed with cudaError {code}")
            return positions

        return run

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


BENCHES = {"cpu": CpuBench, "gpu": GpuBench, "gpu-simulator": SimulatedGpuBench}


def machine() -> Dict[str, object]:
    """What a reader needs to compare figures between machines."""
    cpu = platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    info: Dict[str, object] = {
        "host": socket.gethostname(),
        "cpu": cpu,
        "cpus": os.cpu_count(),
        "affinity": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "platform": platform.platform(),
        "python": platform.python_version(),
        "numpy": np.__version__,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }
    for module in ("numba", "torch"):
        try:
            info[module] = __import__(module).__version__
        except ImportError:
            info[module] = None
    return info


def bench(args: argparse.Namespace) -> List[Dict[str, object]]:
    where = args.bench
    rng = np.random.default_rng(args.seed)
    records: List[Dict[str, object]] = []
    for dtype in args.dtype:
        for n in args.sizes:
            host = rng.standard_normal(n, dtype=np.float32).astype(dtype)
            x = where.put(host)
            floor = where.time(where.floor(x), args.repeat)
            for density in args.densities:
                k = max(1, min(n, round(density * n)))
                truth = exact_topk(host, k)
                runs = where.baselines(x, k)
                for method in args.methods:
                    runs[method] = functools.partial(where.make(method), x, k)
                    if getattr(where, "graphs", False):
                        runs[method + "+graph"] = where.graph(functools.partial(where.make(method), x, k))
                times = {name: where.time(run, args.repeat) for name, run in runs.items()}
                times["floor"] = floor
                reference = times[where.reference][0]
                for name, (med, best) in times.items():
                    recall, method = None, name.removesuffix("+graph")
                    matches = None
                    if method in SELECTORS or name == "cub.DeviceTopK":
                        got = where.to_host(runs[name]())
                        recall = np.intersect1d(got, truth).size / truth.size
                        matches = got.tolist() == truth.tolist()  # the contract: these positions, ascending
                    records.append({
                        "n": n, "k": k, "density": density, "dtype": dtype, "device": args.device, "method": name,
                        "exact": SELECTORS.get(method), "median_s": med, "min_s": best, "repeat": args.repeat,
                        "per_element_s": med / n, "read_gbps": host.nbytes / med / 1e9,
                        "reference": where.reference, "speedup_vs_reference": reference / med,
                        "floor_multiple": med / floor[0], "recall": recall, "matches_reference": matches,
                    })
    return records


def table(records: List[Dict[str, object]]) -> str:
    reference = records[0]["reference"] if records else ""
    head = (f"{'n':>10} {'density':>8} {'k':>8} {'dtype':<8} {'method':<17} {'median ms':>10} "
            f"{'vs ' + reference:>14} {'x floor':>8} {'GB/s':>8} {'recall':>7}")
    lines = [head, "-" * len(head)]
    for r in records:
        recall = "" if r["recall"] is None else f"{r['recall']:.4f}"
        lines.append(
            f"{r['n']:>10} {r['density']:>8g} {r['k']:>8} {r['dtype']:<8} {r['method']:<17} {r['median_s'] * 1e3:>10.3f} "
            f"{r['speedup_vs_reference']:>13.2f}x {r['floor_multiple']:>7.2f}x {r['read_gbps']:>8.2f} {recall:>7}"
        )
    return "\n".join(lines)


def main(argv: Optional[List[str]] = None) -> int:
    args = parse_args(argv)
    records = bench(args)
    print(table(records))
    if args.out:
        libraries = args.bench.libraries() if hasattr(args.bench, "libraries") else {}
        write_json(args.out, {"machine": {**machine(), **args.bench.describe()}, "libraries": libraries,
                              "records": records})
        print(f"wrote {len(records)} records to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
