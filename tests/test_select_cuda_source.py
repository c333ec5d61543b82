"""kernels/select.cu, which only a GPU runs (CuPy compiles it there with NVRTC):
here nvcc compiles every kernel the passes launch, for Hopper, so that a
syntax or template error shows in CI rather than on the first GPU."""
from __future__ import annotations

import shutil
import subprocess

import pytest

from spar_comm.kernels import select_cuda

NVCC = shutil.which("nvcc")


@pytest.mark.slow
@pytest.mark.skipif(NVCC is None, reason="no nvcc on this machine")
def test_every_kernel_the_passes_launch_compiles(tmp_path):
    names = select_cuda.kernel_names()
    unit = tmp_path / "instances.cu"
    unit.write_text(f'#include "{select_cuda.SOURCE}"\n'
                    "void instantiate() {\n  const void* kernels[] = {\n"
                    + "".join(f"    (const void*)&{name},\n" for name in names) + "  };\n  (void)kernels;\n}\n")
    done = subprocess.run([NVCC, "-std=c++17", "-arch=sm_90", "-c", str(unit), "-o", str(tmp_path / "instances.o")],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert len(names) == 17  # 4 kernels for each of 3 widths, steer and rank_keys for 2 each, choose_byte


def test_the_python_side_imports_without_cupy():
    """The names and types are plain data: nothing here needs a GPU to be read."""
    assert "at_least<unsigned int, unsigned int>" in select_cuda.kernel_names()
    assert select_cuda.FLOORS == 63 and set(select_cuda.C_TYPES) == {2, 4, 8}
