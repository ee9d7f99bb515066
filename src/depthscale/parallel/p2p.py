"""Point-to-point messages that are correct under NCCL's rules, and a recorder that proves it.

NCCL ignores tags: between two ranks, the k-th send is received by the k-th receive, in posting
order. Unbatched operations to one peer share a stream, and a send or receive occupies it until its
partner runs, so two ranks that each post "receive, then send" wait on each other for ever. Every
message in depthscale therefore goes through `post`, which issues one step's sends and receives as
a single `batch_isend_irecv` group (NCCL runs a group's operations together), always with tag 0 —
so gloo, which the tests run on, matches messages exactly as NCCL would: in posting order per pair.
The callers (ring attention, the pipeline runtime) post in an order both sides of every pair agree
on; each message keeps a `label` naming what it carries, for the recorder and for error messages.

`recording()` captures every group posted and every wait, per rank, in the form
`depthscale.parallel.nccl_rules.replay` checks: deadlock-free and paired as intended under NCCL.
Every message is also a span (`observe.spans`, category `traffic.channel`): a send from posting to
known-complete, a receive from posting to data-available, with peer, label, bytes and group — the
two ends of one arrow in the merged timeline.
"""

from __future__ import annotations

import contextlib
import itertools
import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed import ProcessGroup

from depthscale.observe import spans
from depthscale.observe.device_time import DeviceTimes


class Send(NamedTuple):
    tensor: Tensor
    peer: int
    """Rank in the group the message is posted on."""
    label: str


class Recv(NamedTuple):
    shape: tuple[int, ...]
    dtype: torch.dtype
    peer: int
    label: str


@dataclass
class Traffic(DeviceTimes):
    """Counters of one caller's messages (its stats object may subclass this). Durations are of
    device work (`observe.device_time`): call `settle()` before reading them on a GPU."""

    bytes_sent: int = 0
    messages: int = 0
    wait_s: float = 0.0
    """Seconds blocked in `wait()` (on a GPU: the compute stream's): communication not hidden by
    compute."""
    send_bytes_live: int = 0
    """Bytes of send buffers posted and not yet known to be complete."""
    peak_send_bytes_live: int = 0
    channel = "p2p"
    """The span category of these messages ("pp", "cp", ...): a class attribute of the caller's."""


class Batch:
    """One posted group. `recv(label)` waits for that receive and returns its buffer;
    `wait_sends(peer)` blocks until the sends (to `peer`) have gone and frees their buffers;
    `poll()` frees them without blocking once they have gone; `wait()` completes everything.

    NCCL returns one work for the whole group, so there every wait is a wait for the group; gloo
    returns one per operation, and a caller waits only for what it needs (the replay in
    `nccl_rules` treats every wait as a wait for the group, as NCCL would). Gloo reports a send
    complete only once it has been waited on, so `poll` frees nothing there: callers wait for sends
    where they know the receive is posted (see the pipeline runtime) or at the end of their step."""

    def __init__(
        self,
        works: list,
        sends: list[tuple[Tensor, int]],
        recvs: dict[str, Tensor],
        traffic: Traffic,
        trace_id: int | None,
        opened: tuple[list, dict] = ((), {}),
        device: torch.device | None = None,
    ) -> None:
        # one work per operation (gloo), in posting order: sends, then receives; else one for the
        # whole group (NCCL's coalesced work) — what batch_isend_irecv returns today
        per_op = len(works) == len(sends) + len(recvs)
        self._works = list(works)  # not yet waited on (a work holds its tensor alive)
        self._recvs, self._traffic, self._trace_id = recvs, traffic, trace_id
        self._device = device if device is not None else torch.device("cpu")
        send_spans, self._recv_spans = opened
        self._sends = [
            _Sent(t, peer, [works[i]] if per_op else list(works), span)
            for i, ((t, peer), span) in enumerate(zip(sends, send_spans or [None] * len(sends)))
        ]
        self._recv_works = dict(zip(recvs, works[len(sends) :])) if per_op else None
        self.position = 0
        """Where the caller placed this group in its posting order (set by the caller)."""
        traffic.send_bytes_live += sum(s.nbytes for s in self._sends)
        traffic.peak_send_bytes_live = max(traffic.peak_send_bytes_live, traffic.send_bytes_live)

    def recv(self, label: str) -> Tensor:
        works = list(self._works) if self._recv_works is None else [self._recv_works.pop(label)]
        with spans.waiting([self._recv_spans.get(label)]):
            self._block(works)
        spans.end(self._recv_spans.pop(label, None))
        return self._recvs.pop(label)

    def wait_sends(self, peer: int | None = None) -> None:
        for s in [s for s in self._sends if peer is None or s.peer == peer]:
            with spans.waiting([s.span]):
                self._block(s.works)
            self._drop(s)

    def poll(self) -> bool:
        """Free the sends that have gone; True once none is held."""
        for s in [s for s in self._sends if all(w.is_completed() for w in s.works)]:
            self._drop(s)
        return not self._sends

    def wait(self) -> None:
        with spans.waiting([s.span for s in self._sends] + list(self._recv_spans.values())):
            self._block(list(self._works))
        for s in list(self._sends):
            self._drop(s)
        for label in list(self._recv_spans):
            spans.end(self._recv_spans.pop(label))

    def _block(self, works: list) -> None:
        """Wait for `works`, each at most once (gloo's send/receive works hang if waited twice)."""
        pending = [w for w in works if any(w is p for p in self._works)]
        if not pending:
            return
        with self._traffic.timing("wait_s", self._device):
            for work in pending:
                work.wait()
        self._works = [w for w in self._works if not any(w is p for p in pending)]
        if _trace is not None and self._trace_id is not None:
            _trace.append({"wait": self._trace_id})

    def _drop(self, s: _Sent) -> None:
        self._sends.remove(s)
        self._traffic.send_bytes_live -= s.nbytes
        spans.end(s.span)


@dataclass(eq=False)
class _Sent:
    tensor: Tensor
    peer: int
    works: list
    span: spans.Open | None = None

    @property
    def nbytes(self) -> int:
        return self.tensor.numel() * self.tensor.element_size()


def post(
    group: ProcessGroup,
    sends: list[Send],
    recvs: list[Recv],
    device: torch.device,
    traffic: Traffic,
) -> Batch:
    """Post `sends` and `recvs` as one group (both may be empty); nothing blocks until a wait.

    Peers are ranks in `group`. Sends are issued before receives, each in list order; two ranks must
    post their messages to each other in the same order, across groups and within one (two sends
    to one peer in a group pair with that peer's receives in their order)."""
    ops, bufs, held = [], {}, []
    for s in sends:
        t = s.tensor.contiguous()
        held.append((t, s.peer))
        ops.append(dist.P2POp(dist.isend, t, group=group, group_peer=s.peer))
        traffic.bytes_sent += t.numel() * t.element_size()
        traffic.messages += 1
    for r in recvs:
        if r.label in bufs:
            raise ValueError(f"two receives labelled {r.label!r} in one group")
        bufs[r.label] = torch.empty(r.shape, dtype=r.dtype, device=device)
        ops.append(dist.P2POp(dist.irecv, bufs[r.label], group=group, group_peer=r.peer))
    trace_id = _record_post(group, sends, held, recvs) if _trace is not None and ops else None
    opened = _open_spans(group, sends, held, recvs, traffic.channel) if spans.active() else ((), {})
    works = [w for w in dist.batch_isend_irecv(ops) if w is not None] if ops else []
    return Batch(works, held, bufs, traffic, trace_id, opened, device)


_group_ranks: dict[int, tuple[list[int], str]] = {}


def _open_spans(group, sends, held, recvs, channel: str) -> tuple[list, dict]:
    """One span per message, named by its global peer: (send spans in order, receives by label)."""
    key = id(group)
    if key not in _group_ranks:
        ranks = dist.get_process_group_ranks(group)
        _group_ranks[key] = (ranks, ",".join(map(str, ranks)))
    ranks, where = _group_ranks[key]
    opened = [
        spans.begin(
            "send", channel, peer=ranks[s.peer], label=s.label, group=where,
            bytes=t.numel() * t.element_size(),
        )
        for s, (t, _) in zip(sends, held)
    ]  # fmt: skip
    receiving = {
        r.label: spans.begin(
            "recv", channel, peer=ranks[r.peer], label=r.label, group=where,
            bytes=math.prod(r.shape) * r.dtype.itemsize,
        )
        for r in recvs
    }  # fmt: skip
    return opened, receiving


# --------------------------------------------------------------------------- recording

_trace: list[dict] | None = None
_ids = itertools.count()


@contextlib.contextmanager
def recording() -> Iterator[list[dict]]:
    """Record this rank's groups and waits while the block runs (one rank, one list).

    Events: {"post": id, "ops": [[kind, global peer, label, bytes], ...], "group": [global ranks],
    "batched": true} and {"wait": id}. Gather the lists of all ranks and pass them to
    `nccl_rules.replay`."""
    global _trace
    if _trace is not None:
        raise RuntimeError("p2p.recording() is already active")
    _trace = events = []
    try:
        yield events
    finally:
        _trace = None


def _record_post(
    group: ProcessGroup, sends: list[Send], held: list[tuple[Tensor, int]], recvs: list[Recv]
) -> int:
    gid = next(_ids)
    ops = [
        ["send", dist.get_global_rank(group, s.peer), s.label, t.numel() * t.element_size()]
        for s, (t, _) in zip(sends, held)
    ]
    ops += [
        [
            "recv",
            dist.get_global_rank(group, r.peer),
            r.label,
            math.prod(r.shape) * r.dtype.itemsize,
        ]
        for r in recvs
    ]
    _trace.append(
        {"post": gid, "ops": ops, "group": dist.get_process_group_ranks(group), "batched": True}
    )
    return gid


__all__ = ["Batch", "Recv", "Send", "Traffic", "post", "recording"]
