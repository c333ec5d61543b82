"""torch's own modes of bench_peers.py, each in a process of its own, forked
from a rank and on a gloo group of its own: gloo ends the whole process on
some collective mismatches and DDP can wait for ever on a hook that went
wrong, so a peer that crashes or stays silent is failed and the rank goes on."""
from __future__ import annotations

import datetime
import itertools
import multiprocessing
import os
from multiprocessing.connection import Connection
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from mpi4py import MPI

from .peer_runners import build_ddp
from .peers import PeerSettings, Workload, describe


def peer_main(conn: Connection, mode: str, init_method: str, rank: int, size: int, fail_at: Optional[int],
              settings: PeerSettings, replica: torch.nn.Module, work: Workload) -> None:
    """A DDP mode in a process of its own, forked from a rank before it starts
    any thread. It takes a step when the rank sends ("step", batch) and
    measures the held-out metric on ("evaluate", None); None stops it. It
    answers ("ok", seconds or metric) or ("error", text). A crash or a hang
    here (gloo aborts the process on some collective mismatches) ends only it."""
    try:
        dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=size,
                                timeout=datetime.timedelta(seconds=settings.peer_timeout))
        runner = build_ddp(mode, replica, work, settings, None)
        conn.send(("ok", None))
    except Exception as error:  # noqa: BLE001 (handed to the rank)
        conn.send(("error", describe(error)))
        return
    steps = itertools.count()
    while (request := conn.recv()) is not None:
        kind, batch = request
        if kind == "step" and next(steps) == fail_at:
            os.abort()  # as gloo does on a mismatch
        try:
            figure = (runner.step(tuple(map(torch.from_numpy, batch)), work.loss) if kind == "step"
                      else runner.evaluate(work.metric))
            conn.send(("ok", figure))
        except Exception as error:  # noqa: BLE001
            conn.send(("error", describe(error)))


class Peer:
    """The rank's side of a ``peer_main`` process: its answers, waited for at
    most ``settings.peer_timeout``. The last rank's peer of
    ``settings.inject_failure`` aborts in its first timed step."""

    phases = None  # torch's own modes: no breakdown of their communication
    collective = False  # rank 0 alone evaluates its model

    def __init__(self, mode: str, init_method: str, world: MPI.Comm, settings: PeerSettings,
                 replica: torch.nn.Module, work: Workload, sent: Optional[float]):
        fail_at = settings.warmup if mode == settings.inject_failure and world.rank == world.size - 1 else None
        self.conn, theirs = multiprocessing.get_context("fork").Pipe()
        self.process = multiprocessing.get_context("fork").Process(
            target=peer_main,
            args=(theirs, mode, init_method, world.rank, world.size, fail_at, settings, replica, work), daemon=True)
        self.process.start()
        theirs.close()
        self.timeout, self.sent, self.note = settings.peer_timeout, lambda: sent, ""

    def answer(self, timeout: Optional[float] = None) -> Optional[float]:
        """The next answer's figure, waited for at most ``timeout`` (default
        the peer timeout); an exception for an error, a death or silence."""
        timeout = timeout or self.timeout
        if not self.conn.poll(timeout):
            raise TimeoutError(f"no answer within {timeout:g} s")
        try:
            status, figure = self.conn.recv()
        except EOFError:
            self.process.join(5)
            raise RuntimeError(f"its process died (exit code {self.process.exitcode})") from None
        if status != "ok":
            raise RuntimeError(figure)
        return figure

    def step(self, batch: Any, loss: Callable) -> float:
        """One step of the peer on ``batch`` (``loss`` is its own, forked with it); its seconds."""
        self.conn.send(("step", tuple(t.numpy() for t in batch)))
        return self.answer()

    def evaluate(self, metric: Callable[[torch.nn.Module], float]) -> float:
        """The peer's own workload's metric (``metric`` is the same, forked with it)."""
        self.conn.send(("evaluate", None))
        return self.answer()

    def close(self) -> None:
        """Stop it: politely where it still listens, else for good."""
        try:
            self.conn.send(None)
        except OSError:
            pass
        self.process.join(5)
        if self.process.is_alive():
            self.process.kill()
            self.process.join()
