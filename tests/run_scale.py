#!/usr/bin/env python3
"""``make test-scale``: the serial reference checks of tests/test_scale_mpi.py
at 8, 12 and 16 ranks, each launch under a hard time limit.

On one host the nodes are emulated (SPAR_COMM_RANKS_PER_NODE); as root the
same layouts run again on emulated hosts (spar_comm.emucluster, network
namespaces, MPICH over TCP between them), where ``Split_type`` finds the
nodes. Layouts are NODESxRANKS: 8x2, 16x1 and 4x4 at 16 ranks, and uneven
nodes of 5 at 8 ranks (5+3) and at 12 ranks (5+5+2). Not part of ``make
test``: 16 ranks on a 2-core machine take minutes.
"""
from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from run_mpi import COUNTS, kill_marked

from spar_comm import emucluster
from spar_comm.topology import ENV_RANKS_PER_NODE

ROOT = Path(__file__).resolve().parent.parent
#: (ranks, ranks per node): the nodes are consecutive runs of that many ranks, the last one shorter.
LAYOUTS = [(16, 2), (16, 1), (16, 4), (8, 5), (12, 5)]
PREFIX = "sps"  # the emulated hosts' prefix: not the default, so nobody's own cluster is touched


def pytest_command(logs: str) -> list:
    """pytest on every rank, each rank's output in its own log (run_mpi.py's wrapper)."""
    return [sys.executable, str(ROOT / "tests" / "run_mpi.py"), "--rank-log", logs, "--",
            sys.executable, "-m", "pytest", "--with-mpi", "-m", "mpi", "-q", "-rfE", "-p", "no:cacheprovider",
            str(ROOT / "tests" / "test_scale_mpi.py")]


def one_host(mpiexec: str, ranks: int, per_node: int, limit: float, logs: str) -> int:
    """A launch on this host with nodes of ``per_node`` emulated; its exit status (124: timed out)."""
    marker = f"{os.getpid()}-{time.monotonic_ns()}"
    env = dict(os.environ, **{ENV_RANKS_PER_NODE: str(per_node)}, SPAR_COMM_TEST_LAUNCH=marker)
    process = subprocess.Popen([mpiexec, "-n", str(ranks), *pytest_command(logs)], cwd=ROOT, env=env,
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        return process.wait(timeout=limit)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        kill_marked(marker)
        process.wait()
        return 124


def emulated_hosts(ranks: int, per_node: int, rate: str, limit: float, logs: str) -> int:
    """A launch across ceil(ranks / per_node) emulated hosts, MPICH filling each in turn."""
    hosts = -(-ranks // per_node)
    emucluster.down(PREFIX)
    spec = emucluster.up(emucluster.ClusterSpec(hosts, per_node, rate, "0us", PREFIX))
    try:
        command = emucluster.mpiexec_command(spec, pytest_command(logs), ranks=ranks)
        return subprocess.run(command, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                              timeout=limit).returncode
    except subprocess.TimeoutExpired:
        return 124
    finally:
        emucluster.down(PREFIX)


def summary(logs: str) -> dict:
    """Rank 0's pytest counts, e.g. {'passed': 19}."""
    log = Path(logs, "rank0.log")
    for line in reversed(log.read_text(errors="replace").splitlines() if log.exists() else []):
        if " in " in line and COUNTS.search(line):
            return {word: int(n) for n, word in COUNTS.findall(line)}
    return {}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mpiexec", default="mpiexec", help="the MPI launcher (default: %(default)s)")
    parser.add_argument("--limit", type=float, default=900, help="seconds per launch before it is killed")
    parser.add_argument("--rate", default="10gbit", help="link rate of the emulated hosts (default: %(default)s)")
    parser.add_argument("--where", choices=("both", "one-host", "hosts"), default="both",
                        help="one host with emulated nodes, emulated hosts, or both (default: %(default)s)")
    args = parser.parse_args()
    os.environ.pop(ENV_RANKS_PER_NODE, None)  # on the emulated hosts the nodes are found, not emulated
    reason = "--where one-host" if args.where == "one-host" else emucluster.available()
    where = (["one host"] if args.where != "hosts" else []) + (["emulated hosts"] if reason is None else [])
    failed, began = 0, time.monotonic()
    for place in where:
        for ranks, per_node in LAYOUTS:
            logs = tempfile.mkdtemp(prefix="spar_comm_scale_")
            start = time.monotonic()
            if place == "one host":
                code = one_host(args.mpiexec, ranks, per_node, args.limit, logs)
            else:
                code = emulated_hosts(ranks, per_node, args.rate, args.limit, logs)
            counts = summary(logs)
            ok = code == 0 and counts.get("passed", 0) > 0 and not counts.get("failed")
            failed += not ok
            if ok:
                shutil.rmtree(logs)
            nodes = f"{ranks // per_node}x{per_node}" + (f"+{ranks % per_node}" if ranks % per_node else "")
            status = "ok" if ok else ("TIMED OUT" if code == 124 else f"FAILED (exit {code}; logs in {logs})")
            print(f"{ranks:>2} ranks as {nodes:<6} on {place}: {status} in {time.monotonic() - start:.0f} s: {counts}",
                  flush=True)
    if reason is not None:
        print(f"emulated hosts skipped: {reason}")
    print(f"scale: {len(where) * len(LAYOUTS) - failed} launches ok, {failed} failed, {time.monotonic() - began:.0f} s")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
