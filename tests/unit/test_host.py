"""Process-level settings of the trainer (train/host.py)."""

import resource

import pytest
import torch

from depthscale.train.host import keep_freed_host_memory


def _faults_of(fn) -> int:
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    fn()
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before


def test_freed_host_memory_is_reused_without_page_faults():
    """After keep_freed_host_memory, a step-like round (allocate activation-sized buffers, touch
    them, free them all) reuses the pages the previous round freed: a few faults at most, where
    glibc's defaults fault every 4 KiB page again each round (~16k here)."""
    if not keep_freed_host_memory():
        pytest.skip("not glibc: mallopt unavailable")

    def step() -> None:
        bufs = [torch.empty(1 << 20) for _ in range(16)]  # 16 x 4 MiB of float32
        for b in bufs:
            b.fill_(1.0)  # touch every page
        del bufs

    step()
    step()  # the first rounds fault the pages in once
    assert _faults_of(step) < 2000


_ALLOCATOR_PROBE = """
import os, torch
from depthscale.train.host import expandable_segments
def case(kind, **env):
    os.environ.pop("PYTORCH_ALLOC_CONF", None)
    os.environ.pop("PYTORCH_CUDA_ALLOC_CONF", None)
    os.environ.update(env)
    applied = expandable_segments(kind)
    print(applied, repr(torch._C._accelerator_getAllocatorSettings()), os.environ.get("PYTORCH_ALLOC_CONF"))
case("cpu")
case("cuda", PYTORCH_ALLOC_CONF="max_split_size_mb:256")
case("cuda", PYTORCH_CUDA_ALLOC_CONF="max_split_size_mb:256")
case("cuda")
case("cuda")  # settings made in the process already
"""


def test_expandable_segments_on_cuda_unless_the_user_configured_the_allocator():
    """On CUDA the allocator gets expandable segments (torch's own setter takes the string, and the
    variable is set for child processes); never on CPU; never over a user's variable, old name or
    new, nor over settings made in the process already. A fresh process: the allocator's settings
    are process-wide."""
    import os
    import subprocess
    import sys

    from depthscale.train.host import ALLOC_ENV

    environ = {k: v for k, v in os.environ.items() if k not in ALLOC_ENV}
    cmd = [sys.executable, "-c", _ALLOCATOR_PROBE]
    out = subprocess.run(cmd, env=environ, capture_output=True, text=True, check=True).stdout
    assert out.splitlines() == [
        "False '' None",
        "False '' max_split_size_mb:256",
        "False '' None",
        "True 'expandable_segments:True' expandable_segments:True",
        "False 'expandable_segments:True' None",
    ]


def test_expandable_segments_keeps_settings_made_in_the_process(monkeypatch):
    import torch

    from depthscale.train import host

    for name in host.ALLOC_ENV:
        monkeypatch.delenv(name, raising=False)
    calls = []
    made = "pinned_use_cuda_host_register:True"
    monkeypatch.setattr(torch._C, "_accelerator_getAllocatorSettings", lambda: made)
    monkeypatch.setattr(torch._C, "_accelerator_setAllocatorSettings", calls.append)
    assert host.expandable_segments("cuda") is False and calls == []
