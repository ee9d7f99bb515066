"""QK-clip (Kimi K2's MuonClip, `optim.qk_clip_tau`): after each Muon step, every attention head
whose largest logit in that step's forward passed τ has W_q and W_k rescaled so its logits shrink
by γ_h = τ / S_h — the logit growth Muon is prone to, stopped at the weights instead of softcapped
in the forward.

S_h comes from the forward's own q and k (`model.attention_logits`: recorded per layer under
no_grad, in blocks, over the pairs the mask allows). Per kv group g (grouped-query attention: one
k head shared by H/Hkv q heads) the scales are

    W_k^g ← √(min_{h∈g} γ_h) · W_k^g        W_q^h ← γ_h / √(min_{h∈g} γ_h) · W_q^h

so every head's logits are scaled by exactly γ_h (≤ 1: every head ends ≤ τ), the shared k takes
the group's strongest clip by half (Kimi K2's √γ split when a group is one head, plain
multi-head attention), and heads that did not pass τ keep their logits (their q rows grow by the
k rows' shrink). A group none of whose heads passed τ is multiplied by exactly 1: untouched.

Replicas stay identical: the maxima of every (layer, head) are gathered into one [layers, heads]
tensor (-inf where a rank has no such head: other pipeline stages' layers, other tp ranks' heads)
and MAX-reduced over all ranks, so every rank scales from the same S (data-parallel ranks saw
different rows). Each rank then scales the rows it holds: its tp heads, its FSDP shard's rows (the
row scale cut by the parameter's own placements, as DTensor cuts it). Nothing is read on the host.

Muon only (`build_optimizer`): AdamW's fused update skips a non-finite step on the device without
the host knowing, and the clip would still rescale; Kimi pairs the clip with Muon.
"""

from __future__ import annotations

import re

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.tensor import DTensor, Replicate, distribute_tensor

from depthscale.model.layers import Attention

__all__ = ["QKClip"]

_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


class QKClip:
    """The clip of one model's attention layers at threshold `tau` (see the module docstring)."""

    def __init__(self, model: nn.Module, tau: float, n_layers: int, n_heads: int, kv_heads: int):
        if tau <= 0:
            raise ValueError(f"QKClip: tau={tau} must be > 0")
        self.tau, self.shape, self.group = tau, (n_layers, n_heads), n_heads // kv_heads
        self.layers: list[tuple[int, Attention, Tensor]] = []
        for name, module in model.named_modules():
            if isinstance(module, Attention):
                match = _LAYER.search(name + ".")
                if match is None:
                    raise ValueError(f"QKClip: attention {name!r} is not in a numbered layer")
                heads = _forward_heads(module.wq.weight, n_heads, module.head_dim)
                self.layers.append((int(match.group(1)), module, heads))
                module.record_max_logits()
        self.device = next(model.parameters()).device
        self.clipped: Tensor | None = None
        """After `apply`: bool [layers, heads], the heads whose S passed tau (for tests, metrics)."""

    def reset(self) -> None:
        """Forget the recorded maxima (a step abandoned by the NaN guard)."""
        for _, attn, _ in self.layers:
            attn.logit_max = None

    @torch.no_grad()
    def apply(self) -> None:
        """Rescale W_q, W_k from the maxima recorded since the last call, then forget them. A
        collective on every rank, attention layers or not: no rank may skip the reduction."""
        device = self.device
        s = torch.full(self.shape, float("-inf"), device=device)
        for index, attn, heads in self.layers:
            if attn.logit_max is not None:
                s[index, heads.to(device)] = attn.logit_max.to(device)
        self.reset()
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(s, op=dist.ReduceOp.MAX)
        over = torch.isfinite(s) & (s > self.tau)
        gamma = torch.where(over, self.tau / s, torch.ones_like(s))
        k_scale = gamma.view(self.shape[0], -1, self.group).amin(-1).sqrt()
        q_scale = gamma / k_scale.repeat_interleave(self.group, dim=1)
        self.clipped = over
        for index, attn, _ in self.layers:
            hd = attn.head_dim
            _scale_rows(attn.wq.weight, q_scale[index].repeat_interleave(hd))
            _scale_rows(attn.wk.weight, k_scale[index].repeat_interleave(hd))


def _forward_heads(weight: Tensor, n_heads: int, head_dim: int) -> Tensor:
    """The global indices of the q heads this rank's forward computes: all of them, or its tensor-
    parallel share (the rows `weight` holds on the mesh dims named tp; FSDP's dims are gathered
    before the forward)."""
    rows = torch.arange(n_heads * head_dim)
    if isinstance(weight, DTensor):
        names = weight.device_mesh.mesh_dim_names or ()
        placements = [
            pl if i < len(names) and names[i] == "tp" else Replicate()
            for i, pl in enumerate(weight.placements)
        ]
        rows = distribute_tensor(rows, weight.device_mesh, placements, src_data_rank=None)
        rows = rows.to_local()
    return rows[::head_dim] // head_dim


def _scale_rows(weight: Tensor, scale: Tensor) -> None:
    """weight[r, :] *= scale[r] for the rows this rank holds (`scale` over the global rows)."""
    column = scale.to(torch.float32)[:, None]
    if isinstance(weight, DTensor):
        local = weight.to_local()
        column = distribute_tensor(
            column.to(local.device), weight.device_mesh, weight.placements, src_data_rank=None
        ).to_local()
    else:
        local = weight
    local.mul_(column.to(local.device, local.dtype))
