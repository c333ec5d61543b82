"""kernels/select.cu, which only a GPU runs (CuPy compiles it there with NVRTC):
here nvcc compiles every kernel the passes launch, for Hopper, so that a
syntax or template error shows in CI rather than on the first GPU."""
from __future__ import annotations

import shutil
import subprocess

import pytest

from spar_comm.kernels import select_cuda, select_plan

NVCC = shutil.which("nvcc")


@pytest.mark.slow
@pytest.mark.skipif(NVCC is None, reason="no nvcc on this machine")
def test_every_kernel_the_passes_launch_compiles(tmp_path):
    names = select_plan.kernel_names()
    unit = tmp_path / "instances.cu"
    unit.write_text(f'#include "{select_cuda.SOURCE}"\n'
                    "void instantiate() {\n  const void* kernels[] = {\n"
                    + "".join(f"    (const void*)&{name},\n" for name in names) + "  };\n  (void)kernels;\n}\n")
    done = subprocess.run([NVCC, "-std=c++17", "-arch=sm_90", "-c", str(unit), "-o", str(tmp_path / "instances.o")],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert len(names) == 8 + 3 * 9 + 2  # 8 plain kernels, 9 for each of 3 widths, steer for 2 key types


def test_the_state_slots_are_named_alike_on_both_sides():
    """select.cu's enum Slot and select_plan.STATE: one order, or every kernel
    reads the wrong slot."""
    source = select_cuda.SOURCE.read_text()
    enum = source[source.index("enum Slot {") + len("enum Slot {"): source.index("};", source.index("enum Slot {"))]
    names = [line.split("//")[0].strip().rstrip(",").lower() for line in enum.splitlines()]
    assert [name for name in names if name] == list(select_plan.STATE)
    for constant, value in (("COMPACT_THREADS", select_cuda.COMPACT_THREADS), ("WORDS", select_cuda.WORDS),
                            ("FLOORS", select_plan.FLOORS)):
        assert f"#define {constant} {value}\n" in source
