"""Files that come from outside the running program: checkpoints, traces,
calibrations and benchmark JSON.

Every such file is untrusted input. It may come from another tool, be cut
short by a full disk or a killed job, be from another version, or be edited
by hand. Readers open it here and check it against what they expect before
using any of it, so that a bad file gives one ``BadFileError`` naming the
file and the problem, not a traceback from inside h5py or a KeyError. In an
MPI program ``agree`` turns one rank's refusal into the same error on every
rank, so that no rank is left waiting in a collective.
"""
from __future__ import annotations

import contextlib
import errno
import json
import math
import os
from typing import Any, Callable, Iterator, Optional, Sequence, TypeVar

import h5py
import numpy as np

from .errors import SparCommError

T = TypeVar("T")

#: dtype kinds of HDF5 datasets, as ``numpy.dtype.kind`` letters, in words.
KINDS = {"f": "floating point", "iu": "integer", "OSU": "text"}


class BadFileError(SparCommError, ValueError):
    """A file was refused: ``path`` names it, ``problem`` says what is wrong."""

    def __init__(self, path: Any, problem: str):
        self.path, self.problem = os.fspath(path), problem
        super().__init__(f"{self.path}: {problem}")

    def __reduce__(self):  # pickled by agree(); the default would pass one argument
        return type(self), (self.path, self.problem)


# -- JSON -------------------------------------------------------------------------------
def read_json(path: Any) -> Any:
    """The document in ``path``: refused when it is missing, unreadable or not JSON."""
    try:
        with open(path, "rb") as stream:
            raw = stream.read()
    except OSError as error:
        raise BadFileError(path, f"cannot read it ({error.strerror or error})") from None
    try:
        return json.loads(raw)
    except UnicodeDecodeError:
        raise BadFileError(path, "not JSON (not text)") from None
    except json.JSONDecodeError as error:
        raise BadFileError(path, f"not JSON, or cut short ({error.msg} at line {error.lineno})") from None


class Nullable:
    """A schema that also takes null (JSON's None)."""

    def __init__(self, schema: Any):
        self.schema = schema


def check(value: Any, schema: Any, path: Any, where: str = "") -> Any:
    """``value`` if it matches ``schema``, else BadFileError naming the key.

    A schema is a type (``float`` takes any finite number, ``int`` a whole
    number; neither takes a bool), a dict of required keys and their schemas
    (``{str: s}``: any key, each value matching ``s``), a one-item list
    (a list of items matching it) or a tuple (a list of that many items).
    Keys beyond those named are allowed: newer writers may add some.
    ``Nullable(s)`` takes null or what ``s`` takes.
    """
    here = where or "the document"
    if isinstance(schema, Nullable):
        return value if value is None else check(value, schema.schema, path, where)
    if isinstance(schema, dict):
        if not isinstance(value, dict):
            raise BadFileError(path, f"{here} should be an object, is {_json_type(value)}")
        if list(schema) == [str]:
            return {key: check(item, schema[str], path, f"{where}.{key}".lstrip(".")) for key, item in value.items()}
        for key, inner in schema.items():
            if key not in value:
                raise BadFileError(path, f"missing key {f'{where}.{key}'.lstrip('.')!r}")
            check(value[key], inner, path, f"{where}.{key}".lstrip("."))
        return value
    if isinstance(schema, (list, tuple)):
        if not isinstance(value, list):
            raise BadFileError(path, f"{here} should be a list, is {_json_type(value)}")
        if isinstance(schema, tuple) and len(value) != len(schema):
            raise BadFileError(path, f"{here} should have {len(schema)} items, has {len(value)}")
        for i, item in enumerate(value):
            check(item, schema[0] if isinstance(schema, list) else schema[i], path, f"{where}[{i}]")
        return value
    if schema is float:  # an integer too large for a float is not finite either
        fits = isinstance(value, (int, float)) and not isinstance(value, bool) and abs(value) <= 1.7e308 and math.isfinite(value)
    elif schema is int:
        fits = isinstance(value, int) and not isinstance(value, bool)
    else:
        fits = isinstance(value, schema)
    if not fits:
        wanted = {float: "a finite number", int: "an integer", str: "a string", bool: "true or false"}.get(schema, schema)
        raise BadFileError(path, f"{here} should be {wanted}, is {value!r:.60}")
    return value


def _json_type(value: Any) -> str:
    return {dict: "an object", list: "a list", str: "a string", bool: "a boolean"}.get(type(value), "a number" if isinstance(value, (int, float)) else "null")


# -- HDF5 -------------------------------------------------------------------------------
@contextlib.contextmanager
def open_hdf5(path: Any, live: bool = False) -> Iterator[h5py.File]:
    """``path`` opened read-only; refused when it is missing, not HDF5, cut
    short or damaged (also when a read inside the block fails on that).

    ``live``: the file may be one a running job is still writing (SWMR). It
    is still opened plainly first where it can be: an SWMR reader skips
    HDF5's check of the file's length and retries a cut-short file's
    metadata reads for minutes.
    """
    try:
        f = h5py.File(path, "r", libver="latest")
    except OSError as error:
        if not os.path.isfile(path):
            raise BadFileError(path, f"cannot read it ({os.strerror(errno.EISDIR if os.path.isdir(path) else errno.ENOENT)})") from None
        if not h5py.is_hdf5(path):
            raise BadFileError(path, "not an HDF5 file") from None
        if not live or "truncated" in str(error):
            raise BadFileError(path, f"a damaged or cut-short HDF5 file ({error})") from None
        try:  # open for writing by a running (or crashed) job
            f = h5py.File(path, "r", libver="latest", swmr=True)
        except OSError as error:
            raise BadFileError(path, f"a damaged or cut-short HDF5 file ({error})") from None
    with f:
        try:
            yield f
        except OSError as error:  # h5py's read errors: the file's contents, not the caller's
            raise BadFileError(path, f"a damaged or cut-short HDF5 file ({error})") from None


def dataset(f: h5py.File, name: str, kind: str, shape: Sequence[Optional[int]]) -> h5py.Dataset:
    """``f[name]``: a dataset of dtype kind ``kind`` (a key of KINDS) and
    ``shape`` (None where any length goes), else BadFileError."""
    found = f.get(name)
    if not isinstance(found, h5py.Dataset):
        raise BadFileError(f.filename, f"missing dataset {name!r}" if found is None else f"{name!r} is not a dataset")
    if found.dtype.kind not in kind:
        raise BadFileError(f.filename, f"dataset {name!r} is {found.dtype}, expected {KINDS[kind]}")
    if len(found.shape) != len(shape) or any(want not in (None, have) for want, have in zip(shape, found.shape)):
        expected = "(" + ", ".join("any" if s is None else str(s) for s in shape) + ")"
        raise BadFileError(f.filename, f"dataset {name!r} has shape {found.shape}, expected {expected}")
    return found


def attribute(obj: h5py.HLObject, name: str, kind: type) -> Any:
    """``obj.attrs[name]`` as a Python ``kind`` (int, float or str), else BadFileError."""
    where = f"attribute {name!r}" + (f" of {obj.name!r}" if obj.name != "/" else "")
    if name not in obj.attrs:
        raise BadFileError(obj.file.filename, f"missing {where}")
    value = obj.attrs[name]
    if isinstance(value, bytes):
        value = value.decode("utf-8", "replace")
    if not _is_scalar(value, kind):
        wanted = "text" if kind is str else f"a finite {kind.__name__}"
        raise BadFileError(obj.file.filename, f"{where} should be {wanted}, is {value!r:.60}")
    return kind(value)


def _is_scalar(value: Any, kind: type) -> bool:
    if kind is str or isinstance(value, (str, bool, np.bool_)):
        return kind is str and isinstance(value, str)
    if not isinstance(value, (int, float, np.integer, np.floating)):
        return False
    return math.isfinite(value) and (kind is not int or float(value).is_integer())


# -- MPI --------------------------------------------------------------------------------
def agree(comm: Any, read: Callable[[], T]) -> T:
    """``read()`` on every rank of ``comm``; if it refused a file on any rank,
    the first such rank's BadFileError is raised on every rank. Collective."""
    refused, result = None, None
    try:
        result = read()
    except BadFileError as error:
        refused = error
    verdicts = comm.allgather(refused)
    first = next((error for error in verdicts if error is not None), None)
    if first is not None:
        raise first
    return result
