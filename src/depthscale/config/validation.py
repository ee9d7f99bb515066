"""Config validation: per-field rules for every field, then cross-field rules, each failing with one
message that names the key and what is allowed (`Config.validate` calls `validate`)."""

from __future__ import annotations

import dataclasses
import math
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any

from depthscale.config.section_checks import check_dir_creatable, check_logging, check_sections
from depthscale.errors import ConfigError
from depthscale.shape import Degrees

if TYPE_CHECKING:
    from depthscale.config.schema import Config


def validate(cfg: Config) -> Config:
    """Cross-field checks; raises ConfigError naming the key and what is allowed. The order is
    the order a user meets them: ranges, then the sections, the degrees (the batch rules divide
    by them), the model's shape, memory modes, the batch, the optimizer, logging, the rest."""
    _check_fields(cfg)
    _check_ranges(cfg)
    check_sections(cfg)
    _check_degrees(cfg)
    _check_model_shape(cfg)
    _check_memory_modes(cfg)
    _check_batch(cfg)
    _check_optim(cfg)
    check_logging(cfg)
    _check_overlap_and_resume(cfg)
    return cfg


def _check_ranges(cfg: Config) -> None:
    """Keys that must be positive or non-negative."""
    _positive(
        cfg,
        "model.dim",
        "model.n_layers",
        "model.n_heads",
        "data.seq_len",
        "train.steps",
        "train.batch_size",
        "optim.lr",
        "model.max_seq_len",
        "checkpoint.replica_mb_s",
    )
    _non_negative(
        cfg,
        "model.vocab_size",
        "model.n_kv_heads",
        "model.ffn_dim",
        "model.ffn_chunk_size",
        "model.sliding_window",
        "train.micro_batch_size",
        "train.grad_clip",
        "train.eval_every",
        "optim.warmup_steps",
        "optim.weight_decay",
        "checkpoint.every",
        "checkpoint.keep",
        "checkpoint.snapshot_every",
        "model.attnres_block_size",
        "data.max_bytes",
        "logging.peak_tflops",
        "train.gc_interval",
        "logging.straggler_threshold",
        "logging.hang_dump_s",
        "logging.mfu_alarm",
        "resilience.slow_steps",
        "resilience.max_restarts",
        "resilience.max_restarts_without_progress",
        "resilience.spare_nodes",
    )
    _positive(
        cfg,
        "resilience.heartbeat_s",
        "resilience.hang_floor_s",
        "resilience.hang_factor",
        "resilience.long_phase_s",
        "resilience.startup_timeout_s",
        "resilience.node_lost_s",
        "resilience.local_nodes",
    )


def _check_degrees(cfg: Config) -> None:
    """Every parallel size >= 1 and the expert degree's rules (shape/layout.py)."""
    m, p = cfg.model, cfg.parallel
    # the parallel sizes first: the batch rules below divide by them
    for name in (
        "dp_replicate",
        "dp_shard",
        "cp",
        "cp_ulysses",
        "tp",
        "pp",
        "pp_virtual",
        "ep",
        "nproc",
        "tp_overlap_chunks",
        "cp_balance_chunk",
    ):
        if getattr(p, name) < 1:
            raise ConfigError(f"parallel.{name}={getattr(p, name)} must be >= 1")
    Degrees.of(p).check_experts(m.moe_experts)


def _check_model_shape(cfg: Config) -> None:
    """Heads, RoPE, the Ulysses split, the sequence, AttnRes blocks, MoE."""
    m, d, p = cfg.model, cfg.data, cfg.parallel
    if m.dim % m.n_heads:
        raise ConfigError(
            f"model.n_heads={m.n_heads} must divide model.dim={m.dim}; "
            f"allowed: a divisor of {m.dim}"
        )
    if m.head_dim % 2:
        raise ConfigError(f"model.dim / model.n_heads = {m.head_dim} must be even for RoPE")
    m.check_rope()
    if m.n_heads % m.kv_heads:
        raise ConfigError(f"model.n_kv_heads={m.n_kv_heads} must divide model.n_heads={m.n_heads}")
    _check_ulysses_layout(m, p)
    if d.seq_len > m.max_seq_len:
        raise ConfigError(f"data.seq_len={d.seq_len} exceeds model.max_seq_len={m.max_seq_len}")
    if (
        m.residual == "block"
        and m.attnres_block_size == 0
        and not 1 <= m.attnres_n_blocks <= m.n_sublayers
    ):
        raise ConfigError(
            f"model.attnres_n_blocks={m.attnres_n_blocks} must be in 1..{m.n_sublayers} "
            f"(the number of sublayers) when model.attnres_block_size is 0"
        )
    _check_moe(m)
    if m.residual == "block" and m.attnres_block_size > m.n_sublayers:
        raise ConfigError(
            f"model.attnres_block_size={m.attnres_block_size} exceeds the number of "
            f"sublayers ({m.n_sublayers}); allowed: 1..{m.n_sublayers}"
        )


def _check_memory_modes(cfg: Config) -> None:
    """Parameter and activation offload against the layout and recompute."""
    t, p = cfg.train, cfg.parallel
    if t.offload_params and Degrees.of(p).shard == 1:
        raise ConfigError(
            "train.offload_params=true offloads FSDP2's sharded states, so it needs FSDP: "
            f"parallel.dp_shard × cp > 1 (got dp_shard={p.dp_shard}, cp={p.cp}); allowed: "
            "dp_shard > 1 or cp > 1, or train.offload_params=false"
        )
    if t.offload_params and max(p.tp, p.pp) > 1:
        # their own gradient reductions (tp-replicated sums, tied-embedding sync) would meet
        # host-memory gradients on NCCL groups, which only reduce GPU tensors
        raise ConfigError(
            f"train.offload_params=true is for data and context parallelism (ZeRO-3 / HSDP "
            f"over dp_shard × cp), but parallel.tp={p.tp}, pp={p.pp}; allowed: tp = pp = 1, "
            "or train.offload_params=false"
        )
    if t.offload_activations and t.recompute == "selective":
        raise ConfigError(
            "train.offload_activations=true with train.recompute='selective': what selective "
            "recompute keeps (GEMM and attention outputs) lives in the recompute cache, which "
            "offload cannot move; allowed with offload: recompute 'none', 'sublayer' or 'full'"
        )


def _check_batch(cfg: Config) -> None:
    """The batch over the data-parallel ranks, and the held-out split."""
    t, d = cfg.train, cfg.data
    dp = cfg.dp_degree
    if t.micro_batch_size and t.batch_size % (dp * t.micro_batch_size):
        raise ConfigError(
            f"train.micro_batch_size={t.micro_batch_size} × data-parallel ranks ({dp}) must divide "
            f"train.batch_size={t.batch_size}"
        )
    if not t.micro_batch_size and t.batch_size % dp:
        raise ConfigError(
            f"train.batch_size={t.batch_size} must divide evenly over the {dp} data-parallel ranks "
            "(parallel.dp_replicate × parallel.dp_shard)"
        )
    if not 0.0 <= d.val_fraction < 1.0:
        raise ConfigError(f"data.val_fraction={d.val_fraction} must be in [0, 1)")


def _check_optim(cfg: Config) -> None:
    """The schedule's fractions, Adam's betas, Muon's keys, the warmup."""
    o, t = cfg.optim, cfg.train
    if not 0.0 <= o.min_lr_ratio <= 1.0:
        raise ConfigError(f"optim.min_lr_ratio={o.min_lr_ratio} must be in [0, 1]")
    if not 0.0 < o.decay_fraction <= 1.0:
        raise ConfigError(f"optim.decay_fraction={o.decay_fraction} must be in (0, 1]")
    for beta in ("beta1", "beta2"):
        if not 0.0 <= getattr(o, beta) < 1.0:
            raise ConfigError(f"optim.{beta}={getattr(o, beta)} must be in [0, 1)")
    _check_muon(o)
    _check_qk_clip(cfg)
    if o.warmup_steps > t.steps:
        raise ConfigError(f"optim.warmup_steps={o.warmup_steps} exceeds train.steps={t.steps}")


def _check_overlap_and_resume(cfg: Config) -> None:
    """Blockwise FFN chunks under tp overlap, pipeline micro-batches, the resume path."""
    m, p = cfg.model, cfg.parallel
    if m.ffn_chunk_size and p.tp > 1 and m.ffn_chunk_size % p.tp_overlap_chunks:
        raise ConfigError(
            f"model.ffn_chunk_size={m.ffn_chunk_size} under tensor parallelism runs the MLP on "
            f"chunks of each rank's sequence shard, each gathered in "
            f"parallel.tp_overlap_chunks={p.tp_overlap_chunks} pieces; allowed: a multiple of "
            f"{p.tp_overlap_chunks}, or 0"
        )
    _check_pipeline_micro_batches(cfg)
    if cfg.checkpoint.resume not in ("auto", "none") and not Path(cfg.checkpoint.resume).exists():
        raise ConfigError(
            f"checkpoint.resume={cfg.checkpoint.resume!r} does not exist; "
            "allowed: 'auto', 'none' or an existing checkpoint directory"
        )


def _check_pipeline_micro_batches(cfg: Config) -> None:
    """Under pp, m micro-batches per step leave the fraction (pp-1)/(m+pp-1) of it idle (the 1F1B
    bubble): with fewer micro-batches than stages, most of it.

    train.micro_batch_size = 0 (the default split: 2·pp, else pp micro-batches per rank) used to
    fall back silently to one micro-batch when the per-rank batch splits into neither: nobody chose
    that, so it is a ConfigError naming the batch sizes that work. An explicit micro_batch_size
    giving fewer micro-batches than stages is a choice the user made (a memory limit, a small debug
    batch); the run is correct, only slow, so it is allowed with a warning naming the bubble."""
    p, t = cfg.parallel, cfg.train
    if p.pp == 1:
        return
    dp = cfg.dp_degree
    per_rank = t.batch_size // dp
    n = per_rank // cfg.micro_batch_size
    if n >= p.pp:
        return
    bubble = (p.pp - 1) / (n + p.pp - 1)
    multiple = p.pp * dp
    example = multiple * max(1, -(-t.batch_size // multiple))
    fix = (
        f"set train.batch_size to a multiple of pp × dp = {multiple} (e.g. {example}) or "
        "choose train.micro_batch_size explicitly"
    )
    if not t.micro_batch_size:
        raise ConfigError(
            f"parallel.pp={p.pp} with train.batch_size={t.batch_size} over {dp} data-parallel "
            f"rank(s): the per-rank batch {per_rank} splits into neither {2 * p.pp} nor {p.pp} "
            f"micro-batches, so the pipeline would run {n} micro-batch(es) per step and idle "
            f"{bubble:.0%} of it; {fix}"
        )
    if per_rank >= p.pp:
        fix = f"use train.micro_batch_size <= {per_rank // p.pp} for at least {p.pp}"
    else:
        fix = f"set train.micro_batch_size=1 and train.batch_size >= {multiple} for at least {p.pp}"
    warnings.warn(
        f"parallel.pp={p.pp} with train.micro_batch_size={t.micro_batch_size}: {n} "
        f"micro-batch(es) per step for {p.pp} stages, so the pipeline idles {bubble:.0%} of "
        f"each step; {fix} micro-batches",
        stacklevel=2,
    )


def _get(cfg: Config, dotted: str) -> Any:
    section, key = dotted.split(".")
    return getattr(getattr(cfg, section), key)


def _positive(cfg: Config, *keys: str) -> None:
    for key in keys:
        if _get(cfg, key) <= 0:
            raise ConfigError(f"{key}={_get(cfg, key)} must be > 0")


def _check_moe(m) -> None:
    """model.moe_*: top-k within the experts, rates and coefficients finite and >= 0."""
    if m.moe_experts < 0:
        raise ConfigError(f"model.moe_experts={m.moe_experts} must be >= 0 (0: dense FFNs)")
    if m.moe_experts == 0:
        return
    if not 1 <= m.moe_top_k <= m.moe_experts:
        raise ConfigError(
            f"model.moe_top_k={m.moe_top_k} must be in 1..{m.moe_experts} (model.moe_experts)"
        )
    for key in ("moe_shared_experts", "moe_ffn_dim", "moe_first_dense"):
        if getattr(m, key) < 0:
            raise ConfigError(f"model.{key}={getattr(m, key)} must be >= 0")
    if m.moe_every < 1:
        raise ConfigError(f"model.moe_every={m.moe_every} must be >= 1")
    if m.moe_first_dense >= m.n_layers:
        raise ConfigError(
            f"model.moe_first_dense={m.moe_first_dense} leaves no MoE layer of {m.n_layers}; "
            f"allowed: 0..{m.n_layers - 1}"
        )
    for key in ("moe_aux_loss", "moe_bias_rate", "moe_z_loss"):
        value = getattr(m, key)
        if not 0.0 <= value < math.inf:
            raise ConfigError(f"model.{key}={value} must be a finite number >= 0")
    if m.parallel_block:
        raise ConfigError(
            "model.parallel_block with model.moe_experts > 0 is not supported; allowed: one of them"
        )
    if m.moe_balance_scope == "global_batch" and m.moe_balance != "aux_loss":
        raise ConfigError(
            f"model.moe_balance_scope='global_batch' needs model.moe_balance='aux_loss' (got "
            f"{m.moe_balance!r}: its loads are summed over the whole step already); allowed: "
            "'micro_batch' with it"
        )


def _check_ulysses_layout(m, p) -> None:
    """parallel.cp_ulysses: a factor of cp that splits each tp rank's heads
    (`shape/ulysses.py`)."""
    from depthscale.shape.ulysses import ulysses_problem

    problem = ulysses_problem(m.n_heads, m.kv_heads, p.tp, p.cp, p.cp_ulysses)
    if problem:
        raise ConfigError(problem)


def _check_muon(o: Any) -> None:
    """Muon's keys, checked whatever optim.name (a config switched to muon later stays valid)."""
    from depthscale.shape.muon import MAX_NS_STEPS

    if not 0.0 <= o.muon_momentum < 1.0:
        raise ConfigError(f"optim.muon_momentum={o.muon_momentum} must be in [0, 1)")
    if not 1 <= o.muon_ns_steps <= MAX_NS_STEPS:
        raise ConfigError(
            f"optim.muon_ns_steps={o.muon_ns_steps} must be in [1, {MAX_NS_STEPS}] "
            "(5 Newton–Schulz steps, as torch.optim.Muon)"
        )
    if not o.muon_adamw_lr >= 0.0:
        raise ConfigError(f"optim.muon_adamw_lr={o.muon_adamw_lr} must be >= 0 (0 = optim.lr)")


def _check_qk_clip(cfg: Config) -> None:
    """QK-clip (`train/qk_clip.py`) runs in Muon's step, from logits of whole rows."""
    o = cfg.optim
    if not o.qk_clip_tau >= 0.0:
        raise ConfigError(f"optim.qk_clip_tau={o.qk_clip_tau} must be >= 0 (0 = off)")
    if o.qk_clip_tau == 0.0:
        return
    if o.name != "muon":
        raise ConfigError(
            f"optim.qk_clip_tau={o.qk_clip_tau} needs optim.name = 'muon', not {o.name!r} "
            "(QK-clip is MuonClip; set optim.qk_clip_tau = 0 for other optimizers)"
        )
    if cfg.parallel.cp > 1:
        raise ConfigError(
            f"optim.qk_clip_tau={o.qk_clip_tau} needs parallel.cp = 1, not {cfg.parallel.cp}: "
            "under context parallelism (ring or Ulysses) no rank holds a query's logits over "
            "all its keys"
        )


def _non_negative(cfg: Config, *keys: str) -> None:
    for key in keys:
        if _get(cfg, key) < 0:
            raise ConfigError(f"{key}={_get(cfg, key)} must be >= 0")


# Fields whose only rule is a lower bound, beyond those `validate` checks with the cross-field rules.
_AT_LEAST_ONE = (
    "model.multiple_of",
    "model.attnres_n_blocks",
    "logging.log_every",
    "logging.trace_queue",
)
_POSITIVE_FLOATS = (
    "model.norm_eps",
    "model.init_std",
    "model.attnres_eps",
    "optim.eps",
    "parallel.timeout_s",
    "parallel.setup_timeout_s",
)
_NON_EMPTY = ("data.path", "data.tokenizer", "data.jsonl_field", "train.name", "train.run_dir")
_SEED_LIMIT = 2**32  # numpy's seed range


def _check_fields(cfg: Config) -> None:
    """Per-field rules for every field of the tree: floats finite (NaN passes every comparison, so
    each bound is also written to fail on NaN), counts and sizes in range, strings non-empty, paths
    usable. Cross-field rules follow in `Config.validate`."""
    for section in dataclasses.fields(cfg):
        values = getattr(cfg, section.name)
        for f in dataclasses.fields(values):
            value = getattr(values, f.name)
            if isinstance(value, float) and not math.isfinite(value):
                raise ConfigError(
                    f"{section.name}.{f.name}={value} is not allowed; allowed: a finite number"
                )
    for key in _AT_LEAST_ONE:
        if _get(cfg, key) < 1:
            raise ConfigError(f"{key}={_get(cfg, key)} must be >= 1")
    for key in _POSITIVE_FLOATS:
        if not _get(cfg, key) > 0:
            raise ConfigError(f"{key}={_get(cfg, key)} must be > 0")
    for key in _NON_EMPTY:
        if not _get(cfg, key).strip():
            raise ConfigError(f"{key} is empty; allowed: a non-empty string")
    t, d = cfg.train, cfg.data
    if not 0 <= t.seed < _SEED_LIMIT:
        raise ConfigError(f"train.seed={t.seed} must be in [0, {_SEED_LIMIT})")
    if t.eval_every and t.eval_batches < 1:
        raise ConfigError(
            f"train.eval_batches={t.eval_batches} must be >= 1 when train.eval_every > 0 "
            "(or set train.eval_every 0 to skip evaluation)"
        )
    if d.eos_token and d.tokenizer == "byte":
        raise ConfigError(
            f"data.eos_token={d.eos_token!r} needs a tokenizer with named tokens; "
            "data.tokenizer='byte' ends documents with id 257 (allowed: data.eos_token empty, "
            "or data.tokenizer 'bpe' or a tokenizer.json)"
        )
    if d.tokenizer == "bpe" and d.bpe_vocab_size < 258:
        raise ConfigError(
            f"data.bpe_vocab_size={d.bpe_vocab_size} is too small; allowed: >= 258 "
            "(256 byte tokens + BOS + EOS)"
        )
    try:
        run_path = Path(t.run_dir.format(name=t.name))
    except (KeyError, IndexError, ValueError) as err:
        raise ConfigError(
            f"train.run_dir={t.run_dir!r} is not a valid path template ({err!r}); "
            "allowed: a path, optionally containing {name} (replaced by train.name)"
        ) from None
    check_dir_creatable("train.run_dir", run_path)
    if d.cache_dir:
        check_dir_creatable("data.cache_dir", Path(d.cache_dir).expanduser())
