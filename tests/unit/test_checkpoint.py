"""Checkpoint integrity: every kind of damage is named and skipped, retention counts only verified
checkpoints, and entries that are not ours are ignored. Real files, one process, tiny models."""

import errno
import json
import os
import re
import shutil

import pytest
import torch
from torch import nn

from depthscale.config import CheckpointConfig, Config, ModelConfig, to_toml
from depthscale.errors import CheckpointError
from depthscale.interop.run_dir import load_run
from depthscale.model.transformer import Transformer
from depthscale.resilience.keeper import snapshot_dir
from depthscale.resilience.replica import replica_root
from depthscale.train import checkpoint_write
from depthscale.train.checkpoint import Checkpointer, load_model, save_model
from depthscale.train.manifest import list_checkpoints, newest_verified, verified, verify
from depthscale.train.snapshot import recovery_tiers

ARCH = ModelConfig(dim=32)


class Run:
    """A tiny model and optimizer that change at every step, saved through one Checkpointer."""

    def __init__(self, root, keep=0, resume="auto", arch=ARCH):
        torch.manual_seed(0)
        self.model = nn.Linear(4, 3)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=0.1)
        self.ckpt = Checkpointer(root, CheckpointConfig(keep=keep, resume=resume), arch)
        self.weights: dict[int, torch.Tensor] = {}

    def save(self, *steps):
        for step in steps:
            self.model(torch.randn(2, 4)).sum().backward()
            self.optimizer.step()
            self.ckpt.save(step, self.model, self.optimizer, {"step": step})
            self.weights[step] = self.model.weight.detach().clone()
        return self

    def load(self, path):
        state = self.ckpt.load(path, self.model, self.optimizer)
        return state["step"], self.model.weight.detach().clone()


def step_dir(root, step):
    return root / f"step_{step:08d}"


def warnings_in(err: str) -> list[str]:
    return [line for line in err.splitlines() if line.startswith("depthscale: warning:")]


def flip_byte(file):
    data = bytearray(file.read_bytes())
    data[len(data) // 2] ^= 0xFF
    file.write_bytes(bytes(data))


def truncate(file):
    file.write_bytes(file.read_bytes()[: file.stat().st_size // 2])


def save_as_another_model(path):
    Run(path.parent, arch=ModelConfig(dim=64)).save(3)


def copy_of_step_2(path):
    shutil.rmtree(path)
    shutil.copytree(step_dir(path.parent, 2), path)


DAMAGE = {
    "flipped shard": (lambda p: flip_byte(p / "__0_0.distcp"), r"__0_0\.distcp is corrupt"),
    "truncated shard": (
        lambda p: truncate(p / "__0_0.distcp"),
        r"__0_0\.distcp has \d+ bytes, its manifest says \d+",
    ),
    "no .metadata": (lambda p: (p / ".metadata").unlink(), r"\.metadata is missing"),
    "no trainer state": (
        lambda p: (p / "trainer_state.json").unlink(),
        r"trainer_state\.json is missing",
    ),
    "garbage trainer state": (
        lambda p: (p / "trainer_state.json").write_text("{garbage"),
        r"trainer_state\.json has 8 bytes",
    ),
    "no rng file": (lambda p: (p / "rng_rank0.pt").unlink(), r"rng_rank0\.pt is missing"),
    "truncated rng file": (lambda p: truncate(p / "rng_rank0.pt"), r"rng_rank0\.pt has \d+ bytes"),
    "no manifest (older depthscale)": (
        lambda p: (p / "manifest.json").unlink(),
        r"no manifest\.json \(an unfinished save, or written by a depthscale without manifests\)",
    ),
    "garbage manifest": (
        lambda p: (p / "manifest.json").write_text("{garbage"),
        r"manifest\.json is not valid JSON",
    ),
    "malformed manifest": (
        lambda p: (p / "manifest.json").write_text("[]"),
        r"manifest\.json is malformed",
    ),
    "another model's": (
        save_as_another_model,
        r"another model's checkpoint \(model\.dim: checkpoint has 64, config has 32\)",
    ),
    "a copy under another step's name": (
        copy_of_step_2,
        r"its manifest is for step 2, not step 3",
    ),
}


@pytest.mark.parametrize("kind", DAMAGE)
def test_damaged_newest_is_named_and_the_newest_verified_loads(tmp_path, capsys, kind):
    damage, reason = DAMAGE[kind]
    saved = Run(tmp_path).save(1, 2, 3)
    assert verify(step_dir(tmp_path, 3), ARCH) is None
    damage(step_dir(tmp_path, 3))
    assert verify(step_dir(tmp_path, 3), ARCH) is not None
    capsys.readouterr()

    resumed = Run(tmp_path)
    chosen = resumed.ckpt.resolve_resume()
    assert chosen == step_dir(tmp_path, 2)
    [warning] = warnings_in(capsys.readouterr().err)
    assert f"skipping checkpoint {step_dir(tmp_path, 3)}: " in warning
    assert re.search(reason, warning), warning
    step, weights = resumed.load(chosen)
    assert step == 2 and torch.equal(weights, saved.weights[2])

    named = Run(tmp_path, resume=str(step_dir(tmp_path, 3)))
    with pytest.raises(CheckpointError, match=reason):
        named.ckpt.resolve_resume()
    assert step_dir(tmp_path, 3).exists()  # left in place for inspection


def test_a_saved_checkpoint_verifies_and_its_manifest_lists_every_file(tmp_path):
    Run(tmp_path).save(5)
    path = step_dir(tmp_path, 5)
    assert verify(path, ARCH) is None
    manifest = json.loads((path / "manifest.json").read_text())
    on_disk = {p.name for p in path.iterdir()} - {"manifest.json"}
    assert set(manifest["files"]) == on_disk
    assert {".metadata", "trainer_state.json", "rng_rank0.pt", "__0_0.distcp"} <= on_disk
    assert manifest["step"] == 5 and manifest["rng_ranks"] == 1
    assert manifest["model"]["dim"] == 32
    assert list(tmp_path.iterdir()) == [path]  # no .tmp, .part or .old left behind


def test_vocab_size_not_yet_resolved_matches_any(tmp_path):
    Run(tmp_path, arch=ModelConfig(dim=32, vocab_size=320)).save(1)
    assert verify(step_dir(tmp_path, 1), ModelConfig(dim=32, vocab_size=0)) is None
    assert "vocab_size" in verify(step_dir(tmp_path, 1), ModelConfig(dim=32, vocab_size=64))


def test_all_damaged_is_an_error_not_a_fresh_start(tmp_path, capsys):
    Run(tmp_path).save(1, 2)
    for step in (1, 2):
        (step_dir(tmp_path, step) / "manifest.json").unlink()
    with pytest.raises(
        CheckpointError, match=r"none of the 2 checkpoints .* step_00000002: no manifest"
    ):
        Run(tmp_path).ckpt.resolve_resume()
    assert len(warnings_in(capsys.readouterr().err)) == 2


def test_empty_root_starts_fresh(tmp_path):
    assert Run(tmp_path / "none").ckpt.resolve_resume() is None


def test_entries_that_are_not_ours_are_ignored_with_a_note(tmp_path, capsys):
    Run(tmp_path, keep=1).save(1, 2)
    shutil.copytree(step_dir(tmp_path, 2), tmp_path / "step_best")
    (tmp_path / "foo").mkdir()
    (tmp_path / "notes.txt").write_text("mine")
    capsys.readouterr()

    assert newest_verified(tmp_path, ARCH) == step_dir(tmp_path, 2)
    err = capsys.readouterr().err
    for name in ("step_best", "foo", "notes.txt"):
        assert f"depthscale: note: ignoring {tmp_path / name}: not a checkpoint" in err
    assert not warnings_in(err)
    assert list_checkpoints(tmp_path) == [step_dir(tmp_path, 2)]
    # named explicitly, a user's copy is as good as the original
    assert verified(tmp_path / "step_best", ARCH) == tmp_path / "step_best"

    Run(tmp_path, keep=1).save(3)  # retention never touches them
    assert {p.name for p in tmp_path.iterdir()} == {
        "step_00000003",
        "step_best",
        "foo",
        "notes.txt",
    }


def test_tmp_leftover_is_ignored_then_cleaned_before_that_step_is_saved(tmp_path, capsys):
    Run(tmp_path).save(1, 2)
    leftover = step_dir(tmp_path, 3).with_name("step_00000003.tmp")
    shutil.copytree(step_dir(tmp_path, 2), leftover)  # even a complete-looking one
    (leftover / "junk").write_text("x")
    capsys.readouterr()

    assert "unfinished save" in verify(leftover, ARCH)
    assert Run(tmp_path).ckpt.resolve_resume() == step_dir(tmp_path, 2)
    assert f"note: ignoring {leftover}: an unfinished save" in capsys.readouterr().err

    Run(tmp_path).save(3)
    assert not leftover.exists()
    assert not (step_dir(tmp_path, 3) / "junk").exists()
    assert verify(step_dir(tmp_path, 3), ARCH) is None


def test_retention_counts_only_verified_checkpoints(tmp_path, capsys):
    run = Run(tmp_path, keep=2).save(1, 2)
    # newer than anything verified: another run's damaged leftovers
    Run(tmp_path).save(5, 6)
    flip_byte(step_dir(tmp_path, 5) / "__0_0.distcp")
    (step_dir(tmp_path, 6) / "manifest.json").unlink()
    capsys.readouterr()

    run.save(3)
    names = sorted(p.name for p in tmp_path.iterdir())
    # counting the damaged ones would have kept 6 and 5 and deleted every verified checkpoint
    assert names == ["step_00000002", "step_00000003", "step_00000005", "step_00000006"]
    warned = warnings_in(capsys.readouterr().err)
    assert len(warned) == 2
    assert all("not counted toward checkpoint.keep" in w for w in warned)
    assert any(str(step_dir(tmp_path, 5)) in w and "corrupt" in w for w in warned)

    run.save(4)  # each damaged checkpoint is named once per run
    assert not warnings_in(capsys.readouterr().err)
    assert not step_dir(tmp_path, 2).exists() and step_dir(tmp_path, 5).exists()


def test_retention_rehashes_what_it_keeps_before_deleting(tmp_path, capsys):
    """A byte flipped after a checkpoint was saved and verified: retention must not count it (the
    verdict from save time is stale) and so must keep the older one that still verifies."""
    run = Run(tmp_path, keep=2).save(1, 2)
    flip_byte(step_dir(tmp_path, 2) / "__0_0.distcp")
    capsys.readouterr()

    run.save(3)
    assert list_checkpoints(tmp_path) == [step_dir(tmp_path, s) for s in (1, 2, 3)]
    [warned] = warnings_in(capsys.readouterr().err)
    assert str(step_dir(tmp_path, 2)) in warned and "no longer" in warned and "corrupt" in warned

    flip_byte(step_dir(tmp_path, 3) / "trainer_state.json")  # the newest damaged too
    run.save(4)
    assert step_dir(tmp_path, 1).exists()  # 4 and 1 are the two that verify now
    assert newest_verified(tmp_path, ARCH) == step_dir(tmp_path, 4)
    run.save(5)
    assert [p.name for p in list_checkpoints(tmp_path)] == [
        "step_00000002",
        "step_00000003",
        "step_00000004",
        "step_00000005",
    ]
    good = [p for p in list_checkpoints(tmp_path) if verify(p, ARCH) is None]
    assert good == [step_dir(tmp_path, 4), step_dir(tmp_path, 5)]


def test_keep_one_keeps_the_newest_verified(tmp_path):
    Run(tmp_path, keep=1).save(1, 2, 3)
    assert list_checkpoints(tmp_path) == [step_dir(tmp_path, 3)]


def test_resave_replaces_a_verified_step_only_when_complete(tmp_path, monkeypatch):
    Run(tmp_path).save(1, 2)
    before = (step_dir(tmp_path, 2) / "__0_0.distcp").read_bytes()

    def crash(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(checkpoint_write, "write_manifest", crash)
    failed = Run(tmp_path).save(2)
    with pytest.raises(CheckpointError, match="step 2.* could not be saved .*disk full"):
        failed.ckpt.wait(final=True)
    assert verify(step_dir(tmp_path, 2), ARCH) is None
    assert (step_dir(tmp_path, 2) / "__0_0.distcp").read_bytes() == before

    monkeypatch.undo()
    again = Run(tmp_path, keep=1).save(2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_00000002"]  # .tmp and 1 gone
    assert Run(tmp_path).load(step_dir(tmp_path, 2))[1].equal(again.weights[2])


def test_resave_over_a_damaged_step_keeps_it_aside(tmp_path, capsys):
    Run(tmp_path).save(1, 2)
    truncate(step_dir(tmp_path, 2) / "__0_0.distcp")
    capsys.readouterr()
    Run(tmp_path).save(2)
    aside = tmp_path / "step_00000002.old"
    assert aside.is_dir() and verify(step_dir(tmp_path, 2), ARCH) is None
    [warning] = warnings_in(capsys.readouterr().err)
    assert f"as {aside}: __0_0.distcp has" in warning


def test_failed_dcp_save_is_reported_and_prunes_nothing(tmp_path, monkeypatch, capsys):
    Run(tmp_path, keep=1).save(1)

    def fail(*args, **kwargs):
        raise OSError("no space left on device")

    monkeypatch.setattr(checkpoint_write.dcp, "save", fail)
    Run(tmp_path, keep=1).save(2)
    [warning] = warnings_in(capsys.readouterr().err)
    assert "checkpoint of step 2 was not saved (rank 0: OSError: no space left" in warning
    assert list_checkpoints(tmp_path) == [step_dir(tmp_path, 1)]


def _torch_save_on_a_full_disk(*_args) -> None:
    """What torch.save raises when the disk fills under it: the OSError, then its zip writer's
    cleanup fails with the RuntimeError that surfaces (the OSError only its context)."""
    try:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    except OSError:
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")  # noqa: B904 (as torch: context, not cause)


def _zip_writer_short_write(*_args) -> None:
    raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")


@pytest.mark.parametrize("fails", [_torch_save_on_a_full_disk, _zip_writer_short_write])
def test_a_full_disk_inside_torch_save_is_a_failed_save_naming_the_disk(
    tmp_path, monkeypatch, capsys, fails
):
    """It stopped the run with "[enforce fail at inline_container.cc:672] unexpected pos"; it is a
    storage failure: reported with the file system's free space, and training goes on."""
    run = Run(tmp_path, keep=0).save(1)
    monkeypatch.setattr(checkpoint_write, "torch_save_synced", fails)
    capsys.readouterr()
    run.save(2)
    [warned] = warnings_in(capsys.readouterr().err)
    assert "checkpoint of step 2 was not saved (rank 0: " in warned
    if fails is _torch_save_on_a_full_disk:
        assert "OSError: [Errno 28] No space left on device" in warned
    else:
        assert "a write failed (torch: [enforce fail" in warned
    assert f"the file system holding {tmp_path} has " in warned and " free of " in warned
    assert [kind for kind, _ in run.ckpt.events()] == ["checkpoint", "checkpoint_failed"]
    assert list_checkpoints(tmp_path) == [step_dir(tmp_path, 1)]


def test_a_failed_save_that_is_not_storage_is_still_an_error(tmp_path, monkeypatch):
    def fail(*args, **kwargs):
        raise ValueError("a bug")

    monkeypatch.setattr(checkpoint_write.dcp, "save", fail)
    with pytest.raises(CheckpointError, match="cannot save checkpoint: rank 0: ValueError: a bug"):
        Run(tmp_path).save(1)
    assert list(tmp_path.iterdir()) == []


def test_dcp_load_failures_name_the_path_and_the_cause(tmp_path):
    """DCP raises CheckpointException, a BaseException; it reaches the user as a CheckpointError."""
    Run(tmp_path).save(1)
    path = step_dir(tmp_path, 1)
    with pytest.raises(
        CheckpointError, match=rf"cannot load checkpoint {path}: rank 0: .*Size mismatch"
    ):
        load_model(path, nn.Linear(4, 5))
    truncate(path / "__0_0.distcp")
    with pytest.raises(CheckpointError, match=rf"cannot load checkpoint {path}: rank 0: "):
        load_model(path, nn.Linear(4, 3))


def test_truncated_rng_file_is_a_checkpoint_error_on_load(tmp_path):
    run = Run(tmp_path).save(1)
    truncate(step_dir(tmp_path, 1) / "rng_rank0.pt")
    with pytest.raises(CheckpointError, match="rng_rank0.pt"):
        run.load(step_dir(tmp_path, 1))


def test_model_only_checkpoints_verify_and_load_runs_picks_the_newest_verified(tmp_path, capsys):
    cfg = ModelConfig(vocab_size=64, dim=32, n_layers=1, n_heads=2)
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.toml").write_text(to_toml(Config(model=cfg)))
    torch.manual_seed(0)
    models = [Transformer(cfg), Transformer(cfg)]
    for step, model in enumerate(models):
        save_model(step_dir(run / "checkpoints", step), model, {"step": step})
    assert verify(step_dir(run / "checkpoints", 1), cfg) is None
    flip_byte(step_dir(run / "checkpoints", 1) / "__0_0.distcp")

    loaded, _ = load_run(run)
    expected = models[0].state_dict()
    assert all(torch.equal(v, expected[k]) for k, v in loaded.state_dict().items())
    assert "skipping checkpoint" in capsys.readouterr().err
    with pytest.raises(CheckpointError, match="__0_0.distcp is corrupt"):
        load_run(run, str(step_dir(run / "checkpoints", 1)))
    with pytest.raises(CheckpointError, match="another model's checkpoint"):
        verified(step_dir(run / "checkpoints", 0), ModelConfig(vocab_size=64, dim=64))


@pytest.mark.parametrize("name", ["adamw", "lamb"])
@pytest.mark.parametrize("saved, resumed", [(True, False), (False, True)])
def test_resume_takes_group_settings_from_the_config_and_state_from_the_checkpoint(
    tmp_path, name, saved, resumed
):
    """A run resumed with optim.decay_embeddings flipped: every parameter's moments load, and each
    group's weight decay is the config's. (Torch's flattened load alone gives a group its first
    parameter's saved settings: with the embedding first, false → true left every matrix
    undecayed.)"""
    from depthscale.config import OptimConfig
    from depthscale.train.optim import build_optimizer

    arch = ModelConfig(vocab_size=64, dim=32, n_layers=1, n_heads=2)

    def build(decay_embeddings):
        torch.manual_seed(0)
        model = Transformer(arch)
        cfg = OptimConfig(name=name, weight_decay=0.1, decay_embeddings=decay_embeddings)
        return model, build_optimizer(model, cfg)

    model, optimizer = build(saved)
    model(torch.randint(0, 64, (2, 8))).float().pow(2).mean().backward()
    optimizer.step()
    ckpt = Checkpointer(tmp_path, CheckpointConfig(), arch)
    ckpt.save(1, model, optimizer, {"step": 1})
    moments = {n: optimizer.state[p]["exp_avg"].clone() for n, p in model.named_parameters()}

    model2, optimizer2 = build(resumed)
    expected = [(len(g["params"]), g["weight_decay"]) for g in optimizer2.param_groups]
    ckpt.load(step_dir(tmp_path, 1), model2, optimizer2)
    assert [(len(g["params"]), g["weight_decay"]) for g in optimizer2.param_groups] == expected
    decayed = {p for g in optimizer2.param_groups if g["weight_decay"] for p in g["params"]}
    assert (model2.tok_embeddings.weight in decayed) is resumed
    assert model2.layers["0"].attention.wq.weight in decayed
    for n, p in model2.named_parameters():
        torch.testing.assert_close(optimizer2.state[p]["exp_avg"], moments[n], rtol=0, atol=0)


def test_recovery_tiers_name_a_damaged_version_and_what_a_restart_would_use(tmp_path):
    """`depthscale diagnose --run` reports each tier as a restart would try it: the newest
    version that verifies, and one line for each newer one that does not."""
    run, shm = tmp_path / "run", tmp_path / "shm"
    memory = snapshot_dir(run, 0, shm)
    Run(memory).save(1, 2)
    Run(run / "checkpoints").save(1)
    snapshot_dir(run, 1, shm).mkdir()
    copy = replica_root(snapshot_dir(run, 1, shm)) / "node0"  # node 1 holds node 0's copy
    shutil.copytree(step_dir(memory, 2), step_dir(copy, 2))
    flip_byte(next((step_dir(memory, 2)).glob("*.distcp")))
    tiers = {t["tier"]: t for t in recovery_tiers(run, ARCH, shm)}
    assert list(tiers) == [
        "memory of node 0",
        "memory of node 1",
        "copy of node 0 on node 1",
        "disk",
    ]
    assert tiers["memory of node 0"]["verified"] == "step_00000001"
    [line] = tiers["memory of node 0"]["failed"]
    assert line.startswith("snapshot step_00000002 in the memory of node 0 (")
    assert "failed verification" in line
    assert tiers["copy of node 0 on node 1"]["verified"] == "step_00000002"
    assert tiers["disk"]["verified"] == "step_00000001" and tiers["disk"]["failed"] == []
