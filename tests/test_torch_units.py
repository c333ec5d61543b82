"""spar_comm.torch's pieces that need no MPI job: where parameters must be for
a topology's memory, and the stream layer chosen for it."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")

from spar_comm.memory import HOST  # noqa: E402
from spar_comm.torch.optimizer import _device_problem  # noqa: E402
from spar_comm.torch.streams import NoStreams, streams_for, tensor_device  # noqa: E402

GPU0 = SimpleNamespace(name="gpu", index=0)
SIMULATED = SimpleNamespace(name="gpu-simulator", index=0)


def on(device: str):
    """A stand-in parameter on ``device`` (no GPU is needed to name one)."""
    return SimpleNamespace(device=torch.device(device))


def test_parameters_must_be_on_the_ranks_gpu():
    assert _device_problem([("w", on("cuda:0"))], GPU0) is None
    assert "is on cuda:1, but this rank's GPU is cuda:0" in _device_problem([("w", on("cuda:1"))], GPU0)
    assert "takes parameters on cuda:0" in _device_problem([("w", on("cpu"))], GPU0)


def test_cpu_and_simulated_gpu_take_cpu_parameters():
    assert _device_problem([("w", on("cpu"))], HOST) is None
    assert _device_problem([("w", on("cpu"))], SIMULATED) is None
    assert "need Topology(device='gpu')" in _device_problem([("w", on("cuda:0"))], HOST)
    assert "gpu-simulator takes CPU tensors" in _device_problem([("w", on("cuda:0"))], SIMULATED)


def test_only_a_real_gpu_has_streams():
    for memory in (HOST, SIMULATED):
        streams = streams_for(memory)
        assert type(streams) is NoStreams and tensor_device(memory) == torch.device("cpu")
        assert streams.produced() is None and streams.finished() is None
        with streams.communicating([None]):
            pass
    assert tensor_device(GPU0) == torch.device("cuda", 0)
