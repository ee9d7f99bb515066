"""The planner's model: parameter counts, FLOPs and activation bytes against the real thing.

Parameters are compared with `sum(p.numel())`, FLOPs with `FlopCounterMode`, and activation bytes
with what autograd keeps: saved-tensor hooks (unique storages, parameters excluded) without
recompute, the profiler's retained bytes for each recompute mode — for standard, Block and Full
AttnRes, fp32 and bf16 autocast, the sequential and the parallel block."""

from __future__ import annotations

import itertools
import random

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from depthscale.config import ModelConfig
from depthscale.model.moe import MoE
from depthscale.model.transformer import Transformer, cross_entropy
from depthscale.plan import activations
from depthscale.shape import ModelShape
from depthscale.train.offload import retained_bytes


def _random_config(rng: random.Random) -> ModelConfig:
    heads = rng.choice([1, 2, 4, 8])
    kv = rng.choice([h for h in (1, 2, 4, 8) if heads % h == 0])
    residual = rng.choice(["standard", "block", "full"])
    layers = rng.randint(1, 5)
    parallel = rng.random() < 0.3
    n_sub = layers * (1 if parallel else 2)
    return ModelConfig(
        vocab_size=rng.randint(17, 300),
        dim=heads * rng.choice([4, 8, 16]),
        n_layers=layers,
        n_heads=heads,
        n_kv_heads=kv,
        ffn_dim=rng.choice([0, rng.randint(8, 100)]),
        multiple_of=rng.choice([8, 32]),
        tie_embeddings=rng.random() < 0.5,
        residual=residual,
        attnres_n_blocks=rng.randint(1, n_sub),
        attnres_key_norm_gain=rng.random() < 0.5,
        parallel_block=parallel,
        max_seq_len=32,
    )


def test_parameter_count_is_exact_for_random_configs():
    rng = random.Random(7)
    for _ in range(24):
        cfg = _random_config(rng)
        with torch.device("meta"):
            model = Transformer(cfg)
        assert ModelShape.from_config(cfg).params() == sum(p.numel() for p in model.parameters()), (
            cfg
        )


def test_gpt_parameters_follow_sc21():
    """SC'21 Eq. 2 reproduces its Table 1 (175B row: 96 layers, h 12288, V 51200, s 2048)."""
    spec = ModelShape.gpt(96, 12288, 96, 51200, 2048)
    assert abs(spec.params() / 1e9 - 174.6) < 0.1


@pytest.mark.parametrize("residual", ["standard", "block"])
def test_flops_match_flop_counter(residual):
    cfg = ModelConfig(
        vocab_size=256, dim=128, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=64,
        residual=residual, attnres_n_blocks=2, attnres_read="two_phase",
    )  # fmt: skip
    torch.manual_seed(0)
    model = Transformer(cfg)
    tokens = torch.randint(0, 256, (2, 64))
    # the math backend runs attention as matmuls FlopCounterMode sees (it has no formula for the
    # CPU flash kernel); it computes the whole causal score matrix, the planner's convention
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        cross_entropy(model(tokens), tokens).backward()
    spec = ModelShape.from_config(cfg)
    predicted = 2 * spec.model_flops(64)
    assert abs(predicted / counter.get_total_flops() - 1) < 0.01


def _saved_bytes(model: Transformer, tokens, bf16: bool) -> int:
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t):
        s = t.untyped_storage()
        if s.data_ptr() not in params:
            seen.setdefault(s.data_ptr(), s.nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        with torch.autocast("cpu", torch.bfloat16, enabled=bf16):
            logits = model(tokens)
        cross_entropy(logits, tokens)
    return sum(seen.values())


def _retained(model: Transformer, tokens, bf16: bool) -> int:
    kept = []

    def forward():
        with torch.autocast("cpu", torch.bfloat16, enabled=bf16):
            logits = model(tokens)
        kept.extend([cross_entropy(logits, tokens), logits])

    return retained_bytes(forward)


CASES = list(itertools.product(["standard", "block", "full"], [False, True], [False, True]))


@pytest.mark.parametrize(("residual", "bf16", "parallel"), CASES)
def test_activation_bytes_match_autograd(residual, bf16, parallel):
    B, T = 3, 40
    cfg = ModelConfig(
        vocab_size=97, dim=64, n_layers=3, n_heads=4, n_kv_heads=2, ffn_dim=176, max_seq_len=64,
        residual=residual, attnres_n_blocks=2, parallel_block=parallel,
    )  # fmt: skip
    spec = ModelShape.from_config(cfg)
    tokens = torch.randint(0, 97, (B, T), generator=torch.Generator().manual_seed(0))
    torch.manual_seed(0)
    model = Transformer(cfg)
    rope_tables = 0 if bf16 else model.rope_cos.nbytes + model.rope_sin.nbytes  # fp32: saved as is
    saved = _saved_bytes(model, tokens, bf16)
    predicted = activations.ours(spec, B * T, T, bf16).total() + rope_tables
    assert abs(predicted / saved - 1) < 0.02
    base = _retained(model, tokens, bf16)
    for mode in ("selective", "sublayer", "full"):
        model.set_recompute(mode)
        # the profiler sees the same outputs (logits, loss) in every mode: compare differences
        measured = saved + _retained(model, tokens, bf16) - base
        predicted = activations.ours(spec, B * T, T, bf16, mode).total() + rope_tables
        assert abs(predicted / measured - 1) < 0.02, mode


MOE_ROUTERS = [
    {"moe_balance": "bias", "moe_normalize_top_k": False},
    {"moe_shared_experts": 1, "moe_balance": "aux_loss", "moe_z_loss": 1e-3},
    {"moe_shared_experts": 2, "moe_gate": "sigmoid", "moe_first_dense": 1},
]


@pytest.mark.parametrize(
    ("residual", "bf16", "router"),
    [("standard", False, 0), ("block", True, 1), ("block", False, 2), ("standard", True, 2)],
)
def test_moe_activation_bytes_match_autograd(residual, bf16, router):
    """The MoE FFN's inventory (router, sorted rows, grouped-GEMM intermediates, shared experts,
    each router option's extra tensors, the per-micro-batch bf16 copies of the experts) equals
    what autograd keeps, in every recompute mode; under selective recompute of Block AttnRes an
    MoE output that starts a block is a sum, not a GEMM's own output."""
    B, T = 3, 40
    cfg = ModelConfig(
        vocab_size=97, dim=64, n_layers=3, n_heads=4, n_kv_heads=2, ffn_dim=176, max_seq_len=64,
        residual=residual, attnres_n_blocks=2, moe_experts=8, moe_top_k=2, moe_ffn_dim=48,
        **MOE_ROUTERS[router],
    )  # fmt: skip
    spec = ModelShape.from_config(cfg)
    tokens = torch.randint(0, 97, (B, T), generator=torch.Generator().manual_seed(0))
    torch.manual_seed(0)
    model = Transformer(cfg)
    rope_tables = 0 if bf16 else model.rope_cos.nbytes + model.rope_sin.nbytes
    saved = _saved_bytes(model, tokens, bf16)
    assert activations.ours(spec, B * T, T, bf16).total() + rope_tables == saved

    def retained() -> int:
        for m in model.modules():  # the routing counters a forward leaves are not activations
            if isinstance(m, MoE):
                m.take_load()
        return _retained(model, tokens, bf16)

    base = retained()
    for mode in ("selective", "sublayer", "full"):
        model.set_recompute(mode)
        measured = saved + retained() - base
        predicted = activations.ours(spec, B * T, T, bf16, mode).total() + rope_tables
        assert predicted == measured, mode
