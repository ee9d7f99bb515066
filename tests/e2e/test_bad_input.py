"""Bad input, one case per row, through the real command line: each gets one clear error naming what
is wrong (exit code 2), or works where the input was valid, and no run directory or checkpoint is
damaged by any of them.

Cases that fail before any process group or worker starts run `depthscale.cli.main` in this process
(the same code path as the console script, minus interpreter start-up); cases that need a process
boundary (several workers, signals, a hang) run the console entry point in a subprocess.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from depthscale.cli import main
from depthscale.data.token_files import write_bin
from training_output import wait_for_step

CONFIG = str(Path("configs/tiny.toml").resolve())
TINY = [
    "--model.dim", "32", "--model.n_layers", "2", "--model.n_heads", "2",
    "--data.seq_len", "32", "--data.max_bytes", "100000", "--train.batch_size", "4",
    "--optim.warmup_steps", "0", "--train.eval_every", "0", "--logging.log_every", "1",
    "--logging.progress", "false", "--logging.tensorboard", "false",
    "--logging.peak_tflops", "1",
]  # fmt: skip


def run_main(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def cli(*args: str, cwd: Path, env: dict | None = None, timeout: float = 900):
    return subprocess.run(
        [sys.executable, "-m", "depthscale.cli", *args],
        cwd=cwd,
        env=dict(os.environ, PYTHONWARNINGS="ignore", **(env or {})),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def tree_digest(root: Path) -> dict[str, str]:
    """Every file under root with its content hash: 'nothing already written is lost'."""
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def assert_one_line_error(code: int, err: str, *fragments: str) -> None:
    """Exit code 2 and one error line (warnings naming skipped checkpoints may precede it)."""
    assert code == 2, err
    lines = [line for line in err.strip().splitlines() if line]
    lines = [
        line for line in lines if not line.startswith(("depthscale: warning", "depthscale: note"))
    ]
    assert len(lines) == 1, err
    assert "Traceback" not in err
    for fragment in fragments:
        assert fragment in err, (fragment, err)


# --------------------------------------------------------------------- config, refused up front

FILE = "{file}"  # replaced by a regular file in tmp_path
CONFIG_CASES = [
    (["--logging.log_every", "0"], "logging.log_every=0 must be >= 1"),
    (["--model.norm_eps", "-1"], "model.norm_eps=-1.0 must be > 0"),
    (["--model.rope_theta", "-5"], "model.rope_theta=-5.0"),
    (["--model.init_std", "0"], "model.init_std=0.0 must be > 0"),
    (["--model.attnres_eps", "0"], "model.attnres_eps"),
    (["--model.multiple_of", "0"], "model.multiple_of=0 must be >= 1"),
    (["--model.attnres_n_blocks", "0"], "model.attnres_n_blocks=0"),
    (["--optim.eps", "0"], "optim.eps=0.0 must be > 0"),
    (["--optim.lr", "nan"], "optim.lr=nan is not allowed; allowed: a finite number"),
    (["--optim.lr", "inf"], "optim.lr=inf"),
    (["--train.grad_clip", "nan"], "train.grad_clip=nan"),
    (["--train.seed", "-1"], "train.seed=-1 must be in [0, 4294967296)"),
    (["--train.eval_batches", "0", "--train.eval_every", "5"], "train.eval_batches=0"),
    (["--train.name", " "], "train.name is empty"),
    (["--train.run_dir", "runs/{nope}"], "train.run_dir='runs/{nope}' is not a valid path"),
    (["--train.run_dir", FILE + "/run"], "cannot be created because"),
    (["--train.run_dir", FILE], "is a file; allowed: a directory path"),
    # os.access tells root yes here; the first write at the end of the run said no
    (["--train.run_dir", "/proc/depthscale-run"], "cannot be written ('/proc' is not writable)"),
    (["--data.cache_dir", FILE + "/cache"], "data.cache_dir"),
    (["--data.tokenizer", "bpe", "--data.bpe_vocab_size", "100"], "data.bpe_vocab_size=100"),
    (["--data.bin_dtype", "int8"], "data.bin_dtype: 'int8' is not allowed"),
    (["--model.dim", "abc"], "model.dim: expected an int"),
    (["--model.nope", "1"], "unknown key in [model] 'nope'"),
    (["--model.n_heads", "3"], "model.n_heads=3 must divide model.dim=32"),
    (["--data.seq_len", "8192"], "data.seq_len=8192 exceeds model.max_seq_len"),
    (["--optim.warmup_steps", "500"], "optim.warmup_steps=500 exceeds train.steps"),
    (["--optim.name", "muon", "--optim.muon_ns_steps", "0"], "optim.muon_ns_steps=0 must be in"),
    (["--optim.name", "muon", "--optim.muon_momentum", "1"], "optim.muon_momentum=1.0 must be in"),
    (["--optim.muon_adamw_lr", "-1"], "optim.muon_adamw_lr=-1.0 must be >= 0"),
    (["--optim.muon_lr", "0.1"], "unknown key in [optim] 'muon_lr'"),
    (["--optim.name", "muon", "--optim.qk_clip_tau", "-1"], "optim.qk_clip_tau=-1.0 must be >= 0"),
    (["--optim.qk_clip_tau", "5"], "optim.qk_clip_tau=5.0 needs optim.name = 'muon'"),
    (
        ["--nproc", "2", "--parallel.cp", "2", "--optim.name", "muon", "--optim.qk_clip_tau", "5"],
        "optim.qk_clip_tau=5.0 needs parallel.cp = 1",
    ),
    (["--optim.name", "sgd"], "optim.name: 'sgd' is not allowed"),
    (["--checkpoint.resume", "/no/such/step"], "checkpoint.resume='/no/such/step' does not exist"),
    # layouts a worker would refuse, caught once in the launching process
    (["--nproc", "3", "--parallel.tp", "3"], "model.n_heads=2 is not divisible by tp=3"),
    (
        [
            "--nproc",
            "2",
            "--parallel.pp",
            "2",
            "--parallel.pp_virtual",
            "2",
            "--train.batch_size",
            "3",
            "--train.micro_batch_size",
            "1",
        ],
        "interleaved 1F1B (parallel.pp_virtual=2) needs the micro-batches",
    ),  # fmt: skip
    (
        ["--nproc", "2", "--parallel.pp", "2", "--train.batch_size", "3"],
        "the per-rank batch 3 splits into neither 4 nor 2 micro-batches",
    ),
    (["--nproc", "2"], "but --nproc is 2"),
    (["--parallel.tp", "2"], "add --nproc 2"),
    (["--parallel.pp_virtual", "2"], "parallel.pp_virtual=2 needs parallel.pp > 1"),
    (
        ["--nproc", "2", "--parallel.pp", "2", "--parallel.pp_ends_fewer_layers", "1"],
        "needs a middle stage to give the layers to",
    ),
    (
        [
            "--nproc",
            "2",
            "--parallel.pp",
            "2",
            "--parallel.pp_virtual",
            "2",
            "--parallel.pp_ends_fewer_layers",
            "2",
        ],
        "cannot leave the end stages 2 fewer than the others; allowed: 0..1",
    ),
    (["--nproc", "2", "--parallel.tp", "2", "--data.seq_len", "33"], "seq_len=33"),
    (["--data.path", "/no/such/corpus.txt"], "data.path='/no/such/corpus.txt' does not exist"),
    (["--logging.profile_steps", "5-3"], "logging.profile_steps='5-3' is not allowed"),
    (["--logging.profile_steps", "x"], "allowed: 'FIRST-LAST' or one step"),
    (["--logging.profile_steps", "9000"], "logging.profile_steps='9000' ends after train.steps"),
    (["--logging.profile_ranks", "0,x"], "logging.profile_ranks='0,x' is not allowed"),
    # [[eval.tasks]]: the entry and key named, and the questions read before any work
    (["--eval.tasks", '[{pth = "t.jsonl"}]'], "unknown key in [[eval.tasks]] (entry 0) 'pth'"),
    (["--eval.tasks", '[{path = "/no/t.jsonl"}]'], "eval.tasks[0].path='/no/t.jsonl' does not"),
    (["--eval.tasks", "t.jsonl"], "eval.tasks: 't.jsonl' is not an inline TOML array"),
    (["--eval.tasks", f'[{{path = "{FILE}", limit = -1}}]'], "eval.tasks[0].limit=-1 must be"),
    (["--eval.tasks", f'[{{path = "{FILE}", name = "a/b"}}]'], "eval.tasks[0].name='a/b' cannot"),
    (["--eval.tasks", f'[{{path = "{FILE}"}}, {{path = "{FILE}"}}]'], "a second task named"),
    (["--eval.tasks", f'[{{path = "{FILE}"}}]'], ":1: not JSON"),
    (["--eval.sets", '[{name = "a", path = "/no/x.jsonl"}]'], "eval.sets[0].path='/no/x.jsonl'"),
    (
        ["--eval.sets", f'[{{name = "a", path = "{FILE}"}}, {{name = "a", path = "{FILE}"}}]'],
        "a second set named 'a'",
    ),
    # mixtures: a weight that is no share, a stage naming no source
    (
        ["--data.sources", f'[{{name = "a", path = "{FILE}", weight = 0}}]'],
        "data.sources[0].weight=0.0 must be a finite number > 0",
    ),
    (
        [
            "--data.sources",
            f'[{{name = "a", path = "{FILE}", weight = 1}}]',
            "--data.stages",
            "[{at_step = 2, weights = {b = 1}}]",
        ],
        "data.stages[0].weights names 'b', not a source",
    ),
    # a key an entry must set, left out: named as missing, not as its default (at_step=0)
    (
        [
            "--data.sources",
            f'[{{name = "a", path = "{FILE}", weight = 1}}]',
            "--data.stages",
            "[{weights = {a = 1}}]",
        ],
        "data.stages[0] misses at_step; required in every [[data.stages]] table: at_step, weights",
    ),
    (
        ["--data.sources", f'[{{name = "a", path = "{FILE}"}}]'],
        "data.sources[0] misses weight; required in every [[data.sources]] table: name, path, "
        "weight",
    ),
    (["--eval.tasks", '[{name = "t"}]'], "eval.tasks[0] misses path; required"),
]


@pytest.mark.parametrize("args, message", CONFIG_CASES, ids=[" ".join(a) for a, _ in CONFIG_CASES])
def test_bad_config_is_one_line_and_writes_nothing(tmp_path, capsys, args, message):
    (tmp_path / "file").write_text("a regular file\n")
    args = [a.replace(FILE, str(tmp_path / "file")) for a in args]
    run_dir = tmp_path / "run"
    code, _, err = run_main(
        capsys, "train", "-c", CONFIG, *TINY, "--train.run_dir", str(run_dir), *args
    )
    assert_one_line_error(code, err, message)
    assert not run_dir.exists()
    assert (tmp_path / "file").read_text() == "a regular file\n"


def test_bad_config_files(tmp_path, capsys):
    code, _, err = run_main(capsys, "train", "-c", str(tmp_path / "missing.toml"))
    assert_one_line_error(code, err, "missing.toml' does not exist")
    bad = tmp_path / "bad.toml"
    bad.write_text("[model\ndim = 3\n")
    code, _, err = run_main(capsys, "train", "-c", str(bad))
    assert_one_line_error(code, err, "is not valid TOML")
    bad.write_bytes(bytes(range(128, 256)))
    code, _, err = run_main(capsys, "train", "-c", str(bad))
    assert_one_line_error(code, err, "bad.toml' is not text", "allowed: a UTF-8 .toml file")
    code, _, err = run_main(capsys, "train", "-c", str(Path(CONFIG).parent))
    assert_one_line_error(code, err, "configs' is a directory; allowed: a .toml file", "tiny.toml")
    code, _, err = run_main(capsys, "train", "-c", "/dev/null")
    assert_one_line_error(code, err, "'/dev/null' is not a regular file")


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EFBIG, errno.EACCES, errno.EISDIR])
def test_what_the_machine_refuses_is_one_line_naming_the_file(monkeypatch, capsys, code):
    """A write the file system refuses anywhere (a full disk under metrics.jsonl, a path the user
    cannot write) is the user's to fix: one line naming the file, exit 2."""
    import depthscale.cli.trace

    def refuse(args):
        raise OSError(code, os.strerror(code), "/runs/x/metrics.jsonl")

    monkeypatch.setattr(depthscale.cli.trace, "run", refuse)
    code_, _, err = run_main(capsys, "trace", "schedule")
    assert_one_line_error(code_, err, "/runs/x/metrics.jsonl: " + os.strerror(code))


# ------------------------------------------------------------------------------ data


def test_bin_of_another_dtype_is_refused(tmp_path, capsys):
    ids = np.random.default_rng(0).integers(1, 256, 4000)
    ids.astype(np.uint32).tofile(tmp_path / "wide.bin")  # no sidecar, read as uint16 below
    run_dir = tmp_path / "run"
    common = ("train", "-c", CONFIG, *TINY, "--train.run_dir", str(run_dir), "--train.steps", "1")
    code, _, err = run_main(
        capsys, *common, "--data.path", str(tmp_path / "wide.bin"), "--data.bin_dtype", "uint16"
    )
    assert_one_line_error(code, err, "looks like uint32")
    code, _, err = run_main(capsys, *common, "--data.path", str(tmp_path / "wide.bin"))
    assert_one_line_error(code, err, "no sidecar wide.bin.json")
    write_bin(tmp_path / "ok.bin", ids, 258)
    code, _, err = run_main(
        capsys, *common, "--data.path", str(tmp_path / "ok.bin"), "--data.bin_dtype", "uint32"
    )
    assert_one_line_error(code, err, "says ok.bin holds uint16")
    assert not run_dir.exists()


def test_binary_corpus_is_refused_before_the_run_starts(tmp_path, capsys):
    (tmp_path / "weights.txt").write_bytes(np.random.default_rng(0).bytes(50_000))
    run_dir = tmp_path / "run"
    code, _, err = run_main(
        capsys, "train", "-c", CONFIG, *TINY, "--train.run_dir", str(run_dir),
        "--data.path", str(tmp_path / "weights.txt"), "--data.cache_dir", str(tmp_path / "c"),
    )  # fmt: skip
    assert_one_line_error(code, err, "weights.txt is not text: 5", "allowed: UTF-8 text")
    assert not run_dir.exists() and not list((tmp_path / "c").rglob("*.npy"))


@pytest.mark.skipif(sys.platform != "linux", reason="RLIMIT_FSIZE with SIGXFSZ ignored: Linux")
def test_full_disk_while_tokenizing_is_one_line_and_keeps_the_cache(tmp_path):
    """A file-size limit makes the cache's write fail with a real EFBIG (Python ignores SIGXFSZ),
    as a full disk does with ENOSPC: one line naming the file, and the cache as it was."""
    import resource

    cache = tmp_path / "cache"
    kept = cache / "tokens" / "earlier.npy"
    kept.parent.mkdir(parents=True)
    kept.write_bytes(b"an entry of an earlier run")

    def limit() -> None:  # 64 KiB: the 100 kB corpus's tokens (200 kB) do not fit
        resource.setrlimit(resource.RLIMIT_FSIZE, (64 << 10, resource.RLIM_INFINITY))

    proc = subprocess.run(
        [sys.executable, "-m", "depthscale.cli", "train", "-c", CONFIG, *TINY,
         "--data.cache_dir", str(cache), "--train.run_dir", str(tmp_path / "run")],
        env=dict(os.environ, PYTHONWARNINGS="ignore"), preexec_fn=limit,
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert_one_line_error(
        proc.returncode, proc.stderr, "cannot write the tokenized corpus to", str(cache / "tokens"),
        "File too large [EFBIG]", "data.cache_dir",
    )  # fmt: skip
    assert [p.name for p in kept.parent.iterdir()] == ["earlier.npy"]  # no half-written entry
    assert kept.read_bytes() == b"an entry of an earlier run"


# ------------------------------------------------------------------ generate and trace numbers


@pytest.fixture(scope="module")
def small_run(tmp_path_factory):
    """A 2-step run with checkpoints at steps 1 and 2."""
    root = tmp_path_factory.mktemp("bad-input")
    proc = cli(
        "train", "-c", CONFIG, *TINY, "--train.steps", "2", "--checkpoint.every", "1",
        "--checkpoint.keep", "0", "--train.run_dir", str(root / "run"), cwd=root,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    return root / "run"


def test_eval_scores_a_task_file_as_the_evaluator_does(small_run, tmp_path, capsys):
    """`depthscale eval` on a run: the table and --json hold the evaluator's own acc/acc_norm."""
    from depthscale.evaluation.multiple_choice import read_task, score
    from depthscale.interop.run_dir import load_run

    task = tmp_path / "arith.jsonl"
    task.write_text(
        '{"context": "1 + 1 =", "choices": [" 2", " 3", " 11"], "gold": 0}\n'
        '{"context": "def main", "choices": ["(", " zq"], "gold": 0}\n'
    )
    code, out, err = run_main(
        capsys, "eval", "--run", str(small_run), "--tasks", str(task), "--json", str(tmp_path / "r")
    )
    assert code == 0, err
    model, tokenizer = load_run(small_run)
    expected = score(model, tokenizer, read_task(task))
    assert json.loads((tmp_path / "r").read_text()) == [expected]
    assert out.splitlines()[1].split() == ["arith", "2", f"{expected['acc']:.4f}",
                                           f"{expected['acc_norm']:.4f}"]  # fmt: skip


EVAL_CASES = [
    (["--tasks", "{tmp}/none.jsonl"], "task file {tmp}/none.jsonl does not exist"),
    (["--tasks", "{bad}"], "{bad}:1: 'gold'=5 must index 'choices' (0..1)"),
    (["--tasks", "{good}", "--json", "{file}/r.json"], "'{file}' is a file"),
]
if not torch.cuda.is_available():
    EVAL_CASES.append((["--tasks", "{good}", "--device", "cuda"], "--device cuda: no CUDA device"))


@pytest.mark.parametrize("args, message", EVAL_CASES, ids=[a[1] + a[-1] for a, _ in EVAL_CASES])
def test_eval_refuses_bad_task_files_before_loading_the_model(
    small_run, tmp_path, capsys, args, message
):
    bad, good, file = tmp_path / "bad.jsonl", tmp_path / "good.jsonl", tmp_path / "file"
    bad.write_text('{"context": "x", "choices": ["a", "b"], "gold": 5}\n')
    good.write_text('{"context": "x", "choices": ["a", "b"], "gold": 1}\n')
    file.write_text("mine\n")
    fill = {"tmp": tmp_path, "bad": bad, "good": good, "file": file}
    before = tree_digest(small_run)
    code, _, err = run_main(
        capsys, "eval", "--run", str(small_run), *[a.format(**fill) for a in args]
    )
    assert_one_line_error(code, err, message.format(**fill))
    assert tree_digest(small_run) == before and file.read_text() == "mine\n"


GENERATE_CASES = [
    (["--temperature", "-1"], "--temperature: '-1' is not allowed; allowed: a finite number >= 0"),
    (["--temperature", "nan"], "--temperature: 'nan' is not allowed"),
    (["--top-k", "-1"], "--top-k: '-1' is not allowed"),
    (["--max-new-tokens", "0"], "--max-new-tokens: '0' is not allowed; allowed: an integer >= 1"),
    (["--seed", "-3"], "--seed: '-3' is not allowed"),
    (["--prompt", "x" * 5000], "the prompt is 5001 tokens"),
    (["--max-new-tokens", "5000"], "--max-new-tokens 5000 exceeds the model's context of 4096"),
]


@pytest.mark.parametrize("args, message", GENERATE_CASES, ids=[a[0] for a, _ in GENERATE_CASES])
def test_generate_validates_its_numbers(small_run, capsys, args, message):
    before = tree_digest(small_run)
    code, err = run_args(capsys, "generate", "--run", str(small_run), "--prompt", "def", *args)
    assert_clear_error(code, err, message)
    assert tree_digest(small_run) == before


TRACE_CASES = [
    (["schedule", "--pp", "0"], "--pp: '0' is not allowed"),
    (["schedule", "--virtual", "0"], "--virtual: '0' is not allowed"),
    (["schedule", "--microbatches", "-2"], "--microbatches: '-2' is not allowed"),
    (["depth", "--batch", "0"], "--batch: '0' is not allowed"),
]


@pytest.mark.parametrize("args, message", TRACE_CASES, ids=[" ".join(a) for a, _ in TRACE_CASES])
def test_trace_validates_its_numbers(small_run, capsys, args, message):
    code, err = run_args(capsys, "trace", *args, "--run", str(small_run))
    assert_clear_error(code, err, message)


def run_args(capsys, *argv: str) -> tuple[int, str]:
    """main(), with argparse's own errors (SystemExit 2 after a usage line) taken as exit codes."""
    try:
        code = main(list(argv))
    except SystemExit as stop:
        code = stop.code
    return code, capsys.readouterr().err


def assert_clear_error(code: int, err: str, *fragments: str) -> None:
    """Exit code 2, no traceback, the message; argparse adds its usage line before it."""
    assert code == 2, err
    assert "Traceback" not in err
    lines = [line for line in err.strip().splitlines() if line and not line.startswith("usage:")]
    lines = [line for line in lines if not line.startswith(" ")]  # wrapped usage lines
    assert len(lines) == 1, err
    for fragment in fragments:
        assert fragment in err, (fragment, err)


# ------------------------------------------------- damaged files that are not checkpoints


def _write(name: str, data: bytes):
    def damage(root: Path) -> None:
        (root / name).write_bytes(data)

    return damage


BINARY = bytes(range(256)) * 4
RUN_DAMAGE = {
    "tokenizer meta not JSON": (_write("tokenizer/tokenizer_meta.json", b"{not"), "tokenizer_meta"),
    "tokenizer meta binary": (_write("tokenizer/tokenizer_meta.json", BINARY), "tokenizer_meta"),
    "tokenizer meta no kind": (_write("tokenizer/tokenizer_meta.json", b"[1]"), "tokenizer_meta"),
    "config.toml binary": (_write("config.toml", BINARY), "config.toml' is not text"),
}
RUN_COMMANDS = {
    "generate": ["generate", "--run", "{run}", "--prompt", "def", "--max-new-tokens", "2"],
    "trace depth": ["trace", "depth", "--run", "{run}", "--out", "{tmp}/depth.png"],
    "ds-to-hf": ["convert", "ds-to-hf", "--run", "{run}", "--out", "{tmp}/hf"],
    "train": ["train", "-c", "{run}/config.toml", "--train.steps", "3"],
}


@pytest.mark.parametrize("command", list(RUN_COMMANDS))
@pytest.mark.parametrize("kind", list(RUN_DAMAGE))
def test_damaged_run_files_are_named(small_run, tmp_path, capsys, kind, command):
    run = tmp_path / "copy"
    _copy_tree(small_run, run)
    damage, fragment = RUN_DAMAGE[kind]
    damage(run)
    before = tree_digest(run)
    argv = [a.format(run=run, tmp=tmp_path) for a in RUN_COMMANDS[command]]
    code, _, err = run_main(capsys, *argv)
    assert_one_line_error(code, err, str(run), fragment)
    assert tree_digest(run) == before and not (tmp_path / "hf").exists()


@pytest.mark.parametrize("what", ["timeline", "stragglers", "hang"])
def test_a_trace_file_that_is_not_text_is_named(small_run, tmp_path, capsys, what):
    """A rank's trace file of binary bytes: timeline and stragglers name it and its line; hang
    notes it and reads the dumps without its meta line."""
    run = tmp_path / "copy"
    _copy_tree(small_run, run)
    trace = run / "trace" / "rank00000.jsonl"
    trace.write_bytes(BINARY)
    (run / "trace" / "hang").mkdir()
    (run / "trace" / "hang" / "rank00000.json").write_text('{"rank": 0}')
    code, out, err = run_main(capsys, "trace", what, "--run", str(run))
    if what == "hang":
        assert code == 0 and "Traceback" not in err
        assert f"note: {trace}: no meta line" in out
    else:
        assert_one_line_error(code, err, f"{trace}:1 is not a JSON record")


@pytest.fixture(scope="module")
def hf_export(small_run, tmp_path_factory):
    out = tmp_path_factory.mktemp("hf") / "export"
    assert main(["convert", "ds-to-hf", "--run", str(small_run), "--out", str(out)]) == 0
    return out


def _edit_config(**changes):
    def damage(hf: Path) -> None:
        config = json.loads((hf / "config.json").read_text())
        (hf / "config.json").write_text(json.dumps(config | changes))

    return damage


def _as_bin(data: bytes):
    def damage(hf: Path) -> None:
        (hf / "model.safetensors").unlink()
        (hf / "pytorch_model.bin").write_bytes(data)

    return damage


HF_DAMAGE = {
    "config.json not JSON": (_write("config.json", b"{not json"), "config.json is not valid JSON"),
    "config.json binary": (_write("config.json", BINARY), "config.json is not valid JSON"),
    "config.json a list": (_write("config.json", b"[1, 2]"), "config.json holds a JSON list"),
    "hidden_size a string": (_edit_config(hidden_size="big"), "hidden_size='big' is not allowed"),
    "negative layers": (_edit_config(num_hidden_layers=-1), "num_hidden_layers=-1 is not allowed"),
    "eps a string": (_edit_config(rms_norm_eps="x"), "rms_norm_eps='x' is not allowed"),
    "safetensors garbage": (_write("model.safetensors", BINARY), "not a readable safetensors"),
    "safetensors text": (_write("model.safetensors", b"hello\n"), "not a readable safetensors"),
    "index not JSON": (_write("model.safetensors.index.json", b"{"), "index.json is not valid"),
    "index no map": (_write("model.safetensors.index.json", b"{}"), "has no weight_map"),
    ".bin garbage": (_as_bin(BINARY), "pytorch_model.bin is not a readable PyTorch"),
    ".bin text": (_as_bin(b"hi\n"), "pytorch_model.bin is not a readable PyTorch"),
}


@pytest.mark.parametrize("kind", list(HF_DAMAGE))
def test_damaged_hugging_face_files_are_named(hf_export, tmp_path, capsys, kind):
    import shutil

    hf = tmp_path / "hf"
    shutil.copytree(hf_export, hf)
    damage, fragment = HF_DAMAGE[kind]
    damage(hf)
    out = tmp_path / "out"
    code, _, err = run_main(capsys, "convert", "hf-to-ds", "--hf", str(hf), "--out", str(out))
    assert_one_line_error(code, err, str(hf), fragment)
    assert not out.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["hf"]


OUTPUTS = [
    (["trace", "depth", "--run", "{run}", "--out", "{file}/x.png"], "'{file}' is a file"),
    (["trace", "schedule", "--out", "{tmp}"], "--out '{tmp}' is a directory"),
    (["trace", "timeline", "--run", "{run}", "--out", "{file}/x.json"], "'{file}' is a file"),
    (["trace", "stragglers", "--run", "{run}", "--out", "{file}/s.png"], "'{file}' is a file"),
    (["convert", "ds-to-hf", "--run", "{run}", "--out", "{file}/hf"], "'{file}' is a file"),
    (["diagnose", "--nproc", "1", "--run", "{file}/run"], "'{file}' is a file"),
    (["plan", "--calibrate", "{tmp}"], "--calibrate '{tmp}' is a directory"),
    (["plan", "--calibrate", "{file}/c.json"], "'{file}' is a file"),
    # the file written beside --out: depth's numbers, timeline's picture of one step
    (
        ["trace", "depth", "--run", "{run}", "--out", "{tmp}/out.png"],
        "'{tmp}/out.json' is a directory",
    ),
    (
        ["trace", "timeline", "--run", "{run}", "--out", "{tmp}/tl.json"],
        "'{tmp}/tl.png' is a directory",
    ),
    (["trace", "hang", "--run", "{run}", "--out", "{file}/hang.txt"], "'{file}' is a file"),
    (["tokenize", "{file}", "--out", "{file}/shards", "--tokenizer", "byte"], "'{file}' is a file"),
    # lm-evaluation-harness writes its results after the whole evaluation
    (
        ["lm-eval", "--model", "depthscale", "--tasks", "t", "--output_path", "{file}/out"],
        "--output_path: '{file}/out' cannot be created because '{file}' is a file",
    ),
    (
        ["lm-eval", "--tasks", "t", "-o", "{tmp}", "--output_path={file}/r.json"],
        "--output_path '{file}/r.json' cannot be created because '{file}' is a file",
    ),
    (
        ["convert", "ds-to-hf", "--run", "{run}", "--out", "{tmp}/hf", "--max-shard-size", "5XB"],
        "--max-shard-size '5XB' is not a size",
    ),
]


@pytest.mark.parametrize(
    "argv, message", OUTPUTS, ids=[" ".join(a[:2] + a[6:]) for a, _ in OUTPUTS]
)
def test_output_paths_that_cannot_be_created(small_run, tmp_path, capsys, argv, message):
    """Refused before any work, naming the flag and the path: every file a command writes."""
    file = tmp_path / "file"
    file.write_text("mine\n")
    for taken in ("out.json", "tl.png"):
        (tmp_path / taken).mkdir()
    fill = {"run": small_run, "file": file, "tmp": tmp_path}
    before = tree_digest(small_run)
    code, _, err = run_main(capsys, *[a.format(**fill) for a in argv])
    assert_one_line_error(code, err, message.format(**fill))
    assert file.read_text() == "mine\n" and tree_digest(small_run) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file", "out.json", "tl.png"]


MADE = {
    "eval": (["eval", "--run", "{run}", "--tasks", "{task}", "--json", "{new}/r.json"], ["r.json"]),
    "trace depth": (["trace", "depth", "--run", "{run}", "--out", "{new}/d.png"], ["d.json", "d.png"]),
    "trace timeline": (["trace", "timeline", "--run", "{run}", "--out", "{new}/t.json"], ["t.json", "t.png"]),
    "trace hang": (["trace", "hang", "--run", "{run}", "--out", "{new}/h.txt"], ["h.txt"]),
}  # fmt: skip


@pytest.mark.parametrize("command", list(MADE))
def test_output_paths_whose_parents_do_not_exist_yet_are_made(small_run, tmp_path, capsys, command):
    """A path under directories that do not exist yet is written, its parents made (as `mkdir -p`
    would): `eval --json DIR/missing/x.json` scored every task, printed the table, then failed on
    the path and lost the results; `trace hang --out` did the same after reading the dumps."""
    run = tmp_path / "run"
    _copy_tree(small_run, run)
    (run / "trace" / "hang").mkdir()
    (run / "trace" / "hang" / "rank00000.json").write_text('{"rank": 0}')
    task = tmp_path / "task.jsonl"
    task.write_text('{"context": "1 + 1 =", "choices": [" 2", " 3"], "gold": 0}\n')
    new = tmp_path / "missing" / "dir"
    argv, written = MADE[command]
    code, _, err = run_main(capsys, *[a.format(run=run, task=task, new=new) for a in argv])
    assert code == 0, err
    assert sorted(p.name for p in new.iterdir()) == written
    if command == "eval":
        (result,) = json.loads((new / "r.json").read_text())
        assert result["acc"] in (0.0, 1.0)


def test_trace_schedule_that_cannot_exist(tmp_path, capsys):
    code, _, err = run_main(
        capsys, "trace", "schedule", "--pp", "2", "--virtual", "2", "--microbatches", "3",
        "--out", str(tmp_path / "s.png"),
    )  # fmt: skip
    assert_one_line_error(code, err, "microbatches (3) divisible by the pipeline ranks (2)")
    assert not (tmp_path / "s.png").exists()


# ------------------------------------------------------------- resume must not damage the run


def test_resume_with_another_tokenizer_leaves_the_run_alone(small_run, tmp_path, capsys):
    from depthscale.data.tokenizer import train_bpe

    other = tmp_path / "other.json"
    train_bpe(["some text to learn merges from " * 20], 300).tok.save(str(other))
    before = tree_digest(small_run)
    code, _, err = run_main(
        capsys, "train", "-c", str(small_run / "config.toml"), "--train.steps", "3",
        "--data.tokenizer", str(other),
    )  # fmt: skip
    assert_one_line_error(code, err, "trained with the tokenizer in")
    assert tree_digest(small_run) == before


def test_resume_with_another_model_and_no_config_toml(small_run, tmp_path, capsys):
    """config.toml gone and another model.dim: refused from the checkpoint's own record, and no
    config.toml claiming the other dim is written beside the checkpoints."""
    run = tmp_path / "copy"
    _copy_tree(small_run, run)
    cfg_text = (run / "config.toml").read_text()
    (run / "config.toml").unlink()
    before = tree_digest(run)
    code, _, err = run_main(
        capsys, "train", "-c", CONFIG, *TINY, "--train.run_dir", str(run), "--model.dim", "64",
        "--train.steps", "3",
    )  # fmt: skip
    assert_one_line_error(code, err, "model.dim: checkpoint has 32, config has 64")
    assert tree_digest(run) == before
    # the right command still works
    (run / "config.toml").write_text(cfg_text)
    code, _, err = run_main(capsys, "train", "-c", str(run / "config.toml"), "--train.steps", "3")
    assert code == 0, err


def _copy_tree(src: Path, dst: Path) -> None:
    """A copy of a run directory (or checkpoint) that trains into itself, not into the original."""
    import shutil

    shutil.copytree(src, dst)
    config = dst / "config.toml"
    if config.is_file():
        config.write_text(config.read_text().replace(f'"{src}"', f'"{dst}"'))


# -------------------------------------------------------------------------- a NaN loss


def test_nan_loss_names_the_step_and_keeps_the_checkpoint(small_run, tmp_path, capsys):
    run = tmp_path / "copy"
    _copy_tree(small_run, run)
    before = tree_digest(run / "checkpoints")
    code, _, err = run_main(
        capsys, "train", "-c", str(run / "config.toml"), "--train.steps", "30",
        "--optim.lr", "1e6", "--train.grad_clip", "0", "--resilience.nan_replay", "false",
    )  # fmt: skip
    assert_one_line_error(code, err, "is not finite at step", "nothing was updated or saved")
    after = tree_digest(run / "checkpoints")
    assert {k: after.get(k) for k in before} == before  # earlier checkpoints untouched
    nan_step = int(err.split("at step ")[1].split()[0])
    assert not any(name.startswith(f"step_{nan_step:08d}") for name in after)


# ------------------------------------------------------------ several processes, signals, hangs


@pytest.mark.dist
def test_one_failing_rank_ends_every_rank_at_once(tmp_path):
    """Rank 1 raises while rank 0 waits in the step's collective: the launcher reports rank 1's
    error once and every process is gone within seconds (gloo's timeout is 30 minutes)."""
    start = time.monotonic()
    proc = cli(
        "train", "-c", CONFIG, *TINY, "--nproc", "2", "--parallel.dp_shard", "2",
        "--train.steps", "50", "--train.run_dir", str(tmp_path / "run"),
        "--faults", "crash@1:2", "--resilience.supervise", "false", cwd=tmp_path,
    )  # fmt: skip
    elapsed = time.monotonic() - start
    assert proc.returncode == 1, proc.stderr
    fault = "InjectedFault: injected fault on rank 1 at step 2 (crash@)"
    assert proc.stderr.count(fault) == 1, proc.stderr
    assert proc.stderr.count("depthscale: rank 1 failed") == 1
    assert "lost a peer" not in proc.stderr and "ChildFailedError" not in proc.stderr
    # start-up takes seconds to a minute or two on a loaded box; a hang would be gloo's 30 minutes
    assert elapsed < 600, elapsed


@pytest.mark.dist
def test_sigterm_to_the_launcher_saves_and_resumes(tmp_path):
    run = tmp_path / "run"
    args = [
        "train", "-c", CONFIG, *TINY, "--nproc", "2", "--parallel.dp_shard", "2",
        "--train.steps", "100000", "--checkpoint.every", "0", "--train.run_dir", str(run),
    ]  # fmt: skip
    proc = _start(args, tmp_path)
    wait_for_step(proc, 2)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert "Traceback" not in err, err
    stop_lines = [line for line in out.splitlines() if "stopped by SIGTERM" in line]
    assert len(stop_lines) == 1, out
    step = int(stop_lines[0].split("after step ")[1].split(";")[0])
    assert (run / "checkpoints" / f"step_{step:08d}").is_dir()
    assert "run the same command to resume" in stop_lines[0]


def test_ctrl_c_saves_where_it_stopped_and_resume_continues(tmp_path):
    run = tmp_path / "run"
    args = [
        "train", "-c", CONFIG, *TINY, "--train.steps", "100000", "--checkpoint.every", "0",
        "--train.run_dir", str(run),
    ]  # fmt: skip
    proc = _start(args, tmp_path)
    wait_for_step(proc, 1)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 128 + signal.SIGINT, err
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err
    line = next(line for line in out.splitlines() if "stopped by SIGINT" in line)
    step = int(line.split("after step ")[1].split(";")[0])
    state = json.loads(
        (run / "checkpoints" / f"step_{step:08d}" / "trainer_state.json").read_text()
    )
    assert state["step"] == step
    again = cli(
        "train", "-c", str(run / "config.toml"), "--train.steps", str(step + 1), cwd=tmp_path
    )
    assert again.returncode == 0, again.stderr
    assert f"resumed at step {step}" in again.stdout


def _start(args: list[str], cwd: Path) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "depthscale.cli", *args],
        cwd=cwd,
        env=dict(os.environ, PYTHONWARNINGS="ignore"),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


# ------------------------------------------------------------------- damaged checkpoints


def _flip_a_byte(step: Path) -> Path:
    shard = next(step.glob("*.distcp"))
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x40
    shard.write_bytes(bytes(data))
    return shard


def _truncate_shard(step: Path) -> Path:
    shard = next(step.glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:50])
    return shard


def _remove(name: str):
    def damage(step: Path) -> Path | None:
        (step / name).unlink()
        return None

    return damage


def _garbage(name: str):
    def damage(step: Path) -> Path:
        (step / name).write_text("{not json")
        return step / name

    return damage


DAMAGE = {
    "flipped shard byte": (_flip_a_byte, "SHA-256"),
    "truncated shard": (_truncate_shard, "bytes"),
    "no trainer state": (_remove("trainer_state.json"), "trainer_state.json"),
    "no DCP metadata": (_remove(".metadata"), ".metadata"),
    "no rng file": (_remove("rng_rank0.pt"), "rng_rank0.pt"),
    "garbage trainer state": (_garbage("trainer_state.json"), "trainer_state.json"),
    "garbage manifest": (_garbage("manifest.json"), "manifest.json"),
}


@pytest.mark.parametrize("kind", list(DAMAGE))
def test_damaged_newest_checkpoint_is_named_and_the_previous_one_used(
    small_run, tmp_path, capsys, kind
):
    run = tmp_path / "copy"
    _copy_tree(small_run, run)
    damage, reason = DAMAGE[kind]
    newest = run / "checkpoints" / "step_00000002"
    damaged = damage(newest)
    kept = damaged.read_bytes() if damaged is not None else None
    code, out, err = run_main(
        capsys, "train", "-c", str(run / "config.toml"), "--train.steps", "3",
        "--checkpoint.keep", "1",
    )  # fmt: skip
    assert code == 0, err
    assert "resumed at step 1" in out
    warning = next(line for line in err.splitlines() if "step_00000002" in line)
    assert warning.startswith("depthscale: warning") and reason in warning, err
    # retention never deleted the damaged checkpoint to make room: its bytes are still there
    if kept is not None:
        assert any(p.is_file() and p.read_bytes() == kept for p in (run / "checkpoints").rglob("*"))
    assert (run / "checkpoints" / "step_00000003" / "manifest.json").is_file()


def test_damaged_newest_checkpoint_for_generate_trace_convert(small_run, tmp_path, capsys):
    run = tmp_path / "copy"
    _copy_tree(small_run, run)
    _flip_a_byte(run / "checkpoints" / "step_00000002")
    _copy_tree(run / "checkpoints" / "step_00000001", run / "checkpoints" / "step_best")
    (run / "checkpoints" / "step_00000003.tmp").mkdir()  # an interrupted save
    before = tree_digest(run)
    code, out, err = run_main(
        capsys, "generate", "--run", str(run), "--prompt", "def", "--max-new-tokens", "4"
    )
    assert code == 0, err
    assert "step_00000002" in err and "step_best" in err
    code, _, err = run_main(
        capsys, "convert", "ds-to-hf", "--run", str(run), "--out", str(tmp_path / "hf")
    )
    assert code == 0, err
    code, _, err = run_main(
        capsys, "generate", "--run", str(run), "--prompt", "def",
        "--checkpoint", str(run / "checkpoints" / "step_00000002"),
    )  # fmt: skip
    assert_one_line_error(code, err, "step_00000002 cannot be used")
    assert tree_digest(run) == before


@pytest.mark.dist
def test_truncated_rng_file_of_one_rank_falls_back_without_a_hang(tmp_path):
    run = tmp_path / "run"
    common = [
        "train", "-c", CONFIG, *TINY, "--nproc", "2", "--parallel.dp_shard", "2",
        "--checkpoint.every", "1", "--checkpoint.keep", "0", "--train.run_dir", str(run),
    ]  # fmt: skip
    first = cli(*common, "--train.steps", "2", cwd=tmp_path)
    assert first.returncode == 0, first.stderr
    rng = run / "checkpoints" / "step_00000002" / "rng_rank1.pt"
    rng.write_bytes(rng.read_bytes()[:50])
    again = cli(*common, "--train.steps", "4", cwd=tmp_path)
    assert again.returncode == 0, again.stderr
    assert "resumed at step 1" in again.stdout
    assert again.stderr.count("step_00000002") >= 1 and "rng_rank1.pt" in again.stderr
