"""How a training system spends memory and overlaps communication: depthscale's own, and the two
systems of the published tables (Megatron-LM as Korthikanti et al. 2022 and MegaScale ran it)."""

from __future__ import annotations

from dataclasses import dataclass, replace


@dataclass(frozen=True)
class Framework:
    name: str
    weight_bytes: int
    """Bytes per parameter of the weights the forward reads (and the sharded copy FSDP keeps)."""
    grad_bytes: int
    master_bytes: int
    """fp32 master copy kept beside bf16 weights (0 when the weights are fp32 already)."""
    moment_bytes: int
    """Adam's two moments."""
    attention: str
    """'flash' (fused, causal tiles skipped) or 'unfused' (scores in memory, whole square)."""
    tp_overlap: bool
    pp_overlap: bool
    dp_overlap: bool
    ours: bool
    """depthscale's activation inventory and FSDP; else Megatron's Table 2 and ZeRO-1."""
    cp_overlap: bool = True
    """Ring attention's K/V rotation runs behind the attention of the block in hand."""
    reduce_bytes: int = 4
    """Bytes per gradient element the data-parallel reduction moves (reduce-scatter, all-reduce):
    4 for fp32, 2 for a bf16/fp16 reduction (`with_reduce_dtype`)."""
    attention_dropout: bool = False
    """Dropout on the attention probabilities (its traffic counts where scores live in memory:
    `plan.kernels`)."""
    frees_stage_outputs: bool = False
    """A pipeline stage frees its output's data once sent (Megatron's
    `deallocate_pipeline_outputs`); depthscale keeps a unit's outputs for its backward."""

    def with_reduce_dtype(self, dtype: str) -> Framework:
        """This framework reducing gradients in `dtype` ('float32' or 'bfloat16'). depthscale
        keeps fp32 gradients and casts for the reduction (FSDP's reduce_dtype); Megatron's
        gradient buffer is then bf16 too (no fp32 main gradients: `--accumulate-allreduce-grads-in-
        fp32` off), so its memory shrinks as well."""
        allowed = {"float32": 4, "bfloat16": 2}
        if dtype not in allowed:
            raise ValueError(f"gradient reduction dtype {dtype!r}; allowed: float32, bfloat16")
        grad = self.grad_bytes if self.ours else min(self.grad_bytes, allowed[dtype])
        return replace(self, reduce_bytes=allowed[dtype], grad_bytes=grad)


DEPTHSCALE = Framework("depthscale", 4, 4, 0, 8, "flash", True, True, True, True)
"""fp32 sharded weights under bf16 autocast (FSDP gathers bf16), fp32 gradients and moments;
TP all-gathers and reduce-scatters overlapped with the GEMMs, P2P posted ahead, FSDP prefetch."""
MEGATRON_2022 = Framework(
    "megatron",
    2,
    4,
    4,
    8,
    "unfused",
    False,
    False,
    False,
    False,
    cp_overlap=False,
    attention_dropout=True,
    frees_stage_outputs=True,
)
"""bf16 weights, fp32 main gradients, fp32 master weights and moments (18 B/param); softmax
over materialised scores, with GPT-3's attention dropout; no overlap of TP, PP or DP
communication with compute."""
MEGASCALE = Framework(
    "megascale", 2, 4, 4, 8, "flash", True, True, True, False, frees_stage_outputs=True
)
"""Megatron's memory with MegaScale's overlap of TP, PP and DP communication and fused kernels."""

FRAMEWORKS = {f.name: f for f in (DEPTHSCALE, MEGATRON_2022, MEGASCALE)}
