"""The NaN/Inf guard: a non-finite loss or gradient on any rank stops that step's update on every
rank, and is told apart as transient (a replay of the same batch is clean: a flipped bit, a bad
kernel launch) or persistent (the batch itself: roll back and never train on it again).

All ranks decide together from one collective flag (a rank-0-only check misses NaNs that appear on
other ranks; WeatherGenerator#2726): the global gradient norm is already the same on every rank,
and each rank's loss share is folded in by a MIN all-reduce of one number. The batches skipped are
recorded by data position in `RUN/skipped_batches.json`, which every later start of the run reads,
so a restart, and a reference run given the same file, skip them too.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
from torch import Tensor

from depthscale.errors import TrainingError
from depthscale.observe import spans

SKIPPED = "skipped_batches.json"


class PersistentNonFinite(Exception):
    """The step's loss or gradient stayed non-finite on replay: its batch is bad."""

    def __init__(self, step: int, position: tuple[int, int] | None) -> None:
        super().__init__(f"non-finite loss or gradient at step {step}, also on replay")
        self.step, self.position = step, position


def finite_flag(loss_share: Tensor, grad_norm: Tensor) -> Tensor:
    """1.0 if every rank's loss share and the (global) gradient norm are finite, else 0.0: a
    one-element tensor on the device, the same on every rank (a MIN all-reduce), not read here."""
    ok = torch.isfinite(grad_norm) & torch.isfinite(loss_share.detach()).all()
    flag = ok.to(torch.float32)
    if dist.is_initialized() and dist.get_world_size() > 1:
        with spans.collective("all_reduce", None, flag):
            dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return flag


class EarlyRead:
    """A device flag copied to host memory as soon as it is computed (asynchronously, into pinned
    memory), to be read later: reading it then waits for the kernels up to the flag, not for
    those queued after it (the optimizer step)."""

    def __init__(self, flag: Tensor) -> None:
        self._event = None
        self._host = flag
        if flag.device.type == "cuda":
            self._host = torch.empty(flag.shape, dtype=flag.dtype, pin_memory=True)
            self._host.copy_(flag, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()

    def true(self) -> bool:
        if self._event is not None:
            self._event.synchronize()
        return self._host.item() > 0


def skip_if_not_finite(optimizer: torch.optim.Optimizer, flag: Tensor) -> bool:
    """Make `optimizer.step()` a no-op on the device when `flag` is 0, where the optimizer can:
    torch's fused Adam/AdamW read `found_inf` (as under AMP's GradScaler) and then change no
    parameter, moment or step count. Returns whether it can; if not, the caller must read the
    flag before stepping."""
    fused = all(group.get("fused") for group in optimizer.param_groups)
    if not fused or not isinstance(optimizer, torch.optim.Adam | torch.optim.AdamW):
        return False
    optimizer.found_inf = 1.0 - flag
    return True


def poison(loss_share: Tensor, params: list[Tensor]) -> Tensor:
    """What a NaN on this rank looks like after backward (drills): the loss and a gradient."""
    for p in params:
        if p.grad is not None:
            grad = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
            if grad.numel():
                grad.view(-1)[0] = math.nan
                break
    return loss_share + math.nan


def read_skipped(run_dir: Path) -> set[tuple[int, int]]:
    """The data positions (epoch, cursor) this run must never train on."""
    try:
        records = json.loads((run_dir / SKIPPED).read_text())
        return {(int(r["epoch"]), int(r["cursor"])) for r in records}
    except FileNotFoundError:
        return set()
    except (ValueError, KeyError, TypeError) as err:
        from depthscale.errors import CheckpointError

        raise CheckpointError(
            f"{run_dir / SKIPPED} is damaged ({err}); it lists the batches this run skips after "
            "persistent NaNs: repair it (a JSON list of {step, epoch, cursor}) or delete it"
        ) from None


def record_skipped(run_dir: Path, step: int, position: tuple[int, int]) -> None:
    """Append a skipped batch (rank 0 writes; atomically, the file is read on every start)."""
    file = run_dir / SKIPPED
    try:
        records = json.loads(file.read_text())
    except (FileNotFoundError, ValueError):
        records = []
    records.append({"step": step, "epoch": position[0], "cursor": position[1]})
    tmp = file.with_suffix(".tmp")
    tmp.write_text(json.dumps(records, indent=1))
    tmp.replace(file)


def not_finite_error(steps: list[int], lr: float) -> TrainingError:
    """The run stops: step `steps[0]` (and the later ones listed) had a non-finite loss or
    gradient and nothing replays it (`resilience.nan_replay=false`)."""
    later = f" and {len(steps) - 1} later step(s)" if len(steps) > 1 else ""
    return TrainingError(
        f"the loss or gradient is not finite at step {steps[0]} (lr {lr:.3g}){later}; nothing "
        "was updated or saved from it. Lower optim.lr, raise optim.warmup_steps, keep "
        "train.grad_clip > 0, or set resilience.nan_replay=true to replay and skip bad "
        "batches"
    )


class NanGuard:
    """The step's update under the guard: a non-finite loss or gradient on any rank
    (`finite_flag`) updates nothing, and the step is replayed once on the same batch; still
    non-finite, PersistentNonFinite. Without replay (`resilience.nan_replay=false`) and with an
    optimizer that skips on the device (fused AdamW), the flag is read only with the metrics:
    the step reads nothing."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        replay: bool,
        apply_update: Callable[[], None],
        refuse: Callable[[list[int]], Exception],
        on_event: Callable[[int, str, str], None],
    ) -> None:
        self.optimizer, self.replay = optimizer, replay
        self.apply_update, self.refuse, self.on_event = apply_update, refuse, on_event

    def update(
        self,
        attempt: Callable[[], tuple[Tensor, Tensor]],
        step: int,
        position: tuple[int, int] | None,
    ) -> tuple[Tensor, Tensor, Tensor]:
        """Run `attempt` (forward and backward: loss share, gradient norm) and the update;
        returns the loss share, the gradient norm and the finite flag."""
        for first_try in (True, False):
            total, grad_norm = attempt()
            flag = finite_flag(total, grad_norm)
            early = EarlyRead(flag) if self.replay else None
            skips_on_device = skip_if_not_finite(self.optimizer, flag)
            if skips_on_device:  # launched now, a no-op on the device if the flag is 0
                self.apply_update()
                if not self.replay:
                    break  # the flag is read with the metrics, on the next log step
            # the guard's one read per step; where the update skips itself, it is already queued
            if early.true() if early is not None else flag.item() > 0:
                if not skips_on_device:
                    self.apply_update()
                break
            self.optimizer.zero_grad(set_to_none=True)
            if not self.replay:
                raise self.refuse([step])
            if not first_try:
                raise PersistentNonFinite(step, position)
            self.on_event(step, "transient", "non-finite loss or gradient; replaying the step")
        if not first_try:
            self.on_event(step, "transient", "the replay was finite: a transient fault")
        return total, grad_norm, flag


def roll_back_to(bad: PersistentNonFinite, run_dir: Path, checkpointer, resume: str, is_main: bool):
    """Where a run goes back to when the batch of `bad.step` stays non-finite: the batch is
    recorded in the run directory (never trained on again) and the newest verified checkpoint
    returned, once every save in flight is on disk; none is a TrainingError."""
    if is_main:
        record_skipped(run_dir, bad.step, bad.position)
    checkpointer.wait()
    path = checkpointer.resolve_resume() if resume != "none" else None
    if path is None:
        raise TrainingError(
            f"{bad}; its batch (data position {bad.position}) is recorded in "
            f"{run_dir / SKIPPED} and will be skipped, but there is no verified checkpoint to "
            "roll back to: start the run again (a supervised run restarts by itself)"
        )
    return path
