"""Shared test helpers. MPI tests run under ``tests/run_mpi.py``, which starts
``pytest --with-mpi`` under mpiexec at several world sizes with a hard limit."""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(__file__))  # for `import reference`

