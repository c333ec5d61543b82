"""Agreement between ranks before anything can diverge.

An exception on one rank leaves the others waiting in the next collective.
These helpers gather every rank's verdict first, so that all ranks raise the
same error or none does. They pickle small objects: construction time only,
never the hot path.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Mapping, Optional

from .errors import ConfigError

if TYPE_CHECKING:
    from mpi4py import MPI


def raise_if_any(comm: MPI.Comm, problem: Optional[str], error: type = ConfigError) -> None:
    """Raise ``error`` on every rank when any rank reports a problem."""
    problems = comm.allgather(problem)
    bad = [(rank, text) for rank, text in enumerate(problems) if text is not None]
    if not bad:
        return
    texts = {text for _, text in bad}
    if len(bad) == comm.size and len(texts) == 1:
        raise error(bad[0][1])
    raise error("; ".join(f"rank {rank}: {text}" for rank, text in bad))


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
