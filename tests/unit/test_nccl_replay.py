"""The NCCL-rules replay (`depthscale.parallel.nccl_rules`): it flags what NCCL would hang on or
mis-pair — the orders depthscale issued before it batched and ordered its messages, recorded from
real gloo runs at commit 4a07612 (tests/fixtures/p2p_orders_4a07612.json) — and passes correct
exchanges. Hand-made traces pin each rule."""

import json
from pathlib import Path

import pytest

from depthscale.parallel.nccl_rules import replay

OLD = json.loads((Path(__file__).parents[1] / "fixtures" / "p2p_orders_4a07612.json").read_text())


def _post(gid, *ops, batched=True, group=(0, 1)):
    return {"post": gid, "ops": [list(op) for op in ops], "group": list(group), "batched": batched}


def _wait(gid):
    return {"wait": gid}


@pytest.mark.parametrize("name", sorted(OLD))
def test_flags_every_recorded_old_order(name):
    report = replay(OLD[name])
    assert not report.ok, name
    if name.startswith("pipeline"):  # receives posted ahead of sends on a shared pair stream
        assert report.deadlock and "recv" in report.deadlock, report
    if name == "ring_cp2_causal_zigzag":  # both ranks send first on their one pair stream
        assert report.deadlock and "send" in report.deadlock, report
    if name == "ring_cp4_causal_zigzag":  # dK/dV's home receive posted before the ring's K/V
        assert any("tag 8" in m for m in report.mispaired), report


def test_a_batched_exchange_passes():
    trace = [
        [_post(0, ("send", 1, "a", 8), ("recv", 1, "b", 8)), _wait(0)],
        [_post(0, ("send", 0, "b", 8), ("recv", 0, "a", 8)), _wait(0)],
    ]
    report = replay(trace)
    assert report.ok and report.messages == 2, report


def test_unbatched_send_then_receive_on_both_sides_deadlocks():
    trace = [
        [
            _post(0, ("send", 1, "a", 8), batched=False),
            _post(1, ("recv", 1, "b", 8), batched=False),
            _wait(1),
        ],
        [
            _post(0, ("send", 0, "b", 8), batched=False),
            _post(1, ("recv", 0, "a", 8), batched=False),
            _wait(1),
        ],
    ]
    report = replay(trace)
    assert report.deadlock and "rank 0 blocks at wait 1" in report.deadlock, report


def test_unbatched_but_mirrored_order_passes():
    trace = [
        [
            _post(0, ("send", 1, "a", 8), batched=False),
            _post(1, ("recv", 1, "b", 8), batched=False),
            _wait(1),
        ],
        [
            _post(0, ("recv", 0, "a", 8), batched=False),
            _post(1, ("send", 0, "b", 8), batched=False),
            _wait(0),
        ],
    ]
    assert replay(trace).ok


def test_pairing_is_by_posting_order_not_label():
    trace = [
        [_post(0, ("send", 1, "x", 8)), _post(1, ("send", 1, "y", 4)), _wait(0), _wait(1)],
        [_post(0, ("recv", 0, "y", 4)), _post(1, ("recv", 0, "x", 8)), _wait(0), _wait(1)],
    ]
    report = replay(trace)
    assert len(report.mispaired) == 2 and "'y' (4 B)" in report.mispaired[0], report


def test_a_group_holds_its_stream_until_all_its_operations_meet():
    # rank 0's first group also waits for a receive that rank 2 only posts after rank 1's second
    # group, which is queued behind rank 1's first group on rank 1's stream: fine, no cycle...
    ok = [
        [_post(0, ("send", 1, "a", 1), ("recv", 2, "c", 1)), _wait(0)],
        [_post(0, ("recv", 0, "a", 1)), _post(1, ("send", 2, "b", 1)), _wait(1)],
        [_post(0, ("recv", 1, "b", 1)), _wait(0), _post(1, ("send", 0, "c", 1)), _wait(1)],
    ]
    assert replay(ok).ok
    # ...but if rank 1 needs rank 0's second group first, rank 0's stream is still busy: cycle
    stuck = [
        [_post(0, ("recv", 2, "c", 1)), _post(1, ("send", 1, "a", 1)), _wait(0)],
        [_post(0, ("recv", 0, "a", 1)), _wait(0), _post(1, ("send", 2, "b", 1))],
        [_post(0, ("recv", 1, "b", 1)), _wait(0), _post(1, ("send", 0, "c", 1))],
    ]
    assert replay(stuck).deadlock


def test_batched_and_unbatched_never_pair():
    trace = [
        [_post(0, ("send", 1, "a", 8), batched=True), _wait(0)],
        [_post(0, ("recv", 0, "a", 8), batched=False), _wait(0)],
    ]
    report = replay(trace)
    assert report.deadlock and len(report.unmatched) == 2, report


def test_only_p2p_posts_point_to_point_and_never_with_a_tag():
    """Every message goes through `parallel/p2p.py` (groups, tag 0): no module calls isend/irecv,
    send/recv or builds a P2POp itself, and p2p passes no tag. `parallel/comm_count.py` names
    them only to count what is posted (it wraps `batch_isend_irecv` and posts nothing)."""
    import re

    src = Path(__file__).parents[2] / "src" / "depthscale"
    pattern = re.compile(r"\b(isend|irecv|batch_isend_irecv|P2POp)\b|dist\.(send|recv)\(")

    def code(path: Path) -> str:  # without docstrings and comments
        return re.sub(r'"""[\s\S]*?"""|#.*', "", path.read_text())

    offenders = [
        str(path.relative_to(src))
        for path in src.rglob("*.py")
        if path.name != "p2p.py"
        and pattern.search(code(path))
        and path.relative_to(src).as_posix() != "parallel/comm_count.py"  # observes, never posts
    ]
    assert not offenders, offenders
    assert pattern.search(code(src / "parallel" / "p2p.py"))  # the scan sees real calls
    assert "tag" not in code(src / "parallel" / "p2p.py")
