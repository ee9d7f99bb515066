"""Fast start and restart: what a 4-process start-up synchronises over the whole world, counted in
fresh gloo processes from before `init_process_group` to the first step done, and the per-rank
start-up phase marks the supervisor reads.

The workers run with TORCH_DIST_INIT_BARRIER=1, which makes torch put a store barrier after every
group it creates (torch < 2.1 always did: MegaScale's 1,047 s): over the whole world for a
`new_group` every rank enters, over the members for `use_local_synchronization=True`. What is
left over the whole world, per rank:

- 1: `init_process_group`'s own (the rendezvous).

torch's `DeviceMesh._flatten` would add one `new_group` per group on every rank for `dp_shard_cp`
and `dp_cp` (4 here; more with every pipeline); a flattened dimension is now made only where two
of its dimensions exceed 1, else the one that does stands in for it (`mesh.flat`).

Before this change (torch's `init_device_mesh`, the tied-embedding groups with `new_group` on every
rank, a `dist.barrier` after the data and one after archiving traces) a pp=2 × dp_shard=2 start-up
had 21 + 1 world store barriers and 2 barriers.
"""

from __future__ import annotations

import json
import os
import socket
import time

import pytest
import torch.multiprocessing as mp

from depthscale.observe import startup

WORLD = 4


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(rank: int, port: int, run_dir: str, corpus: str, layout: dict, results) -> None:
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(WORLD),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(WORLD),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        OMP_NUM_THREADS="1",
        TORCH_DIST_INIT_BARRIER="1",
    )
    import torch

    torch.set_num_threads(1)
    from depthscale.config import load_config
    from depthscale.parallel.mesh import destroy_distributed
    from depthscale.parallel.startup import count_synchronizations
    from depthscale.train.trainer import Trainer

    args = [
        *("--data.path", corpus, "--data.seq_len", "16", "--train.batch_size", "4"),
        *("--model.dim", "32", "--model.n_layers", "4", "--model.n_heads", "4"),
        *("--model.n_kv_heads", "2", "--train.steps", "2", "--train.eval_every", "0"),
        *("--optim.warmup_steps", "1"),
        *("--checkpoint.every", "0", "--logging.progress", "false"),
        *("--logging.tensorboard", "false", "--train.run_dir", run_dir),
        *("--parallel.setup_timeout_s", "900", "--parallel.timeout_s", "500"),
    ]
    args += [a for name, v in layout.items() for a in (f"--parallel.{name}", str(v))]
    try:
        with count_synchronizations() as counts:
            trainer = Trainer(load_config(None, args))
            setup_timeouts = _timeouts()
            trainer.fit(stop_at=1)  # the first step: its phase mark
        # the world group and every wait on a store key (a node's ranks waiting for its data)
        # are bounded by parallel.setup_timeout_s until the first step, then by
        # parallel.timeout_s, which the sub-groups have from the start: not torch's defaults
        # (gloo 30 min, TCPStore 5 min)
        timeouts = {"setup": setup_timeouts, "steps": _timeouts()}
        results.put((rank, {**counts.summary(), "timeouts": timeouts}))
    except BaseException as err:
        results.put((rank, repr(err)))
        raise
    finally:
        destroy_distributed()


def _timeouts() -> dict[str, list[float]]:
    """The store's timeout and the distinct timeouts of this rank's process groups, in seconds."""
    import torch
    from torch.distributed import distributed_c10d

    groups = [g for g in distributed_c10d._world.pg_map if g is not None]
    backends = [g._get_backend(torch.device("cpu")) for g in groups]
    return {
        "store": [distributed_c10d._get_default_store().timeout.total_seconds()],
        "groups": sorted({b.options._timeout.total_seconds() for b in backends}),
    }


def _run(tmp_path, layout: dict) -> dict[int, dict]:
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("".join(f"line {i}: the quick brown fox {i * 7}\n" for i in range(300)))
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = _free_port()
    args = (port, str(tmp_path / "run"), str(corpus), layout, results)
    procs = [ctx.Process(target=_start, args=(r, *args), daemon=True) for r in range(WORLD)]
    for p in procs:
        p.start()
    out = dict(results.get(timeout=600) for _ in range(WORLD))
    for p in procs:
        p.join(timeout=60)
        if p.is_alive():
            p.kill()
    for rank, value in out.items():
        assert isinstance(value, dict), f"rank {rank}: {value}"
    return out


@pytest.mark.parametrize(
    "layout, local_groups",
    [
        ({"pp": 2, "dp_shard": 2}, 4),  # pp, dp_shard, one for the 3 of size 1, the tied pair
        ({"tp": 2, "dp_shard": 2}, 3),
    ],
)
def test_startup_has_no_world_barrier_but_init(tmp_path, layout, local_groups):
    counts = _run(tmp_path, layout)
    expected = {
        "barriers": 0,
        "world_store_barriers": 1,
        "local_store_barriers": local_groups,
        "new_groups_world": 0,
        "new_groups_local": local_groups,
        "splits": 0,
        "timeouts": {
            "setup": {"store": [900.0], "groups": [500.0, 900.0]},  # the world group: 900
            "steps": {"store": [500.0], "groups": [500.0]},
        },
    }
    assert counts == dict.fromkeys(range(WORLD), expected)
    phases = startup.startup_phases(tmp_path / "run")
    assert sorted(phases) == list(range(WORLD))
    expected = [p for p in startup.PHASES if p not in startup.OPTIONAL]
    for rank, seconds in phases.items():
        assert list(seconds) == [*expected, "total"], rank
        assert all(v >= 0 for v in seconds.values()), (rank, seconds)
        assert seconds["total"] == pytest.approx(sum(seconds[p] for p in expected))


def test_phases_are_durations_between_marks_from_the_process_start(tmp_path, monkeypatch):
    """A rank that died after its mesh shows the phases it reached; `launched_at` adds the launch."""
    monkeypatch.setattr(startup, "_marks", {})
    monkeypatch.setattr(startup, "process_start_time", lambda: 100.0)
    clock = iter([102.5, 103.0, 103.25])
    monkeypatch.setattr(startup.time, "time", lambda: next(clock))
    for phase in ("imports", "process_group", "mesh"):
        startup.mark(phase)
    startup.save(tmp_path, 3)
    assert json.loads(startup.startup_path(tmp_path, 3).read_text())["process_start"] == 100.0
    assert startup.startup_phases(tmp_path, launched_at=99.0) == {
        3: {"launch": 1.0, "imports": 2.5, "process_group": 0.5, "mesh": 0.25, "total": 4.25}
    }
    with pytest.raises(ValueError, match="unknown start-up phase 'warmup'"):
        startup.mark("warmup")


def test_process_start_precedes_now():
    assert 0 <= time.time() - startup.process_start_time() < 24 * 3600
