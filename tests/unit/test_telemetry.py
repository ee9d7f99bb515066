"""The trainer's telemetry: the MFU-decline alarm and synchronised garbage collection."""

import gc
import json

import pytest
import torch
from test_trainer import make_cfg

from depthscale.errors import PeersFailed, TrainingError
from depthscale.observe.watchdog import hang_path
from depthscale.train.telemetry import MfuAlarm
from depthscale.train.trainer import Trainer

MS = 1e6


def _phases(forward_ms: float = 10.0, waiting_ms: float = 1.0) -> dict[str, float]:
    return {"data": 0.5 * MS, "forward": forward_ms * MS, "backward": 20 * MS,
            "optimizer": 2 * MS, "waiting": waiting_ms * MS}  # fmt: skip


def test_mfu_alarm_names_the_phase_that_grew_once():
    alarm = MfuAlarm(0.1, window=5)
    for step in range(1, 11):
        assert alarm.update(step, 0.50, _phases()) is None
    fired = []
    for step in range(11, 31):  # waiting grows; MFU falls 20 %
        got = alarm.update(step, 0.40, _phases(waiting_ms=9.0))
        if got:
            fired.append((step, got))
    assert len(fired) == 1, fired  # once, not every step
    step, (text, fields) = fired[0]
    assert fields["phase"] == "waiting" and fields["best_mfu"] == 0.5
    assert "below its best 50.0%" in text and "waiting (1.0 → " in text
    # the rolling mean crosses 10 % below the best within a window, and stays there for one
    assert step <= 10 + 2 * 5


def test_mfu_alarm_waits_out_a_dip_shorter_than_its_window():
    """A loaded machine, a background save or an evaluation: MFU 30 % low for 5 steps, then back.
    The rolling mean (10 steps) is 10 % under the best for 8 steps, less than a window: no alarm
    (before: one). The same dip kept up is a decline, and alarms."""
    alarm = MfuAlarm(0.1, window=10)
    fired = [alarm.update(s, 0.5, _phases()) for s in range(1, 21)]
    fired += [alarm.update(s, 0.35, _phases(forward_ms=20)) for s in range(21, 26)]
    fired += [alarm.update(s, 0.5, _phases()) for s in range(26, 60)]
    assert not any(fired)
    fired = [alarm.update(s, 0.35, _phases(forward_ms=20)) for s in range(60, 90)]
    assert len([f for f in fired if f]) == 1


def test_mfu_alarm_names_no_phase_when_none_grew_measurably():
    """MFU fell but no phase of the step grew (here: every phase 0.0 ms, or jitter of 0.1 ms on
    a 33 ms step): the alarm says so instead of naming "data (0.0 → 0.0 ms)"."""
    zero = dict.fromkeys(("data", "forward", "backward", "optimizer", "waiting"), 0.0)
    for wall_then, wall_now in [(zero, zero), (_phases(), _phases(forward_ms=10.1))]:
        alarm = MfuAlarm(0.1, window=4)
        fired = [alarm.update(s, 0.5, wall_then) for s in range(1, 9)]
        fired += [alarm.update(s, 0.3, wall_now) for s in range(9, 20)]
        (text, fields), *rest = [f for f in fired if f]
        assert rest == [] and fields["phase"] is None
        assert "no phase of this rank's step grew measurably (traced step " in text, text
        assert "the phase that grew most" not in text


def test_mfu_alarm_quiet_within_the_threshold_and_rearmed_by_a_new_best():
    alarm = MfuAlarm(0.1, window=4)
    for step in range(1, 40):  # 5 % jitter never alarms
        assert alarm.update(step, 0.50 if step % 2 else 0.475, _phases()) is None
    off = MfuAlarm(0.0, window=4)
    assert all(off.update(s, 0.5 if s < 10 else 0.1, _phases()) is None for s in range(1, 30))
    for step in range(40, 50):
        alarm.update(step, 0.30, _phases(forward_ms=30))
    assert alarm._alarmed
    for step in range(50, 60):
        alarm.update(step, 0.60, _phases())  # a new best re-arms it
    assert not alarm._alarmed and alarm.best[0] == 0.60


def test_gc_interval_collects_on_schedule_and_nowhere_else(tmp_path):
    """train.gc_interval = 2: the automatic collector never runs during training (it would pause
    one rank in the middle of a step); a full collection runs at the start of every 2nd step."""
    cfg = make_cfg(tmp_path, "--train.gc_interval", "2", "--train.eval_every", "0",
                   "--checkpoint.every", "0")  # fmt: skip
    trainer = Trainer(cfg)
    seen: list[tuple[int, int]] = []  # (steps done, generation) of every collection

    def on_gc(phase: str, info: dict) -> None:
        if phase == "start":
            seen.append((trainer.step, info["generation"]))

    gc.callbacks.append(on_gc)
    try:
        trainer.fit()
    finally:
        gc.callbacks.remove(on_gc)
    assert gc.isenabled()
    # once steps run: full collections at the start of steps 2, 4, 6 (after 1, 3, 5) only
    during = [(step, gen) for step, gen in seen if 1 <= step < cfg.train.steps]
    assert {step for step, _ in during} == {1, 3, 5} and {gen for _, gen in during} == {2}, seen
    lines = (trainer.run_dir / "trace" / "rank00000.jsonl").read_text().splitlines()
    steps = [r["step"] for r in map(json.loads, lines) if r.get("name") == "gc"]
    assert steps == [2, 4, 6]


@pytest.mark.parametrize(
    "error, hang",
    [
        (TrainingError("loss is nan at step 1"), False),
        (OSError(28, "No space left on device"), False),
        (RuntimeError("[gloo] Timed out waiting 10000ms for recv operation to complete"), True),
    ],
    ids=["nan", "disk full", "timeout"],
)
def test_only_a_hang_writes_a_hang_dump(tmp_path, caplog, error, hang):
    """A rank's own error is reported as itself; a hang dump (and its log line) is written only
    when a collective or message timed out or lost its peer, which `trace hang` reads."""
    cfg = make_cfg(tmp_path, "--train.eval_every", "0", "--checkpoint.every", "0")
    trainer = Trainer(cfg)

    def fail() -> None:
        raise error

    trainer._train_step = fail
    with pytest.raises(PeersFailed if hang else type(error)):
        trainer.fit()
    assert hang_path(trainer.run_dir, 0).is_file() == hang
    assert ("wrote its hang dump" in caplog.text) == hang


def test_a_profile_window_stopped_inside_writes_the_steps_it_saw(tmp_path):
    """logging.profile_steps=3-5, and the run stops after step 3 (a signal, an error): the trace
    is written at close, named by the steps it covers; outside the window nothing starts."""
    from depthscale.config import Config
    from depthscale.observe.profile_window import ProfileWindow

    cfg = Config()
    cfg.logging.profile_steps = "3-5"
    window = ProfileWindow(cfg, tmp_path, rank=0, world=1, device_type="cpu")
    for step in (1, 2):
        window.begin(step)
        assert window.end(step) == [] and window._profiler is None
    window.begin(3)
    torch.ones(8, 8) @ torch.ones(8, 8)
    assert window.end(3) == []
    (written,) = window.close()
    assert written == tmp_path / "trace" / "profile" / "rank00000-steps3-3.json"
    events = json.loads(written.read_text())["traceEvents"]
    assert any(e.get("name") == "aten::mm" for e in events)
    assert window.close() == [] and window.end(4) == []  # once per run
    other = ProfileWindow(cfg, tmp_path / "r1", rank=1, world=2, device_type="cpu")
    other.begin(3)
    assert other.end(5) == [] and not (tmp_path / "r1").exists()  # rank 1 is not profiled
