"""FLOPs per token by hand, peak FLOP/s detection, throughput/MFU, and the metrics log files."""

import json
import math

import pytest
import torch

from depthscale.config import ModelConfig
from depthscale.observe import metrics
from depthscale.observe.metrics import (
    MEASURED,
    Throughput,
    _best_rate,
    detect_peak_flops,
    flops_per_token,
)
from depthscale.observe.metrics_log import METRICS, SUPERSEDED, MetricsLogger


def small() -> ModelConfig:
    return ModelConfig(vocab_size=256, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=160)


def test_flops_per_token_matches_hand_count():
    # head_dim 16; per layer: wq 64·64 + wk 64·32 + wv 64·32 + wo 64·64 = 12288, SwiGLU 3·64·160 = 30720
    # -> 43008; two layers 86016; LM head 64·256 = 16384; N = 102400 (embedding lookup not counted).
    n = 2 * (4096 + 2048 + 2048 + 4096 + 3 * 64 * 160) + 64 * 256
    assert n == 102400
    # Attention over T = 16, the whole causal score matrix (shape/model.py's convention): a query
    # counts 16 keys. Forward per layer per token: QKᵀ 2·64·16 + AV 2·64·16 = 4096; two layers
    # 8192. Training = 3 × forward.
    expected = 3 * (2 * n + 2 * 4 * 64 * 16)
    assert expected == 638976.0
    assert flops_per_token(small(), 16) == pytest.approx(expected)
    # HFU's numerator: full recompute runs every layer's forward matmuls and attention again
    recomputed = 2 * (2 * (4096 + 2048 + 2048 + 4096 + 3 * 64 * 160) + 4 * 64 * 16)
    assert flops_per_token(small(), 16, "full") == pytest.approx(expected + recomputed)
    assert flops_per_token(small(), 16, "selective") == flops_per_token(small(), 16)


def test_sliding_window_lowers_attention_flops():
    # Window 4 over T = 16: a query counts 4 keys; a window at least T counts them all.
    windowed = ModelConfig(**{**small().__dict__, "sliding_window": 4})
    assert flops_per_token(windowed, 16) == pytest.approx(6 * 102400 + 12 * 2 * 64 * 4)
    assert flops_per_token(windowed, 16) < flops_per_token(small(), 16)
    for w in (16, 99):
        wide = ModelConfig(**{**small().__dict__, "sliding_window": w})
        assert flops_per_token(wide, 16) == flops_per_token(small(), 16)


def test_flops_per_token_needs_a_vocab_size():
    with pytest.raises(ValueError, match="vocab_size"):
        flops_per_token(ModelConfig(), 16)


def test_detect_peak_flops_on_cpu_is_measured():
    flops, source = detect_peak_flops(torch.device("cpu"), torch.float32)
    assert flops > 0 and math.isfinite(flops)
    assert source.startswith(MEASURED) and f"x {torch.get_num_threads()} threads" in source


def test_the_cpu_peak_is_one_cores_rate_times_the_threads_and_at_least_fp32s(monkeypatch):
    """Injected per-core rates: the peak scales with the threads, and a bf16 run on a CPU whose
    bf16 matmuls are slower than its fp32 ones (no bf16 units: 2.7 vs 80 GFLOP/s per core here)
    gets fp32's peak, which its fp32-accumulating kernels approach (against the bf16 rate alone
    every bf16 run printed a capped 100 %); a CPU with fast bf16 keeps its own."""
    rates = {torch.float32: (80e9, 512), torch.bfloat16: (2.7e9, 128), torch.float16: (300e9, 1024)}
    monkeypatch.setattr(metrics, "_core_rate", lambda dtype: rates[dtype])
    assert metrics._cpu_peak(torch.float32, 4) == (
        320e9,
        f"{MEASURED} (cpu, torch.float32, 512x512 on one core x 4 threads)",
    )
    peak, source = metrics._cpu_peak(torch.bfloat16, 2)
    assert peak == 160e9 and source == (
        f"{MEASURED} (cpu, torch.bfloat16 matmuls at 5.4 GFLOP/s here, slower than float32's: "
        "float32's 512x512 on one core x 2 threads)"
    )
    assert metrics._cpu_peak(torch.float16, 2)[0] == 600e9


def test_a_measured_peak_is_the_fastest_of_several_timed_trials_after_a_warmup():
    """A fake clock (binary fractions: exact sums): the warm-up (calls until `warmup_s` passed)
    and trials slowed by a busy machine do not count; exactly as many trials run as asked (a
    further call would raise StopIteration)."""
    now = [0.0]

    def timed(durations):
        steps = iter(durations)

        def run() -> None:
            now[0] += next(steps)

        return run

    run = timed([8.0, 0.5, 0.125, 0.375, 0.25, 0.75])
    assert _best_rate(run, 1e9, trials=5, budget_s=0.0, clock=lambda: now[0]) == 8e9
    # at least 5 trials, then more while within the budget (3 s): 7 trials
    run = timed([8.0, 0.5, 0.5, 0.5, 0.5, 0.5, 0.0625, 0.5])
    assert _best_rate(run, 1e9, trials=5, budget_s=3.0, clock=lambda: now[0]) == 16e9
    # warm-up calls until 1 s has passed (a fast one among them does not count), then 5 trials
    run = timed([0.25, 0.25, 0.0625, 0.5, 0.5, 0.5, 0.5, 0.5, 0.5])
    rate = _best_rate(run, 1e9, trials=5, budget_s=0.0, clock=lambda: now[0], warmup_s=1.0)
    assert rate == 2e9


@pytest.mark.parametrize(
    ("source", "kind"),
    [(f"{MEASURED} (cpu, torch.float32, 512x512 on one core x 2 threads)", "note"),
     ("spec sheet", "warning")],
)  # fmt: skip
def test_mfu_never_exceeds_100_percent_and_a_raised_peak_is_said_once(source, kind):
    """A peak measured while the machine was busy (or a wrong spec) is raised to the rate a window
    achieves, and the first raise leaves one note for the console (it was logged at INFO, which
    no console showed, so a bf16 CPU run printed a capped "mfu 100.0%" as if measured)."""
    tp = Throughput(flops_per_token=1e6, peak_flops=1e9, window=2, peak_source=source)
    tp.update(500, 1.0)  # 0.5e9 FLOP/s: below the peak, nothing to say
    assert tp.rate()["mfu"] == 0.5 and tp.take_note() is None
    tp.update(3500, 1.0)  # window 2e9: twice the peak
    assert tp.rate()["mfu"] == 1.0 and tp.peak_flops == 2e9
    assert tp.take_note() == (
        f"{kind}: achieved 2 GFLOP/s per device, above the peak 1 GFLOP/s ({source}): MFU is "
        "reported against the best rate achieved from here on"
    )
    assert tp.take_note() is None  # once
    tp.update(2500, 1.0)  # window 3e9
    assert tp.rate()["mfu"] == 1.0 and tp.peak_flops == 3e9 and tp.take_note() is None
    tp.update(3000, 1.0)  # window 2.75e9: below the best, against it
    assert tp.rate()["mfu"] == pytest.approx(2.75 / 3)
    assert tp.take_note() is None


def test_throughput_window_rate_and_mfu():
    tp = Throughput(flops_per_token=1e6, peak_flops=1e9, window=2)
    tp.update(100, 1.0)  # falls out of the window below
    tp.update(300, 0.5)
    tp.update(500, 0.5)
    rate = tp.rate()
    assert rate["tokens_per_s"] == pytest.approx(800.0)
    assert rate["tflops"] == pytest.approx(800 * 1e6 / 1e12)
    assert rate["mfu"] == pytest.approx(800 * 1e6 / 1e9)
    assert Throughput(1e6, 0.0).rate() == {
        "tokens_per_s": 0.0, "tflops": 0.0, "mfu": None, "hfu": None
    }  # fmt: skip


def test_hfu_counts_what_recompute_runs_again_and_raises_the_peak_by_it():
    tp = Throughput(flops_per_token=1e6, peak_flops=1e9, hardware_flops_per_token=1.5e6)
    tp.update(400, 1.0)
    rate = tp.rate()
    assert rate["mfu"] == pytest.approx(0.4) and rate["hfu"] == pytest.approx(0.6)
    tp.update(400, 0.0001)  # 800 tokens in ~1 s: HFU past 1 raises the peak, MFU follows it
    rate = tp.rate()
    assert rate["hfu"] == 1.0 and rate["mfu"] == pytest.approx(1 / 1.5)


def _tb_scalars(run_dir, tag):
    """(step, value) of a TensorBoard tag as TensorBoard shows it (purged steps dropped)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir / "tb"))
    events.Reload()
    return [(e.step, e.value) for e in events.Scalars(tag)]


def test_a_resumed_run_supersedes_the_records_it_trains_again(tmp_path):
    """Trained to step 5, resumed from the checkpoint of step 3: steps 4-5 are trained again, so
    their first records move to metrics.superseded.jsonl, and TensorBoard purges them."""
    with MetricsLogger(tmp_path, tensorboard=True, start_step=0) as logger:
        for step in range(1, 6):
            logger.log(step, {"loss": 10.0 - step})
        logger.event(3, "checkpoint", {"step": 3, "blocking_s": 0.1})
    with (tmp_path / METRICS).open("a") as fh:
        fh.write('{"step": 6, "split": "tra')  # torn by the crash
    with MetricsLogger(tmp_path, tensorboard=True, start_step=3) as logger:
        for step in range(4, 7):
            logger.log(step, {"loss": 100.0 - step})
    records = [json.loads(line) for line in (tmp_path / METRICS).read_text().splitlines()]
    steps = [r["step"] for r in records if r["split"] == "train"]
    assert steps == [1, 2, 3, 4, 5, 6]  # each step once, in order
    assert [r["loss"] for r in records if r["split"] == "train"][3:] == [96.0, 95.0, 94.0]
    assert [r["split"] for r in records].count("checkpoint") == 1
    superseded = (tmp_path / SUPERSEDED).read_text().splitlines()
    assert [json.loads(line)["step"] for line in superseded[:2]] == [4, 5]
    assert superseded[2].startswith('{"step": 6, "split": "tra')
    assert _tb_scalars(tmp_path, "train/loss") == [
        (1, 9.0), (2, 8.0), (3, 7.0), (4, 96.0), (5, 95.0), (6, 94.0)
    ]  # fmt: skip


def test_a_rollback_supersedes_from_its_checkpoint(tmp_path):
    with MetricsLogger(tmp_path, tensorboard=False, start_step=0) as logger:
        for step in range(1, 5):
            logger.log(step, {"loss": 1.0})
        logger.supersede(2)
        logger.log(3, {"loss": 2.0})
    steps = [json.loads(line)["step"] for line in (tmp_path / METRICS).read_text().splitlines()]
    assert steps == [1, 2, 3]


def test_metrics_logger_writes_json_lines_and_tensorboard(tmp_path):
    with MetricsLogger(tmp_path, tensorboard=True) as logger:
        logger.log(1, {"loss": 2.5, "lr": 1e-3, "mfu": None})
        logger.log(2, {"loss": float("nan"), "tokens": 4096})
        logger.log(2, {"loss": 2.0}, prefix="val")
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["split"]) for r in records] == [(1, "train"), (2, "train"), (2, "val")]
    assert records[0]["loss"] == 2.5 and records[0]["mfu"] is None
    assert records[1]["loss"] is None and records[1]["tokens"] == 4096  # non-finite -> null
    assert list((tmp_path / "tb").glob("events.out.tfevents.*"))
    with MetricsLogger(tmp_path, tensorboard=False) as logger:  # appends, no TensorBoard needed
        logger.log(3, {"loss": 1.0})
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 4
    with pytest.raises(ValueError, match="reserved"), MetricsLogger(tmp_path, False) as logger:
        logger.log(4, {"step": 1.0})


def test_the_mixture_metrics_docs_name_are_the_tensorboard_tags(tmp_path):
    """docs/data.md names each source's metrics as TensorBoard and W&B show them: it said
    `tokens/<name>` where they show `train/tokens/<name>`."""
    import re
    from pathlib import Path

    from depthscale.data.mixture import ORDER, mixture_metrics

    state = {"order": ORDER, "sources": {"web": {"served": 3, "epoch": 1}}}
    with MetricsLogger(tmp_path, tensorboard=True) as logger:  # as the trainer logs a step
        logger.log(1, {"loss": 2.0, **mixture_metrics(state, seq_len=8)})
    text = (Path(__file__).resolve().parents[2] / "docs" / "data.md").read_text()
    paragraph = text[text.index("A source smaller than its share") :].split("\n\n")[0]
    named = re.findall(r"metrics log `([\w/<>]+)`[^`]*`([\w/<>]+)`", paragraph)
    assert named, paragraph
    tags = {name.replace("<name>", "web") for name in named[0]}
    assert tags == {"train/tokens/web", "train/epoch/web"}
    assert dict(_tb_scalars(tmp_path, "train/tokens/web")) == {1: 24.0}
    assert dict(_tb_scalars(tmp_path, "train/epoch/web")) == {1: 1.0}
