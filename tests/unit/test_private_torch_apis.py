"""The private torch APIs depthscale relies on, pinned: an upgrade that moves or changes one fails
here, in CI, with its name — not in a training run. Each entry says where it is used."""

from __future__ import annotations

import inspect

import torch

from depthscale.parallel.data_parallel import replicate_apis


def test_composable_replicate_apis():
    """parallel/data_parallel.apply_ddp: DDP's reducer on the module (plain parameters) and FSDP2's
    replicate (DTensor parameters), with the arguments it passes."""
    replicate, replicate_dtensor = replicate_apis()
    ddp = inspect.signature(replicate).parameters
    assert "ignored_modules" in ddp
    assert any(p.kind is inspect.Parameter.VAR_KEYWORD for p in ddp.values())  # process_group=
    fsdp = inspect.signature(replicate_dtensor).parameters
    assert {"mesh", "ignored_params"} <= set(fsdp)


def test_accumulate_grad_node_type():
    """train/memory.py: activation offload recognises parameters (and their autocast casts) by
    their AccumulateGrad node."""
    accumulate = torch._C._functions.AccumulateGrad
    w = torch.nn.Parameter(torch.ones(2))
    assert isinstance(w.to(torch.bfloat16).grad_fn.next_functions[0][0], accumulate)
