"""What backward recomputes instead of keeping: the `recompute` seam of `TransformerBlock`.

Modes, from most memory kept to least (`benchmarks/recompute.py` measures the bytes each keeps):

- `none`: autograd keeps everything it saves.
- `selective`: op-level, over the whole layer (Megatron's selective recompute, in the form
  torchtitan's op-level policy takes). The outputs of the expensive ops are kept — matrix products
  and attention kernels — and everything between them is recomputed in backward: norms, RoPE, the
  SwiGLU activation, the AttnRes reads and merges, casts. Recomputing those costs a few memory-bound
  passes, not GEMMs. Collectives inside the layer (tensor parallelism's gathers) run again.
- `sublayer`: each sublayer body (attention with its projections, or the MLP) is checkpointed; its
  normalized input and the depth read stay saved, the read itself is never recomputed.
- `full`: each layer keeps only its input depth state (the blocks and the partial sum, which live
  anyway) and re-runs the whole layer, reads included, in backward.

Every mode is exact: losses and gradients are bitwise those of `none` (tests/unit/test_memory.py).
The mode is an attribute of the layer, set on the model before it is sharded
(`Transformer.set_recompute`), so it shows in `print(model)` and FSDP wraps the layer as it runs.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Literal, get_args

import torch
from torch.utils.checkpoint import (
    SAC_IGNORED_OPS,
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

RecomputeMode = Literal["none", "selective", "sublayer", "full"]
MODES: tuple[str, ...] = get_args(RecomputeMode)
LAYER_MODES = ("selective", "full")
"""Modes that checkpoint the whole layer (`sublayer` checkpoints inside it)."""


def _ops(*names: str) -> frozenset:
    """aten overloads by name, skipping those this torch build does not have."""
    found = set()
    for name in names:
        packet = getattr(torch.ops.aten, name, None)
        if packet is not None:
            found.add(packet.default)
    return frozenset(found)


KEPT_OPS = _ops(
    "mm",
    "addmm",
    "bmm",
    "baddbmm",
    "_scaled_mm",
    "_grouped_mm",
    "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention",
    "_flash_attention_forward",
)
"""Ops whose outputs `selective` keeps: the GEMMs and attention kernels (compute-bound; their
outputs are what recomputation would pay for most)."""


def _profiler_ops() -> set:
    """The profiler's record-function annotations: not tensor computation, and FSDP's hooks of a
    unit nested inside the layer (expert-parallel experts) run a different number of them in the
    recomputation than in the forward, which selective checkpointing counts per op and refuses.
    Left out of its replay, as a proposed torch fix does (pytorch/pytorch#196862; torch <= 2.13
    has none)."""
    profiler = torch.ops.profiler
    names = ("_record_function_enter_new", "_record_function_enter", "_record_function_exit")
    ops = set()
    for name in names:
        packet = getattr(profiler, name, None)
        if packet is not None:
            ops.update(getattr(packet, o) for o in packet.overloads())
    return ops


SAC_IGNORED_OPS.update(_profiler_ops())


def _policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in KEPT_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def check_mode(mode: str) -> None:
    if mode not in MODES:
        allowed = ", ".join(repr(m) for m in MODES)
        raise ValueError(f"recompute mode {mode!r}; allowed: {allowed}")


def checkpoint_layer(run: Callable, mode: str, *args):
    """`run(*args)` with the layer-level recompute `mode` (`selective` or `full`)."""
    if mode == "selective":
        return checkpoint(
            run,
            *args,
            use_reentrant=False,
            context_fn=partial(create_selective_checkpoint_contexts, _policy),
        )
    return checkpoint(run, *args, use_reentrant=False)
