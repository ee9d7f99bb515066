"""`depthscale tokenize` as a user runs it: 1 and 2 workers write the same bytes; a SIGKILL in the
middle and a rerun finish without redoing the finished shards; the shards train as the corpus
does (the same stream); bad input is one line, exit 2, with nothing written and nothing lost."""

from __future__ import annotations

import json
import os
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
