#!/usr/bin/env python3
"""Run the MPI test suites under mpiexec at several world sizes, each launch
under a hard time limit so that a deadlock fails fast instead of hanging.

Each launch is ``pytest --with-mpi -m mpi`` on every rank, which keeps the
tests that asked for its world size (``@pytest.mark.worlds``, tests/conftest.py;
those on the ``topology`` fixture loop over emulated node layouts themselves);
``SPAR_COMM_RANKS_PER_NODE`` is also set so code that reads the environment
sees emulated nodes. Rank 0's report is shown; other ranks' output only when a
launch fails. The last line is the total.
"""
from __future__ import annotations

import argparse
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))
from shm_cleanup import mpi_segments, remove_orphaned_segments  # noqa: E402  (no MPI: this process must not init it)
LAUNCHES = "1:1,2:1,3:2,4:2,6:3"  # ranks:ranks per node, each launch
RANK_VARIABLES = ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "SLURM_PROCID")
COUNTS = re.compile(r"(\d+) (passed|failed|skipped|errors?|xfailed|xpassed)")


#: Seconds a test may take before it dumps its stack and ends its process (and so the launch).
TEST_LIMIT = 240


def launch_limit(limit: float, ranks: int) -> float:
    """A launch's seconds: ``limit`` up to 4 ranks, more beyond in proportion,
    since every rank shares the same cores (6 ranks on 2 cores ran for 600 s)."""
    return limit * max(1.0, ranks / 4)


#: pytest's exit status when every test was deselected: no test asked for this world size.
NO_TESTS = 5


def run_launch(mpiexec: str, ranks: int, ranks_per_node: int, limit: float, extra: list,
               marks: str = "mpi") -> dict:
    test_limit = min(TEST_LIMIT, max(10, int(limit * 0.4)))
    logs = tempfile.mkdtemp(prefix="spar_comm_mpi_tests_")
    command = [
        mpiexec, "-n", str(ranks), sys.executable, __file__, "--rank-log", logs, "--",
        sys.executable, "-m", "pytest", "--with-mpi", "-m", marks, "-q", "-rfE",
        "-p", "no:cacheprovider", f"--timeout={test_limit}", "--timeout-method=thread", *extra,
    ]
    marker = f"{os.getpid()}-{ranks}-{time.monotonic_ns()}"
    env = dict(os.environ, SPAR_COMM_RANKS_PER_NODE=str(ranks_per_node), SPAR_COMM_TEST_LAUNCH=marker)
    start = time.monotonic()
    process = subprocess.Popen(
        command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True, start_new_session=True,
    )
    try:
        output, _ = process.communicate(timeout=limit)
        timed_out = False
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        kill_marked(marker)  # ranks the launcher started outside its process group
        output, _ = process.communicate()
        timed_out = True
    per_rank = {-1: output.splitlines()}
    for rank in range(ranks):
        log = Path(logs, f"rank{rank}.log")
        per_rank[rank] = log.read_text(errors="replace").splitlines() if log.exists() else ["(no output)"]
    summary = {}
    for text in reversed(per_rank.get(0, [])):
        if " in " in text and COUNTS.search(text):
            summary = {word.rstrip("s") if word.startswith("error") else word: int(n) for n, word in COUNTS.findall(text)}
            break
    ok = not timed_out and process.returncode in (0, NO_TESTS) and summary.get("failed", 0) == 0
    return dict(ok=ok, timed_out=timed_out, code=process.returncode, summary=summary,
                per_rank=per_rank, seconds=time.monotonic() - start)


def kill_marked(marker: str, variable: str = "SPAR_COMM_TEST_LAUNCH") -> int:
    """SIGKILL every process whose environment carries ``variable=marker`` (a
    launch's marker); returns how many there were (what the launch left behind)."""
    needle = f"{variable}={marker}".encode()
    killed = 0
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/environ", "rb") as environ:
                if needle in environ.read().split(b"\0"):
                    os.kill(int(pid), signal.SIGKILL)
                    killed += 1
        except OSError:
            continue
    return killed


def exec_with_rank_log(folder: str, command: list) -> None:
    """Become ``command`` with stdout and stderr in ``folder``/rank<R>.log, so that
    ranks' lines never interleave. R comes from the launcher's environment."""
    rank = next(os.environ[v] for v in RANK_VARIABLES if v in os.environ)
    log = os.open(os.path.join(folder, f"rank{rank}.log"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.execv(command[0], command)


def launches(text: str) -> list:
    """``"1:1,4:2"`` as [(1, 1), (4, 2)]: the world size and node size of each launch."""
    try:
        pairs = [tuple(int(n) for n in item.split(":")) for item in text.split(",")]
    except ValueError:
        pairs = []
    if not pairs or any(len(p) != 2 or not 1 <= p[1] <= p[0] for p in pairs):
        raise argparse.ArgumentTypeError(f"want RANKS:RANKS_PER_NODE,... with 1 <= RANKS_PER_NODE <= RANKS, got {text!r}")
    return pairs


def main() -> int:
    if len(sys.argv) > 3 and sys.argv[1] == "--rank-log":
        exec_with_rank_log(sys.argv[2], sys.argv[4:])
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mpiexec", default="mpiexec", help="the MPI launcher (default: %(default)s)")
    parser.add_argument("--limit", type=float, default=600,
                        help="seconds per launch of up to 4 ranks before it is killed, more beyond in proportion "
                             "(default: %(default)s)")
    parser.add_argument("--launches", type=launches, default=LAUNCHES,
                        help="RANKS:RANKS_PER_NODE of each launch, comma-separated (default: %(default)s)")
    parser.add_argument("--marks", default="mpi",
                        help="the tests to run, as a pytest -m expression (default: %(default)s)")
    parser.add_argument("pytest_args", nargs="*", help="extra pytest arguments, e.g. a test file or -k EXPR")
    args = parser.parse_args()

    passed = failed = skipped = 0
    for ranks, rpn in args.launches:
        before = mpi_segments()
        result = run_launch(args.mpiexec, ranks, rpn, launch_limit(args.limit, ranks), args.pytest_args or ["tests"],
                            args.marks)
        remove_orphaned_segments(before)  # a launch killed at its limit leaves them
        counts = result["summary"]
        passed += counts.get("passed", 0)
        skipped += counts.get("skipped", 0)
        failed += counts.get("failed", 0) + counts.get("error", 0)
        status = "ok" if result["ok"] else ("TIMED OUT (deadlock?)" if result["timed_out"] else "FAILED")
        print(f"mpiexec -n {ranks} (SPAR_COMM_RANKS_PER_NODE={rpn}): {status} in {result['seconds']:.0f} s: {counts}",
              flush=True)
        if not result["ok"]:
            failed += 0 if counts.get("failed") or counts.get("error") else 1  # a crash or time-out
            for rank in sorted(result["per_rank"]):
                print(f"---- output of rank {rank} ----" if rank >= 0 else "---- launcher ----")
                print("\n".join(result["per_rank"][rank][-60:]))
    print(f"mpi: {passed} passed, {failed} failed, {skipped} skipped")
    return 0 if failed == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
