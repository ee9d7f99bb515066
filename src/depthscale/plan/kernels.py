"""Memory traffic of the attention core where its scores live in memory (no fused kernel).

Megatron-LM's `CoreAttention` without FlashAttention runs, per micro-batch and layer, one pass per
kernel over the b·heads·s·s score elements (e bytes each, the compute dtype):

    forward:   QKᵀ writes S (e) · fused scale-mask-softmax reads S, writes P (2e)
               · dropout reads P, writes P' and a one-byte mask (2e + 1) · PV reads P' (e)
    backward:  dO·Vᵀ writes dP' (e) · dV = P'ᵀ·dO reads P' (e)
               · dropout's backward reads dP' and the mask, writes dP (2e + 1)
               · softmax's backward reads dP and P, writes dS (3e) · dQ = dS·K, dK = dSᵀ·Q read dS (2e)

so 4e + 2e + 1 bytes per element forward and 7e + 2e + 1 backward with dropout (13 and 19 in
bf16), 4e and 7e without. `tests/unit/test_plan_kernels.py` counts the bytes every kernel of that
computation reads and writes (torch's dispatcher, op by op) and finds these numbers;
`benchmarks/attention_traffic.py` times it on this CPU across hidden sizes and micro-batches
against the charge. A fused kernel (FlashAttention) keeps the scores on chip: no such traffic.
"""

from __future__ import annotations

from dataclasses import dataclass

MASK_BYTES = 1
"""The dropout mask: one bool per score element (`torch.native_dropout`, the fused CUDA kernel)."""


@dataclass(frozen=True)
class UnfusedAttention:
    element: int = 2
    """Bytes of a score element: 2 in bf16/fp16, 4 in fp32."""
    dropout: bool = True
    """Attention dropout (GPT-3's runs: 0.1): its pass and its mask in both directions."""

    def _dropout(self) -> int:
        return 2 * self.element + MASK_BYTES if self.dropout else 0

    @property
    def forward_bytes(self) -> int:
        """Bytes read and written per score element in the forward."""
        return 4 * self.element + self._dropout()

    @property
    def backward_bytes(self) -> int:
        """Bytes read and written per score element in the backward."""
        return 7 * self.element + self._dropout()
