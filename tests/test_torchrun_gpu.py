"""spar_comm over torch.distributed on a GPU (a step of ``make gpu-check``,
which sets SPAR_COMM_REQUIRE_GPU=1 so that a machine without CUDA torch
and CuPy fails it; elsewhere skipped): CuPy arrays through every
reproducible allreducer against the serial reference, on NCCL (a world of
one: NCCL refuses two ranks on one GPU) and on gloo at 2 ranks sharing the
GPU. Where the group takes device buffers nothing is staged through the
host; where it does not, spar_comm stages them and counts it. And the DDP
example on NCCL."""
from __future__ import annotations

import os

import pytest

from conftest import ROOT
from test_torchrun import lines_of

try:
    import cupy  # noqa: F401
    import torch
    missing = None if torch.cuda.is_available() else "torch sees no CUDA device"
except ImportError as error:
    missing = str(error)
if missing and os.environ.get("SPAR_COMM_REQUIRE_GPU") == "1":
    pytest.fail(f"the GPU check needs CUDA torch and CuPy: {missing}", pytrace=False)
if missing:
    pytest.skip(missing, allow_module_level=True)

SCRIPT = ROOT / "tests" / "torchrun_allreducers.py"


@pytest.mark.parametrize("ranks, backend, in_place, staged", [
    (1, "nccl", "True", "[False]"),
    (2, "gloo", "False", "[True]"),
])
def test_every_allreducer_on_device_arrays_over_a_torch_group(ranks, backend, in_place, staged):
    lines = lines_of(ranks, "--device", "gpu", "--backend", backend, script=SCRIPT, limit=140)
    for rank in range(ranks):
        cases = lines.get((rank, "summary"), "(no line)")
        assert cases.endswith(" cases, 0 failed") and not cases.startswith("0 "), (rank, cases, lines)
        assert lines.get((rank, "staging")) == f"in place {in_place}, staged {staged}", lines


def test_device_buffers_go_to_gloo_as_they_are_when_told(monkeypatch):
    """SPAR_COMM_CUDA_AWARE=1: gloo's collectives take the CUDA tensors (gloo
    copies them itself); its send and receive do not, and TorchComm moves those."""
    monkeypatch.setenv("SPAR_COMM_CUDA_AWARE", "1")
    lines = lines_of(2, "--device", "gpu", "--backend", "gloo", script=SCRIPT, limit=140)
    for rank in range(2):
        cases = lines.get((rank, "summary"), "(no line)")
        assert cases.endswith(" cases, 0 failed") and not cases.startswith("0 "), (rank, cases, lines)
        assert lines.get((rank, "staging")) == "in place True, staged [False]", lines


def test_the_ddp_example_on_nccl_stages_nothing():
    from conftest import torchrun

    run, left = torchrun(1, ROOT / "drivers" / "train_ddp.py", "--device", "cuda", "--backend", "nccl",
                         "--epochs", "2", limit=150)
    assert run.returncode == 0 and left == 0, run.stdout[-2000:] + run.stderr[-3000:]
    done = [line for line in run.stdout.splitlines() if line.startswith("done: ")]
    assert done and "on cuda:" in done[0] and "bytes_staged 0 in the last step" in done[0], run.stdout[-2000:]
