"""Each rank's own part of a checkpoint: its residual and its convergence
aids' velocity, written by that rank, in parallel with the others.

A checkpoint at ``PATH`` is ``PATH`` itself (written by rank 0: what every
rank holds alike, and the manifest: every part's span and checksum) and the
folder ``PATH.parts``, which holds a folder per save, named by the save's
token, with a file per rank. A save writes its parts first and ``PATH``
last, renamed over the old one, so until then the old ``PATH`` names the
old parts, which are still there: a save cut short leaves the previous
checkpoint whole, and a part is never taken for complete unless the
manifest names its checksum. The folders of older saves are removed once
``PATH`` names the new one.

No rank gathers another's state: a save costs a rank its own state (the
file is built in memory, so that a full disk is an error, not a crash
inside HDF5) and rank 0 the manifest's few numbers.
"""
from __future__ import annotations

import contextlib
import os
import secrets
import shutil
from dataclasses import dataclass
from typing import Any, List, Optional, Tuple

import numpy as np

from ..files import BadFileError, attribute, create_hdf5, dataset, finite, open_hdf5, seal, stamp, verify, write_image

#: Datasets of a part file.
RESIDUAL, VELOCITY = "residual", "aids/velocity"
#: Datasets of the manifest in the checkpoint file.
MANIFEST = ("parts/spans", "parts/digests", "parts/velocities")
UNSTAMPED = "the file carries no checksum: it was not completely written"


def folder(path: str) -> str:
    """Where the parts of the checkpoint ``path`` live."""
    return path + ".parts"


def new_token(step: int) -> str:
    """A name for one save's parts: its step, and a random tail so that two
    saves at one step never share a folder."""
    return f"step{step:09d}-{secrets.token_hex(4)}"


def part_path(path: str, token: str, rank: int) -> str:
    return os.path.join(folder(path), token, f"rank{rank}.h5")


def write_part(path: str, token: str, rank: int, world: int, step: int, span: Tuple[int, int],
               residual: np.ndarray, velocity: Optional[np.ndarray]) -> str:
    """Write ``rank``'s part of the save ``token``; return its checksum. An
    OSError (a full disk) leaves no file behind."""
    final = part_path(path, token, rank)
    tmp = final + ".tmp"
    os.makedirs(os.path.dirname(final), exist_ok=True)
    try:
        with create_hdf5(tmp, in_memory=True) as f:
            f.attrs.update(rank=rank, world_size=world, step=step, token=token)
            f.create_dataset(RESIDUAL, data=residual).attrs.update(lo=span[0], hi=span[1])
            if velocity is not None:
                f.create_dataset(VELOCITY, data=velocity)
            seal(f)
            write_image(f, tmp)
        digest = stamp(tmp)
        os.replace(tmp, final)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise
    return digest


def remove_save(path: str, token: str) -> None:
    """Remove the parts of the save ``token`` (one that failed)."""
    shutil.rmtree(os.path.join(folder(path), token), ignore_errors=True)


def remove_other_saves(path: str, token: str) -> None:
    """Remove the parts of every save but ``token``'s (older ones, and any a
    crash left unfinished). Best effort: a leftover costs disk, not a resume."""
    with contextlib.suppress(OSError):
        for name in os.listdir(folder(path)):
            if name != token:
                shutil.rmtree(os.path.join(folder(path), name), ignore_errors=True)


@dataclass(frozen=True)
class Parts:
    """A checkpoint's manifest: the saved ranks' spans, and where each rank's
    part is and what it must be. ``token`` None: a checkpoint of format 2,
    which holds every part itself (``residuals/rank<r>``)."""

    path: str
    token: Optional[str]
    spans: Tuple[Tuple[int, int], ...]
    digests: Tuple[str, ...]
    velocities: Tuple[bool, ...]  # whether each part holds a convergence aids' velocity
    size: int  # the model's parameter count

    @property
    def world(self) -> int:
        return len(self.spans)

    def read(self, rank: int) -> Tuple[np.ndarray, Optional[np.ndarray]]:
        """Saved rank ``rank``'s residual and velocity (None if it has none),
        checked against the manifest; a missing, damaged or foreign part
        raises BadFileError naming it."""
        if self.token is None:
            return self._read_within(rank)
        where = part_path(self.path, self.token, rank)
        if not os.path.isfile(where):
            raise BadFileError(where, f"missing: the part of rank {rank} that {self.path} names")
        with open_hdf5(where, unstamped=UNSTAMPED, digest=self.digests[rank]) as f:
            values = verify(f, keep=[RESIDUAL, VELOCITY])
            for name, expected in (("rank", rank), ("world_size", self.world)):
                if attribute(f, name, int) != expected:
                    raise BadFileError(where, f"attribute {name!r} is not {expected}: not this checkpoint's part")
            if attribute(f, "token", str) != self.token:
                raise BadFileError(where, "attribute 'token' is not this save's: not this checkpoint's part")
            lo, hi = self.spans[rank]
            ds = dataset(f, RESIDUAL, "f", (hi - lo,))
            if (attribute(ds, "lo", int), attribute(ds, "hi", int)) != (lo, hi):
                raise BadFileError(where, f"its residual's span is not the manifest's [{lo}, {hi})")
            velocity = None
            if self.velocities[rank]:
                dataset(f, VELOCITY, "f", (self.size,))
                velocity = finite(where, VELOCITY, values[VELOCITY])
            return finite(where, RESIDUAL, values[RESIDUAL]), velocity

    def _read_within(self, rank: int) -> Tuple[np.ndarray, Optional[np.ndarray]]:
        """Format 2: the part inside the checkpoint itself (checked whole when it was read)."""
        names = [f"residuals/rank{rank}", f"aids/velocity/rank{rank}"]
        with open_hdf5(self.path) as f:
            values = verify(f, keep=names)
            velocity = finite(self.path, names[1], values[names[1]]) if self.velocities[rank] else None
            return finite(self.path, names[0], values[names[0]]), velocity


def manifest(f: Any, token: str, spans: List[Tuple[int, int]], digests: List[str], velocities: List[bool]) -> None:
    """Write the manifest into the checkpoint file ``f`` (group ``parts``)."""
    group = f.create_group("parts")
    group.attrs["token"] = token
    group.create_dataset("spans", data=np.asarray(spans, dtype=np.int64).reshape(-1, 2))
    group.create_dataset("digests", data=np.asarray([d.encode() for d in digests], dtype="S64"))
    group.create_dataset("velocities", data=np.asarray(velocities, dtype=np.int8))


def read_manifest(f: Any, path: str, world: int, size: int, values: dict) -> Parts:
    """The manifest of the checkpoint ``f`` (already verified; ``values`` the
    datasets ``verify`` kept), checked for ``world`` ranks and ``size`` parameters."""
    if "parts" not in f:
        raise BadFileError(path, "it names no parts (group 'parts' is missing)")
    token = attribute(f["parts"], "token", str)
    dataset(f, "parts/spans", "iu", (world, 2))
    dataset(f, "parts/digests", "OSU", (world,))
    dataset(f, "parts/velocities", "iu", (world,))
    spans = tuple((int(lo), int(hi)) for lo, hi in values["parts/spans"])
    for rank, (lo, hi) in enumerate(spans):
        if not 0 <= lo <= hi <= size:
            raise BadFileError(path, f"parts/spans: rank {rank}'s [{lo}, {hi}) is not a range of {size}")
    if os.sep in token or token in ("", ".", ".."):
        raise BadFileError(path, f"attribute 'token' {token!r} is not the name of a save")
    digests = tuple(d.decode("ascii", "replace") for d in values["parts/digests"])
    if not np.isin(values["parts/velocities"], (0, 1)).all():
        raise BadFileError(path, "parts/velocities holds other values than 0 and 1")
    velocities = tuple(bool(v) for v in values["parts/velocities"])
    return Parts(path, token, spans, digests, velocities, size)

