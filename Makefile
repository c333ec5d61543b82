# Two commands on a fresh machine with only python3 and pip:
#   make train   one default run (creates .venv and installs what it needs)
#   make test    the serial suite, then the MPI suite at 1, 2, 3, 4 and 6 ranks
#
# EXTRAS picks the optional dependencies. The default brings an MPI library
# from the package index (the mpich wheel); on a cluster with its own
# CUDA-aware MPI use `make EXTRAS=test ...` so mpi4py binds to the site MPI.
PYTHON ?= python3
VENV   ?= .venv
EXTRAS ?= mpich,test
PY     := $(VENV)/bin/python
comma  := ,
STAMP  := $(VENV)/.installed-$(subst $(comma),-,$(EXTRAS))
MPIEXEC ?= $(if $(wildcard $(VENV)/bin/mpiexec),$(VENV)/bin/mpiexec,mpiexec)
# The frameworks the test suite covers (spar_comm.torch, spar_comm.jax), CPU
# builds; about half a minute and 1.2 GB here. FRAMEWORKS= skips them (their
# tests then skip). torch is pinned: an unpinned torch is a several-GB CUDA build.
FRAMEWORKS ?= torch==2.13.0 jax optax
empty  :=
space  := $(empty) $(empty)
FW_STAMP := $(VENV)/.installed-frameworks-$(subst =,,$(subst $(space),-,$(strip $(FRAMEWORKS))))
NP     ?= 4
RANKS_PER_NODE ?= 2

.PHONY: all install train test test-serial test-mpi bench clean

all: test

install: $(STAMP)

$(STAMP): setup.py
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[$(EXTRAS)]'
	touch $@

# The default run: MLP on digits, hitopk + mstopk, density 0.01, trace in runs/train.h5.
# On a real cluster: make train RANKS_PER_NODE=0 (nodes found by shared memory).
train: $(STAMP)
	$(MPIEXEC) -n $(NP) $(PY) drivers/train.py --ranks-per-node $(RANKS_PER_NODE) $(TRAIN_ARGS)

test: test-serial test-mpi

$(FW_STAMP): $(STAMP)
	$(if $(strip $(FRAMEWORKS)),$(PY) -m pip install --quiet $(FRAMEWORKS))
	touch $@

test-serial: $(STAMP) $(FW_STAMP)
	$(PY) -m pytest -q -p no:cacheprovider tests

test-mpi: $(STAMP) $(FW_STAMP)
	$(PY) tests/run_mpi.py --mpiexec $(MPIEXEC)

# The reference checks at 8, 12 and 16 ranks (8x2, 16x1, 4x4, uneven nodes of
# 5), on one host with emulated nodes and, as root, on emulated hosts. Not part
# of `make test`: 16 ranks on a small machine take a while.
# On a machine with a GPU, CuPy and numba-cuda (not part of `make test`): the
# device kernels on CuPy arrays, then the GPU path of every allreducer with
# GPU_RANKS ranks sharing the GPUs (staged, and CUDA-aware where MPI is).
# The torch suites run there on CUDA tensors (DistributedOptimizer, the DDP hook).
# CUDASIM=1 runs the same under the simulator (gpu-check's simulated mode).
GPU_RANKS ?= 2
CUDASIM ?= 0
GPU_SERIAL_TESTS ?= tests/test_device_select.py tests/test_memory.py tests/test_torch_units.py
GPU_TESTS ?= tests/test_gpu_path_mpi.py tests/test_torch_gpu_path_mpi.py tests/test_torch_ddp_mpi.py
.PHONY: test-gpu
test-gpu:
	NUMBA_ENABLE_CUDASIM=$(CUDASIM) $(PY) -m pytest -q -p no:cacheprovider $(GPU_SERIAL_TESTS)
	NUMBA_ENABLE_CUDASIM=$(CUDASIM) SPAR_COMM_RANKS_PER_NODE=$(GPU_RANKS) $(MPIEXEC) -n $(GPU_RANKS) $(PY) -m pytest \
	    --with-mpi -m mpi -q -p no:cacheprovider --timeout=300 $(GPU_TESTS)

# Everything that needs a GPU, in one command of under 10 minutes, on a GPU
# machine whose python3 has CUDA torch, CuPy, numba-cuda and mpi4py (and the
# wheels drivers/fetch_gpu_wheels.sh downloads): make test-gpu at 1, 2 and 4
# ranks, the benchmarks, the training drivers on the GPU. Reports in OUT:
# gpu-check.json and gpu-check.md. `make test` runs its simulated mode.
OUT ?= gpu-check
GPU_PYTHON ?= $(PYTHON)
.PHONY: gpu-check
gpu-check:
	$(GPU_PYTHON) drivers/gpu_check.py --out $(OUT)

# The mutation fuzzer over checkpoints, traces, calibrations and benchmark JSON
# (tests/fuzz_files.py): FUZZ_CASES cases from FUZZ_SEED, its figures printed;
# it fails on any crash or silent corruption. `make test` runs a bounded count.
FUZZ_CASES ?= 5000
FUZZ_SEED  ?= 0
.PHONY: fuzz
fuzz: $(STAMP)
	$(PY) tests/fuzz_files.py --cases $(FUZZ_CASES) --seed $(FUZZ_SEED)

.PHONY: test-scale
test-scale: $(STAMP) $(FW_STAMP)
	$(PY) tests/run_scale.py --mpiexec $(MPIEXEC)

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .hypothesis
