"""How a command-line driver ends: cleanly on every rank, or the whole job.

spar_comm's own errors are raised on every rank alike, so each rank can exit
with status 2 after rank 0 prints the message once. Any other exception may
be on one rank only, with the others waiting in a collective: that rank
prints its traceback and aborts the whole job.
"""
from __future__ import annotations

import sys
import time
import traceback
from typing import Callable

from mpi4py import MPI

from .errors import SparCommError

# MPICH's launcher may act on an abort before it has forwarded the aborting
# rank's last lines of stderr, and drop them: 7 of 30 jobs lost the traceback.
# A pause between the flush and the abort lets the output leave first.
OUTPUT_GRACE_S = 0.2


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
    abort every rank of ``comm``: the others may be waiting in a collective."""
    text = f"{where} failed:\n{traceback.format_exc()}"
    sys.stderr.write("".join(f"[rank {comm.rank}] {line}\n" for line in text.splitlines()))
    sys.stderr.flush()
    time.sleep(OUTPUT_GRACE_S)
    comm.Abort(1)
