"""The cost model: physical soundness (property tests), MPICH schedules, the
fit recovering a known machine, and calibration inputs it must refuse."""
from __future__ import annotations

import dataclasses
import json
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from spar_comm import ALGORITHMS, selection_size
from spar_comm.collectives.checks import CODECS
from spar_comm.costmodel import (CPU, GPU, CalibrationError, Cluster, Machine, Measurement, fastest, fit,
                                 gbps_to_beta, load, predict, relative_errors, step_terms)
from spar_comm.costmodel import auto, mpi, peers, probe

clusters = st.builds(Cluster, st.integers(1, 512), st.integers(1, 16))
sizes = st.integers(1, 2_000_000_000)
densities = st.floats(1e-5, 1.0)
selectors = st.sampled_from(sorted(GPU.select))
bandwidths = st.floats(0.1, 10_000)


def test_every_algorithm_is_modelled():
    assert list(predict(Cluster(2, 2), 1000, GPU)) == list(ALGORITHMS)


@pytest.mark.parametrize("cluster, beta", [(Cluster(1, 2), "beta_intra"), (Cluster(2, 1), "beta_inter")])
def test_two_rank_dense_is_near_the_ring_bound(cluster, beta):
    n = 100_000_000 * 4  # bytes
    bandwidth_bound = 2 * (2 - 1) / 2 * n * getattr(GPU, beta)
    seconds = predict(cluster, n // 4, GPU, algorithms=["dense"])["dense"]
    # above the bound, and within a small factor: latency and memory passes (copy, sum, average) on top
    assert bandwidth_bound <= seconds <= 3 * bandwidth_bound


@settings(max_examples=60, deadline=None)
@given(clusters, sizes, densities, selectors, bandwidths, bandwidths, st.floats(1.01, 100))
def test_more_bandwidth_is_never_slower(cluster, size, density, selector, inter, intra, factor):
    slow = predict(cluster, size, GPU.with_links(inter, intra), density=density, selector=selector)
    for faster in (GPU.with_links(inter * factor, intra), GPU.with_links(inter, intra * factor)):
        fast = predict(cluster, size, faster, density=density, selector=selector)
        assert all(fast[name] <= slow[name] * (1 + 1e-12) for name in slow)


@settings(max_examples=60, deadline=None)
@given(clusters, sizes, densities, selectors, st.sampled_from(["float32", "float64"]))
def test_predictions_are_positive_and_finite(cluster, size, density, selector, dtype):
    for machine in (GPU, CPU):
        times = predict(cluster, size, machine, dtype, density, selector)
        assert all(0 < t < math.inf for t in times.values()), times


@settings(max_examples=40, deadline=None)
@given(clusters, st.integers(50_000_000, 500_000_000))
def test_twice_the_size_about_doubles_dense_time(cluster, size):
    one = predict(cluster, size, GPU, algorithms=["dense"])["dense"]
    two = predict(cluster, 2 * size, GPU, algorithms=["dense"])["dense"]
    assert 1.8 <= two / one <= 2.0 + 1e-9


def test_node_link_is_shared_by_the_ranks_of_a_node():
    # world allreduce at 8 ranks per node: the steps across nodes carry 8 flows
    terms = mpi.allreduce(mpi.Span(nodes=4, per_node=8), 8 << 20)
    per_rank_inter_bytes = 2 * (8 << 20) / 8 * (1 - 1 / 4)  # halving steps at distance >= 8
    assert terms["beta_inter"] == pytest.approx(8 * per_rank_inter_bytes)


def test_mpich_thresholds_pick_latency_or_bandwidth_schedules():
    span = mpi.Span(nodes=1, per_node=16)
    assert mpi.allgather(span, 8)["alpha_intra"] == 4  # recursive doubling
    assert mpi.allgather(span, 1 << 20)["alpha_intra"] == 15  # ring
    assert mpi.allreduce(span, 1024)["alpha_intra"] == 4
    assert mpi.allreduce(span, 1 << 20)["alpha_intra"] == 8  # Rabenseifner: halving + doubling
    assert mpi.bcast(span, 1 << 20)["alpha_intra"] == 4 + 15  # scatter + ring allgather


def test_small_buckets_stay_dense_and_large_go_sparse():
    cluster, machine = Cluster(16, 8), GPU.with_links(25, 1200)
    small = predict(cluster, 10_000, machine)
    large = predict(cluster, 100_000_000, machine)
    assert fastest(small) in ("dense", "hier_dense")  # of those that sum: adasum and powersgd are priced only
    assert fastest(large) not in ("dense", "hier_dense")


def synthetic_rows(machine: Machine, sizes_):
    rows = []
    for cluster in (Cluster(2, 2), Cluster(1, 4), Cluster(4, 1)):
        for algorithm in ALGORITHMS:
            for size in sizes_:
                row = Measurement(cluster, algorithm, size, "float32", 0.001, "mstopk", 1.0, 0.0)
                terms = row.terms()
                select = {t: a for t, a in terms.items() if t.startswith("select")}
                rows.append(Measurement(cluster, algorithm, size, "float32", 0.001, "mstopk",
                                        machine.seconds(terms), machine.seconds(select)))
    return rows


def test_fit_recovers_a_known_machine_on_sizes_it_did_not_see():
    truth = CPU.replace(alpha_intra=5e-6, alpha_inter=40e-6, beta_inter=gbps_to_beta(10), gamma=3e-10)
    fitted = fit(synthetic_rows(truth, [2**16, 2**18, 2**20, 2**22]), base=GPU)
    errors = [e for *_, e in relative_errors(fitted, synthetic_rows(truth, [2**17, 2**21, 2**23]))]
    assert max(errors) < 0.02


def test_selection_rates_in_context_leave_out_what_holds_more_than_selection():
    """hitopk on a node of several ranks books the node's sum as selection (the
    candidate pass rides on it), gtopk its merges: neither prices selection."""
    from spar_comm.costmodel.calibrate import in_context_rates

    rows = synthetic_rows(CPU.replace(gamma=3e-10), [2**16, 2**20, 2**22])
    slowed = [dataclasses.replace(row, select_seconds=row.select_seconds * 5) for row in rows
              if row.algorithm == "gtopk" or (row.algorithm == "hitopk" and row.cluster.ranks_per_node > 1)]
    assert slowed and in_context_rates(rows + slowed) == in_context_rates(rows)


def test_load_reads_bench_topk_and_a_saved_calibration(tmp_path):
    topk = {"machine": {}, "records": [
        {"method": "mstopk", "n": n, "median_s": 1e-4 + 2e-9 * n} for n in (2**16, 2**20, 2**22)]}
    (tmp_path / "topk.json").write_text(json.dumps(topk))
    machine = load([str(tmp_path / "topk.json")], base=CPU)
    assert machine.select["mstopk"] == pytest.approx((1e-4, 2e-9), rel=1e-6)
    (tmp_path / "cal.json").write_text(json.dumps({"tool": "spar_comm.costmodel", "machine": GPU.to_dict()}))
    assert load([str(tmp_path / "cal.json")]) == GPU


@pytest.mark.parametrize("content, words", [
    (None, "cannot read"),
    ("{not json", "not JSON, or cut short"),
    ("[1, 2]", "neither bench_comm.py nor bench_topk.py"),
    ('{"meta": {}, "results": []}', "malformed bench_comm"),
    ('{"machine": {}, "records": [{"method": "argpartition", "n": 1, "median_s": 1}]}', "no records of a known"),
    ('{"tool": "spar_comm.costmodel", "machine": {"gamma": 1}}', "malformed calibration"),
])
def test_bad_calibration_inputs_are_refused(tmp_path, content, words):
    path = tmp_path / "input.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(CalibrationError, match=words.replace("(", r"\(").replace(".", r"\.")):
        load([str(path)])


def test_step_terms_follow_the_bytes_of_the_implementation():
    # topka at 2 ranks on 2 nodes: 41 pairs of float32 are 168 + 168 bytes, sent once
    terms = step_terms("topka", Cluster(2, 1), 4099, density=0.01)
    assert terms["beta_inter"] == 336 + 4  # the pairs, and the gradient check's 4 bytes


def test_codecs_price_the_bytes_bench_comm_measured():
    """docs/results/codecs.md: topka at 4 ranks as 2 x 2, 2^20, density 0.001 sent
    25,200 bytes a rank between nodes as summed and 9,624 with int8 values and
    automatic indices: three records of 8,400 and of 3,208 bytes."""
    from spar_comm.costmodel.algorithms import Shape

    plain, coded = (Shape(Cluster(2, 2), 1 << 20, 4, 0.001, "exact", *codecs) for codecs in ((), ("int8", "auto")))
    assert (plain.wire(1049, 1 << 20), coded.wire(1049, 1 << 20)) == (25_200 // 3, 9_624 // 3)
    as_summed = step_terms("topka", Cluster(2, 2), 1 << 20, density=0.001)
    narrowed = step_terms("topka", Cluster(2, 2), 1 << 20, density=0.001, values="int8", indices="auto")
    assert 2.6 < as_summed["beta_inter"] / narrowed["beta_inter"] < 2.62
    assert predict(Cluster(2, 2), 1 << 20, CPU, values="int8").keys() == set(CODECS["values"])
    assert predict(Cluster(2, 2), 1 << 20, CPU, indices="auto").keys() == {"topka", "hitopk", "hitopk_leader"}


def test_a_dense_sum_through_a_codec_is_priced_by_the_bytes_bench_comm_measured():
    """tests/test_bench_comm.py: dense on 2 ranks, 4,099 values in int8 blocks,
    sent chunks of 2,088 bytes once in the Alltoall and once in the Allgather."""
    def sent(algorithm, nodes, per_node):  # less the gradient check's Allgather of 4 bytes
        terms = step_terms(algorithm, Cluster(nodes, per_node), 4099, values="int8")
        return terms["beta_inter"] - mpi.allgather(mpi.Span(nodes, per_node), 4)["beta_inter"]

    assert sent("dense", 2, 1) == 2 * 2088
    assert sent("hier_dense", 2, 2) == 2 * 2 * 1048  # a rail of 2,050 values on each of the node's two links


def test_a_real_cluster_pays_no_contention_and_no_host_network_work():
    for algorithm in ALGORITHMS:
        terms = step_terms(algorithm, Cluster(4, 2), 1 << 20)
        roomy = step_terms(algorithm, Cluster(4, 2, cores=8), 1 << 20)  # emulated, a core per rank
        assert "host_inter" not in terms and terms == {t: a for t, a in roomy.items() if t != "host_inter"}


def test_on_shared_cores_cpu_work_stretches_and_links_do_not():
    real, emulated = (step_terms("topka", Cluster(4, 2, cores=cores), 1 << 20) for cores in (None, 2))
    for term, amount in real.items():
        stretch = 1 if term in ("beta_inter",) else 4  # 8 ranks on 2 cores
        assert emulated[term] == pytest.approx(stretch * amount), term
    # topka's world Allgather by recursive doubling of k=1049 pairs (4,196 bytes of values
    # and of indices, each padded to 4,200): the steps at distance 2 and 4 cross nodes,
    # and all 8 ranks send in each; so does the check's Allgather of 4 bytes
    pairs = 2 * 4200
    crossing = 8 * (2 * pairs + 4 * pairs) + 8 * (2 * 4 + 4 * 4)
    assert emulated["host_inter"] == pytest.approx(crossing / 2)  # spread over 2 cores


@pytest.mark.parametrize("density", [0.001, 0.1])
def test_fit_on_few_hosts_predicts_many_hosts_on_the_same_cores(density):
    truth = CPU.replace(beta_inter=gbps_to_beta(1), gamma=3e-10, host_inter=2e-9, pair=2e-8)

    def rows(layouts):
        return [Measurement(Cluster(h, g, cores=2), a, n, "float32", density, "mstopk",
                            truth.seconds(step_terms(a, Cluster(h, g, cores=2), n, density=density)),
                            truth.seconds({t: v for t, v in step_terms(a, Cluster(h, g, cores=2), n,
                                                                       density=density).items()
                                           if t.startswith("select")}))
                for h, g in layouts for a in ALGORITHMS for n in (1 << 20, 1 << 22)]

    fitted = fit(rows([(2, 1), (4, 1), (2, 2), (4, 2)]), base=GPU)
    assert fitted.host_inter == pytest.approx(2e-9, rel=0.05)
    if density >= 0.1:  # at 0.001 the pairs are too few to fix their figure
        assert fitted.pair == pytest.approx(2e-8, rel=0.05)
    errors = [e for *_, e in relative_errors(fitted, rows([(8, 1), (16, 1), (8, 2)]))]
    assert max(errors) < 0.02


def test_each_pair_picked_or_scatter_added_costs_one_pair_figure():
    n, nodes, g = 6_500_000, 2, 2
    shard_k = selection_size(0.1, n // g)
    terms = step_terms("hitopk", Cluster(nodes, g), n, density=0.1, selector="threshold")
    assert terms["pair"] == shard_k + nodes * shard_k  # its picks, and every node's added on its shard
    terms = step_terms("topka", Cluster(nodes, g), n, density=0.1, selector="threshold")
    k = selection_size(0.1, n)
    assert terms["pair"] == k + nodes * g * k  # its picks, and every rank's added
    costly = CPU.replace(pair=2 * CPU.pair)
    assert costly.seconds(terms) - CPU.seconds(terms) == pytest.approx(CPU.pair * terms["pair"])


def test_a_gtopk_merge_is_priced_per_pair_and_by_an_exact_selection_over_the_union():
    """On 4 ranks the root merges twice: each merge sorts 2k indices, searches
    and adds 2k pairs, keeps k by an exact selection over 2k, and returns up
    to k to the residual (9k pairs, 10k with the exact pick). At density 0.1
    on 6.5M float32 that is near 60 ns a pair in (``GTopKAllreducer._merge``,
    measured on one core)."""
    n = 6_500_000
    k = selection_size(0.1, n)
    terms = step_terms("gtopk", Cluster(4, 1), n, density=0.1, selector="threshold")
    assert terms["pair"] == k + 2 * (9 * k + k) + k  # its picks, two merges, the result scattered
    assert terms["select:exact"] == 2 * 2 * k and terms["select_call:exact"] == 2
    merges = CPU.seconds({t: v for t, v in terms.items() if t in ("pair", "select:exact")}) - CPU.pair * 2 * k
    assert 40e-9 < merges / (2 * 2 * k) < 90e-9


def test_an_mpi_message_inside_a_node_is_copied_in_and_out():
    for inter in (False, True):
        terms = mpi.Terms()
        mpi.message(terms, mpi.Span(2, 2), 1000, inter=inter)
        assert terms["gamma"] == (0 if inter else 2000)


def test_auto_takes_the_node_collectives_at_a_high_density_and_hitopk_at_a_low_one():
    """docs/results/peers.md: the GPT's 6.5M-element bucket on 2 x 2 at 10 Gbit/s,
    density 0.1: hier_dense took 0.93x DDP's step, hitopk 1.14x, dense 1.06x;
    at density 0.001 hitopk leads (the MLP's cells)."""
    def chosen(density):
        return fastest(predict(Cluster(2, 2), 6_500_000, CPU, density=density, selector="threshold"))

    assert chosen(0.1) == "hier_dense"
    assert chosen(0.001) == "hitopk"


def test_a_calibration_written_before_host_inter_and_pair_still_loads(tmp_path):
    old = {name: value for name, value in GPU.to_dict().items() if name not in ("host_inter", "pair")}
    (tmp_path / "cal.json").write_text(json.dumps({"tool": "spar_comm.costmodel", "machine": old}))
    assert load([str(tmp_path / "cal.json")]) == GPU


def test_adasum_sends_its_shard_once_per_level_and_fold():
    n = 4096  # 4 nodes of 2 ranks: shards of 2048 float32, two levels, every rank of a node sending at once
    terms = step_terms("adasum", Cluster(4, 2), n)
    check = 8 * 2 + 8 * 4  # the gradient check's Allgather: its steps at distance 2 and 4 cross nodes
    assert terms["beta_inter"] == 2 * (2 * 2048 * 4) + check
    # 3 nodes: one level between nodes 0 and 1, and node 2's shard in and back out of node 0
    folded = step_terms("adasum", Cluster(3, 1), n)
    assert folded["beta_inter"] == 3 * n * 4 + 4 + 8


def test_adasum_is_priced_but_never_the_fastest():
    assert fastest({"adasum": 1e-6, "hier_dense": 1.0, "dense": 2.0}) == "hier_dense"
    assert fastest({"adasum": 1.0}) == "adasum"
    assert "adasum" in predict(Cluster(2, 2), 1 << 20, GPU)


@settings(max_examples=200, deadline=None)
@given(st.floats(1e-6, 0.05), st.floats(0.01, 400.0))
def test_the_link_probe_recovers_latency_and_bandwidth_of_a_linear_link(alpha, gbps):
    """A link whose round trip of n bytes takes 2 (alpha + n beta), as a long
    fat one (25 ms at 1 Gbit/s) or a LAN: both figures come back, and the
    message grew until its bytes took 20 ms one way or reached 16 MiB."""
    beta = gbps_to_beta(gbps)
    sizes = []

    def round_trip(nbytes):
        sizes.append(nbytes)
        return 2 * (alpha + nbytes * beta)

    timed_alpha, timed_beta = probe.time_link(round_trip)
    # the latency's trips carry 8 bytes, which the bandwidth then leaves out (at most 8 in 16 KiB)
    assert timed_alpha == pytest.approx(alpha + 8 * beta, rel=1e-9) and timed_beta == pytest.approx(beta, rel=1e-3)
    # the growing message's time one way less the latency's (whose trips carry 8 bytes): 20 ms reached
    # by the last size, not by the one before (to rounding: hypothesis finds sizes a hair either side)
    assert sizes[-1] == probe.LAST_BYTES or (sizes[-1] - 8) * beta >= probe.TRANSFER_SECONDS * (1 - 1e-9)
    assert sizes[-1] == probe.FIRST_BYTES or (sizes[-1] // 2 - 8) * beta < probe.TRANSFER_SECONDS * (1 + 1e-9)


@pytest.mark.parametrize("ranks, cores", [
    ([("a", [0, 1])] * 4, 2),                                  # an emulated cluster: 4 ranks on 2 cores
    ([("a", [0, 1, 2, 3])] * 4, None),                         # a core each
    ([("a", [i]) for i in range(4)], None),                    # pinned, a core each (Open MPI's binding)
    ([("a", range(16))] * 8 + [("b", range(16))] * 8, None),   # two real nodes
    ([("a", [0, 1])] * 4 + [("b", range(8))] * 2, 3),          # the crowded machine sets the stretch: 2
    ([("a", [0])] * 3, 1),
])
def test_the_cores_auto_prices_come_from_the_most_crowded_machine(ranks, cores):
    assert probe.cores_for(ranks) == cores


def test_the_cores_stretch_the_priced_cluster_as_the_crowded_machine():
    """6 ranks priced as 2 nodes of 4 (unequal nodes: 4 + 2), 3 ranks to a core."""
    ranks = [("a", [0, 1])] * 6
    assert probe.cores_for(ranks) == 2 and probe.cores_for(ranks, priced=8) == 3
    assert Cluster(2, 4, probe.cores_for(ranks, priced=8)).contention == pytest.approx(8 / 3)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from("abc"), st.sets(st.integers(0, 7), min_size=1)), min_size=1, max_size=24))
def test_cores_stretch_cpu_work_by_the_worst_ranks_per_core_within_rounding(ranks):
    per_machine = {m: [cpus for name, cpus in ranks if name == m] for m, _ in ranks}
    worst = max(len(sets) / len(set().union(*sets)) for sets in per_machine.values())
    cores = probe.cores_for(ranks)
    if worst <= 1:
        assert cores is None
    else:  # cores is round(ranks / worst)
        assert 1 <= cores <= len(ranks) and abs(len(ranks) / cores - worst) <= worst / (2 * cores) + 1e-9


# -- DDP's bytes (costmodel/peers.py), the peers bench_peers.py compares against ---------------
def test_powersgd_bytes_follow_torchs_own_rule():
    hook = pytest.importorskip("torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook")
    shapes = [(64, 3, 3, 3), (300, 20), (10, 10), (7,), (4096, 2048), (1, 5000)]
    for rank in (1, 4):
        whole = p = q = 0
        for shape in shapes:
            rows = shape[0] if len(shape) > 1 else 0
            cols = math.prod(shape) // rows if rows else 0
            if rows and hook._should_compress(rows, cols, rank, peers.MIN_COMPRESSION_RATE)[0]:
                p, q = p + rows * rank, q + cols * rank
            else:
                whole += math.prod(shape)
        assert peers.powersgd_elements(shapes, rank) == (whole, p, q)


def test_ddp_bytes_are_a_ring_allreduce_of_the_gradients_between_nodes_only():
    shapes = [(300, 20), (7,)]
    assert peers.ddp_bytes("ddp", shapes, ranks=4, nodes=1) == 0.0  # nothing leaves the node
    assert peers.ddp_bytes("ddp", shapes, ranks=4, nodes=2) == 2 * 3 / 4 * 4 * 6007
    assert peers.ddp_bytes("ddp_fp16", shapes, ranks=4, nodes=2) == 2 * 3 / 4 * 2 * 6007
    whole, p, q = peers.powersgd_elements(shapes, 1)
    assert peers.ddp_bytes("ddp_powersgd_r1", shapes, ranks=2, nodes=2) == 4 * (whole + p) + 4 * q
    assert peers.ddp_bytes("spar_hook", shapes, ranks=2, nodes=2) is None


def test_auto_values_take_int8_on_a_slow_link_and_stay_exact_on_a_fast_one():
    """docs/results/local-steps.md, the GPT on the emulated 2 x 2 (2 cores):
    hitopk at density 0.1 took 566 ms a step and with int8 values 527 at
    1 Gbit/s; on unshaped links 459 against 493."""
    def plan(gbps, algorithm):
        pricing = auto.Pricing(CPU.replace(beta_inter=gbps_to_beta(gbps)), Cluster(2, 2, 2))
        return pricing.plan(algorithm, 2_700_000, "float32", 0.1, "threshold", values="auto")

    assert plan(1, "hitopk") == ("hitopk", "int8") and plan(0.1, "auto")[1] == "int8"
    assert plan(25, "hitopk") == ("hitopk", None) and plan(25, "auto")[1] is None
    assert plan(0.1, "gtopk") == ("gtopk", None)  # a codec it cannot take is never chosen


@settings(max_examples=60, deadline=None)
@given(clusters, st.integers(1, 50_000_000), densities, bandwidths, st.sampled_from(["auto", *CODECS["values"]]))
def test_auto_values_choose_the_fastest_pair_the_allreducers_accept(cluster, size, density, gbps, algorithm):
    """Against every (algorithm, codec) the allreducers would build, priced one by one."""
    machine = CPU.replace(beta_inter=gbps_to_beta(gbps))
    chosen = auto.Pricing(machine, cluster).plan(algorithm, size, "float32", density, "threshold", values="auto")
    names = [name for name in ALGORITHMS if ALGORITHMS[name].sums] if algorithm == "auto" else [algorithm]
    times = {(name, codec): predict(cluster, size, machine, "float32", density, "threshold", [name], codec)[name]
             for codec in auto.VALUE_CHOICES for name in names if codec is None or name in CODECS["values"]}
    assert chosen in times and times[chosen] == min(times.values())
    assert times[chosen] < min(t for (name, codec), t in times.items() if codec is None) or chosen[1] is None
