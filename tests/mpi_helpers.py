"""Assertions that every rank takes alike, so a failure never strands a rank
inside the next collective."""
from __future__ import annotations

import hashlib
from typing import Iterator, List

import numpy as np
from mpi4py import MPI


def assert_all(comm: MPI.Comm, ok: bool, message: str = "") -> None:
    """Fail on every rank when the check failed on any rank."""
    verdicts = comm.allgather((bool(ok), message))
    failed = [f"rank {r}: {m}" for r, (good, m) in enumerate(verdicts) if not good]
    assert not failed, "; ".join(failed)


def assert_identical_bits(comm: MPI.Comm, array: np.ndarray, what: str) -> None:
    digest = hashlib.sha256(np.ascontiguousarray(array).tobytes()).hexdigest()
    digests = comm.allgather(digest)
    assert len(set(digests)) == 1, f"{what} differs between ranks: {digests}"


def layouts(p: int) -> Iterator[int]:
    """Emulated node sizes worth testing at world size p: single-rank nodes,
    nodes of 2 and 3 (unequal when they do not divide p), and one node."""
    seen: List[int] = []
    for rpn in (1, 2, 3, 4, p):
        if rpn <= p and rpn not in seen:
            seen.append(rpn)
            yield rpn

