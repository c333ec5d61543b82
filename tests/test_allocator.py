"""retain_freed_memory: freed blocks are reused instead of faulted in again.

Counted in page faults (the process's minor faults), not time: the same
allocations give the same count whatever else the machine is doing. Each
count comes from a fresh interpreter, since the setting is the process's."""
from __future__ import annotations

import platform
import subprocess
import sys

import pytest

from spar_comm import retain_freed_memory

# A step's worth of large arrays made and freed, as a training step's tensors
# are; the faults of ten steps after three of warm-up, per step.
STEPS = """
import resource, sys
import numpy as np
if sys.argv[1] == "retain":
    from spar_comm import retain_freed_memory
    assert retain_freed_memory()

def step():
    tensors = [np.ones(4 << 20, np.float32) for _ in range(4)]  # 4 x 16 MiB
    del tensors

for _ in range(3):
    step()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(10):
    step()
print((resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 10)
"""

GLIBC = platform.libc_ver()[0] == "glibc"


def faults_per_step(malloc: str) -> float:
    done = subprocess.run([sys.executable, "-c", STEPS, malloc], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return float(done.stdout)


@pytest.mark.skipif(not GLIBC, reason="glibc's malloc only")
def test_a_step_reuses_freed_memory_instead_of_faulting_it_in():
    system, retained = faults_per_step("system"), faults_per_step("retain")
    # 64 MiB freed a step: glibc returns some of it to the kernel (seen: 2,044 faults a step, 8 MiB).
    assert system >= 1000, f"glibc alone faulted only {system} pages a step: the pattern no longer shows the problem"
    assert retained <= 10, f"{retained} faults a step with freed memory retained"


def test_it_says_whether_it_took_effect():
    assert retain_freed_memory() is GLIBC
