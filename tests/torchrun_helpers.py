"""What the scripts that tests/test_torchrun.py runs under torchrun share."""
from __future__ import annotations

import sys
from typing import List

import torch.distributed as dist


def say(line: str) -> None:
    """One line in one write: the ranks share the launcher's stdout."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def report(summary: str, failures: List[str]) -> None:
    """This rank's ``summary`` line and each failure (``rank R: ...``), then leave the group."""
    rank = dist.get_rank()
    say(f"rank {rank}: {summary}")
    for failure in failures:
        say(f"rank {rank}: FAILED {failure}")
    dist.destroy_process_group()
