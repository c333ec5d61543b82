"""The HDF5 trace of a run (docs/design.md, Trace): per-step, per-rank records gathered
to rank 0 every few steps and appended there, flushed after each append.

The file is in SWMR mode from its creation on, so ``analyze.py --follow`` can
read it while the run goes on, and every flushed step survives a crash.

Checksums (format 2): a trace closed by its writer carries a SHA-256 of the
whole file in its header (``files.stamp``), checked before HDF5 parses any of
it; a trace still being written (or whose writer died) has none yet, and
carries these: what is fixed at creation (the attributes, ``hosts``,
the groups and which datasets there are) carries a SHA-256 digest
(``files.seal``); the growing datasets, which SWMR forbids to carry changing
attributes, carry HDF5's fletcher32 filter per chunk and, in
``checksums/step`` and ``checksums/eval``, a 64-bit BLAKE2b digest of every
row across the columns, appended with the row. Traces of format 1 (none of
these) are still read, unchecked.
"""
from __future__ import annotations

import contextlib
import datetime
import errno
import hashlib
import json
import os
import shutil
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Dict, Iterator, Optional, Sequence

import h5py
import numpy as np

from .. import waiting
from ..files import (DIGEST, BadFileError, attribute, create_hdf5, dataset, finite, fixed_length_text, open_hdf5, seal,
                     stamp, system_error, text_attributes, unstamp, verify)

if TYPE_CHECKING:
    from mpi4py import MPI

PHASES = ("data", "compute", "select", "comm_intra", "comm_inter", "update", "step")
BYTES = ("intra", "inter")
EVAL = ("step", "epoch", "train_loss", "test_metric", "wall")
#: The columns of one rank's record of one step, in the order the ranks send them.
FIELDS = PHASES + ("bytes_intra", "bytes_inter", "k", "threshold", "loss", "lr", "density")
COLUMN = {name: i for i, name in enumerate(FIELDS)}
#: Format 2 added the checksums; a trace without a "format" attribute is of format 1.
FORMAT = 2
#: The growing datasets of one row per step, and of one row per evaluation.
STEP_COLUMNS = ([f"phases/{p}" for p in PHASES] + [f"bytes/{b}" for b in BYTES]
                + ["k", "threshold", "step", "loss", "lr", "density"])
EVAL_COLUMNS = [f"eval/{name}" for name in EVAL]
#: The row checksums of each.
CHECKSUMS = {"checksums/step": STEP_COLUMNS, "checksums/eval": EVAL_COLUMNS}
GROWING = frozenset(STEP_COLUMNS + EVAL_COLUMNS + list(CHECKSUMS))


class StepRecorder:
    """Collects this rank's records and gathers them to rank 0 every ``every`` steps.

    The gather is a buffer-based ``Gather`` of float64 rows (no pickling on
    the hot path). Rank 0 hands each block to the writer, when there is one,
    and keeps per-rank totals for the run's summary, and the first step's
    rows apart: it compiles the kernels on a cold cache and sets up buffers.
    """

    def __init__(self, comm: MPI.Comm, every: int, writer: Optional["TraceWriter"] = None):
        self.comm, self.every, self.writer = comm, every, writer
        self.rows = np.zeros((every, len(FIELDS)))
        self.steps = np.zeros(every, dtype=np.int64)
        self.count = 0
        root = comm.rank == 0
        self.recv = np.zeros(comm.size * every * len(FIELDS)) if root else None
        self.totals = np.zeros((comm.size, len(FIELDS))) if root else None
        self.first: Optional[np.ndarray] = None  # [rank, field] of the first step gathered
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
        waiting.collective(self.comm, "Gather", self.rows[:n], recv, root=0, nbytes=self.rows[:n].nbytes)
        self.count = 0
        if recv is None:
            return
        block = np.ascontiguousarray(recv.transpose(1, 0, 2))  # [step, rank, field]
        if self.first is None:
            self.first = block[0].copy()
        self.totals += block.sum(axis=0)
        self.steps_gathered += n
        if self.writer is not None:
            self.writer.append(self.steps[:n], block)

    def means(self, after_first: bool = False) -> np.ndarray:
        """Rank 0: each field's mean over ranks and steps. ``after_first``: the
        first step left out (unless it is the only one), so that compiling on
        a cold cache is no phase's time."""
        if after_first and self.steps_gathered > 1:
            return (self.totals - self.first).mean(axis=0) / (self.steps_gathered - 1)
        return self.totals.mean(axis=0) / max(self.steps_gathered, 1)


class TraceWriter:
    """Rank 0's trace file. A resumed run appends to the trace of the run it
    continues, dropping rows past the checkpoint's step.

    A write that fails (a full disk) is not raised here, on rank 0 alone,
    where the others would wait for it in a collective: it is kept in
    ``failure``, nothing more is written, and the loop raises it on every rank.
    A disk with less than ``SPARE_BYTES`` free counts as full before HDF5
    tries: HDF5 reports a failed write late and noisily, and may leave the
    process to crash at exit."""

    failure: Optional[str] = None
    SPARE_BYTES = 1 << 20

    def __init__(self, path: str, attrs: Dict[str, Any], hosts: list, resume_step: Optional[int] = None):
        world = len(hosts)
        self.path = path
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        if resume_step is not None and os.path.exists(path):
            with open_hdf5(path, live=True) as existing:  # refuse a bad trace before touching it
                current = check_trace(existing, world) == FORMAT
            read_trace(path)  # and every checksum in it
            try:
                if not current:
                    raise OSError("an older format")
                unstamp(path)  # changed from here on: whole again at close()
                self.file = h5py.File(path, "a", libver="latest")
            except OSError:  # its writer died (the file stays marked open), or of an older format: rewrite it
                self._rebuild(path, world)
            self._truncate(resume_step)
        else:
            self.file = create_hdf5(path)
            self._create(world, attrs, hosts)
        self.file.swmr_mode = True

    def _create(self, world: int, attrs: Dict[str, Any], hosts: list) -> None:
        from ..mpi_strings import library_version  # MPI's: a reader of traces loads none

        f = self.file
        f.attrs["created"] = datetime.datetime.now(datetime.timezone.utc).isoformat()
        f.attrs["mpi_library"] = library_version()
        for key, value in attrs.items():
            f.attrs[key] = value
        f.attrs["format"] = FORMAT
        fixed_length_text(f)  # nothing of a trace in HDF5's global heap
        f.create_dataset("hosts", data=np.array([host.encode("utf-8") for host in hosts]))
        per_rank = dict(maxshape=(None, world), chunks=(256, world), fletcher32=True)
        per_step = dict(maxshape=(None,), chunks=(1024,), fletcher32=True)
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
        per_eval = dict(maxshape=(None,), chunks=(64,), fletcher32=True)
        for name in EVAL:
            f.create_dataset(f"eval/{name}", (0,), dtype="i8" if name == "step" else "f8", **per_eval)
        f.create_dataset("checksums/step", (0,), dtype="u8", **per_step)
        f.create_dataset("checksums/eval", (0,), dtype="u8", **per_eval)
        seal(f, growing=GROWING.__contains__)

    def _rebuild(self, path: str, world: int) -> None:
        old = read_trace(path)
        self.file = create_hdf5(path + ".tmp")
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
            ds.resize(keep_eval if _per_eval(name) else keep, axis=0)

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
        """Append rows (of every step column, or every eval column, or both)
        and their checksums, computed here from the values as stored."""
        if self.failure is None:
            with self._kept_failure():
                self._append(columns)

    @contextlib.contextmanager
    def _kept_failure(self) -> Iterator[None]:
        """A failed write kept in ``failure`` (h5py raises some as RuntimeError)."""
        try:
            yield
        except (OSError, RuntimeError) as error:
            self.failure = f"cannot write the trace {self.path}: {system_error(error)}"
            with contextlib.suppress(OSError, RuntimeError):  # HDF5 writes no more to it
                self.file.close()

    def _append(self, columns: Dict[str, np.ndarray]) -> None:
        free = shutil.disk_usage(os.path.dirname(os.path.abspath(self.path))).free
        if free < self.SPARE_BYTES:
            raise OSError(errno.ENOSPC, f"{os.strerror(errno.ENOSPC)} ({free} bytes free, "
                                        f"{self.SPARE_BYTES} kept spare)")
        stored = {name: np.asarray(values).astype(self.file[name].dtype)
                  for name, values in columns.items() if name not in CHECKSUMS}
        for name, names in CHECKSUMS.items():  # last: a live reader takes no row before its checksum
            if names[0] in stored:
                stored[name] = row_checksums(stored, names)
        for name, values in stored.items():
            ds = self.file[name]
            n = ds.shape[0]
            ds.resize(n + len(values), axis=0)
            ds[n:] = values
        self.file.flush()

    def close(self) -> None:
        """Close and stamp the file; a failure is kept in ``failure``."""
        with self._kept_failure():
            self.file.close()
            if self.failure is None:
                stamp(self.path)


def row_checksums(columns: Dict[str, np.ndarray], names: Sequence[str]) -> np.ndarray:
    """The 64-bit BLAKE2b digest of each row of the ``names`` columns (every
    one of ``len`` rows), over their little-endian bytes."""
    rows = len(columns[names[0]])
    if not rows:
        return np.zeros(0, np.uint64)
    parts = [np.ascontiguousarray(columns[name], dtype=columns[name].dtype.newbyteorder("<")).reshape(rows, -1)
             .view(np.uint8) for name in names]
    table = np.concatenate(parts, axis=1)
    return np.array([int.from_bytes(hashlib.blake2b(row.tobytes(), digest_size=8).digest(), "little")
                     for row in table], dtype=np.uint64)


def _per_eval(name: str) -> bool:
    return name.startswith("eval/") or name == "checksums/eval"


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


def check_trace(f: h5py.File, world: Optional[int] = None) -> int:
    """Raise BadFileError unless ``f`` holds what a reader of a trace uses
    (the root attributes, and every dataset of the trace schema with the dtype and
    shape it should have), written by ``world`` ranks where given. Return
    its format: 2 when it carries checksums (checked by ``read_trace``)."""
    version = attribute(f, "format", int) if "format" in f.attrs or DIGEST in f.attrs else 1  # 1 had no attribute
    if version != FORMAT and "format" in f.attrs:
        raise BadFileError(f.filename, f"trace format {version}; this version of spar_comm reads formats 1 and {FORMAT}")
    saved = attribute(f, "world_size", int)
    if saved < 1:
        raise BadFileError(f.filename, f"attribute 'world_size' is {saved}")
    if world is not None and saved != world:
        raise BadFileError(f.filename, f"a trace of {saved} ranks; this run has {world}: a run resumed on another "
                                       "number of ranks writes a new trace (--trace NEW.h5), the old one stays as it is")
    for name in ("algorithm", "selector"):
        attribute(f, name, str)
    attribute(f, "density", float)
    for name, kind in (("topology", str), ("test_metric_name", str), ("parameters", int)):
        if name in f.attrs:  # optional, used by the summary where present
            attribute(f, name, kind)
    try:
        config = json.loads(attribute(f, "config", str))
        if not isinstance(config, dict):
            raise ValueError("not an object")
    except ValueError as error:
        raise BadFileError(f.filename, f"attribute 'config' is not a JSON object ({error})") from None
    batch = config.get("batch_size")
    if type(batch) is not int or batch < 1:
        raise BadFileError(f.filename, f"attribute 'config' has batch_size {batch!r}, not a positive integer")
    dataset(f, "hosts", "OSU", (saved,))
    for name in [f"phases/{p}" for p in PHASES] + ["threshold"]:
        dataset(f, name, "f", (None, saved))
    for name in [f"bytes/{b}" for b in BYTES] + ["k"]:
        dataset(f, name, "iu", (None, saved))
    for name in ("step", "eval/step"):
        dataset(f, name, "iu", (None,))
    for name in ["loss", "lr"] + [f"eval/{e}" for e in EVAL if e != "step"]:
        dataset(f, name, "f", (None,))
    if version == FORMAT:
        dataset(f, "density", "f", (None,))
        for name in CHECKSUMS:
            dataset(f, name, "iu", (None,))
    return version


def read_trace(path: str) -> Trace:
    """Read a trace, also one that a running job is still writing (SWMR).
    A file that is not a trace, or whose checksums do not match, raises
    BadFileError naming it and the problem."""
    with open_hdf5(path, live=True) as f:
        version = check_trace(f)
        if version == FORMAT:
            verify(f, growing=GROWING.__contains__)
        datasets = _datasets(f)
        # Per-step datasets grow one after another: cut all to the shortest, or
        # (format 2) to the rows with a checksum, which is written last.
        rows = min(len(ds) for name, ds in datasets.items() if not _per_eval(name))
        evals = min(len(ds) for name, ds in datasets.items() if _per_eval(name))
        if version == FORMAT:
            short = [(name, len(datasets[name]), len(datasets[total])) for total, names in CHECKSUMS.items()
                     for name in names if len(datasets[name]) < len(datasets[total])]
            if short:
                raise BadFileError(path, "dataset {!r} has {} rows, fewer than the {} its checksums cover".format(*short[0]))
        data = {name: ds[: evals if _per_eval(name) else rows] for name, ds in datasets.items()}
        if version == FORMAT:
            for name, names in CHECKSUMS.items():
                bad = np.flatnonzero(row_checksums(data, names) != data[name])
                if bad.size:
                    raise BadFileError(path, f"row {bad[0]} of the {name.split('/')[1]} datasets does not match "
                                             "its checksum: the file is damaged or was edited")
        for name in [f"phases/{p}" for p in PHASES] + ["lr"]:
            finite(path, name, data[name])
        hosts = [h.decode("utf-8", "replace") if isinstance(h, bytes) else str(h) for h in f["hosts"][:]]
        return Trace(path, text_attributes(f), data, hosts)
