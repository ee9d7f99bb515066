"""Executes a rank's pipeline actions with asynchronous point-to-point communication.

MegaScale-style decoupling: a receive is posted early and waited on only when the compute that needs
it starts; a send does not hold up the compute after it. A sent buffer is freed once the send is
known complete: polled after every compute (NCCL reports completion) or, since gloo reports it only
to a wait, when a later message from the same peer proves the receive was posted there — at the
latest at the end of the step. When each message is posted comes from `p2p_order`: every rank posts
its sends and receives as groups, in one global order all ranks agree on, so the same code runs
under NCCL (no tags, pairing by posting order) as under gloo. A hop carries one tensor [n, micro_batch, seq, dim]:
the partial sum and the depth-state blocks the receiver lacks, packed so each hop is a single
message whose shape both sides compute from the stage cut (no shape handshake). The cross-stage
cache decides which blocks a hop must carry; a hop with nothing to carry is left out at both ends.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import Tensor

from depthscale.model.documents import Documents
from depthscale.observe import spans
from depthscale.parallel import p2p
from depthscale.parallel.pipeline.depth_cache import DepthCache
from depthscale.parallel.pipeline.p2p_order import (
    SENDS,
    Post,
    consumed_receive,
    label,
    rank_program,
    upstream,
)
from depthscale.parallel.pipeline.schedules import Action, Kind, Schedule
from depthscale.parallel.pipeline.stage import PipelineStage


@dataclass
class _Unit:
    """What one (microbatch, stage) forward leaves for its backward."""

    recv: Tensor | None = None  # the received hop (a leaf), or None on the first stage
    outputs: list[Tensor] = field(default_factory=list)  # tensors whose grads come from downstream
    loss: Tensor | None = None


@dataclass
class StepStats(p2p.Traffic):
    channel = "pp"
    per_hop_bytes: list[int] = field(default_factory=list)
    compute_s: float = 0.0  # time inside forward/backward compute
    step_s: float = 0.0  # time of the whole step on this rank (on a GPU: its compute stream's)
    cache_s: float = 0.0
    """Time in the depth cache: assembling a stage's input, packing a hop, gathering gradients."""
    wait_warmup_s: float = 0.0
    """Waiting for a message before this rank's first backward (the pipeline filling)."""
    wait_steady_s: float = 0.0
    """Waiting for a message between the first backward and the last forward: in 1F1B's steady
    state a wait is communication or imbalance that the schedule should have hidden."""
    wait_cooldown_s: float = 0.0
    """Waiting after the last forward (the pipeline draining), sends' completion included."""
    peak_units: int = 0
    """The most (micro-batch, chunk) units whose forward ran and backward has not: what this
    rank's activations peak at (`plan.pipeline.peak_in_flight` predicts it)."""

    @property
    def bubble_ratio(self) -> float:
        """Idle (waiting) time over compute time; compare with (P−1)/(V·M)."""
        return (self.step_s - self.compute_s) / self.compute_s if self.compute_s else 0.0


class PipelineRuntime:
    """Runs this rank's part of `schedule` (all ranks' actions; this rank is its rank in `group`)."""

    def __init__(
        self,
        stages: list[PipelineStage],
        schedule: Schedule,
        group: dist.ProcessGroup,
        cache: DepthCache,
        name: str = "step",
    ) -> None:
        """`name` starts this runtime's message labels ("step 12: F3 0>1"): runtimes of one
        pipeline (training, evaluation) need different names, so that a label is unique."""
        self.name = name
        self.stages = {s.spec.stage: s for s in stages}
        if not self.stages:
            raise ValueError("a pipeline rank needs at least one stage")
        self.group = group
        self.rank = dist.get_rank(group)
        if len(schedule) != dist.get_world_size(group):
            raise ValueError(
                f"the schedule is for {len(schedule)} pipeline ranks but the group has "
                f"{dist.get_world_size(group)}"
            )
        self.actions = schedule[self.rank]
        self.cache = cache
        self.program = rank_program(schedule, self.rank, self._empty_hop)
        self._messages = {(a.kind, a.microbatch, a.stage): a for a in self.actions}
        self._last_backward = {a.stage: a for a in self.actions if a.kind == Kind.B}
        self._phases = compute_phases(self.actions)
        self.steps = 0  # steps run: names this step's messages (every rank runs the same steps)
        self.last_stats: StepStats | None = None
        self.forward_context: Callable[[], contextlib.AbstractContextManager] | None = None
        """Entered around every training stage forward, e.g. `train.offload.offload_activations`
        to keep what a micro-batch saves for backward in host memory while it is in flight."""

    def _empty_hop(self, a: Action) -> bool:
        """Both ends leave out a hop whose receiver already holds everything."""
        return self.cache.hop_size(upstream(a), a.microbatch) == 0

    def step(
        self,
        micro_inputs: list[Tensor] | None,
        micro_labels: list[Tensor] | None,
        shape: tuple[int, int, int],
        dtype: torch.dtype,
        device: torch.device,
        positions: list[Tensor] | None = None,
        documents: list[Documents] | None = None,
    ) -> tuple[Tensor | None, StepStats]:
        """Run all actions for one optimizer step; returns the summed loss on the last stage's rank.
        `positions`: each micro-batch's global token positions (a sequence shard under context
        parallelism), passed to every stage; `documents`: each micro-batch's packed documents
        (every rank has every micro-batch's tokens), passed to every stage too."""
        run = _Step(self, micro_inputs, micro_labels, (*shape,), dtype, device)
        run.positions, run.documents = positions, documents
        with run.stats.timing("step_s", device):
            self._run(run)
        self.steps += 1
        self.last_stats = run.stats
        return run.total_loss, run.stats

    def _run(self, run: _Step) -> None:
        phases = iter(self._phases)
        for item in self.program:
            if isinstance(item, Post):
                run.post(item.actions)
                continue
            a = item.action
            run.phase = next(phases)
            if a.kind == Kind.F:
                run.forward(a)
            else:
                last = a == self._last_backward[a.stage]
                _defer_gradient_sync(self.stages[a.stage], until_last=last)
                run.backward(a)
            run.in_flight = [b for b in run.in_flight if not b.poll()]  # free what has been sent
        with run.stats.timing("wait_cooldown_s", run.device):
            for batch in run.in_flight:
                batch.wait()
        if run.receives or run.outbox:
            unused = list(run.receives) + list(run.outbox)
            raise RuntimeError(f"pipeline step ended with unused messages: {unused}")
        self.cache.clear()  # a forward-only pass leaves its microbatches behind

    def _forward_context(self) -> contextlib.AbstractContextManager:
        if self.forward_context is None or not torch.is_grad_enabled():
            return contextlib.nullcontext()
        return self.forward_context()


class _Step:
    """One step's state on this rank: units in flight, messages produced, posted and sending."""

    def __init__(self, rt: PipelineRuntime, inputs, labels, shape, dtype, device) -> None:
        self.rt, self.inputs, self.labels = rt, inputs, labels
        self.shape, self.dtype, self.device = shape, dtype, device
        self.n_micro = len(inputs) if inputs is not None else len(labels)
        self.units: dict[tuple[int, int], _Unit] = {}
        self.outbox: dict[tuple, Tensor] = {}  # produced, not yet posted
        self.receives: dict[tuple, p2p.Batch] = {}  # posted receives by (kind, microbatch, stage)
        self.in_flight: list[p2p.Batch] = []  # groups whose sends are not known to be complete
        self.posted = 0  # groups posted so far this step
        self.stats = StepStats()
        self.total_loss: Tensor | None = None
        self.positions: list[Tensor] | None = None
        self.documents: list[Documents] | None = None
        self.phase = "warmup"  # of the compute running: where its waits are counted

    def post(self, actions: tuple[Action, ...]) -> None:
        sends, recvs = [], []
        for a in actions:
            if a.kind in SENDS:
                sends.append(p2p.Send(self.outbox.pop(_key(a)), a.peer, self.label(a)))
            else:
                n = self.rt.cache.hop_size(upstream(a), a.microbatch)
                recvs.append(p2p.Recv((n, *self.shape), self.dtype, a.peer, self.label(a)))
        batch = p2p.post(self.rt.group, sends, recvs, self.device, self.stats)
        batch.position = self.posted  # groups are runs of the global order: earlier = lower
        self.posted += 1
        self.receives.update({_key(a): batch for a in actions if a.kind not in SENDS})
        if sends:
            self.in_flight.append(batch)

    def label(self, a: Action) -> str:
        """The message's name at both ends, unique within the run: "step 12: F3 0>1" (1-based)."""
        return f"{self.rt.name} {self.rt.steps + 1}: {label(a)}"

    def take(self, a: Action) -> Tensor | None:
        """The receive compute `a` consumes, waited on; None if it has none."""
        recv = consumed_receive(a, self.rt._messages)
        if recv is None or self.rt._empty_hop(recv):
            return None
        batch = self.receives.pop(_key(recv))
        with self.stats.timing(f"wait_{self.phase}_s", self.device):
            hop = batch.recv(self.label(recv))
            # The peer posts in the global order too, so before sending this it had posted the
            # receives of everything this rank sent it in earlier groups: those sends are
            # complete or completing, and waiting for them frees their buffers without waiting
            # on the peer.
            for earlier in self.in_flight:
                if earlier.position < batch.position:
                    earlier.wait_sends(recv.peer)
        return hop

    def produce(self, kind: Kind, a: Action, tensor: Tensor | None) -> None:
        key = (kind, a.microbatch, a.stage)
        if key in self.rt._messages and tensor is not None:
            self.outbox[key] = tensor

    def forward(self, a: Action) -> None:
        rt, stats = self.rt, self.stats
        stage = rt.stages[a.stage]
        unit = _Unit()
        if stage.spec.is_first:
            state_in = self.inputs[a.microbatch]
            rt.cache.start(a.microbatch)
        else:
            unit.recv = self.take(a)
            if unit.recv is not None:
                unit.recv.requires_grad_()
            with stats.timing("cache_s", self.device):
                state_in = rt.cache.receive(a.stage, a.microbatch, unit.recv)
        with stats.timing("compute_s", self.device):
            with rt._forward_context(), spans.span("forward", mb=a.microbatch, chunk=a.stage):
                labels = self.labels[a.microbatch] if stage.spec.is_last else None
                docs = self.documents[a.microbatch] if self.documents is not None else None
                pos = self.positions[a.microbatch] if self.positions is not None else None
                out = stage(state_in, labels, pos, docs)
            if stage.spec.is_last:
                unit.loss = out / self.n_micro
                loss = unit.loss.detach()
                self.total_loss = loss if self.total_loss is None else self.total_loss + loss
            else:
                unit.outputs = rt.cache.produced(a.stage, a.microbatch, out)
        self.units[(a.microbatch, a.stage)] = unit
        stats.peak_units = max(stats.peak_units, len(self.units))
        if (Kind.SEND_F, a.microbatch, a.stage) in rt._messages:
            with stats.timing("cache_s", self.device):
                hop = rt.cache.outgoing(a.stage, a.microbatch, unit.outputs, self.dtype)
            stats.per_hop_bytes.append(0 if hop is None else hop.numel() * hop.element_size())
            self.produce(Kind.SEND_F, a, hop)

    def backward(self, a: Action) -> None:
        rt = self.rt
        stage = rt.stages[a.stage]
        unit = self.units.pop((a.microbatch, a.stage))
        if stage.spec.is_last:
            tensors, grads = [unit.loss], None
        else:
            grad_hop = self.take(a)
            with self.stats.timing("cache_s", self.device):
                tensors, grads = rt.cache.backward_targets(
                    a.stage, a.microbatch, unit.outputs, grad_hop
                )
        with (
            self.stats.timing("compute_s", self.device),
            spans.span("backward", mb=a.microbatch, chunk=a.stage),
        ):
            torch.autograd.backward(tensors, grads)
        if unit.recv is not None:  # the gradient hop: handed over, so only the send holds it
            with self.stats.timing("cache_s", self.device):
                grad = rt.cache.input_grads(unit.recv).contiguous()
            unit.recv.grad = None
            self.produce(Kind.SEND_B, a, grad)
        if a.stage == min(rt.stages):  # the rank's last backward for this microbatch
            rt.cache.finish(a.microbatch)


def compute_phases(actions: list[Action]) -> list[str]:
    """The phase of each of a rank's computes, in order: "warmup" before its first backward,
    "cooldown" after its last forward, "steady" between (where its waits are counted)."""
    computes = [a.kind for a in actions if a.kind in (Kind.F, Kind.B)]
    first_b = computes.index(Kind.B) if Kind.B in computes else len(computes)
    last_f = max((i for i, k in enumerate(computes) if k == Kind.F), default=-1)
    return [
        "warmup" if i < first_b else "steady" if i <= last_f else "cooldown"
        for i in range(len(computes))
    ]


def _key(a: Action) -> tuple:
    return (a.kind, a.microbatch, a.stage)


def _defer_gradient_sync(stage: PipelineStage, until_last: bool) -> None:
    """A stage wrapped by FSDP2 (or its replicate) would reduce-scatter / all-reduce its gradients
    after every micro-batch's backward; accumulate them unsharded instead and reduce once, in the
    stage's last backward of the step (what FSDP1 called `no_sync`): M times fewer reductions for
    the memory of one unsharded gradient copy. The same sum, so results change by rounding only.
    A stage that keeps its gathered parameters (`keep_gathered`) reshards them only then, too: the
    step's next micro-batches compute with them, gathered once."""
    sync = getattr(stage, "set_requires_gradient_sync", None)  # FSDPModule API
    if sync is not None:
        sync(until_last)
        if stage.keep_gathered:
            stage.set_reshard_after_backward(until_last)
