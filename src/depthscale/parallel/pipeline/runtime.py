"""Executes a rank's pipeline actions with asynchronous point-to-point communication.

MegaScale-style decoupling: a receive is posted as soon as it comes within `lookahead` actions and is
waited on only when the compute that needs it starts; a send is fire-and-forget until the end of the
step. A hop carries one tensor [n, micro_batch, seq, dim]: the partial sum and the depth-state blocks
the receiver lacks, packed so each hop is a single message whose shape both sides compute from the
stage cut (no shape handshake). The cross-stage cache decides which blocks a hop must carry.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import Tensor

from depthscale.parallel.pipeline.depth_cache import DepthCache
from depthscale.parallel.pipeline.schedules import Action, Kind
from depthscale.parallel.pipeline.stage import PipelineStage


@dataclass
class _Unit:
    """What one (microbatch, stage) forward leaves for its backward."""

    recv: Tensor | None = None  # the received hop (a leaf), or None on the first stage
    outputs: list[Tensor] = field(default_factory=list)  # tensors whose grads come from downstream
    loss: Tensor | None = None


@dataclass
class StepStats:
    bytes_sent: int = 0
    messages: int = 0
    per_hop_bytes: list[int] = field(default_factory=list)
    compute_s: float = 0.0  # time inside forward/backward compute
    step_s: float = 0.0  # wall time of the whole step on this rank

    @property
    def bubble_ratio(self) -> float:
        """Idle (waiting) time over compute time; compare with (P−1)/(V·M)."""
        return (self.step_s - self.compute_s) / self.compute_s if self.compute_s else 0.0


class PipelineRuntime:
    def __init__(
        self,
        stages: list[PipelineStage],
        actions: list[Action],
        group: dist.ProcessGroup,
        cache: DepthCache,
        lookahead: int = 2,
    ) -> None:
        self.stages = {s.spec.stage: s for s in stages}
        if not self.stages:
            raise ValueError("a pipeline rank needs at least one stage")
        self.actions = actions
        self.group = group
        self.cache = cache
        self.lookahead = lookahead
        self.forward_context: Callable[[], contextlib.AbstractContextManager] | None = None
        """Entered around every training stage forward, e.g. `train.memory.offload_activations`
        to keep what a micro-batch saves for backward in host memory while it is in flight."""

    def _global(self, pp_rank: int) -> int:
        return dist.get_global_rank(self.group, pp_rank)

    def step(
        self,
        micro_inputs: list[Tensor] | None,
        micro_labels: list[Tensor] | None,
        shape: tuple[int, int, int],
        dtype: torch.dtype,
        device: torch.device,
    ) -> tuple[Tensor | None, StepStats]:
        """Run all actions for one optimizer step; returns the summed loss on the last stage's rank."""
        n_micro = len(micro_inputs) if micro_inputs is not None else len(micro_labels)
        units: dict[tuple[int, int], _Unit] = {}
        posted: dict[tuple, tuple[dist.Work, Tensor]] = {}
        sends: list[tuple[dist.Work, Tensor]] = []
        stats = StepStats()
        total_loss: Tensor | None = None
        step_start = time.perf_counter()

        def post(a: Action) -> None:
            key = (a.kind, a.microbatch, a.stage)
            if key in posted:
                return
            if a.kind == Kind.RECV_F:
                n = self.cache.hop_size(a.stage - 1, a.microbatch)
            else:
                n = self.cache.hop_size(a.stage, a.microbatch)
            if n == 0:  # the receiver already holds everything: both ends skip this hop
                posted[key] = (None, None)
                return
            buf = torch.empty((n, *shape), dtype=dtype, device=device)
            work = dist.irecv(buf, src=self._global(a.peer), group=self.group, tag=_tag(a))
            posted[key] = (work, buf)

        def take(a: Action) -> Tensor:
            work, buf = posted.pop((a.kind, a.microbatch, a.stage))
            if work is not None:
                work.wait()
            return buf

        pending_recv: dict[tuple, Action] = {}
        grads_to_send: dict[tuple[int, int], Tensor] = {}
        last_backward = {a.stage: i for i, a in enumerate(self.actions) if a.kind == Kind.B}
        for idx, a in enumerate(self.actions):
            for ahead in self.actions[idx : idx + self.lookahead + 1]:
                if ahead.kind in (Kind.RECV_F, Kind.RECV_B):
                    post(ahead)
            if a.kind in (Kind.RECV_F, Kind.RECV_B):
                pending_recv[(a.kind, a.microbatch, a.stage)] = a
            elif a.kind == Kind.F:
                stage = self.stages[a.stage]
                unit = _Unit()
                if stage.spec.is_first:
                    state_in = micro_inputs[a.microbatch]
                    self.cache.start(a.microbatch)
                else:
                    recv_a = pending_recv.pop((Kind.RECV_F, a.microbatch, a.stage), None)
                    unit.recv = take(recv_a) if recv_a is not None else None
                    if unit.recv is not None:
                        unit.recv.requires_grad_()
                    state_in = self.cache.receive(a.stage, a.microbatch, unit.recv)
                t0 = time.perf_counter()
                with self._forward_context():
                    out = stage(
                        state_in, micro_labels[a.microbatch] if stage.spec.is_last else None
                    )
                if stage.spec.is_last:
                    loss = out / n_micro
                    unit.loss = loss
                    total_loss = loss.detach() if total_loss is None else total_loss + loss.detach()
                else:
                    unit.outputs = self.cache.produced(a.stage, a.microbatch, out)
                stats.compute_s += time.perf_counter() - t0
                units[(a.microbatch, a.stage)] = unit
            elif a.kind == Kind.SEND_F:
                unit = units[(a.microbatch, a.stage)]
                hop = self.cache.outgoing(a.stage, a.microbatch, unit.outputs)
                if hop is None:
                    stats.per_hop_bytes.append(0)
                    continue
                sends.append(
                    (dist.isend(hop, dst=self._global(a.peer), group=self.group, tag=_tag(a)), hop)
                )
                stats.bytes_sent += hop.numel() * hop.element_size()
                stats.messages += 1
                stats.per_hop_bytes.append(hop.numel() * hop.element_size())
            elif a.kind == Kind.B:
                stage = self.stages[a.stage]
                _defer_gradient_sync(stage, until_last=idx == last_backward[a.stage])
                unit = units.pop((a.microbatch, a.stage))
                if stage.spec.is_last:
                    t0 = time.perf_counter()
                    unit.loss.backward()
                else:
                    recv_a = pending_recv.pop((Kind.RECV_B, a.microbatch, a.stage), None)
                    grad_hop = take(recv_a) if recv_a is not None else None
                    tensors, grads = self.cache.backward_targets(
                        a.stage, a.microbatch, unit.outputs, grad_hop
                    )
                    t0 = time.perf_counter()
                    torch.autograd.backward(tensors, grads)
                stats.compute_s += time.perf_counter() - t0
                unit.outputs = []
                if unit.recv is not None:
                    grads_to_send[(a.microbatch, a.stage)] = self.cache.input_grads(unit.recv)
                if a.stage == min(self.stages):  # the rank's last backward for this microbatch
                    self.cache.finish(a.microbatch)
            elif a.kind == Kind.SEND_B:
                if (a.microbatch, a.stage) not in grads_to_send:
                    continue  # an empty forward hop has an empty gradient hop
                grad = grads_to_send.pop((a.microbatch, a.stage)).contiguous()
                sends.append(
                    (
                        dist.isend(grad, dst=self._global(a.peer), group=self.group, tag=_tag(a)),
                        grad,
                    )
                )
                stats.bytes_sent += grad.numel() * grad.element_size()
                stats.messages += 1
        for work, _ in sends:
            work.wait()
        self.cache.clear()  # a forward-only pass leaves its microbatches behind
        stats.step_s = time.perf_counter() - step_start
        return total_loss, stats

    def _forward_context(self) -> contextlib.AbstractContextManager:
        if self.forward_context is None or not torch.is_grad_enabled():
            return contextlib.nullcontext()
        return self.forward_context()


def _defer_gradient_sync(stage: PipelineStage, until_last: bool) -> None:
    """A stage wrapped by FSDP2 (or its replicate) would reduce-scatter / all-reduce its gradients
    after every micro-batch's backward; accumulate them unsharded instead and reduce once, in the
    stage's last backward of the step (what FSDP1 called `no_sync`): M times fewer reductions for
    the memory of one unsharded gradient copy. The same sum, so results change by rounding only."""
    sync = getattr(stage, "set_requires_gradient_sync", None)  # FSDPModule API
    if sync is not None:
        sync(until_last)


def _tag(a: Action) -> int:
    """Both ends name a hop by its upstream stage u (forward u -> u+1, gradients u+1 -> u), so
    out-of-order messages between the same two ranks never mix."""
    upstream = a.stage if a.kind in (Kind.SEND_F, Kind.RECV_B) else a.stage - 1
    direction = 0 if a.kind in (Kind.SEND_F, Kind.RECV_F) else 1
    return (a.microbatch * 4096 + upstream) * 2 + direction
