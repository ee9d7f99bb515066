"""Fault injection for drills and tests (`--faults`, off by default): each fault class the supervisor
and the NaN guard must survive, injected where it would really happen.

    --faults kill@1:5,nan@0:3        comma-separated; RANK:STEP means "that rank, at that step"

| spec              | what happens                                                                |
|-------------------|-----------------------------------------------------------------------------|
| `kill@R:S`        | rank R sends itself SIGKILL at the start of step S (a dead host, the OOM killer) |
| `stop@R:S`        | rank R sends itself SIGSTOP (a frozen host: its heartbeat stops too)        |
| `hang@R:S[:SEC]`  | rank R sleeps SEC s (default 3600) inside step S's forward (a hung kernel: the heartbeat goes on, progress stops) |
| `crash@R:S`       | rank R raises an error at the start of step S (a one-rank bug)              |
| `nan@R:S`         | rank R's loss of step S is NaN once (a transient fault: the replay is clean) |
| `badbatch@R:S`    | the batch of step S makes rank R's loss NaN whenever it is computed (bad data) |
| `slow@R:F[:S]`    | rank R's forward and backward take F× as long from step S (default 1) on    |
| `enospc@S`        | the checkpoint save of step S fails with "No space left on device"          |
| `slowsave@S[:SEC]`| the checkpoint save of step S (and its snapshot in memory) takes SEC s (default 5) longer to write (slow storage) |
| `corrupt@S`       | a byte of the checkpoint of step S (and of its snapshot in memory) is flipped once it is written |
| `baddiag@NODE`    | the diagnostics find node NODE slow (a node that must be excluded)          |

A fault fires in the first attempt only (a restarted group runs clean, as after a replaced node);
a trailing `*` (`kill@1:5*`) fires it in every attempt (a fault a restart cannot cure).
`badbatch` is bound to the data: within the attempt, that batch is bad whenever it comes back.
"""

from __future__ import annotations

import os
import re
import signal
import time
from dataclasses import dataclass
from pathlib import Path

from depthscale.errors import ConfigError

RANK_STEP = ("kill", "stop", "hang", "crash", "nan", "badbatch")
STEP_ONLY = ("enospc", "corrupt", "slowsave")
KINDS = (*RANK_STEP, "slow", *STEP_ONLY, "baddiag")
ATTEMPT_ENV = "TORCHELASTIC_RESTART_COUNT"

_FORMS = (
    "kill@R:S, stop@R:S, hang@R:S[:SECONDS], crash@R:S, nan@R:S, badbatch@R:S, slow@R:FACTOR[:S], "
    "enospc@S, corrupt@S, slowsave@S[:SECONDS], baddiag@NODE (R a rank, S a step >= 1; a trailing * repeats a fault in "
    "every restart)"
)


class InjectedFault(RuntimeError):
    """Raised on purpose by `crash@R:S`; never caught by depthscale."""


@dataclass(frozen=True)
class Fault:
    kind: str
    rank: int | None = None
    step: int | None = None
    value: float | None = None  # hang: seconds; slow: factor
    node: str | None = None
    every_attempt: bool = False

    def __str__(self) -> str:
        if self.kind == "baddiag":
            where = self.node
        elif self.kind in STEP_ONLY:
            where = str(self.step) + (f":{self.value:g}" if self.value is not None else "")
        elif self.kind == "slow":
            where = f"{self.rank}:{self.value:g}:{self.step}"
        else:
            where = f"{self.rank}:{self.step}" + (
                f":{self.value:g}" if self.value is not None else ""
            )
        return f"{self.kind}@{where}" + ("*" if self.every_attempt else "")


_ITEM = re.compile(r"^([a-z]+)@([^*]+)(\*?)$")


def parse_faults(spec: str) -> tuple[Fault, ...]:
    """Parse a `--faults` string; ConfigError naming the bad item and the allowed forms."""
    faults = []
    for item in filter(None, (part.strip() for part in spec.split(","))):
        faults.append(_parse_one(item))
    return tuple(faults)


def _parse_one(item: str) -> Fault:
    bad = ConfigError(f"resilience.faults: {item!r} is not a fault; allowed: {_FORMS}")
    m = _ITEM.match(item)
    if m is None or m.group(1) not in KINDS:
        raise bad
    kind, where, star = m.group(1), m.group(2), bool(m.group(3))
    parts = where.split(":")
    try:
        if kind == "baddiag":
            if not where or ":" in where:
                raise ValueError
            return Fault(kind, node=where, every_attempt=star)
        if kind in STEP_ONLY:
            step, *rest = parts
            value = float(rest[0]) if rest and kind == "slowsave" else None
            if len(rest) > (kind == "slowsave") or (value is not None and not value > 0):
                raise ValueError
            return _checked(Fault(kind, step=int(step), value=value, every_attempt=star), bad)
        if kind == "slow":
            rank, factor, *rest = parts
            step = int(rest[0]) if rest else 1
            if len(rest) > 1 or not float(factor) > 1:
                raise ValueError
            return _checked(Fault(kind, int(rank), step, float(factor), every_attempt=star), bad)
        rank, step, *rest = parts
        value = float(rest[0]) if rest and kind == "hang" else None
        if len(rest) > (1 if kind == "hang" else 0) or (value is not None and not value > 0):
            raise ValueError
        return _checked(Fault(kind, int(rank), int(step), value, every_attempt=star), bad)
    except ValueError:
        raise bad from None


def _checked(fault: Fault, bad: ConfigError) -> Fault:
    if (fault.rank is not None and fault.rank < 0) or (fault.step is not None and fault.step < 1):
        raise bad
    return fault


def check_ranks(faults: tuple[Fault, ...], world_size: int) -> None:
    """A fault aimed at a rank the run does not have would silently never fire."""
    for f in faults:
        if f.rank is not None and f.rank >= world_size:
            raise ConfigError(
                f"resilience.faults: {f} names rank {f.rank}, but the run has {world_size} "
                f"rank(s); allowed: ranks 0..{world_size - 1}"
            )


def attempt() -> int:
    """Which (re)start of the worker group this process belongs to (0: the first)."""
    return int(os.environ.get(ATTEMPT_ENV, "0") or 0)


class FaultPlan:
    """The faults that apply to this rank in this attempt, and the hooks that fire them."""

    def __init__(self, faults: tuple[Fault, ...], rank: int, this_attempt: int | None = None):
        n = attempt() if this_attempt is None else this_attempt
        self.rank = rank
        self.faults = [
            f for f in faults if (f.every_attempt or n == 0) and (f.rank is None or f.rank == rank)
        ]
        self._fired: set[tuple[str, int]] = set()
        self.bad_positions: set[tuple[int, int]] = set()
        """Data positions (epoch, cursor) `badbatch` poisoned: poisoned again wherever they recur."""

    def __bool__(self) -> bool:
        return bool(self.faults)

    def _at(self, kind: str, step: int) -> Fault | None:
        return next((f for f in self.faults if f.kind == kind and f.step == step), None)

    def at_step_start(self, step: int) -> None:
        """Faults that strike between steps: kill, stop, crash."""
        if self._at("kill", step):
            _say(f"injected fault: rank {self.rank} kills itself at step {step}")
            os.kill(os.getpid(), signal.SIGKILL)
        if self._at("stop", step):
            _say(f"injected fault: rank {self.rank} stops itself (SIGSTOP) at step {step}")
            os.kill(os.getpid(), signal.SIGSTOP)
        if self._at("crash", step):
            raise InjectedFault(f"injected fault on rank {self.rank} at step {step} (crash@)")

    def in_forward(self, step: int) -> None:
        """A hang inside the step: the process lives (its heartbeat goes on), progress stops."""
        fault = self._at("hang", step)
        if fault is not None:
            _say(f"injected fault: rank {self.rank} hangs in step {step}")
            time.sleep(fault.value or 3600.0)

    def poison_loss(self, step: int, position: tuple[int, int]) -> bool:
        """Whether this rank's loss of `step` (its batch at data `position`) is to be NaN."""
        if position in self.bad_positions:
            return True
        for kind in ("badbatch", "nan"):
            if self._at(kind, step) and (kind, step) not in self._fired:
                self._fired.add((kind, step))
                if kind == "badbatch":
                    self.bad_positions.add(position)
                return True
        return False

    def slowdown(self) -> tuple[float, int] | None:
        """(factor, from step) for this rank, if slowed."""
        fault = next((f for f in self.faults if f.kind == "slow"), None)
        return (fault.value, fault.step) if fault is not None else None

    def failing_save(self) -> int | None:
        """The step whose checkpoint save fails with a full disk (`enospc@S`), if any."""
        return next((f.step for f in self.faults if f.kind == "enospc"), None)

    def slow_save(self) -> tuple[int, float] | None:
        """(step, seconds): the save that takes longer to write (`slowsave@S[:SEC]`), if any."""
        fault = next((f for f in self.faults if f.kind == "slowsave"), None)
        return None if fault is None else (fault.step, fault.value or 5.0)

    def corrupts(self, step: int) -> bool:
        return self._at("corrupt", step) is not None

    def corrupt_after_save(self, step: int, path: os.PathLike, wait, is_main: bool) -> None:
        """`corrupt@STEP`: once the checkpoint of `step` is on disk (`wait`), rank 0 flips a
        byte of it."""
        if not self.corrupts(step):
            return
        wait()
        if is_main:
            name = corrupt_checkpoint(path)
            print(f"depthscale: injected fault: flipped a byte of {Path(path) / name}", flush=True)


def bad_diag_nodes(faults: tuple[Fault, ...], diagnostic_run: int) -> list[str]:
    """Nodes the `diagnostic_run`-th diagnostics (0: the first) are told to find slow
    (`baddiag@NODE`: the first only, unless starred)."""
    return [
        f.node
        for f in faults
        if f.kind == "baddiag" and f.node and (f.every_attempt or diagnostic_run == 0)
    ]


def corrupt_checkpoint(path: os.PathLike) -> str:
    """Flip one byte in the middle of the largest file of a checkpoint; returns the file name."""
    files = [os.path.join(path, n) for n in os.listdir(path)]
    target = max((f for f in files if os.path.isfile(f)), key=os.path.getsize)
    with open(target, "r+b") as fh:
        size = os.fstat(fh.fileno()).st_size
        fh.seek(size // 2)
        byte = fh.read(1)
        fh.seek(size // 2)
        fh.write(bytes([byte[0] ^ 0xFF]))
    return os.path.basename(target)


def _say(msg: str) -> None:
    print(f"depthscale: {msg}", flush=True)
