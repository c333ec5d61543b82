"""What drivers/gpu_check.py runs: its steps on a GPU, or their small
simulated stand-ins where there is none (numba-cuda's simulator), the
environment they run in, and the machine its reports name. Each step's
command is run by ``gpu_report.Step``; like it, this module starts no MPI
and no CUDA in the check's own process."""
from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path
from typing import Any, Dict, List, Optional

from .gpu_report import Step, clean

SIZES = [1 << e for e in range(20, 27)]


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
    """The device, CUDA, MPI, Python and package versions the steps run with, and the host."""
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


def environment(simulate: bool) -> Dict[str, str]:
    """The steps' environment: this one, unbuffered, with the simulator on or
    off, Open MPI allowed to run as root, and no emulated node size (each
    step says its own layout)."""
    # PYTHONSAFEPATH: the checkout's spar_comm/ (whose kernels live in kernels/)
    # must not shadow an installed spar_comm when pytest runs from the checkout.
    env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONSAFEPATH="1", NUMBA_ENABLE_CUDASIM="1" if simulate else "0",
               OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    env.pop("SPAR_COMM_RANKS_PER_NODE", None)
    return env
