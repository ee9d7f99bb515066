"""One prepared check of depthscale on one GPU: about 8 minutes, JSON lines out.

    PYTHONPATH=src python scripts/gpu_check.py                 # on the GPU machine
    PYTHONPATH=src python scripts/gpu_check.py --dry-run       # every stage on CPU, tiny shapes

Each stage (gpu_stages/__init__.py lists them, in order) runs in a subprocess of its own with a
timeout of its own: a hang or a CUDA crash in one stage costs that stage alone (under --dry-run
the subprocess is forked from the driver, which imports torch once: `_prepare_dry_run`). Every
measurement is one line of `gpu_check.jsonl` in the output folder (--out, else $OUT, else
./gpu_check_out), written the moment it is measured:

    {"stage", "name", "status": ok|failed|timeout|skipped, "values": {...}, "error", "time"}

then one line per stage (name "stage": its status, seconds, exit code) and a last line (stage
"check", name "summary"). The stages' own output goes to `gpu_check.log` beside it. docs/gpu.md
says how to read the lines and what good values look like.

It installs nothing and needs no network: torch, triton and pytest (transformers for the last
stage, which is skipped without it). Under --dry-run the stages run on CPU (CUDA hidden, Triton
interpreted), at tiny shapes, in under a minute; the test suite runs it
(tests/e2e/test_gpu_check.py), so the check cannot rot between GPU sessions. Exit status: 0 when no
stage failed, 1 when one did, 2 for bad input.

GPU_CHECK_FAULT="STAGE=abort,STAGE=hang" makes those stages' subprocesses abort or hang at start:
how the tests prove that one stage's crash or hang leaves the others' results.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import re
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_stages import BY_NAME, STAGES, Stage  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
JSONL, LOG = "gpu_check.jsonl", "gpu_check.log"
BUDGET_S = 470.0
"""Default seconds for the whole check: 8 minutes less a margin for the driver itself."""
DRY_BUDGET_S = 900.0


class BadInput(Exception):
    """Bad command-line input: printed as one line, exit status 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line instead of usage + error
        raise BadInput(f"{message} (see --help)")


def parse_args(argv: list[str]) -> argparse.Namespace:
    stages = "\n".join(f"  {s.name:<11} {s.timeout_s:>4.0f} s  {s.what}" for s in STAGES)
    p = _Parser(
        prog="gpu_check.py",
        description=__doc__.split("\n")[0],
        epilog=f"stages, in order, with their timeouts on a GPU:\n{stages}",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--dry-run", action="store_true", help="every stage on CPU at tiny shapes")
    p.add_argument("--out", help="output folder (default: $OUT, else ./gpu_check_out)")
    p.add_argument("--only", help="comma-separated stages to run (default: all)")
    p.add_argument(
        "--budget",
        type=float,
        help=f"seconds for the whole check (default {BUDGET_S:.0f}; dry run {DRY_BUDGET_S:.0f})",
    )
    p.add_argument(
        "--stage-timeout",
        action="append",
        default=[],
        metavar="[STAGE=]SECONDS",
        help="override a stage's timeout (every stage's without STAGE=); repeatable",
    )
    p.add_argument("--keep-work", action="store_true", help="keep the scratch folder (run dirs)")
    # the subprocess side: one stage
    p.add_argument("--stage", help=argparse.SUPPRESS)
    p.add_argument("--jsonl", help=argparse.SUPPRESS)
    p.add_argument("--work", help=argparse.SUPPRESS)
    p.add_argument("--timeout", type=float, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.budget is not None and not args.budget > 0:
        raise BadInput(f"--budget {args.budget:g} must be > 0 seconds")
    return args


def selected_stages(only: str | None) -> list[Stage]:
    if not only:
        return list(STAGES)
    names = [n.strip() for n in only.split(",") if n.strip()]
    unknown = [n for n in names if n not in BY_NAME]
    if unknown or not names:
        raise BadInput(
            f"--only {only!r}: unknown stage {', '.join(unknown) or '(none given)'}; "
            f"allowed: {', '.join(BY_NAME)}"
        )
    return [s for s in STAGES if s.name in names]


def timeouts(specs: list[str], dry_run: bool) -> dict[str, float]:
    """Each stage's timeout, with the --stage-timeout overrides applied."""
    result = {s.name: s.dry_timeout_s if dry_run else s.timeout_s for s in STAGES}
    for spec in specs:
        name, _, seconds = spec.rpartition("=")
        try:
            value = float(seconds)
        except ValueError:
            value = float("nan")
        if not value > 0 or (name and name not in BY_NAME):
            raise BadInput(
                f"--stage-timeout {spec!r}: expected [STAGE=]SECONDS with SECONDS > 0 and STAGE "
                f"one of {', '.join(BY_NAME)}"
            )
        for stage in [name] if name else list(result):
            result[stage] = value
    return result


def output_folder(given: str | None) -> Path:
    """--out, else $OUT, else ./gpu_check_out; created, and proven writable by starting the file."""
    folder = Path(given or os.environ.get("OUT") or "gpu_check_out").absolute()
    try:
        folder.mkdir(parents=True, exist_ok=True)
        (folder / JSONL).write_text("")
        (folder / LOG).write_text("")
    except OSError as err:
        reason = err.strerror or err
        raise BadInput(f"cannot write to the output folder {str(folder)!r}: {reason}") from None
    return folder


def write_line(path: Path, line: dict) -> None:
    with open(path, "a+", encoding="utf-8") as f:
        f.seek(0, os.SEEK_END)
        if f.tell():  # a stage killed mid-line leaves no newline: start a fresh line
            f.seek(f.tell() - 1)
            if f.read(1) != "\n":
                f.write("\n")
        f.write(json.dumps(line) + "\n")


def now() -> str:
    return datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")


def stage_env(stage: Stage, dry_run: bool, work: Path) -> dict[str, str]:
    env = dict(os.environ)
    path = [str(REPO / "src"), str(REPO / "scripts"), env.get("PYTHONPATH", "")]
    env["PYTHONPATH"] = os.pathsep.join(p for p in path if p)
    env["PYTHONUNBUFFERED"] = "1"
    # fresh compiler caches per check, one of each for all stages: first-call and first-step
    # seconds are cold where a kernel or graph is first compiled (the kernels stage compiles the
    # AttnRes variants before any other stage needs them), warm after that
    env["TRITON_CACHE_DIR"] = str(work / "triton_cache")
    env["TORCHINDUCTOR_CACHE_DIR"] = str(work / "inductor_cache")
    # a read that misses its fused kernel raises instead of silently running the PyTorch ops
    env.setdefault("DEPTHSCALE_STRICT_KERNELS", "1")
    # no C++ CPU kernel build inside a timed check: a CPU read (references, CPU-side tests) takes
    # the PyTorch ops, a chosen fallback that strict mode allows
    env["DEPTHSCALE_CPU_KERNELS"] = "0"
    if dry_run:
        env["CUDA_VISIBLE_DEVICES"] = ""  # CPU even on a GPU machine
        env["TRITON_INTERPRET"] = "1"
    else:
        env.update(stage.env)  # e.g. TORCH_CUDA_SANITIZER, which asserts on a CPU-only torch
    return env


def read_lines(path: Path, offset: int) -> list[dict]:
    """The whole lines written from byte `offset` on (a last partial line is ignored)."""
    with open(path, "rb") as f:
        f.seek(offset)
        data = f.read()
    lines = []
    for raw in data.split(b"\n")[:-1]:  # the last piece is empty, or a partial line
        try:
            lines.append(json.loads(raw))
        except ValueError:
            continue
    return lines


def log_tail(path: Path, offset: int, n: int = 6) -> str:
    with open(path, "rb") as f:
        f.seek(offset)
        text = f.read().decode("utf-8", "replace")
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    return " | ".join(lines[-n:])[-900:]


def _children_cpu_s() -> float:
    """CPU seconds of the subprocesses waited for so far (a stage's, with its own children)."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _prepare_dry_run(stages: list[Stage], work: Path) -> None:
    """Under --dry-run each stage is forked from this process (`_ForkedStage`) instead of started
    afresh: this process takes the stages' environment (the same for every stage on CPU: the
    stage-specific `Stage.env` is a GPU run's) and imports torch and the stages' modules once, the
    ~3 s that each of 11 fresh interpreters paid. The GPU run keeps a fresh interpreter per stage:
    a CUDA context never crosses a fork, and each stage's first-call seconds are its own."""
    os.environ.update(stage_env(stages[0], True, work))
    os.chdir(REPO)
    sys.path[:0] = [str(REPO / "src"), str(REPO / "scripts")]
    import importlib

    for name in ["torch", "gpu_stages.common", *(f"gpu_stages.{s.module}" for s in stages)]:
        with contextlib.suppress(Exception):  # one that cannot import fails in its own stage
            importlib.import_module(name)


class _ForkedStage:
    """A stage's process forked from the dry run's driver (`_prepare_dry_run`), with what
    `run_stage` uses of a `subprocess.Popen`: `pid` (its own session and process group, so a
    timeout kills its children too) and `wait(timeout)`; its stdout and stderr go to `log`. A
    crash or hang in it costs that stage alone, as a fresh process's would."""

    def __init__(self, argv: list[str], log) -> None:
        sys.stdout.flush()
        sys.stderr.flush()
        self.pid = os.fork()
        if self.pid == 0:  # the stage: never returns into the driver's code
            rc = 70
            try:
                os.setsid()
                os.dup2(log.fileno(), 1)
                os.dup2(log.fileno(), 2)
                for stream in (sys.stdout, sys.stderr):  # what PYTHONUNBUFFERED=1 gives a process
                    stream.reconfigure(line_buffering=True, write_through=True)
                rc = run_one_stage(parse_args(argv))
            except BaseException:  # noqa: BLE001 - report it in the log, end only this process
                import traceback

                traceback.print_exc()
            finally:
                with contextlib.suppress(Exception):
                    sys.stdout.flush()
                    sys.stderr.flush()
                os._exit(rc)

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            pid, status = os.waitpid(self.pid, 0 if deadline is None else os.WNOHANG)
            if pid:
                return os.waitstatus_to_exitcode(status)
            if time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(str(self.pid), timeout)
            time.sleep(0.02)


def run_stage(
    stage: Stage, timeout: float, args: argparse.Namespace, out: Path, work: Path
) -> dict:
    """Run one stage's subprocess to its end or its timeout; returns its stage line."""
    jsonl, log = out / JSONL, out / LOG
    cmd = [sys.executable, str(Path(__file__).resolve()), "--stage", stage.name]
    cmd += ["--jsonl", str(jsonl), "--work", str(work), "--timeout", f"{timeout:.1f}"]
    cmd += ["--dry-run"] if args.dry_run else []
    offset, log_offset = jsonl.stat().st_size, log.stat().st_size
    with open(log, "ab") as f:
        f.write(f"\n===== {stage.name} ({now()}, timeout {timeout:.0f} s) =====\n".encode())
        f.flush()
        t0, cpu0 = time.monotonic(), _children_cpu_s()
        if args.dry_run:
            proc = _ForkedStage(cmd[2:], f)
        else:
            proc = subprocess.Popen(
                cmd,
                cwd=REPO,
                env=stage_env(stage, args.dry_run, work),
                stdout=f,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # its own process group: a timeout kills its children too
            )
        timed_out = False
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            timed_out = True
        with contextlib.suppress(ProcessLookupError):  # its group: what it left running too
            os.killpg(proc.pid, signal.SIGKILL)
        rc = proc.wait() if timed_out else rc
        seconds, cpu = time.monotonic() - t0, _children_cpu_s() - cpu0
    lines = read_lines(jsonl, offset)
    bad = [ln for ln in lines if ln.get("status") in ("failed", "timeout")]
    values = {"seconds": round(seconds, 1), "cpu_s": round(cpu, 1), "timeout_s": timeout}
    values |= {"rc": rc, "lines": len(lines)}
    problems = []
    if bad:
        problems.append(f"{len(bad)} failed: {', '.join(b['name'] for b in bad[:8])}")
    # 0: all ok; 1: the stage's own "a line failed"; anything else: the process itself broke
    broke = timed_out or rc not in (0, 1) or (rc == 1 and not bad) or not lines
    if timed_out:
        last = lines[-1]["name"] if lines else "none"
        problems.append(f"killed after {timeout:.0f} s; last line written: {last}")
    elif broke:
        how = f"signal {signal.Signals(-rc).name}" if rc < 0 else f"exit status {rc}"
        problems.append(f"the stage's process ended with {how}")
    if not lines:
        problems.append("the stage wrote no line")
    if broke:
        problems.append(f"log: {log_tail(log, log_offset)}")
    status = "timeout" if timed_out else "failed" if problems else "ok"
    error = "; ".join(problems) or None
    line = {"stage": stage.name, "name": "stage", "status": status, "values": values}
    line |= {"error": error, "time": now()}
    write_line(jsonl, line)
    return line


def device_slug(jsonl: Path) -> str:
    """'h200' for 'NVIDIA H200', 'cpu' off CUDA: the <device> of the results file's name."""
    for line in read_lines(jsonl, 0):
        if line.get("stage") == "env" and line.get("name") == "device":
            name = str(line.get("values", {}).get("name", "unknown")).lower()
            words = [w for w in re.findall(r"[a-z0-9]+", name) if w not in ("nvidia", "tesla")]
            return words[0] if words else "unknown"
    return "unknown"


def share(
    left: float, limit: float, floor: float, later: list[tuple[float, float]]
) -> float | None:
    """The timeout of a stage started with `left` seconds of the budget: its own `limit`, or what
    is left after keeping each later stage's (limit, floor) floor, whichever is less; None (skip
    it) when that is below its own floor (or its limit, if that is lower)."""
    reserve = sum(min(f, lim) for lim, f in later)
    timeout = min(limit, left - reserve)
    return timeout if timeout >= min(floor, limit) else None


def budget_table(limits: dict[str, float], budget: float) -> str:
    """The stages' limits on a GPU and their sum against the budget: what --dry-run prints first,
    so the check's fit is read without a GPU."""
    gpu = {s.name: limits.get(s.name, s.timeout_s) for s in STAGES}
    rows = [f"  {s.name:<11} {gpu[s.name]:>4.0f} s  (floor {s.floor_s:.0f} s)" for s in STAGES]
    total = sum(gpu.values())
    return "\n".join(["stage budgets on a GPU:", *rows,
                      f"  {'total':<11} {total:>4.0f} s of {budget:.0f} s"])  # fmt: skip


def goals_of(lines: list[dict]) -> dict:
    """Every goal the stages judged (`common.goal`): 'stage/measurement/goal' → met (bool), and
    the counts."""
    found = {}
    for line in lines:
        for name, g in (line.get("values") or {}).get("goals", {}).items():
            found[f"{line['stage']}/{line['name']}/{name}"] = g.get("met")
    met = sum(1 for v in found.values() if v)
    return {"met": met, "missed": len(found) - met, "each": found}


def device_name(jsonl: Path) -> str:
    for line in read_lines(jsonl, 0):
        if line.get("stage") == "env" and line.get("name") == "device":
            return str(line.get("values", {}).get("name", "unknown"))
    return "unknown"


def drive(args: argparse.Namespace) -> int:
    stages = selected_stages(args.only)
    limits = timeouts(args.stage_timeout, args.dry_run)
    out = output_folder(args.out)
    budget = args.budget or (DRY_BUDGET_S if args.dry_run else BUDGET_S)
    jsonl = out / JSONL
    work = Path(tempfile.mkdtemp(prefix="gpu_check_"))
    start = time.monotonic()
    header = {"dry_run": args.dry_run, "stages": [s.name for s in stages], "budget_s": budget}
    header |= {"argv": sys.argv[1:], "python": sys.version.split()[0], "cwd": str(REPO)}
    write_line(jsonl, {"stage": "check", "name": "start", "status": "ok", "values": header,
                       "error": None, "time": now()})  # fmt: skip
    if args.dry_run:  # the budgets a GPU run would have (this run's own are the dry limits)
        gpu_limits = timeouts(args.stage_timeout, dry_run=False)
        print(budget_table(gpu_limits, args.budget or BUDGET_S), flush=True)
    print(f"gpu_check: {len(stages)} stages, budget {budget:.0f} s, lines in {jsonl}", flush=True)
    results = []
    try:
        if args.dry_run:
            _prepare_dry_run(stages, work)
        for i, stage in enumerate(stages):
            left = budget - (time.monotonic() - start)
            later = [(limits[s.name], s.floor_s) for s in stages[i + 1 :]]
            timeout = share(left, limits[stage.name], stage.floor_s, later)
            if timeout is None:
                line = {"stage": stage.name, "name": "stage", "status": "skipped",
                        "values": {"seconds_left": round(left, 1)},
                        "error": f"time budget: {left:.0f} s left of {budget:.0f} s",
                        "time": now()}  # fmt: skip
                write_line(jsonl, line)
            else:
                line = run_stage(stage, timeout, args, out, work)
            results.append(line)
            v = line["values"]
            took = f"{v['seconds']:6.1f} s" if "seconds" in v else "       -"
            print(f"  {stage.name:<11} {line['status']:<8} {took}  {line['error'] or ''}"[:200],
                  flush=True)  # fmt: skip
    finally:
        if not args.keep_work:
            shutil.rmtree(work, ignore_errors=True)
    failed = [r["stage"] for r in results if r["status"] in ("failed", "timeout")]
    date = datetime.date.today().isoformat()
    results_file = f"benchmarks/results/gpu_check_{device_slug(jsonl)}_{date}.jsonl"
    summary = {
        "stages": {r["stage"]: r["status"] for r in results},
        "failed": failed,
        "goals": goals_of(read_lines(jsonl, 0)),
        "seconds": round(time.monotonic() - start, 1),
        "dry_run": args.dry_run,
        "device": device_name(jsonl),
        "date": date,
        "results_file": results_file,
    }
    if args.keep_work:
        summary["work"] = str(work)
    write_line(jsonl, {"stage": "check", "name": "summary",
                       "status": "failed" if failed else "ok", "values": summary,
                       "error": f"failed: {', '.join(failed)}" if failed else None,
                       "time": now()})  # fmt: skip
    goals = summary["goals"]
    print(f"gpu_check: {'FAILED ' + ', '.join(failed) if failed else 'ok'} in "
          f"{summary['seconds']:.0f} s; goals met {goals['met']}, missed {goals['missed']}")  # fmt: skip
    # the results under their committed name: beside the lines (what comes back from a device
    # machine) and, on a GPU, in the checkout's benchmarks/results/ too
    shutil.copyfile(jsonl, out / Path(results_file).name)
    if not args.dry_run:
        with contextlib.suppress(OSError):  # a read-only checkout still has the copy in --out
            shutil.copyfile(jsonl, REPO / results_file)
    print(f"gpu_check: results in {out / Path(results_file).name}"
          + ("" if args.dry_run else f" and {results_file}"))  # fmt: skip
    return 1 if failed else 0


def run_one_stage(args: argparse.Namespace) -> int:
    """The subprocess side: run one stage, its lines appended to --jsonl."""
    faults = dict(
        f.split("=", 1) for f in os.environ.get("GPU_CHECK_FAULT", "").split(",") if "=" in f
    )
    if faults.get(args.stage) == "abort":
        os.abort()
    if faults.get(args.stage) == "hang":
        time.sleep(10**6)
    import importlib

    from gpu_stages.common import Context, one_line

    stage = BY_NAME[args.stage]
    ctx = Context(stage.name, Path(args.jsonl), Path(args.work), args.dry_run, args.timeout)
    if not args.dry_run and not ctx.cuda and stage.name != "env":
        ctx.emit("device", status="failed",
                 error="no CUDA device (torch.cuda.is_available() is False); --dry-run runs "
                 "every stage on CPU")  # fmt: skip
        return 1
    try:
        run = getattr(importlib.import_module(f"gpu_stages.{stage.module}"), stage.function)
        run(ctx)
    except Exception as err:  # noqa: BLE001 - the stage's own line says what broke
        import traceback

        traceback.print_exc()
        ctx.emit("stage_error", status="failed", error=one_line(err))
    return 1 if ctx.failed else 0


def main(argv: list[str] | None = None) -> int:
    try:
        args = parse_args(sys.argv[1:] if argv is None else argv)
        if args.stage:
            if args.stage not in BY_NAME or not (args.jsonl and args.work and args.timeout):
                raise BadInput("--stage needs a known stage, --jsonl, --work and --timeout")
            return run_one_stage(args)
        return drive(args)
    except BadInput as err:
        print(f"gpu_check.py: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
