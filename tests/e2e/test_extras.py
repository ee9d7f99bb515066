"""Each user-facing extra of pyproject.toml, installed into a fresh virtual environment, runs the
command its docs give: `[lm-eval]` installed the harness without its own `hf` extra, so the
README's `lm_eval --model hf ... trust_remote_code=True` line on an export failed with
`ModuleNotFoundError: accelerate`, and no user-facing extra installed transformers at all.

One venv (`python -m venv`, no system site packages: what is installed for the dev suite must not
stand in for an extra), torch from the wheel on disk (pip's find-links / cache, as .ci/run and
the README install it), then each extra in turn with `pip install -e 'ROOT[extra]'` and its
command run. In turn, not one venv per extra, to keep it to minutes: an extra is checked only for
what the extras before it did not already install, so the order puts the smaller one first
(`hf`: transformers alone, before `lm-eval`, whose check then stands or falls on the harness's
hf extra, accelerate). The commands use the docs' own lines on tiny data: a parquet and a
.jsonl.zst corpus trained for one step, W&B offline, an AttnRes export loaded by transformers and
scored by `lm_eval --model hf` and by `depthscale lm-eval`. The fused CPU kernels are off
(`DEPTHSCALE_CPU_KERNELS=0`): building them in a new environment is a compile no extra changes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TORCH = "torch==2.13.0"
TINY = [
    "-c", str(ROOT / "configs" / "tiny.toml"), "--model.dim", "32", "--model.n_layers", "2",
    "--model.n_heads", "2", "--data.seq_len", "32", "--train.batch_size", "2",
    "--train.steps", "1", "--optim.warmup_steps", "0", "--train.eval_every", "0",
    "--logging.progress", "false", "--logging.tensorboard", "false", "--data.val_fraction", "0.2",
]  # fmt: skip


@pytest.mark.slow
def test_each_extra_runs_its_documented_command(tmp_path):
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    bin_ = venv / "bin"
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("PYTHON", "VIRTUAL_ENV", "DEPTHSCALE_STRICT"))
    }
    env |= {
        "PATH": f"{bin_}{os.pathsep}{env['PATH']}",
        "VIRTUAL_ENV": str(venv),
        "DEPTHSCALE_CPU_KERNELS": "0",
        "WANDB_MODE": "offline",
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "PYTHONWARNINGS": "ignore",
    }

    def run(*argv: str, check: bool = True) -> subprocess.CompletedProcess:
        proc = subprocess.run(
            [str(a) for a in argv], cwd=tmp_path, env=env, capture_output=True, text=True
        )
        if check:
            assert proc.returncode == 0, f"{argv}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
        return proc

    # --no-compile: pip byte-compiles every file it installs (all of torch: its install took 39 s,
    # 11 s without); the commands compile only what they import, as they run
    pip = [bin_ / "pip", "install", "-q", "--disable-pip-version-check", "--no-compile"]

    def install(extra: str) -> None:
        run(*pip, "-e", f"{ROOT}[{extra}]")

    python = bin_ / "python"
    run(*pip, TORCH)
    docs = [{"text": f"def f{i}(x):\n    return x * {i} + {i % 7}\n" * 20} for i in range(40)]

    # [parquet]: a .parquet corpus (docs/data.md)
    install("parquet")
    corpus = tmp_path / "corpus.parquet"
    run(python, "-c", "import pyarrow as pa, pyarrow.parquet as pq, json, sys; "
        "pq.write_table(pa.Table.from_pylist(json.loads(sys.argv[2])), sys.argv[1])",
        corpus, json.dumps(docs))  # fmt: skip
    run(bin_ / "depthscale", "train", *TINY, "--data.path", corpus, "--train.run_dir", "r-parquet")

    # [zstd]: a .jsonl.zst corpus
    install("zstd")
    corpus = tmp_path / "corpus.jsonl.zst"
    lines = "".join(json.dumps(d) + "\n" for d in docs)
    run(python, "-c", "import zstandard, sys; open(sys.argv[1], 'wb').write("
        "zstandard.ZstdCompressor().compress(sys.argv[2].encode()))", corpus, lines)  # fmt: skip
    run(bin_ / "depthscale", "train", *TINY, "--data.path", corpus, "--train.run_dir", "r-zst")

    # [wandb]: --logging.wandb true, offline (docs/observability.md); an AttnRes model, exported below
    install("wandb")
    run(bin_ / "depthscale", "train", *TINY, "--data.path", corpus, "--train.run_dir", "run",
        "--model.residual", "block", "--logging.wandb", "true")  # fmt: skip
    assert any((tmp_path / "run" / "wandb").glob("offline-run-*")), "no offline W&B run"

    # [hf]: the export, loaded by transformers as docs/interop.md shows
    install("hf")
    run(bin_ / "depthscale", "convert", "ds-to-hf", "--run", "run", "--out", "exported")
    run(python, "-c", "from transformers import AutoModelForCausalLM, AutoTokenizer; "
        "AutoModelForCausalLM.from_pretrained('exported', trust_remote_code=True); "
        "AutoTokenizer.from_pretrained('exported', trust_remote_code=True)")  # fmt: skip

    # [lm-eval]: the README's two harness lines, on a local multiple-choice task
    install("lm-eval")
    (tmp_path / "mc.jsonl").write_text(
        '{"context": "1 + 1 =", "choices": [" 2", " 3"], "gold": 0}\n'
        '{"context": "def f", "choices": ["(x)", " zq"], "gold": 0}\n'
    )
    (tmp_path / "tasks").mkdir()
    (tmp_path / "tasks" / "my_mc.yaml").write_text(
        textwrap.dedent(f"""\
        task: my_mc
        dataset_path: json
        dataset_kwargs:
          data_files:
            test: {tmp_path / "mc.jsonl"}
        test_split: test
        output_type: multiple_choice
        doc_to_text: "{{{{context}}}}"
        doc_to_choice: "{{{{choices}}}}"
        doc_to_target: "{{{{gold}}}}"
        target_delimiter: ""
        metric_list:
          - metric: acc
          - metric: acc_norm
        """)
    )
    task = ["--tasks", "my_mc", "--include_path", "tasks/"]
    hf = run(bin_ / "lm_eval", "--model", "hf", "--model_args",
             "pretrained=exported/,trust_remote_code=True", *task)  # fmt: skip
    ours = run(bin_ / "depthscale", "lm-eval", "--model", "depthscale", "--model_args", "run=run",
               *task)  # fmt: skip
    for proc in (hf, ours):
        assert "acc_norm" in proc.stdout and "my_mc" in proc.stdout, proc.stdout[-2000:]

    # [gpu]: Triton, which runs the kernels (interpreted where there is no GPU)
    install("gpu")
    run(python, "-c", "import triton, triton.language")
