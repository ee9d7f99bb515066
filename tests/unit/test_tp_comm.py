"""`tp_comm.count_collectives`: collectives are counted only inside a scope, per scope (nested
scopes each see theirs), and a scope left by an exception stops counting. No process group: the
counting is all this tests (tests/dist/test_tensor_parallel.py checks the counts of real steps)."""

import pytest

from depthscale.parallel import tp_comm
from depthscale.parallel.tp_comm import count_collectives, record_collective


def test_counts_only_inside_scopes():
    record_collective("all_gather")  # outside any scope: not counted, nothing kept
    assert tp_comm._counters == []
    with count_collectives() as outer:
        record_collective("all_gather")
        with count_collectives() as inner:
            record_collective("reduce_scatter")
            record_collective("reduce_scatter")
        record_collective("all_reduce")
    record_collective("all_reduce")
    assert dict(outer) == {"all_gather": 1, "reduce_scatter": 2, "all_reduce": 1}
    assert dict(inner) == {"reduce_scatter": 2}
    assert tp_comm._counters == []


def test_a_scope_left_by_an_exception_stops_counting():
    with pytest.raises(RuntimeError), count_collectives() as counts:
        record_collective("all_gather")
        raise RuntimeError
    record_collective("all_gather")
    assert dict(counts) == {"all_gather": 1} and tp_comm._counters == []
