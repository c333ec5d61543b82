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
import hashlib
import json
import math
import os
import re
from typing import Any, Callable, Iterator, List, Optional, Sequence, Tuple, TypeVar

import h5py
import numpy as np

from .errors import SparCommError

T = TypeVar("T")

#: dtype kinds of HDF5 datasets, as ``numpy.dtype.kind`` letters, in words.
KINDS = {"f": "floating point", "iu": "integer", "OSU": "text"}
#: The key (JSON) or attribute (HDF5) that holds a SHA-256 digest of what it sits beside.
DIGEST = "sha256"
#: What h5py raises on a damaged file besides OSError: a bad checksum or heap
#: surfaces as KeyError or RuntimeError, a bad datatype as TypeError or ValueError.
HDF5_ERRORS = (OSError, KeyError, RuntimeError, TypeError, ValueError)


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
        document = json.loads(raw)
    except UnicodeDecodeError:
        raise BadFileError(path, "not JSON (not text)") from None
    except json.JSONDecodeError as error:
        raise BadFileError(path, f"not JSON, or cut short ({error.msg} at line {error.lineno})") from None
    except RecursionError:
        raise BadFileError(path, "not JSON this package writes (nested too deeply)") from None
    except ValueError as error:  # an integer of more digits than Python converts
        raise BadFileError(path, f"not JSON this package writes ({error})") from None
    if isinstance(document, dict) and DIGEST in document:
        document = dict(document)
        saved = document.pop(DIGEST)
        if saved != _json_digest(document):
            raise BadFileError(path, f"the contents do not match their checksum ({DIGEST!r}): damaged or edited "
                                     f"(a file edited by hand is read once its {DIGEST!r} key is removed)")
    return document


def write_json(path: Any, document: Any) -> None:
    """Write ``document`` (a dict) with a checksum of its contents, which
    ``read_json`` verifies: a damaged file is refused, not read as other
    figures. ``path`` is replaced atomically: no reader sees half a file."""
    plain = json.loads(json.dumps(document))  # what a reader will see: str keys, lists
    temporary = os.fspath(path) + ".tmp"
    with open(temporary, "w") as stream:
        json.dump({**plain, DIGEST: _json_digest(plain)}, stream, indent=1)
        stream.write("\n")
    os.replace(temporary, path)


def unwritable(path: Any, flag: str = "--out") -> Optional[str]:
    """Why ``path`` could not be written (its folder is missing or read-only),
    or None: checked before any work, so a long run does not end unwritten."""
    folder = os.path.dirname(os.path.abspath(os.fspath(path)))
    if not os.path.isdir(folder) or not os.access(folder, os.W_OK):
        return f"cannot write {flag} {os.fspath(path)}: {folder} is not a writable folder"
    return None


def _json_digest(document: Any) -> str:
    canonical = json.dumps(document, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()


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
#: Bytes before the HDF5 data (HDF5's user block) that hold the whole-file checksum.
HEADER = 512
#: Attributes an object holds in its header before HDF5 moves them to a heap.
COMPACT_ATTRIBUTES = 1000
#: How the header starts; the SHA-256 of every byte after the header follows, in hex.
MAGIC = b"spar_comm sha256 "


def create_hdf5(path: Any, in_memory: bool = False) -> h5py.File:
    """A new HDF5 file to ``stamp`` when done: the latest format (checksummed
    metadata), HEADER bytes before the HDF5 data, and the root's attributes
    kept in its object header however many: HDF5 can loop forever reading a
    damaged heap of attributes (their dense storage, past 8). ``in_memory``:
    nothing is written to ``path`` until ``write_image``."""
    fcpl = h5py.h5p.create(h5py.h5p.FILE_CREATE)
    fcpl.set_userblock(HEADER)
    fcpl.set_attr_phase_change(COMPACT_ATTRIBUTES, COMPACT_ATTRIBUTES)
    fapl = h5py.h5p.create(h5py.h5p.FILE_ACCESS)
    fapl.set_libver_bounds(h5py.h5f.LIBVER_LATEST, h5py.h5f.LIBVER_LATEST)
    if in_memory:
        fapl.set_fapl_core(backing_store=False)
    return h5py.File(h5py.h5f.create(os.fsencode(path), h5py.h5f.ACC_TRUNC, fapl=fapl, fcpl=fcpl))


def system_error(error: BaseException) -> str:
    """What a failed write says: the system's error where HDF5 buries it in a
    long text (``errno = 28``), else the error as it is."""
    found = re.search(r"errno = (\d+)", str(error))
    return f"[Errno {found[1]}] {os.strerror(int(found[1]))}" if found else str(error)


def write_image(f: h5py.File, path: Any) -> None:
    """Write ``f``, made by ``create_hdf5(in_memory=True)``, to ``path`` with
    plain file I/O and sync it: a full disk is then an OSError here, never a
    failed write inside HDF5, which reports it at close, noisily, and can leave
    the library in a state that crashes the process at exit."""
    f.flush()
    image = f.id.get_file_image()
    with open(path, "wb") as out:
        if image[:4] == b"\x89HDF":  # the image leaves out the user block: its place comes first
            out.write(bytes(HEADER))
        out.write(image)
        out.flush()
        os.fsync(out.fileno())


def stamp(path: Any) -> str:
    """Write the whole-file checksum into the header of ``path``, a closed
    HDF5 file created with ``userblock_size=HEADER``, and return it (a
    manifest names the file by it). Call it last."""
    digest = _file_digest(path)
    with open(path, "r+b") as stream:
        stream.write((MAGIC + digest.encode() + b"\n").ljust(HEADER, b"\0"))
    return digest


def unstamp(path: Any) -> None:
    """Clear the header of ``path`` before the file is changed in place; the
    file then reads as one still being written, until ``stamp``."""
    with open(path, "r+b") as stream:
        stream.write(bytes(HEADER))


def check_stamp(path: Any, unstamped: Optional[str] = None, digest: Optional[str] = None) -> None:
    """Verify the whole-file checksum before HDF5 parses a byte of the file
    (HDF5 can crash or loop on a damaged file). A file without one (still
    being written, or of an older format) is read unchecked, or refused with
    the problem ``unstamped`` where that is given. ``digest``: the checksum
    a manifest names the file by; a whole file of another is refused."""
    try:
        with open(path, "rb") as stream:
            header = stream.read(HEADER)
    except OSError:
        return  # open_hdf5 says why
    if header.startswith(MAGIC):
        saved = header[len(MAGIC):].split(b"\n")[0].decode("ascii", "replace")
        if saved != _file_digest(path):
            raise BadFileError(path, "the file does not match its checksum: it is damaged, cut short or was edited")
        if digest is not None and saved != digest:
            raise BadFileError(path, "not the file its checkpoint names (its checksum differs): a part of another "
                                     "save, or a file put in its place")
        return
    if header == bytes(HEADER):
        if unstamped:
            raise BadFileError(path, "the file carries no checksum: it was not completely written")
        return
    if not h5py.is_hdf5(path):
        raise BadFileError(path, "not an HDF5 file")
    if not header.startswith(b"\x89HDF\r\n\x1a\n"):
        raise BadFileError(path, "the header that holds the file's checksum is damaged")
    if unstamped:  # written before files carried checksums, or by another program
        raise BadFileError(path, unstamped)


def _file_digest(path: Any) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as stream:
        stream.seek(HEADER)
        for block in iter(lambda: stream.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


@contextlib.contextmanager
def open_hdf5(path: Any, live: bool = False, unstamped: Optional[str] = None,
              digest: Optional[str] = None) -> Iterator[h5py.File]:
    """``path`` opened read-only; refused when it is missing, not HDF5, cut
    short or damaged (also when a read inside the block fails on that: any
    error h5py raises there is taken for damage).

    The whole-file checksum (``stamp``) is verified first where the file
    carries one; ``unstamped``: the problem to refuse a file without one with.

    ``digest``: the checksum a manifest names the file by (``check_stamp``).

    ``live``: the file may be one a running job is still writing (SWMR). It
    is still opened plainly first where it can be, and as SWMR only when
    HDF5 says it is open for writing: an SWMR reader skips HDF5's check of
    the file's length and retries a damaged file's metadata reads for minutes.
    """
    check_stamp(path, unstamped, digest)
    try:
        f = h5py.File(path, "r", libver="latest")
    except HDF5_ERRORS as error:
        if not os.path.isfile(path):
            raise BadFileError(path, f"cannot read it ({os.strerror(errno.EISDIR if os.path.isdir(path) else errno.ENOENT)})") from None
        if not h5py.is_hdf5(path):
            raise BadFileError(path, "not an HDF5 file") from None
        if not live or "already open for write" not in str(error):
            raise BadFileError(path, f"a damaged or cut-short HDF5 file ({error})") from None
        try:  # open for writing by a running (or crashed) job
            f = h5py.File(path, "r", libver="latest", swmr=True)
        except HDF5_ERRORS as error:
            raise BadFileError(path, f"a damaged or cut-short HDF5 file ({error})") from None
    try:
        with f:
            yield f
    except HDF5_ERRORS as error:
        if not isinstance(error, OSError) and not _raised_by_h5py(error):
            raise  # the caller's own error, not the file's
        raise BadFileError(path, f"a damaged or cut-short HDF5 file ({type(error).__name__}: {error})") from None


def _raised_by_h5py(error: BaseException) -> bool:
    """Whether ``error`` came from inside h5py (reading the file), not from its caller."""
    tb = error.__traceback__
    while tb is not None:
        if "h5py" in tb.tb_frame.f_code.co_filename.replace("\\", "/").split("/"):
            return True
        tb = tb.tb_next
    return False


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


def seal(f: h5py.File, growing: Callable[[str], bool] = lambda name: False) -> None:
    """Store beside the root, every group and every dataset but the ``growing``
    ones an attribute DIGEST: SHA-256 of its attributes, its members' names
    (a group) or its dtype, shape and values (a dataset). Call it last."""
    for name, obj in _objects(f):
        if not growing(name):
            obj.attrs[DIGEST] = np.bytes_(_hdf5_digest(obj).encode())  # fixed length: see fixed_length_text


def verify(f: h5py.File, keep: Sequence[str] = (), growing: Callable[[str], bool] = lambda name: False) -> dict:
    """Check what ``seal`` stored, reading every sealed dataset once; return
    the values of the datasets named in ``keep`` (by path). A difference,
    a missing digest or an unreadable object raises BadFileError."""
    kept = {}
    for name, obj in _objects(f):
        if growing(name):
            continue
        what = "the root" if name == "/" else f"{'dataset' if isinstance(obj, h5py.Dataset) else 'group'} {name!r}"
        saved = obj.attrs.get(DIGEST)
        if saved is None:
            raise BadFileError(f.filename, f"{what} carries no checksum (attribute {DIGEST!r})")
        values = obj[()] if isinstance(obj, h5py.Dataset) else None
        if not isinstance(saved, bytes) or saved.decode("ascii", "replace") != _hdf5_digest(obj, values):
            raise BadFileError(f.filename, f"{what} does not match its checksum: the file is damaged or was edited")
        if name in keep:
            kept[name] = values
    return kept


def fixed_length_text(obj: Any) -> None:
    """Store every text attribute of ``obj`` as fixed-length UTF-8 (read back
    as bytes), in the object's header. Variable-length text lives in HDF5's
    global heap, which carries no checksum, and HDF5 can loop forever reading
    a damaged one."""
    for key, value in list(obj.attrs.items()):
        if isinstance(value, str):
            obj.attrs[key] = np.bytes_(value.encode("utf-8"))


def text_attributes(obj: Any) -> dict:
    """``obj``'s attributes, fixed-length text decoded to str."""
    return {key: value.decode("utf-8", "replace") if isinstance(value, bytes) else value
            for key, value in obj.attrs.items()}


def _objects(f: h5py.File) -> List[Tuple[str, Any]]:
    """The root, then every group and dataset, by path (links to one object twice count twice)."""
    found: List[Tuple[str, Any]] = [("/", f)]
    f.visititems(lambda name, obj: found.append((name, obj)) if isinstance(obj, (h5py.Group, h5py.Dataset)) else None)
    return found


def _hdf5_digest(obj: Any, values: Any = None) -> str:
    digest = hashlib.sha256()
    for name in sorted(key for key in obj.attrs if key != DIGEST):
        _feed(digest, name.encode(), _canonical(obj.attrs[name]))
    if isinstance(obj, h5py.Dataset):
        values = obj[()] if values is None else values
        _feed(digest, obj.dtype.str.encode(), repr(obj.shape).encode(), _canonical(values))
    else:
        _feed(digest, *(key.encode() for key in obj))  # a deleted or renamed member changes it
    return digest.hexdigest()


def _feed(digest: Any, *parts: bytes) -> None:
    for part in parts:  # each part length-prefixed: no two sequences of parts feed the same bytes
        digest.update(len(part).to_bytes(8, "little"))
        digest.update(part)


def _canonical(value: Any) -> bytes:
    """The bytes of an attribute's or dataset's value, its type included."""
    if isinstance(value, str):
        return b"s" + value.encode("utf-8", "surrogatepass")
    if isinstance(value, bytes):
        return b"b" + value
    if isinstance(value, h5py.Empty):
        return b"e" + str(value.dtype).encode()
    array = np.asarray(value)
    if array.dtype.kind == "O":  # variable-length strings: the items, not their pointers
        return b"o" + repr(array.shape).encode() + b"".join(_canonical(item) for item in array.reshape(-1))
    return b"a" + array.dtype.str.encode() + repr(array.shape).encode() + np.ascontiguousarray(array).tobytes()


def finite(path: Any, name: str, values: np.ndarray) -> np.ndarray:
    """``values`` if all are finite, else BadFileError: for values that cannot be NaN or Inf."""
    bad = np.size(values) - int(np.count_nonzero(np.isfinite(values)))
    if bad:
        raise BadFileError(path, f"dataset {name!r} holds {bad} NaN or infinite values")
    return values


# -- MPI --------------------------------------------------------------------------------
def agree(comm: Any, read: Callable[[], T]) -> T:
    """``read()`` on every rank of ``comm``; if it refused a file on any rank,
    the first such rank's BadFileError is raised on every rank. Any other
    error on a rank is raised there, and the others raise SparCommError
    naming that rank, so no rank is left waiting. Collective."""
    refused, result = None, None
    try:
        result = read()
    except BadFileError as error:
        refused = error
    except Exception as error:  # a defect, not a bad file: still no rank may wait
        refused = error
    verdicts = comm.allgather(None if refused is None else
                              refused if isinstance(refused, BadFileError) else f"{type(refused).__name__}: {refused}")
    first = next((rank for rank, verdict in enumerate(verdicts) if verdict is not None), None)
    if first is None:
        return result
    if isinstance(verdicts[first], BadFileError):
        raise verdicts[first]
    if refused is not None and not isinstance(refused, BadFileError):
        raise refused
    raise SparCommError(f"rank {first} failed reading a file: {verdicts[first]}")
