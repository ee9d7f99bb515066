"""Tensor parallelism with sequence parallelism (Megatron layout), hand-written on our own collectives
so the MegaScale communication/GEMM overlap is under our control.

    apply_tensor_parallel(model, tp_mesh, chunks=1)   # in place, on the full single-process weights
    ... loss.backward() (every micro-batch) ...
    tp_sync_replicated_grads(model)                   # once per optimizer step, before clipping

Layout (tp ranks r = 0..tp-1, sequence T, shard t = T/tp):

    tokens [B,T] ──vocab-parallel embed, reduce-scatter T──▶ [B,t,d]   depth state (hidden / partial sums / AttnRes blocks),
                                                     norms and AttnRes reads: sequence shards [B,t,d]
    x = norm(read(state))         [B,t,d]
      │ all-gather T (SP→TP)                         ┐ fused + chunked when chunks > 1:
    wq,wk,wv,(w_gate,w_up)  column-parallel [B,T,·/tp] ┘ AG of piece i+1 overlaps the GEMM of piece i
    local heads over the full sequence (RoPE on global positions), SwiGLU on local hidden features
    wo,(w_down)  row-parallel, partial sums [B,T,d]  ┐ fused + chunked: RS of piece i overlaps the
      │ reduce-scatter T (TP→SP)                     ┘ GEMM of piece i+1
    write(state, y)               [B,t,d]
    ...
    output read, norm [B,t,d] ──all-gather T──▶ LM head column-parallel over the vocabulary
                                                     ▶ logits [B,T,V/tp]: this rank's vocabulary slice
    loss: vocabulary-parallel cross-entropy (`loss.TokenLoss`), never the full [B,T,V]

With the parallel block one all-gather feeds attention and MLP (five column GEMMs) and the two
row-parallel outputs are summed before one reduce-scatter.

Weights: column-parallel `wq,wk,wv,w_gate,w_up` are DTensor `Shard(0)` parameters on `tp_mesh`, row-
parallel `wo,w_down` DTensor `Shard(1)`; the forward computes on `weight.to_local()`. The embedding and
the LM head are sharded over the vocabulary (`Shard(0)`, rows r·V/tp …), one parameter when tied:
the embedding looks up the tokens of its slice (zeros elsewhere) for the whole sequence and the
reduce-scatter sums the slices while cutting the sequence into shards (Megatron's vocab-parallel
embedding with sequence parallelism). Parameter names do
not change (`layers.0.attention.wq.weight`), so DCP checkpoints reshard to and from the single-process
model, and FSDP2 can shard the DTensors again over a data-parallel mesh (2-D).

Replicated parameters (RMSNorm gains, AttnRes `pseudo_query`/`key_norm`) stay plain tensors, the same on every tp rank. Each rank feeds them different tokens, so each holds
part of their gradient: `tp_sync_replicated_grads(model)` sums them over the tp group in one coalesced
all-reduce. It is explicit (not a hook) because it must run once per optimizer step, after the last
micro-batch's backward and before gradient clipping: a post-accumulate hook would re-reduce gradients
already accumulated, and hooks on parameters do not survive FSDP2 swapping them. It is a sum, so it
commutes with data-parallel reductions and may run before or after them.

Collectives per training step (forward + backward), with S = sublayers (2 per layer, 1 with the
parallel block) and k = chunks: see `collectives_per_step` —
    all-gather 2·k·S + k + 1 (k per sublayer forward and backward, k for the head's input, 1 for
    the embedding's backward), reduce-scatter the same (the embedding's forward, the head's
    backward), all-reduce 3 (the loss's max and sums, the replicated-gradient sync).

Gradient-norm clipping must handle the mix: sharded grads are DTensors (norm over the tp group),
replicated grads are plain and identical on every tp rank (count them once);
`torch.nn.utils.clip_grad_norm_` refuses mixed DTensor / Tensor lists.

Memory: like Megatron without its backward re-gather, the column-parallel GEMMs save the gathered
input [B, T, d] for the weight gradient (the fused operators do the same, so chunks change no memory).

Limits: training/eval forward only (no KV caches); T must be divisible by tp and T/tp by chunks, the
vocabulary by tp.
The model keeps its classes and its one forward: the linears become Column/RowParallelLinear, the
embedding a VocabParallelEmbedding, and each block's `projections` seam the sequence-parallel one
below; `model.seq_shards = tp` tells it that the depth state holds a sequence shard (for RoPE).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from depthscale.config import ModelConfig
from depthscale.errors import ConfigError
from depthscale.model.layers import Projections
from depthscale.model.transformer import Transformer
from depthscale.parallel.tp_comm import (
    all_gather_matmul,
    all_reduce_,
    matmul_reduce_scatter,
    reduce_scatter_sequence,
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
    own (the LM head) it takes the sequence shard and all-gathers it; in the blocks,
    `SequenceParallelProjections` runs a group of these behind one gather."""

    def __init__(
        self, linear: nn.Linear, ctx: TPContext, weight: nn.Parameter | None = None
    ) -> None:
        """`weight`: an existing `Shard(0)` parameter to use (a tied embedding's)."""
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        if weight is None:
            weight = nn.Parameter(
                distribute_tensor(linear.weight.detach(), ctx.mesh, [Shard(0)], src_data_rank=None)
            )
        self.weight = weight
        self.tp = ctx

    def local_weight(self) -> Tensor:
        return self.weight.to_local()

    def forward(self, x: Tensor) -> Tensor:
        """[B, T/tp, in] → [B, T, out/tp]."""
        return all_gather_matmul(x, [self.local_weight()], self.tp.group, self.tp.chunks)[0]

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, tp={self.tp.size} (Shard(0))"


class VocabParallelEmbedding(nn.Module):
    """An embedding whose rows (the vocabulary) are sharded over tp (`weight`: DTensor Shard(0)).
    Tokens of the whole sequence in, this rank's sequence shard of the embeddings out."""

    def __init__(self, embedding: nn.Embedding, ctx: TPContext) -> None:
        super().__init__()
        self.num_embeddings, self.embedding_dim = embedding.weight.shape
        self.weight = nn.Parameter(
            distribute_tensor(embedding.weight.detach(), ctx.mesh, [Shard(0)], src_data_rank=None)
        )
        self.tp = ctx

    def forward(self, tokens: Tensor) -> Tensor:
        """[B, T] → [B, T/tp, dim]: each rank looks up the tokens in its vocabulary slice (zeros for
        the others) and one reduce-scatter sums the slices and keeps this rank's tokens."""
        check_seq_len(tokens.shape[1], self.tp.size, self.tp.chunks)
        weight = self.weight.to_local()
        local = tokens - self.tp.rank * weight.shape[0]
        mine = (local >= 0) & (local < weight.shape[0])
        partial = F.embedding(local.clamp(0, weight.shape[0] - 1), weight)
        partial = partial * mine.unsqueeze(-1).to(partial.dtype)
        return reduce_scatter_sequence(partial, self.tp.group)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, tp={self.tp.size} (Shard(0))"


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


class SequenceParallelProjections(Projections):
    """The block's projections under tensor + sequence parallelism: a column group (q, k, v; gate,
    up; all five in the parallel block) shares one all-gather of the sequence shard, and the row
    outputs (wo; w_down) are summed before one reduce-scatter, each overlapped with its GEMMs when
    `chunks` > 1. The linears are `ColumnParallelLinear` / `RowParallelLinear`."""

    def __init__(self, ctx: TPContext) -> None:
        self.tp = ctx

    def column(self, x: Tensor, linears: Sequence[nn.Module]) -> list[Tensor]:
        weights = [linear.local_weight() for linear in linears]
        return all_gather_matmul(x, weights, self.tp.group, self.tp.chunks)

    def row(self, ys: Sequence[Tensor], linears: Sequence[nn.Module]) -> Tensor:
        weights = [linear.local_weight() for linear in linears]
        return matmul_reduce_scatter(list(ys), weights, self.tp.group, self.tp.chunks)

    def __repr__(self) -> str:
        return f"sequence_parallel(tp={self.tp.size}, chunks={self.tp.chunks})"


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
        ("vocab_size", cfg.vocab_size),
        ("moe_shared_experts × moe_hidden_dim", cfg.moe_shared_experts * cfg.moe_hidden_dim),
    ):
        if value % tp:
            raise ConfigError(
                f"tensor parallelism: model.{name}={value} is not divisible by tp={tp}; "
                f"choose tp dividing n_heads={cfg.n_heads}, kv_heads={cfg.kv_heads}, "
                f"hidden_dim={cfg.hidden_dim} and vocab_size={cfg.vocab_size} (0, automatic, "
                "rounds the tokenizer's vocabulary up to a multiple of 64 that tp divides)"
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
        # an MoE layer's routed experts stay whole on every tp rank (each routes its own sequence
        # shard); its shared experts are a SwiGLU, sharded like a dense one
        ffn = getattr(block.feed_forward, "shared", None) or block.feed_forward
        for parent in (block.attention, ffn):
            for name, child in list(parent.named_children()):
                if name in COLUMN:
                    setattr(parent, name, ColumnParallelLinear(child, ctx))
                elif name in ROW:
                    setattr(parent, name, RowParallelLinear(child, ctx))
        block.projections = SequenceParallelProjections(ctx)
    if model.tok_embeddings is not None:
        model.tok_embeddings = VocabParallelEmbedding(model.tok_embeddings, ctx)
    if model.output is not None:
        tied = None  # a pipeline's last stage keeps its own copy of a tied weight
        if model.cfg.tie_embeddings and model.tok_embeddings is not None:
            tied = model.tok_embeddings.weight
        model.output = ColumnParallelLinear(model.output, ctx, weight=tied)
    model.seq_shards = tp
    model.tp = ctx
    model._tp_replicated = [n for n, p in model.named_parameters() if not isinstance(p, DTensor)]


@torch.no_grad()
def tp_sync_replicated_grads(model: nn.Module) -> None:
    """Sum the gradients of the tp-replicated parameters (norms, AttnRes) over the tp group,
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
    gathers = 2 * chunks * s + chunks + 1
    counts = {"all_gather": gathers, "reduce_scatter": gathers, "all_reduce": 2}
    if sync_grads:
        counts["all_reduce"] += 1
    return counts
