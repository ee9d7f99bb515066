"""The AttnRes cross-stage cache: an adapter right after pipeline P2P.

Block AttnRes needs every completed block at every later stage. Without the cache each hop carries
the whole depth state (partial sum + all blocks so far): C(C−1)/2 · N_p block transfers per token for
C chunks. Under interleaved 1F1B a rank sees each microbatch V times, so it can keep the blocks it
already received or produced: a hop then carries the partial sum and only the blocks the receiving
rank lacks, P(P−1)/2 · N_p + (V−1)·P² · N_p (Attention Residuals, §4.1, Eq. 7–8).

Forward: the receiver concatenates cached blocks with the received ones. Backward: a block read from
the cache by a later chunk gets its gradient there; for a received block that lands in the receive
buffer's `.grad` (a leaf), for a block this rank produced it is captured (a detached leaf) and its
gradient deposited, then added to the producing chunk's output gradient when that chunk's backward
runs — always later, since backward visits a microbatch's chunks in reverse order. A microbatch's
entries are freed after the rank's first chunk finishes its backward. The network code never changes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from depthscale.config import ModelConfig
from depthscale.model.residual import DepthState
from depthscale.parallel.pipeline.stage import blocks_after, has_partial_after


@dataclass
class _Entry:
    tensor: Tensor
    produced_by: int | None  # stage that computed it here (None: it arrived over P2P)
    capture: Tensor | None = None  # the detached leaf later chunks read (produced blocks only)


@dataclass
class _Micro:
    blocks: list[_Entry] = field(default_factory=list)


class DepthCache:
    def __init__(
        self, cfg: ModelConfig, stage_layers: list[range], ranks: int, enabled: bool = True
    ) -> None:
        self.ranks = ranks
        self.enabled = enabled
        ends = [r.stop for r in stage_layers]
        self.k = [blocks_after(cfg, e) for e in ends]  # blocks in the state after each stage
        self.partial = [has_partial_after(cfg, e) for e in ends]
        self.micro: dict[int, _Micro] = {}

    # -- shapes (identical on sender and receiver) ------------------------------------------

    def cached(self, upstream: int) -> int:
        """Blocks the receiver of hop upstream -> upstream+1 already holds: the output of its own
        previous chunk (stage upstream+1-P), when the cache is on."""
        prev = upstream + 1 - self.ranks
        return self.k[prev] if self.enabled and prev >= 0 else 0

    def hop_size(self, upstream: int, microbatch: int = 0) -> int:
        return int(self.partial[upstream]) + self.k[upstream] - self.cached(upstream)

    def blocks_per_hop(self) -> list[int]:
        """Blocks carried by each forward hop 0→1, 1→2, … (partial sums not counted)."""
        return [self.k[u] - self.cached(u) for u in range(len(self.k) - 1)]

    # -- forward ------------------------------------------------------------------------------

    def start(self, microbatch: int) -> None:
        self.micro[microbatch] = _Micro()

    def receive(self, stage: int, microbatch: int, hop: Tensor | None) -> DepthState:
        """The input state of `stage`: cached blocks + the hop's blocks (+ the hop's partial sum)."""
        u = stage - 1
        mic = self.micro.setdefault(microbatch, _Micro())
        c, k, has_p = self.cached(u), self.k[u], self.partial[u]
        # unbind, not hop[i]: its backward stacks the pieces' gradients into the hop's once,
        # where each select's backward would write a zero-filled hop-sized gradient of its own
        parts = hop.unbind(0) if hop is not None else ()
        new = list(parts[int(has_p) : int(has_p) + k - c])
        del mic.blocks[c:]  # stale entries beyond what this hop replaces (cache off: everything)
        mic.blocks.extend(_Entry(t, None) for t in new)
        blocks = [self._read(e) for e in mic.blocks[:c]] + new
        return DepthState(blocks, parts[0] if has_p else None)

    def _read(self, entry: _Entry) -> Tensor:
        if entry.produced_by is None:
            return entry.tensor  # a view of a receive buffer: its gradient accumulates in the leaf
        if entry.capture is None:
            entry.capture = entry.tensor.detach().requires_grad_()
        return entry.capture

    def produced(self, stage: int, microbatch: int, state: DepthState) -> list[Tensor]:
        """Record the output state's blocks; returns [partial?, *blocks] for sending and backward."""
        mic = self.micro[microbatch]
        known = len(mic.blocks)
        for i, block in enumerate(state.blocks):
            if i >= known:
                mic.blocks.append(_Entry(block, stage))
        return ([state.partial] if state.partial is not None else []) + list(state.blocks)

    def outgoing(
        self, stage: int, microbatch: int, outputs: list[Tensor], dtype: torch.dtype
    ) -> Tensor | None:
        """The packed hop in the communication dtype `dtype` (what the receiver's buffers hold):
        partial sum, then the blocks the receiver lacks (None: nothing to send)."""
        has_p = self.partial[stage]
        c = self.cached(stage)
        blocks = outputs[int(has_p) :]
        parts = ([outputs[0]] if has_p else []) + blocks[c:]
        if not parts:
            return None
        return torch.stack([t.detach().to(dtype) for t in parts]).contiguous()

    # -- backward -----------------------------------------------------------------------------

    def backward_targets(
        self, stage: int, microbatch: int, outputs: list[Tensor], grad_hop: Tensor | None
    ) -> tuple[list[Tensor], list[Tensor]]:
        """Output tensors of `stage` and their gradients: from the downstream hop, plus deposits from
        later local chunks that read this stage's produced blocks from the cache."""
        has_p = self.partial[stage]
        c = self.cached(stage)
        grads: dict[int, Tensor] = {}
        carried = ([0] if has_p else []) + [
            int(has_p) + i for i in range(c, len(outputs) - int(has_p))
        ]
        if grad_hop is not None:
            for j, idx in enumerate(carried):
                grads[idx] = grad_hop[j]
        mic = self.micro[microbatch]
        for i, entry in enumerate(mic.blocks):
            if (
                entry.produced_by == stage
                and entry.capture is not None
                and entry.capture.grad is not None
            ):
                idx = int(has_p) + i
                grads[idx] = grads[idx] + entry.capture.grad if idx in grads else entry.capture.grad
                entry.capture = None
        tensors = [outputs[i] for i in sorted(grads) if outputs[i].requires_grad]
        return tensors, [grads[i] for i in sorted(grads) if outputs[i].requires_grad]

    @staticmethod
    def input_grads(recv: Tensor) -> Tensor:
        return recv.grad if recv.grad is not None else torch.zeros_like(recv)

    def clear(self) -> None:
        self.micro.clear()

    def finish(self, microbatch: int) -> None:
        mic = self.micro.pop(microbatch, None)
        if mic is not None:
            left = [
                i
                for i, e in enumerate(mic.blocks)
                if e.capture is not None and e.capture.grad is not None
            ]
            if left:
                raise RuntimeError(
                    f"depth cache: microbatch {microbatch} still holds gradient deposits "
                    f"for blocks {left} after its last backward"
                )
