"""The JSON record of a benchmark run: ``{"meta": ..., ...}``, where meta
always says which tool ran, how it was called, where, when and with which
versions, so that a figure found later in a file can be traced to its run.
Written through ``spar_comm.files.write_json`` (atomic, with a checksum)."""
from __future__ import annotations

import datetime
import platform
import shlex
import sys
from typing import Any, Dict, List, Optional, Sequence

import numpy as np

from ..consensus import raise_if_any
from ..files import unwritable, write_json

#: The fields every meta holds; a tool's own fields may not reuse these names.
COMMON = ("tool", "command", "hosts", "date", "versions")


def versions() -> Dict[str, str]:
    """Python, NumPy, mpi4py, the MPI library, spar_comm, and torch and jax
    where the tool has imported them (never imported here)."""
    import mpi4py

    import spar_comm
    from ..mpi_strings import library_name

    found = {"python": platform.python_version(), "numpy": np.__version__, "mpi4py": mpi4py.__version__,
             "mpi_library": library_name(), "spar_comm": spar_comm.__version__}
    for name in ("torch", "jax"):
        module = sys.modules.get(name)
        if module is not None:
            found[name] = getattr(module, "__version__", "unknown")
    return found


def hosts_of(comm: Any) -> List[str]:
    """The distinct hosts of ``comm``'s ranks, sorted (collective)."""
    from ..mpi_strings import processor_name

    return sorted(set(comm.allgather(processor_name())))


def now() -> str:
    """The time in UTC, ISO 8601, to the second."""
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def meta(tool: str, hosts: Optional[Sequence[str]] = None, **fields: Any) -> Dict[str, Any]:
    """A record's meta: the common fields, then the tool's own ``fields``
    (those of files already written keep their names). ``hosts`` defaults to
    this machine (a tool that runs no MPI job)."""
    clash = sorted(set(fields) & set(COMMON))
    if clash:
        raise ValueError(f"meta fields {', '.join(clash)} are the common ones")
    return {"tool": tool, "command": shlex.join(sys.argv), "hosts": sorted(set(hosts or [platform.node()])),
            "date": now(), "versions": versions(), **fields}


def write_record(path: Any, meta_: Dict[str, Any], **body: Any) -> None:
    """Write ``{"meta": meta_, **body}`` to ``path`` (atomic, checked)."""
    write_json(path, {"meta": meta_, **body})


def refuse_unwritable(comm: Any, path: Optional[str]) -> None:
    """Where rank 0 is to write ``path``, every rank raises the same
    ConfigError now if it cannot (collective): only rank 0's view of the file
    system counts, and a long run must not end unable to write what it measured."""
    raise_if_any(comm, unwritable(path) if comm.rank == 0 and path else None)
