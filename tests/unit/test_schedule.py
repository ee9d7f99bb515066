"""Learning-rate schedules: warmup values, cosine/WSD end points and shape, constant."""

import math

import pytest
import torch

from depthscale.config import OptimConfig
from depthscale.train.schedule import lr_at, set_lr

TOTAL = 100


def cfg(schedule: str, **kw) -> OptimConfig:
    return OptimConfig(lr=1.0, min_lr_ratio=0.1, warmup_steps=10, schedule=schedule, **kw)


@pytest.mark.parametrize("schedule", ["cosine", "wsd", "constant"])
def test_warmup_is_linear_from_lr_over_warmup(schedule):
    c = cfg(schedule)
    assert [lr_at(s, c, TOTAL) for s in range(10)] == pytest.approx(
        [(s + 1) / 10 for s in range(10)]
    )
    assert lr_at(10, c, TOTAL) == pytest.approx(1.0)  # first step after warmup is at full lr


def test_cosine_ends_at_floor_and_decays_monotonically():
    c = cfg("cosine")
    lrs = [lr_at(s, c, TOTAL) for s in range(10, TOTAL)]
    assert lrs[-1] == pytest.approx(0.1)  # lr·min_lr_ratio at the last step (step 99)
    assert all(a > b for a, b in zip(lrs, lrs[1:]))
    # Step 54 is 44 of the 89 decay steps (10..99) in: floor + (lr-floor)·½(1+cos(π·44/89)).
    assert lr_at(54, c, TOTAL) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 44 / 89)))
    assert lr_at(TOTAL + 5, c, TOTAL) == pytest.approx(0.1)  # past the end: stays at the floor


def test_wsd_plateau_then_linear_decay_to_floor():
    c = cfg("wsd", decay_fraction=0.2)  # decay over the last 20 steps: 80..99
    assert all(lr_at(s, c, TOTAL) == 1.0 for s in range(10, 80))
    decay = [lr_at(s, c, TOTAL) for s in range(80, TOTAL)]
    assert decay == pytest.approx([1.0 - 0.9 * (k + 1) / 20 for k in range(20)])
    assert decay[-1] == pytest.approx(0.1)
    assert all(a > b for a, b in zip(decay, decay[1:]))


def test_wsd_decay_never_starts_inside_warmup():
    c = cfg("wsd", decay_fraction=1.0)
    assert lr_at(9, c, 20) == pytest.approx(1.0)  # warmup end
    assert lr_at(19, c, 20) == pytest.approx(0.1)  # decay over steps 10..19, end at floor


def test_constant_and_no_warmup():
    c = OptimConfig(lr=3e-3, warmup_steps=0, schedule="constant")
    assert {lr_at(s, c, TOTAL) for s in range(TOTAL)} == {3e-3}
    assert lr_at(0, OptimConfig(lr=2.0, warmup_steps=0, schedule="cosine"), TOTAL) == 2.0


def test_bad_arguments():
    with pytest.raises(ValueError, match="total_steps"):
        lr_at(0, cfg("cosine"), 0)
    with pytest.raises(ValueError, match="step"):
        lr_at(-1, cfg("cosine"), TOTAL)


def test_set_lr_sets_every_group():
    a, b = torch.zeros(1, requires_grad=True), torch.zeros(1, requires_grad=True)
    opt = torch.optim.SGD([{"params": [a]}, {"params": [b], "lr": 5.0}], lr=1.0)
    set_lr(opt, 0.25)
    assert [g["lr"] for g in opt.param_groups] == [0.25, 0.25]
