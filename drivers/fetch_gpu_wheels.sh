#!/usr/bin/env bash
# Download the wheels a GPU machine lacks for `make gpu-check`, into DIR
# (default .whl), for CPython 3.12 on x86-64 Linux, and build spar_comm's own.
#
#   drivers/fetch_gpu_wheels.sh [DIR] [--mpich]
#
# The machine is taken to have (as the lent H100/H200 images do) Python 3.12
# with CUDA torch, cupy-cuda13x, numba, numba-cuda, mpi4py, h5py, pytest,
# hypothesis and scikit-learn. What spar_comm and its GPU check need beside
# those: array-api-compat and tqdm (spar_comm), pytest-mpi and pytest-timeout
# (the MPI suites). --mpich adds the mpich wheel, for a machine whose mpi4py
# finds no MPI library: check first with
#   python3 -c "import mpi4py.MPI as M; print(M.Get_library_version())"
# On the GPU machine, with no package index:
#   python3 -m pip install --no-index --no-deps --target /tmp/site DIR/*.whl
#   export PYTHONPATH=/tmp/site PATH=/tmp/site/bin:$PATH
#   make gpu-check OUT=gpu-check
# Versions are the ones the CPU suite runs with. NumPy 2.4: numba-cuda 0.30 fails to
# compile any kernel under NumPy 2.5, which removed np.row_stack.
set -euo pipefail
cd "$(dirname "$0")/.."
dir=.whl
mpich=
for arg in "$@"; do
    case "$arg" in
        --mpich) mpich=mpich==5.0.2 ;;
        -*) echo "fetch_gpu_wheels.sh: unknown option $arg" >&2; exit 2 ;;
        *) dir=$arg ;;
    esac
done
python=${PYTHON:-python3}
mkdir -p "$dir"
"$python" -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d "$dir" array-api-compat==1.16.0 tqdm==4.70.1 pytest-mpi==0.6 pytest-timeout==2.4.0 numpy==2.4.6 $mpich
"$python" -m pip wheel --quiet --no-deps -w "$dir" .
ls -l "$dir"
