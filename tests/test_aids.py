"""Serial tests of the convergence aids (spar_comm/training/aids.py): each
transformation against its written recurrence, the density schedule, and the
settings' checks."""
from __future__ import annotations

import array_api_compat
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from spar_comm.training.aids import LocalAids, MomentumCorrection, clip_by_norm
from spar_comm.training.density import DensityWarmup
from spar_comm.training.config import TrainConfig
from spar_comm.training.optim import SGD

xp = array_api_compat.array_namespace(np.zeros(0))


def test_density_warmup_is_dgcs_schedule():
    schedule = DensityWarmup(target=0.001, start=0.25, epochs=4, steps_per_epoch=10)
    by_epoch = [schedule(10 * epoch + 3) for epoch in range(7)]
    assert by_epoch == pytest.approx([0.25, 0.25 * 0.004 ** 0.25, 0.25 * 0.004 ** 0.5, 0.25 * 0.004 ** 0.75,
                                      0.001, 0.001, 0.001])
    assert [schedule(s) for s in range(10)] == [0.25] * 10  # constant within an epoch
    assert all(schedule(s) >= schedule(s + 1) for s in range(60))


@pytest.mark.parametrize("start, epochs", [(0.001, 4), (0.0001, 4), (0.25, 0)])
def test_no_warmup_when_it_would_not_fall(start, epochs):
    schedule = DensityWarmup(target=0.001, start=start, epochs=epochs, steps_per_epoch=5)
    assert {schedule(s) for s in range(40)} == {0.001}


@settings(max_examples=50, deadline=None)
@given(st.lists(st.floats(-1e3, 1e3), min_size=1, max_size=50), st.floats(1e-3, 1e3))
def test_clip_bounds_the_norm_and_keeps_the_direction(values, max_norm):
    grad = np.array(values)
    before = grad.copy()
    norm = clip_by_norm(grad, max_norm, xp)
    assert norm == pytest.approx(np.linalg.norm(before))
    assert np.linalg.norm(grad) <= max_norm * (1 + 1e-12)
    if norm <= max_norm:
        assert np.array_equal(grad, before)
    else:
        np.testing.assert_allclose(grad * norm / max_norm, before, rtol=1e-12, atol=1e-12)


def test_momentum_correction_follows_dgcs_recurrence_and_masks_what_was_sent():
    rng = np.random.default_rng(1)
    params = rng.standard_normal(6)
    aid = MomentumCorrection(momentum=0.9, weight_decay=0.01, masking=True)
    velocity, expected = aid.init(params, xp), np.zeros(6)
    for _ in range(3):
        g = rng.standard_normal(6)
        expected = 0.9 * expected + g + 0.01 * params
        sent, velocity = aid.update(g, velocity, params)
        np.testing.assert_array_equal(sent, velocity)
        np.testing.assert_allclose(velocity, expected, rtol=1e-12)
        reduced = np.where(rng.random(6) < 0.5, rng.standard_normal(6), 0.0)
        velocity = aid.mask(velocity, reduced, xp)
        expected[reduced != 0] = 0
        np.testing.assert_array_equal(velocity, expected)
    unmasked = MomentumCorrection(0.9, 0.0, masking=False)
    v = np.ones(3)
    assert np.array_equal(unmasked.mask(v, np.ones(3), xp), np.ones(3))


def test_everything_sent_makes_momentum_correction_the_ordinary_momentum_sgd():
    """On one rank with nothing selected away (density 1), sending the local
    velocity and taking a plain SGD step is momentum SGD with weight decay."""
    rng = np.random.default_rng(2)
    config = TrainConfig(momentum=0.9, weight_decay=5e-4, momentum_masking=False)
    p_ref = rng.standard_normal(8)
    p = p_ref.copy()
    reference = SGD(p_ref, xp, config.momentum, config.weight_decay)
    aids = LocalAids(config, sparse=True, world_size=1, params=p, xp=xp)
    corrected = SGD(p, xp, aids.optimizer_momentum, aids.optimizer_weight_decay)
    assert (aids.optimizer_momentum, aids.optimizer_weight_decay) == (0.0, 0.0)
    for _ in range(5):
        g = rng.standard_normal(8)
        reference.step(p_ref, g.copy(), 0.1)
        corrected.step(p, aids.before_allreduce(g.copy(), p), 0.1)
    np.testing.assert_allclose(p, p_ref, rtol=1e-12)


def test_dense_algorithms_get_no_aids():
    config = TrainConfig(algorithm="dense", clip_norm=1.0)
    params = np.zeros(4)
    aids = LocalAids(config, sparse=False, world_size=4, params=params, xp=xp)
    g = np.full(4, 10.0)
    assert np.array_equal(aids.before_allreduce(g, params), np.full(4, 10.0))
    assert aids.velocity is None
    assert (aids.optimizer_momentum, aids.optimizer_weight_decay) == (config.momentum, config.weight_decay)


def test_clip_threshold_is_divided_by_the_root_of_the_world_size():
    config = TrainConfig(clip_norm=4.0, momentum_correction=False, momentum_masking=False)
    params = np.zeros(2)
    aids = LocalAids(config, sparse=True, world_size=16, params=params, xp=xp)
    g = aids.before_allreduce(np.array([30.0, 40.0]), params)
    np.testing.assert_allclose(g, [0.6, 0.8])


@pytest.mark.parametrize("changes, message", [
    (dict(momentum_correction=False, momentum_masking=True), "--momentum-masking clears the corrected velocity"),
    (dict(density_warmup_start=0.0), "--density-warmup-start must be in (0, 1]"),
    (dict(density_warmup_start=1.5), "--density-warmup-start must be in (0, 1]"),
    (dict(density_warmup=-1), "--density-warmup must be >= 0"),
    (dict(clip_norm=-0.5), "--clip-norm must be >= 0"),
])
def test_bad_aid_settings_are_named(changes, message):
    problems = TrainConfig(**changes).problems()
    assert any(message in p for p in problems), problems

