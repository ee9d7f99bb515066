"""The collectives of tensor + sequence parallelism, as small autograd Functions with their backward
(Megatron's g / ḡ operators for sequence parallelism; picotron's `tp_communications.py` idea), and the
MegaScale fused collective+GEMM operators that pipeline them in chunks.

Layout: activations are [B, T, ...]; the sequence shard of tp rank r holds the tokens
[r·T/tp, (r+1)·T/tp). Every collective runs on a contiguous buffer (gloo wants contiguous tensors and
the tensor collectives' output as a concatenation along dim 0, so buffers are flattened) and is counted
inside a `count_collectives()` block.

Operators (forward / backward):

- `gather_sequence`            all-gather along T / reduce-scatter (SP → TP, before column-parallel GEMMs)
- `reduce_scatter_sequence`    reduce-scatter along T / all-gather (TP → SP, after row-parallel GEMMs)
- `all_gather_matmul`          AG + column-parallel GEMMs, chunked: AG of piece i+1 in flight while
  piece i multiplies / chunked GEMM + reduce-scatter of piece i while piece i+1 computes
- `matmul_reduce_scatter`      row-parallel GEMMs (summed) + RS, chunked: RS of piece i in flight while
  piece i+1 multiplies / chunked AG + GEMM, prefetching piece i+1

Chunk i of the fused operators is piece i of every rank's shard (rank r's tokens
r·T/tp + i·c … r·T/tp + (i+1)·c - 1, with c = T/(tp·chunks)), so one chunk is a single collective and
outputs land in their global sequence order. With `chunks=1` the fused operators reduce to one
collective each; the model uses the unfused `gather_sequence` / `reduce_scatter_sequence` path then.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import Tensor
from torch.autograd import Function

from depthscale.observe import spans

Group = dist.ProcessGroup


_counters: list[Counter[str]] = []
"""The open `count_collectives` scopes (a list, not a context variable: backward may run on
autograd's own threads)."""


@contextmanager
def count_collectives() -> Iterator[Counter[str]]:
    """Count the collectives of tensor/sequence parallelism issued inside the block, by kind
    ('all_gather', 'reduce_scatter', 'all_reduce'): `with count_collectives() as counts: ...`.
    Outside any block nothing is counted; counting changes no behaviour."""
    counts: Counter[str] = Counter()
    _counters.append(counts)
    try:
        yield counts
    finally:
        _counters.remove(counts)


def record_collective(kind: str) -> None:
    for counts in _counters:
        counts[kind] += 1


# --------------------------------------------------------------------------------- raw collectives

# torch 2.13 renamed the flat-tensor collectives all_gather_into_tensor / reduce_scatter_tensor to
# all_gather_single / reduce_scatter_single (the old names warn there); torch 2.11 has only the old
# names. The name is looked up on `dist` at each call, so a patched collective is still seen.
ALL_GATHER = "all_gather_single" if hasattr(dist, "all_gather_single") else "all_gather_into_tensor"
REDUCE_SCATTER = (
    "reduce_scatter_single" if hasattr(dist, "reduce_scatter_single") else "reduce_scatter_tensor"
)


# Under torch.compile (`train.compile` compiles each block) the collectives are traced as torch's
# functional collectives: c10d's Work objects and the span/counter bookkeeping around them are
# Python the graph cannot hold, and each broke every compiled layer's graph in four or more
# pieces. In the graph a collective's wait sits where its result is first used, which is where
# `work.wait()` stands in the chunked operators below, so their overlap is kept. A compiled
# layer's collectives are then not counted (`count_collectives` counts eager runs) and leave no
# spans: the profiler's trace and NCCL's flight recorder show them.


class _Traced:
    """The Work of a collective in a compiled graph: there the wait is the graph's, at first use."""

    def wait(self) -> bool:
        return True


_TRACED = _Traced()


def all_gather_blocks(x: Tensor, group: Group, async_op: bool = False):
    """x [*s] on every rank → [tp, *s] stacked in rank order (and the Work when async)."""
    x = x.contiguous()
    if torch.compiler.is_compiling():
        return funcol.all_gather_tensor(x.unsqueeze(0), 0, group), _TRACED
    out = x.new_empty((dist.get_world_size(group), *x.shape))
    with spans.collective("all_gather", group, x):  # async: the span covers the issue only
        work = getattr(dist, ALL_GATHER)(out.view(-1), x.view(-1), group=group, async_op=async_op)
    record_collective("all_gather")
    return out, work


def reduce_scatter_blocks(x: Tensor, group: Group, async_op: bool = False):
    """x [tp, *s] → [*s] on rank r: the sum over ranks of block r (and the Work when async)."""
    x = x.contiguous()
    if torch.compiler.is_compiling():
        return funcol.reduce_scatter_tensor(x, "sum", 0, group).squeeze(0), _TRACED
    out = x.new_empty(x.shape[1:])
    with spans.collective("reduce_scatter", group, x):
        work = getattr(dist, REDUCE_SCATTER)(
            out.view(-1), x.view(-1), group=group, async_op=async_op
        )
    record_collective("reduce_scatter")
    return out, work


def all_reduce_(x: Tensor, group: Group) -> Tensor:
    """In-place sum over the group (x must be contiguous)."""
    if torch.compiler.is_compiling():
        return x.copy_(funcol.all_reduce(x, "sum", group))
    with spans.collective("all_reduce", group, x):
        dist.all_reduce(x, group=group)
    record_collective("all_reduce")
    return x


def _blocks_to_seq(blocks: Tensor) -> Tensor:
    """[tp, B, t, ...] → [B, tp·t, ...]."""
    tp, b, t = blocks.shape[:3]
    return blocks.transpose(0, 1).reshape(b, tp * t, *blocks.shape[3:])


def _seq_to_blocks(x: Tensor, tp: int) -> Tensor:
    """[B, T, ...] → [tp, B, T/tp, ...] (contiguous)."""
    b, t = x.shape[:2]
    return x.reshape(b, tp, t // tp, *x.shape[2:]).transpose(0, 1).contiguous()


def _gather_seq(x: Tensor, group: Group) -> Tensor:
    return _blocks_to_seq(all_gather_blocks(x, group)[0])


def _reduce_scatter_seq(x: Tensor, group: Group) -> Tensor:
    return reduce_scatter_blocks(_seq_to_blocks(x, dist.get_world_size(group)), group)[0]


# ------------------------------------------------------------------------------ autograd Functions


class _GatherSequence(Function):
    @staticmethod
    def forward(ctx, x: Tensor, group: Group) -> Tensor:
        ctx.group = group
        return _gather_seq(x, group)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return _reduce_scatter_seq(grad, ctx.group), None


class _ReduceScatterSequence(Function):
    @staticmethod
    def forward(ctx, x: Tensor, group: Group) -> Tensor:
        ctx.group = group
        return _reduce_scatter_seq(x, group)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return _gather_seq(grad, ctx.group), None


def gather_sequence(x: Tensor, group: Group) -> Tensor:
    """[B, T/tp, ...] sequence shard → [B, T, ...]; backward reduce-scatters the (partial) gradient."""
    return _GatherSequence.apply(x, group)


def reduce_scatter_sequence(x: Tensor, group: Group) -> Tensor:
    """[B, T, ...] partial sums → [B, T/tp, ...] summed sequence shard; backward all-gathers."""
    return _ReduceScatterSequence.apply(x, group)


# ------------------------------------------------------------- fused collective + GEMM (MegaScale)


def _compute_dtype(x: Tensor) -> torch.dtype:
    """What F.linear would compute in here: the autocast dtype when autocast is on, else x's dtype."""
    dev = x.device.type
    if torch.is_autocast_enabled(dev):
        return torch.get_autocast_dtype(dev)
    return x.dtype


class _AllGatherMatmul(Function):
    """outs_k = gather_sequence(x) @ W_k^T for all k, pipelined in `chunks` pieces."""

    @staticmethod
    def forward(ctx, x: Tensor, group: Group, chunks: int, *weights: Tensor):
        cdt = _compute_dtype(x)
        tp = dist.get_world_size(group)
        b, t, d = x.shape
        c = t // chunks
        xs = x.to(cdt)
        ws = [w.to(cdt) for w in weights]
        x_full = xs.new_empty(b, tp, chunks, c, d)
        outs = [xs.new_empty(b, tp, chunks, c, w.shape[0]) for w in ws]
        with torch.autocast(x.device.type, enabled=False):
            pending = all_gather_blocks(xs[:, 0:c], group, async_op=True)
            for i in range(chunks):
                blocks, work = pending
                work.wait()
                if i + 1 < chunks:  # prefetch: piece i+1 travels while piece i multiplies
                    pending = all_gather_blocks(xs[:, (i + 1) * c : (i + 2) * c], group, True)
                rows = blocks.transpose(0, 1)  # [B, tp, c, d]
                x_full[:, :, i] = rows
                for out, w in zip(outs, ws):
                    out[:, :, i] = rows @ w.t()
        ctx.save_for_backward(x_full, *ws)
        ctx.group, ctx.chunks, ctx.x_dtype = group, chunks, x.dtype
        ctx.w_dtypes = [w.dtype for w in weights]
        return tuple(o.view(b, tp * t, -1) for o in outs)

    @staticmethod
    def backward(ctx, *grads: Tensor):
        x_full, *ws = ctx.saved_tensors
        group, chunks = ctx.group, ctx.chunks
        b, tp, _, c, d = x_full.shape
        cdt = x_full.dtype
        gs = [
            (g if g is not None else x_full.new_zeros(b, tp * chunks * c, w.shape[0]))
            .to(cdt)
            .reshape(b, tp, chunks, c, -1)
            for g, w in zip(grads, ws)
        ]
        works = []
        for i in range(chunks):  # grad of gathered piece i (partial over ranks) → reduce-scatter
            part = sum(g[:, :, i] @ w for g, w in zip(gs, ws))  # [B, tp, c, d]
            works.append(reduce_scatter_blocks(part.transpose(0, 1), group, async_op=True))
        # weight gradients overlap the last reduce-scatters
        x2 = x_full.reshape(-1, d)
        grad_ws = [
            (g.reshape(-1, g.shape[-1]).t() @ x2).to(dt)
            for g, dt in zip(gs, ctx.w_dtypes, strict=True)
        ]
        pieces = []
        for out, work in works:
            work.wait()
            pieces.append(out)
        grad_x = torch.cat(pieces, dim=1).to(ctx.x_dtype)
        return (grad_x, None, None, *grad_ws)


class _MatmulReduceScatter(Function):
    """reduce_scatter_sequence(sum_k ys_k @ W_k^T), pipelined in `chunks` pieces."""

    @staticmethod
    def forward(ctx, group: Group, chunks: int, n: int, *tensors: Tensor):
        ys, weights = tensors[:n], tensors[n:]
        cdt = _compute_dtype(ys[0])
        tp = dist.get_world_size(group)
        b, t_full = ys[0].shape[:2]
        c = t_full // (tp * chunks)
        ys_c = [y.to(cdt) for y in ys]
        ws = [w.to(cdt) for w in weights]
        views = [y.reshape(b, tp, chunks, c, -1) for y in ys_c]
        works = []
        with torch.autocast(ys[0].device.type, enabled=False):
            for i in range(chunks):  # reduce-scatter of piece i travels while piece i+1 multiplies
                part = sum(v[:, :, i] @ w.t() for v, w in zip(views, ws))  # [B, tp, c, d]
                works.append(reduce_scatter_blocks(part.transpose(0, 1), group, async_op=True))
        pieces = []
        for out, work in works:
            work.wait()
            pieces.append(out)
        ctx.save_for_backward(*ys_c, *ws)
        ctx.group, ctx.chunks, ctx.n = group, chunks, n
        ctx.dtypes = [x.dtype for x in tensors]
        return torch.cat(pieces, dim=1)

    @staticmethod
    def backward(ctx, grad: Tensor):
        saved = ctx.saved_tensors
        ys, ws = saved[: ctx.n], saved[ctx.n :]
        group, chunks = ctx.group, ctx.chunks
        tp = dist.get_world_size(group)
        b, t, d = grad.shape
        c = t // chunks
        g = grad.to(ws[0].dtype)
        g_full = g.new_empty(b, tp, chunks, c, d)
        grad_ys = [y.new_empty(b, tp, chunks, c, y.shape[-1]) for y in ys]
        pending = all_gather_blocks(g[:, 0:c], group, async_op=True)
        for i in range(chunks):
            blocks, work = pending
            work.wait()
            if i + 1 < chunks:
                pending = all_gather_blocks(g[:, (i + 1) * c : (i + 2) * c], group, True)
            rows = blocks.transpose(0, 1)  # [B, tp, c, d]
            g_full[:, :, i] = rows
            for gy, w in zip(grad_ys, ws):
                gy[:, :, i] = rows @ w
        g2 = g_full.reshape(-1, d).t()
        grad_ws = [g2 @ y.reshape(-1, y.shape[-1]) for y in ys]
        outs = [gy.view(b, tp * t, -1) for gy in grad_ys] + grad_ws
        return (None, None, None, *(o.to(dt) for o, dt in zip(outs, ctx.dtypes, strict=True)))


def all_gather_matmul(
    x: Tensor, weights: list[Tensor], group: Group, chunks: int = 1
) -> list[Tensor]:
    """Column-parallel GEMMs fed by the sequence all-gather: x [B, T/tp, d] (sequence shard), local
    weights W_k [out_k/tp, d] → [B, T, out_k/tp] each. chunks > 1 pipelines the all-gather with the
    GEMMs (T/tp must be divisible by chunks)."""
    if chunks == 1:
        x_full = gather_sequence(x, group)
        return [torch.nn.functional.linear(x_full, w) for w in weights]
    return list(_AllGatherMatmul.apply(x, group, chunks, *weights))


def matmul_reduce_scatter(
    inputs: list[Tensor], weights: list[Tensor], group: Group, chunks: int = 1
) -> Tensor:
    """Row-parallel GEMMs, summed, then the sequence reduce-scatter: inputs y_k [B, T, in_k/tp],
    local weights W_k [d, in_k/tp] → [B, T/tp, d]. chunks > 1 pipelines GEMMs with the
    reduce-scatter (T/tp must be divisible by chunks)."""
    if chunks == 1:
        partial = sum(torch.nn.functional.linear(y, w) for y, w in zip(inputs, weights))
        return reduce_scatter_sequence(partial, group)
    return _MatmulReduceScatter.apply(group, chunks, len(inputs), *inputs, *weights)
