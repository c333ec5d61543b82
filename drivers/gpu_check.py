#!/usr/bin/env python3
"""Everything that needs a GPU, in one command, with one JSON and one Markdown report.

    python3 drivers/gpu_check.py --out gpu-check        # (make gpu-check OUT=gpu-check)

Steps, each under its own time limit inside --budget (10 minutes by default):
``make test-gpu`` at 1, 2 and 4 ranks sharing the GPU; ``bench_topk.py
--device gpu`` at 2^20 to 2^26, float32 and float16, densities 0.001 and
0.01; ``bench_comm.py --device gpu`` on 2 ranks; ``train.py --device gpu``
(MLP and CNN); ``train_torch.py`` on CUDA with a 17M-parameter model; the DDP
hook on CUDA (``train_ddp.py``); the allreducers and the DDP example over
torch.distributed on CUDA tensors (NCCL, gloo) under torchrun. It prints the
device's name first, and rewrites ``gpu-check.json`` and ``gpu-check.md`` in
--out after every step, so a run cut short keeps what it did. Exit status 0
when every step passed.

``--simulate`` runs the same plumbing without a GPU (numba-cuda's simulator,
small sizes, a few tests): how the test suite checks this driver.

It needs, beside the GPU: torch with CUDA, CuPy, numba-cuda, mpi4py with its
MPI launcher, h5py, scikit-learn, pytest, pytest-mpi, pytest-timeout,
hypothesis, array-api-compat, tqdm, and spar_comm itself (``pip install
--no-deps .``); ``drivers/fetch_gpu_wheels.sh`` downloads the ones a machine lacks.
"""
from __future__ import annotations

import argparse
import datetime
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

import mpi4py

# Importing spar_comm starts no MPI in this process: the steps start their own jobs.
mpi4py.rc.initialize = False
mpi4py.rc.finalize = False

from spar_comm.bench.gpu_report import Step, clean, write_reports  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
SIZES = [1 << e for e in range(20, 27)]
#: Seconds kept back from the budget for the reports.
MARGIN = 10


def find_mpiexec(python: str) -> str:
    """The launcher beside this Python, else the one on PATH."""
    beside = Path(python).parent / "mpiexec"
    return str(beside) if beside.exists() else (shutil.which("mpiexec") or "mpiexec")


def plan(simulate: bool, python: str, mpiexec: str, work: Path, cub_topk: Optional[str] = None) -> List[Step]:
    """The steps: on the GPU, or their small simulated stand-ins."""
    def mpi(n: int, *args: Any) -> List[Any]:
        return [mpiexec, "-n", n, python, *args]

    def test_gpu(ranks: int) -> Step:
        make = ["make", "test-gpu", f"GPU_RANKS={ranks}", f"PY={python}", f"MPIEXEC={mpiexec}"]
        if simulate:  # the plumbing only: the suites run in full in `make test`
            make += ["CUDASIM=1", "GPU_SERIAL_TESTS=tests/test_torch_units.py",
                     "GPU_TESTS=tests/test_gpu_path_mpi.py -k mstopk_on_the_device"]
        return Step(f"make test-gpu, {ranks} rank{'s' if ranks > 1 else ''}", make, 200)

    # The suites at 2 and 4 ranks come last: a run cut short still has every kind of figure.
    steps = [test_gpu(1)]
    device = "gpu-simulator" if simulate else "gpu"
    topk = ["--sizes", "2048", "--densities", "0.01", "--dtype", "float32", "--methods", "mstopk", "--repeat", "1",
            "--no-torch"] \
        if simulate else ["--sizes", ",".join(map(str, SIZES)), "--densities", "0.001,0.01", "--dtype",
                          "float32,float16", "--repeat", "9", "--graphs", *(["--cub-topk", cub_topk] if cub_topk else [])]
    steps.append(Step("bench_topk.py", [python, "drivers/bench_topk.py", "--device", device, *topk,
                                        "--out", work / "topk.json"], 150, work / "topk.json"))
    comm = ["--sizes", "2048", "--algorithms", "dense,hitopk", "--warmup", "0", "--repeat", "1"] if simulate else \
        ["--sizes", "1048576,16777216", "--warmup", "2", "--repeat", "5"]
    steps.append(Step("bench_comm.py, 2 ranks", mpi(2, "drivers/bench_comm.py", "--device", device,
                                                     "--ranks-per-node", "1", *comm, "--out", work / "comm.json"),
                      90, work / "comm.json"))
    length = ["--steps", "3", "--batch-size", "8", "--algorithm", "dense"] if simulate else ["--steps", "200"]
    for model in ("mlp",) if simulate else ("mlp", "cnn"):
        steps.append(Step(f"train.py --model {model}, 2 ranks",
                          mpi(2, "drivers/train.py", "--device", device, "--model", model, *length, "--trace", "",
                              "--no-progress"), 90))
    if simulate:  # one rank: the torch scripts' start-up is most of their time here
        small = ["--device", "gpu-simulator", "--algorithm", "dense", "--epochs", "1", "--batch-size", "512"]
        steps.append(Step("train_torch.py, simulated", mpi(1, "drivers/train_torch.py", *small, "--hidden", "16"), 90))
        steps.append(Step("train_ddp.py (DDP hook), simulated", mpi(1, "drivers/train_ddp.py", *small), 90))
        return steps
    steps.append(Step("train_torch.py on CUDA, 17M parameters, 2 ranks",
                      mpi(2, "drivers/train_torch.py", "--device", "cuda", "--hidden", "4096", "--density", "0.001",
                          "--epochs", "2"), 120))
    steps.append(Step("train_ddp.py (DDP hook) on CUDA, 2 ranks",
                      mpi(2, "drivers/train_ddp.py", "--device", "cuda", "--density", "0.01", "--epochs", "5"), 90))
    steps.append(Step("torch.distributed on CUDA: NCCL (1 rank), gloo (2 ranks), under torchrun",
                      ["env", "SPAR_COMM_REQUIRE_GPU=1", python, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                       "--timeout=160", "tests/test_torchrun_gpu.py"], 200))
    return steps + [test_gpu(2), test_gpu(4)]


def probe(python: str, code: str) -> str:
    """What a short Python snippet prints (in a process of its own: MPI and CUDA stay out of this one)."""
    try:
        done = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=60)
    except subprocess.TimeoutExpired:
        return "(no answer in 60 s)"
    if done.returncode == 0:
        return clean(done.stdout).strip()
    lines = done.stderr.strip().splitlines()
    return f"(failed: {lines[-1] if lines else done.returncode})"


def machine(simulate: bool, python: str, mpiexec: str) -> Dict[str, str]:
    versions = ("import importlib.metadata as m\nfor p in ('torch','cupy-cuda13x','numba','numba-cuda','mpi4py',"
                "'h5py','spar_comm'):\n  try: print(p, m.version(p), end='; ')\n  except Exception: print(p, '-', end='; ')")
    return {
        "device": "numba-cuda's CUDA simulator (no GPU)" if simulate else
        probe(python, "import torch; print(torch.cuda.get_device_name(0))"),
        "cuda": "" if simulate else probe(python, "import torch; print(torch.version.cuda)"),
        "mpi_library": probe(python, "from mpi4py import MPI; print(MPI.Get_library_version().splitlines()[0])"),
        "mpiexec": mpiexec,
        "python": probe(python, "import sys; print(sys.version.split()[0])"),
        "packages": probe(python, versions),
        "host": os.uname().nodename,
    }


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="folder for gpu-check.json and gpu-check.md")
    parser.add_argument("--simulate", action="store_true", help="no GPU: the plumbing under the simulator")
    parser.add_argument("--budget", type=float, default=570, help="seconds for all steps (default: %(default)s)")
    parser.add_argument("--python", default=sys.executable, help="the Python of the steps (default: this one)")
    parser.add_argument("--mpiexec", help="the MPI launcher (default: beside --python, else on PATH)")
    parser.add_argument("--only", help="run only the steps whose name contains this")
    parser.add_argument("--cub-topk", metavar="LIB.so",
                        help="CUB's DeviceTopK for bench_topk.py (drivers/build_cub_topk.sh builds it)")
    args = parser.parse_args(argv)
    if args.budget <= MARGIN:
        parser.error(f"--budget must be more than {MARGIN} s")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu-check.log").write_text("")
    deadline = time.monotonic() + args.budget - MARGIN
    # Absolute paths: Open MPI's mpiexec, started by its full path, puts its own
    # bin/ first on the ranks' PATH, so a bare "python3" could be another Python.
    python = shutil.which(args.python) or args.python
    mpiexec = (shutil.which(args.mpiexec) or args.mpiexec) if args.mpiexec else find_mpiexec(python)
    # PYTHONSAFEPATH: the checkout's spar_comm/ (whose kernels live in kernels/)
    # must not shadow an installed spar_comm when pytest runs from the checkout.
    env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONSAFEPATH="1", NUMBA_ENABLE_CUDASIM="1" if args.simulate else "0",
               OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    env.pop("SPAR_COMM_RANKS_PER_NODE", None)  # each step says its own layout
    report: Dict[str, Any] = {
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "mode": "simulated" if args.simulate else "gpu",
        "machine": machine(args.simulate, python, mpiexec),
    }
    print(f"gpu-check on {report['machine']['device']} ({report['machine']['mpi_library']})", flush=True)
    with tempfile.TemporaryDirectory(prefix="spar_comm_gpu_check_") as work:
        steps = [s for s in plan(args.simulate, python, mpiexec, Path(work), args.cub_topk) if not args.only or args.only in s.name]
        report["steps"] = [s.result for s in steps]
        for step in steps:
            step.run(env, deadline - time.monotonic(), out / "gpu-check.log", cwd=ROOT)
            print(f"{step.name}: {step.result['status']} ({step.result.get('seconds', 0)} s) "
                  f"{step.result.get('summary', '')}", flush=True)
            write_reports(out, report)
    passed = sum(s["status"] == "passed" for s in report["steps"])
    print(f"gpu-check: {passed} of {len(report['steps'])} steps passed; reports in {out}/gpu-check.{{json,md}}")
    return 0 if passed == len(report["steps"]) else 1


if __name__ == "__main__":
    sys.exit(main())
