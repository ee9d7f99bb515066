"""A layout: how a job's GPUs and its batch are cut, and the policies it trains with."""

from __future__ import annotations

import functools
from dataclasses import asdict, dataclass, fields, replace
from typing import TYPE_CHECKING

from depthscale.plan.activations import RECOMPUTE_MODES
from depthscale.shape import Degrees

if TYPE_CHECKING:
    from depthscale.config import Config


@dataclass(frozen=True)
class Layout:
    tp: int = 1
    pp: int = 1
    v: int = 1
    """Virtual pipeline stages per rank (interleaved 1F1B when > 1)."""
    cp: int = 1
    dp_shard: int = 1
    """FSDP: parameters, gradients and optimizer states sharded over dp_shard × cp (ZeRO-3)."""
    dp_replicate: int = 1
    micro_batch: int = 1
    recompute: str = "none"
    cache: bool = True
    """The AttnRes cross-stage cache (pipelines of Block AttnRes)."""
    offload: bool = False
    """FSDP CPU offload of parameters, gradients and optimizer states."""
    zero1: bool = False
    """Megatron's distributed optimizer: fp32 master weights and moments sharded over dp (the
    published GPT rows); ours shards everything with dp_shard instead."""
    zero3: bool = False
    """Pipelines under FSDP: gather each unit again for every micro-batch's forward and backward
    (`parallel.fsdp_reshard_after_forward = true`) instead of keeping a stage's gathered weights
    for the step (the default): less memory, 2·M gathers per step instead of one."""
    ep: int = 1
    """Expert parallelism: MoE experts split over groups of ep dp_shard ranks (`parallel.ep`)."""
    ends: int = 0
    """Layers the first and last pipeline stage hold fewer than the others
    (`parallel.pp_ends_fewer_layers`): they also run the embedding and the head."""
    ulysses: int = 1
    """Ulysses degree of cp (`parallel.cp_ulysses`): 1 a ring, cp Ulysses, between the hybrid
    (last: the search builds layouts by position)."""

    @functools.cached_property
    def degrees(self) -> Degrees:
        """The parallel degrees alone: what shape/ derives from them (world, dp, shards, expert
        mesh) and the rules they obey, as the runtime reads them. Cached: the planner asks for
        them per parameter and rank (a frozen layout's degrees never change)."""
        return Degrees.of(self)

    @property
    def dp(self) -> int:
        return self.degrees.dp

    @property
    def world(self) -> int:
        return self.degrees.world_size

    @property
    def expert_shard(self) -> int:
        """Ranks FSDP shards an expert-parallel rank's experts over (`Degrees.expert_shard`)."""
        return self.degrees.expert_shard

    @property
    def shard(self) -> int:
        """Ranks the model states are sharded over (FSDP shards over dp_shard × cp)."""
        return self.degrees.shard

    def label(self) -> str:
        parts = [f"tp={self.tp}", f"pp={self.pp}"]
        if self.v > 1:
            parts.append(f"v={self.v}")
        if self.cp > 1:
            parts.append(f"cp={self.cp}")
        if self.ulysses > 1:
            parts.append(f"ulysses={self.ulysses}")
        if self.dp_shard > 1:
            parts.append(f"fsdp={self.dp_shard}")
        if self.dp_replicate > 1:
            parts.append(f"dp={self.dp_replicate}")
        parts.append(f"mb={self.micro_batch}")
        if self.recompute != "none":
            parts.append(f"rc={self.recompute}")
        if self.offload:
            parts.append("offload")
        if not self.cache:
            parts.append("no-cache")
        if self.zero3:
            parts.append("zero3")
        if self.ep > 1:
            parts.append(f"ep={self.ep}")
        if self.ends:
            parts.append(f"ends={self.ends}")
        return ",".join(parts)

    def to_json(self) -> dict:
        return asdict(self)

    def with_(self, **changes) -> Layout:
        return replace(self, **changes)


_ALIASES = {
    "cp_ulysses": "ulysses",
    "fsdp": "dp_shard",
    "dp": "dp_replicate",
    "mb": "micro_batch",
    "rc": "recompute",
}
_INT = {f.name for f in fields(Layout) if f.type in ("int", int)}
_BOOL = {"cache", "offload", "zero1", "zero3"}


def parse_layout(text: str) -> Layout:
    """'tp=8,pp=8,v=6,fsdp=4,mb=1,recompute=selective,cache=off' → Layout. Raises ValueError
    naming the key or value that is wrong and what is allowed."""
    values: dict = {}
    allowed = sorted({f.name for f in fields(Layout)} | set(_ALIASES))
    for item in filter(None, (p.strip() for p in text.split(","))):
        key, sep, raw = item.partition("=")
        key = _ALIASES.get(key.strip().lower(), key.strip().lower())
        raw = raw.strip()
        if not sep or key not in {f.name for f in fields(Layout)}:
            raise ValueError(f"--layout: {item!r} is not KEY=VALUE with KEY one of {allowed}")
        if key in _BOOL:
            if raw.lower() not in ("on", "off", "true", "false", "1", "0"):
                raise ValueError(f"--layout: {key}={raw!r}; allowed: on, off")
            values[key] = raw.lower() in ("on", "true", "1")
        elif key == "recompute":
            if raw not in RECOMPUTE_MODES:
                raise ValueError(f"--layout: recompute={raw!r}; allowed: {RECOMPUTE_MODES}")
            values[key] = raw
        else:
            if not raw.isdigit() or int(raw) < 1:
                raise ValueError(f"--layout: {key}={raw!r} must be an integer >= 1")
            values[key] = int(raw)
    return Layout(**values)


_PARALLEL_SIZES = {
    "tp": "tp",
    "pp": "pp",
    "pp_virtual": "v",
    "cp": "cp",
    "cp_ulysses": "ulysses",
    "dp_shard": "dp_shard",
    "dp_replicate": "dp_replicate",
    "ep": "ep",
    "pp_ends_fewer_layers": "ends",
}
"""parallel.<key> → the Layout field it takes its size from."""


def train_flags(lay: Layout, cfg: Config) -> list[str]:
    """The `depthscale train` overrides that turn `cfg` into this layout: each parallel size,
    micro-batch and memory setting that differs from the config's own, so a config that already
    sets one (say parallel.tp = 2) is overridden where the layout differs, and nothing else is."""
    p, t = cfg.parallel, cfg.train
    wanted = {f"parallel.{k}": getattr(lay, f) for k, f in _PARALLEL_SIZES.items()}
    wanted |= {
        "train.micro_batch_size": lay.micro_batch,
        "train.recompute": lay.recompute,
        "train.offload_params": lay.offload,
    }
    if lay.zero3:
        wanted["parallel.fsdp_reshard_after_forward"] = True
    have = {f"parallel.{k}": getattr(p, k) for k in _PARALLEL_SIZES}
    have |= {
        "train.micro_batch_size": t.micro_batch_size,
        "train.recompute": t.recompute,
        "train.offload_params": t.offload_params,
        "parallel.fsdp_reshard_after_forward": p.fsdp_reshard_after_forward,
    }
    flags: list[str] = []
    for key, value in wanted.items():
        if have[key] != value:
            flags += [f"--{key}", str(value).lower() if isinstance(value, bool) else str(value)]
    return flags
