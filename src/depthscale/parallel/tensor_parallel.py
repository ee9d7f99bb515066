"""Tensor parallelism with sequence parallelism (Megatron layout), hand-written on our own collectives
so the MegaScale communication/GEMM overlap is under our control.

    apply_tensor_parallel(model, tp_mesh, chunks=1)   # in place, on the full single-process weights
    ... loss.backward() (every micro-batch) ...
    tp_sync_replicated_grads(model)                   # once per optimizer step, before clipping

Layout (tp ranks r = 0..tp-1, sequence T, shard t = T/tp):

    tokens [B,T] ──slice──▶ embed [B,t,d]            depth state (hidden / partial sums / AttnRes blocks),
                                                     norms and AttnRes reads: sequence shards [B,t,d]
    x = norm(read(state))         [B,t,d]
      │ all-gather T (SP→TP)                         ┐ fused + chunked when chunks > 1:
    wq,wk,wv,(w_gate,w_up)  column-parallel [B,T,·/tp] ┘ AG of piece i+1 overlaps the GEMM of piece i
    local heads over the full sequence (RoPE on global positions), SwiGLU on local hidden features
    wo,(w_down)  row-parallel, partial sums [B,T,d]  ┐ fused + chunked: RS of piece i overlaps the
      │ reduce-scatter T (TP→SP)                     ┘ GEMM of piece i+1
    write(state, y)               [B,t,d]
    ...
    output read, norm, LM head on the shard [B,t,V] ──all-gather T──▶ logits [B,T,V] on every rank

With the parallel block one all-gather feeds attention and MLP (five column GEMMs) and the two
row-parallel outputs are summed before one reduce-scatter.

Weights: column-parallel `wq,wk,wv,w_gate,w_up` are DTensor `Shard(0)` parameters on `tp_mesh`, row-
parallel `wo,w_down` DTensor `Shard(1)`; the forward computes on `weight.to_local()`. Parameter names do
not change (`layers.0.attention.wq.weight`), so DCP checkpoints reshard to and from the single-process
model, and FSDP2 can shard the DTensors again over a data-parallel mesh (2-D).

Replicated parameters (embedding / tied LM head, RMSNorm gains, AttnRes `pseudo_query`/`key_norm`)
stay plain tensors, the same on every tp rank. Each rank feeds them different tokens, so each holds
part of their gradient: `tp_sync_replicated_grads(model)` sums them over the tp group in one coalesced
all-reduce. It is explicit (not a hook) because it must run once per optimizer step, after the last
micro-batch's backward and before gradient clipping: a post-accumulate hook would re-reduce gradients
already accumulated, and hooks on parameters do not survive FSDP2 swapping them. It is a sum, so it
commutes with data-parallel reductions and may run before or after them.

Collectives per training step (forward + backward), with S = sublayers (2 per layer, 1 with the
parallel block) and k = chunks: see `collectives_per_step` —
    all-gather 2·k·S + 1 (k per sublayer forward, k per sublayer backward, +1 for the logits),
    reduce-scatter 2·k·S, all-reduce 1 (the replicated-gradient sync).

Gradient-norm clipping must handle the mix: sharded grads are DTensors (norm over the tp group),
replicated grads are plain and identical on every tp rank (count them once);
`torch.nn.utils.clip_grad_norm_` refuses mixed DTensor / Tensor lists.

Memory: like Megatron without its backward re-gather, the column-parallel GEMMs save the gathered
input [B, T, d] for the weight gradient (the fused operators do the same, so chunks change no memory).

Limits: training/eval forward only (no KV caches); T must be divisible by tp and T/tp by chunks.
Module code (`model/`) is untouched: blocks and the model have their class swapped to the sequence-
parallel subclasses below, and `nn.Linear`s are replaced by Column/RowParallelLinear.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from depthscale.config import ModelConfig
from depthscale.errors import ConfigError
from depthscale.model.layers import KVCache
from depthscale.model.residual import DepthState
from depthscale.model.transformer import Transformer, TransformerBlock
from depthscale.parallel.tp_comm import (
    all_gather_matmul,
    all_reduce_,
    gather_sequence_replicated,
    matmul_reduce_scatter,
)

COLUMN = ("wq", "wk", "wv", "w_gate", "w_up")
ROW = ("wo", "w_down")


@dataclass
class TPContext:
    mesh: DeviceMesh
    group: dist.ProcessGroup
    size: int
    rank: int
    chunks: int


class ColumnParallelLinear(nn.Module):
    """Y = X·Wᵀ with W's output features sharded over tp (`weight`: DTensor Shard(0)). Called on its
    own it takes the sequence shard and all-gathers it; blocks call `all_gather_matmul` on several of
    these at once to share one gather."""

    def __init__(self, linear: nn.Linear, ctx: TPContext) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = nn.Parameter(
            distribute_tensor(linear.weight.detach(), ctx.mesh, [Shard(0)], src_data_rank=None)
        )
        self.tp = ctx

    def local_weight(self) -> Tensor:
        return self.weight.to_local()

    def forward(self, x: Tensor) -> Tensor:
        """[B, T/tp, in] → [B, T, out/tp]."""
        return all_gather_matmul(x, [self.local_weight()], self.tp.group, self.tp.chunks)[0]

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, tp={self.tp.size} (Shard(0))"


class RowParallelLinear(nn.Module):
    """Y = X·Wᵀ with W's input features sharded over tp (`weight`: DTensor Shard(1)); the partial sums
    are reduce-scattered back to sequence shards."""

    def __init__(self, linear: nn.Linear, ctx: TPContext) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = nn.Parameter(
            distribute_tensor(linear.weight.detach(), ctx.mesh, [Shard(1)], src_data_rank=None)
        )
        self.tp = ctx

    def local_weight(self) -> Tensor:
        return self.weight.to_local()

    def forward(self, x: Tensor) -> Tensor:
        """[B, T, in/tp] → [B, T/tp, out]."""
        return matmul_reduce_scatter([x], [self.local_weight()], self.tp.group, self.tp.chunks)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, tp={self.tp.size} (Shard(1))"


def _no_cache(cache) -> None:
    if cache is not None:
        raise NotImplementedError(
            "tensor parallelism supports training/eval forward only; KV-cache decoding is not "
            "sequence-parallel (generate with the single-process model)"
        )


class SequenceParallelBlock(TransformerBlock):
    """A `TransformerBlock` whose depth state is sequence-sharded; attention and MLP run tensor-
    parallel between one all-gather and one reduce-scatter per sublayer (both per parallel block)."""

    tp: TPContext

    def forward(
        self,
        state: DepthState,
        cos: Tensor,
        sin: Tensor,
        positions: Tensor | None = None,
        cache: KVCache | None = None,
        start: int = 0,
    ) -> DepthState:
        _no_cache(cache)
        g, k = self.tp.group, self.tp.chunks
        attn, mlp = self.attention, self.feed_forward
        if self.parallel:
            x = self.attention_norm(self.residual.read(state))
            cols = [getattr(attn, n) for n in COLUMN[:3]] + [mlp.w_gate, mlp.w_up]
            q, kk, v, gate, up = all_gather_matmul(x, [m.local_weight() for m in cols], g, k)
            ya = attn.attend(q, kk, v, cos, sin, positions)
            ym = F.silu(gate) * up
            y = matmul_reduce_scatter(
                [ya, ym], [attn.wo.local_weight(), mlp.w_down.local_weight()], g, k
            )
            return self.residual.write(state, y)
        x = self.attention_norm(self.attention_residual.read(state))
        q, kk, v = all_gather_matmul(
            x, [attn.wq.local_weight(), attn.wk.local_weight(), attn.wv.local_weight()], g, k
        )
        ya = attn.attend(q, kk, v, cos, sin, positions)
        y = matmul_reduce_scatter([ya], [attn.wo.local_weight()], g, k)
        state = self.attention_residual.write(state, y)
        x = self.ffn_norm(self.ffn_residual.read(state))
        gate, up = all_gather_matmul(x, [mlp.w_gate.local_weight(), mlp.w_up.local_weight()], g, k)
        y = matmul_reduce_scatter([F.silu(gate) * up], [mlp.w_down.local_weight()], g, k)
        return self.ffn_residual.write(state, y)


class SequenceParallelTransformer(Transformer):
    """A `Transformer` whose embed keeps this rank's sequence shard, whose layers see RoPE tables of
    the full sequence (`rope_for`), and whose head all-gathers the logits so every rank returns
    [B, T, V]. Pipeline stages call these same methods, so tp composes with pp."""

    tp: TPContext

    def embed(self, tokens: Tensor) -> DepthState:
        T = tokens.shape[1]
        check_seq_len(T, self.tp.size, self.tp.chunks)
        t = T // self.tp.size
        return super().embed(tokens[:, self.tp.rank * t : (self.tp.rank + 1) * t])

    def rope_for(self, state: DepthState, positions: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """Tables for the full sequence: the layers gather it for attention."""
        return self.rope(positions, state.seq_len * self.tp.size)

    def run_layers(
        self,
        state: DepthState,
        positions: Tensor | None = None,
        caches: list[KVCache] | None = None,
        start: int = 0,
    ) -> DepthState:
        _no_cache(caches)
        return super().run_layers(state, positions)

    def head(self, state: DepthState) -> Tensor:
        return gather_sequence_replicated(super().head(state), self.tp.group)


def check_seq_len(seq_len: int, tp: int, chunks: int) -> None:
    if seq_len % tp:
        raise ConfigError(
            f"sequence parallelism: seq_len={seq_len} is not divisible by tp={tp}; "
            f"allowed: multiples of {tp}"
        )
    if (seq_len // tp) % chunks:
        raise ConfigError(
            f"tp overlap: the per-rank sequence shard seq_len/tp={seq_len // tp} "
            f"(seq_len={seq_len}, tp={tp}) is not divisible by chunks={chunks}; "
            f"allowed: seq_len a multiple of tp·chunks={tp * chunks}"
        )


def check_tp_divides(cfg: ModelConfig, tp: int) -> None:
    for name, value in (
        ("n_heads", cfg.n_heads),
        ("kv_heads (n_kv_heads or n_heads)", cfg.kv_heads),
        ("hidden_dim (ffn_dim)", cfg.hidden_dim),
    ):
        if value % tp:
            raise ConfigError(
                f"tensor parallelism: model.{name}={value} is not divisible by tp={tp}; "
                f"choose tp dividing n_heads={cfg.n_heads}, kv_heads={cfg.kv_heads} and "
                f"hidden_dim={cfg.hidden_dim}"
            )


def apply_tensor_parallel(model: Transformer, tp_mesh: DeviceMesh, chunks: int = 1) -> None:
    """Shard `model` (holding the full single-process weights, identical on every tp rank) in place
    for tensor + sequence parallelism over the 1-D `tp_mesh`. `chunks` > 1 turns on the MegaScale
    overlap of the sequence all-gather / reduce-scatter with the column / row GEMMs."""
    if type(model) is not Transformer:
        raise TypeError(
            f"apply_tensor_parallel expects a plain depthscale Transformer, got {type(model).__name__} "
            "(apply tensor parallelism once, before FSDP / compile wrappers)"
        )
    if tp_mesh.ndim != 1:
        raise ValueError(f"tp_mesh must be 1-D, got a {tp_mesh.ndim}-D mesh")
    if chunks < 1:
        raise ConfigError(f"parallel.tp_overlap_chunks={chunks} must be >= 1")
    tp = tp_mesh.size()
    check_tp_divides(model.cfg, tp)
    ctx = TPContext(tp_mesh, tp_mesh.get_group(), tp, tp_mesh.get_local_rank(), chunks)
    for block in model.layers.values():
        for parent in (block.attention, block.feed_forward):
            for name, child in list(parent.named_children()):
                if name in COLUMN:
                    setattr(parent, name, ColumnParallelLinear(child, ctx))
                elif name in ROW:
                    setattr(parent, name, RowParallelLinear(child, ctx))
        block.__class__ = SequenceParallelBlock
        block.tp = ctx
    model.__class__ = SequenceParallelTransformer
    model.tp = ctx
    model._tp_replicated = [n for n, p in model.named_parameters() if not isinstance(p, DTensor)]


@torch.no_grad()
def tp_sync_replicated_grads(model: nn.Module) -> None:
    """Sum the gradients of the tp-replicated parameters (embedding, norms, AttnRes) over the tp group,
    in one all-reduce per dtype. Call once per optimizer step after all backward passes."""
    ctx: TPContext | None = getattr(model, "tp", None)
    if ctx is None or ctx.size == 1:
        return
    names = set(model._tp_replicated)
    grads: dict[torch.dtype, list[Tensor]] = {}
    for name, p in model.named_parameters():
        if name in names and p.grad is not None:
            g = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
            grads.setdefault(g.dtype, []).append(g)
    for gs in grads.values():
        flat = torch.cat([g.reshape(-1) for g in gs])
        all_reduce_(flat, ctx.group)
        offset = 0
        for g in gs:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()


def collectives_per_step(cfg: ModelConfig, chunks: int, sync_grads: bool = True) -> dict[str, int]:
    """Collectives one forward + backward (+ the replicated-gradient sync) issues on each rank."""
    s = cfg.n_sublayers
    counts = {"all_gather": 2 * chunks * s + 1, "reduce_scatter": 2 * chunks * s}
    if sync_grads:
        counts["all_reduce"] = 1
    return counts
