#!/usr/bin/env python
"""Data-parallel training with sparsified gradient allreduce: the command line
of ``spar_comm.training``.

    mpiexec -n 4 python drivers/train.py          # MLP on digits, hitopk + mstopk, 2 emulated nodes of 2
    mpiexec -n 4 python drivers/train.py --model mlp --dataset synthetic --hidden 4096 --steps 30
    mpirun -n 128 python drivers/train.py       # several hosts: real nodes, found by shared memory

Rank 0 alone prints: a progress bar and one summary line. Bad arguments end
every rank with status 2; an error on any rank ends the whole job non-zero.
"""
from __future__ import annotations

import os

# One BLAS thread per rank: on a CPU run the ranks fill the cores already.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import sys  # noqa: E402
import time  # noqa: E402
from typing import List, Optional  # noqa: E402

from mpi4py import MPI  # noqa: E402

from spar_comm.errors import ConfigError, SparCommError  # noqa: E402
from spar_comm.files import BadFileError  # noqa: E402
from spar_comm.launch import abort_job  # noqa: E402
from spar_comm.training import train  # noqa: E402
from spar_comm.training.command_line import config_from, make_parser  # noqa: E402

RANK = MPI.COMM_WORLD.rank


def main(argv: Optional[List[str]] = None) -> int:
    parser = make_parser()
    args = parser.parse_args(argv)
    if args.ranks_per_node is not None and args.ranks_per_node < 0:
        parser.error(f"--ranks-per-node must be >= 0, got {args.ranks_per_node}")
    config = config_from(args)
    problems = config.problems()
    if problems:
        parser.error("; ".join(problems))
    try:
        summary = train(config)
    except (ConfigError, BadFileError) as exc:  # alike on every rank, raised before any file is written
        parser.error(str(exc))
    except SparCommError as exc:  # alike on every rank: report once, no abort needed
        if RANK == 0:
            sys.stderr.write(f"train.py: {type(exc).__name__}: {exc}\n")
        return 1
    if RANK == 0:
        print(summary.line(), flush=True)
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except (Exception, KeyboardInterrupt):
        # A failure of this rank alone: the others may wait in a collective, so
        # report it and abort the whole job. Ranks other than 0 wait a moment
        # first, so a failure that every rank hit is printed once, by rank 0.
        if RANK != 0:
            time.sleep(1.0)
        abort_job(MPI.COMM_WORLD, "train.py")
