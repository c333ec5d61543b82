"""The benchmarks, so that each of drivers/ stays a command line (its flags,
a call, its printing): timing across ranks (``timing``), the JSON record
every tool writes (``record``), the passes over memory a call makes
(``passes``), and one module a benchmark's job, each taking its settings as
values: ``comm``; ``topk``, ``topk_devices``, ``cub_topk``;
``select_steps``; ``peers``, ``peer_workloads``, ``peer_runners``,
``peer_process``, ``peer_rounds``, ``peer_report``; ``overlap``;
``jax_overhead``; ``late_rank``; ``checkpoint_cost``; ``accuracy``;
``cluster_runs`` and ``cluster``; ``soak`` and ``resources``; ``gpu_plan``
and ``gpu_report``.

Nothing here is imported by ``import spar_comm``; the modules of torch's and
JAX's benchmarks import them, ``peers`` and ``topk_devices`` only where a
function uses them.
"""
