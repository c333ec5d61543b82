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
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

import mpi4py

# Importing spar_comm starts no MPI in this process: the steps start their own jobs.
mpi4py.rc.initialize = False
mpi4py.rc.finalize = False

from spar_comm.bench.gpu_plan import environment, find_mpiexec, machine, plan  # noqa: E402
from spar_comm.bench.gpu_report import write_reports  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
#: Seconds kept back from the budget for the reports.
MARGIN = 10


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
    env = environment(args.simulate)
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
