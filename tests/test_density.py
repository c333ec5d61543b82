"""Density schedules (spar_comm/training/density.py): Accordion's switch
against the paper's rule written out here, its state through a checkpoint's
round trip, and the settings' checks. DGC's warm-up is tested in test_aids.py."""
from __future__ import annotations

import array_api_compat
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from spar_comm.training.config import TrainConfig
from spar_comm.training.density import Accordion, DensityWarmup, Fixed, accordion_high, make_schedule

xp = array_api_compat.array_namespace(np.zeros(0))


def paper_rule(epoch_norms, low, high, eta):
    """Agarwal et al.'s detection, independently: epoch 0 critical; epoch e+1 is
    critical when |n(e-1) - n(e)| / n(e-1) >= eta."""
    densities = [high]
    for e in range(len(epoch_norms) - 1):
        if e == 0:
            densities.append(high)
            continue
        before, now = epoch_norms[e - 1], epoch_norms[e]
        densities.append(high if before == 0 or abs(before - now) / before >= eta else low)
    return densities


@settings(max_examples=60, deadline=None)
@given(scales=st.lists(st.floats(0.0, 100.0), min_size=1, max_size=8), eta=st.floats(0.05, 2.0),
       steps_per_epoch=st.integers(1, 4), seed=st.integers(0, 2**16))
def test_accordion_switches_as_the_paper_says(scales, eta, steps_per_epoch, seed):
    rng = np.random.default_rng(seed)
    schedule = Accordion(target=0.01, high=0.1, eta=eta, steps_per_epoch=steps_per_epoch)
    norms, used = [], []
    for epoch, scale in enumerate(scales):
        total = np.zeros(5)
        for s in range(steps_per_epoch):
            step = epoch * steps_per_epoch + s
            used.append(schedule(step))
            update = rng.standard_normal(5) * scale
            total += update
            schedule.observe(step, update, xp)
        norms.append(float(np.linalg.norm(total)))
    expected = paper_rule(norms, 0.01, 0.1, eta)
    assert used == [d for d in expected for _ in range(steps_per_epoch)]


def test_a_steady_run_falls_to_the_target_and_a_jump_raises_it_again():
    schedule = Accordion(target=0.001, high=0.01, eta=0.5, steps_per_epoch=1)
    seen = []
    for step, scale in enumerate([10.0, 9.0, 8.5, 8.0, 1.0, 0.9]):
        seen.append(schedule(step))
        schedule.observe(step, np.full(4, scale), xp)
    # epoch 0 and 1 high (no earlier norm to compare with at the end of epoch 0),
    # small changes: low; the fall from 8 to 1 (-88%) is critical: high for the epoch after it
    assert seen == [0.01, 0.01, 0.001, 0.001, 0.001, 0.01]


def test_the_state_survives_a_round_trip_mid_epoch():
    updates = [np.random.default_rng(s).standard_normal(6) * (1 + s % 3) for s in range(12)]
    straight = Accordion(0.01, 0.2, 0.3, steps_per_epoch=3)
    for step, u in enumerate(updates):
        straight.observe(step, u, xp)
    first = Accordion(0.01, 0.2, 0.3, steps_per_epoch=3)
    for step, u in enumerate(updates[:7]):
        first.observe(step, u, xp)
    state = first.state_dict()
    state["accumulated"] = np.array(state["accumulated"])  # as a checkpoint hands it back
    resumed = Accordion(0.01, 0.2, 0.3, steps_per_epoch=3)
    resumed.load_state_dict(state, xp, like=np.zeros(6))
    for step, u in enumerate(updates[7:], start=7):
        resumed.observe(step, u, xp)
    assert resumed.state_dict()["previous_norm"] == straight.state_dict()["previous_norm"]
    assert resumed(12) == straight(12)
    assert np.array_equal(resumed.accumulated, straight.accumulated)
    fresh = Accordion(0.01, 0.2, 0.3, steps_per_epoch=3).state_dict()
    assert fresh["accumulated"] is None and fresh["previous_norm"] == -1.0 and fresh["density"] == 0.2


def test_make_schedule_builds_each_kind_and_refuses_others():
    assert type(make_schedule("fixed", 0.01, 10)) is Fixed and make_schedule("fixed", 0.01, 10)(99) == 0.01
    warm = make_schedule("warmup", 0.01, 10, warmup_start=0.25, warmup_epochs=2)
    assert isinstance(warm, DensityWarmup) and warm(0) == 0.25 and warm(20) == 0.01
    assert "warm-up from 0.25 over 2 epochs" in warm.describe()
    acc = make_schedule("accordion", 0.01, 10, eta=0.4)
    assert isinstance(acc, Accordion) and (acc.high, acc.eta) == (0.1, 0.4) and "accordion" in acc.describe()
    assert accordion_high(0.5, 0.0) == 1.0 and accordion_high(0.01, 0.03) == 0.03
    with pytest.raises(ValueError, match="density schedule must be one of fixed, warmup, accordion"):
        make_schedule("cyclic", 0.01, 10)


@pytest.mark.parametrize("changes, message", [
    (dict(density_schedule="cyclic"), "--density-schedule must be one of fixed, warmup, accordion"),
    (dict(accordion_high=1.5), "--accordion-high must be in"),
    (dict(density=0.1, accordion_high=0.05), "--accordion-high must be in"),
    (dict(accordion_eta=0.0), "--accordion-eta must be > 0"),
])
def test_bad_schedule_settings_are_named(changes, message):
    problems = TrainConfig(**changes).problems()
    assert any(message in p for p in problems), problems
