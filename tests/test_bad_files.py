"""Every file the package reads is untrusted input (issue 14, item 7).

A table of bad files goes through every reader: checkpoints, traces,
calibration and benchmark JSON. Each must be refused with one BadFileError
naming the file and the problem (exit status 2 and one message from the
command-line programs, on every rank of an MPI one), and no file may change.
The good file of each kind is made by the package itself; the bad ones are
made from it: not the format, empty, cut short, the other format, and
schema faults (wrong version, missing keys or datasets, wrong shapes, dtypes
or types).
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Callable, Dict, List, Tuple

import array_api_compat.numpy as xnp
import h5py
import numpy as np
import pytest
from test_bench_cluster import modelled_sweep
from test_train_runs import FAST, MPIEXEC, ROOT

from spar_comm import Topology, make_allreducer
from spar_comm.costmodel import CPU, load
from spar_comm.costmodel.calibrate import FORMAT as CALIBRATION_FORMAT
from spar_comm.costmodel.calibrate import TOOL, measurements, read, topk_rates
from spar_comm.errors import ConfigError
from spar_comm.files import BadFileError, seal, stamp
from spar_comm.training import TrainConfig, build_model
from spar_comm.training import checkpoint
from spar_comm.training.checkpoint import read_checkpoint
from spar_comm.training.parts import folder as parts_folder
from spar_comm.training.data import load_dataset
from spar_comm.training.trace import GROWING, read_trace

LIMIT = 120  # seconds a driver may take


# -- the good file of each kind ------------------------------------------------------------
@pytest.fixture(scope="module")
def run_files(tmp_path_factory) -> Tuple[Path, Path]:
    """A checkpoint and a trace written by a real 2-rank run of train.py."""
    folder = tmp_path_factory.mktemp("run")
    checkpoint, trace = folder / "ck.h5", folder / "trace.h5"
    command = [MPIEXEC, "-n", "2", sys.executable, "drivers/train.py", *FAST, "--steps", "20", "--stop-after", "10",
               "--checkpoint", str(checkpoint), "--trace", str(trace)]
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=LIMIT)
    assert result.returncode == 0, result.stderr
    return checkpoint, trace


def calibration() -> dict:
    return {"tool": TOOL, "format": CALIBRATION_FORMAT, "machine": CPU.to_dict()}


def bench_comm() -> dict:
    meta = {"tool": "bench_comm", "num_nodes": 2, "ranks_per_node": 2, "node_sizes": [2, 2], "dtype": "float32",
            "density": 0.001, "selector": "mstopk"}
    results = [{"algorithm": a, "size": n, "time_median": 1e-3 * n / 65536, "t_select": 1e-4}
               for a in ("dense", "topka", "hitopk") for n in (65536, 262144)]
    return {"meta": meta, "results": results}


def bench_topk() -> dict:
    return {"machine": {}, "records": [{"method": "mstopk", "n": n, "median_s": 1e-4 + 2e-9 * n} for n in (2**16, 2**20)]}


# -- the readers, each with what it reads (serial) -------------------------------------------
def layout_of(path: Path):
    with h5py.File(path, "r") as f:
        config = TrainConfig.from_json(f.attrs["config"])
    return build_model(config, load_dataset(config.dataset, config.dtype), xnp, "cpu").layout


def read_as_checkpoint(path: Path, good: Path) -> None:
    layout = layout_of(good)
    for rank in (0, 1):
        read_checkpoint(str(path), rank, layout)


def checkpoint_of(part: Path) -> Path:
    """The checkpoint file a part belongs to: <checkpoint>.parts/<save>/rank<r>.h5."""
    return part.parent.parent.with_suffix("")


def part_of(checkpoint: Path) -> Path:
    """Rank 1's part of the one save a copied checkpoint holds."""
    (part,) = Path(parts_folder(str(checkpoint))).glob("*/rank1.h5")
    return part


def forged(change: Callable[[h5py.File], None]) -> Callable[[Path], None]:
    """An edit of a part with every checksum made anew, the manifest's
    included: only the reader's own checks can refuse it."""
    def make(path: Path) -> None:
        with h5py.File(path, "a") as f:
            change(f)
            seal(f)
        digest, main = stamp(path), checkpoint_of(path)
        with h5py.File(main, "a") as f:
            digests = f["parts/digests"][()]
            digests[int(path.stem[len("rank"):])] = digest.encode()
            f["parts/digests"][()] = digests
            seal(f)
        stamp(main)
    return make


def read_as_auto_calibration(path: Path, good: Path) -> None:
    """SPAR_COMM_CALIBRATION is read by make_allreducer("auto"): a ConfigError
    on every rank that names the variable, the file and the problem."""
    os.environ["SPAR_COMM_CALIBRATION"] = str(path)
    try:
        make_allreducer("auto", Topology(ranks_per_node=1), size=1024)
    except ConfigError as error:
        assert "SPAR_COMM_CALIBRATION" in str(error)
        raise BadFileError(path, str(error)) from None
    finally:
        del os.environ["SPAR_COMM_CALIBRATION"]


#: reader name -> (kind of file, what the good file is, how the library reads it)
READERS: Dict[str, Tuple[str, str, Callable[[Path, Path], object]]] = {
    "read_trace": ("hdf5", "trace", lambda path, good: read_trace(str(path))),
    "read_checkpoint": ("hdf5", "checkpoint", read_as_checkpoint),
    "read_checkpoint_part": ("hdf5", "checkpoint_part",
                             lambda path, good: read_as_checkpoint(checkpoint_of(path), checkpoint_of(good))),
    "calibration": ("json", "calibration", lambda path, good: load([str(path)])),
    "auto": ("json", "calibration", read_as_auto_calibration),
    "bench_comm": ("json", "bench_comm", lambda path, good: measurements(read(str(path))[1], str(path))),
    "bench_topk": ("json", "bench_topk", lambda path, good: topk_rates(read(str(path))[1], str(path))),
}


# -- the bad files: (name, words the message must hold, how to make it from the good file) ----
def text(content: bytes) -> Callable[[Path], None]:
    return lambda path: path.write_bytes(content)


def cut_short(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def edit_json(change: Callable[[dict], None]) -> Callable[[Path], None]:
    def make(path: Path) -> None:
        document = json.loads(path.read_text())
        change(document)
        path.write_text(json.dumps(document))
    return make


def edit_hdf5(change: Callable[[h5py.File], None]) -> Callable[[Path], None]:
    """An edit through h5py, with the checksums then made anew: the reader's
    own checks, behind the checksums, must refuse it (test_checksums.py
    covers an edit that leaves them as they were)."""
    def make(path: Path) -> None:
        with h5py.File(path, "a") as f:
            change(f)
            seal(f, growing=GROWING.__contains__ if "checksums" in f else lambda name: False)
        stamp(path)
    return make


def replace(name: str, data) -> Callable[[h5py.File], None]:
    def change(f: h5py.File) -> None:
        attrs = dict(f[name].attrs)
        del f[name]
        f.create_dataset(name, data=data).attrs.update(attrs)
    return change


def a_json_file(path: Path) -> None:
    path.write_text(json.dumps(calibration()))


def an_hdf5_file(path: Path) -> None:
    with h5py.File(path, "w") as f:
        f["x"] = np.arange(3)


EVERY_FILE = [
    ("empty", "", text(b"")),
    ("text", "", text(b"this is not what you think\n")),
    ("binary", "", text(bytes(range(256)) * 8)),
    ("cut short", "", cut_short),
]
HDF5 = EVERY_FILE + [("json instead", "not an HDF5 file", a_json_file)]
JSON = EVERY_FILE + [("hdf5 instead", "not JSON", an_hdf5_file)]
SCHEMA = {
    "trace": [
        ("an empty HDF5 file", "missing attribute 'world_size'", an_hdf5_file),
        ("missing dataset", "missing dataset 'phases/comm_inter'", edit_hdf5(lambda f: f.__delitem__("phases/comm_inter"))),
        ("wrong shape", "dataset 'k' has shape", edit_hdf5(replace("k", np.zeros((10, 3), "i8")))),
        ("wrong dtype", "dataset 'loss' is", edit_hdf5(replace("loss", np.array([b"x"] * 10)))),
        ("bad config", "attribute 'config' is not a JSON object", edit_hdf5(lambda f: f.attrs.__setitem__("config", "{"))),
        ("world size", "attribute 'world_size' should be a finite int",
         edit_hdf5(lambda f: f.attrs.__setitem__("world_size", "two"))),
    ],
    "checkpoint": [
        ("an empty HDF5 file", "no checksum: a checkpoint of format 1 (or another program's", an_hdf5_file),
        ("version", "checkpoint format 7", edit_hdf5(lambda f: f.attrs.__setitem__("format", 7))),
        ("missing params", "missing dataset 'params/layer0.weight'", edit_hdf5(lambda f: f.__delitem__("params/layer0.weight"))),
        ("missing manifest", "missing dataset 'parts/spans'", edit_hdf5(lambda f: f.__delitem__("parts/spans"))),
        ("wrong shape", "dataset 'params/layer0.bias' has shape (3,)", edit_hdf5(replace("params/layer0.bias", np.zeros(3, "f4")))),
        ("wrong dtype", "dataset 'optimizer/velocity/layer0.weight' is int64",
         edit_hdf5(lambda f: replace("optimizer/velocity/layer0.weight", np.zeros(f["optimizer/velocity/layer0.weight"].shape, "i8"))(f))),
        ("residual range", "parts/spans: rank 0's [5, 1)",
         edit_hdf5(lambda f: f["parts/spans"].__setitem__(0, np.array([5, 1])))),
        ("bad config", "attribute 'config' is not a training configuration",
         edit_hdf5(lambda f: f.attrs.__setitem__("config", '{"no_such_setting": 1}'))),
    ],
    "checkpoint_part": [
        ("edited", "not the file its checkpoint names", edit_hdf5(lambda f: f.attrs.__setitem__("rank", 0))),
        ("another rank's", "attribute 'rank' is not 1", forged(lambda f: f.attrs.__setitem__("rank", 0))),
        ("another save's", "attribute 'token' is not this save's", forged(lambda f: f.attrs.__setitem__("token", "x"))),
        ("residual range", "its residual's span is not the manifest's",
         forged(lambda f: f["residual"].attrs.__setitem__("hi", 1))),
        ("missing residual", "missing dataset 'residual'", forged(lambda f: f.__delitem__("residual"))),
        ("wrong shape", "dataset 'residual' has shape (3,)", forged(replace("residual", np.zeros(3, "f4")))),
    ],
    "calibration": [
        ("version", "calibration format 2", edit_json(lambda d: d.__setitem__("format", 2))),
        ("missing key", "missing key 'machine.gamma'", edit_json(lambda d: d["machine"].__delitem__("gamma"))),
        ("wrong type", "machine.overhead should be a finite number", edit_json(lambda d: d["machine"].__setitem__("overhead", "1"))),
        ("wrong shape", "machine.select.mstopk should have 2 items",
         edit_json(lambda d: d["machine"]["select"].__setitem__("mstopk", [1e-4]))),
        ("negative", "gamma must be a finite number >= 0", edit_json(lambda d: d["machine"].__setitem__("gamma", -1.0))),
        ("foreign", "neither bench_comm.py nor bench_topk.py", text(b'{"tool": "something else"}')),
    ],
    "bench_comm": [
        ("missing key", "missing key 'meta.num_nodes'", edit_json(lambda d: d["meta"].__delitem__("num_nodes"))),
        ("wrong type", "results[1].size should be an integer", edit_json(lambda d: d["results"][1].__setitem__("size", 1.5))),
        ("not a list", "results should be a list", edit_json(lambda d: d.__setitem__("results", {}))),
        ("unknown algorithm", "results[0] is a row the model does not know",
         edit_json(lambda d: d["results"][0].__setitem__("algorithm", "allreduce_magic"))),
    ],
    "bench_topk": [
        ("missing key", "missing key 'records[0].median_s'", edit_json(lambda d: d["records"][0].__delitem__("median_s"))),
        ("no known selector", "no records of a known selector",
         edit_json(lambda d: [r.__setitem__("method", "argpartition") for r in d["records"]])),
    ],
    "sweep": [
        ("missing key", "missing key 'records[0].time_median'", edit_json(lambda d: d["records"][0].__delitem__("time_median"))),
        ("wrong type", "records[2].hosts should be an integer", edit_json(lambda d: d["records"][2].__setitem__("hosts", "2"))),
        ("training", "training[0].final_metric", edit_json(lambda d: d.__setitem__("training", [{"algorithm": "dense"}]))),
        ("unknown cell", "records[0] is not a cell", edit_json(lambda d: d["records"][0].__setitem__("rate", "fast"))),
    ],
}


def copy_checkpoint(source: Path, target: Path) -> None:
    shutil.copyfile(source, target)
    shutil.copytree(parts_folder(str(source)), parts_folder(str(target)))


def good_file(kind: str, folder: Path, run_files: Tuple[Path, Path]) -> Path:
    """A fresh copy of the good file of ``kind`` in ``folder``."""
    folder.mkdir(exist_ok=True)
    if kind in ("checkpoint", "checkpoint_part"):  # the checkpoint file and its parts
        path = folder / run_files[0].name
        copy_checkpoint(run_files[0], path)
        return path if kind == "checkpoint" else part_of(path)
    if kind == "trace":
        path = folder / run_files[1].name
        path.write_bytes(run_files[1].read_bytes())
        return path
    document = {"calibration": calibration, "bench_comm": bench_comm, "bench_topk": bench_topk,
                "sweep": modelled_sweep}[kind]()
    path = folder / f"{kind}.json"
    path.write_text(json.dumps(document))
    return path


def cases(reader: str) -> List[tuple]:
    form, kind, _ = READERS[reader]
    return [(reader, *case) for case in (HDF5 if form == "hdf5" else JSON) + SCHEMA[kind]]


@pytest.mark.slow
@pytest.mark.parametrize("reader, case, words, make", [c for r in READERS for c in cases(r)],
                         ids=lambda v: v if isinstance(v, str) else "")
def test_every_reader_refuses_every_bad_file_by_name(tmp_path, run_files, reader, case, words, make):
    form, kind, read_it = READERS[reader]
    (tmp_path / "good").mkdir()
    good = good_file(kind, tmp_path / "good", run_files)
    read_it(good, good)  # the good file is read without complaint
    if kind in ("checkpoint", "checkpoint_part"):  # a whole copy, where the bad file is one of its files
        bad = good_file(kind, tmp_path / "bad", run_files)
    else:
        bad = tmp_path / f"bad{good.suffix}"
        bad.write_bytes(good.read_bytes())
    make(bad)
    before = bad.read_bytes()
    with pytest.raises(BadFileError) as caught:
        read_it(bad, good)
    message = str(caught.value)
    assert str(bad) in message and words in message, message
    assert bad.read_bytes() == before


# -- the command-line programs: exit status 2, one message, no traceback, nothing written ----
def run_driver(*args, ranks: int = 0) -> subprocess.CompletedProcess:
    command = [sys.executable, *map(str, args)]
    if ranks:
        command = [MPIEXEC, "-n", str(ranks), *command]
    return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=LIMIT)


def assert_refused(result: subprocess.CompletedProcess, path: Path) -> None:
    assert result.returncode == 2, (result.returncode, result.stderr)
    errors = [line for line in result.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1 and str(path) in errors[0], result.stderr
    assert "Traceback" not in result.stderr, result.stderr


DRIVERS = {  # kind of file -> the command lines that read it
    "trace": [["drivers/analyze.py", "{}"]],
    "calibration": [["drivers/predict.py", "--nodes", "4", "--ranks-per-node", "2", "--size", "1M", "--calibration", "{}"]],
    "bench_comm": [["drivers/predict.py", "fit", "{}"]],
    "sweep": [["drivers/bench_cluster.py", "--report", "{}"]],
}


@pytest.mark.slow
@pytest.mark.parametrize("kind, case", [(k, c) for k in DRIVERS for c in ("text", "cut short", "schema")])
def test_drivers_exit_2_with_one_message_naming_the_file(tmp_path, run_files, kind, case):
    bad = good_file(kind, tmp_path, run_files)
    make = {"text": text(b"not a file of ours"), "cut short": cut_short}.get(case) or SCHEMA[kind][1][2]
    make(bad)
    before = bad.read_bytes()
    for command in DRIVERS[kind]:
        assert_refused(run_driver(*[part.format(bad) for part in command]), bad)
    assert bad.read_bytes() == before


def flip_a_bit(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 4
    path.write_bytes(bytes(data))


@pytest.mark.slow
@pytest.mark.parametrize("case", ["text", "cut short", "missing manifest", "flipped bit", "bad part", "bad trace"])
def test_resume_from_a_bad_file_exits_2_on_every_rank_and_touches_nothing(tmp_path, run_files, case):
    checkpoint, trace = tmp_path / "ck.h5", tmp_path / "trace.h5"
    copy_checkpoint(run_files[0], checkpoint)
    trace.write_bytes(run_files[1].read_bytes())
    bad = {"bad trace": trace, "bad part": part_of(checkpoint)}.get(case, checkpoint)
    make = {"text": text(b"not a checkpoint"), "cut short": cut_short, "flipped bit": flip_a_bit,
            "bad part": flip_a_bit, "bad trace": text(b"not a trace")}.get(case)
    (make or dict((c[0], c[2]) for c in SCHEMA["checkpoint"])[case])(bad)
    files = (checkpoint, trace, *Path(parts_folder(str(checkpoint))).rglob("*.h5"))
    before = {path: path.read_bytes() for path in files}
    result = run_driver("drivers/train.py", *FAST, "--steps", "20", "--checkpoint", checkpoint, "--trace", trace,
                        "--resume", ranks=2)
    assert_refused(result, bad)
    assert {path: path.read_bytes() for path in files} == before


def _pricing(**changes) -> str:
    return json.dumps({"machine": CPU.to_dict(), "cores": 2, **changes})


@pytest.mark.parametrize("text, words", [
    ("{", "Expecting"),
    (_pricing(machine={}), "select"),
    (_pricing(machine={**CPU.to_dict(), "beta_inter": float("nan")}), "beta_inter"),
    (_pricing(cores=0), "cores 0"),
    (_pricing(cores=True), "cores True"),
    (json.dumps({"machine": CPU.to_dict()}), "cores"),
])
def test_what_auto_priced_in_a_checkpoint_is_checked_as_a_resume_takes_it(text, words):
    """The checksums make a damaged attribute a BadFileError before this;
    these are well-sealed files whose attribute is not what auto priced."""
    with pytest.raises(BadFileError, match=f"auto_priced.*{words}"):
        checkpoint._priced("ck.h5", text)
    assert checkpoint._priced("ck.h5", _pricing()) == json.loads(_pricing())
