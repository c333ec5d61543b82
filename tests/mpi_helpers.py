"""Assertions that every rank takes alike, so a failure never strands a rank
inside the next collective."""
from __future__ import annotations

import hashlib
from typing import Any, Callable, Iterator, List, Sequence

import numpy as np
from mpi4py import MPI

from spar_comm import waiting


def assert_all(comm: MPI.Comm, ok: bool, message: str = "") -> None:
    """Fail on every rank when the check failed on any rank."""
    verdicts = comm.allgather((bool(ok), message))
    failed = [f"rank {r}: {m}" for r, (good, m) in enumerate(verdicts) if not good]
    assert not failed, "; ".join(failed)


def computed_on_rank_0(comm: MPI.Comm, compute: Callable[[], Sequence[Any]]) -> Any:
    """``compute()`` on rank 0 alone, which gives one item per rank; each rank
    gets its own. The others wait asleep (spar_comm's waits), so that a
    serial reference on cores shared by every rank runs at a whole core's
    speed. An exception on rank 0 is raised on every rank."""
    items: Any = None
    if comm.rank == 0:
        try:
            items = list(compute())
        except Exception as error:  # every rank raises it: none is left in the scatter
            items = [error] * comm.size
    waiting.collective(comm, "Barrier")
    item = comm.scatter(items)
    if isinstance(item, Exception):
        raise item
    return item


def assert_identical_bits(comm: MPI.Comm, array: np.ndarray, what: str) -> None:
    digest = hashlib.sha256(np.ascontiguousarray(array).tobytes()).hexdigest()
    digests = comm.allgather(digest)
    assert len(set(digests)) == 1, f"{what} differs between ranks: {digests}"


#: The world sizes an MPI test runs at, by what it checks (``@pytest.mark.worlds``;
#: docs/testing.md, "Which world sizes a test runs at"). Every size must be one
#: of tests/run_mpi.py's launches.
#:
#: Bit identity against the serial reference: every layout of every launch.
REFERENCE_WORLDS = (1, 2, 3, 4, 6)
#: A test on the ``topology`` fixture's layouts (the default for one): 3 ranks
#: as three one-rank nodes, as unequal nodes (2+1) and as one node; 4 ranks as
#: 4x1, 2x2, unequal nodes (3+1) and one node.
LAYOUT_WORLDS = (3, 4)
#: Any other MPI test (the default): a first, a middle and a last rank, on the
#: launch's emulated nodes of 2 (2+1).
RANK_WORLDS = (3,)


def layout_name(p: int, ranks_per_node: int) -> str:
    """``2x2`` for 2 nodes of 2, ``3+1`` for unequal ones: how the docs name a layout."""
    nodes = [ranks_per_node] * (p // ranks_per_node) + ([p % ranks_per_node] if p % ranks_per_node else [])
    return f"{len(nodes)}x{ranks_per_node}" if len(set(nodes)) == 1 else "+".join(map(str, nodes))


def layouts(p: int) -> Iterator[int]:
    """Emulated node sizes worth testing at world size p: single-rank nodes,
    nodes of 2 and 3 (unequal when they do not divide p), and one node."""
    seen: List[int] = []
    for rpn in (1, 2, 3, 4, p):
        if rpn <= p and rpn not in seen:
            seen.append(rpn)
            yield rpn

