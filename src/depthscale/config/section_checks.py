"""Config checks of whole sections, each failing with one message that names the key and what is
allowed: the data mixture ([[data.sources]], [[data.stages]]), evaluation ([[eval.tasks]],
[[eval.sets]]), resilience (nodes, ports), logging (the profiler's window and ranks, W&B), and the
one path rule every output directory obeys (`check_dir_creatable`). `validation.validate` runs
them in the order a user meets them."""

from __future__ import annotations

import contextlib
import importlib.util
import math
import os
import re
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

from depthscale.errors import ConfigError

if TYPE_CHECKING:
    from depthscale.config.schema import Config


def check_sections(cfg: Config) -> None:
    """Resilience, evaluation tasks, the mixture and the document masks."""
    _check_resilience(cfg)
    _check_eval_tasks(cfg)
    _check_mixture(cfg)
    if cfg.data.mask_eos_target and not cfg.data.document_mask:
        raise ConfigError(
            "data.mask_eos_target needs data.document_mask = true (it masks the loss of packed "
            "documents)"
        )


def check_logging(cfg: Config) -> None:
    """The MFU alarm, the profiler's window and ranks, W&B."""
    t = cfg.train
    if cfg.logging.mfu_alarm >= 1:
        raise ConfigError(
            f"logging.mfu_alarm={cfg.logging.mfu_alarm} must be in [0, 1) "
            "(a fraction of the best MFU; 0 = off)"
        )
    window = profile_window_steps(cfg.logging.profile_steps)
    if window is not None and window[1] > t.steps:
        raise ConfigError(
            f"logging.profile_steps={cfg.logging.profile_steps!r} ends after train.steps={t.steps}"
        )
    profile_window_ranks(cfg.logging.profile_ranks)
    if cfg.logging.wandb and importlib.util.find_spec("wandb") is None:
        raise ConfigError(
            "logging.wandb=true needs the wandb package, which is not installed; allowed: "
            "pip install 'depthscale[wandb]', or logging.wandb=false"
        )


def profile_window_steps(text: str) -> tuple[int, int] | None:
    """`logging.profile_steps` as (first, last) steps, 1-based and inclusive; None when off."""
    if not text.strip():
        return None
    first, _, last = text.strip().partition("-")
    try:
        window = int(first), int(last or first)
    except ValueError:
        window = (0, 0)
    if not 1 <= window[0] <= window[1]:
        raise ConfigError(
            f"logging.profile_steps={text!r} is not allowed; allowed: 'FIRST-LAST' or one step, "
            "steps from 1 with FIRST <= LAST (e.g. '20-22'), or '' (off)"
        )
    return window


def profile_window_ranks(text: str, world: int | None = None) -> set[int] | None:
    """`logging.profile_ranks` as a set of ranks (None: every rank); with `world`, each must be a
    rank of the job."""
    if text.strip() == "all":
        return None
    try:
        ranks = {int(r) for r in text.split(",")}
    except ValueError:
        ranks = {-1}
    if min(ranks) < 0 or (world is not None and max(ranks) >= world):
        within = f" below the world size {world}" if world is not None else ""
        raise ConfigError(
            f"logging.profile_ranks={text!r} is not allowed; allowed: 'all' or ranks{within}, "
            "comma separated (e.g. '0' or '0,7')"
        )
    return ranks


def check_dir_creatable(key: str, path: Path) -> None:
    """The directory exists or can be made: nothing on its way is a regular file, and the nearest
    existing ancestor is writable. Checked up front so a run fails before any work, not at its
    first write."""
    if path.exists() and not path.is_dir():
        raise ConfigError(f"{key}: {str(path)!r} is a file; allowed: a directory path")
    existing = path
    while not existing.exists():
        if existing.parent == existing:
            break
        existing = existing.parent
    if existing.exists() and not existing.is_dir():
        raise ConfigError(
            f"{key}: {str(path)!r} cannot be created because {str(existing)!r} is a file; "
            "allowed: a path whose parents are directories"
        )
    if existing.is_dir() and not _can_create_in(existing):
        raise ConfigError(
            f"{key}: {str(path)!r} cannot be written ({str(existing)!r} is not writable)"
        )


def _can_create_in(directory: Path) -> bool:
    """Whether a file can be made in `directory`, tried rather than asked: `os.access` says yes
    to root on a read-only or virtual file system (/proc, a read-only mount), where the first
    write then fails at the end of the work."""
    if not os.access(directory, os.W_OK | os.X_OK):
        return False
    try:
        fd, probe = tempfile.mkstemp(prefix=".depthscale-probe-", dir=directory)
    except OSError:
        return False
    os.close(fd)
    with contextlib.suppress(OSError):
        os.unlink(probe)
    return True


_TASK_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")


def _check_eval_tasks(cfg: Config) -> None:
    """Every [[eval.tasks]] entry names a file and a unique, loggable name (what the file holds
    is read by `evaluation.multiple_choice.read_task` before training starts); every
    [[eval.sets]] entry a corpus and a unique name."""
    seen: set[str] = set()
    for i, task in enumerate(cfg.eval.tasks):
        key = f"eval.tasks[{i}]"
        if not task.path.strip():
            raise ConfigError(f"{key}.path is empty; allowed: a JSONL file of questions")
        path = Path(task.path).expanduser()
        if not path.is_file():
            what = "is a directory" if path.is_dir() else "does not exist"
            raise ConfigError(
                f"{key}.path={task.path!r} {what}; allowed: a JSONL file of questions"
            )
        if task.limit < 0:
            raise ConfigError(f"{key}.limit={task.limit} must be >= 0 (0 = every question)")
        if not _TASK_NAME.fullmatch(task.label):
            raise ConfigError(
                f"{key}.name={task.label!r} cannot name a metric; allowed: letters, digits, "
                "'_', '.', '-', starting with a letter or digit"
            )
        if task.label in seen:
            raise ConfigError(
                f"{key}: a second task named {task.label!r}; allowed: distinct names "
                "(set eval.tasks[i].name)"
            )
        seen.add(task.label)
    names: list[str] = []
    for i, entry in enumerate(cfg.eval.sets):
        key = f"eval.sets[{i}]"
        _check_name(key, entry.name, "set", names)
        if not entry.path.strip() or not Path(entry.path).expanduser().exists():
            raise ConfigError(
                f"{key}.path={entry.path!r} does not exist; allowed: a corpus (docs/data.md)"
            )


def _check_name(key: str, name: str, what: str, taken: list[str]) -> None:
    """An entry's name: loggable in a metric's name, and not one an earlier entry has (added)."""
    if not _TASK_NAME.fullmatch(name):
        raise ConfigError(
            f"{key}.name={name!r} cannot name a {what}; allowed: letters, digits, '_', '.', '-', "
            "starting with a letter or digit"
        )
    if name in taken:
        raise ConfigError(f"{key}: a second {what} named {name!r}; allowed: distinct names")
    taken.append(name)


def _check_mixture(cfg: Config) -> None:
    """[[data.sources]]: named, existing, positive weights, instead of data.path;
    [[data.stages]]: rising steps inside the run, weights of known sources."""
    d = cfg.data
    if not d.sources:
        if d.stages:
            raise ConfigError("data.stages needs data.sources (stages change a mixture's weights)")
        return
    if d.path != "stdlib":
        raise ConfigError(
            f"data.path={d.path!r} and data.sources are both set; allowed: one of them "
            "(a mixture's corpora are its sources' paths)"
        )
    names: list[str] = []
    for i, src in enumerate(d.sources):
        key = f"data.sources[{i}]"
        _check_name(key, src.name, "source", names)
        if not src.path.strip():
            raise ConfigError(f"{key}.path is empty; allowed: a corpus (docs/data.md)")
        if not Path(src.path).expanduser().exists():
            raise ConfigError(f"{key}.path={src.path!r} does not exist")
        if not (0 < src.weight < math.inf):
            raise ConfigError(f"{key}.weight={src.weight} must be a finite number > 0")
        if not (0 <= src.max_epochs < math.inf):
            raise ConfigError(f"{key}.max_epochs={src.max_epochs} must be >= 0 (0 = no limit)")
    previous = 0
    for i, stage in enumerate(d.stages):
        key = f"data.stages[{i}]"
        if not previous < stage.at_step <= cfg.train.steps:
            raise ConfigError(
                f"{key}.at_step={stage.at_step}: allowed: a step after the previous stage's "
                f"({previous}) and at most train.steps={cfg.train.steps}"
            )
        previous = stage.at_step
        unknown = [n for n in stage.weights if n not in names]
        if unknown:
            raise ConfigError(
                f"{key}.weights names {', '.join(map(repr, unknown))}, not a source; allowed: "
                + ", ".join(names)
            )
        if not all(0 <= w < math.inf for w in stage.weights.values()) or not any(
            w > 0 for w in stage.weights.values()
        ):
            raise ConfigError(
                f"{key}.weights={stage.weights}: allowed: finite weights >= 0, at least one > 0"
            )


def _check_resilience(cfg: Config) -> None:
    """(`resilience.faults` is parsed by the CLI and the trainer: its grammar lives with the
    faults, in resilience/faults.py.)"""
    r, p = cfg.resilience, cfg.parallel
    if p.nnodes < 1 or not 0 <= p.node_rank < p.nnodes:
        raise ConfigError(
            f"parallel.nnodes={p.nnodes}, parallel.node_rank={p.node_rank}: allowed: nnodes >= 1 "
            "and 0 <= node_rank < nnodes"
        )
    if not 0 <= p.master_port <= 65535 or (p.nnodes > 1 and p.master_port == 0):
        raise ConfigError(
            f"parallel.master_port={p.master_port} is not allowed; allowed: 1..65535 (0, any "
            "free port, only with parallel.nnodes=1)"
        )
    if p.nnodes > 1 and (r.local_nodes > 1 or r.spare_nodes):
        raise ConfigError(
            "resilience.local_nodes / spare_nodes simulate nodes on one host; with "
            f"parallel.nnodes={p.nnodes} every node is real: allowed: local_nodes=1, spare_nodes=0"
        )
    nproc = cfg.parallel.nproc
    if r.local_nodes > 1 and nproc % r.local_nodes:
        raise ConfigError(
            f"resilience.local_nodes={r.local_nodes} must divide the {nproc} local processes "
            f"(--nproc); allowed: a divisor of {nproc}"
        )
