"""fp32 test tolerances derived from the computation, not guessed.

Two fp32 evaluations of one sum s = Σ x_i (n terms) that add in different orders each stay within
γ_k·Σ|x_i| of s, with γ_k = k·u/(1 − k·u), u = 2^-24, k = n for a sequential sum (Higham 1993; k ≈
⌈log2 n⌉ + block for blocked/pairwise sums), so they differ by at most 2·γ_k·Σ|x_i|: `fp32_sum_bound`.

A model is a chain of such reductions (forward, then backward through the transposed ones, then the
weight gradient's sum over tokens). To first order the relative errors of a chain add, so a whole
forward + backward is bounded by the same formula with k = the sum of the reduction lengths along the
longest path (`transformer_terms`, `fp32_model_bound`), relative to the magnitude of the values
compared. This is the worst case (every rounding at its maximum, all in one direction); real errors
grow like √k and sit about √k ≈ 30-50× below it. That slack is what covers the moderate cancellation
(Σ|x_i| a few times |Σ x_i|) of the AttnRes pseudo_query / key_norm gradients. A real bug — a dropped
micro-batch, token or chunk, a wrong gradient, a bf16 round trip (u = 2^-9 ≈ 2e-3) — is 1e-3 to 1 of
the values: orders of magnitude above every bound here.

Chained comparisons over several optimizer steps are not covered by one-step bounds: training
amplifies a rounding difference in the parameters step by step (up to ×10-20 per SGD step seen on the
tensor-parallel test model). Parity tests therefore start every step from the same parameters
(`copy_params_`), or compare one step only.

Every check goes through `check`, which also appends the measured value and its bound as one JSON line
to $DEPTHSCALE_TOLERANCE_LOG when that is set, so drift shows up before a test flakes.
"""

from __future__ import annotations

import json
import math
import os

import torch

U32 = 2.0**-24
"""fp32 unit roundoff (round to nearest): |fl(x) − x| ≤ u·|x|."""
U64 = 2.0**-53


def gamma(k: int, u: float = U32) -> float:
    """γ_k = k·u / (1 − k·u): the relative error bound of k successive roundings."""
    assert k * u < 1, k
    return k * u / (1 - k * u)


def fp32_sum_bound(
    n_terms: int,
    magnitude: float = 1.0,
    *,
    pairwise: bool = False,
    block: int = 0,
    c: float = 2.0,
    u: float = U32,
) -> float:
    """Largest |a − b| between two evaluations of one sum of `n_terms` terms whose Σ|x_i| is
    `magnitude`, added in different orders: c·γ_k·magnitude with k = n_terms (sequential), or
    k = ⌈log2 n⌉ + block (pairwise / blocked). c = 2: each side is at most γ_k·Σ|x_i| from the exact
    sum. Pass magnitude=1 for a bound relative to the magnitude of the values compared."""
    n = max(int(n_terms), 1)
    k = (math.ceil(math.log2(n)) + block) if pairwise else n
    return c * gamma(max(k, 1), u) * magnitude


def transformer_terms(cfg, seq_len: int, batch: int = 1, backward: bool = True) -> int:
    """Sum of the reduction lengths along the longest forward + backward path of `Transformer(cfg)`
    on [batch, seq_len] tokens (first-order: a chain's relative rounding errors add).

    Per sublayer: the depth read (key RMS and query·key over dim, softmax and weighted sum over at most
    n_sublayers + 1 sources — also the length of a standard residual stream's running sum), the
    RMSNorm (dim), attention (q/k/v projections over dim, scores over head_dim, softmax and A·V over
    seq_len, output projection over dim) and the SwiGLU (gate/up over dim, down over hidden_dim); a
    parallel block has one read and norm and the longer of its two branches. The head: a last read,
    the norm, the LM head over dim, the log-sum-exp over the vocabulary and the mean over tokens.
    Backward runs the transposed reductions of the same lengths, then each weight gradient sums over
    the batch·seq_len tokens. backward=False: the forward (logits and loss) alone."""
    d, m = cfg.dim, cfg.n_sublayers + 1
    read = 2 * d + 2 * m
    attention = d + cfg.head_dim + 2 * seq_len + d
    ffn = d + cfg.hidden_dim
    if cfg.parallel_block:
        layer = read + d + max(attention, ffn)
    else:
        layer = 2 * (read + d) + attention + ffn
    forward = cfg.n_layers * layer + read + d + d + cfg.vocab_size + batch * seq_len
    return 2 * forward + batch * seq_len if backward else forward


def fp32_model_bound(
    cfg, seq_len: int, batch: int = 1, c: float = 2.0, backward: bool = True
) -> float:
    """Relative bound for two fp32 forward + backward passes of one model on one batch that differ
    in summation order somewhere (layout, chunking, kernel shapes, thread count): see the module
    docstring. backward=False: logits / loss of the forward alone."""
    return fp32_sum_bound(transformer_terms(cfg, seq_len, batch, backward), 1.0, c=c)


def scaled_err(a: torch.Tensor | None, b: torch.Tensor | None) -> float:
    """max|a − b| / max|b|: the error relative to the tensor's largest entry (its magnitude), so
    entries that cancel to near zero do not blow it up. Two missing tensors agree; 0/0 is 0."""
    if a is None or b is None:
        return 0.0 if a is None and b is None else math.inf
    a, b = a.detach().double(), b.detach().double()
    diff = (a - b).abs().max().item() if a.numel() else 0.0
    scale = b.abs().max().item() if b.numel() else 0.0
    if diff == 0.0:
        return 0.0
    return diff / scale if scale > 0 else math.inf


def rel_norm_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """‖a − b‖ / ‖b‖ (0 when both are zero)."""
    a, b = a.detach().double(), b.detach().double()
    diff = (a - b).norm().item()
    if diff == 0.0:
        return 0.0
    norm = b.norm().item()
    return diff / norm if norm > 0 else math.inf


@torch.no_grad()
def copy_params_(dst: torch.nn.Module, src: torch.nn.Module) -> None:
    """dst's parameters := src's (same names), also into DTensor shards (each rank keeps its own
    shard of the full tensor, no communication): multi-step parity tests restart every step from
    the same point, so that a one-step bound applies to every step."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    ref = dict(src.named_parameters(remove_duplicate=False))
    for name, p in dst.named_parameters():
        full = ref[name].detach()
        if isinstance(p, DTensor):
            full = distribute_tensor(
                full.to(p.dtype), p.device_mesh, p.placements, src_data_rank=None
            )
        p.copy_(full)


def check_close(got: torch.Tensor, want: torch.Tensor, bound: float, what: str = "") -> None:
    """`check` of scaled_err(got, want): the largest difference relative to want's largest entry."""
    check(scaled_err(got, want), bound, what)


def check(measured: float, bound: float, what: str = "") -> None:
    """assert measured <= bound, recording both (see the module docstring)."""
    log = os.environ.get("DEPTHSCALE_TOLERANCE_LOG")
    if log:
        test = os.environ.get("PYTEST_CURRENT_TEST", "").rsplit(" ", 1)[0]
        line = dict(
            test=test,
            what=str(what),
            measured=float(measured),
            bound=float(bound),
            ratio=float(measured) / float(bound) if bound else math.inf,
            threads=torch.get_num_threads(),
        )
        with open(log, "a") as f:
            f.write(json.dumps(line) + "\n")
    assert measured <= bound, f"{what}: measured {measured:.3g} > bound {bound:.3g}"


class AdamWBound:
    """Elementwise bound on how far torch's AdamW moves a parameter differently when its gradients
    differ by at most δ (elementwise) per step and each step starts from the same parameters.

    The optimizer states then differ by |Δm| ≤ β1·|Δm| + (1−β1)·δ and |Δv| ≤ β2·|Δv| + (1−β2)·(2|g|δ + δ²)
    (g: the reference gradient), and the step direction u = m̂/(√v̂ + ε) is evaluated over the whole
    interval those allow (interval arithmetic), so |Δp| ≤ lr·|Δu| + the update's own roundings. Where
    |g| is below its own error bound the interval contains both signs and |Δu| approaches 2: Adam
    normalizes away the gradient's size, so rounding noise on a ~0 gradient can flip a full lr step.
    Elsewhere |Δu| ≈ |Δm̂|/√v̂ is small, so a wrong update (lr on every entry) still fails."""

    def __init__(self, lr: float, betas: tuple[float, float], eps: float) -> None:
        self.lr, (self.b1, self.b2), self.eps = lr, betas, eps
        self.dm: dict[str, torch.Tensor] = {}
        self.dv: dict[str, torch.Tensor] = {}

    def after_step(
        self, name: str, grad: torch.Tensor, delta: torch.Tensor | float, state: dict, param
    ) -> torch.Tensor:
        """Call once per step per parameter after the reference optimizer's step: `grad` is the
        reference gradient, `delta` its error bound, `state` the reference optimizer's state and
        `param` the reference parameter after the step. Returns the elementwise bound on |Δp|."""
        g = grad.detach().double().abs()
        delta = torch.as_tensor(delta, dtype=torch.float64).expand_as(g)
        dm = self.dm.get(name, torch.zeros_like(g))
        dv = self.dv.get(name, torch.zeros_like(g))
        self.dm[name] = dm = self.b1 * dm + (1 - self.b1) * delta
        self.dv[name] = dv = self.b2 * dv + (1 - self.b2) * (2 * g * delta + delta**2)
        t = float(state["step"])
        bc1, bc2 = 1 - self.b1**t, 1 - self.b2**t
        m = state["exp_avg"].detach().double().abs() / bc1
        v = state["exp_avg_sq"].detach().double() / bc2
        dm_hat, dv_hat = dm / bc1, dv / bc2
        u = m / (v.sqrt() + self.eps)
        hi = (m + dm_hat) / ((v - dv_hat).clamp_min(0).sqrt() + self.eps)
        lo = (m - dm_hat) / ((v + dv_hat).sqrt() + self.eps)
        du = torch.maximum(hi - u, u - lo)
        p = param.detach().double().abs()
        # decay multiply, denominator, division and the add: a handful of roundings on each side
        return self.lr * du + 8 * U32 * (p + self.lr * u)
