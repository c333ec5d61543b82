"""How a command-line driver ends: cleanly on every rank, or the whole job.

spar_comm's own errors are raised on every rank alike, so each rank can exit
with status 2 after rank 0 prints the message once. Any other exception may
be on one rank only, with the others waiting in a collective: that rank
prints its traceback and aborts the whole job.
"""
from __future__ import annotations

import sys
import traceback
from typing import Callable

from mpi4py import MPI

from . import waiting
from .errors import SparCommError


def run_main(main: Callable[[], int | None], prog: str) -> None:
    """Run ``main`` and exit the process the way an HPC user expects."""
    try:
        code = main() or 0
    except SystemExit:
        raise
    except SparCommError as error:  # collective by construction: every rank is here
        if MPI.COMM_WORLD.rank == 0:
            print(f"{prog}: error: {error}", file=sys.stderr, flush=True)
        sys.exit(2)
    except BaseException:
        abort_job(MPI.COMM_WORLD, prog)
    sys.exit(code)


def abort_job(comm: MPI.Comm, where: str) -> None:
    """Print the exception being handled, each line prefixed with the rank, and
    abort every rank of ``comm``: the others may be waiting in a collective
    (``waiting.end_job``: the trace closed, no shared-memory file left)."""
    waiting.end_job(f"{where} failed:\n{traceback.format_exc()}", 1, comm)
