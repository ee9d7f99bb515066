"""`depthscale tokenize` as a user runs it: 1 and 2 workers write the same bytes; a SIGKILL in the
middle and a rerun finish without redoing the finished shards; the shards train as the corpus
does (the same stream); bad input is one line, exit 2, with nothing written and nothing lost."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from test_bad_input import assert_one_line_error, run_main, tree_digest

from depthscale.config import DataConfig
from depthscale.data.loader import tokenize_corpus
from depthscale.data.tokenizer import ByteTokenizer, train_bpe

WORDS = [
    "alpha",
    "beta",
    "gamma",
    "delta",
    "epsilon",
    "zeta",
    "eta",
    "theta",
    "iota",
    "kappa",
    "lambda",
    "mu",
]


def _corpus(root: Path, files: list[int]) -> Path:
    """A folder of .jsonl files with these many documents each (seeded words)."""
    rng = np.random.default_rng(0)
    folder = root / "corpus"
    folder.mkdir()
    for i, n in enumerate(files):
        with open(folder / f"part{i:02d}.jsonl", "w") as f:
            for _ in range(n):
                text = " ".join(rng.choice(WORDS, size=int(rng.integers(20, 200))))
                f.write(json.dumps({"text": text}) + "\n")
    return folder


def _tokenize(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "depthscale.cli", "tokenize", *args, "--progress", "false"],
        cwd=cwd, capture_output=True, text=True, timeout=600,
    )  # fmt: skip


def _files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def test_any_number_of_workers_writes_the_same_shards_which_train_as_the_corpus(tmp_path):
    corpus = _corpus(tmp_path, [30, 5, 40, 12])
    for workers in ("1", "2"):
        proc = _tokenize(str(corpus), "--out", f"w{workers}", "--tokenizer", "byte",
                         "--workers", workers, cwd=tmp_path)  # fmt: skip
        assert proc.returncode == 0, proc.stderr
    assert _files(tmp_path / "w1") == _files(tmp_path / "w2")
    manifest = json.loads((tmp_path / "w1" / "manifest.json").read_text())
    assert [s["documents"] for s in manifest["shards"]] == [30, 5, 40, 12]
    ends = np.load(tmp_path / "w1" / "shard-00000.docs.npy")
    shard = np.load(tmp_path / "w1" / "shard-00000.npy")
    assert (shard[ends - 1] == ByteTokenizer().eos_id).all() and ends[-1] == len(shard)
    byte, cache = ByteTokenizer(), str(tmp_path / "cache")
    direct = tokenize_corpus(DataConfig(path=str(corpus), cache_dir=cache), byte)
    sharded = tokenize_corpus(DataConfig(path=str(tmp_path / "w1"), cache_dir=cache), byte)
    assert np.array_equal(np.asarray(sharded), direct)  # the same stream: the same batches


@pytest.mark.slow  # a drill with real signals (CI runs it after the default suite)
def test_a_killed_run_is_finished_without_redoing_its_finished_shards(tmp_path):
    """A BPE tokenizer (slow enough to stop between shards), a small first file: SIGKILL once
    the first shard's sidecar exists; the rerun keeps every shard the killed run finished (their
    files untouched) and ends with the clean run's bytes."""
    corpus = _corpus(tmp_path, [3, 4000, 4000, 4000, 4000])
    bpe = train_bpe((" ".join(WORDS),) * 50, 300)
    bpe.tok.save(str(tmp_path / "tokenizer.json"))
    args = [str(corpus), "--tokenizer", str(tmp_path / "tokenizer.json"), "--progress", "false"]
    clean = _tokenize(*args, "--out", "clean", cwd=tmp_path)
    assert clean.returncode == 0, clean.stderr
    proc = subprocess.Popen(
        [sys.executable, "-m", "depthscale.cli", "tokenize", *args, "--out", "out"],
        cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    out, deadline = tmp_path / "out", time.monotonic() + 300
    while not (out / "shard-00000.json").exists() and time.monotonic() < deadline:
        time.sleep(0.005)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert not (out / "manifest.json").exists(), "the run finished before the kill"
    finished = {p.name: p.stat().st_mtime_ns for p in out.glob("shard-*") if p.suffix != ".tmp"}
    assert "shard-00000.json" in finished and "shard-00004.json" not in finished
    rerun = _tokenize(*args, "--out", "out", cwd=tmp_path)
    assert rerun.returncode == 0, rerun.stderr
    for name, mtime in finished.items():
        if (out / f"{name.split('.')[0]}.json").name in finished:  # a finished shard: kept
            assert (out / name).stat().st_mtime_ns == mtime, name
    assert {k: v for k, v in _files(out).items() if not k.endswith(".tmp")} == _files(
        tmp_path / "clean"
    )


def _workers_of(pid: int) -> list[int]:
    """The spawned worker processes whose parent is `pid` (read from /proc: not the resource
    tracker that spawn also starts)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            cmdline = (stat.parent / "cmdline").read_bytes()
        except OSError:
            continue
        if int(fields[1]) == pid and b"spawn_main" in cmdline:
            found.append(int(stat.parent.name))
    return found


def _shard_being_written(pid: int) -> int | None:
    """The shard a stopped worker is writing: the index in its open `.shard-NNNNN.npy.*.tmp`."""
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            name = os.readlink(fd)
        except OSError:
            continue
        if m := re.search(r"/\.shard-(\d+)\.npy\.\d+\.tmp$", name):
            return int(m[1])
    return None


@pytest.mark.slow  # a drill with real signals (CI runs it after the default suite)
def test_a_killed_worker_is_named_with_its_file_at_once_and_the_finished_shards_kept(tmp_path):
    """SIGKILL (what the out-of-memory killer sends) of a real worker while it writes a shard:
    the run ends within seconds (multiprocessing.Pool waited forever, silent at 0 % CPU) with one
    line naming the worker and its file, no process left, the finished shards kept by the
    rerun, which completes."""
    corpus = _corpus(tmp_path, [3, 1500, 1500, 1500])
    files = sorted(corpus.iterdir())
    bpe = train_bpe((" ".join(WORDS),) * 50, 300)
    bpe.tok.save(str(tmp_path / "tokenizer.json"))
    args = [str(corpus), "--tokenizer", str(tmp_path / "tokenizer.json"), "--out", "out"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "depthscale.cli", "tokenize", *args, "--workers", "2",
         "--progress", "false"],
        cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True,
    )  # fmt: skip
    out, deadline, victim = tmp_path / "out", time.monotonic() + 120, None
    try:
        while victim is None and time.monotonic() < deadline:
            for pid in _workers_of(proc.pid) if (out / "shard-00000.json").exists() else []:
                os.kill(pid, signal.SIGSTOP)  # still, so that what it holds open stays so
                index = _shard_being_written(pid)
                if index is not None:
                    os.kill(pid, signal.SIGKILL)
                    victim, killed_at = (pid, index), time.monotonic()
                    break
                os.kill(pid, signal.SIGCONT)
            time.sleep(0.002)
        assert victim is not None, "no worker was seen writing a shard"
        _, err = proc.communicate(timeout=60)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # a hang must not outlive the test
    took = time.monotonic() - killed_at
    pid, index = victim
    assert proc.returncode == 2 and took < 10, (proc.returncode, took, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith(
        f"depthscale: error: worker pid {pid} was killed by SIGKILL (what the out-of-memory killer "
        f"sends) while tokenizing {files[index]}; the "
    ), err
    assert "the finished shards (1) in out are kept: the same command finishes the rest" in err
    deadline = time.monotonic() + 10  # the group empties (spawn's resource tracker last)
    while time.monotonic() < deadline:
        try:
            os.killpg(proc.pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.05)
    else:
        raise AssertionError("a process of the failed tokenize is still running")
    finished = {p.name: p.stat().st_mtime_ns for p in out.glob("shard-*")}
    assert "shard-00000.json" in finished and f"shard-{index:05d}.json" not in finished
    assert not list(out.glob(".*.tmp")) and not (out / "manifest.json").exists()
    rerun = _tokenize(*args, cwd=tmp_path)
    assert rerun.returncode == 0, rerun.stderr
    assert {p.name: p.stat().st_mtime_ns for p in out.glob("shard-*") if p.name in finished} == (
        finished
    )
    assert len(json.loads((out / "manifest.json").read_text())["shards"]) == 4


def test_bad_input_is_one_line_and_writes_or_loses_nothing(tmp_path, capsys):
    import pyarrow as pa
    import pyarrow.parquet as pq

    corpus = _corpus(tmp_path, [5, 5])
    pq.write_table(pa.table({"body": ["a b c"]}), tmp_path / "t.parquet")
    code, _, err = run_main(capsys, "tokenize", str(tmp_path / "t.parquet"), "--out",
                            str(tmp_path / "new"), "--tokenizer", "byte")  # fmt: skip
    assert_one_line_error(code, err, "no column 'text' (found: 'body'); set --field")
    assert not (tmp_path / "new").exists()
    out = tmp_path / "shards"
    assert (
        run_main(capsys, "tokenize", str(corpus), "--out", str(out), "--tokenizer", "byte")[0] == 0
    )
    before = tree_digest(out)
    bpe = train_bpe((" ".join(WORDS),) * 20, 280)
    bpe.tok.save(str(tmp_path / "other.json"))
    code, _, err = run_main(capsys, "tokenize", str(corpus), "--out", str(out), "--tokenizer",
                            str(tmp_path / "other.json"))  # fmt: skip
    assert_one_line_error(code, err, "holds shards of another tokenizer", "nothing was changed")
    assert tree_digest(out) == before
    code, _, err = run_main(
        capsys, "tokenize", str(corpus), "--out", str(out), "--tokenizer", "bpe"
    )
    assert_one_line_error(code, err, "--tokenizer bpe: shards need a fixed tokenizer")
    shard = out / "shard-00001.npy"
    shard.write_bytes(shard.read_bytes()[:-10])  # truncated: training refuses it
    run = tmp_path / "run"
    code, _, err = run_main(capsys, "train", "--data.path", str(out), "--train.steps", "2",
                            "--optim.warmup_steps", "1", "--train.run_dir", str(run))  # fmt: skip
    assert_one_line_error(code, err, "shard-00001.npy: unreadable or truncated shard")
    assert not run.exists()
    code, _, err = run_main(capsys, "train", "--data.path", str(out), "--data.tokenizer",
                            str(tmp_path / "other.json"), "--train.steps", "2",
                            "--optim.warmup_steps", "1", "--train.run_dir", str(run))  # fmt: skip
    assert_one_line_error(code, err, "was tokenized with another tokenizer")


def test_empty_damaged_and_dropped_inputs(tmp_path, capsys):
    """An input with no text is refused naming it (it once made 0 tokens and exit 0); a damaged
    compressed file late in the list is named before any shard is written (it was once named
    after the shards before it); a rerun with fewer inputs removes the shards past them, which
    tokenize provably wrote, and leaves any other file named like a shard."""
    import gzip

    corpus = _corpus(tmp_path, [4, 4])
    (tmp_path / "empty.jsonl").write_text("\n\n")
    (tmp_path / "blank").mkdir()
    (tmp_path / "blank" / "a.txt").write_text("")
    for bad in ("empty.jsonl", "blank"):
        out = tmp_path / f"out-{bad}"
        code, _, err = run_main(capsys, "tokenize", str(corpus), str(tmp_path / bad), "--out",
                                str(out), "--tokenizer", "byte")  # fmt: skip
        assert_one_line_error(code, err, f"input '{tmp_path / bad}' ", "no text to tokenize")
        assert not out.exists()
    (corpus / "part02.jsonl").write_text("")  # in a folder with text: a note, an empty shard
    damaged = tmp_path / "late.jsonl.gz"
    damaged.write_bytes(gzip.compress(b'{"text": "x y z"}\n' * 2000)[:-20])
    out = tmp_path / "shards"
    code, _, err = run_main(capsys, "tokenize", str(corpus), str(damaged), "--out", str(out),
                            "--tokenizer", "byte")  # fmt: skip
    assert_one_line_error(code, err, f"{damaged}: the compressed stream is damaged")
    assert "1 input file(s) hold no text (first: " in err and not out.exists()
    damaged.write_bytes(gzip.compress(b'{"text": "x y z"}\n' * 2000))
    inputs = [str(corpus), str(damaged)]
    assert run_main(capsys, "tokenize", *inputs, "--out", str(out), "--tokenizer", "byte")[0] == 0
    assert sorted(p.name for p in out.glob("shard-*.json")) == [
        f"shard-0000{i}.json" for i in range(4)
    ]
    (out / "shard-00007.npy").write_bytes(b"the user's")  # no sidecar shows it is tokenize's
    kept = tree_digest(out)
    code, _, err = run_main(capsys, "tokenize", str(corpus), "--out", str(out), "--tokenizer",
                            "byte")  # fmt: skip
    assert code == 0, err
    assert "removed 1 shard(s) of an earlier run's inputs beyond these 3 (shard-00003)" in err
    assert "left as they are: shard-00007.npy" in err
    manifest = json.loads((out / "manifest.json").read_text())
    listed = {s["file"] for s in manifest["shards"]}
    assert listed == {f"shard-0000{i}.npy" for i in range(3)}
    now = tree_digest(out)
    assert {k for k in kept if k.startswith("shard-00003")} and not any(
        k.startswith("shard-00003") for k in now
    )
    assert {k: v for k, v in kept.items() if k != "manifest.json" and k in now} == {
        k: v for k, v in now.items() if k != "manifest.json"
    }  # the rest untouched, the user's file included


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--workers", "0"], "argument --workers: '0' is not allowed"),
        (["--progress", "maybe"], "argument --progress: 'maybe' is not allowed"),
    ],
)
def test_bad_flags_are_named(tmp_path, capsys, args, message):
    from depthscale.cli import main

    with pytest.raises(SystemExit) as exit_:
        main(
            ["tokenize", str(tmp_path), "--out", str(tmp_path / "o"), "--tokenizer", "byte", *args]
        )
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and message in err, err
    assert not (tmp_path / "o").exists()


@pytest.mark.slow  # a drill with real signals (CI runs it after the default suite)
def test_ctrl_c_stops_every_worker_and_keeps_the_finished_shards(tmp_path):
    """SIGINT to the process group (Ctrl-C) with two workers, once a shard is finished: exit 130
    with a note, no half-written file left, no worker left running; the rerun finishes."""
    corpus = _corpus(tmp_path, [3, 4000, 4000, 4000, 4000])
    bpe = train_bpe((" ".join(WORDS),) * 50, 300)
    bpe.tok.save(str(tmp_path / "tokenizer.json"))
    args = [str(corpus), "--tokenizer", str(tmp_path / "tokenizer.json"), "--out", "out"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "depthscale.cli", "tokenize", *args, "--workers", "2",
         "--progress", "false"],
        cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True,
    )  # fmt: skip
    out, deadline = tmp_path / "out", time.monotonic() + 300
    while not list(out.glob("shard-*.json")) and time.monotonic() < deadline:
        time.sleep(0.005)
    os.killpg(proc.pid, signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    assert "the finished shards in out are kept" in err and "Traceback" not in err
    assert not list(out.glob(".*.tmp")) and not (out / "manifest.json").exists()
    deadline = time.monotonic() + 30  # the group empties: no worker outlives the parent
    while time.monotonic() < deadline:
        try:
            os.killpg(proc.pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.05)
    else:
        raise AssertionError("a process of the interrupted tokenize is still running")
    rerun = _tokenize(*args, cwd=tmp_path)
    assert rerun.returncode == 0, rerun.stderr
    assert (out / "manifest.json").is_file()
