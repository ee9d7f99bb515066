"""The background half of an asynchronous checkpoint save, in a process of its own.

A writer thread shares the training process's GIL: DCP serialises every item of the state dict
(a tensor or a small object: an AdamW run has ~10 per parameter) with `torch.save`, and on a CPU
run those tenths of a second of Python are taken from training (`benchmarks/checkpoint.py`
measures 6 % with a save every 10 steps). Here each rank starts one writer process, at its first
asynchronous save, and hands it every later one:

- staging: the state is copied into one shared-memory buffer, allocated once and reused while the
  state's layout (names, shapes, dtypes) stays the same; the writer maps the same buffer. A save
  sends only the small values (learning rates, the step, RNG state) through a pipe.
- planning: DCP's local plan is made here, from the live state, where DTensors know their global
  shape and offsets; the writer plays it back over the staged shards (`StagedPlanner`), so it never
  needs a device mesh.
- writing: the writer runs `CheckpointWriter.write` (checkpoint_write.py) — DCP, fsync, hashes,
  manifest, publish, with every rank learning whether any failed — over a gloo group of the writer
  processes, joined through the training run's own store under a fresh key prefix.

The writer runs at a lower priority (nice 10), so where training keeps every core busy it writes
in the gaps. It dies with its parent (PR_SET_PDEATHSIG): a killed rank leaves no writer behind.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import select
import signal
import socket
import subprocess
import sys
import traceback
import uuid
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.connection import Connection, Pipe
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.planner import SavePlan
from torch.distributed.tensor import DTensor

from depthscale.config import CheckpointConfig, ModelConfig
from depthscale.errors import CheckpointError, PeersFailed
from depthscale.train.checkpoint_write import CheckpointWriter, SaveRecord

_ALIGN = 64
_STOP_SIGNALS = {signal.SIGINT, signal.SIGTERM}
_NICE = 10
_started = 0


@dataclass
class _Peers:
    """How a rank's writer joins the other ranks' writers: a gloo group made through the run's
    TCP store, under a key prefix fresh for each set of writers."""

    host: str
    port: int
    timeout_s: float
    prefix: str
    rank: int
    world: int


def _tcp_store() -> tuple[str, int, float] | None:
    """(host, port, timeout_s) of the TCP store under the default process group, or None when it
    was made without one (a file store)."""
    store = distributed_c10d._get_default_store()
    timeout_s = store.timeout.total_seconds()
    while isinstance(store, dist.PrefixStore):
        store = store.underlying_store
    if not isinstance(store, dist.TCPStore):
        return None
    return store.host, store.port, timeout_s


def _peers() -> _Peers | None:
    """This rank's writer's group (called by every rank, in the same order); None alone."""
    global _started
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return None
    address = _tcp_store()
    assert address is not None, "checked by can_start()"
    _started += 1  # every rank starts its writers in the same order: the n-th ones pair up
    key = f"depthscale/checkpoint_writer/{_started}"
    store = distributed_c10d._get_default_store()
    if dist.get_rank() == 0:
        store.set(key, uuid.uuid4().hex)
    token = store.get(key).decode()
    return _Peers(*address, f"depthscale/ckpt/{token}/", dist.get_rank(), dist.get_world_size())


def can_start() -> bool:
    """Whether this rank can hand its saves to a writer process: a platform that shares memory
    by file descriptor (Linux), and peers reachable through a TCP store (where there are any)."""
    if not (hasattr(os, "memfd_create") and hasattr(socket, "send_fds")):
        return False
    return not dist.is_initialized() or dist.get_world_size() == 1 or _tcp_store() is not None


@dataclass
class _Spec:
    """What the writer process needs to start: where to write, whom to write with."""

    root: Path
    cfg: CheckpointConfig
    model: ModelConfig | None
    peers: _Peers | None
    parent: int


@dataclass
class _Layout:
    """The staged state's shape: each tensor's (name, offset, dtype, shape) in the shared buffer
    of `size` bytes (its file descriptor travels beside this), and the DCP plan made from the
    live state."""

    size: int
    slots: list[tuple[str, int, torch.dtype, tuple[int, ...]]]
    plan: SavePlan
    mappings: dict


def _map(fd: int, size: int) -> torch.Tensor:
    """The shared buffer behind a memfd, mapped into this process."""
    return torch.from_file(f"/proc/self/fd/{fd}", shared=True, size=size, dtype=torch.uint8)


def _views(buffer: torch.Tensor, slots: list) -> dict[str, torch.Tensor]:
    return {
        fqn: buffer[offset : offset + _nbytes(dtype, shape)].view(dtype).view(shape)
        for fqn, offset, dtype, shape in slots
    }


def _nbytes(dtype: torch.dtype, shape: tuple[int, ...]) -> int:
    return torch.Size(shape).numel() * dtype.itemsize


def _layout_key(flat: dict[str, Any]) -> tuple:
    key = []
    for fqn, obj in flat.items():
        if isinstance(obj, DTensor):
            local = obj.to_local()
            key.append(
                (fqn, local.dtype, tuple(local.shape), tuple(obj.shape), str(obj.placements))
            )
        elif isinstance(obj, torch.Tensor):
            key.append((fqn, obj.dtype, tuple(obj.shape)))
        else:
            key.append(fqn)
    return tuple(key)


class SaveProcess:
    """This rank's writer process, seen from training: `submit` stages a save and returns, `poll`
    and `result` collect its outcome. One save is in flight at a time."""

    def __init__(self, root: Path, cfg: CheckpointConfig, model: ModelConfig | None) -> None:
        """Start the writer (every rank at once: the writers of a run form a group)."""
        spec = _Spec(Path(root), cfg, model, _peers(), os.getpid())
        self._conn, conn = Pipe()
        self._fds, fds = socket.socketpair()
        env = dict(os.environ)
        package_root = str(Path(__file__).resolve().parents[2])  # however depthscale was found
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [package_root, env.get("PYTHONPATH")]))
        # its failures reach this rank as exceptions, printed once in the rank's one line; torch's
        # C++ warnings about the same dead sockets (a stack each) would be printed beside it
        env.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
        # Started with the stop signals blocked, the writer inherits the block until it ignores
        # them (`_ignore_stop_signals`): one that arrived while it still imported torch printed a
        # KeyboardInterrupt traceback. This process takes one that came meanwhile as it unblocks.
        blocked = signal.pthread_sigmask(signal.SIG_BLOCK, _STOP_SIGNALS)
        try:
            self._process = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "depthscale.train.save_process",
                    str(conn.fileno()),
                    str(fds.fileno()),
                ],
                pass_fds=(conn.fileno(), fds.fileno()),
                env=env,
            )
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
        conn.close()
        fds.close()
        self._conn.send(spec)
        self._key: tuple | None = None
        self._views: dict[str, torch.Tensor] = {}
        self._in_flight: int | None = None

    @property
    def pid(self) -> int:
        return self._process.pid

    @property
    def in_flight(self) -> bool:
        return self._in_flight is not None

    @property
    def writing_step(self) -> int | None:
        """The step the writer is still writing, None once its outcome is waiting to be collected.
        Safe from another thread (the heartbeat's): it only asks whether the pipe is readable."""
        step = self._in_flight
        if step is None:
            return None
        readable, _, _ = select.select([self._conn], [], [], 0)
        return None if readable else step

    def submit(
        self,
        step: int,
        state: dict,
        rng: dict,
        trainer_state: dict,
        fail: bool,
        rank: int,
        delay_s: float = 0.0,
    ) -> None:
        """Copy `state` into the shared buffer and ask the writer to save it as `step`. `fail`
        and `delay_s` are drills (`Checkpointer.inject_write_error_at`, `inject_write_delay`)."""
        if self._process.poll() is not None:
            raise self._died(f"before saving step {step}")
        planner = DefaultSavePlanner()
        planner.set_up_planner(state, is_coordinator=rank == 0)
        flat = planner.state_dict
        layout = None
        key = _layout_key(flat)
        if key != self._key:
            layout = self._allocate(flat, planner.create_local_plan(), planner.mappings)
            self._key = key
        objects = {}
        for fqn, obj in flat.items():
            if isinstance(obj, torch.Tensor):
                self._views[fqn].copy_(obj.to_local() if isinstance(obj, DTensor) else obj)
            else:
                objects[fqn] = obj
        rng_bytes = {k: v.numpy().tobytes() for k, v in rng.items()}
        try:
            self._conn.send((layout, step, objects, rng_bytes, trainer_state, fail, delay_s))
        except OSError:
            raise self._died(f"while receiving step {step}") from None
        self._in_flight = step

    def _allocate(self, flat: dict, plan: SavePlan, mappings: dict) -> _Layout:
        """A new shared buffer for a new layout; its memfd goes to the writer, which maps it."""
        slots, offset = [], 0
        for fqn, obj in flat.items():
            if isinstance(obj, torch.Tensor):
                local = obj.to_local() if isinstance(obj, DTensor) else obj
                slots.append((fqn, offset, local.dtype, tuple(local.shape)))
                offset += -(-_nbytes(local.dtype, tuple(local.shape)) // _ALIGN) * _ALIGN
        size = max(offset, _ALIGN)
        fd = os.memfd_create("depthscale-checkpoint")
        try:
            os.ftruncate(fd, size)
            buffer = _map(fd, size)
            socket.send_fds(self._fds, [b"b"], [fd])
        finally:
            os.close(fd)  # both mappings keep the memory; nothing is left in any file system
        self._views = _views(buffer, slots)
        return _Layout(size, slots, plan, mappings)

    def poll(self) -> tuple[SaveRecord, BaseException | None] | None:
        """The finished save's (SaveRecord, error), or None while it is still being written."""
        if self._in_flight is None or not self._conn.poll():
            return None
        return self._receive()

    def result(self) -> tuple[SaveRecord, BaseException | None]:
        """Wait for the save in flight; a writer that died is an error naming its exit."""
        while not self._conn.poll(0.2):
            if self._process.poll() is not None and not self._conn.poll():
                step, self._in_flight = self._in_flight, None
                raise self._died(f"while saving step {step}")
        return self._receive()

    def _receive(self) -> tuple[SaveRecord, BaseException | None]:
        step, self._in_flight = self._in_flight, None
        try:
            return self._conn.recv()
        except (EOFError, OSError):  # closed, or reset by a writer that was killed
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._process.wait(5)
            raise self._died(f"while saving step {step}") from None

    def _died(self, when: str) -> CheckpointError:
        code = self._process.poll()
        if code is None:
            how = "closed its pipe"
        elif code < 0:
            how = f"was killed by {signal.Signals(-code).name}"
        else:
            how = f"exited with code {code}"
        return CheckpointError(
            f"the checkpoint writer process of this rank (pid {self._process.pid}) {how} {when}; "
            "the checkpoints already published are complete"
        )


class StagedPlanner(DefaultSavePlanner):
    """Plays back the local plan that training made from the live state over the staged copies:
    `state_dict` maps each flattened name to its staged local shard or value."""

    def __init__(self, plan: SavePlan, mappings: dict) -> None:
        super().__init__()
        self._plan = plan
        self.mappings = mappings

    def set_up_planner(self, state_dict, storage_meta=None, is_coordinator: bool = False) -> None:
        self.state_dict = state_dict
        self.is_coordinator = is_coordinator

    def create_local_plan(self) -> SavePlan:
        self.plan = self._plan
        return self.plan

    def lookup_object(self, index):
        return self.state_dict[index.fqn]


def _ignore_stop_signals() -> None:
    """The writer leaves stopping to its rank: Ctrl-C or `pkill -INT` reaching it mid-save raised
    KeyboardInterrupt inside torch.save, whose zip writer then failed the save with "unexpected
    pos" while the rank was stopping cleanly and waiting for that very save. The writer ends when
    its rank closes the pipe, or with it (PR_SET_PDEATHSIG)."""
    for sig in _STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, _STOP_SIGNALS)


def _die_with_parent(parent: int) -> None:
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if os.getppid() != parent:  # the parent died before the line above
        os._exit(1)


def _join(peers: _Peers | None) -> PeersFailed | None:
    """Join the writers' gloo group through the run's store; why not, when a peer is gone. The
    store is tried first with a plain connection: refused, its host is gone, and torch's own
    client would retry for the whole timeout (parallel.timeout_s), printing a C++ stack per try,
    while this rank waits for its save."""
    if peers is None:
        return None
    where = f"{peers.host}:{peers.port}"
    try:
        socket.create_connection((peers.host, peers.port), timeout=min(peers.timeout_s, 30)).close()
    except OSError as err:
        return PeersFailed(
            f"its checkpoint writer cannot reach the rendezvous store at {where} "
            f"({err.strerror or err})"
        )
    timeout = timedelta(seconds=peers.timeout_s)
    try:
        client = dist.TCPStore(peers.host, peers.port, is_master=False, timeout=timeout)
        dist.init_process_group(
            "gloo",
            store=dist.PrefixStore(peers.prefix, client),
            rank=peers.rank,
            world_size=peers.world,
            timeout=timeout,
        )
    except Exception as err:  # noqa: BLE001 — every way of failing here leaves no group to write with
        return PeersFailed(
            f"the checkpoint writers could not form their group through the store at {where} "
            f"({str(err).splitlines()[0][:200]}): a peer's writer or the store is gone"
        )
    return None


def _refuse(conn: Connection, cannot: PeersFailed) -> None:
    """Answer each save request with why the writer cannot save, until training closes the pipe:
    the rank reports it in its one line (a traceback here would be printed beside it)."""
    while True:
        try:
            request = conn.recv()
        except EOFError:
            return
        conn.send((SaveRecord(request[1], is_async=True, error=str(cannot)), cannot))


def _serve(conn: Connection, fds: socket.socket) -> None:
    """The writer process: join the writers' group, then save each request until the pipe
    closes."""
    spec: _Spec = conn.recv()
    _die_with_parent(spec.parent)
    os.nice(_NICE)
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a file-size limit: a failed save (EFBIG)
    torch.set_num_threads(1)
    cannot = _join(spec.peers)
    if cannot is not None:
        _refuse(conn, cannot)
        return
    writer = CheckpointWriter(spec.root, spec.cfg, spec.model)
    layout: _Layout | None = None
    views: dict[str, torch.Tensor] = {}
    while (request := _next_request(conn)) is not None:
        new_layout, step, objects, rng_bytes, trainer_state, fail, delay_s = request
        if new_layout is not None:
            _, (fd,), _, _ = socket.recv_fds(fds, 1, 1)
            layout, views = new_layout, _views(_map(fd, new_layout.size), new_layout.slots)
            os.close(fd)
        assert layout is not None, "the first request carries the layout"
        state = {**views, **objects}
        rng = {k: torch.frombuffer(bytearray(v), dtype=torch.uint8) for k, v in rng_bytes.items()}
        record = SaveRecord(step, is_async=True)
        planner = StagedPlanner(layout.plan, layout.mappings)
        error = None
        try:
            writer.write(record, state, rng, trainer_state, planner, fail, delay_s)
        except BaseException as err:  # a bug in the save: training raises it at its next wait
            error = err
        try:
            conn.send((record, _picklable(error)))
        except (BrokenPipeError, ConnectionResetError):  # training exited during the write
            break
    if dist.is_initialized():
        dist.destroy_process_group()


def _next_request(conn: Connection) -> tuple | None:
    """The next save training asks for, or None once training has exited: the pipe closed, or
    reset because training exited (a stop signal) without reading this process's last reply,
    which is no error of the save's (before: a ConnectionResetError traceback per rank)."""
    try:
        return conn.recv()
    except (EOFError, ConnectionResetError):
        return None


def _picklable(err: BaseException | None) -> BaseException | None:
    if err is None or isinstance(err, CheckpointError):
        return err
    text = "".join(traceback.format_exception_only(type(err), err)).strip()
    return CheckpointError(f"in the checkpoint writer process: {text}")


if __name__ == "__main__":
    _ignore_stop_signals()
    _serve(Connection(int(sys.argv[1])), socket.socket(fileno=int(sys.argv[2])))
