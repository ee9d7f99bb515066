"""Counting host synchronisations in a training step, on CPU.

A call that reads a tensor's value into Python — `.item()`, `.tolist()`, `bool(t)`, `float(t)`,
`int(t)`, `.cpu()` or a blocking `.to("cpu")` of a device tensor — waits, on a GPU, for every
kernel queued before it. On the CPU nothing waits, so these calls are counted instead: every one
made on the training thread, by any code but torch's own (torch's internals are what
`torch.cuda.set_sync_debug_mode` checks where CUDA exists), attributed to the optimizer step
being computed (`Telemetry.begin_step`).

    with HostSyncs(trainer) as syncs:
        trainer.fit()
    syncs.per_step()  # {step: [(file:line, method), ...]}
"""

from __future__ import annotations

import collections
import os
import sys
import threading
from pathlib import Path

import torch

_TORCH = str(Path(torch.__file__).parent) + os.sep
_METHODS = ("item", "tolist", "cpu", "__bool__", "__float__", "__int__", "to")


class HostSyncs:
    def __init__(self, trainer) -> None:
        self.trainer = trainer
        self.step = 0
        self.events: dict[int, list[tuple[str, str]]] = collections.defaultdict(list)
        self._thread = threading.get_ident()
        self._saved: dict[str, object] = {}

    def per_step(self) -> dict[int, list[tuple[str, str]]]:
        return {s: self.events.get(s, []) for s in range(1, self.step + 1)}

    def _record(self, name: str) -> None:
        if threading.get_ident() != self._thread:
            return
        frame = sys._getframe(2)
        if frame.f_code.co_filename.startswith(_TORCH):
            return
        self.events[self.step].append((f"{frame.f_code.co_filename}:{frame.f_lineno}", name))

    def _wrap(self, name: str):
        original = self._saved[name]
        syncs = self

        if name == "to":

            def to(tensor, *args, **kwargs):
                out = original(tensor, *args, **kwargs)
                moved = out.device != tensor.device
                if moved and out.device.type == "cpu" and not kwargs.get("non_blocking", False):
                    syncs._record("to")
                return out

            return to

        def method(tensor, *args, **kwargs):
            syncs._record(name)
            return original(tensor, *args, **kwargs)

        return method

    def __enter__(self) -> HostSyncs:
        self._own = {name for name in _METHODS if name in vars(torch.Tensor)}
        for name in _METHODS:
            self._saved[name] = getattr(torch.Tensor, name)
        for name in _METHODS:
            setattr(torch.Tensor, name, self._wrap(name))
        telemetry = self.trainer.telemetry
        begin = telemetry.begin_step

        def begin_step(step: int) -> None:
            self.step = step
            begin(step)

        telemetry.begin_step = begin_step
        return self

    def __exit__(self, *exc) -> None:
        for name, original in self._saved.items():
            if name in self._own:
                setattr(torch.Tensor, name, original)
            else:  # inherited from torch._C.TensorBase: uncover it again
                delattr(torch.Tensor, name)
        del self.trainer.telemetry.begin_step
