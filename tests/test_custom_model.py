"""train() with your own model and data set: the hand-written model of docs/training.md
runs as printed, and a data set that breaks the protocol is refused."""
from __future__ import annotations

import re
from types import SimpleNamespace

import numpy as np
import pytest
from mpi4py import MPI

from conftest import ROOT
from spar_comm import ConfigError
from spar_comm.training import TrainConfig, train
from spar_comm.training.data import load_dataset


def docs_block() -> str:
    text = (ROOT / "docs" / "training.md").read_text()
    match = re.search(r"<!-- custom-model:.*?-->\n```python\n(.*?)```", text, re.S)
    assert match, "docs/training.md lost its custom-model block"
    return match.group(1)


def test_the_documented_model_trains_with_train(capsys):
    scope: dict = {}
    exec(compile(docs_block(), "docs/training.md", "exec"), scope)  # noqa: S102 (our own docs)
    summary = scope["summary"]
    assert summary.test_metric > 0.85  # ten digit classes; softmax regression reaches ~0.95
    assert summary.steps == summary.total_steps > 0
    assert "Softmax" in summary.setup and "on digits" in summary.setup
    assert "held-out accuracy" in capsys.readouterr().out


@pytest.mark.parametrize("change, message", [
    (dict(y_train=None), "lacks y_train"),
    (dict(y_test=np.zeros(3, dtype=np.int64)), "are not \\[n, ...\\] and \\[n\\]"),
    (dict(y_train="labels"), "are not \\[n, ...\\] and \\[n\\]"),
    (dict(n_classes=3), "integer labels in \\[0, 3\\)"),
])
def test_a_data_set_that_breaks_the_protocol_is_refused(change, message):
    digits = load_dataset("digits")
    fields = {f: getattr(digits, f) for f in ("name", "x_train", "y_train", "x_test", "y_test", "n_classes")}
    fields.update(change)
    data = SimpleNamespace(**{k: v for k, v in fields.items() if v is not None})
    with pytest.raises(ConfigError, match=message):
        train(TrainConfig(steps=2, progress=False), comm=MPI.COMM_SELF, data=data)
