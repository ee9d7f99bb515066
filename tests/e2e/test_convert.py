"""`depthscale convert` as a user runs it: an imported model trains, saves and resumes; bad input
fails with one line and exit code 2, leaving what was already on disk as it was."""

import shutil
from pathlib import Path

import pytest
import torch

from depthscale.cli import main
from depthscale.data.tokenizer import ByteTokenizer, load_tokenizer, train_bpe

transformers = pytest.importorskip("transformers")

LLAMA3 = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 16,
}
LINEAR = {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0}
TRAIN = [
    "--train.steps",
    "2",
    "--train.batch_size",
    "2",
    "--optim.warmup_steps",
    "1",
    "--train.eval_every",
    "0",
    "--train.device",
    "cpu",
    "--train.keep_host_memory",
    "false",
    "--logging.log_every",
    "1",
    "--logging.tensorboard",
    "false",
    "--logging.progress",
    "false",
    "--logging.peak_tflops",
    "1",
]


def hf_dir(
    path: Path,
    rope: dict,
    max_len: int,
    vocab: int,
    tied: bool,
    tokenizer_vocab: int = 0,
    kv_heads: int = 2,
) -> Path:
    """A tiny random HF Llama directory, with a BPE tokenizer.json when tokenizer_vocab > 0."""
    config = transformers.LlamaConfig(
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=kv_heads,
        intermediate_size=64,
        vocab_size=vocab,
        max_position_embeddings=max_len,
        tie_word_embeddings=tied,
        rope_parameters=dict(rope),
    )
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(path)
    if tokenizer_vocab:
        texts = [f"def f{i}(x):\n    return x * {i} + {i * i}\n" for i in range(300)]
        train_bpe(texts, tokenizer_vocab).tok.save(str(path / "tokenizer.json"))
    return path


def listing(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in root.rglob("*") if p.is_file()}


@pytest.mark.parametrize(
    ("rope", "max_len", "vocab", "tied", "tokenizer_vocab"),
    [
        (LLAMA3, 64, 300, True, 0),  # byte tokenizer (258 ids); context below data.seq_len 128
        (LINEAR, 40, 320, False, 300),  # the model's own tokenizer.json
    ],
)
def test_imported_model_trains_saves_and_resumes(
    tmp_path, capsys, rope, max_len, vocab, tied, tokenizer_vocab
):
    hf = hf_dir(tmp_path / "hf", rope, max_len, vocab, tied, tokenizer_vocab)
    run = tmp_path / "run"
    assert main(["convert", "hf-to-ds", "--hf", str(hf), "--out", str(run)]) == 0
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("".join(f"def f{i}(x):\n    return x * {i}\n\n" for i in range(800)))
    train = ["train", "-c", str(run / "config.toml"), "--data.path", str(corpus), *TRAIN]
    assert main(train) == 0, capsys.readouterr().err  # the config as written: seq_len fits
    assert (run / "checkpoints" / "step_00000002" / "trainer_state.json").is_file()
    capsys.readouterr()
    assert main([*train, "--train.steps", "4"]) == 0
    assert "resumed at step 2" in capsys.readouterr().out
    assert (run / "checkpoints" / "step_00000004" / "trainer_state.json").is_file()


def convert_fails(capsys, *args: str) -> str:
    """Run `depthscale convert ...`, expect exit code 2, return its one-line error."""
    capsys.readouterr()
    assert main(["convert", *args]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    return err


@pytest.fixture
def run_dir(tmp_path) -> Path:
    hf = hf_dir(tmp_path / "hf", LLAMA3, 64, 320, False, tokenizer_vocab=300)
    assert main(["convert", "hf-to-ds", "--hf", str(hf), "--out", str(tmp_path / "run")]) == 0
    return tmp_path / "run"


def test_export_into_a_non_empty_directory_is_refused(tmp_path, run_dir, capsys):
    out = tmp_path / "export"
    out.mkdir()
    (out / "tokenizer.json").write_text('{"stale": true}')
    err = convert_fails(capsys, "ds-to-hf", "--run", str(run_dir), "--out", str(out))
    assert f"output {out} already exists and is not an empty directory" in err
    assert "allowed: a new or empty directory" in err
    assert listing(out) == {"tokenizer.json": b'{"stale": true}'}
    (out / "tokenizer.json").unlink()  # an empty directory is fine
    assert main(["convert", "ds-to-hf", "--run", str(run_dir), "--out", str(out)]) == 0
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= set(listing(out))


@pytest.mark.parametrize("kind", ["bpe", "byte"])
def test_export_writes_the_tokenizer_transformers_loads(tmp_path, run_dir, kind):
    """ds-to-hf writes the run's tokenizer where AutoTokenizer finds it (the byte tokenizer as
    the byte-level BPE that encodes as it does), and BOS/EOS in config and generation config."""
    if kind == "byte":
        shutil.rmtree(run_dir / "tokenizer")
        ByteTokenizer().save(run_dir / "tokenizer")
    ours = load_tokenizer(run_dir / "tokenizer")
    out = tmp_path / "export"
    assert main(["convert", "ds-to-hf", "--run", str(run_dir), "--out", str(out)]) == 0
    theirs = transformers.AutoTokenizer.from_pretrained(out)
    text = "def f7(x):\n    return x * 7 + 49  # héllo 🙂\r\n\t\x00"
    assert theirs.encode(text, add_special_tokens=False) == ours.encode(text)
    assert theirs.decode(ours.encode(text)) == text
    assert (theirs.bos_token_id, theirs.eos_token_id) == (ours.bos_id, ours.eos_id)
    config = transformers.AutoConfig.from_pretrained(out)
    assert (config.bos_token_id, config.eos_token_id) == (ours.bos_id, ours.eos_id)
    assert transformers.GenerationConfig.from_pretrained(out).eos_token_id == ours.eos_id


def test_import_into_a_non_empty_directory_is_refused(tmp_path, capsys):
    hf = hf_dir(tmp_path / "hf", LINEAR, 64, 300, True)
    out = tmp_path / "run"
    (out / "checkpoints").mkdir(parents=True)
    (out / "notes.txt").write_text("mine")
    err = convert_fails(capsys, "hf-to-ds", "--hf", str(hf), "--out", str(out))
    assert "already exists and is not an empty directory" in err
    assert listing(out) == {"notes.txt": b"mine"} and not any((out / "checkpoints").iterdir())


@pytest.mark.parametrize(
    ("rope", "vocab", "tokenizer_vocab", "kv_heads", "message"),
    [
        (LINEAR, 100, 300, 2, "has token ids up to 299, but the model's vocab_size is 100"),
        ({"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}, 300, 0, 2, "rope_type='yarn'"),
        # refused from config.json, in its own names, before a weight is read
        (LINEAR, 320, 300, 3, "config.json: HF config num_key_value_heads=3 does not divide"),
    ],
)
def test_failed_import_leaves_nothing_behind(
    tmp_path, capsys, rope, vocab, tokenizer_vocab, kv_heads, message
):
    hf = hf_dir(tmp_path / "hf", rope, 64, vocab, True, tokenizer_vocab, kv_heads)
    out = tmp_path / "out" / "run"
    assert message in convert_fails(capsys, "hf-to-ds", "--hf", str(hf), "--out", str(out))
    assert not out.exists() and not list(out.parent.iterdir())  # no run, no temporary sibling
