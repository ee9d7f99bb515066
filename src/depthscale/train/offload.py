"""Activation memory: offloading saved activations to host memory, and measuring what is kept.

Recomputation is a seam of the layer itself (`model/recompute.py`, `Transformer.set_recompute`),
set before the model is sharded.

Offloading moves the activations autograd saves for backward to host memory while a microbatch
waits for its backward (pipeline in-flight microbatches) and brings them back ahead of use, both
copies on side CUDA streams. Parameters (and their casts) and tiny tensors stay. On a CPU-only run
the copy is a no-op, but the classification, ordering and byte accounting are the same.

A tensor saved several times is moved once. Block AttnRes saves every completed block sum again at
each later block's phase-1 read, so a block went to host memory and back about once per later
block (N times for the first of N); saves of one storage, view and version now share one host copy,
and its copy back stays on the device from its first use in backward to its last.

Host copies are regions of pinned slabs of exact size reused every step (`pinned_pool.py`), not
one pinned allocation per tensor, which torch's host allocator rounds up to a power of two.
"""

from __future__ import annotations

import contextlib
import math
import weakref
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, fields

import torch

from depthscale.train.pinned_pool import PinnedPool

DEFAULT_MIN_BYTES = 64 * 1024
"""Saved device tensors smaller than this stay on the device. Each offloaded tensor costs a region
of a pinned slab (`pinned_pool.py`), two copy launches, two events and a stream wait: some tens of microseconds whatever
its size, about the time PCIe takes to move 64 KiB. Below that the fixed cost dominates and the
device memory given back is negligible. CPU tensors are never copied, so by default none is tiny."""

DEFAULT_PREFETCH = 2
"""How many offloaded tensors backward brings back ahead of use when the number of layers is not
given: enough to hide one copy behind the node that runs before it. Given the layers a forward ran
(`offload_activations(layers=)`), backward brings back one layer's worth ahead (the forward's
offloaded tensors / its layers): the next layer's copies run behind this layer's backward."""


@dataclass
class OffloadStats:
    """What the pack hook did with each tensor saved for backward. `tensors`/`bytes` are the ones
    moved to host memory (the trainer logs `bytes` as `offloaded_mb`); the others stayed where they
    were, by reason. `prefetch_hits` counts unpacks whose copy back was already under way."""

    tensors: int = 0
    bytes: int = 0
    param_tensors: int = 0
    param_bytes: int = 0
    """Parameters, their views and autocast casts: weight-sized, and a parameter lives anyway."""
    tiny_tensors: int = 0
    tiny_bytes: int = 0
    """Below `min_bytes`: the per-copy overhead would dominate."""
    shared_tensors: int = 0
    shared_bytes: int = 0
    """Saves of a tensor already moved (same storage, view and version): they share its host copy,
    so `bytes` is what crossed to the host once."""
    prefetch_hits: int = 0
    prefetch_misses: int = 0

    def reset(self) -> None:
        for f in fields(self):
            setattr(self, f.name, 0)


_AccumulateGrad = torch._C._functions.AccumulateGrad


def _is_parameter(t: torch.Tensor, exclude: set[int]) -> bool:
    """A parameter, a view of one, or an autocast dtype cast of one (grad_fn ToCopyBackward0 fed by
    the parameter's AccumulateGrad). `exclude` holds storage pointers of parameters that need no
    grad (frozen weights, which look like any other leaf). A few attribute reads per tensor."""
    base = t if t._base is None else t._base
    if base.is_leaf and base.requires_grad:
        return True
    fn = base.grad_fn
    if (
        fn is not None
        and type(fn).__name__ == "ToCopyBackward0"
        and isinstance(fn.next_functions[0][0], _AccumulateGrad)
    ):
        return True
    if exclude:
        try:
            return t.untyped_storage().data_ptr() in exclude
        except RuntimeError:  # a wrapper subclass (DTensor) has no storage of its own
            return False
    return False


class _Offloaded:
    """One saved tensor in host memory, for `saves` saves of it. `stored` is the CUDA event after
    its copy out, `pending` its copy back to the device once started (kept until its last save is
    unpacked) and `ready` the event after that copy (events are None off CUDA; on CPU `host` is the
    tensor itself and so is its "copy"). `positions`: where its saves are in pack order."""

    __slots__ = (
        "device", "host", "stored", "positions", "saves", "unpacks", "pending", "ready",
        "__weakref__",
    )  # fmt: skip

    def __init__(
        self, device: torch.device, host: torch.Tensor, stored: torch.cuda.Event | None = None
    ) -> None:
        self.device, self.host, self.stored = device, host, stored
        self.positions: list[int] = []
        self.saves = self.unpacks = 0
        self.pending: torch.Tensor | None = None
        self.ready: torch.cuda.Event | None = None

    @property
    def used(self) -> bool:
        """Every save of it unpacked (a second backward, with retain_graph, fetches it again)."""
        return self.unpacks >= self.saves

    def position(self) -> int:
        """The pack position of the save backward unpacks next: saves come back in reverse."""
        return self.positions[max(0, self.saves - 1 - self.unpacks)]


class _PackOrder:
    """Offloaded tensors in pack order, and which to bring back when backward unpacks one.

    Backward needs saved tensors roughly in reverse pack order, so on unpacking entry i the next
    ones it will want are i-1, i-2, ...: the `ahead` nearest that are still alive and not yet used
    are fetched now. Weak references only, so an entry dies with the graph node that saved it.
    No CUDA in here: it is unit-tested on CPU."""

    def __init__(self, ahead: int) -> None:
        self.ahead = ahead
        self._entries: list[weakref.ref[_Offloaded]] = []

    def add(self, entry: _Offloaded) -> None:
        """One save of `entry` (an entry saved again is added again)."""
        entry.positions.append(len(self._entries))
        entry.saves += 1
        self._entries.append(weakref.ref(entry))

    def to_fetch(self, entry: _Offloaded) -> list[_Offloaded]:
        """`entry` unless its copy is already under way, then the upcoming entries not yet fetched
        (each counted once, at its latest save before this one)."""
        out = [] if entry.pending is not None else [entry]
        seen = {id(entry)}
        i, window = entry.position() - 1, 0
        while i >= 0 and window < self.ahead:
            e = self._entries[i]()
            i -= 1
            if e is None or e.used or id(e) in seen:
                continue
            seen.add(id(e))
            window += 1
            if e.pending is None:
                out.append(e)
        return out


_side_streams: dict[tuple[torch.device, str], torch.cuda.Stream] = {}
_pools: dict[torch.device, PinnedPool] = {}


def _side_stream(device: torch.device, direction: str) -> torch.cuda.Stream:
    """One stream per device and direction, shared by every offload block: copies out (a forward)
    never queue behind copies in (a backward), which a pipeline schedule interleaves."""
    key = (device, direction)
    if key not in _side_streams:
        _side_streams[key] = torch.cuda.Stream(device=device)
    return _side_streams[key]


def _host_pool(device: torch.device) -> PinnedPool:
    """The pinned slabs copies out of `device` go to, one pool per device for the process's
    life (reused by every step); a region released after backward fences its slab with an event
    on the copy-in stream, which the next copy into the slab waits for."""
    if device not in _pools:

        def fence() -> torch.cuda.Event:
            event = torch.cuda.Event()
            event.record(_side_stream(device, "in"))
            return event

        _pools[device] = PinnedPool(fence=fence)
    return _pools[device]


class _Offloader:
    """The pack/unpack hooks. On CUDA the copies run on side streams: device to pinned host once the
    compute stream has written the tensor, host to device ahead of backward; the compute stream
    waits for a copy's event only where it uses the tensor. CPU tensors are not copied (same
    bookkeeping)."""

    def __init__(
        self,
        stats: OffloadStats,
        params: Iterable[torch.Tensor],
        min_bytes: int | None,
        prefetch: int,
        pin: bool,
        layers: int | None = None,
    ) -> None:
        self.stats, self.min_bytes, self.pin = stats, min_bytes, pin
        self.exclude = {p.untyped_storage().data_ptr() for p in params}
        self.order = _PackOrder(prefetch)
        self.layers = layers
        self.moved = 0
        """Tensors this forward moved to the host (each once)."""
        self._live: dict[tuple, tuple[weakref.ref, weakref.ref[_Offloaded]]] = {}
        """(storage address, view, version) → (the storage, its entry), for saves of it again."""

    def pack(self, t: torch.Tensor) -> object:
        s, nbytes = self.stats, t.numel() * t.element_size()
        # kept tensors are returned detached: a node saving its own output would otherwise form a
        # cycle (node -> saved tensor -> grad_fn) that outlives a graph dropped without backward
        if _is_parameter(t, self.exclude):
            s.param_tensors += 1
            s.param_bytes += nbytes
            return t.detach()
        limit = self.min_bytes
        if limit is None:
            limit = 0 if t.device.type == "cpu" else DEFAULT_MIN_BYTES
        if nbytes < limit:
            s.tiny_tensors += 1
            s.tiny_bytes += nbytes
            return t.detach()
        key, storage = _view_key(t)
        entry = self._saved_before(key, storage)
        if entry is not None:
            s.shared_tensors += 1
            s.shared_bytes += nbytes
        else:
            s.tensors += 1
            s.bytes += nbytes
            self.moved += 1
            entry = self._to_host(t)
            if key is not None:
                self._remember(key, storage, entry)
        self.order.add(entry)
        return entry

    def _saved_before(self, key: tuple | None, storage) -> _Offloaded | None:
        """The entry of an earlier save of the same storage, view and version, if it lives. The
        storage is compared by identity, not address: a freed block's address is reused."""
        if key is None or key not in self._live:
            return None
        known, entry = self._live[key]
        return entry() if known() is storage else None

    def _remember(self, key: tuple, storage, entry: _Offloaded) -> None:
        def forget(ref: weakref.ref, key: tuple = key) -> None:
            if self._live.get(key, (None, None))[1] is ref:
                del self._live[key]

        self._live[key] = (weakref.ref(storage), weakref.ref(entry, forget))

    def unpack(self, packed: object) -> torch.Tensor:
        if not isinstance(packed, _Offloaded):
            return packed  # type: ignore[return-value]
        if self.layers:  # backward has begun: every save of this forward is known
            per_layer = math.ceil(self.moved / self.layers)
            self.order.ahead = max(self.order.ahead, per_layer)
        if packed.pending is None:
            self.stats.prefetch_misses += 1
        else:
            self.stats.prefetch_hits += 1
        for e in self.order.to_fetch(packed):
            self._fetch(e)
        return self._take(packed)

    def _to_host(self, t: torch.Tensor) -> _Offloaded:
        if t.device.type != "cuda":  # CPU: no copy; another device: a plain synchronous one
            return _Offloaded(t.device, t.detach() if t.device.type == "cpu" else t.detach().cpu())
        out = _side_stream(t.device, "out")
        out.wait_stream(torch.cuda.current_stream(t.device))  # t is written by then
        with torch.cuda.stream(out):
            if self.pin and t.layout == torch.strided:  # exact bytes from the pinned slabs
                host = _host_pool(t.device).take(t.shape, t.dtype, wait=out.wait_event)
            else:
                host = torch.empty(t.shape, dtype=t.dtype, layout=t.layout, pin_memory=self.pin)
            host.copy_(t, non_blocking=self.pin)
            stored = torch.cuda.Event()
            stored.record(out)
        t.record_stream(out)  # its block is not reused before the copy has read it
        return _Offloaded(t.device, host, stored)

    def _fetch(self, e: _Offloaded) -> None:
        if e.stored is None:
            e.pending = e.host if e.device.type == "cpu" else e.host.to(e.device)
            return
        back = _side_stream(e.device, "in")
        back.wait_event(e.stored)  # the host copy is complete
        with torch.cuda.stream(back):  # allocated on the side stream: no wait on compute
            e.pending = e.host.to(e.device, non_blocking=self.pin)
            e.ready = torch.cuda.Event()
            e.ready.record(back)

    def _take(self, e: _Offloaded) -> torch.Tensor:
        t = e.pending
        assert t is not None
        e.unpacks += 1
        if e.used:  # its last save: the copy back lives on in the caller's hands only
            e.pending = None
        if e.ready is not None:
            current = torch.cuda.current_stream(e.device)
            current.wait_event(e.ready)
            t.record_stream(current)  # the side stream does not reuse it while compute reads it
            e.ready = None
        return t


def _view_key(t: torch.Tensor) -> tuple[tuple | None, object]:
    """(storage address, offset, shape, strides, dtype, version) and the storage object, for
    finding a tensor saved again; (None, None) for a wrapper subclass with no storage (DTensor)."""
    try:
        storage = t.untyped_storage()
    except RuntimeError:
        return None, None
    key = (storage.data_ptr(), t.storage_offset(), t.shape, t.stride(), t.dtype, t._version)
    return key, storage


@contextlib.contextmanager
def offload_activations(
    stats: OffloadStats | None = None,
    pin_memory: bool = True,
    *,
    params: Iterable[torch.Tensor] = (),
    min_bytes: int | None = None,
    prefetch: int = DEFAULT_PREFETCH,
    layers: int | None = None,
) -> Iterator[OffloadStats]:
    """Within the block, activations saved for backward go to host memory (pinned when a GPU is
    present), each tensor once however often it is saved, and come back when backward unpacks
    them, `prefetch` tensors ahead, or (given the `layers` the block's forward runs) one layer's
    worth ahead if that is more.

    Stay where they are (counted in `stats` by reason): leaves that require grad (parameters, or
    inputs the caller holds), their views and autocast dtype casts — a parameter lives anyway, so
    moving it frees nothing, and a cast is weight-sized, not activation-sized, and cached by
    autocast for the forward; `params` adds parameters that need no grad, which look like any other
    leaf. Also tensors below `min_bytes` (None: `DEFAULT_MIN_BYTES` for device tensors, 0 on CPU)."""
    stats = stats if stats is not None else OffloadStats()
    pin = pin_memory and torch.cuda.is_available()
    hooks = _Offloader(stats, params, min_bytes, prefetch, pin, layers)
    with torch.autograd.graph.saved_tensors_hooks(hooks.pack, hooks.unpack):
        yield stats


def saved_activation_bytes(fn: Callable[[], object], params: list[torch.Tensor]) -> int:
    """Bytes of distinct non-parameter storages autograd saves for backward while running fn():
    the activation memory that peaks at the end of the forward pass. Works on CPU, where there is no
    allocator statistic (on CUDA, compare with torch.cuda.max_memory_allocated)."""
    exclude = {p.untyped_storage().data_ptr() for p in params}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        ptr = t.untyped_storage().data_ptr()
        if ptr not in exclude:
            seen[ptr] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    del out
    return sum(seen.values())


def retained_bytes(fn: Callable[[], object]) -> int:
    """Bytes allocated on the CPU while running fn() and still allocated when it returns — with a
    forward pass whose output fn keeps, everything autograd keeps for backward, whichever way it
    keeps it (saved tensors, recompute caches, checkpoint inputs). Read from the profiler's memory
    events, so it is exact and needs no allocator statistic (CPU has none)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    return sum(e.self_cpu_memory_usage for e in prof.events())


def offloading_for(
    stats: OffloadStats | None, n_layers: int, parallel
) -> contextlib.AbstractContextManager:
    """Activation offload around one forward (`train.offload_activations`), or nothing. A pipeline
    stage runs one of this rank's chunks per forward: backward brings back a layer's worth of
    activations ahead of use, so the count is the layers of one chunk."""
    if stats is None:
        return contextlib.nullcontext()
    chunks = parallel.pp_virtual if parallel.pp > 1 else 1
    return offload_activations(stats, layers=max(1, n_layers // chunks))
