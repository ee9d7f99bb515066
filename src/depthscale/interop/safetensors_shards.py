"""Weights as Hugging Face writes them: one `model.safetensors`, or, past a shard size, numbered
shards and the `model.safetensors.index.json` that maps every tensor to its file (what
`from_pretrained`, `hf-to-ds` and every Hub tool read), so a 70B export is not one 140 GB file."""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping
from pathlib import Path

from safetensors.torch import save_file
from torch import Tensor

from depthscale.errors import ConfigError

DEFAULT_SHARD_BYTES = 5 * 10**9
"""transformers' default for `save_pretrained` (max_shard_size="5GB")."""

_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20}
_UNITS |= {"GIB": 2**30}


def parse_size(text: str) -> int:
    """'5GB', '500MB', '2GiB' or a byte count → bytes (> 0)."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", text)
    unit = match and match[2].upper()
    if not match or unit not in _UNITS or float(match[1]) * _UNITS[unit] < 1:
        raise ConfigError(
            f"--max-shard-size {text!r} is not a size; allowed: a positive size such as 5GB, "
            "500MB, 2GiB or a byte count"
        )
    return int(float(match[1]) * _UNITS[unit])


def save_weights(
    tensors: Mapping[str, Tensor], path: Path, max_shard_bytes: int = DEFAULT_SHARD_BYTES
) -> list[str]:
    """Write `tensors` (contiguous CPU tensors, no two sharing storage) into `path`: one file when
    they fit in `max_shard_bytes`, else shards filled in name order, a tensor never split (one
    larger than the limit gets a shard of its own); returns the files written."""
    shards: list[dict[str, Tensor]] = [{}]
    size = 0
    for name in sorted(tensors):
        nbytes = tensors[name].numel() * tensors[name].element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = tensors[name]
        size += nbytes
    metadata = {"format": "pt"}
    if len(shards) == 1:
        _save(shards[0], path / "model.safetensors", metadata)
        return ["model.safetensors"]
    files = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    weight_map = {}
    for file, shard in zip(files, shards, strict=True):
        _save(shard, path / file, metadata)
        weight_map |= dict.fromkeys(shard, file)
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (path / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return [*files, "model.safetensors.index.json"]


def _save(tensors: Mapping[str, Tensor], file: Path, metadata: dict[str, str]) -> None:
    """`save_file`, then the mode every other file of the export gets (0666 less the umask):
    safetensors (0.8) creates its files 0600 whatever the umask, which left the weights unreadable
    to the group and others that can read the rest of the export."""
    save_file(tensors, file, metadata=metadata)
    os.chmod(file, 0o666 & ~_umask())


def _umask() -> int:
    """The process's umask, read without changing it where Linux says it (/proc; setting it to
    read it would briefly give files made by other threads another mode)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except OSError:
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask
