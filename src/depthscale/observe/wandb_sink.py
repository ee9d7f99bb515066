"""Weights & Biases as a third sink of the metrics log (beside metrics.jsonl and TensorBoard).

The same scalars under the same "{split}/{name}" names, the resolved config as the W&B run's
config, and the run directory's W&B id kept in RUN/wandb_id, so a resumed run (a restart, a rerun
of the same command) continues the same W&B run instead of starting a new one. Steps go in as a
logged value, `step`, which the charts use as their x axis: W&B's own step counter must only grow,
so a resumed run that trains steps again would otherwise have its records dropped.

Imported only when `logging.wandb` is on; the package is the `wandb` extra.
"""

from __future__ import annotations

import dataclasses
import uuid
from pathlib import Path

from depthscale.config import Config
from depthscale.errors import ConfigError

ID_FILE = "wandb_id"


class WandbSink:
    def __init__(self, run_dir: Path, cfg: Config) -> None:
        import wandb

        id_file = Path(run_dir) / ID_FILE
        run_id = id_file.read_text().strip() if id_file.is_file() else uuid.uuid4().hex[:16]
        log = cfg.logging
        try:
            self.run = wandb.init(
                project=log.wandb_project,
                entity=log.wandb_entity or None,
                name=log.wandb_name or cfg.train.name,
                id=run_id,
                resume="allow",
                dir=str(run_dir),
                config=dataclasses.asdict(cfg),
            )
        except Exception as err:  # no login, no network, a bad entity: W&B's own words
            raise ConfigError(
                f"logging.wandb: W&B did not start ({str(err).splitlines()[0][:200]}); allowed: "
                "WANDB_MODE=offline to log without an account, or logging.wandb=false"
            ) from None
        id_file.write_text(run_id + "\n")
        self.run.define_metric("step")
        self.run.define_metric("*", step_metric="step")

    def log(self, step: int, values: dict[str, float | int | None], prefix: str) -> None:
        scalars = {f"{prefix}/{k}": v for k, v in values.items() if v is not None}
        self.run.log({"step": step, **scalars})

    def close(self) -> None:
        self.run.finish()
