"""The CPU kernels' build: named by the interpreter and torch as well as the sources, run under a
lock that dies with its holder (real processes, SIGKILL), and the lines a user sees meanwhile. A
stand-in build function replaces the compile (which takes ~40 s; the suite compiles once, in the
`cpu_ops` fixture, through the same `build_locked`)."""

import os
import re
import select
import signal
import subprocess
import sys
import time

import pytest
import torch
from torch.utils.cpp_extension import FileBaton

from depthscale.kernels import attnres_cpu
from depthscale.kernels.attnres_cpu import CFLAGS, build_env, build_locked, library_name

PROMPT_S = 5.0
"""A lock its holder's death released is taken at once; 5 s leaves room for a loaded 2-core box."""

HOLDER = """
import sys, time
from pathlib import Path
from torch.utils.cpp_extension import FileBaton
from depthscale.kernels.attnres_cpu import build_locked

directory = Path(sys.argv[1])

def build():
    FileBaton(str(directory / "lock")).try_acquire()  # what torch's build does first
    print("building", flush=True)
    time.sleep(300)

build_locked(directory, directory / "lib.so", build)
"""

WAITER = """
import sys, time
from pathlib import Path
from depthscale.kernels.attnres_cpu import build_locked

directory = Path(sys.argv[1])
print("ready", flush=True)
build_locked(directory, directory / "lib.so", lambda: print("in", time.monotonic(), flush=True))
"""


def _spawn(script: str, directory) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k != "RANK"}  # rank 0: it reports its wait
    return subprocess.Popen(
        [sys.executable, "-c", script, str(directory)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        bufsize=0,
        env=env,
    )


def _wait_for(proc: subprocess.Popen, stream, pattern: str, timeout_s: float = 120.0) -> re.Match:
    """The first match of `pattern` in what `stream` of `proc` says (imports take seconds here)."""
    seen, deadline = "", time.monotonic() + timeout_s
    while (found := re.search(pattern, seen)) is None:
        ready, _, _ = select.select([stream], [], [], max(0.0, deadline - time.monotonic()))
        chunk = os.read(stream.fileno(), 4096) if ready else b""
        if not chunk:
            proc.kill()
            raise AssertionError(f"no {pattern!r} within {timeout_s} s: {seen!r}")
        seen += chunk.decode()
    return found


def _reap(*procs: subprocess.Popen) -> None:
    for proc in procs:
        proc.kill()
        proc.communicate()


def _holder_in_a_build(directory) -> subprocess.Popen:
    holder = _spawn(HOLDER, directory)
    _wait_for(holder, holder.stdout, "building")
    return holder


def test_a_killed_build_holds_up_no_later_build(tmp_path):
    """SIGKILL in the middle of a build (torch's `lock` file created): the next process builds at
    once instead of waiting for torch's file to go stale."""
    holder = _holder_in_a_build(tmp_path)
    _reap(holder)
    assert (tmp_path / "lock").exists()  # torch's file outlives its holder

    def build() -> str:
        assert FileBaton(str(tmp_path / "lock")).try_acquire(), "torch would wait on it forever"
        return "built"

    start = time.monotonic()
    assert build_locked(tmp_path, tmp_path / "lib.so", build) == "built"
    assert time.monotonic() - start < PROMPT_S


def test_a_process_waiting_on_a_build_says_so_and_goes_on_when_the_builder_dies(tmp_path):
    holder = _holder_in_a_build(tmp_path)
    waiter = _spawn(WAITER, tmp_path)
    try:
        _wait_for(waiter, waiter.stdout, "ready\n")
        said = _wait_for(waiter, waiter.stderr, r"\A(.*)\n")[1]
        assert said.startswith(f"depthscale: waiting for process {holder.pid} to build"), said
        killed = time.monotonic()
        holder.kill()
        got_in = float(_wait_for(waiter, waiter.stdout, r"in (\S+)\n")[1])
        assert got_in - killed < PROMPT_S  # CLOCK_MONOTONIC: one clock for every process
        assert waiter.wait(timeout=60) == 0
    finally:
        _reap(holder, waiter)


def test_the_build_says_when_it_compiles_how_long_it_took_and_why_it_failed(
    tmp_path, capsys, monkeypatch
):
    library = tmp_path / "lib.so"
    build_locked(tmp_path, library, library.touch)
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 2 and lines[0].startswith("depthscale: compiling the CPU kernels (")
    assert re.fullmatch(r"depthscale: compiled the CPU kernels in \d+ s", lines[1])
    assert build_locked(tmp_path, library, lambda: 7) == 7  # built already: loads quietly
    assert capsys.readouterr().err == ""

    def broken() -> None:
        raise RuntimeError("Error building extension\nc++: error: unrecognized option")

    with pytest.raises(RuntimeError, match="Error building"):
        build_locked(tmp_path / "other", tmp_path / "other" / "lib.so", broken)
    failed = capsys.readouterr().err.splitlines()[-1]
    assert re.fullmatch(r"depthscale: the CPU kernel build failed after \d+ s \(.*\)", failed)
    assert "unrecognized option" in failed
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))  # nothing to build with: silent
    with pytest.raises(RuntimeError, match="no C\\+\\+ compiler"):
        attnres_cpu._build(*attnres_cpu.VARIANTS[0])
    assert capsys.readouterr().err == ""


def test_the_library_name_keys_the_interpreter_torch_and_flags(monkeypatch, tmp_path):
    """Two virtualenvs, checkouts, Pythons or torch builds sharing one extension cache each build
    and keep their own library instead of rebuilding each other's."""
    base = library_name(build_env(), CFLAGS, [])
    assert [name for name, _, _ in attnres_cpu.VARIANTS] == [
        library_name(build_env(), [*CFLAGS, "-fopenmp"], ["-fopenmp"]),
        base,
    ]
    assert re.fullmatch(r"depthscale_cpu_[0-9a-f]{16}", base)
    others = [
        (torch, "__version__", "2.99.0+cpu"),
        (torch.version, "git_version", "0" * 40),
        (torch, "__file__", "/other/venv/lib/python3.12/site-packages/torch/__init__.py"),
        (sys, "executable", "/other/venv/bin/python"),
        (sys, "version", "3.99.0 (main) [GCC 99]"),
        (sys.implementation, "cache_tag", "cpython-399"),
    ]
    for target, attr, value in others:
        with monkeypatch.context() as patch:
            patch.setattr(target, attr, value)
            assert library_name(build_env(), CFLAGS, []) != base, attr
    checkout = tmp_path / "other-checkout"  # the same sources elsewhere: ninja's commands differ
    checkout.mkdir()
    copies = [checkout / p.name for p in (*attnres_cpu.SOURCES, attnres_cpu.HEADER)]
    for source, copy in zip((*attnres_cpu.SOURCES, attnres_cpu.HEADER), copies, strict=True):
        copy.write_bytes(source.read_bytes())
    with monkeypatch.context() as patch:
        patch.setattr(attnres_cpu, "SOURCES", copies[:-1])
        patch.setattr(attnres_cpu, "HEADER", copies[-1])
        assert library_name(build_env(), CFLAGS, []) != base
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    assert attnres_cpu.build_directory(base) == tmp_path / base


# A compiler that takes forever to compile (and answers version queries as the real one does), so
# the build can be interrupted by a real Ctrl-C: SIGINT to the whole process group, ninja included.
SLOW_CXX = """#!/bin/sh
case " $* " in
  *" -c "*) echo "$*" >> "$SLOW_CXX_LOG"; exec sleep 300 ;;
esac
exec c++ "$@"
"""

INTERRUPTED = """
import signal, sys, time
from depthscale.kernels import attnres_cpu
signal.signal(signal.SIGINT, lambda *_: None)  # the trainer's handler: stop at a step boundary
print("loaded", attnres_cpu.load(), time.monotonic(), flush=True)
"""


def test_ctrl_c_during_the_build_stops_it_without_building_another_variant(tmp_path):
    """Before, an interrupted build fell through to the next variant, whose compile (~40 s) the
    user who pressed Ctrl-C waited out in silence before the run could stop."""
    cxx, log = tmp_path / "slow-c++", tmp_path / "compiles.log"
    cxx.write_text(SLOW_CXX)
    cxx.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "DEPTHSCALE_CPU_KERNELS")}
    env.update(CXX=str(cxx), SLOW_CXX_LOG=str(log), TORCH_EXTENSIONS_DIR=str(tmp_path / "ext"))
    proc = subprocess.Popen(
        [sys.executable, "-c", INTERRUPTED], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        bufsize=0, env=env, start_new_session=True,
    )  # fmt: skip
    try:
        _wait_for(proc, proc.stderr, "compiling the CPU kernels")
        deadline = time.monotonic() + 120
        while not log.exists() and time.monotonic() < deadline:  # ninja has started the compiler
            time.sleep(0.05)
        interrupted_at = time.monotonic()
        os.killpg(proc.pid, signal.SIGINT)
        loaded = _wait_for(proc, proc.stdout, r"loaded (\S+) (\S+)\n")
        assert loaded[1] == "None" and float(loaded[2]) - interrupted_at < PROMPT_S
        assert proc.wait(timeout=60) == 0
        err = proc.stderr.read().decode()
        assert "the CPU kernel build was interrupted" in err, err
        assert err.count("compiling the CPU kernels") == 0  # the first was read by _wait_for
        built = set(re.findall(r"-DTORCH_EXTENSION_NAME=(\S+)", log.read_text()))
        assert len(built) == 1, built  # the first variant's sources, no other's
    finally:
        _reap(proc)
