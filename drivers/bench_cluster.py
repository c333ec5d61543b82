#!/usr/bin/env python3
"""Every algorithm on an emulated cluster with real rate-limited links (root).

For each host layout (e.g. 2 hosts x 2 ranks, 4 hosts x 1 rank) the cluster
is brought up once; for each link rate the links are reshaped and
drivers/bench_comm.py runs across the hosts at every density. Dense
algorithms do not depend on the density and run at the first one only.
Results go to --out as JSON after every run (a killed sweep keeps what it
measured) and as one table at the end; the cluster is removed at the end, on
Ctrl-C and on failure.

    python drivers/bench_cluster.py --out cluster.json
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from spar_comm import ALGORITHMS, emucluster

HERE = Path(__file__).resolve().parent
DENSE = ("dense", "hier_dense")


def layouts(text: str) -> list:
    try:
        pairs = [tuple(int(v) for v in part.split("x")) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"layouts are HOSTSxRANKS, comma-separated, e.g. 2x2,4x1; got {text!r}")
    if any(len(p) != 2 or min(p) < 1 for p in pairs):
        raise argparse.ArgumentTypeError(f"layouts are HOSTSxRANKS with both >= 1, got {text!r}")
    return pairs


def csv(kind):
    def parse(text: str) -> list:
        try:
            values = [kind(v) for v in text.split(",") if v]
        except ValueError:
            raise argparse.ArgumentTypeError(f"bad list {text!r}")
        if not values:
            raise argparse.ArgumentTypeError("empty list")
        return values
    return parse


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="bench_cluster.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layouts", type=layouts, default=[(2, 2), (4, 1)], help="HOSTSxRANKS list (default: 2x2,4x1)")
    parser.add_argument("--rates", type=csv(str), default=["100mbit", "1gbit", "10gbit"],
                        help="link rates, tc syntax (default: 100mbit,1gbit,10gbit)")
    parser.add_argument("--sizes", type=csv(int), default=[1 << 22, 1 << 24], help="elements (default: 2^22,2^24)")
    parser.add_argument("--densities", type=csv(float), default=[0.001, 0.01], help="(default: 0.001,0.01)")
    parser.add_argument("--algorithms", type=csv(str), default=list(ALGORITHMS))
    parser.add_argument("--selector", default=None, help="top-k method (default: bench_comm's)")
    parser.add_argument("--repeat", type=int, default=3, help="timed calls per cell (default: %(default)s)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed calls per cell (default: %(default)s)")
    parser.add_argument("--limit", type=float, default=1200, help="seconds one bench_comm run may take")
    parser.add_argument("--prefix", default="spb", help="name prefix of the cluster made (default: %(default)s)")
    parser.add_argument("--out", help="JSON results")
    args = parser.parse_args(argv)
    for rate in args.rates:
        if not emucluster.RATE.match(rate):
            parser.error(f"rate {rate!r} is not a tc rate such as 100mbit, 1gbit")
    if min(args.sizes) < 1 or not all(0 < d <= 1 for d in args.densities):
        parser.error("sizes must be >= 1 and densities in (0, 1]")
    unknown = set(args.algorithms) - set(ALGORITHMS)
    if unknown:
        parser.error(f"unknown algorithm(s) {', '.join(sorted(unknown))}")
    if args.out and not os.access(os.path.dirname(os.path.abspath(args.out)), os.W_OK):
        parser.error(f"cannot write --out {args.out}")
    return args


def run_bench_comm(spec, args, density: float, algorithms: list) -> dict:
    """bench_comm.py across the emulated hosts; returns its JSON document."""
    with tempfile.TemporaryDirectory() as folder:
        out = os.path.join(folder, "bench.json")
        command = [sys.executable, str(HERE / "bench_comm.py"), "--sizes", ",".join(map(str, args.sizes)),
                   "--density", str(density), "--algorithms", ",".join(algorithms),
                   "--repeat", str(args.repeat), "--warmup", str(args.warmup), "--out", out]
        if args.selector:
            command += ["--selector", args.selector]
        result = subprocess.run(emucluster.mpiexec_command(spec, command), capture_output=True, text=True,
                                timeout=args.limit)
        if result.returncode != 0:
            raise RuntimeError(f"bench_comm failed ({result.returncode}):\n{result.stdout}\n{result.stderr}")
        return json.loads(Path(out).read_text())


def table(records: list) -> str:
    algorithms = [a for a in ALGORITHMS if any(r["algorithm"] == a for r in records)]
    keys = sorted({(r["layout"], r["rate_bps"], r["rate"], r["size"], r["density"]) for r in records})
    lines = [f"{'layout':>6} {'rate':>8} {'size':>9} {'density':>7} " + " ".join(f"{a:>13}" for a in algorithms)
             + "   (ms per call, slowest rank)"]
    for layout, _, rate, size, density in keys:
        cells = []
        for algorithm in algorithms:
            # dense algorithms ran at the first density only: their time holds for all
            match = [r for r in records if (r["layout"], r["rate"], r["size"], r["algorithm"]) == (layout, rate, size, algorithm)
                     and (r["density"] == density or algorithm in DENSE)]
            cells.append(f"{match[0]['time_median'] * 1e3:13.1f}" if match else f"{'-':>13}")
        lines.append(f"{layout:>6} {rate:>8} {size:>9} {density:>7} " + " ".join(cells))
    return "\n".join(lines)


def main() -> int:
    args = parse_args()
    reason = emucluster.available()
    if reason:
        print(f"bench_cluster.py: error: {reason}", file=sys.stderr)
        return 2
    records, document = [], {"meta": vars(args).copy(), "records": []}
    document["meta"]["layouts"] = [f"{h}x{r}" for h, r in args.layouts]
    for hosts, ranks in args.layouts:
        emucluster.down(args.prefix)
        spec = emucluster.up(emucluster.ClusterSpec(hosts, ranks, args.rates[0], "0us", args.prefix))
        try:
            for rate in args.rates:
                spec = emucluster.reshape(spec, rate, "0us")
                for i, density in enumerate(args.densities):
                    algorithms = [a for a in args.algorithms if i == 0 or a not in DENSE]
                    print(f"# {hosts}x{ranks} at {rate}, density {density}: {', '.join(algorithms)}", flush=True)
                    result = run_bench_comm(spec, args, density, algorithms)
                    for row in result["results"]:
                        records.append({"layout": f"{hosts}x{ranks}", "hosts": hosts, "ranks_per_host": ranks,
                                        "rate": rate, "rate_bps": emucluster.rate_bits_per_second(rate),
                                        "density": density, **row})
                    document["records"] = records
                    document["bench_comm_meta"] = result["meta"]
                    if args.out:
                        _write(args.out, document)
        finally:
            emucluster.down(args.prefix)
    print(table(records))
    return 0


def _write(path: str, document: dict) -> None:
    temporary = path + ".tmp"
    Path(temporary).write_text(json.dumps(document, indent=1))
    os.replace(temporary, path)


if __name__ == "__main__":
    sys.exit(main())
