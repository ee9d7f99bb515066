"""The stages of `scripts/gpu_check.py`, in the order they run: what pays most on a GPU comes first,
so a check cut short by its time budget still says the most. Their limits add up to
`sum(s.timeout_s for s in STAGES)` = 420 s, 50 s inside the check's 470-second budget (each stage's
process start and imports come out of its own limit); `--dry-run` prints them.

This module imports nothing heavy: the driver reads the list without importing torch, and each
stage's module (`gpu_stages.<module>`, with a `run(ctx)` function) is imported only inside the
subprocess that runs it.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Stage:
    name: str
    module: str
    """`gpu_stages.<module>.<function>(ctx)` runs the stage."""
    function: str
    timeout_s: float
    """Most seconds the stage may take on the GPU (its subprocess is killed after that)."""
    floor_s: float
    """Fewest seconds worth starting it with: the driver keeps this much of the budget for each
    stage still to come, and skips a stage that would get less."""
    dry_timeout_s: float
    """The same limit under --dry-run (CPU, tiny shapes, two shared cores)."""
    what: str
    env: dict[str, str] = field(default_factory=dict)
    """Extra environment of the stage's subprocess (set before torch is imported)."""


STAGES: tuple[Stage, ...] = (
    Stage("env", "env", "run", 20, 10, 120,
          "versions, device, SM count, SDPA backends, TF32 flags, copy and matmul ceilings"),
    Stage("kernels", "kernels", "run", 55, 20, 240,
          "Triton AttnRes kernels at production shapes against the PyTorch ops and the copy "
          "ceiling (goals), a read replayed under torch.cuda.graph"),
    Stage("llama1b", "llama1b", "run", 90, 30, 300,
          "the full 16-layer llama-1b compiled, standard then block: MFU, first-step seconds, "
          "block/standard step time (goals)"),
    Stage("loss", "loss", "run", 110, 40, 300,
          "a ~100M model, block vs standard residual at equal tokens: the loss (goal: block no "
          "worse)"),
    Stage("trainer", "trainer", "run", 30, 15, 240,
          "Trainer.fit on a 4-layer llama-1b slice: host vs device ms per step, kernel launches "
          "per layer, two runs bitwise equal"),
    Stage("world1", "world1", "run", 25, 10, 180,
          "a one-rank process group: ring attention at cp = 1 vs one SDPA call (goal), "
          "split_group, a p2p self-loop, the flight recorder's dump parsed"),
    Stage("attention", "attention", "run", 20, 10, 180,
          "sliding window vs full causal, one ring tile vs flash, backends from the profiler"),
    Stage("offload", "offload", "run", 15, 8, 180,
          "activation offload under TORCH_CUDA_SANITIZER=1",
          env={"TORCH_CUDA_SANITIZER": "1"}),
    Stage("calibrate", "calibrate", "run", 15, 8, 120,
          "GEMM curve, flash attention and HBM efficiencies as a cluster file for `plan`"),
    Stage("unit_tests", "unit_tests", "run", 25, 10, 240,
          "the unit tests marked cuda (no AOT or C++ CPU kernel tests)"),
    Stage("hf", "hf", "run", 15, 8, 180,
          "depthscale vs Hugging Face LlamaForCausalLM on the same weights"),
)  # fmt: skip

BY_NAME = {s.name: s for s in STAGES}
