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
from datetime import timedelta
from typing import Any, Optional

import torch.distributed as dist
from mpi4py import MPI

from ..consensus import raise_if_any, require_same

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


def _free_port(address: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((address, 0))
        return s.getsockname()[1]


def init_process_group(backend: str = "gloo", *, comm: Optional[MPI.Comm] = None,
                       timeout: Optional[timedelta] = None, **options: Any) -> None:
    """``torch.distributed.init_process_group`` over the ranks of ``comm``
    (default MPI.COMM_WORLD), rank for rank. Collective; a rank that cannot
    (torch.distributed already started, rank 0 without an address) gives
    ConfigError on every rank. ``options`` go to torch as they are."""
    comm = comm or MPI.COMM_WORLD
    require_same(comm, "process group", {"backend": backend})
    problem = "torch.distributed is already initialised" if dist.is_initialized() else None
    raise_if_any(comm, problem)
    host = comm.Split_type(MPI.COMM_TYPE_SHARED, key=comm.rank)
    one_host = comm.allreduce(host.size, op=MPI.MIN) == comm.size
    host.Free()
    if one_host:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    where, problem = None, None
    if comm.rank == 0:
        try:
            address = _rank0_address(one_host)
            port = int(os.environ["MASTER_PORT"]) if os.environ.get("MASTER_PORT") else _free_port(address)
            where = f"tcp://{address}:{port}"
        except (OSError, ValueError) as error:
            problem = f"rank 0 found no address for torch.distributed ({error}); set MASTER_ADDR"
    raise_if_any(comm, problem)
    where = comm.bcast(where, root=0)
    extra = {} if timeout is None else {"timeout": timeout}
    dist.init_process_group(backend, init_method=where, rank=comm.rank, world_size=comm.size, **extra, **options)
