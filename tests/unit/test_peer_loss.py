"""The one line a rank prints when a peer's process is gone (train/peer_loss.py): whom it waited
for, whether that process still runs on this host, whether the rendezvous store still answers."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest
from test_trainer import make_cfg

from depthscale.errors import CheckpointError, PeersFailed
from depthscale.observe.startup import startup_path
from depthscale.observe.watchdog import hang_path
from depthscale.train.peer_loss import describe, is_peer_loss
from depthscale.train.trainer import Trainer

CLOSED = (
    "[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer "
    "[127.0.0.1]:50356. This is typically caused by a remote worker crashing. Check the logs of "
    "the remote worker before reporting an error. GLHF!"
)


def _record(run, rank: int, pid: int, host: str | None = None) -> None:
    path = startup_path(run, rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"rank": rank, "pid": pid, "host": host or socket.gethostname()}))


def _dead_pid() -> int:
    """The pid of a process that ran here and is gone (killed and reaped)."""
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    proc.kill()
    proc.wait()
    return proc.pid


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]  # nothing listens there once closed


@pytest.fixture
def two_nodes(monkeypatch):
    """Rank 0 and 1, a node each, rank 0 hosting a store that still answers."""
    server = socket.create_server(("127.0.0.1", 0))
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(server.getsockname()[1]))
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)
    yield
    server.close()


def test_a_peer_whose_process_is_gone_here_is_named_with_its_pid(tmp_path, two_nodes):
    pid = _dead_pid()
    _record(tmp_path, 1, pid)
    _record(tmp_path, 0, os.getpid())
    waits = [{"name": "all_reduce", "cat": "collective", "group": "0,1", "step": 7}]
    line = describe(RuntimeError(CLOSED), 0, 9, waits, tmp_path)
    assert line == (
        f"rank 0 lost its peer rank 1 (node 1, host {socket.gethostname()}) in all_reduce at "
        f"step 7: Connection closed by peer [127.0.0.1]:50356; its process is gone (pid {pid} on "
        "this host)"
    )


def test_a_store_that_refuses_names_the_rank_hosting_it(tmp_path, two_nodes, monkeypatch):
    """Rank 0 hosts the store without torchrun's agent; the peer ran on another host."""
    monkeypatch.setenv("MASTER_PORT", str(_closed_port()))
    _record(tmp_path, 0, 1, host="elsewhere")
    waits = [{"name": "recv", "cat": "pp", "peer": 0, "step": 3}]
    line = describe(RuntimeError("Connection reset by peer"), 1, 4, waits, tmp_path)
    assert line.startswith(
        "rank 1 lost its peer rank 0 (node 0, host elsewhere) in pp recv at step 3: Connection "
        "reset by peer; the rendezvous store at 127.0.0.1:"
    )
    assert line.endswith("refuses connections too: its host is gone")


def test_several_unknown_peers_are_listed_as_one_of_them(tmp_path, two_nodes, monkeypatch):
    """Peers on other hosts, a store that answers: which one went cannot be told from here."""
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    waits = [{"name": "all_gather", "cat": "collective", "group": "0,1,2,3", "step": 2}]
    line = describe(RuntimeError(CLOSED), 1, 2, waits, tmp_path)
    assert line.startswith("rank 1 lost a peer: one of ranks 0, 2, 3 (node 0; node 1) in ")
    assert line.endswith("it died, was killed or its host went away: its own output says why")


def test_a_failed_background_save_that_lost_its_peers_is_a_peer_loss():
    """The writer's PeersFailed or its lost connection, raised as the save's error."""
    for cause in (PeersFailed("its checkpoint writer cannot reach ..."), RuntimeError(CLOSED)):
        try:
            raise CheckpointError("background checkpoint save failed") from cause
        except CheckpointError as err:
            assert is_peer_loss(err)
    assert not is_peer_loss(RuntimeError("[gloo] Timed out waiting 10000ms for recv operation"))


def test_the_trainer_reports_a_lost_peer_in_one_line(tmp_path, caplog):
    """One line: the dump is still written, for `trace hang`, without a line of its own."""
    cfg = make_cfg(tmp_path, "--train.eval_every", "0", "--checkpoint.every", "0")
    trainer = Trainer(cfg)

    def fail() -> None:
        raise RuntimeError(CLOSED)

    trainer._train_step = fail
    with pytest.raises(PeersFailed) as raised:
        trainer.fit()
    assert len(str(raised.value).splitlines()) == 1
    assert str(raised.value).startswith("rank 0 lost a peer at step 1: Connection closed by peer")
    assert hang_path(trainer.run_dir, 0).is_file() and "wrote its hang dump" not in caplog.text
