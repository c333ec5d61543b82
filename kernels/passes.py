"""Count the passes over memory a call makes, at the kernels' entry points.

On the CPU a sparse allreduce is bound by memory, not by the network, so
what it costs is how many times it reads and writes vectors of its length.
Each entry point that sweeps an array books the elements it reads and
writes under its name; ``counting()`` turns the books on for a block of code
and hands them over. Off (the default), booking is one test of a flag.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Dict, Iterator, List, Tuple

#: The books while ``counting()`` is open: (name, elements read, elements written), in order.
_books: List[Tuple[str, int, int]] | None = None


def book(name: str, read: int, written: int = 0) -> None:
    """Record one pass ``name`` that read ``read`` and wrote ``written`` elements."""
    if _books is not None:
        _books.append((name, int(read), int(written)))


@contextmanager
def counting() -> Iterator[List[Tuple[str, int, int]]]:
    """Book every pass made inside the block into the list it yields."""
    global _books
    outer, _books = _books, []
    try:
        yield _books
    finally:
        _books = outer


def totals(books: List[Tuple[str, int, int]], length: int, least: float = 0.25) -> Dict[str, float]:
    """Reads and writes in vectors of ``length``, summed over the passes of each
    name that touched at least ``least`` of it in all (the full-length ones: a
    shard of a node of 4 counts, the k selected pairs do not), and how many
    names those are (``passes``: a write that rides on a pass's read costs
    less than a pass of its own, which must fetch what it overwrites)."""
    named: Dict[str, List[int]] = {}
    for name, read, written in books:
        named.setdefault(name, [0, 0])
        named[name][0] += read
        named[name][1] += written
    full = [(read, written) for read, written in named.values() if max(read, written) >= least * length]
    return {"passes": len(full), "reads": sum(r for r, _ in full) / length, "writes": sum(w for _, w in full) / length}
