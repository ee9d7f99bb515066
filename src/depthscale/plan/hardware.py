"""Clusters the planner can plan for: GPU presets and the network between them.

Peaks are dense spec-sheet numbers (no sparsity). Bandwidths are per GPU and per direction:
NVLink within a node, the GPU's share of the inter-node fabric across nodes. `efficiency` terms
are what a well-tuned kernel or NCCL ring reaches of the peak; they are properties of the hardware
and libraries, the same for every model and layout (never fitted to a published row).
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

GiB = 2**30


@dataclass(frozen=True)
class Cluster:
    name: str
    peak_flops: dict[str, float]
    """Dense matmul FLOP/s by dtype ('bfloat16', 'float32')."""
    hbm_bytes: float
    hbm_bw: float
    """Device memory bytes/s."""
    gpus_per_node: int
    intra_bw: float
    """NVLink bytes/s per GPU per direction."""
    inter_bw: float
    """Inter-node bytes/s per GPU per direction."""
    intra_latency: float = 1e-6
    inter_latency: float = 2e-6
    """Per-step link latencies (Calculon's A100 system description)."""
    gemm_efficiency: float = 0.8
    """Fraction of peak a large GEMM reaches: cuBLAS's large bf16 GEMMs on an A100 run at about
    250 of 312 TFLOP/s. `benchmarks/plan_tables.py` shows the published tables at 0.75 and 0.85
    too."""
    gemm_half_dim: float = 96.0
    """A GEMM whose smallest dimension is this reaches half of `gemm_efficiency` (small shapes
    cannot fill the machine): efficiency = gemm_efficiency · x / (x + gemm_half_dim)."""
    attention_efficiency: float = 0.6
    """Fused (flash) attention's fraction of peak."""
    memory_efficiency: float = 0.8
    """Fraction of HBM bandwidth elementwise kernels reach."""
    comm_efficiency: float = 0.8
    """Fraction of link bandwidth a NCCL ring reaches on large messages."""
    memory_reserve: float = 0.05
    """Device memory the allocator's fragmentation and the CUDA context take (fraction)."""
    collectives: dict[str, tuple[tuple[int, float, float], ...]] = field(default_factory=dict)
    """Measured (group size, latency s per call, payload bytes/s) of 'all_reduce', 'all_gather',
    'reduce_scatter' and 'p2p' (`--calibrate`); when given they replace the ring model below for
    that operation (the entry of the nearest group size)."""
    gemm_curve: tuple[tuple[float, float], ...] = ()
    """Measured (smallest dimension, fraction of peak) points (`depthscale plan --calibrate`);
    when given they replace the x / (x + gemm_half_dim) curve, interpolated in log x."""
    measured: tuple[str, ...] = ()
    """The efficiencies a calibration measured (a GPU run's `scripts/gpu_check.py` writes
    them); a measured GEMM curve or collectives count as measured anyway."""
    host_bw: float = 25e9
    """Device↔host bytes/s per GPU (PCIe 4/5 x16, the spec sheet's 32/64 GB/s at ~75 %):
    offloaded states, a snapshot's copy to host memory and a restore from it."""
    snapshot_bw: float = 2.85e9
    """Bytes of a rank's state per second of step time a snapshot costs (training's wait while
    its state is copied into the writer's staging buffer); the planner uses min(this, host_bw).
    Measured: 0.52 GB per rank in a median 0.18 s (benchmarks/results/recovery_cpu_2026-12-07.json,
    the 2-core CPU box). The writer's own copying, hashing and writing run on host cores a GPU
    step leaves idle; on that box they took the training ranks' cores (its JSON has that cost)."""
    memory_read_bw: float = 0.34e9
    """Bytes/s per rank a restart reads a snapshot back at, verification included (rank 0 hashes
    the version before any rank loads it; then the copy to the device at host_bw). Measured: the
    checkpoint_load phase, 0.52 GB per rank in 1.53 s (recovery_cpu_2026-12-07.json)."""
    storage_bw: float = 2e12 / 16384
    """Shared file system bytes/s per GPU for checkpoints: Llama 3's (arXiv 2407.21783 §3.3.1)
    Tectonic sustains 2 TB/s (7 TB/s peak) for its 16,384 GPUs, ~122 MB/s each."""
    verify_bw: float = 1e9
    """SHA-256 bytes/s of one process: a restore verifies each file of its checkpoint before any
    load (rank 0 alone, the whole checkpoint). ~1.0-1.1 GB/s measured on the 2-core x86 box."""
    restart_s: float = 9.6
    """Fault → restarted workers ready to read their state (detection, stop, relaunch, imports,
    data, model, process groups): what a restart costs besides the state's bytes and one step.
    Measured: a 1 GB model's restarts on the 2-core CPU box (recovery_cpu_2026-12-07.json, the
    mean of its two); GPU jobs add CUDA and NCCL start-up."""

    def peak(self, dtype: str) -> float:
        return self.peak_flops.get(dtype) or self.peak_flops["float32"]

    def efficiencies(self) -> dict[str, dict[str, float | str]]:
        """Each efficiency the estimates use, its value and where it comes from: 'measured' (a
        calibration: `depthscale plan --calibrate`, or a GPU run's preset) or 'assumed' (a
        number from the literature, not measured on this hardware). `plan` prints both."""
        measured = {
            "gemm_efficiency": bool(self.gemm_curve),
            "comm_efficiency": bool(self.collectives),
            "attention_efficiency": False,
            "memory_efficiency": False,
        }
        measured = {k: m or k in self.measured for k, m in measured.items()}
        return {
            name: {"value": getattr(self, name), "source": "measured" if m else "assumed"}
            for name, m in measured.items()
        }

    def gemm_flops(self, dtype: str, smallest_dim: float) -> float:
        """Achieved FLOP/s of a GEMM whose smallest dimension is `smallest_dim`."""
        x = max(smallest_dim, 1.0)
        if self.gemm_curve:
            return self.peak(dtype) * _interpolate(self.gemm_curve, x)
        return self.peak(dtype) * self.gemm_efficiency * x / (x + self.gemm_half_dim)

    def usable_bytes(self) -> float:
        return self.hbm_bytes * (1 - self.memory_reserve)

    def link(self, group: int, span_nodes: bool) -> tuple[float, float]:
        """(bytes/s, latency) of a ring over `group` ranks, inside a node or across nodes."""
        if span_nodes:
            return self.inter_bw * self.comm_efficiency, self.inter_latency
        return self.intra_bw * self.comm_efficiency, self.intra_latency

    def op_time(self, op: str, payload: float, n: int, span_nodes: bool, calls: float = 1) -> float:
        """Seconds of `calls` collectives of kind `op` moving `payload` bytes in all over a
        group of `n` ranks: measured rates where calibrated, else a ring — an all-gather or
        reduce-scatter puts (n−1)/n of its payload on the wire in n−1 steps, an all-reduce twice
        that, an all-to-all (n−1)/n in one (each peer's share at once), a send all of it in one."""
        if n <= 1 or payload <= 0:
            return 0.0
        if op in self.collectives:
            _, latency, bw = min(self.collectives[op], key=lambda e: abs(e[0] - n))
            return calls * latency + payload / bw
        factor, steps = {
            "all_reduce": (2 * (n - 1) / n, 2 * (n - 1)),
            "all_gather": ((n - 1) / n, n - 1),
            "reduce_scatter": ((n - 1) / n, n - 1),
            "all_to_all": ((n - 1) / n, 1),  # every peer's share posted at once
            "p2p": (1.0, 1),
        }[op]
        bw, lat = self.link(n, span_nodes)
        return factor * payload / bw + calls * steps * lat

    def to_json(self) -> dict:
        return asdict(self)


def _interpolate(points: tuple[tuple[float, float], ...], x: float) -> float:
    pts = sorted(points)
    if x <= pts[0][0]:
        return pts[0][1]
    for (x0, y0), (x1, y1) in zip(pts, pts[1:]):
        if x <= x1:
            t = (math.log(x) - math.log(x0)) / (math.log(x1) - math.log(x0))
            return y0 + t * (y1 - y0)
    return pts[-1][1]


_GB = 1e9

PRESETS: dict[str, Cluster] = {
    # Selene / MegaScale-era A100 SXM 80 GB: NVLink 3 (300 GB/s per direction), 8× HDR 200 Gb/s
    # per node (25 GB/s per GPU).
    "a100": Cluster(
        "a100",
        {"bfloat16": 312e12, "float32": 19.5e12, "tf32": 156e12},
        80 * GiB,
        2.039e12,
        8,
        300 * _GB,
        25 * _GB,
    ),
    # H100 SXM 80 GB: NVLink 4 (450 GB/s per direction), 8× NDR 400 Gb/s per node (50 GB/s).
    # Large bf16 GEMMs reach ~700 of 989 TFLOP/s: not yet measured here (the GPU issue will).
    "h100": Cluster(
        "h100",
        {"bfloat16": 989e12, "float32": 67e12, "tf32": 494.5e12},
        80 * GiB,
        3.35e12,
        8,
        450 * _GB,
        50 * _GB,
        gemm_efficiency=0.72,
    ),
    # H200 SXM 141 GB: the H100's compute and links, more and faster memory.
    "h200": Cluster(
        "h200",
        {"bfloat16": 989e12, "float32": 67e12, "tf32": 494.5e12},
        141e9,
        4.8e12,
        8,
        450 * _GB,
        50 * _GB,
        gemm_efficiency=0.72,
    ),
}


def cluster(name: str) -> Cluster:
    """A preset by name, or a JSON file written by `depthscale diagnose --calibrate`."""
    key = name.lower()
    if key in PRESETS:
        return PRESETS[key]
    path = Path(name)
    if path.suffix == ".json" and path.is_file():
        return load_cluster(path)
    allowed = ", ".join(sorted(PRESETS))
    raise ValueError(
        f"unknown cluster {name!r}; allowed: {allowed}, or a calibration JSON file "
        "(depthscale plan --calibrate OUT.json --nproc N)"
    )


def load_cluster(path: Path) -> Cluster:
    """A cluster from a JSON file (`depthscale plan --calibrate` writes one); ValueError naming
    the file and what is wrong with it."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: not a readable JSON cluster description ({e})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: a cluster description is a JSON object")
    fields = {k: v for k, v in data.items() if k in Cluster.__dataclass_fields__}
    peaks = fields.get("peak_flops")
    if (
        not isinstance(peaks, dict)
        or not peaks
        or not all(isinstance(v, int | float) and v > 0 for v in peaks.values())
    ):
        raise ValueError(f"{path}: peak_flops must map dtypes to FLOP/s > 0, got {peaks!r}")
    for name in ("hbm_bytes", "hbm_bw", "gpus_per_node", "intra_bw", "inter_bw"):
        value = fields.get(name)
        if not isinstance(value, int | float) or value <= 0:
            raise ValueError(f"{path}: {name} must be a number > 0, got {value!r}")
    try:
        if "collectives" in fields:
            fields["collectives"] = {
                k: tuple(tuple(e) for e in v) for k, v in fields["collectives"].items()
            }
        if "gemm_curve" in fields:
            fields["gemm_curve"] = tuple(tuple(p) for p in fields["gemm_curve"])
        if "measured" in fields:
            fields["measured"] = tuple(fields["measured"])
        return Cluster(**fields)
    except (TypeError, AttributeError) as e:
        raise ValueError(f"{path}: not a cluster description ({e})") from None
