"""A training step never waits on the device except on log steps (`train/step_metrics.py`):
counted with `tests/host_syncs.py` (every value read to the host on the training thread)."""

from __future__ import annotations

import pytest

from host_syncs import HostSyncs

STEPS, LOG_EVERY = 6, 3
LOG_STEP_SYNCS = 1
"""On a log step: one read of every pending step's loss and gradient norm."""


def _trainer(tmp_path, *overrides: str):
    from depthscale.config import load_config
    from depthscale.train.trainer import Trainer

    corpus = tmp_path / "corpus.txt"
    corpus.write_text("".join(f"line {i}: the quick brown fox jumps\n" for i in range(300)))
    args = [
        *("--data.path", str(corpus), "--data.seq_len", "16", "--train.batch_size", "4"),
        *("--model.dim", "32", "--model.n_layers", "2", "--model.n_heads", "4"),
        *("--train.steps", str(STEPS), "--logging.log_every", str(LOG_EVERY)),
        *("--train.eval_every", "0", "--checkpoint.every", "0", "--optim.warmup_steps", "1"),
        *("--logging.progress", "false", "--logging.tensorboard", "false"),
        *("--logging.peak_tflops", "1", "--train.run_dir", str(tmp_path / "run")),
        *overrides,
    ]
    return Trainer(load_config(None, args))


def check_syncs(per_step: dict[int, list], guard: int) -> None:
    """At most `guard` reads on a step that is not a log step (the NaN guard's flag, where its
    replay needs it before the next step), `guard` + LOG_STEP_SYNCS on a log step."""
    assert len(per_step) == STEPS
    for step, events in per_step.items():
        allowed = guard + (LOG_STEP_SYNCS if step % LOG_EVERY == 0 else 0)
        assert len(events) <= allowed, f"step {step}: {events}"


@pytest.mark.parametrize("residual", ["standard", "block"])
def test_without_replay_a_step_reads_the_device_only_on_log_steps(tmp_path, residual):
    """Fused AdamW skips a non-finite update on the device: nothing to read before the next step."""
    blocks = ("--model.attnres_n_blocks", "2")
    trainer = _trainer(
        tmp_path, "--model.residual", residual, *blocks, "--resilience.nan_replay", "false"
    )
    with HostSyncs(trainer) as syncs:
        history = trainer.fit()
    check_syncs(syncs.per_step(), guard=0)
    assert all(isinstance(m["loss"], float) for m in history)  # every step's loss read by the end


def test_with_replay_the_guard_reads_one_flag_per_step(tmp_path):
    """The replay must know before the next batch: one read, of a flag computed before the
    update, which is already queued (the host waits for the backward, not the optimizer)."""
    trainer = _trainer(tmp_path)
    with HostSyncs(trainer) as syncs:
        trainer.fit()
    check_syncs(syncs.per_step(), guard=1)
    for events in syncs.per_step().values():
        assert ("nan_guard" in events[0][0] or "trainer.py" in events[0][0]) and events[0][
            1
        ] == "item"


def test_an_item_added_to_the_step_is_caught(tmp_path, monkeypatch):
    trainer = _trainer(tmp_path, "--resilience.nan_replay", "false")
    clip = trainer.plan.clip_gradients

    def clip_and_read(max_norm):
        norm = clip(max_norm)
        norm.item()  # the kind of line this guards against
        return norm

    monkeypatch.setattr(trainer.plan, "clip_gradients", clip_and_read)
    with HostSyncs(trainer) as syncs:
        trainer.fit()
    with pytest.raises(AssertionError, match="step 1: .*'item'"):
        check_syncs(syncs.per_step(), guard=0)
