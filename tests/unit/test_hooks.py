"""The step loop's hooks: a feature added as a hook sees every named point, in order, with the
step's metrics, and the loop runs the default features through the same list."""

from __future__ import annotations

from test_trainer import make_cfg

from depthscale.train.hooks import Hook
from depthscale.train.hooks.defaults import default_hooks
from depthscale.train.trainer import Trainer


class _Recorder(Hook):
    def __init__(self) -> None:
        self.calls: list[tuple[str, int]] = []

    def step_end(self, run, metrics, seconds):
        assert seconds > 0 and "tokens_per_s" in metrics  # Throughput ran before it
        self.calls.append(("step_end", run.trainer.step))

    def metrics_read(self, run, metrics):
        assert isinstance(metrics["loss"], float)  # read from the device by now
        self.calls.append(("metrics_read", run.trainer.step))

    def log(self, run, metrics):
        self.calls.append(("log", run.trainer.step))

    def after_step(self, run):
        self.calls.append(("after_step", run.trainer.step))

    def fit_end(self, run):
        self.calls.append(("fit_end", run.trainer.step))


def test_a_hook_sees_every_point_of_every_step_in_order(tmp_path):
    cfg = make_cfg(tmp_path, "--train.steps", "4", "--logging.log_every", "2",
                   "--train.eval_every", "0", "--checkpoint.every", "0")  # fmt: skip
    trainer = Trainer(cfg)
    recorder = _Recorder()
    trainer.hooks.hooks.append(recorder)
    trainer.fit()
    expected = []
    for step in range(1, 5):
        expected.append(("step_end", step))
        if step % 2 == 0:
            expected += [("metrics_read", step), ("log", step)]
        expected.append(("after_step", step))
    assert recorder.calls == expected + [("fit_end", 4)]


def test_the_heartbeat_hook_is_there_only_for_a_supervised_worker():
    names = [type(h).__name__ for h in default_hooks(None, None)]
    assert "HeartbeatHook" not in names
    assert names.index("Throughput") < names.index("TelemetryNotices")
    assert names.index("Evaluation") < names.index("Checkpointing") < names.index("Progress")
