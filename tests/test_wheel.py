"""The wheel holds every module of the checkout: a subpackage missing from it
imports here, from the checkout, and fails only where the wheel is installed."""
from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_the_wheel_holds_every_module_and_kernel_source(tmp_path):
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation",
                            "-w", str(tmp_path), str(ROOT)], capture_output=True, text=True, timeout=300)
    assert built.returncode == 0, built.stderr
    (wheel,) = tmp_path.glob("spar_comm-*.whl")
    held = set(zipfile.ZipFile(wheel).namelist())
    wanted = {f"spar_comm/{p.relative_to(ROOT / 'spar_comm').as_posix()}" for p in (ROOT / "spar_comm").rglob("*.py")}
    wanted |= {f"spar_comm/kernels/{p.name}" for p in (ROOT / "kernels").iterdir() if p.suffix in (".py", ".cu")}
    assert len(wanted) > 50
    assert sorted(wanted - held) == []
