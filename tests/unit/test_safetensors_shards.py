"""The weights files of an export get the mode the rest of the export gets (0666 less the umask),
one file or shards, whatever safetensors creates them with."""

from __future__ import annotations

import os
import stat

import pytest
import torch

from depthscale.interop.safetensors_shards import save_weights


@pytest.mark.parametrize("umask", [0o022, 0o027])
@pytest.mark.parametrize("shard_bytes", [10**9, 64])  # one model.safetensors; three shards
def test_weights_files_respect_the_umask_as_the_other_files_do(tmp_path, umask, shard_bytes):
    tensors = {name: torch.zeros(16) for name in ("a", "b", "c")}  # 64 bytes each
    old = os.umask(umask)
    try:
        files = save_weights(tensors, tmp_path, shard_bytes)
        (tmp_path / "config.json").write_text("{}\n")  # as the export's other files are written
    finally:
        os.umask(old)
    assert len(files) == (1 if shard_bytes > 10**6 else 4)
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in tmp_path.iterdir()}
    assert modes == dict.fromkeys([*files, "config.json"], 0o666 & ~umask)
