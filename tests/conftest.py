import os

import pytest
import torch

# Tests run on 2 cores next to multi-process cases; keep intra-op threads modest and results deterministic.
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


@pytest.fixture(autouse=True)
def _isolated_cache(tmp_path_factory, monkeypatch):
    """Tokenizer/corpus caches go to a per-session temp dir, never the user's ~/.cache."""
    cache = tmp_path_factory.getbasetemp() / "depthscale-cache"
    monkeypatch.setenv("DEPTHSCALE_CACHE", str(cache))
    torch.manual_seed(0)
