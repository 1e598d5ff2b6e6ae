import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from marginkit.schedules import (
    Constant,
    CosineDecay,
    HyperparameterScheduler,
    Join,
    LinearWarmup,
)


class ToyLoss(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.margin = 0.25
        self.gamma = 256.0
        self.reduction = "mean"
        self.register_buffer("scale", torch.tensor(30.0, dtype=torch.float64))
        self.weight = torch.nn.Parameter(torch.ones(()))

    @property
    def frozen(self) -> float:
        return 1.0


def test_values_at_known_steps():
    lin = LinearWarmup(32.0, 64.0, steps=1000)
    assert [lin(t) for t in (0, 250, 500, 1000, 5000)] == [32.0, 40.0, 48.0, 64.0, 64.0]
    cos = CosineDecay(0.5, 0.25, steps=100)
    assert cos(0) == 0.5 and cos(100) == 0.25 and cos(10**6) == 0.25
    assert cos(50) == pytest.approx(0.375, abs=1e-15)
    assert cos(25) == pytest.approx(0.25 + 0.125 * (1 + math.sqrt(0.5)), abs=1e-15)
    assert Constant(3)(0) == Constant(3)(10**9) == 3.0
    down = LinearWarmup(1.0, 0.0, 4)
    assert [down(t) for t in range(6)] == [1.0, 0.75, 0.5, 0.25, 0.0, 0.0]


@given(
    st.floats(-1e3, 1e3),
    st.floats(-1e3, 1e3),
    st.integers(1, 10_000),
    st.integers(0, 20_000),
)
def test_schedules_equal_closed_forms_and_stay_between_endpoints(start, end, steps, step):
    t = min(step / steps, 1.0)
    lin, cos = LinearWarmup(start, end, steps)(step), CosineDecay(start, end, steps)(step)
    assert lin == pytest.approx(start + (end - start) * t, rel=1e-12, abs=1e-9)
    assert cos == pytest.approx(end + (start - end) * (1 + math.cos(math.pi * t)) / 2, rel=1e-12, abs=1e-9)
    lo, hi = min(start, end), max(start, end)
    for v in (lin, cos):
        assert lo - 1e-9 <= v <= hi + 1e-9


@given(st.integers(0, 400))
def test_join_restarts_each_piece_at_its_boundary(step):
    warm, decay, tail = LinearWarmup(0.0, 1.0, 100), CosineDecay(1.0, 0.1, 200), Constant(0.1)
    joined = Join([warm, decay, tail], [100, 300])
    expected = warm(step) if step < 100 else decay(step - 100) if step < 300 else tail(step - 300)
    assert joined(step) == expected


def test_schedules_are_immutable_values():
    a = LinearWarmup(1, 2, 3)
    assert (
        a == LinearWarmup(1.0, 2.0, 3)
        and a != CosineDecay(1, 2, 3)
        and hash(a) == hash(LinearWarmup(1, 2, 3))
    )
    assert repr(a) == "LinearWarmup(start=1.0, end=2.0, steps=3)"
    with pytest.raises(AttributeError, match="immutable"):
        a.steps = 5


def test_scheduler_applies_step0_then_each_step():
    loss = ToyLoss()
    sched = HyperparameterScheduler(
        loss, {"gamma": LinearWarmup(32, 64, 4), "margin": CosineDecay(0.5, 0.25, 2), "scale": Constant(16)}
    )
    assert (loss.gamma, loss.margin, float(loss.scale)) == (32.0, 0.5, 16.0)
    assert loss.scale.dtype == torch.float64  # buffer filled in place
    seen = [sched.step() for _ in range(5)]
    assert [v["gamma"] for v in seen] == [40.0, 48.0, 56.0, 64.0, 64.0]
    assert seen[0]["margin"] == pytest.approx(0.375) and seen[1]["margin"] == 0.25
    assert loss.gamma == 64.0 and loss.margin == 0.25 and sched.last_step == 5
    assert sched.values() == seen[-1]


def test_resume_from_state_dict_matches_uninterrupted_run():
    plan = {"gamma": Join([LinearWarmup(32, 64, 7), Constant(64)], [7]), "margin": CosineDecay(0.4, 0.2, 11)}
    ref_loss = ToyLoss()
    ref = HyperparameterScheduler(ref_loss, plan)
    trace = [ref.step() for _ in range(20)]

    first_loss = ToyLoss()
    first = HyperparameterScheduler(first_loss, plan)
    for _ in range(9):
        first.step()
    state = first.state_dict()
    assert state == {"step": 9, "names": ["gamma", "margin"]}

    resumed_loss = ToyLoss()  # fresh object with constructor defaults
    resumed = HyperparameterScheduler(resumed_loss, plan)
    resumed.load_state_dict(state)
    assert (resumed_loss.gamma, resumed_loss.margin) == (first_loss.gamma, first_loss.margin)
    rest = [resumed.step() for _ in range(11)]
    assert rest == trace[9:]
    assert (resumed_loss.gamma, resumed_loss.margin) == (ref_loss.gamma, ref_loss.margin)


def test_missing_attribute_is_named_with_the_available_ones():
    with pytest.raises(AttributeError, match=r"'gama'.*ToyLoss.*available: gamma, margin, scale$"):
        HyperparameterScheduler(ToyLoss(), {"gama": Constant(1)})


@pytest.mark.parametrize(
    ("schedules", "error", "match"),
    [
        ({"reduction": Constant(1)}, TypeError, "ToyLoss.reduction is a str, not a number"),
        ({"weight": Constant(1)}, TypeError, "learnable nn.Parameter"),
        ({"frozen": Constant(1)}, TypeError, "read-only"),
        ({}, TypeError, "non-empty mapping"),
        ({"margin": 0.3}, TypeError, r"schedules\['margin'\] must be callable"),
        ({"margin": lambda step: math.nan}, ValueError, "margin schedule value must be finite"),
    ],
)
def test_scheduler_rejects_bad_targets(schedules, error, match):
    with pytest.raises(error, match=match):
        HyperparameterScheduler(ToyLoss(), schedules)


def test_plain_objects_and_callables_work():
    class Cfg:
        margin = 1.0

    cfg = Cfg()
    sched = HyperparameterScheduler(cfg, {"margin": lambda step: 1.0 / (1 + step)})
    sched.step()
    assert cfg.margin == 0.5


@pytest.mark.parametrize(
    ("make", "error", "match"),
    [
        (lambda: LinearWarmup(0, 1, 0), ValueError, "steps must be >= 1"),
        (lambda: CosineDecay(0, 1, 2.5), TypeError, "steps must be an int"),
        (lambda: LinearWarmup(math.inf, 1, 2), ValueError, "start must be finite"),
        (lambda: CosineDecay(0, "1", 2), TypeError, "end must be a real number"),
        (lambda: Constant(True), TypeError, "value must be a real number"),
        (lambda: Join([Constant(1), Constant(2)], []), ValueError, "boundaries must have"),
        (lambda: Join([Constant(1), Constant(2), Constant(3)], [5, 5]), ValueError, "strictly increasing"),
        (lambda: Join([], []), TypeError, "non-empty sequence"),
        (lambda: LinearWarmup(0, 1, 5)(-1), ValueError, "step must be >= 0"),
    ],
)
def test_schedule_arguments_are_validated(make, error, match):
    with pytest.raises(error, match=match):
        make()


def test_load_state_dict_validates():
    sched = HyperparameterScheduler(ToyLoss(), {"margin": Constant(0.1)})
    with pytest.raises(ValueError, match="must contain 'step'"):
        sched.load_state_dict({})
    with pytest.raises(ValueError, match="do not match"):
        sched.load_state_dict({"step": 3, "names": ["gamma"]})
    with pytest.raises(ValueError, match="step'\\] must be >= 0"):
        sched.load_state_dict({"step": -2})


def test_scheduled_circle_loss_equals_a_loss_built_with_those_values(gen):
    # Integration: the library's losses read their hyper-parameters at forward time, so a
    # scheduled loss computes exactly what a loss constructed with the scheduled values does.
    from marginkit.losses import CircleLoss

    emb = torch.randn(12, 8, generator=gen, dtype=torch.float64)
    labels = torch.tensor([0, 0, 0, 1, 1, 1, 2, 2, 2, 3, 3, 3])
    loss = CircleLoss(margin=0.25, gamma=256.0)
    sched = HyperparameterScheduler(
        loss, {"gamma": LinearWarmup(32, 64, 4), "margin": CosineDecay(0.4, 0.25, 4)}
    )
    for _ in range(3):
        values = sched.step()
        expected = CircleLoss(margin=values["margin"], gamma=values["gamma"])(emb, labels)
        assert torch.equal(loss(emb, labels), expected)
    assert values["gamma"] == 56.0
