"""lm-evaluation-harness on depthscale runs (`interop/lm_eval_adapter.py`): a local
multiple-choice task through the harness reports the acc and acc_norm of `depthscale eval`, its
log-likelihoods are our evaluator's, and for a standard model those of the Hugging Face export
through the harness's own `hf` model; rolling log-likelihoods and greedy generation are
depthscale's; `depthscale lm-eval` is the harness's command line with `--model depthscale`; a
missing harness is one line naming the extra.

fp32 tolerance (tests/tolerances.py): the harness batches and orders requests its own way and the
HF export is another implementation of the same forward pass, so log-likelihoods agree within
`fp32_model_bound` of the forward alone, relative to the value (our evaluator through the adapter
runs our own code on the same rows: equal to that bound too, as batch shapes differ). acc and
acc_norm must be equal exactly: the fixture's best choices lead by far more than the bound
(checked).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from depthscale.config import Config, ModelConfig, to_toml
from depthscale.data.tokenizer import ByteTokenizer
from depthscale.evaluation.multiple_choice import loglikelihoods, read_task, score, task_pairs
from depthscale.model.generate import generate
from depthscale.model.transformer import Transformer
from depthscale.train.checkpoint import save_model
from tolerances import check, fp32_model_bound

lm_eval = pytest.importorskip("lm_eval")
from lm_eval.api.instance import Instance  # noqa: E402
from lm_eval.tasks import TaskManager  # noqa: E402

import depthscale.interop.lm_eval_adapter as adapter  # noqa: E402  (registers the model)

BYTE = ByteTokenizer()
OFFLINE = {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
QUESTIONS = [
    ("The capital of France is", [" Paris", " a cat", " 42"], 0),
    ("def add(a, b):\n    return", [" a + b", " None", "x"], 0),
    ("1, 2, 3,", [" 4", " banana", " seven hundred"], 0),
    ("She opened the", [" door", " sky", " of"], 0),
    ("import", [" numpy as np", " the", "("], 0),
]


def _model_config(residual: str) -> ModelConfig:
    return ModelConfig(
        dim=32, n_layers=2, n_heads=4, vocab_size=320, max_seq_len=64, residual=residual,
        attnres_n_blocks=2,
    )  # fmt: skip


def _run_dir(root: Path, residual: str) -> Path:
    """A run directory as training leaves one: config.toml, tokenizer/, a verified checkpoint."""
    torch.manual_seed(0)
    model = Transformer(_model_config(residual))
    with torch.no_grad():  # clear margins between the choices
        for p in model.parameters():
            if p.ndim > 1:
                p.normal_(0.0, 0.3)
    cfg = Config(model=model.cfg)
    cfg.data.seq_len = 64
    run = root / residual
    cfg.train.run_dir = str(run)
    run.mkdir(parents=True)
    (run / "config.toml").write_text(to_toml(cfg.validate()))
    BYTE.save(run / "tokenizer")
    save_model(run / "checkpoints" / "step_00000000", model, {"step": 0, "tokens_seen": 0})
    return run


@pytest.fixture(scope="module")
def task_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("lm_eval")
    data = root / "toy.jsonl"
    data.write_text(
        "".join(
            json.dumps({"context": c, "choices": ch, "gold": g}) + "\n" for c, ch, g in QUESTIONS
        )
    )
    (root / "toy.yaml").write_text(
        "task: toy_mc\n"
        "dataset_path: json\n"
        f"dataset_kwargs:\n  data_files:\n    test: {data}\n"
        "test_split: test\n"
        "output_type: multiple_choice\n"
        'doc_to_text: "{{context}}"\n'
        'doc_to_choice: "{{choices}}"\n'
        'doc_to_target: "{{gold}}"\n'
        'target_delimiter: ""\n'
        "metric_list:\n  - metric: acc\n  - metric: acc_norm\n"
    )
    return root


@pytest.fixture(autouse=True)
def _offline(monkeypatch):
    for key, value in OFFLINE.items():
        monkeypatch.setenv(key, value)


def _harness(model: str, model_args: str, task_dir: Path) -> tuple[dict, list[float]]:
    """(acc, acc_norm) and every choice's log-likelihood, question by question, as the harness
    scored them."""
    out = lm_eval.simple_evaluate(
        model=model, model_args=model_args, tasks=["toy_mc"], batch_size=4, device="cpu",
        task_manager=TaskManager(include_path=str(task_dir)), log_samples=True,
    )  # fmt: skip
    metrics = out["results"]["toy_mc"]
    samples = sorted(out["samples"]["toy_mc"], key=lambda s: s["doc_id"])
    lls = [float(r[0][0]) for s in samples for r in s["resps"]]
    return {"acc": metrics["acc,none"], "acc_norm": metrics["acc_norm,none"]}, lls


def _ours(run: Path, task_dir: Path) -> tuple[dict, list[float], float]:
    from depthscale.interop.run_dir import load_run

    model, tokenizer = load_run(run)
    task = read_task(task_dir / "toy.jsonl")
    result = score(model, tokenizer, task)
    lls = loglikelihoods(model, task_pairs(tokenizer, task))
    it = iter(lls)
    bound = fp32_model_bound(model.cfg, 64, 4, backward=False)
    for q in task.questions:
        scores = [next(it) for _ in q.choices]
        for ranked in (scores, [s / len(c) for s, c in zip(scores, q.choices)]):
            top = sorted(ranked, reverse=True)
            assert top[0] - top[1] > 4 * bound * abs(top[0]), "the fixture has a near-tie"
    return {"acc": result["acc"], "acc_norm": result["acc_norm"]}, lls, bound


def _close(got: list[float], want: list[float], bound: float) -> None:
    assert len(got) == len(want)
    for i, (a, b) in enumerate(zip(got, want)):
        check(abs(a - b) / abs(b), bound, f"choice {i} log-likelihood")


@pytest.mark.parametrize(
    "residual",
    ["block", pytest.param("standard", marks=pytest.mark.slow)],  # two harness runs: ~15 s
)
def test_the_harness_scores_a_run_as_depthscale_eval_does(tmp_path, task_dir, residual):
    """Through `--model depthscale`: equal acc / acc_norm, log-likelihoods within the bound; for
    the standard model also through the harness's `hf` model on the Hugging Face export, with the
    harness's default tokenization: the export's tokenizer starts a text with the EOS training
    put before every document (add_bos_token=True would rebuild it to start with the BOS)."""
    run = _run_dir(tmp_path, residual)
    expected, lls, bound = _ours(run, task_dir)
    metrics, harness_lls = _harness("depthscale", f"run={run}", task_dir)
    assert metrics == expected
    _close(harness_lls, lls, bound)
    if residual == "standard":
        from depthscale.interop.run_dir import run_to_hf

        run_to_hf(run, tmp_path / "hf")
        args = f"pretrained={tmp_path / 'hf'},dtype=float32"
        metrics, hf_lls = _harness("hf", args, task_dir)
        assert metrics == expected
        _close(hf_lls, lls, bound)


def test_rolling_loglikelihood_and_greedy_generation_are_depthscales(tmp_path):
    """A text longer than the context is scored in the harness's disjoint windows: the sum of
    every token's log-probability given what precedes it in its window; generation is greedy
    decoding with the KV cache, cut at the first stop string."""
    run = _run_dir(tmp_path, "block")
    lm = adapter.DepthscaleLM(run=str(run), batch_size=4, device="cpu")
    text = "abcdefghij" * 9  # 90 tokens: two windows of a 64-token context
    (rolling,) = lm.loglikelihood_rolling([Instance("loglikelihood_rolling", {}, (text,), 0)])
    ids = BYTE.encode(text)
    # window 1: EOS + ids[0:63] predicts ids[0:64]; window 2: ids[25:89] predicts ids[26:90],
    # of which the last 26 (ids[64:90]) are scored: each token once, with up to 64 before it
    windows = [([BYTE.eos_id, *ids[:63]], ids[:64]), (ids[25:89], ids[64:90])]
    want = 0.0
    with torch.no_grad():
        for inputs, scored in windows:
            logprobs = torch.log_softmax(lm.model(torch.tensor([inputs])).double(), dim=-1)[0]
            first = len(inputs) - len(scored)
            want += sum(logprobs[first + i, t].item() for i, t in enumerate(scored))
    assert rolling == pytest.approx(want, rel=1e-5)

    (out,) = lm.generate_until(
        [Instance("generate_until", {}, ("def main(", {"until": ["\n"], "max_gen_toks": 12}), 0)]
    )
    prompt = torch.tensor([[BYTE.eos_id, *BYTE.encode("def main(")]])
    greedy = generate(lm.model, prompt, 12, temperature=0.0, eos_id=BYTE.eos_id)
    text = BYTE.decode([t for t in greedy[0, prompt.shape[1] :].tolist() if t != BYTE.eos_id])
    assert out == text.split("\n", 1)[0]


@pytest.mark.slow  # a fresh process importing the harness (CI runs it after the default suite)
def test_depthscale_lm_eval_is_the_harness_command_line(tmp_path, task_dir):
    """`depthscale lm-eval --model depthscale --model_args run=DIR ...` in a fresh process writes
    the harness's results file with our acc and acc_norm."""
    run = _run_dir(tmp_path, "block")
    expected, _, _ = _ours(run, task_dir)
    proc = subprocess.run(
        [sys.executable, "-m", "depthscale.cli", "lm-eval", "--model", "depthscale",
         "--model_args", f"run={run}", "--tasks", "toy_mc", "--include_path", str(task_dir),
         "--batch_size", "4", "--output_path", str(tmp_path / "out")],
        env=dict(os.environ, **OFFLINE), capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    (results,) = list((tmp_path / "out").rglob("results_*.json"))
    metrics = json.loads(results.read_text())["results"]["toy_mc"]
    assert {"acc": metrics["acc,none"], "acc_norm": metrics["acc_norm,none"]} == expected


def test_without_the_harness_lm_eval_is_one_line_naming_the_extra(monkeypatch, capsys):
    import importlib.util

    from depthscale.cli import main

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "lm_eval" else real(name, *a)
    )
    assert main(["lm-eval", "--model", "depthscale", "--tasks", "x"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (
        "depthscale: error: depthscale lm-eval needs lm-evaluation-harness; "
        "pip install 'depthscale[lm-eval]'"
    )


def test_what_the_harness_refuses_is_one_line(tmp_path, task_dir, capsys):
    """A task the harness does not know: one error line after the harness's own INFO lines, exit
    2 (the harness indexes its thousands of tasks first: one call). A run that is not one and a
    batch size that is none are refused by the adapter with the errors `main` prints as one line."""
    from depthscale.cli import main
    from depthscale.errors import CheckpointError, ConfigError

    run = _run_dir(tmp_path, "block")
    args = ["--model_args", f"run={run}", "--tasks", "nosuch", "--include_path", str(task_dir)]
    assert main(["lm-eval", "--model", "depthscale", *args]) == 2
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err
    lines = [ln for ln in err.splitlines() if " INFO " not in ln and " WARNING " not in ln]
    assert lines == ["depthscale: error: lm-evaluation-harness: Tasks not found: nosuch"], err
    with pytest.raises(CheckpointError, match="is not a run directory"):
        adapter.DepthscaleLM(run=str(tmp_path))
    with pytest.raises(ConfigError, match="run=DIR is required"):
        adapter.DepthscaleLM()
    with pytest.raises(ConfigError, match="--batch_size '0'"):
        adapter.DepthscaleLM(run=str(run), batch_size="0")
