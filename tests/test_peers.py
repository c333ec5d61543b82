"""The two real workloads (spar_comm.workloads, trained by drivers/train_gpt.py
and drivers/train_cnn.py) and drivers/bench_peers.py in smoke sizes, under
mpiexec -n 2 (bench_peers' modes over torch also under torchrun) with a
hard limit; bench_peers' modes (spar_comm.bench.peers)."""
from __future__ import annotations

import json
import math
import re

import numpy as np
import pytest

from conftest import ROOT, torchrun

torch = pytest.importorskip("torch")
from spar_comm.bench import peers  # noqa: E402
from spar_comm.bench.timing import rotated  # noqa: E402


def figures(stdout: str, name: str) -> list:
    return [float(m) for m in re.findall(rf"{name} (\S+)\n", stdout)]


@pytest.mark.slow
def test_the_gpt_learns_the_standard_library_on_two_ranks(run_driver):
    run = run_driver("train_gpt.py", "--tiny", "--steps", "40", "--eval-every", "20", "--density", "0.1",
                     "--lr", "3e-3", ranks=2, timeout=180)
    assert run.returncode == 0, run.stderr
    losses = figures(run.stdout, "validation loss")
    assert len(losses) == 2, run.stdout  # rank 0 alone prints
    assert all(math.isfinite(v) for v in losses) and losses[1] < losses[0] < math.log(256) + 0.5, losses


@pytest.mark.slow
def test_the_cnn_learns_the_digits_on_two_ranks(run_driver):
    run = run_driver("train_cnn.py", "--width", "8", "--steps", "60", "--eval-every", "60", "--density", "0.1",
                     ranks=2, timeout=180)
    assert run.returncode == 0, run.stderr
    accuracy = figures(run.stdout, "held-out accuracy")
    assert len(accuracy) == 1 and accuracy[0] > 0.3, run.stdout  # ten classes: chance is 0.1


@pytest.mark.slow  # each case runs a driver
@pytest.mark.parametrize("script, bad", [
    ("train_gpt.py", ["--density", "2"]),
    ("train_gpt.py", ["--tiny", "--heads", "3"]),
    ("train_cnn.py", ["--algorithm", "nope"]),
    ("bench_peers.py", ["cnn", "--modes", "ddp,nope"]),
    ("bench_peers.py", ["--warmup", "2"]),  # no model named
    ("bench_peers.py", ["mlp", "--eval-every", "5"]),  # random data: nothing held out
    ("bench_peers.py", ["cnn", "--targets", "0.9"]),  # targets but no evaluations
    ("bench_peers.py", ["mlp", "--malloc", "jemalloc"]),
])
def test_bad_arguments_exit_2_with_a_usage_message(script, bad, run_driver):
    run = run_driver(script, *bad)
    assert run.returncode == 2 and "error:" in run.stderr and "Traceback" not in run.stderr, run.stderr


@pytest.mark.slow
def test_under_torchrun_a_mode_that_needs_mpi_exits_2_naming_the_ones_that_run(run_driver):
    run = run_driver("bench_peers.py", "mlp", "--modes", "spar_hitopk,no_comm", env={"WORLD_SIZE": "2"})
    assert run.returncode == 2 and "Traceback" not in run.stderr, run.stderr
    assert "--modes spar_hitopk: under torchrun only spar_dense_torch," in run.stderr, run.stderr


@pytest.mark.slow
def test_bench_peers_runs_its_modes_over_torch_under_torchrun(tmp_path):
    """No MPI launch: the modes over torch.distributed's group on 2 emulated
    nodes of 1, the same bytes as over MPI (tests/test_peers' other run)."""
    out = tmp_path / "peers.json"
    run, left = torchrun(2, ROOT / "drivers" / "bench_peers.py", "mlp", "--hidden", "64", "--layers", "1",
                         "--ranks-per-node", "1", "--warmup", "1", "--repeat", "2", "--out", str(out), limit=180)
    assert run.returncode == 0 and left == 0, run.stdout[-2000:] + run.stderr[-2000:]
    document = json.loads(out.read_text())
    results = {r["mode"]: r for r in document["results"]}
    assert list(results) == list(peers.UNDER_TORCHRUN) and document["world_size"] == 2
    assert all(r["status"] == "ok" and r["step_ms"] > 0 for r in results.values()), results
    parameters = document["parameters"]
    assert results["spar_dense_torch"]["bytes_inter"] == 4 * parameters  # 2 nodes of 1: the vector once
    assert 0 < results["spar_hitopk_torch"]["bytes_inter"] < parameters / 10
    assert "between nodes over torch.distributed" in results["spar_auto_torch"]["note"]


@pytest.mark.slow
def test_bench_peers_reports_every_mode_and_survives_a_failing_peer(run_driver, tmp_path):
    out, png = tmp_path / "peers.json", tmp_path / "peers.png"
    run = run_driver("bench_peers.py", "gpt", "--tiny", "--batch-size", "2", "--ranks-per-node", "1",
                     "--warmup", "2", "--repeat", "2", "--sync-every", "2", "--peer-timeout", "20",
                     "--inject-failure", "ddp_fp16",
                     "--out", out, "--plot", png, ranks=2, timeout=240)
    assert run.returncode == 0, run.stderr
    document = json.loads(out.read_text())
    results = {r["mode"]: r for r in document["results"]}
    assert list(results) == list(peers.MODES), "every mode, in order"
    failed = results["ddp_fp16"]
    assert failed["status"] == "failed" and "rank 1: RuntimeError: its process died" in failed["error"], failed
    hook = results["spar_hook"]
    assert hook["status"] == "ok", hook
    ok = {m: r for m, r in results.items() if r["status"] == "ok"}
    assert set(ok) == set(peers.MODES) - {"ddp_fp16"}, [r["error"] for r in results.values()]
    assert all(r["step_ms"] > 0 and r["ratio_to_ddp"] > 0 for r in ok.values())
    assert ok["ddp"]["ratio_to_ddp"] == 1.0 and ok["no_comm"]["bytes_inter"] == 0.0
    # Two ranks, one a node: a ring allreduce sends every float32 gradient once,
    # as spar_comm's own dense counts it.
    assert ok["ddp"]["bytes_inter"] == ok["spar_dense"]["bytes_inter"] == 4 * document["parameters"]
    assert 0 < ok["spar_hitopk"]["bytes_inter"] < ok["ddp"]["bytes_inter"] / 10
    # Half of that in float16 (chunks padded to 8 bytes), about a quarter in int8 blocks.
    assert 0 <= ok["spar_dense_float16"]["bytes_inter"] - ok["ddp"]["bytes_inter"] / 2 < 1024
    assert ok["ddp"]["bytes_inter"] / 4 < ok["spar_dense_int8"]["bytes_inter"] < ok["ddp"]["bytes_inter"] / 3.9
    assert 0 < ok["spar_hitopk_int8"]["bytes_inter"] < ok["spar_hitopk"]["bytes_inter"]
    for mode in ("spar_dense", "spar_topka", "spar_hitopk"):  # the same allreducers over the torch transport
        assert ok[f"{mode}_torch"]["bytes_inter"] == ok[mode]["bytes_inter"], mode
    assert "between nodes over torch.distributed" in ok["spar_auto_torch"]["note"], ok["spar_auto_torch"]
    assert "between nodes over MPI" in ok["spar_auto"]["note"], ok["spar_auto"]
    assert ok["spar_auto_codecs"]["note"].startswith("chose "), ok["spar_auto_codecs"]  # and the codecs it took
    phases = ok["spar_hitopk"]["phases_ms"]
    assert list(phases) == list(peers.PHASES) and phases["select"] > 0 and min(phases.values()) >= 0, phases
    assert "phases_ms" not in ok["ddp"] and "where spar_comm's communication went" in run.stdout
    assert 0 < ok["ddp_powersgd_r1"]["bytes_inter"] < ok["ddp_powersgd_r4"]["bytes_inter"] < ok["ddp"]["bytes_inter"]
    # The sharded modes, one rank a node. torch's HSDP all-reduces the whole
    # model between the two (its shards are whole), as DDP; FSDP over both
    # ranks sends half of every group two or three times (two all-gathers and
    # a reduce-scatter; the root's parameters gathered once), dim 0 padded to even.
    parameters = document["parameters"]
    assert ok["hsdp"]["bytes_inter"] == ok["ddp"]["bytes_inter"] and ok["fsdp_per_node"]["bytes_inter"] == 0
    assert 4 * parameters <= ok["fsdp"]["bytes_inter"] <= 6 * 1.01 * parameters, ok["fsdp"]
    assert 0 < ok["hsdp_spar_topka_int8"]["bytes_inter"] < ok["hsdp_spar_topka"]["bytes_inter"] < parameters / 10
    assert ok["hsdp_spar_topka"]["note"] == f"residual {parameters:,} elements a rank, its shard {parameters:,}"
    # The local-step modes synchronise in one of the two timed rounds: half
    # of the dense sum's bytes a step for DiLoCo, less in int8 and sparse.
    assert ok["diloco"]["bytes_inter"] == ok["spar_dense"]["bytes_inter"] / 2
    assert 0 < ok["local_hitopk_int8"]["bytes_inter"] < ok["local_hitopk"]["bytes_inter"] < ok["diloco_int8"]["bytes_inter"]
    assert "Nesterov, lr 0.7" in ok["diloco"]["note"] and "error feedback alone" in ok["local_hitopk"]["note"]
    # Overlapped, the timed round counts the reduction that finished in it (the warm-up's): the same size.
    assert ok["diloco_int8_overlap"]["bytes_inter"] == ok["diloco_int8"]["bytes_inter"]
    assert 0 < ok["local_hitopk_int8_overlap"]["bytes_inter"] and "inner steps late" in ok["local_hitopk_int8_overlap"]["note"]
    assert "failed" in run.stdout and "spar_hitopk" in run.stdout and png.stat().st_size > 0


def test_each_round_starts_one_mode_later():
    orders = [rotated(3, i) for i in range(4)]
    assert orders == [[0, 1, 2], [1, 2, 0], [2, 0, 1], [0, 1, 2]]


def test_time_to_target_is_the_first_evaluation_that_reaches_it():
    elapsed = np.cumsum([0.5, 0.25, 0.25, 1.0, 2.0, 0.5])
    lower = peers.Workload(None, None, None, None, metric_name="validation loss", lower_is_better=True)
    found = peers.learning_curve([(2, 3.0), (4, 2.4), (6, 2.5)], elapsed, lower, [2.5, 2.4, 2.0])
    assert found["curve"] == [[2, 0.75, 3.0], [4, 2.0, 2.4], [6, 4.5, 2.5]] and found["final_metric"] == 2.5
    assert found["to_target"] == [dict(target=2.5, steps=4, seconds=2.0), dict(target=2.4, steps=4, seconds=2.0),
                                  dict(target=2.0, steps=None, seconds=None)]
    higher = peers.Workload(None, None, None, None, metric_name="held-out accuracy")
    found = peers.learning_curve([(3, 0.8), (6, 0.9)], elapsed, higher, [0.8, 0.9, 0.95])
    assert [t["steps"] for t in found["to_target"]] == [3, 6, None]


@pytest.mark.slow
def test_bench_peers_times_every_mode_to_its_targets(run_driver, tmp_path):
    out, png = tmp_path / "tta.json", tmp_path / "tta.png"
    targets = [0.12, 0.15]
    run = run_driver("bench_peers.py", "cnn", "--width", "4", "--image", "8", "--batch-size", "16",
                     "--ranks-per-node", "1", "--modes", "ddp,ddp_powersgd_r1,spar_hitopk,spar_hitopk_spin,no_comm",
                     "--density", "0.1", "--selector", "threshold", "--dense-below", "20",
                     "--warmup", "2", "--repeat", "10", "--eval-every", "4",
                     "--targets", ",".join(map(str, targets)), "--peer-timeout", "30", "--out", out, "--plot", png,
                     ranks=2, timeout=240)
    assert run.returncode == 0, run.stderr
    document = json.loads(out.read_text())
    results = {r["mode"]: r for r in document["results"]}
    assert all(r["status"] == "ok" for r in results.values()), [r["error"] for r in results.values()]
    assert document["settings"]["selector"] == "threshold" and document["settings"]["dense_below"] == 20
    assert "spar_comm: threshold at density 0.1, parameters below 20 dense" in run.stdout
    ddp = results["ddp"]
    for mode, r in results.items():
        assert r["metric"] == "held-out accuracy" and [p[0] for p in r["curve"]] == [4, 8, 12], r
        seconds = [p[1] for p in r["curve"]]
        assert 0 < seconds[0] < seconds[1] < seconds[2], r  # training time only grows
        assert all(0 <= p[2] <= 1 for p in r["curve"]) and r["final_metric"] == r["curve"][-1][2]
        for target, reached, ddps in zip(targets, r["to_target"], ddp["to_target"], strict=True):
            first = next(([p[0], p[1]] for p in r["curve"] if p[2] >= target), [None, None])
            assert [reached["target"], reached["steps"], reached["seconds"]] == [target, *first], r
            if reached["seconds"] is not None and ddps["seconds"]:
                assert reached["ratio_to_ddp"] == reached["seconds"] / ddps["seconds"]
    # How a rank waits changes no bit: the same accuracy at every evaluation.
    assert [p[2] for p in results["spar_hitopk_spin"]["curve"]] == [p[2] for p in results["spar_hitopk"]["curve"]]
    assert "time to target" in run.stdout and "to 0.15" in run.stdout and png.stat().st_size > 0


def test_a_spinning_mode_spins_for_its_own_steps_only(monkeypatch):
    monkeypatch.setattr(peers.waiting, "SLEEP", True)
    seen = []

    class Optimizer:
        def zero_grad(self):
            pass

        def step(self):
            seen.append(peers.waiting.SLEEP)

    class Loss:
        def backward(self):
            pass

    for spin in (True, False):
        peers.Runner(None, Optimizer(), lambda: 0.0, spin=spin).step(None, lambda model, batch: Loss())
        assert peers.waiting.SLEEP is True
    assert seen == [False, True]
    assert "spar_hitopk_spin" in peers.SPINNING  # hitopk in all else
    assert peers.SPAR["spar_hitopk_spin"] == peers.SPAR["spar_hitopk"]
