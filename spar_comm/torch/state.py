"""What the optimizer's and the DDP hook's state dicts share.

Each rank's ``state_dict()`` holds its own residuals only, under a key that
names the rank (``residuals["rank{r}"]``): ``torch.distributed.checkpoint``
keeps one copy of a key saved with different values on different ranks, so a
residual under a key every rank uses would come back as one rank's. A state
that holds another rank's residuals (one rank's ``torch.save`` loaded by
every rank) is refused on every rank, naming the ways that scale.
"""
from __future__ import annotations

from typing import Any, Dict, List, Mapping, Optional, Tuple

from ..consensus import raise_if_any

#: Named wherever a state holding another rank's residuals is refused.
SCALABLE_WAYS = (
    "each rank must load its own residuals: save and load every rank's state with "
    "torch.distributed.checkpoint.save(state, checkpoint_id=...) and torch.distributed.checkpoint.load(state, "
    "checkpoint_id=...) on every rank (state holding this rank's state_dict()), or torch.save each rank's own "
    "state_dict() to a file per rank and load that rank's file"
)

#: Named wherever a state saved on another number of ranks is refused.
OTHER_WORLD = ("spar_comm.torch.load_checkpoint(state, path) loads a checkpoint on another number of ranks, "
               "the residuals' total kept")


def rank_key(rank: int) -> str:
    """The key of rank ``rank``'s residuals in ``state_dict()["residuals"]``."""
    return f"rank{rank}"


def own_residuals(residuals: Any, rank: int, world_size: int, what: str) -> Tuple[Any, Optional[str]]:
    """This rank's entry of a state's ``residuals`` (a mapping by ``rank_key``),
    or why there is none. The reason is the same on every rank given the same
    wrong state, so that ``agree`` names it once."""
    if not isinstance(residuals, Mapping):
        return None, f"{what}'s residuals are not a mapping by rank ('rank0', 'rank1', ...)"
    mine = residuals.get(rank_key(rank))
    if mine is not None:
        return mine, None
    others = sorted(str(key) for key in residuals)
    if not others:
        return None, f"{what} holds no rank's residuals"
    return None, (f"{what} holds the residuals of {', '.join(others)} of a job of {world_size} ranks, not this "
                  f"rank's: {SCALABLE_WAYS}")


def agree(comm: Any, problem: Optional[str]) -> None:
    """``raise_if_any`` with the ranks that found the same problem named
    together, so that a job of many ranks reads each problem once."""
    problems = comm.allgather(problem)
    by_text: Dict[str, List[int]] = {}
    for rank, text in enumerate(problems):
        if text is not None:
            by_text.setdefault(text, []).append(rank)
    agreed = None
    if len(by_text) == 1 and len(next(iter(by_text.values()))) == comm.size:
        agreed = next(iter(by_text))
    elif by_text:
        agreed = "; ".join(f"{_ranks(ranks)}: {text}" for text, ranks in by_text.items())
    raise_if_any(comm, agreed)


def _ranks(ranks: List[int]) -> str:
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    if ranks == list(range(ranks[0], ranks[-1] + 1)):
        return f"ranks {ranks[0]} to {ranks[-1]}"
    shown = ", ".join(map(str, ranks[:8]))
    return f"ranks {shown}" + (f" and {len(ranks) - 8} more" if len(ranks) > 8 else "")
