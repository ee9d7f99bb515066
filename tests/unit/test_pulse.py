"""The supervisors' beat (resilience/peers.py `Pulse`): how a node finds another gone, against a
real store — in a process of its own where node 0 is killed or frozen."""

from __future__ import annotations

import datetime
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch.distributed as dist

from depthscale.resilience.peers import Pulse

SERVE = """
import sys, time
import torch.distributed as dist
store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
print(store.port, flush=True)
time.sleep(300)
"""


@pytest.fixture
def node0():
    """A store in a process of its own, as node 0's supervisor hosts it: (process, port)."""
    proc = subprocess.Popen([sys.executable, "-c", SERVE], stdout=subprocess.PIPE, text=True)
    port = int(proc.stdout.readline())
    yield proc, port
    proc.kill()
    proc.wait()


def _until(found, seconds: float):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if (value := found()) is not None:
            return value
        time.sleep(0.02)
    return None


def test_node0_whose_process_ended_is_found_at_once(node0):
    proc, port = node0
    pulse = Pulse("127.0.0.1", port, 2, 1, period=0.05, limit_s=5.0)
    assert pulse.check() is None
    proc.kill()
    killed = time.monotonic()
    lost = _until(pulse.check, 2.0)
    assert lost is not None and lost.node == 0 and time.monotonic() - killed < 1.0
    assert "closed this node's connection: node 0's supervisor is gone" in lost.how
    pulse.stop()


def test_a_frozen_node0_is_found_within_the_limit_and_the_supervisor_told(node0):
    """Its kernel still answers (no keep-alive failure): the beat goes unanswered; a main thread
    stuck in a store call would never read the verdict, so `abandon` is called."""
    proc, port = node0
    pulse = Pulse("127.0.0.1", port, 2, 1, period=0.05, limit_s=1.0)
    told: list = []
    pulse.abandon = told.append
    time.sleep(0.2)
    proc.send_signal(signal.SIGSTOP)
    frozen = time.monotonic()
    assert _until(lambda: told[0] if told else None, 5.0) is not None
    assert 1.0 <= time.monotonic() - frozen < 3.5
    assert told[0].node == 0 and "did not answer this node's beat for" in told[0].how
    proc.send_signal(signal.SIGCONT)
    pulse.stop()


def test_a_verdict_the_main_thread_took_is_not_acted_on_twice(node0):
    proc, port = node0
    pulse = Pulse("127.0.0.1", port, 2, 1, period=0.05, limit_s=5.0)
    told: list = []
    pulse.abandon = told.append
    proc.kill()
    assert _until(pulse.check, 2.0) is not None
    pulse.took.set()  # as Peers does when it raises PeersLost on the main thread
    time.sleep(Pulse.GRACE_S + 0.5)
    assert told == []
    pulse.stop()


def test_node0_finds_a_silent_node_gone_but_not_one_that_left():
    store = dist.TCPStore(
        "127.0.0.1", 0, is_master=True, wait_for_workers=False,
        timeout=datetime.timedelta(seconds=5),
    )  # fmt: skip
    leader = Pulse("127.0.0.1", store.port, 3, 0, period=0.05, limit_s=0.5)
    one = Pulse("127.0.0.1", store.port, 3, 1, period=0.05, limit_s=0.5)
    two = Pulse("127.0.0.1", store.port, 3, 2, period=0.05, limit_s=0.5)
    time.sleep(0.3)
    assert leader.check() is None
    two.stop()
    store.set("sup/left/2", "exit 0")  # node 2 finished and said so
    time.sleep(1.0)
    assert leader.check() is None and leader.left == {2}
    one.stop()  # silent: its supervisor killed
    lost = _until(leader.check, 3.0)
    assert lost is not None and lost.node == 1 and leader.gone == {1}
    assert "its supervisor has not beaten in node 0's store for" in lost.how
    assert lost.evidence["silent_s"] > 0.5
    leader.stop()
    assert not [t for t in threading.enumerate() if t.name == "depthscale-pulse"]
