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
import os
import sys
from typing import List, Optional

from spar_comm.bench.topk import machine, measure, table
from spar_comm.bench.topk_devices import BENCHES, GpuBench, load_torch
from spar_comm.cli import comma_list, positive_int
from spar_comm.files import write_json
from spar_comm.kernels import SELECTORS

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
        torch = load_torch(not args.no_torch)
        args.bench = (GpuBench(torch, args.graphs, args.cub_topk) if args.device == "gpu"
                      else BENCHES[args.device](torch))
    except RuntimeError as error:
        parser.error(f"--device {args.device}: {error}")
    unknown = [m for m in args.methods if m not in args.bench.methods]
    if unknown:
        parser.error(f"--device {args.device} has no kernel for {', '.join(unknown)}")
    return args


def main(argv: Optional[List[str]] = None) -> int:
    args = parse_args(argv)
    records = measure(args.bench, args.device, args.sizes, args.densities, args.dtype, args.methods, args.repeat,
                      args.seed)
    print(table(records))
    if args.out:
        write_json(args.out, {"machine": {**machine(), **args.bench.describe()}, "libraries": args.bench.libraries(),
                              "records": records})
        print(f"wrote {len(records)} records to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
