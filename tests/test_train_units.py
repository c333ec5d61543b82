"""Serial unit tests of the training library: schedule, optimizer, layout,
data shards, config checks, and the hand-written backward passes."""
from __future__ import annotations

import math

import array_api_compat
import numpy as np
import pytest

from spar_comm.training.config import TrainConfig
from spar_comm.training.data import Shards, digits, load_dataset
from spar_comm.training.layout import ParamLayout
from spar_comm.training.models import MLP
from spar_comm.training.optim import SGD
from spar_comm.training.schedule import LearningRate

xp = array_api_compat.array_namespace(np.zeros(0))


def test_warmup_then_cosine_to_zero():
    lr = LearningRate(1.0, total=110, warmup=10, kind="cosine")
    assert [lr(s) for s in range(10)] == pytest.approx([(s + 1) / 10 for s in range(10)])
    assert lr(10) == pytest.approx(1.0)
    assert lr(60) == pytest.approx(0.5)
    assert lr(110) == pytest.approx(0.0, abs=1e-12)
    assert all(lr(s) >= lr(s + 1) for s in range(10, 110))


def test_step_schedule_divides_by_ten_at_half_and_three_quarters():
    lr = LearningRate(1.0, total=100, kind="step")
    assert (lr(0), lr(49), lr(50), lr(74), lr(75), lr(99)) == pytest.approx((1, 1, 0.1, 0.1, 0.01, 0.01))


def test_sgd_matches_the_written_recurrence():
    rng = np.random.default_rng(0)
    p = rng.standard_normal(5)
    expected_p, v = p.copy(), np.zeros(5)
    opt = SGD(p, xp, momentum=0.9, weight_decay=0.01)
    for _ in range(3):
        g = rng.standard_normal(5)
        v = 0.9 * v + g + 0.01 * expected_p
        expected_p = expected_p - 0.1 * v
        opt.step(p, g, 0.1)
    np.testing.assert_allclose(p, expected_p, rtol=1e-12)
    np.testing.assert_allclose(opt.velocity, v, rtol=1e-12)


def test_layout_views_write_through_to_the_flat_vector():
    layout = ParamLayout([("w", (2, 3)), ("b", (3,))])
    flat = np.zeros(layout.size)
    views = layout.views(flat, xp)
    views["w"][1, 2] = 5.0
    views["b"][...] = 1.0
    assert layout.size == 9
    assert flat.tolist() == [0, 0, 0, 0, 0, 5, 1, 1, 1]


@pytest.mark.parametrize("depth", [0, 1, 2])
def test_mlp_gradient_matches_finite_differences(depth):
    """The hand-written backward pass against central differences (float64)."""
    rng = np.random.default_rng(depth)
    model = MLP(n_in=5, n_classes=4, hidden=6, depth=depth, xp=xp, dtype="float64")
    params = model.init(seed=1) + 0.1 * rng.standard_normal(model.layout.size)
    batch = (rng.standard_normal((7, 5)), rng.integers(0, 4, 7))
    _, grad = model.loss_and_grad(params, batch)
    grad = grad.copy()
    numeric = np.zeros_like(grad)
    h = 1e-6
    for i in range(params.size):
        up, down = params.copy(), params.copy()
        up[i] += h
        down[i] -= h
        numeric[i] = (model.loss_and_grad(up, batch)[0] - model.loss_and_grad(down, batch)[0]) / (2 * h)
    np.testing.assert_allclose(grad, numeric, rtol=1e-5, atol=1e-8)


def test_mlp_loss_is_the_cross_entropy():
    model = MLP(n_in=3, n_classes=3, hidden=4, depth=1, xp=xp, dtype="float64")
    params = model.init(seed=0)
    x, y = np.eye(3), np.array([0, 1, 2])
    z = model.logits(params, x)
    expected = np.mean(np.log(np.exp(z).sum(axis=1)) - z[np.arange(3), y])
    assert model.loss_and_grad(params, (x, y))[0] == pytest.approx(expected, rel=1e-12)


def test_torch_adapter_gradient_is_autograd_in_the_fused_buffer():
    torch = pytest.importorskip("torch")
    from spar_comm.training.torch_model import small_cnn

    model = small_cnn(seed=0, n_classes=10, dtype="float64")
    params = model.init(0)
    x = torch.randn(4, 64, dtype=torch.float64)
    y = torch.tensor([0, 3, 5, 9])
    loss, grad = model.loss_and_grad(params, (x, y))
    reference = small_cnn(seed=0, n_classes=10, dtype="float64").module
    expected = torch.nn.functional.cross_entropy(reference(x), y)
    expected.backward()
    flat_expected = torch.cat([p.grad.reshape(-1) for p in reference.parameters()])
    assert loss == pytest.approx(float(expected.detach()), rel=1e-12)
    assert torch.equal(grad, flat_expected)
    params -= 1.0  # an in-place update of the flat vector is the module's weights
    assert torch.equal(model.module.conv1.bias, reference.conv1.bias - 1.0)


def test_shards_are_disjoint_equal_and_reshuffled_per_epoch():
    world, batch = 3, 4
    shards = [Shards(50, r, world, batch, seed=7) for r in range(world)]
    spe = shards[0].steps_per_epoch
    assert spe == (50 // world) // batch
    epoch0 = [np.concatenate([s.indices(i) for i in range(spe)]) for s in shards]
    epoch1 = [np.concatenate([s.indices(spe + i) for i in range(spe)]) for s in shards]
    assert len(np.unique(np.concatenate(epoch0))) == world * spe * batch
    assert not np.array_equal(epoch0[0], epoch1[0])
    again = Shards(50, 0, world, batch, seed=7)
    assert np.array_equal(again.indices(spe + 1), shards[0].indices(spe + 1))
    assert shards[0].position(spe + 1) == (1, 1)


def test_digits_are_scikit_learns():
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    mine_x, mine_y = digits()
    assert np.array_equal(mine_x, x) and np.array_equal(mine_y, y)


def test_datasets_have_a_held_out_split():
    digits = load_dataset("digits")
    assert digits.n_features == 64 and digits.n_classes == 10
    assert len(digits.y_test) == round(0.2 * 1797) and len(digits.y_train) + len(digits.y_test) == 1797
    synthetic = load_dataset("synthetic")
    assert synthetic.x_train.dtype == np.float32 and len(np.unique(synthetic.y_train)) == 10


def test_config_problems_and_resume_differences():
    assert TrainConfig().problems() == []
    bad = TrainConfig(density=0, epochs=2, steps=3, resume=True, model="resnet")
    text = " ".join(bad.problems())
    for needle in ("--density", "not both", "--resume needs --checkpoint", "--model"):
        assert needle in text
    a, b = TrainConfig(), TrainConfig(lr=0.2, stop_after=5, trace="x.h5")
    assert set(b.differences(a)) == {"lr"}
    assert TrainConfig.from_json(b.to_json()) == b


@pytest.mark.parametrize("changes, needle", [
    (dict(sync_every=-1), "--sync-every must be >= 0"),
    (dict(sync_every=4, outer_momentum=1.0), "outer momentum must be in [0, 1)"),
    (dict(sync_every=4, outer_lr=0.0), "outer learning rate must be > 0"),
    (dict(sync_every=4, checkpoint="c.h5", checkpoint_every=6), "must be a multiple of --sync-every 4"),
    (dict(sync_every=4, algorithm="powersgd"), "does not reduce pseudo-gradients"),
    (dict(outer_lr=0.7), "need --sync-every H"),
])
def test_the_outer_loop_settings_are_checked(changes, needle):
    assert any(needle in problem for problem in TrainConfig(**changes).problems()), TrainConfig(**changes).problems()


def test_mlp_size_of_the_throughput_task():
    """--hidden 4096 on the synthetic task is the ~16M-parameter model of the issue."""
    layout = MLP(64, 10, 4096, 2, xp, "float32").layout
    assert 15e6 < layout.size < 18e6
    assert layout.size == 64 * 4096 + 4096 + 4096 * 4096 + 4096 + 4096 * 10 + 10
    assert math.prod(layout.shapes["layer1.weight"]) == 4096 * 4096


def test_the_mlp_uses_only_the_array_api_so_cupy_can_run_it():
    """On --device gpu the MLP runs on CuPy through the array API. Run it on
    array-api-strict, which refuses anything outside the standard, and it must
    give NumPy's loss and gradient."""
    strict = pytest.importorskip("array_api_strict")
    rng = np.random.default_rng(0)
    x, y = rng.standard_normal((7, 5)), rng.integers(0, 4, 7)
    answers = []
    for namespace, to in ((xp, np.asarray), (strict, strict.asarray)):
        model = MLP(n_in=5, n_classes=4, hidden=6, depth=2, xp=namespace, dtype="float64")
        params = model.init(seed=1)
        loss, grad = model.loss_and_grad(params, (to(x), to(y)))
        logits = model.logits(params, to(x))
        answers.append((loss, np.asarray(grad), np.asarray(logits)))
    (loss, grad, logits), (strict_loss, strict_grad, strict_logits) = answers
    assert loss == strict_loss and np.array_equal(grad, strict_grad) and np.array_equal(logits, strict_logits)
