"""What a new user meets in the first hour, in-process: --version, train --help naming every config
key, --print-config, plan resolving the vocabulary as training does and printing the command that
launches its layout (and failing when the one layout asked for is rejected), help texts that cite
only docs that exist; and `python -m depthscale`, the one case that needs a fresh interpreter."""

from __future__ import annotations

import dataclasses
import json
import re
import shlex
import subprocess
import sys
import tomllib
from importlib.metadata import version
from pathlib import Path

import pytest

from depthscale.cli import build_parser, main
from depthscale.config import Config, load_config
from depthscale.plan.layout import Layout

ROOT = Path(__file__).resolve().parents[2]
CONFIG = str(ROOT / "configs" / "tiny.toml")


def test_version_is_the_installed_distributions(capsys):
    with pytest.raises(SystemExit) as stop:
        main(["--version"])
    assert stop.value.code == 0
    assert capsys.readouterr().out.strip() == f"depthscale {version('depthscale')}"


def _subparsers() -> dict[str, object]:
    parser = build_parser()
    action = next(a for a in parser._actions if a.dest == "command")
    return {"": parser, **action.choices}


def test_train_help_names_every_section_and_key_with_its_default():
    text = _subparsers()["train"].format_help()
    assert "--print-config" in text
    for section in dataclasses.fields(Config):
        assert f"[{section.name}]" in text, section.name  # resilience was missing
        for key in dataclasses.fields(section.default_factory()):
            assert re.search(rf"\b{key.name}=\S", text), f"{section.name}.{key.name}"
    assert 'supervise="auto"' in text and "hang_dump_s=120.0" in text


def test_print_config_prints_the_resolved_config_and_writes_nothing(tmp_path, capsys):
    run = tmp_path / "run"
    argv = ["-c", CONFIG, "--model.dim", "64", "--train.run_dir", str(run)]
    assert main(["train", *argv, "--print-config"]) == 0
    printed = capsys.readouterr().out
    tomllib.loads(printed)
    (tmp_path / "printed.toml").write_text(printed)
    assert load_config(tmp_path / "printed.toml") == load_config(CONFIG, argv[2:])
    assert not run.exists()
    # a layout that could not launch is refused, not printed
    assert main(["train", "-c", CONFIG, "--nproc", "4", "--print-config"]) == 2
    assert "but --nproc is 4" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("overrides", "vocab", "note"),
    [
        ([], 320, None),  # the byte tokenizer's 258 ids, rounded up to a multiple of 64
        (["--data.tokenizer", "bpe", "--data.bpe_vocab_size", "1000"], 1024, "not trained yet"),
    ],
)
def test_plan_resolves_the_vocabulary_as_training_does(capsys, overrides, vocab, note):
    assert main(["plan", "-c", CONFIG, "--gpus", "4", "--top", "1", "--json", *overrides]) == 0
    out = capsys.readouterr()
    assert json.loads(out.out)["model"]["vocab"] == vocab
    assert (note in out.err) if note else out.err == ""


@pytest.mark.parametrize("gpus", [4, 16])
def test_plan_prints_the_command_that_launches_its_layout(capsys, gpus):
    assert main(["plan", "-c", CONFIG, "--gpus", str(gpus), "--top", "1", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    launch, best = report["launch"], report["layouts"][0]
    argv = shlex.split(launch["command"])
    assert argv[:4] == ["depthscale", "train", "-c", CONFIG] and launch["layout"] == best["label"]
    argv = [{"RANK": "0", "HOST": "node0"}.get(a, a) for a in argv]
    args, rest = build_parser().parse_known_args(argv[1:])
    cfg = load_config(args.config, [*rest, "--parallel.nproc", str(args.nproc)])
    layout = Layout(**best["layout"])
    p = cfg.parallel
    assert (p.tp, p.pp, p.pp_virtual, p.cp) == (layout.tp, layout.pp, layout.v, layout.cp)
    assert (p.dp_shard, p.dp_replicate) == (layout.dp_shard, layout.dp_replicate)
    assert cfg.train.micro_batch_size == layout.micro_batch and cfg.train.dtype == "bfloat16"
    assert cfg.world_size == gpus == p.nproc * p.nnodes and launch["nodes"] == p.nnodes
    assert main(["plan", "-c", CONFIG, "--gpus", str(gpus), "--top", "1"]) == 0
    assert launch["command"] in capsys.readouterr().out


def test_help_cites_only_docs_that_exist():
    texts = []
    for parser in _subparsers().values():  # the raw texts: formatting may break a path at '-'
        texts += [parser.description, parser.epilog, *(a.help for a in parser._actions)]
    cited = {doc for text in texts if text for doc in re.findall(r"docs/[\w./-]+?\.md", text)}
    assert cited, "no help text cites a doc"
    missing = sorted(doc for doc in cited if not (ROOT / doc).is_file())
    assert not missing, missing


def test_python_m_depthscale_is_the_command(tmp_path):
    """`python -m depthscale` (what `python -m torch.distributed.run`-style launchers and machines
    without the console script on PATH run) is the `depthscale` command: it was refused as "a
    package and cannot be directly executed"."""
    for argv, first in (
        (["--help"], "usage: depthscale "),
        (["train", "--help"], "usage: depthscale train"),
    ):
        proc = subprocess.run(
            [sys.executable, "-m", "depthscale", *argv],
            cwd=tmp_path,
            capture_output=True,
            text=True,
        )
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout.startswith(first), proc.stdout[:200]
    assert "[train]" in proc.stdout  # the config keys of train --help


def test_plan_fails_when_the_one_layout_asked_for_is_rejected(capsys):
    """`plan --layout L` answers whether L runs: a rejected L prints its row and exits 1 with the
    reason on stderr (it exited 0, which a script reads as yes); an accepted one exits 0."""
    argv = ["plan", "-c", CONFIG, "--gpus", "4", "--layout"]
    assert main([*argv, "tp=8"]) == 1
    out = capsys.readouterr()
    assert "rejected: uses 8 GPUs, not 4" in out.out
    assert out.err.strip().splitlines() == [
        "depthscale: plan: --layout tp=8 is rejected (tp=8,pp=1,mb=1: uses 8 GPUs, not 4)"
    ]
    assert main([*argv, "tp=8", "--json"]) == 1
    assert not json.loads(capsys.readouterr().out)["layouts"][0]["ok"]
    assert main([*argv, "tp=2,fsdp=2"]) == 0
    assert capsys.readouterr().err == ""
