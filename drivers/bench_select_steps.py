#!/usr/bin/env python3
"""Where a device selection's time goes: every launch of one call, timed by
CUDA events, summed by kernel.

    python drivers/bench_select_steps.py --sizes 67108864 --densities 0.001,0.01 --methods threshold_warm,mstopk

For each (method, n, density, dtype) it makes one selector, calls it
--warmup times, then times --repeat calls launch by launch (an event before
and after each kernel of ``select.cu``; the events themselves cost a little)
and prints, per kernel, the median over calls of its summed milliseconds, the
whole call's median without the events, and one read of x (``x.max()``) for
scale. --out writes the figures as JSON. Needs CuPy and a GPU.
"""
from __future__ import annotations

import argparse
import sys
from typing import List, Optional

from spar_comm.bench.select_steps import METHODS, kernel_times
from spar_comm.cli import comma_list, positive_int
from spar_comm.files import write_json


def parse_args(argv: Optional[List[str]]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=comma_list(int, lambda v: v >= 2, "an integer >= 2"), default=[1 << 26],
                        help="comma-separated lengths (default: 2^26)")
    parser.add_argument("--densities", type=comma_list(float, lambda v: 0 < v < 1, "in (0, 1)"),
                        default=[0.001, 0.01], help="comma-separated k/n (default: 0.001,0.01)")
    parser.add_argument("--methods", type=comma_list(str, lambda m: m in METHODS, f"one of {', '.join(METHODS)}"),
                        default=list(METHODS), help="comma-separated device methods (default: all)")
    parser.add_argument("--dtype", type=comma_list(str, lambda d: d in ("float16", "float32", "float64"),
                                                   "float16, float32 or float64"), default=["float32"])
    parser.add_argument("--warmup", type=positive_int, default=3, help="calls before timing (default: 3)")
    parser.add_argument("--repeat", type=positive_int, default=10, help="timed calls (default: 10)")
    parser.add_argument("--out", metavar="FILE.json", help="write the figures here")
    return parser.parse_args(argv)


def main(argv: Optional[List[str]] = None) -> int:
    args = parse_args(argv)
    try:
        import cupy

        cupy.cuda.runtime.getDeviceCount()
    except Exception as error:  # ImportError, or no device
        print(f"bench_select_steps.py: needs CuPy and a GPU ({type(error).__name__}: {error})", file=sys.stderr)
        return 2
    records = []
    for record in kernel_times(cupy, args.sizes, args.densities, args.methods, args.dtype, args.warmup, args.repeat):
        records.append(record)
        print(f"\n{record['method']} n={record['n']} k={record['k']} {record['dtype']}: {record['call_ms']:.3f} ms "
              f"a call ({record['call_ms'] / record['read_ms']:.2f} reads), {record['launches']} launches")
        for name, ms in sorted(record["kernels_ms"].items(), key=lambda item: -item[1]):
            print(f"  {name:<18} {ms:8.3f} ms")
    if args.out:
        write_json(args.out, {"records": records})
    return 0


if __name__ == "__main__":
    sys.exit(main())
