#!/usr/bin/env python
"""Read HDF5 traces of drivers/train.py: phase breakdown, bytes, throughput,
several runs side by side, a plot (phase breakdown, loss, accuracy against wall
time), a Chrome/Perfetto export.

    python drivers/analyze.py runs/dense.h5 runs/hitopk.h5 --plot breakdown.png
    python drivers/analyze.py runs/train.h5 --json > summary.json
    python drivers/analyze.py runs/train.h5 --chrome events.json --steps 100:110   # open in ui.perfetto.dev
    python drivers/analyze.py runs/train.h5 --follow      # a run that is still going
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import List, Optional, Tuple

from spar_comm.files import BadFileError
from spar_comm.training.analysis import chrome_events, format_report, plot, summarize
from spar_comm.training.trace import read_trace


def step_range(text: str) -> Tuple[int, int]:
    """``A:B`` -> (A, B), steps A to B-1; either side may be left out."""
    first, sep, last = text.partition(":")
    try:
        a = int(first) if first else 0
        b = int(last) if last else 2**62
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected A:B with integers, got {text!r}") from None
    if not sep or a < 0 or b <= a:
        raise argparse.ArgumentTypeError(f"expected A:B with 0 <= A < B, got {text!r}")
    return a, b


def make_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="analyze.py", description=__doc__.split("\n\n")[0])
    p.add_argument("traces", nargs="+", metavar="TRACE", help="HDF5 trace files")
    p.add_argument("--steps", type=step_range, metavar="A:B", help="only steps A to B-1 (default: all)")
    p.add_argument("--plot", metavar="PNG",
                   help="write a stacked-bar breakdown, the loss curves and held-out accuracy against wall time")
    p.add_argument("--json", action="store_true", help="print the figures as JSON instead of tables")
    p.add_argument("--chrome", metavar="JSON", help="write Chrome/Perfetto trace events of the first trace")
    p.add_argument("--follow", action="store_true", help="report a running job's trace until it is done")
    p.add_argument("--interval", type=float, default=2.0, help="seconds between reports with --follow")
    return p


def follow(path: str, interval: float) -> int:
    """One line per interval on a live trace, until it holds every step of its run."""
    while not os.path.exists(path):
        time.sleep(interval)
    seen = -1
    while True:
        trace = read_trace(path)
        total = int(trace.attrs.get("total_steps", 0))
        if trace.steps != seen and trace.steps:
            seen = trace.steps
            recent = summarize(trace, (int(trace.data["step"][max(0, seen - 50)]), 2**62))
            phases = recent["phases"]
            print(
                f"step {int(trace.data['step'][-1]) + 1}/{total}  loss {recent['final_loss']:.4f}  "
                f"step {1e3 * phases['step']['mean']:.2f} ms (compute {1e3 * phases['compute']['mean']:.2f}, "
                f"comm {1e3 * (phases['comm_intra']['mean'] + phases['comm_inter']['mean']):.2f}, "
                f"select {1e3 * phases['select']['mean']:.2f})  {recent['steps_per_s']:.1f} steps/s",
                flush=True,
            )
        if total and seen >= total:
            return 0
        time.sleep(interval)


def main(argv: Optional[List[str]] = None) -> int:
    parser = make_parser()
    args = parser.parse_args(argv)
    missing = [path for path in args.traces if not os.path.exists(path)]
    if missing and not args.follow:
        parser.error(f"no such trace: {', '.join(missing)}")
    try:
        if args.follow:
            return follow(args.traces[0], args.interval)
        traces = [read_trace(path) for path in args.traces]
    except BadFileError as exc:
        parser.error(f"not a spar_comm trace: {exc}")
    summaries = [summarize(trace, args.steps) for trace in traces]
    if args.json:
        json.dump(dict(traces=summaries), sys.stdout, indent=1)
        print()
    else:
        sys.stdout.write(format_report(summaries))
    if args.plot:
        plot(traces, summaries, args.plot)
    if args.chrome:
        with open(args.chrome, "w") as out:
            json.dump(chrome_events(traces[0], args.steps), out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
