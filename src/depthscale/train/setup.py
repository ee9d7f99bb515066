"""What `Trainer.__init__` resolves and checks before training: the device, the seeds, the data
(built once per node), the tokenizer a resumed run must keep, the peak FLOP/s for MFU."""

from __future__ import annotations

import os
import random
from pathlib import Path

import numpy as np
import torch
from torch import nn

from depthscale.config import Config, ConfigError, to_toml
from depthscale.data.agreement import check_ranks_agree, data_identity
from depthscale.data.eval_sets import attach_eval_sets
from depthscale.data.loader import DataBundle, build_data
from depthscale.errors import CheckpointError
from depthscale.observe import flight_recorder, startup
from depthscale.observe.metrics import detect_peak_flops
from depthscale.parallel.parallelize import Layout, init_layout
from depthscale.parallel.startup import leader_first
from depthscale.resilience.diagnostics import DIAGNOSE_ENV, diagnose_in_group
from depthscale.resilience.faults import FaultPlan, parse_faults
from depthscale.resilience.heartbeat import Heartbeat
from depthscale.train.console import say
from depthscale.train.host import expandable_segments, keep_freed_host_memory


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError(
            "train.device='cuda' but no CUDA device is available; allowed here: 'auto', 'cpu'"
        )
    return torch.device(name)


def tf32_wanted(setting: str | bool, device: torch.device) -> bool:
    """`train.tf32`: whether fp32 matmuls run in TF32 — only ever on CUDA ('auto' = on there)."""
    return device.type == "cuda" and setting in ("auto", True)


def apply_tf32(setting: str | bool, device: torch.device) -> bool:
    """Set CUDA's fp32 matmul precision from `train.tf32` (cuBLAS only: CPU matmuls, whose oneDNN
    precision is a separate switch, are left alone; on CPU nothing is touched). Returns whether
    TF32 is on, which the MFU peak then follows (`observe.metrics.detect_peak_flops`)."""
    if device.type != "cuda":
        return False
    on = tf32_wanted(setting, device)
    torch.backends.cuda.matmul.allow_tf32 = on
    return on


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def build_data_once_per_node(cfg: Config, env, dp_size: int, progress=None) -> DataBundle:
    """Local rank 0 tokenizes (or trains the BPE tokenizer) and fills the cache; the node's other
    ranks then load it instead of repeating the work, each waiting for that one rank (no barrier:
    other nodes' ranks go on). The token stream is memory-mapped, so one copy
    in the page cache serves every rank on the node. Then all ranks check that they hold the
    same data (`data/agreement.py`): nodes build theirs independently. `progress(n)` is told as
    tokenizing goes on (a supervised worker's heartbeat: a long tokenization is not a hang)."""

    def build() -> DataBundle:
        data = build_data(
            cfg.data,
            cfg.train.seed,
            cfg.train.batch_size,
            ranks=dp_size,
            steps=cfg.train.steps,
            progress=progress,
        )
        return attach_eval_sets(
            data, cfg.data, cfg.eval.sets, cfg.train.seed, cfg.train.batch_size, dp_size, progress
        )

    data = leader_first("data", env.rank - env.local_rank, build)  # the node's local rank 0
    check_ranks_agree(data_identity(data, cfg.train.seed))
    tok = data.tokenizer  # which token ends documents is a choice (docs/data.md): say it
    say(f"depthscale: tokenizer {tok.name} ({tok.vocab_size} tokens), {tok.eos_summary}")
    return data


def compile_blocks(model: nn.Module) -> int:
    """`train.compile`: compile each transformer block in place, as torchtitan does. Whatever runs
    the blocks runs them compiled: the model's forward, or a pipeline stage calling its own blocks
    (a compiled whole model would leave stages uncompiled). `nn.Module.compile` keeps parameter
    names, so state dicts and checkpoints are unchanged. Static shapes: train and eval batches
    differ, and dynamic-shape tracing of the custom AttnRes autograd Functions is not reliable; a
    recompile per shape is cheap. Blocks share their code, and dynamo keys its cache by code: each
    shape and grad mode (train, eval) is one more entry, and so would be each block whose inputs
    differ (AttnRes blocks compile their sublayer parts, which do not: `TransformerBlock.compile`),
    so the limit is raised to two per block: no block falls back to eager for want of an entry.
    Returns the number of blocks compiled."""
    import torch._dynamo

    layers = list(model.layers.values())
    torch._dynamo.config.recompile_limit = max(
        torch._dynamo.config.recompile_limit, 2 * len(layers)
    )
    for layer in layers:
        layer.compile(dynamic=False)
    return len(layers)


def check_same_tokenizer(run_dir: Path, tokenizer) -> None:
    """The checkpoints were trained on the run's saved tokenizer; another one would decode garbage."""
    from depthscale.data.tokenizer import load_tokenizer

    saved_dir = run_dir / "tokenizer"
    if not saved_dir.is_dir():
        return
    saved = load_tokenizer(saved_dir)
    if saved.fingerprint != tokenizer.fingerprint:
        raise CheckpointError(
            f"cannot resume {run_dir}: its checkpoints were trained with the tokenizer in "
            f"{saved_dir} ({saved.name}), but data.tokenizer gives another one ({tokenizer.name}); "
            "allowed: the run's own tokenizer (or start a new run with a new --train.name)"
        )


def peak_flops(cfg: Config, device: torch.device, dtype: torch.dtype) -> tuple[float, str]:
    if cfg.logging.peak_tflops > 0:
        return cfg.logging.peak_tflops * 1e12, "logging.peak_tflops"
    return detect_peak_flops(device, dtype)


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def start_runtime(
    cfg: Config, heartbeat: Heartbeat | None
) -> tuple[Layout, FaultPlan, torch.dtype]:
    """Everything before data and model, in the order it must happen: host memory and allocator
    settings (before the first CUDA allocation), the NCCL flight recorder (read when the first
    NCCL group is made), the process groups, the injected faults, a restart's diagnostics, then
    numerics and seeds."""
    device = resolve_device(cfg.train.device)
    if cfg.train.keep_host_memory is True or (
        cfg.train.keep_host_memory == "auto" and device.type == "cpu"
    ):
        keep_freed_host_memory()
    expandable_segments(device.type)
    if device.type == "cuda":
        flight_recorder.configure_nccl(cfg.run_path)
    layout = init_layout(cfg, device)
    faults = FaultPlan(parse_faults(cfg.resilience.faults), layout.env.rank)
    if heartbeat is not None:
        heartbeat.update(coords=layout.dims.coordinates(layout.env.rank))
        if os.environ.get(DIAGNOSE_ENV) and layout.env.world_size > 1:  # a restart after a fault
            diagnose_in_group(cfg.run_path / "checkpoints", heartbeat.publish_diagnostics)
            startup.mark("diagnose")
    apply_tf32(cfg.train.tf32, layout.device)
    if cfg.train.deterministic:
        torch.use_deterministic_algorithms(True)
    seed_everything(cfg.train.seed)
    return layout, faults, DTYPES[cfg.train.dtype]


def write_run_files(run_dir: Path, cfg: Config, tokenizer) -> None:
    """The run directory's config.toml and tokenizer (rank 0), written once every start-up check
    has passed: a refused or failed start leaves an existing run directory as it was, and creates
    none."""
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.toml").write_text(to_toml(cfg))
    tokenizer.save(run_dir / "tokenizer")
