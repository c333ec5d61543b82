"""A seeded mutation fuzzer over the files spar_comm reads: checkpoints,
traces, calibrations and benchmark JSON (bench_comm, bench_topk, and
bench_cluster's sweeps).

Each case copies a good file the package wrote, applies one mutation and
reads the copy back as the package does. A mutation is a small JSON object
made from the case's seed and the good file's structure (names, not byte
offsets, wherever it edits HDF5 or JSON structure), so a case can be kept
and replayed (``fuzz_corpus.json``). The outcome of a case is

    refused   BadFileError naming the file
    same      accepted, and what was read means what the good file means
    prefix    (trace_live only) accepted as the good file's first rows: a
              live reader cannot tell rows not yet written from rows lost
    changed   (<kind>_plain only) accepted, and differs: JSON without its
              checksum, as edited by hand, is taken as it reads
    crash     any other exception, a reader that died or hung    (a defect)
    corrupt   accepted, but what was read differs from the good file's (a defect)

Cases run in a worker process, so that a crash inside HDF5 or a hang is one
case's outcome, not the end of the run.

    python tests/fuzz_files.py --cases 5000            # prints the figures
    python tests/fuzz_files.py --corpus tests/fuzz_corpus.json
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import io
import json
import math
import os
import random
import select
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import h5py
import numpy as np

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path[:0] = [str(HERE)]

#: trace_live: a trace as its writer leaves it while running or after a crash,
#: without the whole-file checksum, so that HDF5 parses the damage.
#: <kind>_plain: the JSON as written by hand, without the checksum; a change
#: that stays valid cannot be told from an edit there, so only crashes count.
JSON_KINDS = ("calibration", "bench_comm", "bench_topk", "sweep")
#: checkpoint_part: rank 1's own part of the checkpoint (its file under ck.h5.parts).
KINDS = ("checkpoint", "checkpoint_part", "trace", "trace_live") + JSON_KINDS + tuple(f"{kind}_plain" for kind in JSON_KINDS)
FILES = {"checkpoint": "ck.h5", "checkpoint_part": "rank1.h5", "trace": "trace.h5", "trace_live": "live.h5",
         **{kind: f"{kind}.json" for kind in KINDS[4:]}}
HDF5 = ("checkpoint", "checkpoint_part", "trace", "trace_live")
CHECKPOINTS = ("checkpoint", "checkpoint_part")
#: Settings of the run that writes the good checkpoint and trace: small and quick.
TRAIN = ["--selector", "exact", "--no-progress", "--trace-every", "5", "--hidden", "32", "--steps", "20",
         "--stop-after", "10"]
CASE_LIMIT = 60  # seconds one case may take before it counts as a hang
DEFECTS = ("crash", "corrupt")


# -- the good files ------------------------------------------------------------------------
def make_good_files(folder: Path) -> None:
    """Write one good file of every kind into ``folder``, each by the package's own writer."""
    from spar_comm.costmodel import CPU
    from spar_comm.costmodel.calibrate import save
    from spar_comm.files import DIGEST, unstamp, write_json
    from test_bench_cluster import modelled_sweep

    mpiexec = shutil.which("mpiexec", path=os.path.dirname(sys.executable)) or "mpiexec"
    command = [mpiexec, "-n", "2", sys.executable, str(ROOT / "drivers/train.py"), *TRAIN,
               "--checkpoint", str(folder / FILES["checkpoint"]), "--trace", str(folder / FILES["trace"])]
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
    if result.returncode != 0:
        raise RuntimeError(f"the run that writes the good checkpoint failed:\n{result.stderr}")
    shutil.copyfile(folder / FILES["trace"], folder / FILES["trace_live"])
    unstamp(folder / FILES["trace_live"])
    save(str(folder / FILES["calibration"]), CPU, ["bench_comm.json"], [])
    meta = {"tool": "bench_comm", "num_nodes": 2, "ranks_per_node": 2, "node_sizes": [2, 2], "dtype": "float32",
            "density": 0.001, "selector": "mstopk"}
    results = [{"algorithm": a, "size": n, "time_median": 1e-3 * n / 65536 * (1 + i / 10), "t_select": 1e-4 * (1 + i)}
               for i, a in enumerate(("dense", "topka", "hitopk")) for n in (65536, 262144)]
    write_json(folder / FILES["bench_comm"], {"meta": meta, "results": results})
    records = [{"method": m, "n": n, "median_s": 1e-4 + 2e-9 * n * (1 + i)}
               for i, m in enumerate(("mstopk", "exact")) for n in (2**16, 2**20)]
    write_json(folder / FILES["bench_topk"], {"machine": {"cpu": "x"}, "records": records})
    write_json(folder / FILES["sweep"], modelled_sweep())
    for kind in JSON_KINDS:
        document = json.loads((folder / FILES[kind]).read_text())
        del document[DIGEST]
        (folder / FILES[f"{kind}_plain"]).write_text(json.dumps(document, indent=1))


def location(kind: str, folder: Path) -> Path:
    """The file of ``kind`` in ``folder`` (a part's folder is named by its save)."""
    if kind == "checkpoint_part":
        (part,) = folder.glob(f"{FILES['checkpoint']}.parts/*/{FILES[kind]}")
        return part
    return folder / FILES[kind]


def checkpoint_of(path: Path) -> Path:
    """The checkpoint file that ``path`` (it, or one of its parts) belongs to."""
    saves = path.parent.parent  # a part lies in <checkpoint>.parts/<save>/
    return saves.with_suffix("") if saves.suffix == ".parts" else path


def copy_checkpoint(source: Path, target: Path) -> None:
    """A checkpoint file and its parts, copied whole (over any earlier copy)."""
    shutil.copyfile(source, target)
    shutil.rmtree(f"{target}.parts", ignore_errors=True)
    shutil.copytree(f"{source}.parts", f"{target}.parts")


# -- what a file means: what the package reads from it ---------------------------------------
def meaning(kind: str, path: Path, good: Path) -> Any:
    """What the package makes of ``path``, as comparable plain values. Raises
    what the reader raises."""
    from spar_comm.costmodel import load
    from spar_comm.costmodel.calibrate import measurements, read, topk_rates

    kind = kind.replace("_plain", "")
    if kind in CHECKPOINTS:
        from spar_comm.training.checkpoint import read_checkpoint
        path, good = checkpoint_of(path), checkpoint_of(good)
        layout = _layout(good)
        read = [dataclasses.asdict(read_checkpoint(str(path), rank, layout)) for rank in (0, 1)]
        for saved in read:
            del saved["parts"]["path"]  # where it was read from, not what it holds
        return read
    if kind in ("trace", "trace_live"):
        from spar_comm.training.analysis import chrome_events, format_report, summarize
        from spar_comm.training.trace import read_trace
        trace = read_trace(str(path))
        summary = summarize(trace)
        format_report([summary])
        chrome_events(trace)
        summary.pop("path")
        return trace.attrs, trace.data, trace.hosts, summary
    if kind == "calibration":
        return load([str(path)]).to_dict()
    if kind == "bench_comm":
        return [dataclasses.astuple(m) for m in measurements(read(str(path))[1], str(path))], load([str(path)]).to_dict()
    if kind == "bench_topk":
        return topk_rates(read(str(path))[1], str(path))
    if kind == "sweep":
        from spar_comm.bench.cluster import read_sweep, report
        document = read_sweep(str(path))
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            report(document)
        return printed.getvalue()
    raise ValueError(kind)


_layouts: Dict[Path, Any] = {}


def _layout(good: Path) -> Any:
    if good not in _layouts:
        import array_api_compat.numpy as xnp
        from spar_comm.training import TrainConfig, build_model
        from spar_comm.training.data import load_dataset
        with h5py.File(good, "r") as f:
            config = TrainConfig.from_json(f.attrs["config"])
        _layouts[good] = build_model(config, load_dataset(config.dataset, config.dtype), xnp, "cpu").layout
    return _layouts[good]


def same(a: Any, b: Any) -> bool:
    """Equal to the bit: arrays by dtype, shape and bytes; NaN equals NaN."""
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(same, a, b))
    if isinstance(a, (np.ndarray, np.generic)) or isinstance(b, (np.ndarray, np.generic)):
        x, y = np.asarray(a), np.asarray(b)
        if x.dtype.kind == "O" or y.dtype.kind == "O":
            return x.shape == y.shape and all(map(same, x.reshape(-1).tolist(), y.reshape(-1).tolist()))
        return x.dtype == y.dtype and x.shape == y.shape and x.tobytes() == y.tobytes()
    if isinstance(a, float) and isinstance(b, float):
        return a == b or (math.isnan(a) and math.isnan(b))
    return type(a) is type(b) and a == b


# -- mutations -------------------------------------------------------------------------------
def structure(kind: str, path: Path) -> dict:
    """What mutations are made from: the file's size and, for HDF5, its objects
    and attributes; for JSON, the paths of its values."""
    info: dict = {"size": path.stat().st_size}
    if kind in HDF5:
        objects, attributes = [], []
        with h5py.File(path, "r") as f:
            def visit(name: str, obj: Any) -> None:
                objects.append((name, isinstance(obj, h5py.Dataset)))
                attributes.extend((name, key) for key in obj.attrs)
            attributes.extend(("/", key) for key in f.attrs)
            f.visititems(visit)
        info.update(objects=objects, attributes=attributes)
    else:
        paths: List[list] = []

        def walk(value: Any, where: list) -> None:
            if where:
                paths.append(where)
            items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
            for key, item in items:
                walk(item, where + [key])
        walk(json.loads(path.read_text()), [])
        info["paths"] = paths
    return info


#: Values a JSON edit writes, as JSON text (some of it not standard JSON, as Python reads it).
JSON_VALUES = ["null", "true", "false", '"x"', '""', "[]", "{}", "0", "-1", "1.5", "1e308", "-1e308", "1e999",
               "NaN", "Infinity", "-Infinity", "-0.0", "123456789012345678901234567890", "9223372036854775808",
               "1e-320", '"1gbit"', "[1, 2]", '{"a": 1}']
#: Values an HDF5 edit writes into a dataset's element or an attribute.
H5_VALUES = ["nan", "inf", "-inf", 1e30, -1e30, 1e308, 0, -1, 1, 2**62, 0.5]
ATTR_VALUES = H5_VALUES + ["text", "", "b:bytes", "array", "bool", "2.0", '{"batch_size": 0}']


def mutation(kind: str, seed: int, info: dict) -> dict:
    """The mutation of case ``seed``: one of the byte-level ones (any file),
    or a structural edit (HDF5 or JSON)."""
    rng = random.Random(f"{kind}:{seed}")
    structural = ["h5_delete", "h5_retype", "h5_reshape", "h5_value", "h5_attr_delete", "h5_attr_set",
                  "h5_data_flip", "h5_data_flip", "h5_rename"] if kind in HDF5 else \
        ["json_delete", "json_set", "json_set", "json_set", "json_format", "json_duplicate"]
    op = rng.choice(["flip", "flip", "truncate", "zero", "garbage", "append"] + structural)
    if op == "flip":
        return dict(op=op, at=[rng.random() for _ in range(rng.choice([1, 1, 1, 2, 8]))], bit=rng.randrange(8))
    if op == "truncate":
        return dict(op=op, keep=rng.random())
    if op in ("zero", "garbage"):
        return dict(op=op, at=rng.random(), length=rng.choice([1, 8, 64, 512, 4096]), seed=rng.randrange(2**31))
    if op == "append":
        return dict(op=op, length=rng.choice([1, 100, 5000]), seed=rng.randrange(2**31))
    if kind in HDF5:
        datasets = [name for name, is_dataset in info["objects"] if is_dataset]
        if op == "h5_delete":
            return dict(op=op, name=rng.choice([name for name, _ in info["objects"]]))
        if op == "h5_retype":
            return dict(op=op, name=rng.choice(datasets), dtype=rng.choice(["f2", "f4", "f8", "i4", "i8", "u1", "S8"]))
        if op == "h5_reshape":
            return dict(op=op, name=rng.choice(datasets), how=rng.choice(["flat", "axis", "shorter", "longer", "scalar"]))
        if op == "h5_value":
            return dict(op=op, name=rng.choice(datasets), at=rng.random(), value=rng.choice(H5_VALUES))
        if op == "h5_attr_delete":
            return dict(op=op, name=rng.choice(info["attributes"]))
        if op == "h5_attr_set":
            target = rng.choice(info["attributes"] + [("/", "extra")])
            return dict(op=op, name=list(target), value=rng.choice(ATTR_VALUES))
        if op == "h5_data_flip":
            return dict(op=op, name=rng.choice(datasets), at=rng.random(), bit=rng.randrange(8))
        return dict(op=op, name=rng.choice(datasets))  # h5_rename
    if op in ("json_delete", "json_set"):
        where = rng.choice(info["paths"])
        return dict(op=op, path=where) if op == "json_delete" else dict(op=op, path=where, value=rng.choice(JSON_VALUES))
    if op == "json_format":
        return dict(op=op, indent=rng.choice([None, 0, 4]), reverse=rng.random() < 0.5)
    return dict(op=op, path=rng.choice(info["paths"]), value=rng.choice(JSON_VALUES))  # json_duplicate


def apply(kind: str, change: dict, path: Path) -> None:
    """Apply ``change`` to the file at ``path`` in place."""
    op = change["op"]
    data = bytearray(path.read_bytes())
    if op == "flip":
        for at in change["at"]:
            data[int(at * len(data)) % len(data)] ^= 1 << change["bit"]
    elif op == "truncate":
        del data[int(change["keep"] * len(data)):]
    elif op in ("zero", "garbage"):
        start = int(change["at"] * len(data))
        end = min(len(data), start + change["length"])
        filler = random.Random(change["seed"]).randbytes(end - start) if op == "garbage" else bytes(end - start)
        data[start:end] = filler
    elif op == "append":
        data += random.Random(change["seed"]).randbytes(change["length"])
    elif op.startswith("h5_"):
        with h5py.File(path, "a") as f:
            H5_EDITS[op](f, change)
        return
    else:
        document = json.loads(data)
        path.write_text(JSON_EDITS[op](document, change))
        return
    path.write_bytes(bytes(data))


def _h5_value(value: Any, dtype: np.dtype) -> Any:
    """An H5_VALUES entry as something a dataset of ``dtype`` can hold."""
    number = float(value) if isinstance(value, str) else value
    if dtype.kind in "iu":
        info = np.iinfo(dtype)
        return int(min(max(number, info.min), info.max)) if math.isfinite(number) else info.max
    if dtype.kind in "SOU":
        return str(value).encode()
    return number


def _replace(f: h5py.File, name: str, values: Any) -> None:
    attrs = dict(f[name].attrs)
    del f[name]
    f.create_dataset(name, data=values).attrs.update(attrs)


def _retype(f: h5py.File, change: dict) -> None:
    values = f[change["name"]][()]
    dtype = np.dtype(change["dtype"])
    array = np.asarray(values)
    if dtype.kind == "S":
        converted = np.full(array.shape, b"x", dtype=dtype)
    else:
        with np.errstate(all="ignore"):
            converted = array.astype(dtype) if array.dtype.kind not in "OSU" else np.zeros(array.shape, dtype)
    _replace(f, change["name"], converted)


def _reshape(f: h5py.File, change: dict) -> None:
    values = np.asarray(f[change["name"]][()])
    how = change["how"]
    if how == "flat":
        new = values.reshape(-1)
    elif how == "axis":
        new = values.reshape(values.shape + (1,))
    elif how == "shorter":
        new = values[:-1] if values.ndim and len(values) else values.reshape(-1)[:0]
    elif how == "longer":
        new = np.concatenate([values, values[-1:] if values.ndim and len(values) else np.zeros((1,) + values.shape[1:], values.dtype)]) \
            if values.ndim else values.reshape(1)
    else:
        new = values.reshape(-1)[0] if values.size else np.zeros((), values.dtype)
    _replace(f, change["name"], new)


def _value(f: h5py.File, change: dict) -> None:
    ds = f[change["name"]]
    values = np.array(ds[()])
    if values.size == 0:
        return
    flat = values.reshape(-1)
    flat[int(change["at"] * flat.size)] = _h5_value(change["value"], values.dtype)
    ds[()] = flat.reshape(values.shape)


def _attr_set(f: h5py.File, change: dict) -> None:
    where, key = change["name"]
    value = change["value"]
    special = {"b:bytes": np.bytes_(b"bytes"), "array": np.array([1, 2]), "bool": np.bool_(True), "2.0": 2.0}
    if value in special:
        value = special[value]
    elif isinstance(value, str) and value in ("nan", "inf", "-inf"):
        value = float(value)
    f[where].attrs[key] = value


def _data_flip(f: h5py.File, change: dict) -> None:
    """Flip one bit in the stored bytes of a dataset (a chunk's, or the contiguous block)."""
    ds = f[change["name"]]
    regions = []
    if ds.chunks:
        for i in range(ds.id.get_num_chunks()):
            chunk = ds.id.get_chunk_info(i)
            regions.append((chunk.byte_offset, chunk.size))
    elif ds.id.get_offset() is not None:
        regions.append((ds.id.get_offset(), ds.id.get_storage_size()))
    total = sum(size for _, size in regions)
    if not total:
        return
    spot = int(change["at"] * total)
    for offset, size in regions:
        if spot < size:
            break
        spot -= size
    name = f.filename
    f.flush()
    with open(name, "r+b") as raw:
        raw.seek(offset + spot)
        byte = raw.read(1)[0]
        raw.seek(offset + spot)
        raw.write(bytes([byte ^ (1 << change["bit"])]))


H5_EDITS: Dict[str, Callable[[h5py.File, dict], None]] = {
    "h5_delete": lambda f, c: f.__delitem__(c["name"]),
    "h5_retype": _retype,
    "h5_reshape": _reshape,
    "h5_value": _value,
    "h5_attr_delete": lambda f, c: f[c["name"][0]].attrs.__delitem__(c["name"][1]),
    "h5_attr_set": _attr_set,
    "h5_data_flip": _data_flip,
    "h5_rename": lambda f, c: f.move(c["name"], c["name"] + "_renamed"),
}


def _at(document: Any, where: list) -> Tuple[Any, Any]:
    for key in where[:-1]:
        document = document[key]
    return document, where[-1]


def _json_set(document: Any, change: dict) -> str:
    parent, key = _at(document, change["path"])
    parent[key] = "\0marker\0"
    return json.dumps(document).replace('"\\u0000marker\\u0000"', change["value"])


def _json_duplicate(document: Any, change: dict) -> str:
    """The key at ``path`` given twice in its object; Python keeps the second."""
    parent, key = _at(document, change["path"])
    if not isinstance(parent, dict):
        return _json_set(document, change)
    text = json.dumps(parent)
    extra = json.dumps({key: "\0marker\0"})[1:-1].replace('"\\u0000marker\\u0000"', change["value"])
    parent.clear()
    parent["\0marker\0"] = None
    spliced = text[:-1] + (", " if len(text) > 2 else "") + extra + "}"
    return json.dumps(document).replace('{"\\u0000marker\\u0000": null}', spliced)


def _json_delete(document: Any, change: dict) -> str:
    parent, key = _at(document, change["path"])
    del parent[key]
    return json.dumps(document)


JSON_EDITS: Dict[str, Callable[[Any, dict], str]] = {
    "json_delete": _json_delete,
    "json_set": _json_set,
    "json_format": lambda d, c: json.dumps(dict(reversed(d.items())) if c["reverse"] else d, indent=c["indent"]),
    "json_duplicate": _json_duplicate,
}


# -- one case ----------------------------------------------------------------------------------
def run_case(kind: str, change: dict, good_folder: Path, work: Path, originals: Dict[str, Any]) -> Tuple[str, str]:
    """(outcome, detail) of one case, in this process."""
    from spar_comm.files import BadFileError

    good = location(kind, good_folder)
    if kind in CHECKPOINTS:
        copy_checkpoint(good_folder / FILES["checkpoint"], work / FILES["checkpoint"])
        path = location(kind, work)
    else:
        path = work / FILES[kind]
        shutil.copyfile(good, path)
    try:
        apply(kind, change, path)
    except Exception as error:  # the edit itself does not apply to this file: not a case
        return "skipped", f"{type(error).__name__}: {error}"
    try:
        found = meaning(kind, path, good)
    except BadFileError as error:
        if str(path) not in str(error):
            return "crash", f"BadFileError not naming the file: {error}"
        return "refused", str(error).replace(str(path), FILES[kind])
    except Exception as error:
        return "crash", f"{type(error).__name__}: {error}"
    if same(found, originals[kind]):
        return "same", ""
    if kind == "trace_live" and is_prefix(found, originals[kind]):
        return "prefix", ""
    if kind.endswith("_plain"):
        return "changed", ""
    return "corrupt", "accepted, and what was read differs from the good file"


def is_prefix(found: Any, original: Any) -> bool:
    """Whether a trace's meaning is the original's with rows missing at the end."""
    attrs, data, hosts, _ = found
    return (same(attrs, original[0]) and same(hosts, original[2]) and data.keys() == original[1].keys()
            and all(same(values, original[1][name][:len(values)]) for name, values in data.items()))


def worker(good_folder: Path) -> None:
    """Run the cases given one per line on stdin; answer one line each on stdout."""
    originals = {kind: meaning(kind, location(kind, good_folder), location(kind, good_folder)) for kind in KINDS}
    with tempfile.TemporaryDirectory() as work:
        sys.stdout.flush()
        answer = os.fdopen(os.dup(1), "w")
        os.dup2(2, 1)  # anything a reader or HDF5 prints stays out of the answers
        answer.write("ready\n")
        answer.flush()
        for line in sys.stdin:
            case = json.loads(line)
            outcome, detail = run_case(case["kind"], case["mutation"], good_folder, Path(work), originals)
            answer.write(json.dumps([outcome, detail[:300]]) + "\n")
            answer.flush()


class Runner:
    """Cases in a worker process, started again after one dies or hangs."""

    def __init__(self, good_folder: Path):
        self.good_folder, self.process = good_folder, None

    def _start(self) -> None:
        self.process = subprocess.Popen([sys.executable, __file__, "--worker", str(self.good_folder)],
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                        text=True, bufsize=1)
        if self._read(300) != "ready":
            raise RuntimeError("the fuzz worker did not start")

    def _read(self, limit: float) -> Optional[str]:
        ready, _, _ = select.select([self.process.stdout], [], [], limit)
        line = self.process.stdout.readline() if ready else None
        return line.strip() if line else None

    def run(self, kind: str, change: dict) -> Tuple[str, str]:
        if self.process is None or self.process.poll() is not None:
            self._start()
        self.process.stdin.write(json.dumps(dict(kind=kind, mutation=change)) + "\n")
        self.process.stdin.flush()
        line = self._read(CASE_LIMIT)
        if line:
            outcome, detail = json.loads(line)
            return outcome, detail
        self.process.kill()
        code = self.process.wait()
        self.process = None
        return "crash", f"the reader hung for {CASE_LIMIT} s" if code == -9 else f"the reader died (status {code})"

    def close(self) -> None:
        if self.process is not None:
            self.process.stdin.close()
            self.process.wait(timeout=30)


# -- a run -------------------------------------------------------------------------------------
@dataclasses.dataclass
class Result:
    kind: str
    mutation: dict
    outcome: str
    detail: str


def cases(count: int, seed: int, good_folder: Path, kinds: Sequence[str] = KINDS) -> Iterator[Tuple[str, dict]]:
    """``count`` cases, the kinds in turn, case i of kind k made from seed + i."""
    infos = {kind: structure(kind, location(kind, good_folder)) for kind in kinds}
    for i in range(count):
        kind = kinds[i % len(kinds)]
        yield kind, mutation(kind, seed + i, infos[kind])


def run(planned: Iterator[Tuple[str, dict]], good_folder: Path) -> List[Result]:
    runner = Runner(good_folder)
    try:
        return [Result(kind, change, *runner.run(kind, change)) for kind, change in planned]
    finally:
        runner.close()


def summary(results: Sequence[Result], seconds: float) -> str:
    outcomes = ("refused", "same", "prefix", "changed", "crash", "corrupt", "skipped")
    kinds = [k for k in KINDS if any(r.kind == k for r in results)]
    lines = [f"{'file':<18}" + "".join(f"{o:>9}" for o in outcomes) + f"{'cases':>9}"]
    for kind in kinds + ["all"]:
        mine = [r for r in results if kind in ("all", r.kind)]
        lines.append(f"{kind:<18}" + "".join(f"{sum(r.outcome == o for r in mine):>9}" for o in outcomes)
                     + f"{len(mine):>9}")
    defects = [r for r in results if r.outcome in DEFECTS]
    lines.append(f"{len(results)} cases in {seconds:.0f} s: {sum(r.outcome == 'crash' for r in results)} crashes, "
                 f"{sum(r.outcome == 'corrupt' for r in results)} silent corruptions")
    for r in defects[:50]:
        lines.append(f"  {r.outcome}: {r.kind} {json.dumps(r.mutation)}: {r.detail}")
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", type=int, default=5000)
    parser.add_argument("--seed", type=int, default=0, help="case i is made from seed + i")
    parser.add_argument("--kinds", default=",".join(KINDS), help="comma-separated, of " + ", ".join(KINDS))
    parser.add_argument("--corpus", help="replay the cases of this JSON file instead")
    parser.add_argument("--defects", help="write the cases that were defects to this JSON file")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(Path(args.worker))
        return 0
    kinds = [k for k in args.kinds.split(",") if k]
    unknown = set(kinds) - set(KINDS)
    if unknown or args.cases < 0:
        parser.error(f"unknown kinds {sorted(unknown)}" if unknown else "--cases must be >= 0")
    with tempfile.TemporaryDirectory() as folder:
        good_folder = Path(folder)
        make_good_files(good_folder)
        started = time.perf_counter()
        if args.corpus:
            planned = ((c["kind"], c["mutation"]) for c in json.loads(Path(args.corpus).read_text()))
        else:
            planned = cases(args.cases, args.seed, good_folder, kinds)
        results = run(planned, good_folder)
        print(summary(results, time.perf_counter() - started))
    if args.defects:
        Path(args.defects).write_text(json.dumps([dict(kind=r.kind, mutation=r.mutation, detail=r.detail)
                                                  for r in results if r.outcome in DEFECTS], indent=1) + "\n")
    return 1 if any(r.outcome in DEFECTS for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
