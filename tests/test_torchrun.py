"""spar_comm.torch under torchrun, no MPI launch: over torch.distributed's
group once it is initialised (every allreducer against the serial reference,
and a DDP step); before that, or told to use MPI, where every process's MPI
world is a world of one, each way in refuses with ConfigError on every rank,
naming both worlds, before a gradient is touched. Each launch has a hard time
limit and leaves no process behind."""
from __future__ import annotations

import time
from pathlib import Path

import pytest

from conftest import ROOT, torchrun
from spar_comm import waiting

torch = pytest.importorskip("torch")
SCRIPT = ROOT / "tests" / "torchrun_worlds.py"
CALLS = ["rank", "size", "local_device", "init_process_group", "broadcast_parameters", "broadcast_optimizer_state",
         "DistributedOptimizer", "comm_hook"]


def lines_of(ranks: int, *args: str, script: Path = SCRIPT, limit: float = 90) -> dict:
    """The script's lines under ``torchrun --nproc-per-node ranks``, by rank
    and call (a line of no call is the rank's ``summary``)."""
    run, _ = torchrun(ranks, script, *args, limit=limit)
    output = run.stdout
    # The workers' own words come first in stderr, torchrun's report of them last.
    assert run.returncode == 0, output[-2000:] + run.stderr[:3000] + "\n...\n" + run.stderr[-1500:]
    lines: dict = {}
    for line in output.splitlines():
        if line.startswith("rank "):
            rank, _, rest = line.partition(": ")
            name, _, outcome = rest.partition(": ") if ": " in rest else ("summary", "", rest)
            lines[(int(rank.split()[1]), name)] = outcome
    return lines


@pytest.mark.slow
def test_without_torch_distributed_every_way_in_refuses_mpis_world_of_one_on_every_rank():
    """... but init_process_group, which starts torch.distributed from torchrun's environment."""
    lines = lines_of(2)
    for rank in range(2):
        assert lines.get((rank, "init_process_group")) == "ran", lines
        for call in [c for c in CALLS if c != "init_process_group"] + ["comm_hook over MPI"]:
            outcome = lines.get((rank, call), "(no line)")
            assert outcome.startswith("ConfigError: spar_comm.torch."), (rank, call, outcome)
            assert "MPI's world of 1 rank, but this torch job has 2 (WORLD_SIZE=2, as torchrun sets it)" in outcome
            assert "mpiexec -n 2" in outcome, outcome
        assert (rank, "gradient") not in lines  # no DDP step ran on a hook over a world of one


@pytest.mark.slow
def test_with_torch_distributed_every_way_in_works_over_its_group():
    """The hook and the optimizer over the gloo group, no MPI launch: after
    rank 0's weights were broadcast, one DDP step leaves every rank the mean
    gradient (inputs 1 and 2 on six weights: 6 * 1.5). Forcing MPI instead
    is refused, naming both worlds."""
    lines = lines_of(2, "--init")
    for rank in range(2):
        assert lines.get((rank, "rank")) == f"ran {rank}" and lines.get((rank, "size")) == "ran 2", lines
        assert lines.get((rank, "init_process_group")) == "ConfigError: torch.distributed is already initialised"
        for call in ("local_device", "broadcast_parameters", "broadcast_optimizer_state", "DistributedOptimizer",
                     "comm_hook"):
            assert lines.get((rank, call)) == "ran", (rank, call, lines.get((rank, call)))
        refused = lines.get((rank, "comm_hook over MPI"), "(no line)")
        assert "MPI's world of 1 rank, but this torch job has 2 (torch.distributed's default group)" in refused
        assert lines.get((rank, "gradient")) == repr(9.0), lines


@pytest.mark.slow
def test_a_torchrun_job_of_one_rank_is_its_own_world():
    lines = lines_of(1, "--init")
    expected = {call: "ran" for call in CALLS + ["comm_hook over MPI"]}
    expected.update(rank="ran 0", size="ran 1", init_process_group="ConfigError: torch.distributed is already initialised")
    assert {call: lines.get((0, call)) for call in expected} == expected
    # one rank's mean is its own gradient: the input 1.0, six weights
    assert lines.get((0, "gradient")) == repr(6.0), lines


@pytest.mark.slow
@pytest.mark.parametrize("ranks", [2, 3, 4])
def test_every_allreducer_over_a_gloo_group_matches_the_serial_reference(ranks):
    """tests/torchrun_allreducers.py: every reproducible algorithm, with and
    without codecs, on every emulated node layout, to the last bit."""
    lines = lines_of(ranks, script=ROOT / "tests" / "torchrun_allreducers.py", limit=150)
    for rank in range(ranks):
        cases = lines.get((rank, "summary"), "(no line)")
        assert cases.endswith(" cases, 0 failed") and not cases.startswith("0 "), (rank, cases, lines)


@pytest.mark.slow
def test_the_ddp_example_trains_under_torchrun_with_identical_replicas():
    """drivers/train_ddp.py, launched as PyTorch users launch: no mpiexec."""
    run, _ = torchrun(2, ROOT / "drivers" / "train_ddp.py", "--epochs", "2", limit=120)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    assert "world size 2" in run.stdout and "parameters identical on all 2 ranks" in run.stdout, run.stdout


@pytest.mark.slow
@pytest.mark.parametrize("ranks", [2, 3])
def test_ddp_over_a_gloo_group_is_exact_conserves_and_survives_a_nan(ranks):
    """tests/torchrun_ddp.py: the mean with dense, the same bits on every rank
    and conservation with hitopk, a NaN on one rank a NaN bucket on every
    rank, the hook's state through a save and load, and an overflow under
    GradScaler skipped on every rank with its scale halved."""
    lines = lines_of(ranks, script=ROOT / "tests" / "torchrun_ddp.py", limit=120)
    assert [lines.get((rank, "summary")) for rank in range(ranks)] == ["0 failed"] * ranks, lines


@pytest.fixture(scope="module")
def hsdp_checkpoint(tmp_path_factory) -> Path:
    """The directory the HSDP launches share: the first (2x2) saves, the later ones resume."""
    return tmp_path_factory.mktemp("hsdp_checkpoint")


@pytest.mark.slow
@pytest.mark.parametrize("nodes, per_node", [(2, 2), (2, 3), (3, 2)])
def test_hsdp_with_the_hook_is_torchs_hsdp_conserves_and_refuses_a_wrong_mesh(nodes, per_node, hsdp_checkpoint):
    """tests/torchrun_fsdp.py on emulated nodes: FSDP2 sharded inside each
    node, reduced between nodes by hsdp_hook. ``dense`` ends on torch's own
    HSDP (2-D mesh) with force-sum, accumulation and mixed precision;
    ``topka``, ``gtopk``, int8 values and ``auto`` (dense for a small module,
    topka for a large one) conserve per shard with a shard's residual and the
    same shards on every replica; an Inf is NaN
    everywhere with the residuals kept; a save resumes to the bit; a wrong
    mesh and the algorithms that do not apply are refused alike. The 2x2
    launch saves into ``hsdp_checkpoint``; 3x2 resumes there with each
    shard's residual total kept, and 2x3 is refused (nodes of another size)."""
    ranks = nodes * per_node
    run, left = torchrun(ranks, ROOT / "tests" / "torchrun_fsdp.py",
                         env={"SPAR_COMM_RANKS_PER_NODE": str(per_node),
                              "SPAR_COMM_TEST_HSDP_CHECKPOINT": str(hsdp_checkpoint)}, limit=150)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    summaries = [line.partition(": ")[2] for line in run.stdout.splitlines() if line.startswith("rank ")
                 and line.endswith(" failed")]
    assert summaries == ["0 failed"] * ranks, run.stdout[-4000:]
    assert f"mesh ({nodes}, {per_node})" in run.stdout and left == 0


@pytest.mark.slow
def test_the_fsdp_example_trains_hsdp_under_torchrun_with_identical_replicas():
    """drivers/train_fsdp.py on 2 emulated nodes of 2: the world and nodes, a
    validation loss, and every replica's shards those of the first node."""
    run, left = torchrun(4, ROOT / "drivers" / "train_fsdp.py", "--steps", "10",
                         env={"SPAR_COMM_RANKS_PER_NODE": "2"}, limit=120)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    lines = run.stdout.splitlines()
    assert lines[0].startswith("world 4: 2 nodes of 2 ranks [[0, 1], [2, 3]]; between nodes: topka"), lines
    assert any(line.startswith("validation loss ") for line in lines), lines
    assert lines[-1] == "parameters identical on all 4 ranks" and left == 0, lines


@pytest.mark.slow
@pytest.mark.parametrize("ranks", [2, 4])
def test_the_state_round_trips_through_torch_distributed_checkpoint_rank_by_rank(ranks):
    """tests/torchrun_state.py: the optimizer's and the hook's state saved and
    loaded with torch.distributed.checkpoint, each rank's residuals (different
    on every rank) under their own keys in their own file, back to the bit on
    their rank; resumed runs reach the bits of the run that never stopped (the
    optimizer) and conserve the gradients (the hook); a template without the
    wrapped optimizer's momentum is refused."""
    lines = lines_of(ranks, script=ROOT / "tests" / "torchrun_state.py", limit=150)
    assert [lines.get((rank, "summary")) for rank in range(ranks)] == ["0 failed"] * ranks, lines


@pytest.mark.alone  # it times a deadline
@pytest.mark.slow
@pytest.mark.parametrize("way", ["hook", "optimizer", "checkpoint"])
def test_a_peer_that_stops_answering_ends_a_torchrun_job_at_the_deadline(way):
    """tests/torchrun_stall.py: rank 0 hangs at step 3; rank 1 warns half-way,
    then ends by its deadline naming the collective and its own rank, with
    the deadline's exit status; torchrun ends the hung rank, and nothing is
    left behind."""
    timeout = 4
    run, left = torchrun(2, ROOT / "tests" / "torchrun_stall.py", "--way", way,
                         env={waiting.ENV_TIMEOUT: str(timeout)})
    ended = time.time()
    hung = [float(line.split()[-1]) for line in run.stdout.splitlines() if line.startswith("rank 0: hangs at ")]
    assert run.returncode != 0 and len(hung) == 1, run.stdout[-2000:] + run.stderr[-2000:]
    assert "finished" not in run.stdout
    assert f"exitcode  : {waiting.EXIT_TIMEOUT} " in run.stderr, run.stderr[-3000:]
    assert "[rank 1] spar_comm: still waiting, half-way to the deadline: " in run.stderr, run.stderr[-3000:]
    expected = f"[rank 1] spar_comm: no answer past the deadline (SPAR_COMM_TIMEOUT={timeout}): "
    line = next((text for text in run.stderr.splitlines() if text.startswith(expected)), "")
    assert " over " in line and f"ending the job with status {waiting.EXIT_TIMEOUT}" in line, run.stderr[-3000:]
    print(f"{way}: {line}; torchrun ended {ended - hung[0]:.1f} s after rank 0 hung")
    assert ended - hung[0] < timeout + 8, f"the job ended {ended - hung[0]:.1f} s after rank 0 hung"
    assert left == 0, f"{left} processes left"


@pytest.fixture(scope="module")
def saved_on(tmp_path_factory):
    """The checkpoint tests/torchrun_resume.py saves on a world of ``ranks``,
    saved once for every load of it (loads only read it)."""
    saves = {}

    def save(ranks: int) -> str:
        if ranks not in saves:
            directory = str(tmp_path_factory.mktemp(f"saved_on_{ranks}") / "checkpoint")
            lines = lines_of(ranks, "save", directory, script=ROOT / "tests" / "torchrun_resume.py", limit=120)
            assert [lines.get((rank, "summary")) for rank in range(ranks)] == ["0 failed"] * ranks, lines
            saves[ranks] = directory
        return saves[ranks]

    return save


@pytest.mark.slow
@pytest.mark.parametrize("saved, loaded", [(2, 1), (2, 4), (4, 2)])
def test_the_state_resumes_on_another_world_with_the_residuals_total_kept(saved_on, saved, loaded):
    """tests/torchrun_resume.py: the optimizer's and the hook's state saved by
    save_checkpoint on one world, loaded by load_checkpoint on another: the
    parameters to the bit, the new ranks' residuals summed equal to the saved
    ranks' summed in rank order (from NumPy files written beside the save),
    each position on one new rank; a plain dcp.load on the new world is
    refused by spar_comm, naming load_checkpoint."""
    directory = saved_on(saved)
    lines = lines_of(loaded, "load", directory, script=ROOT / "tests" / "torchrun_resume.py", limit=120)
    assert [lines.get((rank, "summary")) for rank in range(loaded)] == ["0 failed"] * loaded, lines
