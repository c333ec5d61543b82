"""Ordering between backward and the gradient communication: CUDA streams and events.

Backward writes a gradient on the stream that produced it; the communication
reads it on a stream of its own, and whoever uses the result (``step()``, or
DDP through the hook's future) runs on its own stream again. Three events
order them, never a device-wide synchronise:

* ``produced()``: recorded on the current stream when a gradient is final;
* ``communicating(after)``: the communication stream waits for those events,
  and everything inside the block (torch copies, CuPy arithmetic, the device
  kernels) is queued on it; ``finished()`` records its end there;
* ``consume(event)``: the caller's current stream waits for that end.

``NoStreams`` is the same interface doing nothing: CPU tensors, and the GPU
path under numba-cuda's simulator, which runs the same code on CPU tensors.
"""
from __future__ import annotations

import contextlib
from typing import Any, Iterator, Optional, Sequence

import ml_dtypes
import numpy as np
import torch


class NoStreams:
    """No streams: work happens in program order, so there is nothing to wait for."""

    def produced(self) -> Optional[Any]:
        """An event after the work queued so far on the current stream (None: none needed)."""
        return None

    @contextlib.contextmanager
    def communicating(self, after: Sequence[Any]) -> Iterator[None]:
        """Run the block's device work after the events ``after``, on the communication stream."""
        yield

    def finished(self) -> Optional[Any]:
        """Inside ``communicating``: an event after the block's work so far."""
        return None

    def consume(self, event: Optional[Any]) -> None:
        """Make the current stream wait for ``event`` (from ``finished``)."""


class CudaStreams(NoStreams):
    """A communication stream of its own on ``device``, shared by torch and CuPy
    (the allreducers run on CuPy's current stream)."""

    def __init__(self, device: torch.device):
        import cupy

        self.device = device
        self.stream = torch.cuda.Stream(device)
        self._cupy_device = cupy.cuda.Device(device.index)
        self._cupy_stream = cupy.cuda.ExternalStream(self.stream.cuda_stream, device.index)

    def produced(self) -> torch.cuda.Event:
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        return event

    @contextlib.contextmanager
    def communicating(self, after: Sequence[Any]) -> Iterator[None]:
        # The device and current stream are per thread in torch and in CuPy: set both.
        with torch.cuda.device(self.device), torch.cuda.stream(self.stream), self._cupy_device, self._cupy_stream:
            for event in after:
                self.stream.wait_event(event)
            yield

    def finished(self) -> torch.cuda.Event:
        event = torch.cuda.Event()
        event.record(self.stream)
        return event

    def consume(self, event: Optional[Any]) -> None:
        if event is not None:
            torch.cuda.current_stream(self.device).wait_event(event)


def streams_for(memory: Any) -> NoStreams:
    """The ordering for an allreducer memory: CUDA streams on a real GPU, none
    on the CPU or the simulated GPU."""
    if memory.name == "gpu":
        return CudaStreams(torch.device("cuda", memory.index))
    return NoStreams()


def tensor_device(memory: Any) -> torch.device:
    """Where a memory's tensors live: the rank's GPU, else the CPU (the simulator's too)."""
    return torch.device("cuda", memory.index) if memory.name == "gpu" else torch.device("cpu")


def as_tensor(array: Any) -> torch.Tensor:
    """A tensor over an allreducer's array, sharing its memory (NumPy, or CuPy through DLPack).
    NumPy has no bfloat16 of its own: ml_dtypes' arrays cross as their 16 bits."""
    if not isinstance(array, np.ndarray):
        return torch.from_dlpack(array)
    if array.dtype == ml_dtypes.bfloat16:
        return torch.from_numpy(array.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(array)


def as_array(tensor: torch.Tensor) -> Any:
    """An array over a tensor's memory for an allreducer: NumPy on the CPU
    (bfloat16 as ml_dtypes' type), the tensor itself on a GPU."""
    if tensor.device.type != "cpu":
        return tensor
    if tensor.dtype == torch.bfloat16:
        return tensor.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return tensor.numpy()
