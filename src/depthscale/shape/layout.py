"""What a layout *is*, torch-free: every parallel degree (expert parallelism included), the rules
they obey, the ranks they group and the shapes of the meshes built from them. `parallel/mesh.py`
and `parallel/expert_parallel.py` build their process groups from these shapes, `plan/` prices
them, and the config checks raise these rules' errors — one statement each (torchtitan's
`ParallelDims` is the model: one object holds every degree, validates them and derives the rest).

The dense mesh lays the world out row-major over `MESH_DIMS`: tp innermost (adjacent ranks, the
fastest links: TP stays inside a node), then cp, then the data-parallel dimensions, pp outermost,
as Megatron and MegaScale do. Expert parallelism is a slice of dp_shard, not a dimension of its
own: an ep group is `ep` consecutive dp_shard ranks, so dp_shard splits into (dp_shard / ep, ep).
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from depthscale.errors import ConfigError
from depthscale.shape.model import EXPERTS_KEY

MESH_DIMS = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
"""The dense mesh's dimensions, outermost first."""

EXPERT_SHARD_DIM = 1
"""The dimension of an expert weight [E/ep, in, out] FSDP shards over the ranks holding the same
experts: dim 0 already holds ep's split, and a second split of it would be strided
(`_StridedShard`), which resharding checkpoints across ep handles less well than two plain
shards. The runtime (`parallel/expert_parallel.py`) shards on it and the planner
(`plan/states.py`) counts shards on it."""


@dataclass(frozen=True)
class Degrees:
    """The parallel degrees of a job. Positional order is `MESH_DIMS`, then ep."""

    pp: int = 1
    dp_replicate: int = 1
    dp_shard: int = 1
    cp: int = 1
    tp: int = 1
    ep: int = 1
    """Expert parallelism: MoE experts split over groups of ep dp_shard ranks."""

    @classmethod
    def of(cls, sizes) -> Degrees:
        """The degrees of anything carrying them by name (`config.ParallelConfig`, a plan
        `Layout`)."""
        return cls(*(getattr(sizes, f.name) for f in fields(cls)))

    @property
    def world_size(self) -> int:
        return self.pp * self.dp_replicate * self.dp_shard * self.cp * self.tp

    @property
    def dp(self) -> int:
        """Ranks that see different samples of the global batch."""
        return self.dp_replicate * self.dp_shard

    @property
    def shard(self) -> int:
        """Ranks FSDP shards the model states over: dp_shard × cp (cp ranks hold the same
        parameters)."""
        return self.dp_shard * self.cp

    @property
    def expert_shard(self) -> int:
        """Ranks FSDP shards an expert-parallel rank's experts over: the (dp_shard / ep) × cp
        ranks of its replica holding the same experts (1 without ep: nothing to shard over)."""
        return self.dp_shard // self.ep * self.cp if self.ep > 1 else 1

    @property
    def mesh_shape(self) -> tuple[int, ...]:
        """The dense mesh's sizes over `MESH_DIMS`."""
        return tuple(getattr(self, name) for name in MESH_DIMS)

    @property
    def expert_mesh_shape(self) -> tuple[int, int, int, int, int, int]:
        """The world as (pp, dp_replicate, dp_shard / ep, ep, cp, tp): the dense mesh with
        dp_shard cut into ep groups of consecutive ranks."""
        return (self.pp, self.dp_replicate, self.dp_shard // self.ep, self.ep, self.cp, self.tp)

    def coordinates(self, rank: int) -> dict[str, int]:
        """Where global `rank` sits: {"pp", "dp", "cp", "tp"}, dp flattening dp_replicate ×
        dp_shard (the mesh lays ranks out row-major over `MESH_DIMS`)."""
        index = {}
        for name in reversed(MESH_DIMS):
            rank, index[name] = divmod(rank, getattr(self, name))
        dp = index["dp_replicate"] * self.dp_shard + index["dp_shard"]
        return {"pp": index["pp"], "dp": dp, "cp": index["cp"], "tp": index["tp"]}

    def sizes(self) -> dict[str, int]:
        """The degrees coordinates range over: {"pp", "dp", "cp", "tp"}."""
        return {"pp": self.pp, "dp": self.dp, "cp": self.cp, "tp": self.tp}

    def expert_shard_rank(self, shard_rank: int) -> int:
        """A rank's index in its expert shard group, from its index in dp_shard × cp (dp_shard
        outer): the ep groups of dp_shard are consecutive ranks, the group takes one of each."""
        dp_shard_rank, cp_rank = divmod(shard_rank, self.cp)
        return dp_shard_rank // self.ep * self.cp + cp_rank

    @property
    def seq_multiple(self) -> int:
        """What every sequence is padded to a multiple of: 2·cp under context parallelism (the
        zigzag layout cuts it in 2·cp chunks), else 1."""
        return 2 * self.cp if self.cp > 1 else 1

    def padded_seq(self, seq_len: int) -> int:
        """`seq_len` rounded up to `seq_multiple`."""
        m = self.seq_multiple
        return -(-seq_len // m) * m

    # -- rules ----------------------------------------------------------------------------------

    def check(self, world_size: int | None = None) -> Degrees:
        """Every degree >= 1 and, given the world size, their product equal to it."""
        for f in fields(self):
            if getattr(self, f.name) < 1:
                raise ConfigError(f"parallel.{f.name}={getattr(self, f.name)} must be >= 1")
        if world_size is not None and self.world_size != world_size:
            layout = " × ".join(f"{name}={getattr(self, name)}" for name in MESH_DIMS)
            raise ConfigError(
                f"parallel layout {layout} needs {self.world_size} processes but the world "
                f"size is {world_size}; allowed: degrees whose product is {world_size}"
            )
        return self

    def expert_rule(self, n_experts: int) -> str:
        """What is wrong with ep for a model of `n_experts` routed experts per MoE layer (0:
        dense), or "": ep is a slice of dp_shard over which the experts split evenly."""
        ep = self.ep
        if ep > 1 and n_experts == 0:
            return f"parallel.ep={ep} needs an MoE model ({EXPERTS_KEY} > 0)"
        if self.dp_shard % ep:
            return (
                f"parallel.ep={ep} must divide parallel.dp_shard={self.dp_shard} (expert "
                "parallelism is a slice of the data-parallel dimension)"
            )
        if n_experts and n_experts % ep:
            return (
                f"parallel.ep={ep} must divide {EXPERTS_KEY}={n_experts} (each rank holds an "
                "equal share of the experts)"
            )
        return ""

    def check_experts(self, n_experts: int) -> None:
        """`expert_rule` as a ConfigError."""
        if error := self.expert_rule(n_experts):
            raise ConfigError(error)
