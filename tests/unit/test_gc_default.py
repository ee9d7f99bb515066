"""Synchronised garbage collection is the default (`train.gc_interval = 100`): no rank pauses for
Python's collector in the middle of a step — at a thousand ranks one of them always would — and
the collections every 100th step skip what was alive when training began (frozen)."""

from __future__ import annotations

import gc

import torch
from test_trainer import make_cfg

from depthscale.config.schema import TrainConfig
from depthscale.parallel.mesh import DistEnv, ParallelDims
from depthscale.train.telemetry import Telemetry


def test_the_default_is_a_collection_every_100_steps(tmp_path):
    assert TrainConfig().gc_interval == 100
    cfg = make_cfg(tmp_path, "--logging.trace", "false")
    assert cfg.train.gc_interval == 100
    telemetry = Telemetry(
        cfg, tmp_path / "run", DistEnv(0, 1, 0), ParallelDims.from_config(cfg.parallel),
        torch.device("cpu"),
    )  # fmt: skip
    collections: list[int] = []

    def on_gc(phase: str, info: dict) -> None:
        if phase == "start":
            collections.append(info["generation"])

    frozen_before = gc.get_freeze_count()
    gc.callbacks.append(on_gc)
    try:
        with telemetry.recording():
            assert not gc.isenabled() and gc.get_freeze_count() > frozen_before
            collections.clear()
            for step in range(1, 201):
                garbage = [[]]
                garbage[0].append(garbage)  # a cycle: only the collector frees it
                del garbage
                telemetry.begin_step(step)
                telemetry.abandon_step()
            assert collections == [2, 2]  # full collections at steps 100 and 200, nothing else
    finally:
        gc.callbacks.remove(on_gc)
    assert gc.isenabled() and gc.get_freeze_count() == frozen_before
