"""spar_comm: MPI-native data-parallel training with top-k sparsified gradients.

The top-level ``kernels/`` folder is installed as ``spar_comm.kernels``: a
top-level ``kernels`` module would clash with an unrelated published package.
"""
from setuptools import find_packages, setup

setup(
    name="spar_comm",
    version="0.1.0",
    license="Apache-2.0",
    description="Top-k sparsified gradient allreduce (MSTopK, HiTopKComm) on mpi4py",
    python_requires=">=3.9",
    # Every subpackage, so none is left out of the wheel as it is added.
    packages=find_packages(include=["spar_comm", "spar_comm.*"]) + ["spar_comm.kernels"],
    package_dir={"spar_comm": "spar_comm", "spar_comm.kernels": "kernels"},
    package_data={"spar_comm.kernels": ["*.cu"]},
    install_requires=[
        "mpi4py>=4", "numpy>=1.24", "h5py>=3.8",
        # bfloat16 gradients on the CPU (NumPy has no bfloat16 of its own)
        "ml_dtypes>=0.2",
        # compiled candidate pass of the fast exact top-k (see kernels/magnitude.py)
        "numba>=0.59",
        # the training loop: array API, progress bar, the digits data set shipped in the wheel
        "array-api-compat>=1.4", "tqdm", "scikit-learn>=1.0",
    ],
    extras_require={
        # An MPI library from the package index, for machines without one.
        # Cluster users leave it out and build mpi4py against the site MPI.
        "mpich": ["mpich"],
        # GPU arrays: CuPy, and numba-cuda for the selection kernels (kernels/device_select.py);
        # numba-cuda 0.30 compiles no kernel under NumPy 2.5 (np.row_stack is gone)
        "gpu": ["cupy-cuda13x", "numba-cuda>=0.30.4,<0.31", "numpy<2.5"],
        # numba-cuda and a CUDA runtime library run the device kernels under
        # Numba's CUDA simulator, so the tests exercise them without a GPU
        # array-api-strict: the MLP must stay inside the array API that CuPy runs it through
        "test": ["pytest>=7", "pytest-mpi>=0.6", "pytest-timeout", "pytest-xdist>=3", "hypothesis", "matplotlib",
                 "numba-cuda>=0.30.4,<0.31", "nvidia-cuda-runtime>=13.5,<14", "array-api-strict>=2.3"],
        # analyze.py --plot
        "plot": ["matplotlib"],
        # spar_comm.torch (DistributedOptimizer) and the autograd adapter (train.py --model cnn)
        "torch": ["torch>=2.1"],
        # spar_comm.jax (an optax GradientTransformation)
        "jax": ["jax", "optax"],
    },
)
