"""The passes over memory one allreduce call makes, as a benchmark mode
counts them and the table in docs/design.md (Allreducers, "Passes over
memory") states them: the reads and writes of every full-length pass at the
kernels' entry points (``spar_comm.kernels.passes``), in vectors of the
gradient's length, the most any rank made."""
from __future__ import annotations

from typing import Any, Dict

import numpy as np
from mpi4py import MPI

from ..kernels import passes


def counted_call(reducer: Any, grad: Any, out: Any) -> Dict[str, Any]:
    """``reducer.allreduce(grad, out=out)`` once, counting its passes: how many,
    their reads and their writes, each the largest over ranks (collective)."""
    with passes.counting() as books:
        reducer.allreduce(grad, out=out)
    mine = passes.totals(books, reducer.size)
    most = np.empty(3)
    reducer.topology.world.Allreduce(np.array([mine["passes"], mine["reads"], mine["writes"]], float), most,
                                     op=MPI.MAX)
    return {"passes": int(most[0]), "reads": float(most[1]), "writes": float(most[2])}
