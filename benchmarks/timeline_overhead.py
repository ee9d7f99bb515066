"""What always-on spans cost, and how long merging a run's traces takes.

    python benchmarks/timeline_overhead.py [--steps-per-block 4 --blocks 40 --micro-batch 1
                                            --merge-steps 1000 --out benchmarks/results/...json]

1. Step time with spans on vs off: one Trainer (the default tiny config, one process) runs blocks
   of steps alternately recording and not (interleaved, so drift and warm-up hit both alike); the
   micro-batch size sets how many spans a step records (1 → two per sequence plus the step's own).
   Reported: median step time of each, their ratio with a bootstrap 95% interval, spans per step,
   and the hot-path cost of one span measured alone (begin + end, 100,000 times) times the spans
   per step over the step time: the overhead without the step-to-step noise of a 2-core machine.
   The MegaScale paper calls its monitor's overhead "negligible" without a number; this is ours.
2. Merge time: four ranks' trace files of `--merge-steps` steps of a pp=2 × dp=2 1F1B schedule
   (synthetic spans and messages in the recorder's format), merged into one Perfetto trace by
   `depthscale.observe.timeline.write_timeline` (goal: 4 ranks × 1,000 steps in ≤ 10 s).

Prints one JSON object; `--out` also writes it.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import device_info  # noqa: E402

from depthscale.config import load_config  # noqa: E402
from depthscale.observe import spans  # noqa: E402
from depthscale.observe.spans import trace_path  # noqa: E402
from depthscale.observe.timeline import write_timeline  # noqa: E402
from depthscale.train.trainer import Trainer  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def step_overhead(args, run_dir: Path) -> dict:
    steps = args.blocks * args.steps_per_block + 4
    cfg = load_config(
        ROOT / "configs" / "tiny.toml",
        [
            "--train.steps", str(steps), "--train.run_dir", str(run_dir),
            "--train.micro_batch_size", str(args.micro_batch), "--train.eval_every", "0",
            "--checkpoint.every", "0", "--logging.progress", "false",
            "--logging.tensorboard", "false",
        ],
    )  # fmt: skip
    trainer = Trainer(cfg)
    recorder = trainer.telemetry.recorder
    times: dict[str, list[float]] = {"on": [], "off": []}
    with trainer.telemetry.recording():
        for _ in range(2):  # warm-up
            trainer.train_step()
        on_steps = set()
        for block in range(args.blocks):
            mode = "on" if block % 2 == 0 else "off"
            spans.activate(recorder if mode == "on" else None)
            for _ in range(args.steps_per_block):
                if mode == "on":
                    on_steps.add(trainer.step + 1)
                t0 = time.perf_counter()
                trainer.train_step()
                times[mode].append(time.perf_counter() - t0)
        spans.activate(recorder)
    trainer.telemetry.close()
    records = [json.loads(line) for line in recorder.path.read_text().splitlines()]
    recorded = sum(1 for r in records if r["kind"] == "span" and r["step"] in on_steps)
    on, off = statistics.median(times["on"]), statistics.median(times["off"])
    lo, hi = _bootstrap_ratio(times["on"], times["off"])
    per_span = span_cost(run_dir)
    spans_per_step = recorded / len(times["on"])
    return {
        "span_cost_us": per_span * 1e6,
        "hot_path_fraction_of_step": per_span * spans_per_step / off,
        "steps_each": len(times["on"]),
        "spans_per_step": spans_per_step,
        "step_ms_spans_on": on * 1e3,
        "step_ms_spans_off": off * 1e3,
        "ratio_on_vs_off": on / off,
        "ratio_95ci": [lo, hi],
        "dropped_events": recorder.dropped,
    }


def span_cost(run_dir: Path, n: int = 100_000) -> float:
    """Seconds one `spans.span` costs the thread that records it (the writer drains meanwhile)."""
    recorder = spans.SpanRecorder(trace_path(run_dir / "cost", 0), {"rank": 0}, queue_size=n + 8)
    old = spans.activate(recorder)
    try:
        t0 = time.perf_counter()
        for i in range(n):
            with spans.span("forward", mb=i):
                pass
        return (time.perf_counter() - t0) / n
    finally:
        spans.activate(old)
        recorder.close()


def _bootstrap_ratio(a: list[float], b: list[float], n: int = 2000) -> tuple[float, float]:
    rng = random.Random(0)
    ratios = sorted(
        statistics.median(rng.choices(a, k=len(a))) / statistics.median(rng.choices(b, k=len(b)))
        for _ in range(n)
    )
    return ratios[int(0.025 * n)], ratios[int(0.975 * n) - 1]


def synthetic_run(run_dir: Path, steps: int, micro: int = 4) -> int:
    """Trace files of a pp=2 × dp=2 run: per step and rank a step span, data, forward/backward per
    micro-batch, one send and one receive per micro-batch and direction, an all-reduce, the
    optimizer — about 40 records per rank and step. Returns the records written."""
    written = 0
    for rank in range(4):
        pp, dp = divmod(rank, 2)
        peer = (1 - pp) * 2 + dp
        meta = {
            "kind": "meta", "rank": rank, "world": 4,
            "coords": {"pp": pp, "dp": dp, "cp": 0, "tp": 0},
            "dims": {"pp": 2, "dp": 2, "cp": 1, "tp": 1, "pp_virtual": 1, "microbatches": micro},
            "host": "synthetic", "pid": rank, "clock": "perf_counter_ns", "device": "cpu",
        }  # fmt: skip
        lines = [meta, {"kind": "clock", "offset_ns": 0, "lo_ns": 0, "hi_ns": 0, "rtt_ns": 0}]
        t = 0
        for step in range(1, steps + 1):
            start = t
            lines.append(_span("data", "data", t, 10_000, step))
            t += 10_000
            for mb in range(micro):
                for kind in ("F", "B"):
                    u = (0, 1) if kind == "F" else (1, 0)
                    label = f"step {step}: {kind}{mb} {u[0]}>{u[1]}"
                    sending = (pp == 0) == (kind == "F")
                    args = {"peer": peer, "label": label, "bytes": 4096, "group": "0,1,2,3"}
                    name = "forward" if kind == "F" else "backward"
                    if sending:
                        lines.append(_span(name, "compute", t, 1_000_000, step, mb=mb))
                        t += 1_000_000
                        lines.append(_span("send", "pp", t, 50_000, step, **args))
                    else:
                        lines.append(_span("recv", "pp", t, 1_100_000, step, **args))
                        t += 1_100_000
                        lines.append(_span(name, "compute", t, 1_000_000, step, mb=mb))
                        t += 1_000_000
            coll = {"group": f"{pp * 2},{pp * 2 + 1}", "bytes": 1024, "seq": step}
            lines.append(_span("all_reduce", "collective", t, 200_000, step, **coll))
            t += 200_000
            lines.append(_span("optimizer", "compute", t, 300_000, step))
            t += 300_000
            lines.append(_span("step", "step", start, t - start, step))
            t += 1_000
        path = trace_path(run_dir, rank)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("\n".join(json.dumps(x, separators=(",", ":")) for x in lines) + "\n")
        written += len(lines)
    return written


def _span(name: str, cat: str, ts: int, dur: int, step: int, **args) -> dict:
    return {
        "kind": "span",
        "name": name,
        "cat": cat,
        "ts": ts,
        "dur": dur,
        "step": step,
        "args": args,
    }


def merge_time(steps: int, tmp: Path) -> dict:
    run = tmp / "synthetic"
    records = synthetic_run(run, steps)
    t0 = time.perf_counter()
    out, summary = write_timeline(run)
    seconds = time.perf_counter() - t0
    return {
        "ranks": 4,
        "steps": steps,
        "records": records,
        "merge_s": seconds,
        "trace_mb": out.stat().st_size / 1e6,
        "flows": sum(summary.flows.values()),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps-per-block", type=int, default=4)
    parser.add_argument("--blocks", type=int, default=40)
    parser.add_argument("--micro-batch", type=int, default=1)
    parser.add_argument("--merge-steps", type=int, default=1000)
    parser.add_argument("--out")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        result = {
            **device_info(),
            "spans": step_overhead(args, Path(tmp) / "run"),
            "merge": merge_time(args.merge_steps, Path(tmp)),
        }
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
