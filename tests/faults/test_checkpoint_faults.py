"""Checkpoints under faults and at scale: async == sync bitwise, a full disk during a save (injected,
and real through RLIMIT_FSIZE) leaves training running and the previous checkpoint intact, and a
restore reads each byte once per replica group. Real files, real gloo processes, fp32, torch.equal."""

from __future__ import annotations

import contextlib
import errno
import io
import json
import os
import resource
import signal
import subprocess
import sys
import tempfile
import time

import pytest
import torch
import torch.distributed as dist
from harness import cached_mesh, small_config
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
from torch.distributed.tensor import DTensor

from depthscale.config import CheckpointConfig
from depthscale.errors import CheckpointError
from depthscale.model.transformer import Transformer
from depthscale.parallel.mesh import ParallelDims
from depthscale.parallel.parallelize import parallelize
from depthscale.train.checkpoint import Checkpointer
from depthscale.train.manifest import list_checkpoints, newest_verified, step_dir, verify

FLAT = StateDictOptions(flatten_optimizer_state_dict=True)


# ---------------------------------------------------------------------------- helpers


def _build(layout: dict):
    """A small Transformer in `layout` (ParallelConfig fields; {} = one process), its AdamW, mesh."""
    cfg = small_config("block", layout)
    dims = ParallelDims.from_config(cfg.parallel)
    mesh = cached_mesh(dims) if dist.is_initialized() else None
    with torch.device("meta"):
        model = Transformer(cfg.model)
    torch.manual_seed(cfg.train.seed)  # each rank draws its shards: the same stream everywhere
    parallelize(model, mesh, dims, cfg, device=torch.device("cpu"))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2), mesh, cfg


def _step(model, optimizer, seed: int = 1) -> None:
    """One update from the same batch on every rank: replicas stay identical."""
    tokens = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(seed))
    model(tokens).float().pow(2).mean().backward()
    optimizer.step()
    optimizer.zero_grad()


def _local_state(model, optimizer) -> dict:
    """Every tensor and setting this rank holds (DTensors as their local shards)."""
    model_sd, optim_sd = get_state_dict(model, optimizer, options=FLAT)
    out = {}
    for prefix, sd in (("model", model_sd), ("optim", optim_sd)):
        for key, value in sd.items():
            value = value.to_local() if isinstance(value, DTensor) else value
            out[f"{prefix}.{key}"] = value.clone() if isinstance(value, torch.Tensor) else value
    return out


def _assert_same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for key in a:
        if isinstance(a[key], torch.Tensor):
            assert a[key].dtype == b[key].dtype and torch.equal(a[key], b[key]), key
        else:
            assert a[key] == b[key], key


def _saved(path) -> dict:
    """Every tensor and value in a checkpoint, read back independently of any model, plus the
    trainer state and each rank's RNG state."""
    out = path.parent / (path.name + ".pt")
    dcp_to_torch_save(path, out)
    state = torch.load(out, weights_only=False)
    out.unlink()
    state["trainer_state"] = json.loads((path / "trainer_state.json").read_text())
    for rng in sorted(path.glob("rng_rank*.pt")):
        state[rng.name] = torch.load(rng, weights_only=True)["torch"]
    return state


def _flat_saved(path) -> dict:
    flat = {}

    def walk(prefix, obj):
        if isinstance(obj, dict):
            for k, v in obj.items():
                walk(f"{prefix}.{k}" if prefix else str(k), v)
        else:
            flat[prefix] = obj

    walk("", _saved(path))
    return flat


def _quiet_stderr():
    return _stderr_captured()


@contextlib.contextmanager
def _stderr_captured():
    """This rank's stderr, at file descriptor 2 too: what its checkpoint writer process prints
    (it inherits the descriptor when it starts, inside the block) is included. Yields a list
    that holds the text once the block ends."""
    out: list[str] = []
    sys.stderr.flush()
    saved = os.dup(2)
    text = io.StringIO()
    with tempfile.TemporaryFile(mode="w+") as file:
        os.dup2(file.fileno(), 2)
        try:
            with contextlib.redirect_stderr(text):
                yield out
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            file.seek(0)
            out.append(text.getvalue() + file.read())


def _warnings(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("depthscale: warning:")]


# ---------------------------------------------------------------------------- async == sync


_WAYS = (("sync", False, "process"), ("process", True, "process"), ("thread", True, "thread"))
"""(directory, async_save, async_writer): a synchronous save, and the two background writers."""


def _save_every_way(root: str, layout: dict) -> bool:
    from pathlib import Path

    torch.manual_seed(0)
    model, optimizer, _, _ = _build(layout)
    _step(model, optimizer)
    for name, is_async, writer in _WAYS:
        cfg = CheckpointConfig(keep=0, async_save=is_async, async_writer=writer)
        ckpt = Checkpointer(Path(root) / name, cfg)
        torch.manual_seed(7)  # the same RNG state saved every way
        ckpt.save(3, model, optimizer, {"step": 3, "data": {"position": 12}})
        assert ckpt.is_async is is_async and ckpt.last_blocking_s > 0
        assert (ckpt.writer_pid is not None) is (name == "process")
        ckpt.wait(final=True)
    if dist.is_initialized():
        dist.barrier()
    return True


def _assert_saves_equal(root) -> None:
    sync = _flat_saved(step_dir(root / "sync", 3))
    assert any(k.startswith("optim.state.") for k in sync)
    assert sync["trainer_state.data.position"] == 12
    for name, _, _ in _WAYS[1:]:
        other = _flat_saved(step_dir(root / name, 3))
        assert sync.keys() == other.keys(), name
        _assert_same(sync, other)


def test_async_and_sync_saves_are_bitwise_equal(tmp_path):
    _save_every_way(str(tmp_path), {})
    _assert_saves_equal(tmp_path)


@pytest.mark.parametrize("layout", [{"dp_shard": 2}, {"dp_replicate": 2}, {"tp": 2}])
def test_async_and_sync_saves_are_bitwise_equal_on_two_ranks(dist_pool, tmp_path, layout):
    dist_pool(2).run(_save_every_way, str(tmp_path), layout)
    _assert_saves_equal(tmp_path)


def test_async_save_is_the_default_with_several_processes(tmp_path):
    ckpt = Checkpointer(tmp_path, CheckpointConfig())
    assert ckpt.cfg.async_save == "auto" and not ckpt.is_async  # one process: sync


def _auto_is_async(root: str) -> bool:
    return Checkpointer(root, CheckpointConfig()).is_async


def test_auto_is_async_on_two_ranks(dist_pool, tmp_path):
    assert dist_pool(2).run(_auto_is_async, str(tmp_path)) == [True, True]


# ---------------------------------------------------------------------------- full disk


def _disk_full_drill(root: str, is_async: bool, fail_rank: int, real: bool) -> dict:
    """Save steps 1, 2, 3; step 2 fails on `fail_rank`: ENOSPC injected after its shards are
    written, or (real) a file-size limit that makes its writes fail with EFBIG."""
    from pathlib import Path

    model, optimizer, _, _ = _build({"dp_shard": 2} if dist.is_initialized() else {})
    ckpt = Checkpointer(Path(root), CheckpointConfig(keep=0, async_save=is_async))
    rank = dist.get_rank() if dist.is_initialized() else 0
    with _stderr_captured() as err:
        for step in (1, 2, 3):
            _step(model, optimizer, seed=step)
            limited = real and step == 2 and rank == fail_rank
            if step == 2 and rank == fail_rank and not real:
                ckpt.inject_write_error_at = 2
            # the limit on whichever process writes: the writer process (started at step 1's
            # save, it ignores SIGXFSZ itself) or this one
            writer = ckpt.writer_pid or 0
            if limited:
                old = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
                soft, hard = resource.prlimit(writer, resource.RLIMIT_FSIZE)
                resource.prlimit(writer, resource.RLIMIT_FSIZE, (16 << 10, hard))
            try:
                ckpt.save(step, model, optimizer, {"step": step})
                ckpt.wait()  # the background write ends before the limit is lifted
            finally:
                if limited:
                    resource.prlimit(writer, resource.RLIMIT_FSIZE, (soft, hard))
                    signal.signal(signal.SIGXFSZ, old)
            if step == 2:
                if dist.is_initialized():
                    dist.barrier()  # rank 0 removes the .tmp after the ranks agreed
                after_failure = {
                    "names": sorted(p.name for p in Path(root).iterdir()),
                    "step1_verifies": verify(step_dir(Path(root), 1)) is None,
                }
        ckpt.wait(final=True)
    return {
        "stderr": err[0],
        "events": [(kind, fields["step"], fields["error"]) for kind, fields in ckpt.events()],
        **after_failure,
    }


def _check_drill(results: list[dict], root, cause: str) -> None:
    for r in results:
        assert r["names"] == ["step_00000001"], r["names"]  # no step_2, no .tmp left
        assert r["step1_verifies"]
        kinds = [(kind, step) for kind, step, _ in r["events"]]
        assert kinds == [("checkpoint", 1), ("checkpoint_failed", 2), ("checkpoint", 3)]
        assert cause in r["events"][1][2]
    [warning] = _warnings(results[0]["stderr"])  # once, on rank 0
    assert f"checkpoint of step 2 was not saved ({cause}" in warning
    assert "the newest checkpoint is still" in warning and "step_00000001" in warning
    assert "training continues" in warning
    assert all(not _warnings(r["stderr"]) for r in results[1:])
    assert [p.name for p in list_checkpoints(root)] == ["step_00000001", "step_00000003"]
    assert newest_verified(root) == step_dir(root, 3)


@pytest.mark.parametrize("is_async", [True, False])
def test_injected_full_disk_is_reported_once_and_training_goes_on(tmp_path, is_async):
    results = [_disk_full_drill(str(tmp_path), is_async, 0, real=False)]
    _check_drill(results, tmp_path, "rank 0: OSError: [Errno 28] No space left on device")


@pytest.mark.parametrize("is_async", [True, False])
def test_full_disk_on_one_rank_leaves_no_peer_waiting(dist_pool, tmp_path, is_async):
    results = dist_pool(2).run(_disk_full_drill, str(tmp_path), is_async, 1, False, timeout=120)
    _check_drill(results, tmp_path, "rank 1: OSError: [Errno 28] No space left on device")


@pytest.mark.skipif(sys.platform != "linux", reason="RLIMIT_FSIZE with SIGXFSZ ignored: Linux")
def test_real_file_size_limit_on_one_rank_is_a_failed_save_not_a_stop(dist_pool, tmp_path):
    results = dist_pool(2).run(_disk_full_drill, str(tmp_path), True, 1, True, timeout=120)
    _check_drill(results, tmp_path, f"rank 1: OSError: [Errno {errno.EFBIG}] File too large")


def _final_save_fails(root: str) -> str:
    from pathlib import Path

    model, optimizer, _, _ = _build({})
    ckpt = Checkpointer(Path(root), CheckpointConfig(keep=0, async_save=True))
    ckpt.save(1, model, optimizer, {"step": 1})
    ckpt.inject_write_error_at = 2
    with _quiet_stderr():
        ckpt.save(2, model, optimizer, {"step": 2})
        with pytest.raises(CheckpointError) as raised:
            ckpt.wait(final=True)
    return str(raised.value)


def test_a_failed_last_save_of_a_run_is_an_error(tmp_path):
    message = _final_save_fails(str(tmp_path))
    assert "the last checkpoint of this run (step 2) could not be saved" in message
    assert "No space left on device" in message and "step_00000001" in message


def _run_cfg(tmp_path, *overrides):
    from depthscale.config import load_config

    corpus = tmp_path / "corpus.txt"
    corpus.write_text("".join(f"line {i}: the quick brown fox jumps\n" for i in range(200)))
    base = f"""--data.path {corpus} --data.seq_len 32 --model.dim 32 --model.n_layers 2
        --model.n_heads 4 --train.batch_size 4 --logging.progress false --logging.log_every 1
        --logging.tensorboard false --logging.peak_tflops 1 --optim.warmup_steps 1 --train.run_dir {tmp_path / "run"}"""
    return load_config(None, base.split() + list(overrides))


def test_full_disk_in_a_training_run_is_an_event_and_the_run_finishes(tmp_path):
    from depthscale.train.trainer import Trainer

    cfg = _run_cfg(tmp_path, "--train.steps", "4", "--checkpoint.every", "1")
    cfg.checkpoint.keep, cfg.checkpoint.async_save = 0, True
    trainer = Trainer(cfg)
    trainer.checkpointer.inject_write_error_at = 2
    with _stderr_captured() as err:
        history = trainer.fit()
    assert len(history) == 4
    root = cfg.run_path / "checkpoints"
    assert [p.name for p in list_checkpoints(root)] == [f"step_0000000{s}" for s in (1, 3, 4)]
    assert not list(root.glob("*.tmp"))
    [warning] = _warnings(err[0])
    assert "checkpoint of step 2 was not saved" in warning
    lines = (cfg.run_path / "metrics.jsonl").read_text().splitlines()
    events = [e for e in map(json.loads, lines) if e["split"].startswith("checkpoint")]
    # logged at the end of the step after each save finished (step 3's may finish after step 4)
    saves = [(e["split"], e["step"]) for e in events]
    assert saves[:2] == [("checkpoint", 1), ("checkpoint_failed", 2)]
    assert saves[2:] in ([], [("checkpoint", 3)])
    assert all(e["blocking_s"] > 0 and e["is_async"] for e in events)


# ---------------------------------------------------------------------------- load once


def _restore_counted(root: str, saved_layout: dict, loaded_layout: dict) -> dict:
    """Save a trained model in `saved_layout`, then restore it into fresh models of
    `loaded_layout` twice: once per replica group (broadcast) and with every rank reading."""
    from pathlib import Path

    model, optimizer, mesh, _ = _build(saved_layout)
    _step(model, optimizer)
    ckpt = Checkpointer(Path(root), CheckpointConfig(keep=0, async_save=True))
    ckpt.save(1, model, optimizer, {"step": 1})
    ckpt.wait(final=True)
    saved = _local_state(model, optimizer) if saved_layout == loaded_layout else None
    out = {}
    for load_once in (True, False):
        fresh, fresh_opt, mesh, _ = _build(loaded_layout)
        from depthscale.train.restore import restore

        _, stats = restore(step_dir(Path(root), 1), fresh, fresh_opt, mesh, load_once=load_once)
        state = _local_state(fresh, fresh_opt)
        if saved is not None:
            _assert_same(saved, state)  # what was saved is what comes back, bitwise
        out[load_once] = (state, stats)
    _assert_same(out[True][0], out[False][0])
    return {k: v[1] for k, v in out.items()}


def _check_restore(results: list[dict], root, per_rank: int | None) -> None:
    """All ranks together read what one process reading the whole checkpoint reads (DCP reads a
    little more than the files' size: torch.load re-reads each item's zip headers), each byte
    they need once; every rank reading reads `per_rank` times that (None: more than once, as
    FSDP ranks each read the parameters FSDP keeps whole and the step counts)."""
    from depthscale.train.restore import distinct_bytes, restore

    model, optimizer, _, _ = _build({})
    _, alone = restore(step_dir(root, 1), model, optimizer)
    size = sum(f.stat().st_size for f in step_dir(root, 1).glob("*.distcp"))
    assert 0.95 * size < distinct_bytes([alone]) <= size < alone.shard_bytes
    once = [r[True] for r in results]
    assert sum(s.shard_bytes for s in once) == alone.shard_bytes
    assert distinct_bytes(once) == distinct_bytes([alone])
    every_rank = sum(r[False].shard_bytes for r in results)
    if per_rank is None:
        assert every_rank > alone.shard_bytes
    else:
        assert every_rank == per_rank * alone.shard_bytes


def test_restore_in_one_process_reads_the_checkpoint_once(tmp_path):
    _check_restore([_restore_counted(str(tmp_path), {}, {})], tmp_path, 1)


@pytest.mark.parametrize(
    "layout, per_rank",
    [({"dp_replicate": 2}, 2), ({"dp_shard": 2}, None)],
    ids=["replicate2", "shard2"],
)
def test_restore_reads_once_per_replica_group_on_two_ranks(dist_pool, tmp_path, layout, per_rank):
    results = dist_pool(2).run(_restore_counted, str(tmp_path), layout, layout)
    _check_restore(results, tmp_path, per_rank)
    if "dp_replicate" in layout:  # rank 1 received its state from rank 0
        assert [r[True].from_storage for r in results] == [True, False]
        assert results[1][True].shard_bytes == 0


def _groups_held_after_restore(root: str, layout: dict) -> int:
    from torch.distributed import distributed_c10d

    _restore_counted(root, layout, layout)
    return len(distributed_c10d._world.pg_names)


def test_restore_leaves_every_rank_holding_as_many_groups(dist_pool, tmp_path):
    """torch names a group made by its members alone after the number of groups each holds: a
    restore that gave only the readers a group made every later such group (a mesh of another
    layout) hang, its members waiting under different names."""
    held = dist_pool(2).run(_groups_held_after_restore, str(tmp_path), {"dp_replicate": 2})
    assert held[0] == held[1]


@pytest.mark.slow
@pytest.mark.parametrize(
    "layout, per_rank",
    [({"dp_replicate": 4}, 4), ({"dp_replicate": 2, "dp_shard": 2}, None)],
    ids=["replicate4", "hsdp2x2"],
)
def test_restore_reads_once_per_replica_group_on_four_ranks(dist_pool, tmp_path, layout, per_rank):
    results = dist_pool(4).run(_restore_counted, str(tmp_path), layout, layout)
    _check_restore(results, tmp_path, per_rank)


@pytest.mark.parametrize(
    "saved, loaded",
    [({"dp_shard": 2}, {"dp_replicate": 2}), ({"dp_replicate": 2}, {"dp_shard": 2})],
    ids=["shard_to_replicate", "replicate_to_shard"],
)
def test_a_layout_change_reshards_through_dcp(dist_pool, tmp_path, saved, loaded):
    """The restored state equals the single-process view of the checkpoint."""
    dist_pool(2).run(_restore_counted, str(tmp_path), saved, loaded)
    reference = _flat_saved(step_dir(tmp_path, 1))
    full = dist_pool(2).run(_full_after_restore, str(tmp_path), loaded)[0]
    for key, value in full.items():
        assert torch.equal(value, reference[key]), key


def _full_after_restore(root: str, layout: dict) -> dict:
    from pathlib import Path

    model, optimizer, mesh, _ = _build(layout)
    Checkpointer(Path(root), CheckpointConfig()).load(
        step_dir(Path(root), 1), model, optimizer, mesh
    )
    model_sd, _ = get_state_dict(model, optimizer, options=FLAT)
    return {
        f"model.{k}": v.full_tensor() if isinstance(v, DTensor) else v.clone()
        for k, v in model_sd.items()
    }


# ---------------------------------------------------------------------------- the writer process


def _tiny() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = torch.nn.Linear(8, 8)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.ones(2, 8)).sum().backward()
    optimizer.step()
    return model, optimizer


def test_a_killed_writer_process_is_an_error_naming_it_and_published_saves_stay(tmp_path):
    model, optimizer = _tiny()
    ckpt = Checkpointer(tmp_path, CheckpointConfig(keep=0, async_save=True))
    ckpt.save(1, model, optimizer, {"step": 1})
    ckpt.wait()
    pid = ckpt.writer_pid
    os.kill(pid, signal.SIGKILL)
    with pytest.raises(CheckpointError) as raised:
        ckpt.save(2, model, optimizer, {"step": 2})
        ckpt.wait()
    message = str(raised.value)
    assert f"checkpoint writer process of this rank (pid {pid}) was killed by SIGKILL" in message
    assert newest_verified(tmp_path) == step_dir(tmp_path, 1)


_ORPHAN = """
import sys, time, torch
from pathlib import Path
from depthscale.config import CheckpointConfig
from depthscale.train.checkpoint import Checkpointer
model = torch.nn.Linear(8, 8)
ckpt = Checkpointer(Path(sys.argv[1]), CheckpointConfig(async_save=True))
ckpt.save(1, model, torch.optim.SGD(model.parameters(), lr=0.1), {"step": 1})
ckpt.wait()
print(ckpt.writer_pid, flush=True)
time.sleep(600)
"""


def test_the_writer_process_dies_with_its_rank(tmp_path):
    """A rank SIGKILLed (by the supervisor, the OOM killer) leaves no writer behind."""
    rank = subprocess.Popen(
        [sys.executable, "-c", _ORPHAN, str(tmp_path)], stdout=subprocess.PIPE, text=True
    )
    try:
        writer = int(rank.stdout.readline())
        assert _running(writer)
    finally:
        rank.kill()
        rank.wait()
    deadline = time.monotonic() + 30
    while _running(writer) and time.monotonic() < deadline:
        time.sleep(0.05)
    if _running(writer):
        os.kill(writer, signal.SIGKILL)
        pytest.fail(f"writer {writer} outlived its rank by 30 s")


def _running(pid: int) -> bool:
    """Alive and not a zombie (an orphan's reaper may be slow, or absent in a container)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False
