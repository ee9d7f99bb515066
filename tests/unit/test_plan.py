"""The planner against published runs, the schedule code, and bad input (pure arithmetic)."""

from __future__ import annotations

import json
import re
import sys
import time

import pytest

from depthscale.cli import main
from depthscale.config import ModelConfig
from depthscale.parallel.pipeline.schedules import interleaved_1f1b, simulate
from depthscale.plan.estimate import Workload, estimate
from depthscale.plan.frameworks import DEPTHSCALE, MEGATRON_2022
from depthscale.plan.hardware import PRESETS
from depthscale.plan.layout import Layout, parse_layout
from depthscale.plan.pipeline import _simulated, hop_tensors, peak_in_flight, pipeline_time
from depthscale.plan.search import SIMULATED, search
from depthscale.shape import ModelShape

# Korthikanti et al. 2022, Tables 3 and 5: (heads, hidden, layers, t, p, v, GPUs, batch,
# micro-batch, iteration s with full recompute, with sequence parallelism + selective recompute)
KORTHIKANTI = {
    "22B": (64, 6144, 48, 8, 1, 1, 8, 4, 4, 1.42, 1.10),
    "175B": (96, 12288, 96, 8, 8, 3, 64, 64, 1, 18.13, 13.75),
    "530B": (128, 20480, 105, 8, 35, 3, 280, 280, 1, 49.05, 37.83),
    "1T": (160, 25600, 128, 8, 64, 1, 512, 512, 1, 94.42, 71.49),
}


def test_korthikanti_table5_iteration_times():
    """Eight iteration times within 10 % each and 5 % on average. The paper interleaves 175B and
    530B over 3 chunks (Table 3's footnote) in both columns; the 1T run is not interleaved."""
    errors = {}
    for name, (heads, h, layers, t, p, v, gpus, batch, mb, full, sel) in KORTHIKANTI.items():
        spec = ModelShape.gpt(layers, h, heads, 51200, 2048)
        for recompute, measured in (("full", full), ("selective", sel)):
            lay = Layout(tp=t, pp=p, v=v if recompute == "selective" else 1, micro_batch=mb,
                         recompute=recompute)  # fmt: skip
            est = estimate(Workload(spec, 2048, batch), PRESETS["a100"], lay, MEGATRON_2022, gpus)
            assert est.ok, (name, est.reason)
            errors[name, recompute] = est.step_s / measured - 1
    assert max(abs(e) for e in errors.values()) <= 0.10, errors
    assert sum(abs(e) for e in errors.values()) / len(errors) <= 0.05, errors


def test_korthikanti_mfu_convention():
    """Eq. 7 at 312 TFLOP/s reproduces the paper's MFU cells from its iteration times."""
    for name, mfu in (("175B", 0.514), ("530B", 0.560), ("1T", 0.563)):
        heads, h, layers, t, p, v, gpus, batch, mb, _, sel = KORTHIKANTI[name]
        spec = ModelShape.gpt(layers, h, heads, 51200, 2048)
        achieved = spec.model_flops(2048) * batch / sel / (gpus * 312e12)
        assert abs(achieved - mfu) < 0.002, name


@pytest.mark.parametrize(("p", "v", "m"), [(2, 1, 5), (4, 1, 16), (4, 2, 8), (3, 3, 9), (4, 4, 12)])
def test_peak_in_flight_is_the_schedule_s(p, v, m):
    tl = simulate(interleaved_1f1b(p, v, m))
    assert list(peak_in_flight(p, v, m)) == tl.peak_in_flight


@pytest.mark.parametrize(("p", "v", "m"), [(4, 1, 64), (4, 2, 64), (8, 3, 96), (5, 3, 85)])
def test_long_pipelines_extrapolate_exactly(p, v, m):
    """Past a few rounds every round of P micro-batches adds the same time: the extrapolated
    makespan equals the full simulation's, with stages of different costs."""
    stages = p * v
    f = [1.0 + 0.1 * (s == 0) + 0.3 * (s == stages - 1) for s in range(stages)]
    b = [2.2 * x for x in f]
    fast = pipeline_time(p, v, m, f, b, 0.05)
    full = _simulated(p, v, m, tuple(f), tuple(b), 0.05)
    assert fast.makespan == pytest.approx(full.makespan, rel=1e-9)
    assert fast.peak_in_flight == full.peak_in_flight


@pytest.mark.parametrize(
    ("p", "v", "layers", "block_size"), [(2, 2, 8, 2), (4, 2, 16, 4), (2, 3, 6, 3), (4, 3, 13, 5)]
)
@pytest.mark.parametrize("cache", [True, False])
def test_hops_carry_what_the_depth_cache_sends(p, v, layers, block_size, cache):
    """The plan's hop sizes are the runtime's: `DepthCache` (which test_depth_cache.py checks
    against Eq. 7 and 8) sends the same blocks per hop, plus a partial sum where a block goes on."""
    from depthscale.parallel.pipeline.depth_cache import DepthCache
    from depthscale.parallel.pipeline.schedules import split_layers

    cfg = ModelConfig(vocab_size=64, dim=32, n_layers=layers, n_heads=4, residual="block",
                      attnres_block_size=block_size)  # fmt: skip
    runtime = DepthCache(cfg, split_layers(layers, p * v), p, enabled=cache)
    plan = hop_tensors(ModelShape.from_config(cfg), Layout(pp=p, v=v, cache=cache))
    sizes = [runtime.hop_size(u) for u in range(p * v - 1)]
    assert plan == sizes


def test_the_cache_cuts_pipeline_bytes_and_memory():
    spec = ModelShape(
        16, 256, 8, 8, 704, 1000, residual="block", blocks=tuple(i // 4 for i in range(32))
    )
    w = Workload(spec, 1024, 64)
    on = estimate(
        w, PRESETS["h100"], Layout(pp=4, v=2, dp_replicate=2, micro_batch=1), DEPTHSCALE, 8
    )
    off = estimate(w, PRESETS["h100"], Layout(pp=4, v=2, dp_replicate=2, micro_batch=1, cache=False),
                   DEPTHSCALE, 8)  # fmt: skip
    assert on.ok and off.ok
    assert on.comm["pp"] < off.comm["pp"] and on.memory["pipeline"] < off.memory["pipeline"]


def test_search_names_what_each_rejected_layout_breaks():
    spec = ModelShape.gpt(96, 12288, 96, 51200, 2048)
    result = search(Workload(spec, 2048, 1536), PRESETS["a100"], MEGATRON_2022, 1024)
    assert result.ranked and result.rejected
    reasons = {e.reason.split(" ")[0] for e in result.rejected}
    assert "OOM" in reasons
    assert all(e.reason for e in result.rejected)
    assert all(e.ok and e.peak_bytes <= PRESETS["a100"].usable_bytes() for e in result.ranked)
    steps = [e.step_s for e in result.ranked[:SIMULATED]]  # simulated, then ranked again
    assert steps == sorted(steps)
    tp16 = estimate(Workload(spec, 2048, 1536), PRESETS["a100"], Layout(tp=16, pp=8, dp_replicate=8),
                    MEGATRON_2022, 1024)  # fmt: skip
    assert tp16.reason == "tp 16 > 8 GPUs per node"


def test_layout_parsing_names_bad_keys_and_values():
    assert parse_layout("tp=8, pp=8, v=6, fsdp=4, mb=2, rc=selective, cache=off") == Layout(
        tp=8, pp=8, v=6, dp_shard=4, micro_batch=2, recompute="selective", cache=False
    )
    for bad, words in (("tq=2", "KEY one of"), ("tp=0", ">= 1"), ("recompute=some", "allowed")):
        with pytest.raises(ValueError, match=words):
            parse_layout(bad)


def test_plan_prices_and_chooses_the_cp_style():
    """With cp > 1 each style the heads allow is priced (wire bytes per step of the fullest cp
    rank) and the cheapest is the layout's, launched with parallel.cp_ulysses; a Ulysses degree
    the heads or cp refuse is a one-line error naming the key."""
    from depthscale.plan.comm import cp_choice
    from depthscale.plan.report import PlanRequest, run
    from depthscale.shape import ModelShape

    spec = ModelShape.from_config(ModelConfig(dim=1024, n_layers=4, n_heads=16, n_kv_heads=4))
    ask = dict(spec=spec, gpus=8, cluster="h100", seq=32768, batch=8)
    row = run(PlanRequest(**ask, layout="cp=8"))["layouts"][0]
    style = row["cp_style"]
    assert set(style["wire_gb_per_step"]) == {"ring", "hybrid 2×4", "hybrid 4×2", "ulysses"}
    cheapest = min(style["wire_gb_per_step"], key=style["wire_gb_per_step"].get)
    assert style["chosen"] == cheapest != "ring"  # 16 heads over 8 ranks: Ulysses moves less
    assert row["layout"]["ulysses"] == style["ulysses"] and "ulysses=" in row["label"]
    # few heads: only the ring and the degrees that divide them
    two = ModelShape.from_config(ModelConfig(dim=256, n_layers=4, n_heads=2))
    assert set(cp_choice(two, Layout(cp=8), 32768, 8, True)["options"]) == {"ring", "hybrid 2×4"}
    with pytest.raises(ValueError, match=r"--layout: parallel.cp_ulysses=3 must divide .*cp=8"):
        run(PlanRequest(**ask, layout="cp=8,ulysses=3"))


def test_cli_plans_a_config(tmp_path, capsys):
    cfg = tmp_path / "m.toml"
    cfg.write_text("[model]\nvocab_size = 32000\ndim = 1024\nn_layers = 8\nn_heads = 16\n"
                   "residual = 'block'\nattnres_n_blocks = 4\n")  # fmt: skip
    assert main(["plan", "-c", str(cfg), "--gpus", "16", "--seq", "2048", "--batch", "64",
                 "--json"]) == 0  # fmt: skip
    report = json.loads(capsys.readouterr().out)
    assert report["layouts"] and report["layouts"][0]["ok"]
    assert report["model"]["params"] > 0 and report["flops"]["formula"]
    best = report["layouts"][0]
    assert best["wire_gb"] > 0 and best["bytes_per_group_gb"]
    assert main(["plan", "-c", str(cfg), "--gpus", "16", "--layout", "tp=4,pp=2,fsdp=2"]) == 0
    assert "step s" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["--layout", "tp=3"], "not KEY=VALUE|uses 3 GPUs|tp 3"),
        (["--layout", "pp=x"], "integer"),
        (["--cluster", "tpu"], "allowed: a100, h100, h200"),
        (["--framework", "jax"], "allowed: depthscale"),
    ],
)
def test_cli_bad_input_is_one_line(args, words, capsys):
    code = main(["plan", "--gpus", "8", "--model.vocab_size", "256", *args])
    out = capsys.readouterr()
    if code == 1:  # a valid but impossible layout is reported, with exit 1 and the reason
        assert "rejected" in out.out and "rejected (" in out.err
        return
    assert code == 2 and "Traceback" not in out.err
    import re

    assert re.search(words, out.err), out.err


def test_cli_takes_the_vocabulary_from_the_tokenizer(capsys):
    """model.vocab_size 0 (the default) is resolved as training resolves it; a tokenizer that is
    not there is refused as training refuses it."""
    assert main(["plan", "--gpus", "8", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["model"]["vocab"] == 320  # 258 bytes, to 64s
    assert main(["plan", "--gpus", "8", "--data.tokenizer", "/no/tokenizer.json"]) == 2
    assert "data.tokenizer='/no/tokenizer.json': no such file" in capsys.readouterr().err


def test_plan_imports_no_torch():
    """Planning is arithmetic: neither the planner nor the command (which reads the config's
    tokenizer for its vocabulary) pays for torch's import."""
    import subprocess

    code = "import sys, depthscale.plan.report; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)
    code = (
        "import sys; from depthscale.cli import main; "
        "assert main(['plan', '--gpus', '8', '--top', '1']) == 0; "
        "assert 'torch' not in sys.modules, 'torch imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, capture_output=True)


def test_cache_is_what_makes_an_interleaved_70b_layout_fit():
    """Block AttnRes 70B (8 blocks) on 64 H100s: tp=8, pp=4, v=5 keeps every chunk's received
    depth state until its backward; with the cross-stage cache the hops carry only the blocks a
    rank lacks, and the layout fits — without it, it does not."""
    spec = ModelShape(80, 8192, 64, 8, 28672, 128256, residual="block",
                     blocks=tuple(min(i // 20, 7) for i in range(160)), tie_embeddings=False)  # fmt: skip
    w = Workload(spec, 4096, 1024)
    lay = Layout(tp=8, pp=4, v=5, dp_replicate=2, micro_batch=1)
    on = estimate(w, PRESETS["h100"], lay, DEPTHSCALE, 64)
    off = estimate(w, PRESETS["h100"], lay.with_(cache=False), DEPTHSCALE, 64)
    assert on.ok and not off.ok and off.reason.startswith("OOM by")
    assert on.memory["pipeline"] < off.memory["pipeline"]
    assert on.comm["pp"] < off.comm["pp"]


def test_a_pipeline_that_cannot_keep_its_weights_gathered_re_gathers_them():
    """70B on 64 H100s, tp=4, pp=4, fsdp=4: keeping each stage's gathered weights for the step
    (the default under pipelines) runs out of memory; re-gathering them for every micro-batch
    (zero3) fits, at 2·M gathers per step instead of one, and the search offers that twin."""
    spec = ModelShape(80, 8192, 64, 8, 28672, 128256, residual="block",
                     blocks=tuple(min(i // 20, 7) for i in range(160)), tie_embeddings=False)  # fmt: skip
    w = Workload(spec, 4096, 1024)
    keep = estimate(w, PRESETS["h100"], Layout(tp=4, pp=4, dp_shard=4), DEPTHSCALE, 64)
    zero3 = estimate(w, PRESETS["h100"], Layout(tp=4, pp=4, dp_shard=4, zero3=True), DEPTHSCALE, 64)
    assert not keep.ok and keep.reason.startswith("OOM by") and zero3.ok
    assert zero3.memory["transient"] < keep.memory["transient"]
    assert zero3.comm["dp"] > keep.comm["dp"] and zero3.step_s > keep.step_s
    labels = {e.layout.label() for e in search(w, PRESETS["h100"], DEPTHSCALE, 64).ranked}
    assert "tp=4,pp=4,fsdp=4,mb=1,zero3" in labels and "tp=4,pp=4,fsdp=4,mb=1" not in labels
    with pytest.raises(ValueError, match="zero3"):
        parse_layout("tp=4,zero3=maybe")
    bad = estimate(
        w, PRESETS["h100"], Layout(tp=8, pp=4, dp_replicate=2, zero3=True), DEPTHSCALE, 64
    )
    assert not bad.ok and "needs pp > 1 and FSDP" in bad.reason


def test_ring_traffic_shows_in_full_where_it_does_not_overlap():
    """7B at 32k tokens, cp=8 inside a node: behind the attention (depthscale) the ring's K/V
    rotation costs the layer nothing; exposed (gloo: transfers on the cores that compute) it adds
    exactly its transfer time — forward K, V; backward K, V, dK, dV (FSDP's gathers kept
    additive on both sides, so only the ring differs)."""
    import dataclasses

    from depthscale.plan.estimate import _cp_bytes

    spec = ModelShape(32, 4096, 32, 8, 14336, 128256, residual="block",
                     blocks=tuple(i // 8 for i in range(64)))  # fmt: skip
    w, lay, c = Workload(spec, 32768, 64), Layout(cp=8), PRESETS["h100"]
    hidden_fw = dataclasses.replace(DEPTHSCALE, dp_overlap=False)
    exposed_fw = dataclasses.replace(hidden_fw, cp_overlap=False)
    hidden, exposed = (estimate(w, c, lay, fw, 8) for fw in (hidden_fw, exposed_fw))
    assert hidden.ok and exposed.ok and hidden.comm == exposed.comm
    ring = c.op_time("p2p", _cp_bytes(w, lay, 2), 8, False, 3 * 7)
    assert ring > 0
    for part, share in (("layer_forward_s", 1 / 3), ("layer_backward_s", 2 / 3)):
        assert exposed.times[part] - hidden.times[part] == pytest.approx(share * ring, rel=1e-9)
    assert exposed.step_s > hidden.step_s


def test_calibration_fits_and_measured_gemm_curves():
    from depthscale.parallel.calibrate import fit_link

    bw, lat = fit_link([(b, 2e-5 + b / 3e9) for b in (1e3, 1e5, 1e6, 4e6)])
    assert bw == pytest.approx(3e9, rel=1e-9) and lat == pytest.approx(2e-5, rel=1e-6)
    # a descheduled smallest call: the next size up stands in for the latency
    bw, lat = fit_link([(1e3, 5e-3), (1e6, 2e-3), (4e6, 5e-3)])
    assert bw == pytest.approx(1e9) and lat == pytest.approx(1e-3)
    bw, lat = fit_link([(1e3, 5e-3), (1e6, 6e-3), (4e6, 4e-3)])  # both small ones slow: bound
    assert bw == pytest.approx(1e9) and lat == pytest.approx(4e-3)
    c = PRESETS["a100"].__class__(
        **{**PRESETS["a100"].to_json(), "gemm_curve": ((32, 0.5), (512, 0.9))}
    )
    assert c.gemm_flops("bfloat16", 16) == pytest.approx(0.5 * 312e12)
    assert c.gemm_flops("bfloat16", 128) == pytest.approx(0.7 * 312e12)  # halfway in log x
    assert c.gemm_flops("bfloat16", 4096) == pytest.approx(0.9 * 312e12)


def test_calibration_takes_each_rate_from_the_slowest_rank():
    from depthscale.parallel.calibrate import _slowest

    fast = {"gemm_samples": [(64.0, 100.0), (256.0, 200.0)], "peak": 200.0,
            "attention_efficiency": 0.5, "memory_bw": 8.0}  # fmt: skip
    slow = {"gemm_samples": [(64.0, 120.0), (256.0, 150.0)], "peak": 150.0,
            "attention_efficiency": 0.4, "memory_bw": 9.0}  # fmt: skip
    out = _slowest([fast, slow])
    assert out["gemm_samples"] == [(64.0, 100.0), (256.0, 150.0)] and out["peak"] == 150.0
    assert out["curve"] == [(64.0, pytest.approx(100 / 150)), (256.0, 1.0)]
    assert out["attention_efficiency"] * out["peak"] == pytest.approx(60.0)  # slow: 0.4 × 150
    assert out["memory_bw"] == 8.0


def test_calibration_times_shapes_in_interleaved_rounds():
    from depthscale.parallel.calibrate import _interleaved_medians

    order: list[str] = []
    seconds = _interleaved_medians(
        {"a": lambda: order.append("a"), "b": lambda: order.append("b")}, 0.0
    )
    assert set(seconds) == {"a", "b"} and all(t >= 0 for t in seconds.values())
    assert order[:2] == ["a", "b"] and order[2:] == ["a", "b"] * ((len(order) - 2) // 2)
    assert len(order) >= 2 + 2 * 5  # a warm-up call each, then at least five rounds


def test_calibration_samples_short_calls_over_a_window():
    """With more ranks than cores a call shorter than a time slice reads a whole core; a window
    of back-to-back calls reads the share a rank gets. The result stays seconds per call."""
    from depthscale.parallel.calibrate import _interleaved_medians

    calls = []

    def nap() -> None:
        calls.append(1)
        time.sleep(0.002)

    seconds = _interleaved_medians({"nap": nap}, 0.0, window_s=0.1)
    assert len(calls) >= 1 + 5 * 2  # the warm-up call sets the count: at least two per sample
    assert 0.002 <= seconds["nap"] < 0.1


def test_collectives_are_charged_what_they_add_between_bursts_of_compute(monkeypatch):
    """A collective is timed as a step meets it: each call after a burst of compute, and charged
    what the loop of both takes over the loop of the bursts alone (a clock the calls advance
    makes the arithmetic exact); a call that reads as free costs a microsecond, not less."""
    from depthscale.parallel import calibrate

    clock = [0.0]
    calls: list[str] = []

    def work(name: str, seconds: float):
        def fn() -> None:
            calls.append(name)
            clock[0] += seconds

        return fn

    monkeypatch.setattr(calibrate.time, "perf_counter", lambda: clock[0])
    costs = calibrate._costs_after_compute(
        {"op": work("op", 0.25), "free": work("free", 0.0)},
        work("burst", 1.0),
        rounds=3,
        calls=4,
        before=work("barrier", 7.0),  # outside the timed loops
    )
    assert costs == {"op": pytest.approx(0.25), "free": 1e-6}
    round_ = ["barrier", *["burst"] * 4]
    for name in ("op", "free"):
        round_ += ["barrier", *[name_ for _ in range(4) for name_ in ("burst", name)]]
    assert calls == round_ * 3


def test_cli_calibrate_needs_a_path_it_can_write(tmp_path, capsys):
    (tmp_path / "file").write_text("mine\n")  # its missing parents would be made, as for any output
    assert main(["plan", "--calibrate", str(tmp_path / "file" / "c.json")]) == 2
    assert "because '" + str(tmp_path / "file") + "' is a file" in capsys.readouterr().err
    assert main(["plan", "--model.vocab_size", "256"]) == 2
    assert "--gpus" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("text", "words"),
    [
        ("not json", "not a readable JSON"),
        ("[1, 2]", "a JSON object"),
        ('{"peak_flops": 5}', "peak_flops must map"),
        ('{"peak_flops": {"float32": 1e11}, "hbm_bytes": 1e9}', "hbm_bw must be a number"),
    ],
)
def test_a_damaged_calibration_file_is_named(tmp_path, capsys, text, words):
    bad = tmp_path / "cluster.json"
    bad.write_text(text)
    assert main(["plan", "--gpus", "2", "--model.vocab_size", "256", "--cluster", str(bad)]) == 2
    err = capsys.readouterr().err
    assert words in err and str(bad) in err and "Traceback" not in err


def test_long_context_searches_cp_beyond_eight(monkeypatch):
    """cp is bounded by the sequence and the mesh (`max_cp`), not a constant: a 7B model at 256K
    tokens, 4 sequences on 1024 GPUs, fits only with more than 8-way context parallelism — the
    search finds cp = 32, where a cap of 8 (what it had) finds no layout at all; a short sequence
    is not cut finer than 256 tokens per rank."""
    from depthscale.plan import search as planner

    assert planner.max_cp(262144) == 1024 and planner.max_cp(2048) == 8
    assert planner.max_cp(100) == 1
    spec = ModelShape(32, 4096, 32, 8, 14336, 128256)
    w = Workload(spec, 262144, 4)
    result = search(w, PRESETS["h100"], DEPTHSCALE, 1024)
    assert result.ranked and min(e.layout.cp for e in result.ranked) > 8
    monkeypatch.setattr(planner, "max_cp", lambda seq: 8)
    assert not search(w, PRESETS["h100"], DEPTHSCALE, 1024).ranked
    monkeypatch.undo()
    short = search(Workload(spec, 1024, 512), PRESETS["h100"], DEPTHSCALE, 64)
    assert max(e.layout.cp for e in short.ranked + short.rejected) <= planner.max_cp(1024) == 4


def test_gradient_reduction_dtype_is_a_setting_of_the_framework():
    """A small model at large data-parallel degree under Megatron: its un-overlapped fp32
    all-reduce is a large share of the step, and reducing in bf16 halves those bytes (and its
    gradient buffer); depthscale keeps fp32 gradients and halves only the reduce-scatter."""
    spec = ModelShape(24, 2304, 24, 24, 9216, 51200)
    w, c, lay = Workload(spec, 2048, 1024), PRESETS["h100"], Layout(dp_replicate=256, micro_batch=4)
    fp32, bf16 = (estimate(w, c, lay, MEGATRON_2022.with_reduce_dtype(d), 256)
                  for d in ("float32", "bfloat16"))  # fmt: skip
    assert bf16.comm["dp"] == pytest.approx(fp32.comm["dp"] / 2)
    assert bf16.step_s < fp32.step_s and bf16.memory["grads"] < fp32.memory["grads"]
    ours = DEPTHSCALE.with_reduce_dtype("bfloat16")
    assert ours.grad_bytes == DEPTHSCALE.grad_bytes and ours.reduce_bytes == 2
    with pytest.raises(ValueError, match="allowed: float32, bfloat16"):
        DEPTHSCALE.with_reduce_dtype("float16")


def test_the_table_names_assumed_efficiencies_and_rejected_throughput(capsys):
    main(["plan", "--gpus", "8", "--cluster", "h100", "--model.dim", "4096",
          "--model.n_layers", "32", "--model.n_heads", "32", "--data.seq_len", "4096",
          "--train.batch_size", "64", "--grad-reduce-dtype", "bfloat16", "--top", "50"])  # fmt: skip
    out = capsys.readouterr().out
    assert "efficiencies assumed: gemm 0.72" in out and "gradients reduced in bfloat16" in out
    assert re.search(r"OOM by [\d.]+ GiB \(would run [\d.]+ s/step, \d+ tok/s\)", out), out
    assert "--parallel.grad_reduce_dtype bfloat16" in out
