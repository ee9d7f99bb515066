"""The config tree: one dataclass per section, every field typed, defaulted and documented."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from depthscale.config.validation import validate
from depthscale.errors import ConfigError
from depthscale.shape import Degrees, is_moe_layer

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
    moe_experts: int = 0
    """Mixture-of-Experts FFN (`model/moe.py`): routed experts per MoE layer; 0 = dense FFNs."""
    moe_top_k: int = 2
    """Experts each token is routed to (dropless: every token reaches all of them)."""
    moe_shared_experts: int = 0
    """Experts every token goes through as well (one dense FFN this many times wider)."""
    moe_ffn_dim: int = 0
    """Hidden size of one expert (fine-grained experts are narrow); 0 = the dense hidden size."""
    moe_gate: Literal["softmax", "sigmoid"] = "softmax"
    """Router scores: softmax over experts (Mixtral, Qwen3-MoE) or per-expert sigmoids
    (DeepSeek-V3)."""
    moe_normalize_top_k: bool = True
    """Rescale each token's top-k weights to sum to 1."""
    moe_balance: Literal["aux_loss", "bias"] = "aux_loss"
    """Load balancing: an auxiliary loss (Switch / GShard, coefficient moe_aux_loss), or
    aux-loss-free (DeepSeek-V3): a per-expert bias added to the scores for selection only, moved
    by moe_bias_rate towards the mean load after every step."""
    moe_aux_loss: float = 0.01
    """Coefficient of the load-balancing loss (moe_balance = 'aux_loss')."""
    moe_balance_scope: Literal["micro_batch", "global_batch"] = "micro_batch"
    """The tokens the load-balancing loss's expert shares f_e are counted over (training only):
    each rank's micro-batch (Megatron's default: the loss then depends on the layout), or every
    rank's micro-batch of the same accumulation step, all-reduced (global-batch balance, Qwen's
    "Demons in the Detail": the same loss and gradients for every layout with the same
    micro-batch steps; the whole batch with the default micro_batch_size)."""
    moe_bias_rate: float = 0.001
    """Step of the aux-loss-free bias update (moe_balance = 'bias')."""
    moe_z_loss: float = 0.0
    """Coefficient of the router z-loss (mean squared log-sum-exp of the router logits)."""
    moe_every: int = 1
    """Every k-th layer is MoE (counted from the first after moe_first_dense)."""
    moe_first_dense: int = 0
    """The first layers keep a dense FFN."""

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
    def moe_hidden_dim(self) -> int:
        return self.moe_ffn_dim or self.hidden_dim

    def is_moe_layer(self, layer_id: int) -> bool:
        """Whether layer `layer_id` has a Mixture-of-Experts FFN."""
        return is_moe_layer(layer_id, self.moe_experts, self.moe_first_dense, self.moe_every)

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


REQUIRED = {"required": True}
"""The metadata of a key that an entry of a list of tables (`[[data.sources]]`, ...) must set:
its default only fills the dataclass, and a missing key is named as missing
(`loading._table_list`), not reported as its default's value."""


@dataclass
class DataSource:
    """One source of a mixture (`[[data.sources]]`): its corpus and its share of the tokens."""

    name: str = field(default="", metadata=REQUIRED)
    """What it is logged as (`train/tokens/<name>`, `train/epoch/<name>`) and what stages call
    it."""
    path: str = field(default="", metadata=REQUIRED)
    """A corpus as `data.path` names one (any format of docs/data.md)."""
    weight: float = field(default=0.0, metadata=REQUIRED)
    """Its share of every batch's tokens (> 0; the weights are normalised)."""
    max_epochs: float = 0.0
    """Refuse a run whose schedule would read it more than this many times; 0 = no limit."""
    jsonl_field: str = ""
    """The text field or column of this source; "" = data.jsonl_field."""


@dataclass
class DataStage:
    """New weights from a step on (`[[data.stages]]`), e.g. to anneal on a high-quality mix."""

    at_step: int = field(default=0, metadata=REQUIRED)
    """The first step (from 1) that draws with these weights."""
    weights: dict[str, float] = field(default_factory=dict, metadata=REQUIRED)
    """{source name = weight}; a source not named draws nothing in this stage."""


@dataclass
class DataConfig:
    path: str = "stdlib"
    """Corpus: 'stdlib' (the running Python's standard library source), a file of any format of
    the table in `data/formats.py` (text, or tokens another trainer wrote; docs/data.md,
    "Formats"), a directory of them, or a `depthscale tokenize` directory."""
    tokenizer: str = "byte"
    """'byte', 'bpe' (trained on the corpus with HF tokenizers and cached), or a path to a tokenizer.json."""
    eos_token: str = ""
    """The token that ends every document, overriding the tokenizer's own: '' = the `eos_token`
    its tokenizer_config.json (or special_tokens_map.json) configures, else found by name
    (docs/data.md, "Which EOS"). Must be a token of the vocabulary."""
    bpe_vocab_size: int = 4096
    seq_len: int = 128
    val_fraction: float = 0.01
    """Fraction of the token stream (taken from its end) held out for evaluation."""
    max_bytes: int = 0
    """Read at most this many bytes of raw text from a text corpus (each mixture source its own);
    0 = all of it. Token files (.bin, .npy, Megatron, tokenize shards) are always used whole.
    Start-up says how much of the corpus a cap leaves out."""
    bin_dtype: Literal["auto", "uint16", "uint32"] = "auto"
    """Element type of a pre-tokenized .bin file, or of a raw (headerless) Dolma .npy. auto: the
    one its sidecar `NAME.bin.json` records (written by `data.token_files.write_bin`) or the .npy
    header says; a file with neither needs it set. A Megatron .idx records its own."""
    cache_dir: str = ""
    """Where tokenized corpora and trained tokenizers are cached; '' = ~/.cache/depthscale."""
    jsonl_field: str = "text"
    """The field of each .jsonl line, or the .parquet column, that holds a document's text."""
    sources: list[DataSource] = field(default_factory=list)
    """A weighted mixture instead of data.path: `[[data.sources]]` tables (name, path, weight,
    max_epochs, jsonl_field); each source keeps its own order and position (`data/mixture.py`)."""
    stages: list[DataStage] = field(default_factory=list)
    """Weight changes during the run: `[[data.stages]]` tables (at_step, weights)."""
    document_mask: bool = False
    """Attention never crosses a document boundary inside a packed row, and RoPE positions restart
    in every document: a packed row computes what its documents would alone. A document starts at
    each EOS (the token that ends the one before, and plays BOS), so no prediction is lost
    (`model/documents.py`; docs/data.md)."""
    mask_eos_target: bool = False
    """With document_mask: no loss on EOS targets, for corpora whose document ends are cuts rather
    than ends (the model is then never taught to stop)."""


@dataclass
class TrainConfig:
    steps: int = 200
    batch_size: int = 16
    """Global batch: sequences per optimizer step."""
    micro_batch_size: int = 0
    """Sequences per forward/backward on one data-parallel rank; 0 = the rank's whole share of the
    batch, or with pipeline parallelism 2·pp micro-batches (else pp; a per-rank batch that splits
    into neither is refused). Accumulation = batch / (dp · micro). Set explicitly under pp, fewer
    micro-batches than stages are allowed with a warning naming the pipeline bubble."""
    seed: int = 0
    dtype: Literal["float32", "bfloat16"] = "float32"
    """Compute dtype: float32, or bfloat16 autocast (parameters and optimizer state stay float32)."""
    tf32: Literal["auto", True, False] = "auto"
    """fp32 matmuls on CUDA in TF32 (tensor cores: fp32 range and sums, 10-bit mantissa inputs, ~7x
    the fp32 rate on an H100). 'auto': on for CUDA — under bfloat16 autocast only the matmuls kept
    in fp32 on purpose (AttnRes logits, the fp32 ring reference) take it, with 8x less rounding than
    bf16. false: exact fp32 (parity runs against a CPU reference). Never changes CPU matmuls."""
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
    keep_host_memory: Literal["auto", True, False] = "auto"
    """Let glibc malloc reuse freed host memory instead of returning it to the OS, so a step does
    not page-fault its activations in again (`train.host.keep_freed_host_memory`); RSS then stays
    at the peak. 'auto': on where training runs on the CPU (its activations are host memory), off
    on a GPU, whose host memory is the data workers' and the checkpoint stager's. False leaves
    the allocator's defaults."""
    gc_interval: int = 100
    """N > 0 (default 100): Python's garbage collector is disabled while training and run on every
    rank at the start of every N-th step, so that no rank pauses for it in the middle of a step and
    launches its collectives late (MegaScale §6.3; `benchmarks/gc_interval.py`) — on a thousand
    ranks one of them is always collecting. The objects alive when training starts (model, torch,
    start-up) are frozen out of those collections, so each walks only what training allocated.
    0: the collector runs whenever it decides, on each rank separately."""


@dataclass
class OptimConfig:
    name: Literal["adamw", "lamb", "muon"] = "adamw"
    """adamw; lamb (MegaScale, large batches); muon: Newton–Schulz-orthogonalised momentum for the
    hidden matrices, AdamW for the rest, the matrices' update scaled to AdamW's RMS so lr and
    weight_decay carry over (docs/training.md, Muon)."""
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
    muon_momentum: float = 0.95
    """Muon: the momentum of the matrices' buffer, in [0, 1)."""
    muon_nesterov: bool = True
    """Muon: orthogonalise the Nesterov look-ahead (1-μ)·g + μ·buffer instead of the buffer."""
    muon_ns_steps: int = 5
    """Muon: quintic Newton–Schulz iterations per matrix and step, 1..20 (5, as torch.optim.Muon)."""
    muon_adamw_lr: float = 0.0
    """Muon: the peak learning rate of the parameters AdamW updates (embedding, output head, norms,
    AttnRes queries, MoE router); 0 = optim.lr. The schedule scales it as it scales optim.lr."""
    qk_clip_tau: float = 0.0
    """Muon: QK-clip (Kimi K2's MuonClip) at this max attention logit; 0 = off. After each step,
    a head whose largest logit q·k/√head_dim in that step's forward passed τ has W_q and W_k
    rescaled so its logits shrink to τ (docs/training.md, QK-clip). Muon only; not with context
    parallelism (no rank holds all of a query's keys)."""


@dataclass
class ParallelConfig:
    dp_replicate: int = 1
    dp_shard: int = 1
    cp: int = 1
    cp_ulysses: int = 1
    """Context parallelism's Ulysses degree, a factor of cp: the cp ranks form groups of this many
    consecutive ranks that trade the sequence shard for a head shard by all-to-all around
    attention, and a ring (the rest of cp) runs across the groups (`parallel/ulysses.py`). 1: a
    pure ring; cp: pure Ulysses. Divides the heads per tp rank, and the KV heads per tp rank
    divide it or are a multiple of it."""
    cp_balance: Literal["zigzag", "documents"] = "documents"
    """How the ring cuts each row over the cp ranks. 'zigzag': 2·cp chunks, rank r takes chunks
    r and 2·cp−1−r (balances one causal sequence). 'documents': with data.document_mask, finer
    chunks assigned per micro-batch by their attention work under the rows' documents and the
    window, computed on the host (`parallel/cp_balance.py`; never worse than zigzag, and zigzag
    itself for rows without boundaries or without document masks)."""
    cp_balance_chunk: int = 64
    """cp_balance='documents': the shortest chunk (tokens) a row is cut into; the chunks are as
    many as this allows (a multiple of 2·cp dividing the row)."""
    tp: int = 1
    pp: int = 1
    pp_virtual: int = 1
    """Virtual pipeline stages per rank (interleaved 1F1B when > 1)."""
    pp_ends_fewer_layers: int = 0
    """The first and the last pipeline stage hold this many layers fewer than the others: they
    also run the embedding and the head, and the first keeps the most micro-batches in flight
    (Llama 3 405B: 1, 126 layers on 16 ranks × 8 one-layer stages). 0: a balanced split."""
    ep: int = 1
    """Expert parallelism (MoE): the routed experts are split over groups of this many dp_shard
    ranks, tokens reach them by all-to-all (`parallel/expert_parallel.py`); a slice of the
    data-parallel dimension, not a dimension of its own. Divides dp_shard and model.moe_experts."""
    timeout_s: float = 600.0
    """How long a collective or message may wait for its peers before it fails (the process
    group's timeout), from the first completed step on; every rank then writes its hang dump."""
    setup_timeout_s: float = 1800.0
    """The same limit before the first step completes: joining the group, a node's tokenisation
    that its other ranks wait for, checkpoint load, the first step's compilation and communicator
    set-up. Long, so a slow start is not mistaken for a dead peer; then `timeout_s`."""
    nproc: int = 1
    """Local worker processes to launch (depthscale train --nproc N): per node."""
    nnodes: int = 1
    """Nodes of the job. Each runs `depthscale train --nproc N --parallel.node_rank K` (one
    supervisor per node; node 0's hosts the rendezvous store at master_addr:master_port)."""
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    """Node 0's address, reachable from every node."""
    master_port: int = 0
    """The rendezvous store's port on node 0; 0 = any free port (one node only)."""
    tp_overlap_chunks: int = 1
    """MegaScale TP overlap: split the sequence-parallel all-gather / reduce-scatter around the
    column- / row-parallel GEMMs into this many chunks, so communication of chunk i+1 overlaps the
    GEMM of chunk i. 1 = no chunking."""
    grad_reduce_dtype: Literal["float32", "bfloat16"] = "float32"
    """The dtype data parallelism reduces gradients in: FSDP's reduce-scatter and HSDP's
    all-reduce (replicas without dp_shard take FSDP's replicate mode for bfloat16: DDP's reducer
    sums fp32). bfloat16 halves those bytes; the sum of many bf16 shards loses bits (8 of them),
    which small models at large data-parallel degree may afford. The gradients kept for the
    optimizer stay fp32."""
    fsdp_reshard_after_forward: Literal["auto", True, False] = "auto"
    """FSDP: true frees gathered parameters after forward (ZeRO-3: gathered again for backward);
    false keeps them until backward (ZeRO-2-like). Under pipeline parallelism false keeps a
    stage's gathered parameters for the whole step, so they are gathered once per step, not twice
    per micro-batch (resharded after the stage's last backward). "auto": false under pipeline
    parallelism (as torchtitan and Megatron do), true otherwise. Replicas without dp_shard × cp
    (dp_replicate beside tp or pp) gather nothing and keep their unsharded copies, as DDP does."""
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
    async_save: Literal["auto", True, False] = "auto"
    """Write checkpoints in the background after staging them in host memory (training waits only
    for the copy); 'auto': when several processes train, since one process writes fast enough."""
    on_signal: bool = True
    """On SIGINT / SIGTERM (Ctrl-C, a scheduler's preemption notice), finish the current step, save
    a checkpoint and exit; False exits after the step without saving."""
    async_writer: Literal["process", "thread"] = "process"
    """Who writes an async save: 'process', one writer process per rank (started at the first
    save; it takes none of training's GIL time), or 'thread', in the training process (no extra
    process; its Python work competes with training's). Without a TCP store (a process group not
    made through env:// or torchrun) saves use a thread."""
    snapshot_every: int = 0
    """Under a supervisor, also snapshot the state into host memory every this many steps
    (train/snapshot.py): a restart restores from there, losing about this many steps, and
    falls back to the newest checkpoint on disk when a snapshot does not verify; 0 = off. Costs
    up to 3x the state in host memory. Off by default: measured on the 2-core CPU box, where the
    writer competes with training for cores, every 10 steps cost 24 % of tokens/s, every 3 44 %
    (docs/fault-tolerance.md); where the host has cores to spare (GPU nodes), turn it on."""
    replica_mb_s: float = 1000.0
    """In a multi-node job, each node's keeper copies every snapshot to the next node's keeper
    (the buddy replica) at most this fast, in MB/s, so the copy does not take the step's network;
    a node lost whole is then restored from that copy."""


@dataclass
class LoggingConfig:
    log_every: int = 10
    tensorboard: bool = True
    progress: bool = True
    peak_tflops: float = 0.0
    """Peak dense TFLOP/s used for MFU; 0 = detect (known GPUs) or measure (CPU matmul)."""
    trace: bool = True
    """Record spans on every rank (RUN/trace/rank*.jsonl; `depthscale trace timeline` merges
    them). Always on by design: `benchmarks/timeline_overhead.py` measures what it costs."""
    trace_queue: int = 65536
    """Events the background writer may fall behind by; beyond it they are dropped and counted."""
    straggler_threshold: float = 0.12
    """Name a rank whose compute (or data-wait) time exceeds its peers' (same pipeline stage) by
    this fraction for several steps (`observe/stragglers.py`); 0 = off. Needs trace. 0.12 sits
    above what four ranks sharing two CPU cores vary by and below a 20 % slowdown."""
    hang_dump_s: float = 120.0
    """A rank that makes no progress inside a step for this many seconds writes its hang dump
    (RUN/trace/hang/; `depthscale trace hang` names the culprit); 0 = only on a timeout error."""
    mfu_alarm: float = 0.1
    """Warn when the rolling MFU stays this fraction below its best for a window (20 steps),
    naming the phase that grew; 0 = off."""
    profile_steps: str = ""
    """Take a torch.profiler trace of these steps ("20-22", or one step: "20") on
    `profile_ranks` into RUN/trace/profile/ (Chrome trace format: ui.perfetto.dev opens it beside
    `depthscale trace timeline`); "" = off."""
    profile_ranks: str = "0"
    """The ranks that profile: "0", a comma list ("0,7") or "all"."""
    memory_snapshot: bool = False
    """With profile_steps, on CUDA: also a CUDA memory snapshot of the window (a .pickle that
    pytorch.org/memory_viz reads)."""
    wandb: bool = False
    """Also send the scalars TensorBoard gets to Weights & Biases (`pip install
    'depthscale[wandb]'`; WANDB_MODE=offline writes RUN/wandb/ with no account). A resumed run
    continues the same W&B run: its id is kept in RUN/wandb_id."""
    wandb_project: str = "depthscale"
    wandb_entity: str = ""
    """The W&B team or user; "" = your W&B default."""
    wandb_name: str = ""
    """The W&B run's name; "" = train.name."""


@dataclass
class ResilienceConfig:
    """The supervisor (`resilience/supervisor.py`) and the NaN guard; docs/fault-tolerance.md."""

    supervise: Literal["auto", "true", "false"] = "auto"
    """Run the workers under the supervisor (heartbeats, detection, diagnostics, restarts). auto:
    when more than one process is launched (--nproc > 1); false: plain torchrun semantics (a failed
    worker ends the job)."""
    heartbeat_s: float = 0.25
    """Heartbeat period, longer in a large group (all ranks beat into one store: at most 256 beats
    a second, so 2 s at 512 ranks). A rank silent for max(4 of its periods, 1.5 s) is dead or
    frozen."""
    hang_floor_s: float = 30.0
    """A group whose slowest rank made no progress (no span ended) for max(this, hang_factor ×
    p99 step time, 2 heartbeats) is hung. The floor covers what a step's history cannot predict:
    a GC pause, a slow read from shared storage, a machine that other work loads (1.5 s restarted
    a healthy 4-rank CPU run four times). Drills that time detection lower it."""
    hang_factor: float = 3.0
    """The margin over the slowest step of the last 100 (the p99 over at most 100 steps)."""
    long_phase_s: float = 300.0
    """The no-progress limit inside a checkpoint save (while any rank's background writer is still
    in flight, too) or an evaluation, which may legitimately run long without ending a span; also
    how long a hung group's save in flight may take to finish before the group is stopped."""
    startup_timeout_s: float = 300.0
    """How long a (re)started group may go without any progress before its first completed step:
    a new start-up phase, a compilation begun or ended, a span ended. The whole start may take many
    times this (tokenizer training, NCCL set-up, one compilation per block); also how long a
    node's supervisor waits for node 0's store and for the other nodes."""
    node_lost_s: float = 5.0
    """Multi-node: a node whose supervisor has not beaten in node 0's store for this long, or node
    0's store unanswered for this long, is gone, and the others give up (exit 75). A supervisor
    beats from a thread of its own every heartbeat_s; this allows a loaded host and a few TCP
    retransmissions. A node 0 whose process ended is found at once (its store closes)."""
    slow_steps: int = 20
    """Restart (after diagnostics) when the straggler detector has flagged the same rank for this
    many consecutive steps; 0 = only report slow ranks."""
    max_restarts: int = 20
    """Restarts in all before the supervisor gives up (exit code 75, with a report)."""
    max_restarts_without_progress: int = 3
    """Restarts in a row that found no newer verified checkpoint before the supervisor gives up."""
    diagnose: bool = True
    """Run `depthscale diagnose` between a fault and the restart, excluding nodes that fail it."""
    local_nodes: int = 1
    """Split this host's workers into this many nodes (drills of node exclusion on one machine;
    a real multi-node job runs one supervisor per node)."""
    spare_nodes: int = 0
    """Extra local nodes held in reserve to replace excluded ones (drills)."""
    nan_replay: bool = True
    """On a non-finite loss or gradient: skip the update, replay the step once; if it is still
    non-finite roll back to the newest verified checkpoint and skip that batch. False: stop."""
    faults: str = ""
    """Fault injection for drills, off by default (`resilience/faults.py`; e.g.
    "kill@1:5,nan@0:3")."""


@dataclass
class EvalTask:
    """One downstream task (`[[eval.tasks]]`): multiple-choice questions in a local JSONL file,
    one `{"context": str, "choices": [str, ...], "gold": index}` a line, scored by log-likelihood
    every `train.eval_every` steps (`evaluation/multiple_choice.py`); logged as
    `eval/<name>/acc` and `eval/<name>/acc_norm`."""

    path: str = field(default="", metadata=REQUIRED)
    name: str = ""
    """The name it is logged under; "" = the file's name without its suffix."""
    limit: int = 0
    """Score only the first this many questions; 0 = all of them."""

    @property
    def label(self) -> str:
        return self.name or Path(self.path).stem


@dataclass
class EvalSet:
    """A named held-out corpus (`[[eval.sets]]`), any format of docs/data.md, evaluated every
    `train.eval_every` steps on `train.eval_batches` batches; logged as `val/<name>/loss` and
    `val/<name>/bpb` (bits per byte of its text)."""

    name: str = field(default="", metadata=REQUIRED)
    path: str = field(default="", metadata=REQUIRED)
    jsonl_field: str = ""
    """Its text field or column; "" = data.jsonl_field."""


@dataclass
class EvalConfig:
    """Evaluation beyond the held-out loss (which `train.eval_every` and `train.eval_batches`
    set)."""

    tasks: list[EvalTask] = field(default_factory=list)
    """Downstream multiple-choice tasks, as `[[eval.tasks]]` tables (path, name, limit)."""
    sets: list[EvalSet] = field(default_factory=list)
    """Named held-out corpora, as `[[eval.sets]]` tables (name, path, jsonl_field); the held-out
    end of the training data stays `val/`."""


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    resilience: ResilienceConfig = field(default_factory=ResilienceConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)

    @property
    def micro_batch_size(self) -> int:
        """train.micro_batch_size, or its default: a data-parallel rank's whole share of the batch,
        except under pipeline parallelism, where 2·pp (else pp) micro-batches per rank keep the
        bubble small (`validate` refuses a per-rank batch that splits into neither, rather than run
        one micro-batch per step)."""
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
        return Degrees.of(self.parallel).dp

    @property
    def grad_accum_steps(self) -> int:
        """Micro-batches each data-parallel rank runs per optimizer step."""
        return self.train.batch_size // (self.dp_degree * self.micro_batch_size)

    @property
    def run_path(self) -> Path:
        return Path(self.train.run_dir.format(name=self.train.name))

    def validate(self) -> Config:
        """Per-field and cross-field checks (`config/validation.py`); raises ConfigError naming the
        key and what is allowed. Returns self."""
        return validate(self)

    @property
    def world_size(self) -> int:
        return Degrees.of(self.parallel).world_size
