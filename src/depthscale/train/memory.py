"""Activation memory: recomputation and offloading, applied to a model from outside.

- `selective` recompute re-runs each sublayer's body (attention or MLP: projections, SDPA, the
  SwiGLU hidden state; under tensor parallelism their collectives too) in backward, but keeps its
  input: the depth read's sources and the normalized read stay saved, so the AttnRes read itself is
  never recomputed. It wraps the block's sublayer seams (`attention_sublayer`, `mlp_sublayer`,
  `parallel_sublayer`), which every layout's block runs through.
- `full` recompute keeps only each layer's input depth state (the blocks and the partial sum, which
  live anyway) and re-runs the whole layer, depth reads included, in backward.
- Offloading moves the tensors autograd saves for backward to host memory while a microbatch waits
  for its backward (pipeline in-flight microbatches) and brings them back on use. On a CPU-only run
  the copy is a no-op, but the mechanism and its byte accounting are the same.

Modules are patched through their instance `forward`, so parameter names and checkpoints are unchanged.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from depthscale.model.residual import DepthState
from depthscale.model.transformer import Transformer


def _checkpointed(forward):
    def run(*args, **kwargs):
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)

    return run


def _layer_checkpointed(layer: nn.Module):
    """Checkpoint a whole layer. The depth state is rebuilt inside the region, so the two-phase memo
    a read stores on its input state is recomputed too, never reused from the first forward."""
    forward = layer.forward

    def inner(blocks, partial, inter, *args, **kwargs):
        return forward(DepthState(list(blocks), partial, inter), *args, **kwargs)

    def run(state: DepthState, *args, **kwargs):
        return checkpoint(
            inner,
            tuple(state.blocks),
            state.partial,
            state.inter,
            *args,
            use_reentrant=False,
            **kwargs,
        )

    return run


def apply_recompute(model: Transformer, mode: str) -> None:
    """mode: 'none' | 'selective' | 'full' (per layer)."""
    if mode == "none":
        return
    if mode not in ("selective", "full"):
        raise ValueError(f"recompute mode {mode!r}; allowed: 'none', 'selective', 'full'")
    for layer in model.layers.values():
        if mode == "full":
            layer.forward = _layer_checkpointed(layer)
        else:
            for name in ("attention_sublayer", "mlp_sublayer", "parallel_sublayer"):
                setattr(layer, name, _checkpointed(getattr(layer, name)))


@dataclass
class OffloadStats:
    tensors: int = 0
    bytes: int = 0

    def reset(self) -> None:
        self.tensors = self.bytes = 0


@contextlib.contextmanager
def offload_activations(
    stats: OffloadStats | None = None, pin_memory: bool = True
) -> Iterator[OffloadStats]:
    """Within the block, every tensor saved for backward is kept in host memory (pinned when a GPU is
    present) and moved back to its device when backward unpacks it."""
    stats = stats if stats is not None else OffloadStats()
    pin = pin_memory and torch.cuda.is_available()

    def pack(t: torch.Tensor):
        stats.tensors += 1
        stats.bytes += t.numel() * t.element_size()
        if t.device.type == "cpu":
            return t.device, t
        host = torch.empty(t.shape, dtype=t.dtype, layout=t.layout, pin_memory=pin)
        host.copy_(t, non_blocking=pin)
        return t.device, host

    def unpack(packed):
        device, t = packed
        return t if t.device == device else t.to(device, non_blocking=True)

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        yield stats


def saved_activation_bytes(fn: Callable[[], object], params: list[torch.Tensor]) -> int:
    """Bytes of distinct non-parameter storages autograd saves for backward while running fn():
    the activation memory that peaks at the end of the forward pass. Works on CPU, where there is no
    allocator statistic (on CUDA, compare with torch.cuda.max_memory_allocated)."""
    exclude = {p.untyped_storage().data_ptr() for p in params}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        ptr = t.untyped_storage().data_ptr()
        if ptr not in exclude:
            seen[ptr] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    del out
    return sum(seen.values())
