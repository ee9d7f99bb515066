"""Initialise parameters the same way whether a rank holds a whole tensor or a slice of it.

A sharded parameter (a DTensor: tensor-parallel, FSDP, or both) is filled with the slice of exactly
the tensor one process would hold: the full tensor is drawn on the parameter's device from a
generator seeded by (seed, name), and this rank keeps its slice (`distribute_tensor` with no
source rank slices locally, without communication). The cost is one full parameter at a time.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor, distribute_tensor

Fill = Callable[[Tensor, torch.Generator], object]


def init_seed(seed: int, key: str) -> int:
    """A stable 63-bit seed for the tensor named `key` (Python's `hash` changes per process)."""
    return (seed * 0x9E3779B1 + zlib.crc32(key.encode())) % (2**63 - 1)


@torch.no_grad()
def fill_seeded_(param: Tensor, key: str, seed: int, fill: Fill) -> None:
    """Fill `param` (plain or DTensor) in place with `fill(full, generator)` drawn on its full
    shape, from a generator seeded by `init_seed(seed, key)` on the parameter's device."""
    local = param.to_local() if isinstance(param, DTensor) else param
    full = torch.empty(param.shape, dtype=param.dtype, device=local.device)
    fill(full, torch.Generator(local.device).manual_seed(init_seed(seed, key)))
    if isinstance(param, DTensor):
        full = distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None)
        full = full.to_local()
    local.copy_(full)


@torch.no_grad()
def fill_constant_(param: Tensor, value: float) -> None:
    (param.to_local() if isinstance(param, DTensor) else param).fill_(value)
