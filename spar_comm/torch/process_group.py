"""``torch.distributed`` brought up from an MPI launch, so that
``mpiexec -n 4 python my_ddp_script.py`` needs no extra environment.

Rank and size come from MPI, and rank 0's address and a free port of its
reach every rank over MPI. On one host the address is 127.0.0.1 (and gloo
is told to use the loopback interface unless ``GLOO_SOCKET_IFNAME`` says
otherwise); across hosts it is ``MASTER_ADDR`` when set, else the address of
rank 0's ``GLOO_SOCKET_IFNAME`` interface, else its host name's address.
"""
from __future__ import annotations

import fcntl
import os
import socket
import struct
import time
from datetime import timedelta
from typing import Any, Optional

import torch.distributed as dist
from mpi4py import MPI

from ..consensus import raise_if_any, require_same
from .world import launched, require_job_world

#: Linux's ioctl for an interface's IPv4 address (<linux/sockios.h>).
_SIOCGIFADDR = 0x8915


def interface_address(name: str) -> str:
    """The IPv4 address of network interface ``name`` (Linux)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        answer = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, struct.pack("256s", name[:15].encode()))
    return socket.inet_ntoa(answer[20:24])


def _rank0_address(one_host: bool) -> str:
    if one_host:
        return "127.0.0.1"
    if os.environ.get("MASTER_ADDR"):
        return os.environ["MASTER_ADDR"]
    interface = os.environ.get("GLOO_SOCKET_IFNAME", "").split(",")[0]
    return interface_address(interface) if interface else socket.gethostbyname(socket.gethostname())


def _free_ports(address: str, count: int) -> list:
    """``count`` distinct free ports on ``address`` (all held open until each is known)."""
    sockets = [socket.socket(socket.AF_INET, socket.SOCK_STREAM) for _ in range(count)]
    try:
        for s in sockets:
            s.bind((address, 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def on_one_host(comm: MPI.Comm) -> bool:
    """Whether every rank of ``comm`` shares one host's memory. Collective."""
    host = comm.Split_type(MPI.COMM_TYPE_SHARED, key=comm.rank)
    one_host = comm.allreduce(host.size, op=MPI.MIN) == comm.size
    host.Free()
    return one_host


def init_methods(comm: MPI.Comm, count: int, one_host: bool, master_port: Optional[str] = None) -> list:
    """``count`` init_method addresses for torch.distributed, the same on every
    rank: rank 0's address (see the module's docstring) with a free port each,
    or ``master_port`` for a single one. Collective; where rank 0 finds no
    address, ConfigError on every rank."""
    where, problem = None, None
    if comm.rank == 0:
        try:
            address = _rank0_address(one_host)
            ports = [int(master_port)] if master_port and count == 1 else _free_ports(address, count)
            where = [f"tcp://{address}:{port}" for port in ports]
        except (OSError, ValueError) as error:
            problem = f"rank 0 found no address for torch.distributed ({error}); set MASTER_ADDR"
    raise_if_any(comm, problem)
    return comm.bcast(where, root=0)


def init_process_group(backend: str = "gloo", *, comm: Optional[MPI.Comm] = None,
                       timeout: Optional[timedelta] = None, **options: Any) -> None:
    """``torch.distributed.init_process_group`` over the ranks of ``comm``
    (default MPI.COMM_WORLD), rank for rank; or, in a job that torchrun
    launched (MPI's world of one, torchrun's ``WORLD_SIZE`` and
    ``MASTER_ADDR`` set), from torchrun's environment as torch itself does.
    Collective; a rank that cannot (torch.distributed already started, a
    launcher's WORLD_SIZE that is not ``comm``'s, rank 0 without an address)
    gives ConfigError on every rank. ``options`` go to torch as they are."""
    comm = comm or MPI.COMM_WORLD
    require_same(comm, "process group", {"backend": backend})
    problem = "torch.distributed is already initialised" if dist.is_initialized() else None
    raise_if_any(comm, problem)
    extra = {} if timeout is None else {"timeout": timeout}
    told = launched()
    if comm.size == 1 and os.environ.get("MASTER_ADDR") and told is not None and told.world_size != "1":
        dist.init_process_group(backend, **extra, **options)  # torchrun's job: its rendezvous, not MPI's
        return
    require_job_world(comm, "spar_comm.torch.init_process_group")  # under torchrun: one world per process
    one_host = on_one_host(comm)
    if one_host:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    where = init_methods(comm, 1, one_host, os.environ.get("MASTER_PORT") if comm.rank == 0 else None)[0]
    dist.init_process_group(backend, init_method=where, rank=comm.rank, world_size=comm.size, **extra, **options)


#: Seconds ``destroy_process_group`` hands the GIL to gloo's worker threads.
RELEASE_PAUSE_S = 0.1


def destroy_process_group() -> None:
    """``torch.distributed.destroy_process_group()``, after a pause that lets
    gloo's worker threads finish with the last collective.

    A worker drops a finished collective's tensors a moment after the call
    has returned, and takes the GIL to do so. The process group itself dies
    later, with its last holder (DDP, as a script's ``main`` returns), and
    its destructor joins the workers while holding the GIL: a deadlock if a
    worker has not dropped them yet (seen in 2 of 30 runs of a DDP script on
    a loaded machine). The pause releases the GIL so that they can."""
    time.sleep(RELEASE_PAUSE_S)
    dist.destroy_process_group()
