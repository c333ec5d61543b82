#!/usr/bin/env bash
# Build drivers/cub_topk.cu, CUB's DeviceTopK for bench_topk.py --cub-topk,
# against the CCCL headers of the cuda-cccl wheel (DeviceTopK arrived in
# CCCL 3.3; CUDA 13.0's own headers are older). Needs nvcc and pip's access
# to the package index; the library runs on any machine with the same CUDA
# major version and an sm_90 GPU (H100, H200).
#
#   drivers/build_cub_topk.sh [OUT.so]      (default: build/libcub_topk.so)
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-build/libcub_topk.so}
python=${PYTHON:-python3}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
"$python" -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_26_x86_64 --platform manylinux_2_28_x86_64 -d "$work" cuda-cccl==1.2.1
(cd "$work" && "$python" -m zipfile -e cuda_cccl-*.whl unpacked)
mkdir -p "$(dirname "$out")"
nvcc -std=c++17 -O3 -arch=sm_90 -shared -Xcompiler -fPIC -I"$work/unpacked/cuda/cccl/headers/include" \
    drivers/cub_topk.cu -o "$out"
echo "built $out"
