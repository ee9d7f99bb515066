"""Host synchronisations per training step in every layout (`tests/host_syncs.py`; one process:
tests/unit/test_host_syncs.py): no device value is read on a step that is not a log step, but the
NaN guard's flag where its replay needs it before the next step; a log step reads its metrics
once."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch.distributed as dist
from host_syncs import HostSyncs

STEPS, LOG_EVERY = 4, 2


def _count(root: str, layout: dict, nan_replay: bool) -> dict[int, list]:
    from pathlib import Path

    from depthscale.config import load_config
    from depthscale.train.trainer import Trainer

    corpus = Path(root) / "corpus.txt"
    if dist.get_rank() == 0:
        corpus.write_text("".join(f"line {i}: the quick brown fox jumps\n" for i in range(300)))
    dist.barrier()
    args = [
        *("--data.path", str(corpus), "--data.seq_len", "16", "--train.batch_size", "4"),
        *("--model.dim", "32", "--model.n_layers", "2", "--model.n_heads", "4"),
        *("--model.residual", "block", "--model.attnres_n_blocks", "2"),
        *("--train.steps", str(STEPS), "--logging.log_every", str(LOG_EVERY)),
        *("--train.eval_every", "0", "--checkpoint.every", "0", "--optim.warmup_steps", "1"),
        *("--logging.progress", "false", "--logging.tensorboard", "false"),
        *("--logging.peak_tflops", "1", "--train.run_dir", f"{root}/run"),
        *("--resilience.nan_replay", str(nan_replay).lower()),
    ]
    args += [a for name, v in layout.items() for a in (f"--parallel.{name}", str(v))]
    trainer = Trainer(load_config(None, args))
    with HostSyncs(trainer) as syncs:
        trainer.fit()
    return syncs.per_step()


LAYOUTS = [{"dp_shard": 2}, {"dp_replicate": 2}, {"tp": 2}, {"pp": 2}, {"cp": 2}]
GUARD = "nan_guard.py"
METRICS = "step_metrics.py"


def _check(per_step: dict[int, list], guard_reads: int) -> None:
    """Each step after the first: `guard_reads` reads of the NaN guard's flag; a log step also
    one read of the pending metrics; nothing else."""
    for step, events in per_step.items():
        if step == 1:  # per-shape caches fill on the first step (the ring plan, from host data)
            continue
        files = sorted(Path(site.rsplit(":", 1)[0]).name for site, _ in events)
        expected = [GUARD] * guard_reads + ([METRICS] if step % LOG_EVERY == 0 else [])
        assert files == sorted(expected), f"step {step}: {events}"


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda d: "_".join(d))
@pytest.mark.parametrize("nan_replay", [True, False])
def test_every_layout_reads_the_device_only_where_it_must(dist_pool, tmp_path, layout, nan_replay):
    """With replay, the guard reads its flag once per step (before the next batch); without, the
    update skips itself on the device (fused AdamW) and nothing is read but on log steps."""
    for per_step in dist_pool(2).run(_count, str(tmp_path), layout, nan_replay):
        assert sorted(per_step) == list(range(1, STEPS + 1))
        _check(per_step, guard_reads=int(nan_replay))
