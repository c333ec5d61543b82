"""What the benchmark drivers share, so that each of drivers/ stays a command
line: timing across ranks (``timing``), the JSON record every tool writes
(``record``), the passes over memory a call makes (``passes``), and the pure parts of individual benchmarks that tests check
without running them (``accuracy``, ``cluster``, ``resources``, ``gpu_report``,
``peers``).

Nothing here is imported by ``import spar_comm``; ``peers`` needs torch only
where a function uses it.
"""
