"""Agreement between ranks before anything can diverge.

An exception on one rank leaves the others waiting in the next collective.
These helpers gather every rank's verdict first, so that all ranks raise the
same error or none does. They pickle small objects: construction time only,
never the hot path.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Dict, List, Mapping, Optional

from .errors import ConfigError

if TYPE_CHECKING:
    from mpi4py import MPI


def raise_if_any(comm: MPI.Comm, problem: Optional[str], error: type = ConfigError) -> None:
    """Raise ``error`` on every rank when any rank reports a problem, each
    problem named once with the ranks that found it (a job of many ranks
    that found the same reads it once)."""
    problems = comm.allgather(problem)
    by_text: Dict[str, List[int]] = {}
    for rank, text in enumerate(problems):
        if text is not None:
            by_text.setdefault(text, []).append(rank)
    if not by_text:
        return
    if len(by_text) == 1 and len(next(iter(by_text.values()))) == comm.size:
        raise error(next(iter(by_text)))
    raise error("; ".join(f"{_ranks(ranks)}: {text}" for text, ranks in by_text.items()))


def _ranks(ranks: List[int]) -> str:
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    if ranks == list(range(ranks[0], ranks[-1] + 1)):
        return f"ranks {ranks[0]} to {ranks[-1]}"
    shown = ", ".join(map(str, ranks[:8]))
    return f"ranks {shown}" + (f" and {len(ranks) - 8} more" if len(ranks) > 8 else "")


def require_same(comm: MPI.Comm, what: str, settings: Mapping[str, Any]) -> None:
    """Raise ConfigError on every rank unless all ranks passed equal settings."""
    everyone = comm.allgather(dict(settings))
    differing = sorted(key for key in settings if any(s.get(key) != everyone[0].get(key) for s in everyone))
    if differing:
        detail = "; ".join(
            f"{key}: " + ", ".join(f"rank {r}={s.get(key)!r}" for r, s in enumerate(everyone))
            for key in differing
        )
        raise ConfigError(f"ranks disagree on the {what}: {detail}")
