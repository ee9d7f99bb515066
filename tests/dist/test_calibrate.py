"""`depthscale plan --calibrate` end to end on two gloo processes: every rate it writes is a positive
measurement, every collective is timed for the group size, and the planner loads the file back."""

from __future__ import annotations

import json

from depthscale.parallel.calibrate import OPS, measure_cluster
from depthscale.plan.hardware import load_cluster


def test_two_rank_calibration_loads_as_a_cluster(tmp_path):
    measured = measure_cluster(nproc=2, budget_s=0.0)
    assert measured["peak_flops"]["float32"] > 0 and measured["hbm_bw"] > 0
    assert 0 < measured["attention_efficiency"] <= 1
    assert measured["intra_bw"] > 0 and measured["intra_latency"] >= 0
    assert set(measured["collectives"]) == set(OPS)
    for op, entries in measured["collectives"].items():
        assert [n for n, _, _ in entries] == [2], op  # one group size: the two ranks
        assert all(latency >= 0 and bw > 0 for _, latency, bw in entries), op
    path = tmp_path / "cpu.json"
    path.write_text(json.dumps(measured))
    cluster = load_cluster(path)
    assert cluster.op_time("p2p", 2**20, 2, False) > 0
    assert cluster.gemm_flops("float32", 64) <= cluster.peak("float32")
