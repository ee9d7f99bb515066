"""`depthscale train --nproc N`: start N local workers through torchrun's own machinery.

Equivalent to `torchrun --standalone --nproc-per-node N -m depthscale train ARGS`. The standalone
rendezvous picks a free port, so concurrent jobs on one host never collide on 29500.

Failures are reported once. Each worker writes the message of the error that ended it into a
per-launch directory (`DEPTHSCALE_ERROR_DIR`) instead of printing it, because every rank often hits
the same bad input; when the group fails, the launcher prints the root cause once: an error naming
bad input first, then any other error, and only if nothing else explains the failure a rank that lost
its peers. torch's own elastic logs and its `ChildFailedError` report are kept quiet.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from depthscale.parallel.host_cpus import threads_per_rank

ERROR_DIR_ENV = "DEPTHSCALE_ERROR_DIR"

# Kinds of worker failure, most telling first: bad input names its cause; a bug has a traceback;
# a rank that lost a peer only echoes another rank's failure.
INPUT, BUG, PEER_LOST = "input", "bug", "peer_lost"
_PRIORITY = {INPUT: 0, BUG: 1, PEER_LOST: 2}


def is_worker() -> bool:
    """True inside a process started by torchrun (or another launcher that sets the rank)."""
    return "LOCAL_RANK" in os.environ or "RANK" in os.environ


@dataclass(frozen=True)
class WorkerError:
    rank: int
    kind: str
    message: str
    time: float


def record_worker_error(rank: int, kind: str, message: str) -> bool:
    """Called by a failing worker: hand its message to the launcher. False when no depthscale
    launcher is listening (plain torchrun), in which case the worker prints it itself."""
    directory = os.environ.get(ERROR_DIR_ENV)
    if not directory:
        return False
    record = {"rank": rank, "kind": kind, "message": message, "time": time.time()}
    try:
        tmp = Path(directory) / f"rank{rank}.json.tmp"
        tmp.write_text(json.dumps(record))
        tmp.rename(tmp.with_suffix(""))
    except OSError:
        return False
    return True


def read_worker_errors(directory: Path) -> list[WorkerError]:
    errors = []
    for file in sorted(directory.glob("rank*.json")):
        try:
            errors.append(WorkerError(**json.loads(file.read_text())))
        except (OSError, ValueError, TypeError):
            continue
    return errors


def root_cause(errors: list[WorkerError]) -> WorkerError | None:
    """The error that explains the failure: the most telling kind, then the earliest."""
    if not errors:
        return None
    return min(errors, key=lambda e: (_PRIORITY.get(e.kind, 1), e.time, e.rank))


_PEER_LOST_SIGNS = ("connection closed by peer", "connection reset by peer", "broken pipe")


def peer_lost(err: BaseException) -> bool:
    """A collective or point-to-point failed because another rank exited: a consequence of that
    rank's failure, not a cause of its own."""
    text = str(err).lower()
    return any(sign in text for sign in _PEER_LOST_SIGNS)


def quiet_elastic_logs() -> None:
    """The agent logs every worker's exit and a banner about OMP_NUM_THREADS; we report failures
    ourselves, once, and set the thread count. Its module loggers set their own levels."""
    for name in list(logging.root.manager.loggerDict):
        if name.startswith(("torch.distributed.elastic", "torch.distributed.run")):
            logging.getLogger(name).setLevel(logging.CRITICAL)


class _FirstStopSignal:
    """SIGINT / SIGTERM handler for the launcher: the first raises the agent's SignalException,
    upon which the agent forwards the signal to the workers and waits for them to save and exit;
    later ones (a second Ctrl-C, a scheduler repeating SIGTERM, `timeout` forwarding its own) are
    ignored, since torch's handler would raise again inside that shutdown and abandon the workers
    mid-save. The agent still kills workers that outlive its shutdown timeout."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self, exception_type: type) -> None:
        self.exception_type = exception_type
        self.received: int | None = None

    def __call__(self, signum: int, frame: object) -> None:
        if self.received is not None:
            return
        self.received = signum
        sig = signal.Signals(signum)
        raise self.exception_type(f"launcher got {sig.name}", sigval=sig)

    def install(self) -> dict[int, object]:
        # Leave these signals to us: the agent registers its own handler for whatever this
        # variable names when it starts the workers.
        os.environ["TORCHELASTIC_SIGNALS_TO_HANDLE"] = "SIGHUP,SIGQUIT"
        return {sig: signal.signal(sig, self) for sig in self.SIGNALS}


def launch(nproc: int, train_args: list[str], max_restarts: int = 0) -> int:
    """Run `python -m depthscale train TRAIN_ARGS` on `nproc` local workers; returns the exit code
    (0 when every worker succeeded) after printing a failing worker's message once."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run

    quiet_elastic_logs()
    previous = _FirstStopSignal(SignalException).install()
    # torchrun would set 1 thread per worker (with a warning); share the cores instead.
    os.environ.setdefault("OMP_NUM_THREADS", str(threads_per_rank(nproc)))
    argv = [
        "--standalone",
        f"--nproc-per-node={nproc}",
        f"--max-restarts={max_restarts}",
        "--module",
        "depthscale",
        "train",
        *train_args,
    ]
    with tempfile.TemporaryDirectory(prefix="depthscale-errors-") as directory:
        os.environ[ERROR_DIR_ENV] = directory
        notice = _ShutdownNotice(Path(directory))
        try:
            run(get_args_parser().parse_args(argv))
            return 0
        except ChildFailedError as failed:
            return _report_failure(failed, Path(directory))
        except SignalException as stop:
            # The agent forwarded the signal and waited for the workers: rank 0 has said where the
            # run stopped and resumes; exit as a process stopped by that signal would.
            return 128 + int(stop.sigval)
        finally:
            notice.stop()
            os.environ.pop(ERROR_DIR_ENV, None)
            for sig, handler in previous.items():
                signal.signal(sig, handler)


class _ShutdownNotice:
    """Once a worker has failed, torch's agent stops the others with SIGTERM and waits up to its
    shutdown timeout (30 s) before it kills them: a hung or stopped rank never answers, so the
    whole wait passed in silence. A thread says so once the wait has lasted `after_s`; a group
    that ends sooner (bad input in a worker: one line, then exit) prints nothing more."""

    def __init__(self, directory: Path, after_s: float = 5.0, poll_s: float = 0.5) -> None:
        self.directory, self.after_s, self.poll_s = directory, after_s, poll_s
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="shutdown-notice", daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        while not self._done.wait(self.poll_s):
            cause = root_cause(read_worker_errors(self.directory))
            if cause is not None and time.time() - cause.time >= self.after_s:
                print(
                    f"depthscale: rank {cause.rank} failed {self.after_s:.0f} s ago; waiting for "
                    "the other workers to stop (torch's agent kills those still running after its "
                    "shutdown timeout, 30 s by default)",
                    file=sys.stderr,
                    flush=True,
                )
                return

    def stop(self) -> None:
        self._done.set()
        self._thread.join()


def _report_failure(failed, directory: Path) -> int:
    cause = root_cause(read_worker_errors(directory))
    if cause is not None:
        print(cause.message, file=sys.stderr, flush=True)
        return 2 if cause.kind == INPUT else 1
    # No worker recorded an error: it was killed (OOM killer, SIGKILL) or died inside native code.
    rank, failure = min(failed.failures.items())
    how = (
        f"was killed by {failure.signal_name()}"
        if failure.exitcode < 0
        else f"exited with code {failure.exitcode}"
    )
    print(f"depthscale: worker rank {rank} {how} without an error message", file=sys.stderr)
    return 1
