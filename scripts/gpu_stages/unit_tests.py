"""Stage unit_tests: the unit tests marked `cuda` in the kernel, attention and dispatch test files —
the cases that run only where CUDA exists (the real kernels against fp64, CUDA streams).

One pytest run over the files that exist (the list is a set of patterns, so test files added or
renamed by later changes are picked up), read line by line from `pytest -v` so that a run cut short
by the timeout still reports every test that finished. One line per file, one for the whole run.

On the GPU only those (`-m cuda`): everything else runs in CI on every commit, and compiling the
dozens of Triton variants the CPU tests interpret would cost the check a minute or two. The
ahead-of-time compile test and the C++ CPU kernels' build are excluded outright (`EXCLUDED`):
useless on a GPU and slow; `DEPTHSCALE_CPU_KERNELS=0` (the driver's) keeps any CPU read on the
PyTorch ops. The dry run runs one small file (test_attention_tiles.py, all of it: CI runs them
anyway), which proves the run and the counting.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from collections import Counter

from gpu_stages.common import REPO, Context, OutOfBounds

PATTERNS = (
    "test_kernels.py",
    "test_kernel_dispatch.py",
    "test_kernel_*.py",
    "test_*triton*.py",
    "test_attention*.py",
    "test_window_attention.py",
    "test_memory.py",
    "test_device_time.py",
)
EXCLUDED = ("aot", "kernel_build", "cpu_kernel")
"""Test files whose name holds one of these: the AOT compile for sm_90a/sm_80 (61 variants × 2
architectures) and the C++ CPU kernels — CPU-side, minutes, nothing a GPU adds."""
DRY_RUN_FILE = "test_attention_tiles.py"
OUTCOME = re.compile(r"^(?P<id>\S+::\S+)\s+(?P<outcome>PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)\b")
SUMMARY = re.compile(r"(\d+) (passed|failed|errors?|skipped|deselected|xfailed|xpassed)")


def files() -> list[str]:
    found: list[str] = []
    for pattern in PATTERNS:
        for path in sorted((REPO / "tests" / "unit").glob(pattern)):
            rel = str(path.relative_to(REPO))
            if not any(word in path.name for word in EXCLUDED) and rel not in found:
                found.append(rel)
    return found


def run(ctx: Context) -> None:
    selected = files()
    if not selected:
        ctx.emit("pytest", status="failed", error=f"no test file matches {PATTERNS} in tests/unit")
        return
    if ctx.dry_run:
        dry = [f for f in selected if f.endswith(DRY_RUN_FILE)]
        selected, selection = dry or selected[:1], "all"
    else:
        selection = "cuda"
    cmd = [sys.executable, "-m", "pytest", "-v", "-rfE", "--color=no", "-p", "no:cacheprovider"]
    cmd += ["-m", selection] if selection != "all" else []
    cmd += selected
    log = ctx.work / f"{ctx.stage}_pytest.log"
    limit = max(10.0, ctx.time_left() - 8)  # leave time to write the lines
    with open(log, "w") as f:
        proc = subprocess.Popen(
            cmd, cwd=REPO, stdout=f, stderr=subprocess.STDOUT, start_new_session=True
        )
        timed_out = False
        try:
            rc = proc.wait(timeout=limit)
        except subprocess.TimeoutExpired:
            timed_out = True
            os.killpg(proc.pid, signal.SIGKILL)
            rc = proc.wait()
    text = log.read_text(errors="replace")
    sys.stdout.write(text[-20000:])  # into the stage's log
    report(ctx, text, rc, timed_out, limit, selected, selection)


def report(
    ctx: Context,
    text: str,
    rc: int,
    timed_out: bool,
    limit: float,
    selected: list[str],
    selection: str,
) -> None:
    per_file: dict[str, Counter] = {f: Counter() for f in selected}
    failures: list[str] = []
    for line in text.splitlines():
        m = OUTCOME.match(line)
        if not m:
            continue
        test_id, outcome = m["id"], m["outcome"].lower()
        per_file.setdefault(test_id.split("::")[0], Counter())[outcome] += 1
        if outcome in ("failed", "error"):
            failures.append(test_id)
    for name, counts in per_file.items():
        if not counts:
            continue  # every test of the file deselected, or not reached
        values = dict(counts)
        bad = [t for t in failures if t.startswith(name + "::")]
        if bad:
            ctx.emit(f"pytest {name}", values | {"failures": bad[:20]}, "failed",
                     f"{len(bad)} failed: {', '.join(t.split('::', 1)[1] for t in bad[:5])}")  # fmt: skip
        else:
            ctx.emit(f"pytest {name}", values)
    summary = {}
    summary_lines = [ln for ln in text.splitlines() if ln.startswith("=") and " in " in ln]
    if summary_lines:
        for count, kind in SUMMARY.findall(summary_lines[-1]):
            summary[kind.rstrip("s") if kind.startswith("error") else kind] = int(count)
    totals = sum(per_file.values(), Counter())
    values = {
        "counts": summary or dict(totals),
        "rc": rc,
        "files": selected,
        "selection": selection,
        "timed_out": timed_out,
        "failures": failures[:30],
    }

    def verdict() -> dict:
        if timed_out:
            raise OutOfBounds(f"pytest killed after {limit:.0f} s; counts are of the tests that "
                              "finished", values)  # fmt: skip
        if rc != 0 or failures or not totals.get("passed"):
            raise OutOfBounds(f"pytest exit status {rc}, {len(failures)} failed", values)
        return values

    ctx.measure("pytest", verdict)
