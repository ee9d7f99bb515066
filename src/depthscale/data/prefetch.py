"""Prepare the next batches in a background thread (MegaScale's asynchronous data preprocessing), so
the training loop never waits on gathering and copying windows.

The loader's position must match what training has consumed, not what was prefetched: each queued
batch carries the loader state right after it, and `state_dict()` is the state after the last batch
handed out. Resuming from it replays exactly the batches that were prefetched but never trained on.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterable
from typing import Any

import torch

from depthscale.data.stream import Batch, BatchStream, Position


class Prefetcher:
    def __init__(
        self,
        loader: BatchStream,
        rank: int = 0,
        world: int = 1,
        depth: int = 2,
        pin: bool = False,
        device_index: int | None = None,
    ) -> None:
        """`pin`: batches come in page-locked memory (training on a GPU), so that the training
        thread's copy to the device is asynchronous (`non_blocking=True`). `device_index`: the
        rank's GPU, made current in the thread before it pins: pinning touches CUDA, and a new
        thread's current device is 0, so every rank would open a context (~0.5 GB) on GPU 0."""
        self.loader, self.rank, self.world, self.depth = loader, rank, world, depth
        self.pin, self.device_index = pin, device_index
        self._state = loader.state_dict()
        self.position: Position | None = None
        """The data position of the batch handed out last."""
        self._start()

    def _start(self) -> None:
        self._closed = False
        self._queue: queue.Queue = queue.Queue(maxsize=self.depth)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._fill, daemon=True)
        self._thread.start()

    def _fill(self) -> None:
        try:
            if self.pin and self.device_index is not None:
                torch.cuda.set_device(self.device_index)
            while not self._stop.is_set():
                batch = self.loader.next_batch(self.rank, self.world)
                if self.pin:
                    batch = Batch(batch.inputs.pin_memory(), batch.labels.pin_memory())
                item = (batch, self.loader.state_dict(), self.loader.position)
                while not self._stop.is_set():
                    try:
                        self._queue.put(item, timeout=0.1)
                        break
                    except queue.Full:
                        continue
        except BaseException as err:  # surfaced on the training thread by next_batch
            self._queue.put(err)

    def next_batch(self) -> Batch:
        if self._closed:  # a later `fit` on the same trainer: resume where training left off
            self.loader.load_state_dict(self._state)
            self._start()
        item = self._queue.get()
        if isinstance(item, BaseException):
            raise item
        batch, self._state, self.position = item
        return batch

    def state_dict(self) -> dict[str, Any]:
        return dict(self._state)

    def metrics(self) -> dict[str, float]:
        """The stream's own metrics at the position training consumed (a mixture's tokens and
        epochs per source; none for one stream)."""
        return self.loader.metrics(self._state)

    def exclude(self, positions: Iterable[Position]) -> None:
        """Never serve the batches at `positions` (`BatchStream.exclude`)."""
        self.loader.exclude(positions)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.close()
        self.loader.load_state_dict(state)
        self._state = self.loader.state_dict()
        self._start()

    def close(self) -> None:
        """Stop the thread; batches prefetched and not handed out are dropped (the next
        `next_batch` starts again from the position consumed)."""
        self._stop.set()
        self._thread.join()
        self._closed = True
