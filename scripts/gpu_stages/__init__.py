"""The stages of `scripts/gpu_check.py`, in the order they run: what pays most on a GPU comes first,
so a check cut short by its time budget still says the most.

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
    Stage("env", "env", "run", 40, 15, 120,
          "versions, device, SM count, SDPA backends, TF32 flags, copy and matmul ceilings"),
    Stage("calibrate", "calibrate", "run", 30, 10, 120,
          "GEMM curve, flash attention and HBM efficiencies as a cluster file for `plan`"),
    Stage("unit_tests", "unit_tests", "run", 120, 30, 240,
          "the kernel, attention and dispatch unit tests, run on CUDA"),
    Stage("kernels", "kernels", "run", 130, 30, 240,
          "Triton AttnRes kernels at production shapes against the PyTorch ops"),
    Stage("trainer", "trainer", "run_eager", 90, 30, 240,
          "4-layer llama-1b slice, bf16: standard, block and full residuals"),
    Stage("compiled", "trainer", "run_compiled", 160, 40, 300,
          "the same slice under torch.compile: first step, graph breaks, loss vs eager"),
    Stage("attention", "attention", "run", 45, 15, 180,
          "sliding window vs full causal, one ring tile vs flash, backends from the profiler"),
    Stage("offload", "offload", "run", 50, 15, 180,
          "activation offload under TORCH_CUDA_SANITIZER=1",
          env={"TORCH_CUDA_SANITIZER": "1"}),
    Stage("hf", "hf", "run", 50, 15, 180,
          "depthscale vs Hugging Face LlamaForCausalLM on the same weights"),
)  # fmt: skip

BY_NAME = {s.name: s for s in STAGES}
