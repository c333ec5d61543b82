"""Untrusted files (issue 19): checksums in checkpoints, traces and JSON, and
the mutation fuzzer (fuzz_files.py) run on a bounded count and on its corpus
of the cases that once failed. ``make fuzz`` runs it long."""
from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import h5py
import numpy as np
import pytest

import fuzz_files
from fuzz_files import CHECKPOINTS, FILES, KINDS, copy_checkpoint, location, meaning, run, run_case
from spar_comm.errors import SparCommError
from spar_comm.files import BadFileError, agree, seal, stamp, unstamp, write_json
from spar_comm.training.trace import GROWING, read_trace

#: Cases of the bounded run in `make test`; `make fuzz` runs 5000.
BOUNDED = 22 * len(KINDS)
CORPUS = Path(__file__).with_name("fuzz_corpus.json")


@pytest.fixture(scope="module")
def good(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("good")
    fuzz_files.make_good_files(folder)
    return folder


def copy(good: Path, kind: str, folder: Path) -> Path:
    if kind in CHECKPOINTS:  # the checkpoint file and its parts
        copy_checkpoint(good / FILES["checkpoint"], folder / FILES["checkpoint"])
        return location(kind, folder)
    path = folder / FILES[kind]
    shutil.copyfile(good / FILES[kind], path)
    return path


def refused(kind: str, path: Path, good: Path) -> str:
    with pytest.raises(BadFileError) as caught:
        meaning(kind, path, location(kind, good))
    assert str(path) in str(caught.value)
    return caught.value.problem


# -- checkpoints ---------------------------------------------------------------------------
def datasets(path: Path) -> list:
    names: list = []
    with h5py.File(path, "r") as f:
        f.visititems(lambda name, obj: names.append(name) if isinstance(obj, h5py.Dataset) else None)
    return names


@pytest.mark.slow
def test_a_flipped_bit_in_any_dataset_of_a_checkpoint_is_refused_by_both_checksums(good, tmp_path):
    names = datasets(good / FILES["checkpoint"])
    assert len(names) == 15  # 6 parameters, 6 velocities, the manifest's spans, checksums and velocity flags
    for name in names:
        for at in (0.0, 0.999):
            path = copy(good, "checkpoint", tmp_path)
            with h5py.File(path, "a") as f:
                fuzz_files._data_flip(f, dict(name=name, at=at, bit=3))
            assert "the file does not match its checksum" in refused("checkpoint", path, good)
            stamp(path)  # the whole-file checksum made anew: the dataset's own still refuses it
            assert refused("checkpoint", path, good) == \
                f"dataset {name!r} does not match its checksum: the file is damaged or was edited"


@pytest.mark.slow
def test_a_flipped_bit_in_a_part_is_refused_by_its_checksum_and_the_manifest(good, tmp_path):
    names = datasets(location("checkpoint_part", good))
    assert sorted(names) == ["aids/velocity", "residual"]
    for name in names:
        path = copy(good, "checkpoint_part", tmp_path)
        with h5py.File(path, "a") as f:
            fuzz_files._data_flip(f, dict(name=name, at=0.5, bit=3))
        assert "the file does not match its checksum" in refused("checkpoint_part", path, good)
        stamp(path)  # whole again, but not the file the checkpoint names
        assert refused("checkpoint_part", path, good).startswith("not the file its checkpoint names")


def forge(part: Path, edit) -> None:
    """Edit a part and make every checksum anew, the manifest's included: the
    reader's own checks behind them must refuse it."""
    with h5py.File(part, "a") as f:
        edit(f)
        seal(f)
    digest = stamp(part)
    main, rank = part.parent.parent.with_suffix(""), int(part.stem[len("rank"):])
    with h5py.File(main, "a") as f:
        digests = f["parts/digests"][()]
        digests[rank] = digest.encode()
        f["parts/digests"][()] = digests
        seal(f)
    stamp(main)


def test_a_forged_part_is_refused_by_what_it_holds(good, tmp_path):
    for edit, problem in ((lambda f: f.attrs.__setitem__("rank", 0), "attribute 'rank' is not 1"),
                          (lambda f: f["residual"].attrs.__setitem__("hi", 1), "its residual's span is not the manifest's"),
                          (lambda f: f.__delitem__("residual"), "missing dataset 'residual'")):
        path = copy(good, "checkpoint_part", tmp_path)
        forge(path, edit)
        assert problem in refused("checkpoint_part", path, good)


def test_an_edit_through_h5py_or_a_missing_dataset_is_refused(good, tmp_path):
    for edit in (lambda f: f["params/layer1.bias"].__setitem__(0, 0.5),
                 lambda f: f.__delitem__("parts/velocities"),
                 lambda f: f.attrs.__setitem__("step", 3)):
        path = copy(good, "checkpoint", tmp_path)
        with h5py.File(path, "a") as f:
            edit(f)
        stamp(path)
        assert "does not match its checksum" in refused("checkpoint", path, good)


def test_non_finite_values_are_refused_behind_valid_checksums(good, tmp_path):
    def poke(name: str, value: float):
        def edit(f: h5py.File) -> None:
            values = f[name][()]
            values.reshape(-1)[7] = value
            f[name][()] = values
        return edit

    path = copy(good, "checkpoint", tmp_path)
    with h5py.File(path, "a") as f:
        poke("params/layer0.weight", np.nan)(f)
        seal(f)
    stamp(path)
    assert refused("checkpoint", path, good) == "dataset 'params/layer0.weight' holds 1 NaN or infinite values"
    for name, value in (("residual", np.inf), ("aids/velocity", -np.inf)):
        path = copy(good, "checkpoint_part", tmp_path)
        forge(path, poke(name, value))
        assert refused("checkpoint_part", path, good) == f"dataset {name!r} holds 1 NaN or infinite values"


def test_a_checkpoint_of_the_previous_format_is_refused_saying_why(good, tmp_path):
    """Format 1: no header, no digests, format attribute 1."""
    old = tmp_path / "old.h5"
    with h5py.File(good / FILES["checkpoint"], "r") as new, h5py.File(old, "w") as f:
        for key in new:
            new.copy(key, f)
        f.attrs.update({k: v for k, v in new.attrs.items() if k != "sha256"})
        f.attrs["format"] = 1
    problem = refused("checkpoint", old, good)
    assert "a checkpoint of format 1" in problem and "resume it with the version that wrote it" in problem


def test_a_checkpoint_not_completely_written_is_refused(good, tmp_path):
    path = copy(good, "checkpoint", tmp_path)
    unstamp(path)
    assert refused("checkpoint", path, good) == "the file carries no checksum: it was not completely written"


# -- traces --------------------------------------------------------------------------------
def test_a_live_trace_is_checked_by_fletcher32_and_row_checksums(good, tmp_path):
    path = copy(good, "trace_live", tmp_path)
    with h5py.File(path, "a") as f:
        assert all(f[name].fletcher32 for name in GROWING)
        fuzz_files._data_flip(f, dict(name="phases/compute", at=0.0, bit=0))
    assert "filter returned failure during read" in refused("trace_live", path, good)  # fletcher32
    path = copy(good, "trace_live", tmp_path)
    with h5py.File(path, "a") as f:
        f["k"][3, 1] = 7  # through h5py: fletcher32 is made anew, the row checksum is not
    assert refused("trace_live", path, good).startswith("row 3 of the step datasets does not match its checksum")


def test_a_closed_trace_carries_a_whole_file_checksum(good, tmp_path):
    path = copy(good, "trace", tmp_path)
    with open(path, "r+b") as stream:  # flip the last byte: writing a constant may change nothing
        stream.seek(-1, 2)
        last = stream.read(1)[0]
        stream.seek(-1, 2)
        stream.write(bytes([last ^ 0xFF]))
    assert refused("trace", path, good) == \
        "the file does not match its checksum: it is damaged, cut short or was edited"


def test_a_trace_of_the_previous_format_is_still_read(good, tmp_path):
    """Format 1: no header, no format attribute, no digests, no row checksums, no fletcher32."""
    old = tmp_path / "old.h5"
    with h5py.File(good / FILES["trace"], "r") as new, h5py.File(old, "w", libver="latest") as f:
        f.attrs.update({k: v for k, v in new.attrs.items() if k not in ("sha256", "format")})
        for name in datasets(good / FILES["trace"]):
            if not name.startswith("checksums"):
                f.create_dataset(name, data=new[name][()], dtype=new[name].dtype, maxshape=new[name].maxshape)
    then, now = read_trace(str(good / FILES["trace"])), read_trace(str(old))
    assert sorted(now.data) == sorted(set(then.data) - {"checksums/step", "checksums/eval"})
    assert all(fuzz_files.same(values, then.data[name]) for name, values in now.data.items())
    assert now.steps == 10 and now.hosts == then.hosts


# -- JSON ----------------------------------------------------------------------------------
def test_json_written_by_the_package_is_refused_when_changed_and_read_once_unsealed(good, tmp_path):
    path = tmp_path / "bench_topk.json"
    document = json.loads((good / FILES["bench_topk"]).read_text())
    document["records"][0]["median_s"] *= 2
    path.write_text(json.dumps(document))
    assert "the contents do not match their checksum" in refused("bench_topk", path, good)
    del document["sha256"]  # edited by hand, on purpose: read as it is
    path.write_text(json.dumps(document))
    halved = meaning("bench_topk", path, path)
    assert halved != meaning("bench_topk", good / FILES["bench_topk"], good / FILES["bench_topk"])


def test_write_json_reads_back_equal(tmp_path):
    document = {"a": [1, 2.5, None, "x"], "b": {"c": float("nan")}, 3: (1, 2)}
    write_json(tmp_path / "d.json", document)
    from spar_comm.files import read_json
    back = read_json(tmp_path / "d.json")
    assert fuzz_files.same(back, {"a": [1, 2.5, None, "x"], "b": {"c": float("nan")}, "3": [1, 2]})


# -- agreement between ranks ---------------------------------------------------------------
class Ranks:
    """A communicator of two ranks whose other rank's verdict is given."""

    def __init__(self, other: Any):
        self.other = other

    def allgather(self, mine: Any) -> list:
        return [self.other, mine]


def test_agree_raises_alike_on_every_rank(tmp_path):
    bad = BadFileError(tmp_path / "x.h5", "damaged")

    def refuse():
        raise BadFileError(tmp_path / "y.h5", "cut short")

    with pytest.raises(BadFileError, match="x.h5: damaged"):  # the first rank's refusal, on every rank
        agree(Ranks(bad), refuse)
    with pytest.raises(BadFileError, match="x.h5: damaged"):
        agree(Ranks(bad), lambda: 1)
    with pytest.raises(SparCommError, match="rank 0 failed reading a file: KeyError"):  # another error: no rank waits
        agree(Ranks("KeyError: 'x'"), lambda: 1)
    with pytest.raises(ZeroDivisionError):
        agree(Ranks(None), lambda: 1 / 0)
    assert agree(Ranks(None), lambda: 5) == 5


# -- the fuzzer ----------------------------------------------------------------------------
def test_the_fuzzer_tells_silent_corruption_from_a_refusal(good, tmp_path, monkeypatch):
    """With the checksums switched off, an edited parameter is read: the fuzzer must call it corrupt."""
    originals = {kind: meaning(kind, location(kind, good), location(kind, good)) for kind in ("checkpoint", "bench_topk_plain")}
    change = dict(op="h5_value", name="params/layer1.bias", at=0.5, value=0.5)
    assert run_case("checkpoint", change, good, tmp_path, originals)[0] == "refused"
    import spar_comm.training.checkpoint as checkpoint
    monkeypatch.setattr(checkpoint, "verify", lambda f, keep: {name: f[name][()] for name in keep if name in f})
    monkeypatch.setattr(fuzz_files, "apply", lambda kind, c, path: (fuzz_files.H5_EDITS["h5_value"](h5py.File(path, "a"), c), stamp(path)))
    assert run_case("checkpoint", change, good, tmp_path, originals) == \
        ("corrupt", "accepted, and what was read differs from the good file")
    monkeypatch.undo()
    change = dict(op="json_set", path=["records", 0, "median_s"], value="0.5")
    assert run_case("bench_topk_plain", change, good, tmp_path, originals)[0] == "changed"


@pytest.mark.slow
def test_the_corpus_of_cases_that_once_failed_replays_without_a_defect(good):
    corpus = json.loads(CORPUS.read_text())
    assert len(corpus) >= 90 and {case["kind"] for case in corpus} >= {"checkpoint", "trace", "sweep_plain"}
    results = run(((case["kind"], case["mutation"]) for case in corpus), good)
    defects = [(r.kind, r.mutation, r.detail) for r in results if r.outcome in fuzz_files.DEFECTS]
    assert not defects


@pytest.mark.slow
def test_a_bounded_fuzz_run_finds_no_defect(good):
    results = run(fuzz_files.cases(BOUNDED, 1, good), good)
    outcomes = {r.outcome for r in results}
    assert not outcomes & set(fuzz_files.DEFECTS), fuzz_files.summary(results, 0)
    assert {"refused", "same"} <= outcomes and len(results) == BOUNDED
