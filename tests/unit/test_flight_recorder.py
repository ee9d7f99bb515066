"""Which of torch's Flight Recorders a hang dump reads, chosen by backend, and the environment a
CUDA run's NCCL groups are made under — against stand-ins for torch's dump functions (a CPU
build has no `_dump_nccl_trace`)."""

from __future__ import annotations

import pickle
from types import SimpleNamespace

import pytest
import torch

from depthscale.observe import flight_recorder
from depthscale.observe.flight_recorder import GLOO_DUMP, NCCL_DUMP, dumpers, nccl_env


@pytest.mark.parametrize(
    "backend, read",
    [
        ("gloo", (GLOO_DUMP,)),
        ("nccl", (NCCL_DUMP, GLOO_DUMP)),
        ("cpu:gloo,cuda:nccl", (NCCL_DUMP, GLOO_DUMP)),
    ],
)
def test_the_dump_is_chosen_by_backend(backend, read):
    """NCCL's collectives are only in NCCL's recorder; the gloo side groups of a GPU run in the
    generic one (reading that alone, as before, saw no NCCL collective at all)."""
    assert dumpers(backend) == read


def _nccl_dump() -> dict:
    """Torch's format: world group "0" on NCCL, #7 started on the GPU, #8 queued behind it."""
    entry = {"pg_id": 0, "process_group": ("0", "default_pg"), "profiling_name": "nccl:all_reduce",
             "retired": False, "is_p2p": False, "time_discovered_started_ns": None}  # fmt: skip
    return {
        "pg_config": {"0": {"name": "0", "desc": "default_pg", "ranks": "[0, 1]"}},
        "pg_status": {"0": {"last_enqueued_collective": 8, "last_started_collective": 7,
                            "last_completed_collective": 6}},
        "entries": [
            {**entry, "collective_seq_id": 6, "state": "completed", "retired": True,
             "time_created_ns": 100},
            {**entry, "collective_seq_id": 7, "state": "started", "time_created_ns": 200},
            {**entry, "collective_seq_id": 8, "state": "scheduled", "time_created_ns": 400},
            {**entry, "collective_seq_id": 0, "state": "scheduled", "is_p2p": True,
             "time_created_ns": 500},
        ],
    }  # fmt: skip


def _gloo_dump() -> dict:
    """A gloo side group "5" (the step statistics' all-reduce), #3 pending."""
    return {
        "pg_config": {"": {"name": "", "desc": "", "ranks": "[0]"}},  # as torch 2.13's gloo
        "pg_status": {"1": {"last_enqueued_collective": 3, "last_started_collective": -1,
                            "last_completed_collective": 2}},
        "entries": [{"pg_id": 1, "process_group": ("5", "side"), "collective_seq_id": 3,
                     "profiling_name": "gloo:all_reduce", "state": "scheduled", "retired": False,
                     "is_p2p": False, "time_created_ns": 300}],
    }  # fmt: skip


@pytest.fixture
def fake_torch(monkeypatch):
    """A process in a group of `backend`, bound to GPU 3; logs the calls in order."""
    calls: list[tuple] = []

    def dump(name, data):
        def call(*args):
            calls.append((name, torch.cuda.current_device()))
            return pickle.dumps(data)

        return call

    fake = SimpleNamespace(calls=calls, backend="nccl", device=0)
    c10d = torch._C._distributed_c10d
    for name, data in ((NCCL_DUMP, _nccl_dump()), (GLOO_DUMP, _gloo_dump())):
        monkeypatch.setattr(c10d, name, dump(name, data), raising=False)

    def set_device(device):
        calls.append(("set_device", torch.device(device).index))
        fake.device = torch.device(device).index

    monkeypatch.setattr(torch.cuda, "set_device", set_device)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: fake.device)
    world = SimpleNamespace(bound_device_id=torch.device("cuda", 3))
    monkeypatch.setattr(
        flight_recorder,
        "dist",
        SimpleNamespace(
            is_initialized=lambda: True,
            get_backend=lambda: fake.backend,
            group=SimpleNamespace(WORLD=world),
            get_process_group_ranks=lambda g: [0, 1, 2, 3],
        ),
    )
    return fake


def test_an_nccl_rank_reads_both_recorders_on_its_own_gpu(fake_torch, monkeypatch):
    monkeypatch.delenv("TORCH_NCCL_ENABLE_TIMING", raising=False)
    seen = flight_recorder.snapshot()
    # NCCL's dump queries CUDA events: the (watchdog) thread is on the rank's GPU first
    assert fake_torch.calls[:2] == [("set_device", 3), (NCCL_DUMP, 3)]
    assert [c[0] for c in fake_torch.calls] == ["set_device", NCCL_DUMP, GLOO_DUMP]
    assert seen["groups"]["0"] == {"ranks": [0, 1], "desc": "default_pg", "enqueued": 8,
                                   "backend": "nccl", "started": 7, "completed": 6}  # fmt: skip
    assert seen["groups"]["5"]["enqueued"] == 3 and "backend" not in seen["groups"]["5"]
    assert seen["in_flight"] == [  # oldest first, over both recorders; messages left out
        {"group": "0", "seq": 7, "op": "all_reduce", "state": "started"},
        {"group": "5", "seq": 3, "op": "all_reduce"},
        {"group": "0", "seq": 8, "op": "all_reduce", "state": "scheduled"},
    ]


def test_a_gloo_rank_reads_only_the_generic_recorder(fake_torch):
    fake_torch.backend = "gloo"
    seen = flight_recorder.snapshot()
    assert fake_torch.calls == [(GLOO_DUMP, 0)]  # no CUDA, no NCCL
    assert set(seen["groups"]) == {"5"}


def test_a_failing_recorder_leaves_the_other(fake_torch, monkeypatch):
    def broken(*args):
        raise RuntimeError("watchdog stuck")

    monkeypatch.setattr(torch._C._distributed_c10d, NCCL_DUMP, broken, raising=False)
    seen = flight_recorder.snapshot()
    assert set(seen["groups"]) == {"5"} and "watchdog stuck" in seen["errors"][0]
    monkeypatch.setattr(torch._C._distributed_c10d, GLOO_DUMP, broken)
    assert "watchdog stuck" in flight_recorder.snapshot()["error"]


def test_nccl_environment_is_set_before_the_group_without_overriding_the_user(tmp_path):
    environ = {"TORCH_FR_BUFFER_SIZE": "100"}  # the user's
    flight_recorder.configure_nccl(tmp_path / "run", environ)
    assert environ["TORCH_FR_BUFFER_SIZE"] == "100"
    assert environ["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1"
    assert environ["TORCH_NCCL_ENABLE_TIMING"] == "1"
    prefix = tmp_path / "run" / "trace" / "nccl" / "rank"
    assert environ["TORCH_FR_DUMP_TEMP_FILE"] == environ["TORCH_NCCL_DEBUG_INFO_TEMP_FILE"]
    assert environ["TORCH_FR_DUMP_TEMP_FILE"] == str(prefix)
    assert not prefix.parent.exists()  # made after the previous trace is archived:
    flight_recorder.make_dump_dir(environ)
    assert prefix.parent.is_dir()  # torch creates no folder for its dump
    assert set(nccl_env(tmp_path)) == set(environ)
