"""The HDF5 trace of a run (DESIGN §6): per-step, per-rank records gathered
to rank 0 every few steps and appended there, flushed after each append.

The file is in SWMR mode from its creation on, so ``analyze.py --follow`` can
read it while the run goes on, and every flushed step survives a crash.
"""
from __future__ import annotations

import datetime
import json
import os
from dataclasses import dataclass
from typing import Any, Dict, Optional

import h5py
import numpy as np
from mpi4py import MPI

from ..files import BadFileError, attribute, dataset, open_hdf5
from ..mpi_strings import library_version

PHASES = ("data", "compute", "select", "comm_intra", "comm_inter", "update", "step")
BYTES = ("intra", "inter")
EVAL = ("step", "epoch", "train_loss", "test_metric", "wall")
#: The columns of one rank's record of one step, in the order the ranks send them.
FIELDS = PHASES + ("bytes_intra", "bytes_inter", "k", "threshold", "loss", "lr", "density")
COLUMN = {name: i for i, name in enumerate(FIELDS)}


class StepRecorder:
    """Collects this rank's records and gathers them to rank 0 every ``every`` steps.

    The gather is a buffer-based ``Gather`` of float64 rows (no pickling on
    the hot path). Rank 0 hands each block to the writer, when there is one,
    and keeps per-rank totals for the run's summary.
    """

    def __init__(self, comm: MPI.Comm, every: int, writer: Optional["TraceWriter"] = None):
        self.comm, self.every, self.writer = comm, every, writer
        self.rows = np.zeros((every, len(FIELDS)))
        self.steps = np.zeros(every, dtype=np.int64)
        self.count = 0
        root = comm.rank == 0
        self.recv = np.zeros(comm.size * every * len(FIELDS)) if root else None
        self.totals = np.zeros((comm.size, len(FIELDS))) if root else None
        self.steps_gathered = 0

    def record(self, step: int, values: Dict[str, float]) -> None:
        """Keep one step's figures; gather (a collective) when the buffer is full."""
        row = self.rows[self.count]
        for name, value in values.items():
            row[COLUMN[name]] = value
        self.steps[self.count] = step
        self.count += 1
        if self.count == self.every:
            self.flush()

    def flush(self) -> None:
        """Gather what is buffered to rank 0 and append it. Collective: every rank
        calls it after the same steps."""
        n = self.count
        if n == 0:
            return
        recv = None if self.recv is None else self.recv[: self.comm.size * n * len(FIELDS)].reshape(self.comm.size, n, -1)
        self.comm.Gather(self.rows[:n], recv, root=0)
        self.count = 0
        if recv is None:
            return
        block = np.ascontiguousarray(recv.transpose(1, 0, 2))  # [step, rank, field]
        self.totals += block.sum(axis=0)
        self.steps_gathered += n
        if self.writer is not None:
            self.writer.append(self.steps[:n], block)


class TraceWriter:
    """Rank 0's trace file. A resumed run appends to the trace of the run it
    continues, dropping rows past the checkpoint's step."""

    def __init__(self, path: str, attrs: Dict[str, Any], hosts: list, resume_step: Optional[int] = None):
        world = len(hosts)
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        if resume_step is not None and os.path.exists(path):
            with open_hdf5(path, live=True) as existing:  # refuse a bad trace before touching it
                check_trace(existing, world)
            try:
                self.file = h5py.File(path, "a", libver="latest")
            except OSError:  # its writer died: the file stays marked open, so copy what a reader sees
                self._rebuild(path, world)
            self._truncate(resume_step)
        else:
            self.file = h5py.File(path, "w", libver="latest")
            self._create(world, attrs, hosts)
        self.file.swmr_mode = True

    def _create(self, world: int, attrs: Dict[str, Any], hosts: list) -> None:
        f = self.file
        f.attrs["created"] = datetime.datetime.now(datetime.timezone.utc).isoformat()
        f.attrs["mpi_library"] = library_version()
        for key, value in attrs.items():
            f.attrs[key] = value
        f.create_dataset("hosts", data=np.array(hosts, dtype=h5py.string_dtype()))
        per_rank = dict(maxshape=(None, world), chunks=(256, world))
        per_step = dict(maxshape=(None,), chunks=(1024,))
        for name in PHASES:
            f.create_dataset(f"phases/{name}", (0, world), dtype="f8", **per_rank)
        for name in BYTES:
            f.create_dataset(f"bytes/{name}", (0, world), dtype="i8", **per_rank)
        f.create_dataset("k", (0, world), dtype="i8", **per_rank)
        f.create_dataset("threshold", (0, world), dtype="f8", **per_rank)
        f.create_dataset("step", (0,), dtype="i8", **per_step)
        f.create_dataset("loss", (0,), dtype="f8", **per_step)
        f.create_dataset("lr", (0,), dtype="f8", **per_step)
        f.create_dataset("density", (0,), dtype="f8", **per_step)
        for name in EVAL:
            f.create_dataset(f"eval/{name}", (0,), dtype="i8" if name == "step" else "f8", maxshape=(None,), chunks=(64,))

    def _rebuild(self, path: str, world: int) -> None:
        old = read_trace(path)
        self.file = h5py.File(path + ".tmp", "w", libver="latest")
        self._create(world, old.attrs, old.hosts)
        self._extend(old.data)
        self.file.close()
        os.replace(path + ".tmp", path)
        self.file = h5py.File(path, "a", libver="latest")

    def _truncate(self, resume_step: int) -> None:
        f = self.file
        keep = int(np.searchsorted(f["step"][:], resume_step))
        keep_eval = int(np.searchsorted(f["eval/step"][:], resume_step, side="right"))
        for name, ds in _datasets(f).items():
            ds.resize(keep_eval if name.startswith("eval/") else keep, axis=0)

    def append(self, steps: np.ndarray, block: np.ndarray) -> None:
        """Add ``block`` ([step, rank, field]) and flush."""
        columns = {f"phases/{p}": block[:, :, COLUMN[p]] for p in PHASES}
        columns.update({f"bytes/{b}": block[:, :, COLUMN["bytes_" + b]] for b in BYTES})
        columns.update(
            k=block[:, :, COLUMN["k"]],
            threshold=block[:, :, COLUMN["threshold"]],
            step=steps,
            loss=block[:, :, COLUMN["loss"]].mean(axis=1),
            lr=block[:, 0, COLUMN["lr"]],
            density=block[:, 0, COLUMN["density"]],
        )
        self._extend(columns)

    def add_eval(self, **values: float) -> None:
        """One evaluation: ``step``, ``epoch``, ``train_loss``, ``test_metric``, ``wall``."""
        self._extend({f"eval/{name}": np.array([values[name]]) for name in EVAL})

    def _extend(self, columns: Dict[str, np.ndarray]) -> None:
        for name, values in columns.items():
            ds = self.file[name]
            n = ds.shape[0]
            ds.resize(n + len(values), axis=0)
            ds[n:] = values
        self.file.flush()

    def close(self) -> None:
        self.file.close()


def _datasets(f: h5py.File) -> Dict[str, h5py.Dataset]:
    """Every growing dataset of a trace, by path."""
    found: Dict[str, h5py.Dataset] = {}

    def visit(name: str, obj: Any) -> None:
        if isinstance(obj, h5py.Dataset) and name != "hosts":
            found[name] = obj

    f.visititems(visit)
    return found


@dataclass
class Trace:
    """A trace read into memory: ``data`` maps dataset paths to arrays."""

    path: str
    attrs: Dict[str, Any]
    data: Dict[str, np.ndarray]
    hosts: list

    @property
    def steps(self) -> int:
        return len(self.data["step"])


def check_trace(f: h5py.File, world: Optional[int] = None) -> None:
    """Raise BadFileError unless ``f`` holds what a reader of a trace uses
    (the root attributes, and every dataset of DESIGN §6 with the dtype and
    shape it should have), written by ``world`` ranks where given."""
    saved = attribute(f, "world_size", int)
    if world is not None and saved != world:
        raise BadFileError(f.filename, f"a trace of {saved} ranks; this run has {world}")
    for name in ("algorithm", "selector"):
        attribute(f, name, str)
    attribute(f, "density", float)
    try:
        if not isinstance(json.loads(attribute(f, "config", str)), dict):
            raise ValueError("not an object")
    except ValueError as error:
        raise BadFileError(f.filename, f"attribute 'config' is not a JSON object ({error})") from None
    dataset(f, "hosts", "OSU", (saved,))
    for name in [f"phases/{p}" for p in PHASES] + ["threshold"]:
        dataset(f, name, "f", (None, saved))
    for name in [f"bytes/{b}" for b in BYTES] + ["k"]:
        dataset(f, name, "iu", (None, saved))
    for name in ("step", "eval/step"):
        dataset(f, name, "iu", (None,))
    for name in ["loss", "lr"] + [f"eval/{e}" for e in EVAL if e != "step"]:
        dataset(f, name, "f", (None,))


def read_trace(path: str) -> Trace:
    """Read a trace, also one that a running job is still writing (SWMR).
    A file that is not a trace raises BadFileError naming it and the problem."""
    with open_hdf5(path, live=True) as f:
        check_trace(f)
        datasets = _datasets(f)
        # Per-step datasets grow one after another: cut all to the shortest.
        rows = min(len(ds) for name, ds in datasets.items() if not name.startswith("eval/"))
        evals = min(len(ds) for name, ds in datasets.items() if name.startswith("eval/"))
        data = {name: ds[: evals if name.startswith("eval/") else rows] for name, ds in datasets.items()}
        hosts = [h.decode() if isinstance(h, bytes) else str(h) for h in f["hosts"][:]]
        return Trace(path, dict(f.attrs), data, hosts)
