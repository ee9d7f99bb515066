"""The command line as a user runs it: train, resume, generate, trace, convert, and bad input."""

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

TINY = [
    "--model.dim",
    "32",
    "--model.n_layers",
    "2",
    "--model.n_heads",
    "2",
    "--data.seq_len",
    "32",
    "--data.max_bytes",
    "200000",
    "--train.batch_size",
    "4",
    "--optim.warmup_steps",
    "2",
    "--train.eval_every",
    "4",
    "--logging.log_every",
    "2",
    "--checkpoint.every",
    "4",
    "--logging.progress",
    "false",
    "--logging.peak_tflops",
    "1",
]


# Only a hang guard: a 4-process run takes well under a minute on an idle 2-core box, but under load
# (a stress run with OMP_NUM_THREADS=4: 16 threads on 2 busy cores, first-use kernel builds) several
# minutes; $DEPTHSCALE_E2E_TIMEOUT_S overrides.
CLI_TIMEOUT_S = float(os.environ.get("DEPTHSCALE_E2E_TIMEOUT_S", "900"))


def cli(*args, cwd, check=True, env=None):
    env = dict(os.environ, PYTHONWARNINGS="ignore", **(env or {}))
    proc = subprocess.run(
        [sys.executable, "-m", "depthscale.cli", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=CLI_TIMEOUT_S,
    )
    if check and proc.returncode != 0:
        raise AssertionError(
            f"exit {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
        )
    return proc


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory):
    """A block-AttnRes run trained for 8 steps on the stdlib corpus (the default data)."""
    root = tmp_path_factory.mktemp("cli")
    proc = cli(
        "train",
        "-c",
        str(os.path.abspath("configs/tiny.toml")),
        *TINY,
        "--train.steps",
        "8",
        "--model.residual",
        "block",
        "--model.attnres_n_blocks",
        "2",
        "--train.run_dir",
        str(root / "run"),
        cwd=root,
    )
    return root, proc


def test_train_prints_falling_loss_and_writes_run_dir(trained_run):
    root, proc = trained_run
    losses = [
        float(line.split("loss ")[1].split()[0])
        for line in proc.stdout.splitlines()
        if line.startswith("step") and "| loss" in line
    ]
    assert len(losses) == 4 and losses[-1] < losses[0]
    run = root / "run"
    assert (run / "metrics.jsonl").is_file() and list((run / "tb").glob("events.out.tfevents.*"))
    assert (run / "checkpoints" / "step_00000008" / "trainer_state.json").is_file()


def test_rerun_resumes_and_extends(trained_run):
    root, _ = trained_run
    proc = cli(
        "train",
        "-c",
        str(os.path.abspath("configs/tiny.toml")),
        *TINY,
        "--train.steps",
        "10",
        "--model.residual",
        "block",
        "--model.attnres_n_blocks",
        "2",
        "--train.run_dir",
        str(root / "run"),
        cwd=root,
    )
    assert "resumed at step 8" in proc.stdout
    assert (root / "run" / "checkpoints" / "step_00000010").is_dir()


def test_generate_and_trace(trained_run):
    root, _ = trained_run
    out = cli(
        "generate",
        "--run",
        str(root / "run"),
        "--prompt",
        "import ",
        "--max-new-tokens",
        "20",
        "--temperature",
        "0",
        cwd=root,
    )
    assert out.stdout.startswith("import ")
    cli("trace", "depth", "--run", str(root / "run"), "--out", str(root / "depth.png"), cwd=root)
    assert (root / "depth.png").stat().st_size > 1000
    trace = json.loads((root / "depth.json").read_text())
    assert len(trace["weights"]) == 4 + 1  # 4 sublayers + the final output read


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--model.dimm", "3"], "unknown key in [model] 'dimm' (did you mean 'dim'?)"),
        (["--model.n_heads", "3"], "model.n_heads=3 must divide model.dim=32"),
        (["--data.path", "/no/such/corpus.txt"], "/no/such/corpus.txt"),
        (["--parallel.tp", "2"], "parallel layout needs 2 processes; add --nproc 2"),
        (["--parallel.pp_virtual", "2"], "parallel.pp_virtual=2 needs parallel.pp > 1"),
        (
            [
                "--parallel.cp",
                "3",
                "--nproc",
                "3",
                "--data.seq_len",
                "32",
                "--model.max_seq_len",
                "32",
            ],
            "parallel.cp=3 pads data.seq_len=32 to 36",
        ),
        (["--parallel.dp_shard", "2", "--nproc", "4"], "= 2 processes, but --nproc is 4"),
    ],
)
def test_bad_input_fails_before_work_with_one_line(tmp_path, args, message):
    proc = cli(
        "train", *TINY, "--train.run_dir", str(tmp_path / "run"), *args, cwd=tmp_path, check=False
    )
    assert proc.returncode == 2
    assert message in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_convert_round_trip_through_hugging_face(tmp_path):
    transformers = pytest.importorskip("transformers")
    import torch

    hf_cfg = transformers.LlamaConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=128,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(hf_cfg).eval()
    hf.save_pretrained(tmp_path / "hf")
    cli(
        "convert",
        "hf-to-ds",
        "--hf",
        str(tmp_path / "hf"),
        "--out",
        str(tmp_path / "ds"),
        cwd=tmp_path,
    )
    cli(
        "convert",
        "ds-to-hf",
        "--run",
        str(tmp_path / "ds"),
        "--out",
        str(tmp_path / "hf2"),
        cwd=tmp_path,
    )
    again = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "hf2").eval()
    tokens = torch.randint(0, 128, (1, 9))
    with torch.no_grad():  # the same weights in the same HF code: the same bits
        assert torch.equal(again(tokens).logits, hf(tokens).logits)


def test_trace_schedule_draws_png_and_reports_bubble(tmp_path):
    out = cli(
        "trace",
        "schedule",
        "--pp",
        "2",
        "--virtual",
        "2",
        "--microbatches",
        "4",
        "--out",
        str(tmp_path / "s.png"),
        cwd=tmp_path,
    )
    assert "bubble 0.1250" in out.stdout  # (P-1)/(V·M) = 1/8
    assert (tmp_path / "s.png").stat().st_size > 1000


def _write_task(path: Path) -> None:
    """A multiple-choice task file of 6 questions (`evaluation/multiple_choice.py`'s format)."""
    questions = [
        ("def f(x):\n    return", [" x", " None", " f(x)"], 0),
        ("import", [" os", " sys", "ys"], 1),
        ("for i in range(", ["10):", "n):", "len(x)):"], 2),
        ("class A", ["(object):", ":", "(B):"], 1),
        ("if __name__ ==", [' "__main__":', " 1:", " None:"], 0),
        ("    self.", ["x = x", "assertEqual(", "name"], 2),
    ]
    path.write_text(
        "".join(
            json.dumps({"context": c, "choices": ch, "gold": g}) + "\n" for c, ch, g in questions
        )
    )


def _train_short(tmp_path, *args):
    """Four steps of the tiny config (block AttnRes), with a downstream task ("mc") evaluated at
    step 4; returns the logged losses and grad norms, and the task's acc and acc_norm."""
    _write_task(tmp_path / "task.jsonl")
    (tmp_path / "held.jsonl").write_text(  # a named held-out set: val/held/loss and bpb
        "".join(
            json.dumps({"text": f"def f{i}(x):\n    return x * {i}\n" * 8}) + "\n"
            for i in range(40)
        )
    )
    proc = cli(
        "train",
        "-c",
        str(os.path.abspath("configs/tiny.toml")),
        *args,
        "--model.residual",
        "block",
        "--train.steps",
        "4",
        "--optim.warmup_steps",
        "1",
        "--logging.log_every",
        "2",
        "--logging.progress",
        "false",
        "--train.eval_every",
        "4",
        "--data.max_bytes",
        "300000",
        "--train.run_dir",
        str(tmp_path / "run"),
        "--eval.tasks",
        f'[{{path = "{tmp_path / "task.jsonl"}", name = "mc"}}]',
        "--eval.sets",
        f'[{{name = "held", path = "{tmp_path / "held.jsonl"}"}}]',
        cwd=tmp_path,
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("step") and "| loss" in ln]
    logged = [
        (float(ln.split("loss ")[1].split()[0]), float(ln.split("grad_norm ")[1].split()[0]))
        for ln in lines
    ]
    records = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    evals = [json.loads(r) for r in records if '"split": "eval/mc"' in r]
    held = [json.loads(r) for r in records if '"split": "val/held"' in r]
    assert [r["step"] for r in evals] == [r["step"] for r in held] == [4]
    return logged, {k: evals[0][k] for k in ("acc", "acc_norm")} | {
        f"held_{k}": held[0][k] for k in ("loss", "bpb")
    }


@pytest.fixture(scope="module")
def one_process_run(tmp_path_factory):
    path = tmp_path_factory.mktemp("one")
    return (*_train_short(path), path)


# Each launch costs ~20 s, nearly all start-up (4 workers importing torch on 2 cores), so the
# command line runs every axis once, not every composition: pipelines with middle stages and
# interleaving, with tp, with cp, and HSDP with offload. The compositions left out here (tp x
# dp_shard, pp x dp_shard, a 4-rank ring) are proven against one process in tests/dist
# (test_composed.py, test_context_parallel.py), their task scores in test_downstream_eval.py.
@pytest.mark.parametrize(
    "layout",
    [
        ["--parallel.pp", "4", "--parallel.pp_virtual", "2"],
        ["--parallel.pp", "2", "--parallel.tp", "2", "--parallel.pp_virtual", "2"],
        ["--parallel.pp", "2", "--parallel.cp", "2"],
        [
            "--parallel.dp_replicate",
            "2",
            "--parallel.dp_shard",
            "2",
            "--train.offload_params",
            "true",
        ],
    ],
)
def test_multi_process_training_from_the_command_line(tmp_path, layout, one_process_run):
    """`depthscale train --nproc 4 ...` launches 4 workers through torchrun's machinery, and the
    logged losses and gradient norms equal the one-process run's (printed to 4 decimals / 3).

    Tolerance: printing alone puts two equal-to-rounding values up to one last digit apart (1e-4 /
    1e-3); the other half is for the layouts' fp32 reordering, carried through 4 free-running AdamW
    steps (no per-step resync from outside the CLI): ~2e-5 of a loss of ~5, far above the ~1e-7
    one step gives; a layout bug (a lost gradient or token) moves them by orders of magnitude more."""
    logged, evals = _train_short(tmp_path, "--nproc", "4", *layout)
    ref_logged, ref_evals, _ = one_process_run
    assert len(logged) == 2
    for (loss, norm), (ref_loss, ref_norm) in zip(logged, ref_logged):
        assert loss == pytest.approx(ref_loss, abs=2e-4)
        assert norm == pytest.approx(ref_norm, abs=2e-3)
    # the downstream task, scored in the layout; the named held-out set's loss (and bits per byte)
    assert {k: evals[k] for k in ("acc", "acc_norm")} == {
        k: ref_evals[k] for k in ("acc", "acc_norm")
    }
    assert evals["held_loss"] == pytest.approx(ref_evals["held_loss"], abs=2e-4)
    assert evals["held_bpb"] == pytest.approx(ref_evals["held_bpb"], abs=3e-4)
    assert (tmp_path / "run" / "checkpoints" / "step_00000004" / "trainer_state.json").is_file()


def test_depthscale_eval_reports_what_training_evaluated(one_process_run):
    """`depthscale eval` on the run's final checkpoint reports the acc and acc_norm that training
    logged for the same task at that step (the layouts' runs above log them too)."""
    _, evals, path = one_process_run
    out = path / "eval.json"
    cli("eval", "--run", "run", "--tasks", "task.jsonl", "--json", str(out), cwd=path)
    (result,) = json.loads(out.read_text())
    assert result["task"] == "task" and result["n"] == 6
    assert {k: result[k] for k in ("acc", "acc_norm")} == {k: evals[k] for k in ("acc", "acc_norm")}


def test_pipeline_trains_in_bf16_from_the_command_line(tmp_path, one_process_run):
    """`--parallel.pp 2 --train.dtype bfloat16` (it crashed: fp32 hops into bf16 receive buffers):
    the depth state is bf16 throughout, the hops too, the loss falls, and the first step names
    the fused AttnRes kernels it ran (uniform bf16 sources: no silent PyTorch fallback).

    The same launch asks for a profile window: `--logging.profile_steps 2-3
    --logging.profile_ranks 1`: rank 1 writes a Chrome trace of steps 2-3 (ops and shapes) and
    says where; rank 0 writes none; a run without the option has no profile folder (the
    one-process run of the parity tests)."""
    proc = cli(
        "train",
        *TINY,
        *("--nproc", "2", "--parallel.pp", "2", "--train.dtype", "bfloat16"),
        *("--model.residual", "block", "--model.attnres_n_blocks", "2"),
        *("--train.steps", "4", "--optim.warmup_steps", "1", "--logging.log_every", "1"),
        *("--logging.progress", "false", "--train.eval_every", "4", "--data.max_bytes", "300000"),
        *("--logging.profile_steps", "2-3", "--logging.profile_ranks", "1"),
        *("--train.run_dir", str(tmp_path / "run")),
        cwd=tmp_path,
    )
    out = proc.stdout
    assert "AttnRes kernels: merge=cpu, phase1=cpu" in out
    losses = [float(ln.split("loss ")[1].split()[0]) for ln in out.splitlines() if "| loss" in ln]
    assert len(losses) == 4 and all(math.isfinite(x) for x in losses)
    assert losses[-1] < losses[0]
    assert "val loss" in out
    both = proc.stdout + proc.stderr
    folder = tmp_path / "run" / "trace" / "profile"
    assert sorted(p.name for p in folder.iterdir()) == ["rank00001-steps2-3.json"]
    assert f"rank 1: profile of the steps written to {folder / 'rank00001-steps2-3.json'}" in both
    events = json.loads((folder / "rank00001-steps2-3.json").read_text())["traceEvents"]
    assert any(e.get("name") == "aten::mm" and "Input Dims" in e.get("args", {}) for e in events)
    assert "USDT" not in both
    runs = list(tmp_path.parent.glob("one*/run"))
    assert runs and not any((r / "trace" / "profile").exists() for r in runs)


def test_pipeline_run_resumes_where_it_stopped(tmp_path):
    """A pipeline run (pp=2 with cp=2, Block AttnRes, AdamW) resumed from its step-2 checkpoint
    logs the same losses at steps 3 and 4 as the uninterrupted run: each stage restores its own
    parameters' optimizer state (stages hold different parameters)."""
    common = [
        *("--nproc", "4", "--parallel.pp", "2", "--parallel.cp", "2"),
        *(
            "--model.residual",
            "block",
            "--model.attnres_n_blocks",
            "2",
            "--optim.schedule",
            "constant",
        ),
        *("--optim.warmup_steps", "0", "--logging.log_every", "1", "--logging.progress", "false"),
        *("--train.eval_every", "0", "--data.max_bytes", "300000", "--checkpoint.every", "2"),
    ]

    def losses(run: str, steps: int) -> dict[int, str]:
        out = cli(
            "train",
            *TINY,
            *common,
            "--train.steps",
            str(steps),
            "--train.run_dir",
            str(tmp_path / run),
            cwd=tmp_path,
        ).stdout
        lines = [ln.split() for ln in out.splitlines() if ln.startswith("step") and "| loss" in ln]
        return {int(w[1].split("/")[0]): w[4] for w in lines}

    # the uninterrupted run saves at step 2 too: a copy of its directory without the step-4
    # checkpoint is a run stopped after step 2 (one launch fewer than training it again)
    straight = losses("straight", 4)
    shutil.copytree(tmp_path / "straight", tmp_path / "resumed")
    shutil.rmtree(tmp_path / "resumed" / "checkpoints" / "step_00000004")
    resumed = losses("resumed", 4)
    assert sorted(resumed) == [3, 4]
    assert resumed == {k: straight[k] for k in (3, 4)}


@pytest.mark.slow  # two 2-process runs, 45 s
def test_a_ring_checkpoint_resumes_under_ulysses(tmp_path):
    """A ring run (cp = 2, Block AttnRes, AdamW) resumed from its step-2 checkpoint as Ulysses
    (`parallel.cp_ulysses = 2`: the same parameters and FSDP shards over cp, attention by
    all-to-alls) logs the losses of the uninterrupted ring run at steps 3 and 4, to the model's
    fp32 bound (the layouts sum attention in other orders; tests/tolerances.py)."""
    from depthscale.config import Config
    from tolerances import fp32_model_bound

    common = [
        *TINY,
        *("--nproc", "2", "--parallel.cp", "2", "--model.residual", "block"),
        *("--model.attnres_n_blocks", "2", "--optim.schedule", "constant"),
        *("--optim.warmup_steps", "0", "--logging.log_every", "1", "--logging.progress", "false"),
        *("--train.eval_every", "0", "--data.max_bytes", "300000", "--checkpoint.every", "2"),
    ]

    def losses(run: str, *extra: str) -> dict[int, float]:
        out = cli("train", *common, *extra, "--train.run_dir", str(tmp_path / run), cwd=tmp_path)
        rows = [ln.split() for ln in out.stdout.splitlines() if ln.startswith("step")]
        return {int(w[1].split("/")[0]): float(w[4]) for w in rows if "loss" in w}

    ring = losses("ring", "--train.steps", "4")
    step2 = tmp_path / "ring" / "checkpoints" / "step_00000002"
    ulysses = losses(
        "ulysses", "--train.steps", "4", "--parallel.cp_ulysses", "2",
        "--checkpoint.resume", str(step2),
    )  # fmt: skip
    assert sorted(ulysses) == [3, 4]
    cfg = Config()
    cfg.model.dim, cfg.model.n_layers, cfg.model.n_heads = 32, 2, 2
    cfg.model.residual, cfg.model.attnres_n_blocks = "block", 2
    bound = fp32_model_bound(cfg.model, 32, 4)  # TINY's rows
    for step in (3, 4):  # the printed loss rounds too: half its last digit
        gap = abs(ulysses[step] - ring[step])
        assert gap <= max(bound * ring[step], 5e-5), (step, ring, ulysses)


def _wandb_records(path: Path) -> list:
    """The records of a W&B transaction log (RUN/wandb/offline-run-*/run-ID.wandb): a 7-byte
    header (":W&B", magic, version), then LevelDB-log records in 32 KiB blocks (crc32c, length,
    type: 1 full, 2 first, 3 middle, 4 last), each a `wandb_internal_pb2.Record`."""
    from wandb.proto import wandb_internal_pb2

    data, block, pos, pending, records = path.read_bytes(), 32768, 7, b"", []
    assert data[:4] == b":W&B"
    while pos + 7 <= len(data):
        left = block - pos % block
        length, kind = int.from_bytes(data[pos + 4 : pos + 6], "little"), data[pos + 6]
        if left < 7 or (length == 0 and kind == 0):
            pos += left  # a block's zero-filled tail
            continue
        pending += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            records.append(record)
            pending = b""
    return records


def test_wandb_gets_the_scalars_and_a_resumed_run_continues_it(tmp_path, one_process_run):
    """Offline W&B: the logged train/loss of every logged step (equal to metrics.jsonl's), the
    config, and after a rerun to more steps the same W&B run id. Off, a run writes nothing of
    W&B and never imports it."""
    run = tmp_path / "run"
    args = [
        "train", *TINY, "--train.steps", "4", "--optim.warmup_steps", "1",
        *("--logging.log_every", "2", "--logging.progress", "false", "--logging.wandb", "true"),
        *("--logging.wandb_project", "proj", "--train.run_dir", str(run)),
    ]  # fmt: skip
    env = {"WANDB_MODE": "offline", "WANDB_DIR": str(tmp_path), "WANDB_CONFIG_DIR": str(tmp_path)}
    cli(*args, cwd=tmp_path, env=env)
    cli(*[a if a != "4" else "6" for a in args], cwd=tmp_path, env=env)
    run_id = (run / "wandb_id").read_text().strip()
    logs = sorted(run.glob("wandb/offline-run-*/run-*.wandb"))
    assert len(logs) == 2 and all(p.name == f"run-{run_id}.wandb" for p in logs)
    logged = {}
    for log in logs:
        for record in _wandb_records(log):
            kind = record.WhichOneof("record_type")
            if kind == "run":
                assert record.run.run_id == run_id and record.run.project == "proj"
            if kind == "history":
                items = {
                    i.key or "/".join(i.nested_key): json.loads(i.value_json)
                    for i in record.history.item
                }
                if "train/loss" in items:
                    logged[items["step"]] = items["train/loss"]
    ours = [json.loads(ln) for ln in (run / "metrics.jsonl").read_text().splitlines()]
    assert logged == {r["step"]: r["loss"] for r in ours if r["split"] == "train"}
    assert sorted(logged) == [2, 4, 6]
    plain = next(iter(tmp_path.parent.glob("one*/run")))
    assert not (plain / "wandb").exists() and not (plain / "wandb_id").exists()
    code = (
        "import sys, tempfile; from depthscale.observe.metrics_log import MetricsLogger; "
        "MetricsLogger(tempfile.mkdtemp(), False).close(); print('wandb' in sys.modules)"
    )
    imported = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert imported.stdout.strip() == "False", imported.stderr
