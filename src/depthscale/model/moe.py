"""Mixture-of-Experts FFN: a router sends each token to `top_k` of `experts` SwiGLU experts
(dropless: no capacity, every token reaches all k), plus optional shared experts every token uses.
In the depth state it is just the FFN sublayer: Attention Residuals read and write around it as
around a dense MLP.

    scores  = softmax(x·Wr) or sigmoid(x·Wr)                    [N, E]   (fp32)
    chosen  = top-k of scores (+ the balancing bias, for choosing only)
    weights = scores[chosen], optionally renormalised to sum to 1
    y       = Σ_k weights_k · expert_{chosen_k}(x) + shared(x)

Tokens are sorted by expert and every expert's rows run as one group of a grouped GEMM
(`grouped_mm`: `torch._grouped_mm` on CUDA in bf16 and on CPU where the build runs it, one matmul
per expert elsewhere). Between the
sort and the GEMMs sits the `dispatcher`, the seam expert parallelism replaces: locally it hands the
sorted rows to this rank's experts as they are; `parallel/expert_parallel.py` sends them with
all-to-all to the ranks that hold their experts and brings the outputs back.

Load balancing, both kinds from the literature:
* `aux_loss`: the Switch / GShard loss E · Σ_e f_e · P_e (f_e: the share of routed slots expert e
  got, P_e: its mean normalised score), times `moe_aux_loss`;
* `bias` (aux-loss-free, DeepSeek-V3): a per-expert bias added to the scores when choosing (not to
  the weights), moved after every optimizer step by `moe_bias_rate` · sign(mean load − load).
Its statistics are those of one micro-batch of one rank (whole rows under context parallelism)
or, with `moe_balance_scope = "global_batch"`, of every rank's micro-batch of the step: the layer
only sums counts through `token_totals`, which `parallel/` sets. The router z-loss
(`moe_z_loss` · mean log-sum-exp²) keeps the logits small. The auxiliary losses
reach backward through `AuxLoss`: the layer's output carries them (the gradient of the loss
w.r.t. them is `aux_scale`), so they need no path of their own through pipeline stages.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from functools import lru_cache
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from depthscale.config import ModelConfig
from depthscale.model.layers import LOCAL, Projections, SwiGLU, outside_graph
from depthscale.shape import ModelShape


class Routing(NamedTuple):
    experts: Tensor
    """[N, k] int64: each token's chosen experts."""
    weights: Tensor
    """[N, k] fp32: their weights."""
    aux: Tensor
    """The auxiliary loss of this routing (balance + z-loss, with their coefficients), fp32 []."""
    load: Tensor
    """[E] fp32: routed slots per expert."""


class Router(nn.Module):
    """Scores, top-k choice and the auxiliary losses, in fp32 whatever the compute dtype."""

    def __init__(self, cfg: ModelConfig, n_experts: int) -> None:
        super().__init__()
        self.n_experts, self.top_k = n_experts, cfg.moe_top_k
        self.gate, self.normalize = cfg.moe_gate, cfg.moe_normalize_top_k
        self.balance, self.aux_coef, self.z_coef = cfg.moe_balance, cfg.moe_aux_loss, cfg.moe_z_loss
        self.weight = nn.Parameter(torch.empty(n_experts, cfg.dim))
        self.register_buffer("expert_bias", torch.zeros(n_experts))
        """Aux-loss-free balancing's per-expert bias (checkpointed with the model)."""

    def forward(self, x: Tensor, totals: Callable[[Tensor], Tensor] | None = None) -> Routing:
        """x [N, dim] → the routing of its N tokens. `totals`: sums per-expert counts (and the
        token count) over the ranks holding the other tokens the auxiliary losses are taken over
        — those of the same rows (context and sequence parallelism), or of the whole micro-batch
        step (`moe_balance_scope = "global_batch"`) — so this rank's `aux` is its share of the
        loss over all of them: E · Σ_e f_e · (Σ_{its tokens} p_e) / N with f_e, N the totals.
        The counts carry no gradient, the loss is linear in each token's p, so the shares sum
        to that loss and their gradients to its gradient. Only where a backward can use them
        (grad enabled) are the losses computed: evaluation and scoring exchange no counts,
        whatever each rank evaluates."""
        with torch.autocast(x.device.type, enabled=False):
            logits = F.linear(x.float(), self.weight.float())
            scores = logits.softmax(-1) if self.gate == "softmax" else logits.sigmoid()
            pick = scores + self.expert_bias if self.balance == "bias" else scores
            experts = pick.topk(self.top_k, dim=-1).indices
            weights = scores.gather(-1, experts)
            if self.normalize:
                weights = weights / weights.sum(-1, keepdim=True)
            load = torch.bincount(experts.flatten(), minlength=self.n_experts).float()
            aux = logits.new_zeros(())
            balance = self.balance == "aux_loss" and self.aux_coef > 0 and torch.is_grad_enabled()
            z_loss = self.z_coef > 0 and torch.is_grad_enabled()
            if balance or z_loss:
                counted = torch.cat([load, load.new_full((1,), x.shape[0])])
                counted = totals(counted) if totals is not None else counted
                whole, n = counted[:-1], counted[-1]  # over every rank summed: no gradient
            if balance:
                share = whole / (n * self.top_k)  # f_e
                probs = scores / scores.sum(-1, keepdim=True)  # P_e: softmax already sums to 1
                aux = aux + self.aux_coef * self.n_experts * (share * probs.sum(0) / n).sum()
            if z_loss:
                aux = aux + self.z_coef * logits.logsumexp(-1).square().sum() / n
        return Routing(experts, weights, aux, load)


class AuxLoss(torch.autograd.Function):
    """Identity on `y` whose backward also sends `scale` to `aux`: the auxiliary loss joins the
    loss being differentiated (scaled as the main loss is: 1 / micro-batches) wherever the
    layer's output goes, pipeline stages included."""

    @staticmethod
    def forward(ctx, y: Tensor, aux: Tensor, scale: float) -> Tensor:
        ctx.scale = scale
        ctx.aux_meta = (aux.shape, aux.dtype, aux.device)
        return y

    @staticmethod
    def backward(ctx, dy: Tensor):
        shape, dtype, device = ctx.aux_meta
        return dy, torch.full(shape, ctx.scale, dtype=dtype, device=device), None


def grouped_mm_path(
    device_type: str, dtype: torch.dtype, dims: tuple[int, int], works: bool
) -> str:
    """'grouped' (`torch._grouped_mm`: one kernel for every expert, no host sync) on CUDA in
    bf16 and on CPU in fp32 or bf16, where this build runs it (`works`: `grouped_mm_works`) and
    the rows are 16-byte aligned (the kernels' stride rule); else 'loop' (one matmul per expert,
    the group sizes read on the host)."""
    aligned = all(d * torch.finfo(dtype).bits // 8 % 16 == 0 for d in dims)
    wanted = (device_type == "cuda" and dtype == torch.bfloat16) or (
        device_type == "cpu" and dtype in (torch.float32, torch.bfloat16)
    )
    return "grouped" if wanted and aligned and works else "loop"


@lru_cache(maxsize=8)
def grouped_mm_works(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether `torch._grouped_mm` runs forward and backward here and agrees with the loop (a
    probe, once per device and dtype: torch builds differ in which devices and dtypes it has).
    It runs in a thread of its own, whose autograd, autocast and dispatch-mode state are fresh:
    called first from inside a layer, it must not run under that layer's recompute context (a
    selective checkpoint then counted the probe's ops as the layer's), no-grad or compile."""
    if not hasattr(torch, "_grouped_mm"):
        return False
    with ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(_probe, device, dtype).result()


def _probe(device: torch.device, dtype: torch.dtype) -> bool:
    try:
        g = torch.Generator().manual_seed(0)
        x = torch.randn(6, 16, generator=g).to(device, dtype).requires_grad_()
        w = torch.randn(3, 16, 8, generator=g).to(device, dtype).requires_grad_()
        counts = torch.tensor([1, 0, 5], device=device)
        y = grouped_mm(x, w, counts, "grouped")
        want = grouped_mm(x, w, counts, "loop")
        y.backward(torch.ones_like(y))
        ok = torch.allclose(y.float(), want.float(), rtol=1e-2, atol=1e-2)
        return bool(ok and x.grad is not None and w.grad is not None)
    except (RuntimeError, NotImplementedError):
        return False


def _contiguous(grad: Tensor) -> Tensor:
    return grad.contiguous()


def grouped_mm(x: Tensor, w: Tensor, counts: Tensor, path: str | None = None) -> Tensor:
    """Rows of x [M, a] grouped by expert (counts [E] rows each, in order) times each group's
    w [E, a, b] → [M, b]."""
    if path is None:
        works = grouped_mm_works(x.device, x.dtype)
        path = grouped_mm_path(x.device.type, x.dtype, tuple(w.shape[1:]), works)
    if path == "grouped":
        offsets = counts.cumsum(0).to(torch.int32)
        y = torch._grouped_mm(x, w.to(x.dtype), offs=offsets)
        if y.requires_grad:  # its backward refuses expanded gradients, such as a sum's
            y.register_hook(_contiguous)
        return y
    outs = [rows @ w[e].to(x.dtype) for e, rows in enumerate(x.split(counts.tolist()))]
    return torch.cat(outs) if outs else x.new_zeros(0, w.shape[-1])


class Experts(nn.Module):
    """The routed experts this rank holds (all of them in one process, a slice under expert
    parallelism): SwiGLU weights stacked over experts, [E, dim, hidden] and [E, hidden, dim]."""

    def __init__(self, n_experts: int, dim: int, hidden: int) -> None:
        super().__init__()
        self.w_gate = nn.Parameter(torch.empty(n_experts, dim, hidden))
        self.w_up = nn.Parameter(torch.empty(n_experts, dim, hidden))
        self.w_down = nn.Parameter(torch.empty(n_experts, hidden, dim))

    def forward(self, x: Tensor, counts: Tensor) -> Tensor:
        """x [M, dim], sorted by expert with counts [E] rows each → [M, dim]. Expert-parallel
        weights (DTensors sharded over the experts) compute with this rank's experts."""
        w_gate, w_up, w_down = (_local(w) for w in (self.w_gate, self.w_up, self.w_down))
        gate = grouped_mm(x, w_gate, counts)
        up = grouped_mm(x, w_up, counts)
        return grouped_mm(F.silu(gate) * up, w_down, counts)


class LocalDispatch:
    """One process holds every expert: the sorted rows go to them as they are."""

    def dispatch(self, x: Tensor, counts: Tensor) -> tuple[Tensor, Tensor, None]:
        return x, counts, None

    def combine(self, y: Tensor, handle: None) -> Tensor:
        return y

    def __repr__(self) -> str:
        return "local"


class MoE(nn.Module):
    """The MoE FFN sublayer (see the module doc). `forward(x, proj)` as `SwiGLU`'s: `proj` runs
    the shared experts' projections."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        facts = ModelShape.from_config(cfg)
        self.router = Router(cfg, facts.n_experts)
        self.experts = Experts(facts.n_experts, cfg.dim, facts.moe_ffn)
        self.shared = None
        if cfg.moe_shared_experts:
            wide = ModelConfig(dim=cfg.dim, ffn_dim=cfg.moe_shared_experts * cfg.moe_hidden_dim)
            self.shared = SwiGLU(wide)
        self.dispatcher = LocalDispatch()
        self.aux_scale = 1.0
        """d(loss)/d(aux) in backward: 1 / micro-batches (set by the parallel plan)."""
        self.token_totals: Callable[[Tensor], Tensor] | None = None
        self.token_scale = 1.0
        """The sum of counts over the ranks holding the other tokens of the auxiliary losses (see
        `Router.forward`; set by `parallel/expert_parallel.py`'s `apply_balance_scope`), and the
        factor the gradient average over them divides by."""
        self.load: Tensor | None = None
        outside_graph(MoE.routed)  # made here, outside any compiled region
        """Routed slots per expert since the last `take_load` (training forwards only), and last
        the auxiliary loss they added (as scaled into the step's loss)."""

    def forward(self, x: Tensor, proj: Projections = LOCAL) -> Tensor:
        return outside_graph(MoE.routed)(self, x, proj)

    def routed(self, x: Tensor, proj: Projections = LOCAL) -> Tensor:
        """The layer, eagerly: its routing is data-dependent (top-k, sorting, group sizes read
        on the host, all-to-all with exchanged sizes) and its load counting a side effect, so
        under `torch.compile` it runs outside the compiled graph (`torch.compiler.disable`), as
        ring attention does; the blocks around it compile."""
        shape = x.shape
        tokens = x.reshape(-1, shape[-1])
        routing = self.router(tokens, self.token_totals)
        self._count(routing)
        k = routing.experts.shape[1]
        slots = routing.experts.flatten()
        order = slots.argsort(stable=True)  # the N·k (token, expert) slots grouped by expert
        token_of = order // k
        counts = torch.bincount(slots, minlength=self.router.n_experts)
        # the rows travel and meet the experts in the compute dtype (a Linear's, under autocast);
        # each token's k outputs are weighted and summed in fp32
        compute = _compute_dtype(tokens)
        rows = tokens[token_of].to(compute)
        rows, local_counts, handle = self.dispatcher.dispatch(rows, counts)
        out_rows = self.dispatcher.combine(self.experts(rows, local_counts), handle)
        weighted = out_rows.float() * routing.weights.flatten()[order, None]
        y = torch.zeros(tokens.shape, device=tokens.device).index_add_(0, token_of, weighted)
        y = y.to(compute)
        if self.shared is not None:  # on the rows as they came (sequence-parallel projections)
            y = y + self.shared(x, proj).reshape(y.shape)
        if routing.aux.requires_grad:
            y = AuxLoss.apply(y, routing.aux, self.aux_scale * self.token_scale)
        return y.view(shape)

    def _count(self, routing: Routing) -> None:
        """Add a training forward's load (not evaluation's, nor recomputation's in backward)."""
        if self.training and torch.is_grad_enabled() and not _in_backward():
            aux = (routing.aux.detach() * self.aux_scale).reshape(1)
            counted = torch.cat([routing.load, aux])
            self.load = counted if self.load is None else self.load + counted

    def take_load(self) -> Tensor:
        """[experts + 1]: the slots routed to each expert since the last call, then the
        auxiliary loss they added; and reset."""
        load, self.load = self.load, None
        return load if load is not None else torch.zeros(self.router.n_experts + 1)

    def extra_repr(self) -> str:
        r = self.router
        return (
            f"experts={r.n_experts}, top_k={r.top_k}, gate={r.gate}, dispatch={self.dispatcher!r}"
        )


def _compute_dtype(x: Tensor) -> torch.dtype:
    device = x.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else x.dtype


def _local(t: Tensor) -> Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _in_backward() -> bool:
    """Whether autograd is running a backward pass now (a recomputed forward under activation
    checkpointing runs inside one)."""
    return torch._C._current_graph_task_id() != -1


@torch.no_grad()
def update_bias(router: Router, load: Tensor, rate: float) -> None:
    """Aux-loss-free balancing (DeepSeek-V3): every expert's bias moves by `rate` towards the mean
    load — up when it got fewer slots than the mean, down when more, unchanged at the mean."""
    router.expert_bias += rate * torch.sign(load.mean() - load).to(router.expert_bias)
