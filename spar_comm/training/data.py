"""Data sets that need no download, and each rank's share of every epoch.

Host-side NumPy: batches are drawn here and moved to the model's array
namespace by the loop.
"""
from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass
from typing import Any, Optional, Tuple

import numpy as np

#: Held-out fraction of the digits set; the split is fixed (seed 0), whatever --seed is.
TEST_FRACTION = 0.2
SYNTHETIC_FEATURES = 64
SYNTHETIC_CLASSES = 10
SYNTHETIC_TRAIN = 16384
SYNTHETIC_TEST = 512


@dataclass
class Dataset:
    name: str
    x_train: np.ndarray
    y_train: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray
    n_classes: int

    @property
    def n_features(self) -> int:
        return self.x_train.shape[1]


def dataset_problem(data: Any) -> Optional[str]:
    """Why ``data`` cannot be trained on (None if it can). Your own data set is
    any object with ``Dataset``'s fields: NumPy-convertible ``x_train``
    [n, features], integer ``y_train`` [n] in ``range(n_classes)``, the same
    for the held-out ``x_test``/``y_test``, and a ``name`` for the summary."""
    missing = [f for f in ("name", "x_train", "y_train", "x_test", "y_test", "n_classes") if not hasattr(data, f)]
    if missing:
        return f"the data set {type(data).__name__} lacks {', '.join(missing)} (see spar_comm.training.data.Dataset)"
    for part in ("train", "test"):
        x, y = np.shape(getattr(data, f"x_{part}")), np.shape(getattr(data, f"y_{part}"))
        if len(x) < 2 or len(y) != 1 or x[0] != y[0] or x[0] == 0:
            return f"the data set's x_{part} {x} and y_{part} {y} are not [n, ...] and [n] with n >= 1"
        labels = np.asarray(getattr(data, f"y_{part}"))
        if labels.dtype.kind not in "iu" or labels.min() < 0 or labels.max() >= data.n_classes:
            return f"the data set's y_{part} must hold integer labels in [0, {data.n_classes})"
    return None


def load_dataset(name: str, dtype: str = "float32") -> Dataset:
    """``digits``: scikit-learn's 8x8 handwritten digits (shipped in its wheel),
    80/20 split. ``synthetic``: Gaussian inputs labelled by a fixed random
    two-layer teacher network, learnable but not trivially so."""
    if name == "digits":
        x, y = digits()
        x = x / 16.0
        order = np.random.default_rng(0).permutation(len(y))
        n_test = int(round(TEST_FRACTION * len(y)))
        test, train = order[:n_test], order[n_test:]
        return Dataset(name, x[train].astype(dtype), y[train], x[test].astype(dtype), y[test], 10)
    if name == "synthetic":
        rng = np.random.default_rng(1234)
        w1 = rng.standard_normal((SYNTHETIC_FEATURES, 256))
        w2 = rng.standard_normal((256, SYNTHETIC_CLASSES))
        x = rng.standard_normal((SYNTHETIC_TRAIN + SYNTHETIC_TEST, SYNTHETIC_FEATURES))
        y = np.argmax(np.tanh(x @ w1 / 8.0) @ w2, axis=1)
        x = x.astype(dtype)
        return Dataset(name, x[:SYNTHETIC_TRAIN], y[:SYNTHETIC_TRAIN], x[SYNTHETIC_TRAIN:], y[SYNTHETIC_TRAIN:], SYNTHETIC_CLASSES)
    raise ValueError(f"unknown dataset {name!r}")


def digits() -> Tuple[np.ndarray, np.ndarray]:
    """The 1797 digits of scikit-learn's wheel, read straight from its CSV file:
    importing sklearn.datasets costs every rank a second or more."""
    spec = importlib.util.find_spec("sklearn")
    path = os.path.join(spec.submodule_search_locations[0], "datasets", "data", "digits.csv.gz")
    if not os.path.exists(path):  # a scikit-learn that moved the file
        from sklearn.datasets import load_digits

        return load_digits(return_X_y=True)
    table = np.loadtxt(path, delimiter=",")
    return table[:, :-1], table[:, -1].astype(np.int64)


class Shards:
    """Rank ``rank``'s batches: each epoch is a permutation of the training set
    drawn from (seed, epoch); rank r takes every world-th sample from position
    r, cut to the same length on every rank so all ranks take equal steps.

    The data order is a function of the step alone, so resuming needs only
    the step (the checkpoint stores the rest to check it).
    """

    def __init__(self, n: int, rank: int, world: int, batch_size: int, seed: int):
        self.n, self.rank, self.world, self.batch_size, self.seed = n, rank, world, batch_size, seed
        self.per_rank = n // world
        self.steps_per_epoch = self.per_rank // batch_size
        self._epoch, self._mine = -1, np.zeros(0, dtype=np.int64)

    def position(self, step: int) -> Tuple[int, int]:
        """(epoch, batch within the epoch) of ``step``."""
        return divmod(step, self.steps_per_epoch)

    def indices(self, step: int) -> np.ndarray:
        epoch, i = self.position(step)
        if epoch != self._epoch:
            order = np.random.default_rng([self.seed, epoch]).permutation(self.n)
            self._epoch, self._mine = epoch, order[self.rank :: self.world][: self.per_rank]
        return self._mine[i * self.batch_size : (i + 1) * self.batch_size]
