"""One typed config tree, loaded from TOML and overridable from the command line.

Every field has a type and a default. Loading checks keys and types strictly and then runs the
cross-field checks in `Config.validate`, so a bad config fails with one message that names the key
and what is allowed, before any model, data or process group is built.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
import tomllib
import types
import typing
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, get_args, get_origin

from depthscale.errors import ConfigError

__all__ = ["Config", "ConfigError", "load_config"]


ResidualMode = Literal["standard", "full", "block"]
RopeScalingKind = Literal["none", "linear", "llama3"]


@dataclass
class ModelConfig:
    vocab_size: int = 0
    """0: take the tokenizer's vocabulary size, rounded up to a multiple of 64 that parallel.tp
    divides (the vocabulary is sharded over tp)."""
    dim: int = 128
    n_layers: int = 4
    n_heads: int = 4
    n_kv_heads: int = 0
    """Grouped-query attention: 0 means n_heads (plain multi-head attention)."""
    ffn_dim: int = 0
    """SwiGLU hidden size; 0 means the Llama rule: 8/3·dim rounded up to `multiple_of`."""
    multiple_of: int = 32
    ffn_chunk_size: int = 0
    """Blockwise FFN (BPT): run the MLP over chunks of this many sequence positions, recomputing
    each chunk in backward, so its [tokens, ffn_dim] intermediates never exist for the whole
    sequence at once (exact; costs one extra MLP forward in training). 0 = off."""
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: RopeScalingKind = "none"
    """RoPE frequency scaling (HF `rope_type`), to run past the pre-training context: 'linear'
    divides every frequency by rope_scaling_factor (the same as dividing positions); 'llama3'
    (Llama 3.1+) divides only the low frequencies, keeps the high ones, and blends in between."""
    rope_scaling_factor: float = 1.0
    """linear, llama3: how many times the context is stretched (HF `factor`); 1 = unscaled."""
    rope_low_freq_factor: float = 1.0
    """llama3: wavelengths above rope_original_max_len / this are divided by the factor (HF
    `low_freq_factor`)."""
    rope_high_freq_factor: float = 4.0
    """llama3: wavelengths below rope_original_max_len / this are kept (HF `high_freq_factor`)."""
    rope_original_max_len: int = 8192
    """llama3: the context length the model was pre-trained with (HF
    `original_max_position_embeddings`)."""
    max_seq_len: int = 4096
    tie_embeddings: bool = True
    init_std: float = 0.02
    parallel_block: bool = False
    """MegaScale/PaLM parallel block: attention and MLP read the same normalized input; outputs summed."""
    sliding_window: int = 0
    """Causal sliding-window attention span in tokens (each token sees itself and window-1 before it); 0 = full."""
    residual: ResidualMode = "standard"
    """Residual stream: standard PreNorm, Full AttnRes, or Block AttnRes."""
    attnres_block_size: int = 0
    """Block AttnRes: sublayers per block (attention and MLP each count one). 0: use attnres_n_blocks."""
    attnres_n_blocks: int = 8
    """Block AttnRes: number of blocks N when attnres_block_size is 0; leftover sublayers join the last block."""
    attnres_key_norm_gain: bool = True
    """AttnRes key RMSNorm has a learnable gain (paper-faithful default); False: a plain RMSNorm."""
    attnres_eps: float = 1e-6
    attnres_read: Literal["two_phase", "efficient", "reference"] = "two_phase"
    """How depth reads are computed; all exact. two_phase: batched inter-block read + online-softmax
    merge (fused Triton kernels on CUDA); efficient: one read per sublayer saving only per-token
    scalars for backward; reference: plain autograd."""

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    @property
    def hidden_dim(self) -> int:
        if self.ffn_dim:
            return self.ffn_dim
        hidden = int(8 * self.dim / 3)
        return self.multiple_of * ((hidden + self.multiple_of - 1) // self.multiple_of)

    @property
    def n_sublayers(self) -> int:
        """Sublayers that read the depth state: 2 per layer, 1 with the parallel block."""
        return self.n_layers * (1 if self.parallel_block else 2)

    def check_rope(self) -> None:
        """Raise ConfigError for RoPE settings that give NaN, infinite or shrunk frequencies
        (transformers only warns about them). Comparisons are written so that NaN fails them."""
        if not 0.0 < self.rope_theta < math.inf:
            raise ConfigError(f"model.rope_theta={self.rope_theta} must be a finite number > 0")
        if not 1.0 <= self.rope_scaling_factor < math.inf:
            raise ConfigError(
                f"model.rope_scaling_factor={self.rope_scaling_factor} must be finite and >= 1 "
                "(scaling stretches the context; 1 = unscaled)"
            )
        low, high = self.rope_low_freq_factor, self.rope_high_freq_factor
        if not 0.0 < low < high < math.inf:
            raise ConfigError(
                f"model.rope_low_freq_factor={low} and model.rope_high_freq_factor={high} must "
                "satisfy 0 < low < high (finite); llama3 blends over the band between them and "
                "divides by high - low"
            )
        if self.rope_original_max_len <= 0:
            raise ConfigError(
                f"model.rope_original_max_len={self.rope_original_max_len} must be > 0"
            )


@dataclass
class DataConfig:
    path: str = "stdlib"
    """Corpus: 'stdlib' (the running Python's standard library source), or a .txt, .jsonl or .bin file or a directory of them."""
    tokenizer: str = "byte"
    """'byte', 'bpe' (trained on the corpus with HF tokenizers and cached), or a path to a tokenizer.json."""
    bpe_vocab_size: int = 4096
    seq_len: int = 128
    val_fraction: float = 0.01
    """Fraction of the token stream (taken from its end) held out for evaluation."""
    max_bytes: int = 0
    """Read at most this many bytes of raw text from the corpus; 0 = all of it."""
    bin_dtype: Literal["auto", "uint16", "uint32"] = "auto"
    """Element type of a pre-tokenized .bin file. auto: the one its sidecar `NAME.bin.json` records
    (written by `data.sources.write_bin`); a .bin without a sidecar needs it set explicitly."""
    cache_dir: str = ""
    """Where tokenized corpora and trained tokenizers are cached; '' = ~/.cache/depthscale."""
    jsonl_field: str = "text"


@dataclass
class TrainConfig:
    steps: int = 200
    batch_size: int = 16
    """Global batch: sequences per optimizer step."""
    micro_batch_size: int = 0
    """Sequences per forward/backward on one data-parallel rank; 0 = the rank's whole share of the
    batch (with pipeline parallelism: 2·pp micro-batches). Accumulation = batch / (dp · micro)."""
    seed: int = 0
    dtype: Literal["float32", "bfloat16"] = "float32"
    """Compute dtype: float32, or bfloat16 autocast (parameters and optimizer state stay float32)."""
    compile: bool = False
    grad_clip: float = 1.0
    """Clip the global gradient norm to this value; 0 disables clipping."""
    eval_every: int = 50
    eval_batches: int = 4
    device: Literal["auto", "cpu", "cuda"] = "auto"
    run_dir: str = "runs/{name}"
    name: str = "tiny"
    deterministic: bool = False
    recompute: Literal["none", "selective", "sublayer", "full"] = "none"
    """Activation recomputation per layer (`model/recompute.py`). selective: op-level — GEMM and
    attention outputs stay saved, the memory-bound ops between them (norms, RoPE, activations,
    AttnRes reads) are re-run in backward; sublayer: attention and MLP bodies are re-run, each
    sublayer's input (so the AttnRes read) stays saved; full: only each layer's input depth state
    stays, the whole layer is re-run. `benchmarks/recompute.py` measures what each keeps."""
    offload_params: bool = False
    """FSDP2 CPU offload (needs parallel.dp_shard × cp > 1, tp = pp = 1): sharded parameters, gradients and optimizer
    states live in host memory and the optimizer steps there; each unit's shard is copied to the
    device for its all-gather. With HSDP this is ZeRO-3 inside the shard group plus offload — how
    full AttnRes trains large models without pipelining."""
    offload_activations: bool = False
    """Keep the tensors saved for backward in host memory until backward needs them (with pipeline
    parallelism: while a micro-batch is in flight). A no-op copy on CPU; its bytes are counted."""
    keep_host_memory: bool = True
    """Let glibc malloc reuse freed host memory instead of returning it to the OS, so a step does
    not page-fault its activations in again (`train.host.keep_freed_host_memory`); RSS then stays
    at the peak. False leaves the allocator's defaults."""


@dataclass
class OptimConfig:
    name: Literal["adamw", "lamb"] = "adamw"
    lr: float = 3e-3
    """Peak learning rate. LAMB scales each layer's step by ‖w‖/‖update‖, so its lr is a relative
    step size: typically 1e-2..1e-1 where AdamW would use 1e-4..3e-3."""
    min_lr_ratio: float = 0.1
    """Final learning rate as a fraction of lr (cosine and WSD)."""
    weight_decay: float = 0.1
    """Decoupled weight decay of the matrices; vectors (norm gains) and AttnRes queries never
    decay (decaying a zero-initialised query pulls every depth read toward a uniform average)."""
    decay_embeddings: bool = True
    """Whether the token embedding (and a tied LM head) decays with the other matrices. True, as in
    GPT-2 / nanoGPT and Megatron-LM's default: the embedding is one more matrix. OLMo 2 turns it off
    for training stability; false puts the embedding in a group of its own with weight decay 0
    (LAMB keeps its trust ratio there)."""
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    schedule: Literal["cosine", "wsd", "constant"] = "cosine"
    warmup_steps: int = 20
    decay_fraction: float = 0.2
    """WSD: the fraction of steps spent in the final decay."""


@dataclass
class ParallelConfig:
    dp_replicate: int = 1
    dp_shard: int = 1
    cp: int = 1
    tp: int = 1
    pp: int = 1
    pp_virtual: int = 1
    """Virtual pipeline stages per rank (interleaved 1F1B when > 1)."""
    nproc: int = 1
    """Local worker processes to launch (depthscale train --nproc N)."""
    tp_overlap_chunks: int = 1
    """MegaScale TP overlap: split the sequence-parallel all-gather / reduce-scatter around the
    column- / row-parallel GEMMs into this many chunks, so communication of chunk i+1 overlaps the
    GEMM of chunk i. 1 = no chunking."""
    fsdp_reshard_after_forward: bool = True
    """FSDP: free gathered parameters after forward (ZeRO-3); False keeps them until backward (ZeRO-2-like)."""
    fsdp_defer_reduce_scatter: bool = False
    """With gradient accumulation, FSDP/HSDP reduce-scatter each micro-batch's gradients (the
    cross-replica all-reduce of HSDP and DDP's all-reduce always wait for the last micro-batch).
    True accumulates unsharded gradients and reduce-scatters once per step: accum× fewer
    reduce-scatters for the memory of one unsharded gradient copy (pipelines always do this)."""


@dataclass
class CheckpointConfig:
    every: int = 100
    """Save every this many steps (and at the end); 0 = only at the end."""
    keep: int = 2
    """Keep the newest this many checkpoints; 0 = keep all."""
    resume: str = "auto"
    """'auto' (newest checkpoint in the run directory, if any), 'none', or a checkpoint directory."""
    async_save: bool = False
    on_signal: bool = True
    """On SIGINT / SIGTERM (Ctrl-C, a scheduler's preemption notice), finish the current step, save
    a checkpoint and exit; False exits after the step without saving."""


@dataclass
class LoggingConfig:
    log_every: int = 10
    tensorboard: bool = True
    progress: bool = True
    peak_tflops: float = 0.0
    """Peak dense TFLOP/s used for MFU; 0 = detect (known GPUs) or measure (CPU matmul)."""


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)

    @property
    def micro_batch_size(self) -> int:
        """train.micro_batch_size, or its default: a data-parallel rank's whole share of the batch,
        except under pipeline parallelism, where 2·pp micro-batches per rank keep the bubble small."""
        if self.train.micro_batch_size:
            return self.train.micro_batch_size
        per_rank = max(1, self.train.batch_size // self.dp_degree)
        if self.parallel.pp > 1:
            for micro in (2 * self.parallel.pp, self.parallel.pp):
                if per_rank % micro == 0:
                    return per_rank // micro
        return per_rank

    def resolve_vocab_size(self, tokenizer_vocab: int) -> None:
        """model.vocab_size 0 takes the tokenizer's, rounded up to a multiple of 64 (friendlier
        matmul shapes) that tensor parallelism can split (the vocabulary is sharded over tp)."""
        m = self.model
        if m.vocab_size == 0:
            step = math.lcm(64, self.parallel.tp)
            m.vocab_size = step * math.ceil(tokenizer_vocab / step)
        elif m.vocab_size < tokenizer_vocab:
            raise ConfigError(
                f"model.vocab_size={m.vocab_size} is smaller than the tokenizer's "
                f"vocabulary ({tokenizer_vocab}); allowed: 0 (automatic) or >= {tokenizer_vocab}"
            )

    @property
    def dp_degree(self) -> int:
        return self.parallel.dp_replicate * self.parallel.dp_shard

    @property
    def grad_accum_steps(self) -> int:
        """Micro-batches each data-parallel rank runs per optimizer step."""
        return self.train.batch_size // (self.dp_degree * self.micro_batch_size)

    @property
    def run_path(self) -> Path:
        return Path(self.train.run_dir.format(name=self.train.name))

    def validate(self) -> Config:
        """Cross-field checks; raises ConfigError naming the key and what is allowed."""
        m, d, t, o, p = self.model, self.data, self.train, self.optim, self.parallel
        _check_fields(self)
        _positive(
            self,
            "model.dim",
            "model.n_layers",
            "model.n_heads",
            "data.seq_len",
            "train.steps",
            "train.batch_size",
            "optim.lr",
            "model.max_seq_len",
        )
        _non_negative(
            self,
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
            "model.attnres_block_size",
            "data.max_bytes",
            "logging.peak_tflops",
        )
        if m.dim % m.n_heads:
            raise ConfigError(
                f"model.n_heads={m.n_heads} must divide model.dim={m.dim}; "
                f"allowed: a divisor of {m.dim}"
            )
        if m.head_dim % 2:
            raise ConfigError(f"model.dim / model.n_heads = {m.head_dim} must be even for RoPE")
        m.check_rope()
        if m.n_heads % m.kv_heads:
            raise ConfigError(
                f"model.n_kv_heads={m.n_kv_heads} must divide model.n_heads={m.n_heads}"
            )
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
        if m.residual == "block" and m.attnres_block_size > m.n_sublayers:
            raise ConfigError(
                f"model.attnres_block_size={m.attnres_block_size} exceeds the number of "
                f"sublayers ({m.n_sublayers}); allowed: 1..{m.n_sublayers}"
            )
        if t.offload_params and p.dp_shard * p.cp == 1:
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
        dp = self.dp_degree
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
        if not 0.0 <= o.min_lr_ratio <= 1.0:
            raise ConfigError(f"optim.min_lr_ratio={o.min_lr_ratio} must be in [0, 1]")
        if not 0.0 < o.decay_fraction <= 1.0:
            raise ConfigError(f"optim.decay_fraction={o.decay_fraction} must be in (0, 1]")
        for beta in ("beta1", "beta2"):
            if not 0.0 <= getattr(o, beta) < 1.0:
                raise ConfigError(f"optim.{beta}={getattr(o, beta)} must be in [0, 1)")
        if o.warmup_steps > t.steps:
            raise ConfigError(f"optim.warmup_steps={o.warmup_steps} exceeds train.steps={t.steps}")
        for name in (
            "dp_replicate",
            "dp_shard",
            "cp",
            "tp",
            "pp",
            "pp_virtual",
            "nproc",
            "tp_overlap_chunks",
        ):
            if getattr(p, name) < 1:
                raise ConfigError(f"parallel.{name}={getattr(p, name)} must be >= 1")
        if m.ffn_chunk_size and p.tp > 1 and m.ffn_chunk_size % p.tp_overlap_chunks:
            raise ConfigError(
                f"model.ffn_chunk_size={m.ffn_chunk_size} under tensor parallelism runs the MLP on "
                f"chunks of each rank's sequence shard, each gathered in "
                f"parallel.tp_overlap_chunks={p.tp_overlap_chunks} pieces; allowed: a multiple of "
                f"{p.tp_overlap_chunks}, or 0"
            )
        self._check_pipeline_micro_batches()
        if (
            self.checkpoint.resume not in ("auto", "none")
            and not Path(self.checkpoint.resume).exists()
        ):
            raise ConfigError(
                f"checkpoint.resume={self.checkpoint.resume!r} does not exist; "
                "allowed: 'auto', 'none' or an existing checkpoint directory"
            )
        return self

    def _check_pipeline_micro_batches(self) -> None:
        """Under pp, fewer micro-batches than stages leave most of every step idle (1F1B bubble
        (pp-1)/(m+pp-1)). The default micro-batch size would silently fall back to one micro-batch
        when the per-rank batch splits into neither 2·pp nor pp: that is an error naming the fix.
        An explicit train.micro_batch_size is the user's choice: it only warns."""
        p, t = self.parallel, self.train
        if p.pp == 1:
            return
        dp = self.dp_degree
        per_rank = t.batch_size // dp
        n = per_rank // self.micro_batch_size
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
            fix = f"raise train.batch_size to {multiple} or more for at least {p.pp}"
        warnings.warn(
            f"parallel.pp={p.pp} with train.micro_batch_size={t.micro_batch_size}: {n} "
            f"micro-batch(es) per step for {p.pp} stages, so the pipeline idles {bubble:.0%} of "
            f"each step; {fix} micro-batches",
            stacklevel=2,
        )

    @property
    def world_size(self) -> int:
        p = self.parallel
        return p.pp * p.dp_replicate * p.dp_shard * p.cp * p.tp


def _get(cfg: Config, dotted: str) -> Any:
    section, key = dotted.split(".")
    return getattr(getattr(cfg, section), key)


def _positive(cfg: Config, *keys: str) -> None:
    for key in keys:
        if _get(cfg, key) <= 0:
            raise ConfigError(f"{key}={_get(cfg, key)} must be > 0")


def _non_negative(cfg: Config, *keys: str) -> None:
    for key in keys:
        if _get(cfg, key) < 0:
            raise ConfigError(f"{key}={_get(cfg, key)} must be >= 0")


# Fields whose only rule is a lower bound, beyond those `validate` checks with the cross-field rules.
_AT_LEAST_ONE = ("model.multiple_of", "model.attnres_n_blocks", "logging.log_every")
_POSITIVE_FLOATS = ("model.norm_eps", "model.init_std", "model.attnres_eps", "optim.eps")
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
    _check_dir_creatable("train.run_dir", run_path)
    if d.cache_dir:
        _check_dir_creatable("data.cache_dir", Path(d.cache_dir).expanduser())


def _check_dir_creatable(key: str, path: Path) -> None:
    """The directory exists or can be made: nothing on its way is a regular file, and the nearest
    existing ancestor is writable. Checked up front so a run fails before any work, not at its
    first write."""
    if path.exists() and not path.is_dir():
        raise ConfigError(f"{key}: {str(path)!r} is a file; allowed: a directory path")
    existing = path
    while not existing.exists():
        if existing.parent == existing:
            break
        existing = existing.parent
    if existing.exists() and not existing.is_dir():
        raise ConfigError(
            f"{key}: {str(path)!r} cannot be created because {str(existing)!r} is a file; "
            "allowed: a path whose parents are directories"
        )
    if existing.is_dir() and not os.access(existing, os.W_OK | os.X_OK):
        raise ConfigError(
            f"{key}: {str(path)!r} cannot be written ({str(existing)!r} is not writable)"
        )


# --------------------------------------------------------------------------------------------
# Loading: TOML file, then dotted overrides, each value checked against the field's type.


def _section_types(section_cls: type) -> dict[str, Any]:
    return typing.get_type_hints(section_cls)


def _describe(tp: Any) -> str:
    if get_origin(tp) is Literal:
        return "one of " + ", ".join(repr(a) for a in get_args(tp))
    return getattr(tp, "__name__", str(tp))


def _coerce(key: str, value: Any, tp: Any, from_string: bool) -> Any:
    """Check (TOML) or parse (command line) one value against its declared type."""
    if get_origin(tp) is Literal:
        allowed = get_args(tp)
        if value not in allowed:
            raise ConfigError(
                f"{key}: {value!r} is not allowed; allowed: " + ", ".join(repr(a) for a in allowed)
            )
        return value
    if get_origin(tp) in (typing.Union, types.UnionType):
        raise ConfigError(f"{key}: union types are not supported in the config schema")
    if tp is bool:
        if from_string and isinstance(value, str):
            low = value.lower()
            if low in ("1", "true", "yes", "on"):
                return True
            if low in ("0", "false", "no", "off"):
                return False
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{key}: expected a bool (true/false), got {value!r}")
    if tp is int:
        if from_string and isinstance(value, str):
            try:
                return int(value.replace("_", ""))
            except ValueError:
                pass
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise ConfigError(f"{key}: expected an int, got {value!r}")
    if tp is float:
        if from_string and isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                pass
        if isinstance(value, int | float) and not isinstance(value, bool):
            return float(value)
        raise ConfigError(f"{key}: expected a float, got {value!r}")
    if tp is str:
        if isinstance(value, str):
            return value
        raise ConfigError(f"{key}: expected a string, got {value!r}")
    raise ConfigError(f"{key}: unsupported type {tp}")


def _unknown(kind: str, name: str, allowed: list[str]) -> ConfigError:
    hint = difflib.get_close_matches(name, allowed, n=1)
    did_you_mean = f" (did you mean {hint[0]!r}?)" if hint else ""
    return ConfigError(f"unknown {kind} {name!r}{did_you_mean}; allowed: " + ", ".join(allowed))


def set_value(cfg: Config, dotted: str, value: Any, from_string: bool = False) -> None:
    """Set `section.key` on cfg after checking the key exists and the value has the right type."""
    parts = dotted.split(".")
    sections = [f.name for f in dataclasses.fields(Config)]
    if len(parts) != 2:
        raise ConfigError(
            f"config key {dotted!r} must look like 'section.key' "
            f"with section one of: {', '.join(sections)}"
        )
    section, key = parts
    if section not in sections:
        raise _unknown("config section", section, sections)
    sec = getattr(cfg, section)
    hints = _section_types(type(sec))
    if key not in hints:
        raise _unknown(f"key in [{section}]", key, list(hints))
    setattr(sec, key, _coerce(dotted, value, hints[key], from_string))


def from_dict(data: dict[str, Any]) -> Config:
    cfg = Config()
    for section, values in data.items():
        if not isinstance(values, dict):
            sections = [f.name for f in dataclasses.fields(Config)]
            if section not in sections:
                raise _unknown("config section", section, sections)
            raise ConfigError(f"[{section}] must be a table of keys, got {values!r}")
        for key, value in values.items():
            set_value(cfg, f"{section}.{key}", value)
    return cfg


def to_dict(cfg: Config) -> dict[str, dict[str, Any]]:
    return dataclasses.asdict(cfg)


def to_toml(cfg: Config) -> str:
    """Serialize a config as TOML (the run directory keeps one, so a run can be reproduced)."""
    lines: list[str] = []
    for section, values in to_dict(cfg).items():
        lines.append(f"[{section}]")
        for key, value in values.items():
            if isinstance(value, bool):
                text = "true" if value else "false"
            elif isinstance(value, str):
                text = '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
            else:
                text = repr(value)
            lines.append(f"{key} = {text}")
        lines.append("")
    return "\n".join(lines)


def parse_overrides(args: list[str]) -> list[tuple[str, str]]:
    """Turn ['--model.dim', '128', '--train.compile=true'] into [('model.dim', '128'), ...]."""
    pairs: list[tuple[str, str]] = []
    i = 0
    while i < len(args):
        arg = args[i]
        if not arg.startswith("--") or "." not in arg:
            raise ConfigError(
                f"unexpected argument {arg!r}; overrides look like --section.key VALUE"
            )
        arg = arg[2:]
        if "=" in arg:
            key, value = arg.split("=", 1)
            i += 1
        else:
            if i + 1 >= len(args):
                raise ConfigError(f"override --{arg} is missing its value")
            key, value = arg, args[i + 1]
            i += 2
        pairs.append((key, value))
    return pairs


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> Config:
    """Load a TOML config file (or the defaults), apply `--section.key value` overrides, validate."""
    data: dict[str, Any] = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config file {str(path)!r} does not exist")
        try:
            data = tomllib.loads(path.read_text())
        except tomllib.TOMLDecodeError as err:
            raise ConfigError(f"config file {str(path)!r} is not valid TOML: {err}") from err
    cfg = from_dict(data)
    for key, value in parse_overrides(overrides or []):
        set_value(cfg, key, value, from_string=True)
    return cfg.validate()
