"""Every `depthscale ...` command in a code block of README.md and docs/*.md runs as written: train
commands pass every check a launch makes (`--print-config` prints only a config that would run,
so nothing trains), plan commands load their config (and evaluate a --layout), the others parse
with the CLI's own parser. A doc example
that fails as written is the first thing a new user copies.

Placeholders that a reader fills in (a node rank, a head node's address, SLURM's variables) are
given values; `depthscale train ...` (elided arguments) stands for the tiny config.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from depthscale.cli import build_parser, main
from depthscale.config import load_config

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SUBCOMMANDS = (
    "train",
    "generate",
    "trace",
    "diagnose",
    "plan",
    "convert",
    "eval",
    "lm-eval",
    "tokenize",
)
PLACEHOLDERS = {"K": "0", "HEAD": "node0", "$SLURM_NNODES": "4", "$SLURM_NODEID": "0"}
PLACEHOLDERS |= {"$head": "node0", "...": "-c configs/tiny.toml"}
_FENCE = re.compile(r"^```[^\n]*\n(.*?)^```", re.M | re.S)


def _commands_in(text: str) -> list[str]:
    """Each depthscale invocation in the fenced blocks of one document, continuation lines
    joined, prompts, environment assignments and wrappers (`... &&`, `srun bash -c '...'`) off."""
    found = []
    for block in _FENCE.findall(text):
        for line in block.replace("\\\n", " ").splitlines():
            line = line.strip().removeprefix("$ ")
            if not re.search(rf"\bdepthscale ({'|'.join(SUBCOMMANDS)})\b", line):
                continue
            for part in line.split("&&"):
                found += _unwrapped(part)
    return found


def _unwrapped(part: str) -> list[str]:
    tokens = shlex.split(part, comments=True)
    while tokens and re.fullmatch(r"[A-Z_]+=\S*", tokens[0]):
        tokens = tokens[1:]  # VAR=value depthscale ...
    if tokens[:1] == ["depthscale"]:
        return [shlex.join(tokens)]
    inner = [t for t in tokens if t.startswith("depthscale ")]  # srun bash -c '...'
    return [c for t in inner for c in _unwrapped(t)]


def documented() -> list[tuple[str, str]]:
    return [
        (doc.relative_to(ROOT).as_posix(), command)
        for doc in DOCS
        for command in _commands_in(doc.read_text())
    ]


def test_the_docs_hold_commands_and_placeholders_are_known():
    found = documented()
    assert len(found) >= 30, found
    assert any("--faults" in c for _, c in found) and any("srun" not in c for _, c in found)


@pytest.mark.parametrize(("doc", "command"), documented(), ids=lambda x: x[:70])
def test_documented_command_runs_as_written(doc, command, monkeypatch, capsys):
    monkeypatch.chdir(ROOT)  # the docs' paths (configs/...) are relative to the checkout
    argv = []
    for token in shlex.split(command)[1:]:
        argv += shlex.split(PLACEHOLDERS[token]) if token in PLACEHOLDERS else [token]
    if argv[0] == "train":
        code = main([*argv, "--print-config"])
        assert code == 0, f"{doc}: {command}\n{capsys.readouterr().err}"
    elif argv[0] == "plan" and "--layout" in argv:  # one layout: quick (a search takes seconds)
        assert main(argv) == 0, f"{doc}: {command}\n{capsys.readouterr().err}"
    elif argv[0] == "lm-eval":  # every argument is the harness's: its own parser reads them
        import sys

        from lm_eval._cli import HarnessCLI

        monkeypatch.setattr(sys, "argv", ["lm_eval", *argv[1:]])
        args = HarnessCLI().parse_args()
        assert args.model == "depthscale" and "run" in args.model_args, command
    else:
        args, rest = build_parser().parse_known_args(argv)
        if argv[0] == "plan":
            load_config(args.config, rest)  # its overrides are config keys
        else:
            assert not rest, f"{doc}: {command}: unrecognized {rest}"


def test_the_slurm_script_binds_cpus_and_asks_for_a_shared_run_directory():
    """Multi-node: a task without --cpus-per-task gets one CPU for eight workers, and a run
    directory that only one node sees loses the other nodes' checkpoint shards."""
    text = (ROOT / "docs" / "fault-tolerance.md").read_text()
    script = next(b for b in _FENCE.findall(text) if "#SBATCH" in b)
    assert "--cpus-per-task=" in script and "--cpu-bind=" in script
    assert "OMP_NUM_THREADS=$((SLURM_CPUS_PER_TASK / 8))" in script
    before = text[: text.index(script)].rsplit("\n\n", 2)[-2]  # the paragraph introducing it
    assert "train.run_dir" in before and "file system every" in before and "node mounts" in before
