"""A mixture run as a user makes one: three local sources in three formats (a parquet file, a folder
of .jsonl.zst files, a Megatron .bin/.idx pair, each written here), weights 0.5 / 0.3 / 0.2 and a
stage at step 20, killed (SIGKILL) at step 31 and resumed on two data-parallel processes. The
resumed run's data states at every checkpoint (the batches are a function of the state:
tests/unit/test_mixture.py) and its logged per-source token counts equal the uninterrupted run's,
and every logged count is within one window of its stage's share."""

from __future__ import annotations

import json
import struct
import sysconfig
from pathlib import Path

import numpy as np
import pytest
from test_cli import cli

from depthscale.data.tokenizer import ByteTokenizer

# a SIGKILL drill of three runs (~20 s): CI runs it after the default suite, with the other drills
pytestmark = pytest.mark.slow

SEQ, BATCH, STEPS = 32, 8, 40
WEIGHTS = {"web": 0.5, "code": 0.3, "wiki": 0.2}
STAGE_AT, STAGE = 20, {"web": 0.2, "code": 0.2, "wiki": 0.6}


def _texts() -> list[str]:
    root = Path(sysconfig.get_paths()["stdlib"])
    return [p.read_text(errors="replace")[:3000] for p in sorted(root.glob("*.py"))[:90]]


def _sources(root: Path) -> dict[str, Path]:
    import pyarrow as pa
    import pyarrow.parquet as pq
    import zstandard

    texts = _texts()
    pq.write_table(pa.table({"text": texts[:30]}), root / "web.parquet")
    code = root / "code"
    code.mkdir()
    for i in range(2):
        lines = "".join(json.dumps({"text": t}) + "\n" for t in texts[30 + 15 * i : 45 + 15 * i])
        (code / f"part{i}.jsonl.zst").write_bytes(
            zstandard.ZstdCompressor().compress(lines.encode())
        )
    byte = ByteTokenizer()  # a Megatron pair: one sequence a document, EOD appended
    docs = [np.array([*byte.encode(t), byte.eos_id], dtype=np.uint16) for t in texts[60:]]
    lengths = [len(d) for d in docs]
    pointers = np.concatenate([[0], np.cumsum(lengths)[:-1]]) * 2
    (root / "wiki.bin").write_bytes(b"".join(d.tobytes() for d in docs))
    with open(root / "wiki.idx", "wb") as f:
        f.write(b"MMIDIDX\x00\x00" + struct.pack("<QBQQ", 1, 8, len(docs), len(docs) + 1))
        f.write(np.asarray(lengths, "<i4").tobytes() + np.asarray(pointers, "<i8").tobytes())
        f.write(np.arange(len(docs) + 1, dtype="<i8").tobytes())
    return {"web": root / "web.parquet", "code": code, "wiki": root / "wiki.bin"}


def _config(root: Path) -> Path:
    paths = _sources(root)
    text = "[data]\n"
    for name, weight in WEIGHTS.items():
        text += f'[[data.sources]]\nname = "{name}"\npath = "{paths[name]}"\nweight = {weight}\n'
    weights = ", ".join(f"{k} = {v}" for k, v in STAGE.items())
    text += f"[[data.stages]]\nat_step = {STAGE_AT}\nweights = {{{weights}}}\n"
    (root / "mix.toml").write_text(text)
    return root / "mix.toml"


COMMON = [
    *("--model.dim", "32", "--model.n_layers", "2", "--model.n_heads", "2"),
    *("--data.seq_len", str(SEQ), "--train.batch_size", str(BATCH)),
    *("--train.steps", str(STEPS), "--optim.warmup_steps", "2", "--logging.log_every", "1"),
    *("--checkpoint.every", "10", "--checkpoint.keep", "0", "--logging.progress", "false"),
    *("--train.eval_every", "0", "--data.cache_dir"),
]


def _train(root: Path, run: str, *extra: str, check: bool = True):
    args = ["train", "-c", str(root / "mix.toml"), *COMMON, str(root / "cache")]
    return cli(*args, "--train.run_dir", str(root / run), *extra, cwd=root, check=check)


def _logged(run: Path) -> dict[int, dict[str, int]]:
    records = [json.loads(ln) for ln in (run / "metrics.jsonl").read_text().splitlines()]
    return {
        r["step"]: {k: v for k, v in r.items() if k.startswith(("tokens/", "epoch/"))}
        for r in records
        if r["split"] == "train"
    }


def _states(run: Path) -> dict[int, dict]:
    return {
        int(p.name.split("_")[1]): json.loads((p / "trainer_state.json").read_text())["data"]
        for p in sorted((run / "checkpoints").glob("step_*"))
    }


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("mixture")
    _config(root)
    _train(root, "straight")
    killed = _train(root, "resumed", "--faults", "kill@0:31", check=False)
    assert killed.returncode != 0
    assert sorted(_states(root / "resumed")) == [10, 20, 30]
    _train(root, "resumed", "--nproc", "2", "--parallel.dp_shard", "2")
    return root / "straight", root / "resumed"


def test_a_resumed_mixture_continues_the_uninterrupted_run(runs):
    straight, resumed = runs
    assert _states(resumed) == _states(straight)
    assert sorted(_states(straight)) == [10, 20, 30, 40]
    assert _logged(resumed) == _logged(straight)


def test_every_source_is_within_one_window_of_its_share(runs):
    """Counted in windows of the current stage: after step k of the first stage, k·B windows
    dealt; from step 20, those since step 19 (logged every step)."""
    straight, _ = runs
    logged = _logged(straight)
    assert sorted(logged) == list(range(1, STEPS + 1))
    first = {name: logged[STAGE_AT - 1][f"tokens/{name}"] // SEQ for name in WEIGHTS}
    for step, counts in logged.items():
        in_stage = step < STAGE_AT
        weights = WEIGHTS if in_stage else STAGE
        dealt = (step if in_stage else step - STAGE_AT + 1) * BATCH
        for name, w in weights.items():
            windows = counts[f"tokens/{name}"] // SEQ - (0 if in_stage else first[name])
            assert abs(windows - w * dealt) < 1, (step, name, windows, w * dealt)
        assert sum(counts[f"tokens/{n}"] for n in WEIGHTS) == step * BATCH * SEQ
