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
