"""The pure parts of `benchmarks/convergence.py`: reading a run's metrics, the seed spread, the
learning-rate choice, the step budget and the per-variant summary."""

import importlib.util
import json
import math
import sys
from pathlib import Path

import pytest

from depthscale.config import load_config

_PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "convergence.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("convergence", _PATH)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    yield module
    del sys.modules[spec.name]


def _line(**row) -> str:
    return json.dumps(row)


def test_read_metrics_keeps_one_point_per_step_the_later_line_winning(bench):
    lines = [
        _line(step=10, split="train", loss=3.0),
        _line(step=10, split="val", loss=2.0, bpb=2.9),
        _line(step=20, split="val", loss=1.9, bpb=2.7),  # logged, then the run was interrupted
        "",
        _line(step=20, split="train", loss=2.5),  # resumed from the step-10 checkpoint
        _line(step=20, split="val", loss=1.8, bpb=2.6),
        _line(step=20, split="eval/arc", acc=0.5),
    ]
    val, train = bench.read_metrics(lines)
    assert val == [(10, 2.9), (20, 2.6)]
    assert train == [(10, 3.0), (20, 2.5)]


def test_spread_is_mean_sample_std_min_max(bench):
    s = bench.spread([1.0, 2.0, 4.0])
    assert s["mean"] == pytest.approx(7 / 3)
    assert s["std"] == pytest.approx(
        math.sqrt(((1 - 7 / 3) ** 2 + (2 - 7 / 3) ** 2 + (4 - 7 / 3) ** 2) / 2)
    )
    assert (s["min"], s["max"], s["n"]) == (1.0, 4.0, 3)
    assert bench.spread([3.0])["std"] == 0.0


def test_best_lr_ignores_diverged_runs_and_fails_when_all_diverged(bench):
    assert bench.best_lr({1e-3: 2.5, 3e-3: math.nan, 6e-3: 2.4}) == 6e-3
    assert bench.best_lr({1e-3: 2.5, 3e-3: 2.2, 6e-3: math.inf}) == 3e-3
    with pytest.raises(RuntimeError, match="every learning rate"):
        bench.best_lr({1e-3: math.nan})


def test_steps_for_budget_fits_the_rounds(bench):
    # 3 sweep runs and 5 others, 2 at a time: 2 + 3 = 5 rounds of 600 s each;
    # a round: 20 s start-up + (steps + 10 eval steps) * 0.5 s  ->  steps = 1160 - 10 = 1150
    steps = bench.steps_for_budget(3000, 0.5, 20, 10, [3, 5], 2)
    assert steps == 1150
    assert 5 * (20 + (steps + 10) * 0.5) <= 3000
    assert bench.steps_for_budget(10, 0.5, 20, 10, [3, 5], 2) == 0


def test_summarise_differences_from_standard_and_adamw(bench):
    def run(residual, optim, seed, bpb):
        job = bench.Job(residual, optim, seed, 3e-3)
        return bench.RunResult(job, 10, 100, 1.0, 1.0, val=[(5, 9.0), (10, bpb)])

    results = [
        run("standard", "adamw", 0, 2.0), run("standard", "adamw", 1, 2.2),
        run("block", "adamw", 0, 1.9), run("block", "adamw", 1, 2.1),
        run("standard", "muon", 0, 1.8), run("standard", "muon", 1, 1.8),
    ]  # fmt: skip
    variants = bench.summarise(results, ["standard", "block", "full"])
    assert set(variants) == {"standard/adamw", "block/adamw", "standard/muon"}
    assert variants["block/adamw"]["minus_standard_bpb"] == pytest.approx(-0.1)
    assert variants["standard/muon"]["minus_adamw_bpb"] == pytest.approx(-0.3)
    assert variants["standard/adamw"]["final_val_bpb"]["std"] == pytest.approx(math.sqrt(0.02))


def test_every_run_is_a_valid_config_holding_out_the_stream_end(bench, tmp_path):
    """The overrides a run passes to `depthscale train` validate, train on the whole stdlib and
    evaluate the last val_fraction of it, ending on an evaluated step."""
    args = bench.argparse.Namespace(
        dim=128, layers=24, heads=4, kv_heads=2, blocks=8, seq=128, batch=8, val_fraction=0.01,
        eval_batches=16, warmup_fraction=0.1, schedule="cosine", log_every=10,
    )  # fmt: skip
    job = bench.Job("block", "adamw", 1, 3e-3)
    cfg = load_config(bench.BASE_CONFIG, bench.overrides(args, job, 120, tmp_path, 20))
    assert (cfg.model.residual, cfg.model.n_layers, cfg.train.seed) == ("block", 24, 1)
    assert (cfg.data.path, cfg.data.max_bytes, cfg.data.val_fraction) == ("stdlib", 0, 0.01)
    assert (cfg.train.steps % cfg.train.eval_every, cfg.optim.warmup_steps) == (0, 12)
