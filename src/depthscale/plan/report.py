"""`depthscale plan`: the readable table and the JSON of a search or of one layout."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass

from depthscale.plan import goodput
from depthscale.plan.comm import (
    cp_choice,
    cp_style,
    dim_sizes,
    muon_payload,
    rank_payload,
    wire_bytes,
)
from depthscale.plan.estimate import Estimate, Workload, estimate
from depthscale.plan.frameworks import FRAMEWORKS, Framework
from depthscale.plan.hardware import Cluster, cluster
from depthscale.plan.layout import Layout, parse_layout
from depthscale.plan.memory import rank_params
from depthscale.plan.muon_states import MuonPlan, muon_plan
from depthscale.plan.search import SIMULATED, search
from depthscale.shape import ModelShape
from depthscale.shape.muon import NS_STEPS
from depthscale.shape.ulysses import ulysses_problem

GiB = 2**30


@dataclass
class PlanRequest:
    spec: ModelShape
    gpus: int
    cluster: str
    seq: int
    batch: int
    dtype: str = "bfloat16"
    framework: str = "depthscale"
    layout: str | None = None
    top: int = 10
    tokens: float = 0.0
    grad_reduce_dtype: str = "float32"
    """The dtype the data-parallel gradient reduction moves (the framework's setting)."""
    failures_per_day: float | None = None
    """Failures a day of the whole job (None: Llama 3's rate scaled to `gpus`: plan.goodput)."""
    memory_recoverable: float = goodput.MEMORY_RECOVERABLE
    """The share of failures the memory tier survives."""
    intervals: tuple[int, int] | None = None
    """The config's (checkpoint.snapshot_every, checkpoint.every) in steps: their goodput too."""
    optimizer: str = "adamw"
    """The config's optim.name: 'muon' plans its states, redistribution and Newton–Schulz."""
    muon_ns_steps: int = NS_STEPS
    qk_clip_tau: float = 0.0
    """The config's optim.qk_clip_tau: above 0, layouts with context parallelism are rejected."""


def run(req: PlanRequest) -> dict:
    """Evaluate the request; raises ValueError with a message naming bad input."""
    _check_request(req)
    per_day = req.failures_per_day or goodput.failures_per_day(req.gpus)
    goodput.check_failures(per_day, req.memory_recoverable)
    rows = _Rows(req)
    w, c, fw = rows.w, rows.c, rows.fw
    header = _header(req, c, fw.name)
    started = time.perf_counter()
    if req.layout:
        asked = parse_layout(req.layout)
        s = req.spec
        problem = ulysses_problem(s.n_heads, s.kv_heads, asked.tp, asked.cp, asked.ulysses)
        if problem:
            raise ValueError(f"--layout: {problem}")
        est = estimate(w, c, asked, fw, req.gpus, muon=rows.plan_for(asked))
        return {
            **header,
            "seconds": time.perf_counter() - started,
            "layouts": [rows.row(est)],
            **_goodput(req, c, fw, [est], per_day),
        }
    # every row shown is simulated: past the simulated few the closed form would rank them
    muon = rows.plan_for if rows.muon else None  # Muon's states decide what fits, its NS the rank
    result = search(w, c, fw, req.gpus, simulated=max(SIMULATED, req.top), muon=muon)
    reasons: dict[str, int] = {}
    for e in result.rejected:
        key = e.reason.split(" by ")[0] if e.reason.startswith("OOM") else e.reason
        reasons[key] = reasons.get(key, 0) + 1
    return {
        **header,
        "seconds": time.perf_counter() - started,
        "considered": result.considered,
        "fitting": len(result.ranked),
        "layouts": [rows.row(e) for e in result.ranked[: req.top]],
        "rejected_examples": [_row(e, req) for e in _examples(result.rejected)],
        "rejected_by_reason": dict(sorted(reasons.items(), key=lambda kv: -kv[1])),
        **_goodput(req, c, fw, result.ranked, per_day),
    }


def _check_request(req: PlanRequest) -> None:
    """What the request asks that the planner cannot model, as one ValueError naming it."""
    if req.gpus < 1:
        raise ValueError(f"--gpus {req.gpus} must be >= 1")
    if req.framework not in FRAMEWORKS:
        raise ValueError(f"--framework {req.framework!r}; allowed: {', '.join(FRAMEWORKS)}")
    fw = FRAMEWORKS[req.framework]
    if req.spec.moe and not fw.ours:
        raise ValueError(
            f"--framework {req.framework} models the published dense GPT runs, not an MoE model "
            f"({req.spec.n_experts} experts per MoE layer); allowed: --framework depthscale"
        )
    if req.optimizer == "muon" and not (fw.ours and req.spec.family == "llama"):
        raise ValueError(
            f"optim.name muon is planned for --framework depthscale and depthscale's own model, "
            f"not {fw.name} / family {req.spec.family!r}"
        )


class _Rows:
    """The report's row of a layout: the estimate's numbers, and for depthscale's own model the
    optimizer it runs (Muon's numbers), the context-parallel style, the bytes per group and
    what the cross-stage cache saves."""

    def __init__(self, req: PlanRequest) -> None:
        self.req = req
        self.c = cluster(req.cluster)
        self.fw = FRAMEWORKS[req.framework].with_reduce_dtype(req.grad_reduce_dtype)
        self.w = Workload(req.spec, req.seq, req.batch, req.dtype, req.qk_clip_tau > 0)
        self.muon = req.optimizer == "muon"
        self._muon_plans: dict[tuple, MuonPlan | str] = {}

    def row(self, e: Estimate) -> dict:
        req, fw = self.req, self.fw
        muon = None
        if self.muon and e.ok:
            e, muon = self._with_muon(e)
        out = _row(e, req)
        if muon is not None:
            out["muon"] = muon
        lay = e.layout
        if e.ok and fw.ours and lay.cp > 1:
            lay = self._cp_style(lay, out)
        if e.ok and fw.ours and req.spec.family == "llama":
            payload = rank_payload(
                req.spec, lay, req.seq, req.batch, req.dtype == "bfloat16",
                reduce_bytes=fw.reduce_bytes,
            )  # fmt: skip
            if muon and "redistribution_bytes" in muon:
                payload += muon_payload(lay, muon["redistribution_bytes"])
            out["bytes_per_group_gb"] = {
                f"{op} {grp}": b / 1e9 for (op, grp), b in sorted(payload.items()) if b
            }
            out["wire_gb"] = wire_bytes(payload, dim_sizes(lay)) / 1e9
        if e.ok and e.layout.cache and e.layout.pp > 1 and req.spec.attnres:
            off = estimate(self.w, self.c, e.layout.with_(cache=False), fw, req.gpus)
            out["cache_saves_gib"] = (off.peak_bytes - e.peak_bytes) / GiB
            out["fits_without_cache"] = off.ok
        return out

    def _cp_style(self, lay: Layout, out: dict) -> Layout:
        """Ring, Ulysses or hybrid, whichever moves the fewest bytes; a layout that did not set
        its Ulysses degree takes the planner's choice (and its launch flag)."""
        req = self.req
        choice = cp_choice(req.spec, lay, req.seq, req.batch, req.dtype == "bfloat16")
        if lay.ulysses == 1:  # not set by the layout asked for: the planner's choice
            lay = lay.with_(ulysses=choice["ulysses"])
            out["label"], out["layout"] = lay.label(), lay.to_json()
        out["cp_style"] = {
            "chosen": choice["chosen"] if lay.ulysses == choice["ulysses"] else cp_style(lay),
            "ulysses": lay.ulysses,
            "wire_gb_per_step": {k: b / 1e9 for k, b in choice["options"].items()},
        }
        return lay

    def _muon_of(self, lay: Layout) -> MuonPlan | str:
        """`muon_plan`, once per placement of the parameters (rows often share one); where Muon's
        model does not cover the layout, why."""
        key = (lay.tp, lay.pp, lay.v, lay.ends, lay.cp, lay.dp_shard, lay.ep)
        if key not in self._muon_plans:
            placed = Layout(tp=lay.tp, pp=lay.pp, v=lay.v, ends=lay.ends, cp=lay.cp,
                            dp_shard=lay.dp_shard, ep=lay.ep)  # fmt: skip
            try:
                self._muon_plans[key] = muon_plan(
                    self.req.spec, placed, ns_steps=self.req.muon_ns_steps
                )
            except ValueError as err:
                self._muon_plans[key] = str(err)
        return self._muon_plans[key]

    def plan_for(self, lay: Layout) -> MuonPlan | None:
        """The Muon plan a layout is estimated (and searched) with: None without Muon, or for a
        layout of the search Muon's model does not cover (AdamW's estimate; its row says why);
        for the one asked for with --layout that is a one-line error."""
        if not self.muon:
            return None
        m = self._muon_of(lay)
        if isinstance(m, str):
            if self.req.layout:
                raise ValueError(f"--layout {self.req.layout} with optim.name muon: {m}")
            return None
        return m

    def _with_muon(self, e: Estimate) -> tuple[Estimate, dict]:
        """Muon's numbers of a layout the search (or --layout) estimated with Muon; a layout of
        the search that Muon's model does not cover kept AdamW's estimate and says why."""
        m = self._muon_of(e.layout)
        if isinstance(m, str):
            return e, {"not_modelled": m}
        return e, {
            "optimizer_gb": m.optimizer_bytes / 1e9,
            "redistribution_bytes": m.sent_bytes,
            "ns_flops": m.ns_flops,
            "ns_s": e.times["muon_ns_s"],
            "all_to_all_s": e.times["muon_all_to_all_s"],
        }


def _goodput(
    req: PlanRequest, c: Cluster, fw: Framework, ranked: list[Estimate], per_day: float
) -> dict:
    """The goodput of the first layout that fits under failures (plan.goodput): its fullest
    rank's checkpointed state (fp32 weights and moments) through the cluster's bandwidths."""
    best = next((e for e in ranked if e.ok), None)
    if best is None or not fw.ours:
        return {}
    per_param = fw.weight_bytes + fw.master_bytes + fw.moment_bytes
    rank_bytes = rank_params(req.spec, best.layout).states(best.layout) * per_param
    bw = goodput.Bandwidths(
        snapshot=min(c.snapshot_bw, c.host_bw),
        host=min(c.memory_read_bw, c.host_bw),
        storage=c.storage_bw,
        verify=min(c.verify_bw, c.storage_bw * c.gpus_per_node),
        restart_s=c.restart_s,
    )
    memory, storage = goodput.costs(rank_bytes, req.spec.params() * per_param, bw)
    out = goodput.plan(memory, storage, best.step_s, per_day, req.memory_recoverable, req.intervals)
    return {"goodput": {"layout": best.layout.label(), "rank_state_gb": rank_bytes / 1e9, **out}}


def _examples(rejected: list[Estimate]) -> list[Estimate]:
    """One rejected layout per reason (the nearest to fitting for OOM)."""
    seen: dict[str, Estimate] = {}
    for e in sorted(rejected, key=lambda e: e.peak_bytes if e.memory else 0):
        key = "OOM" if e.reason.startswith("OOM") else e.reason
        seen.setdefault(key, e)
    return list(seen.values())[:8]


def _header(req: PlanRequest, c: Cluster, fw: str) -> dict:
    s = req.spec
    return {
        "model": {
            "name": s.name,
            "family": s.family,
            "params": s.params(),
            "layers": s.n_layers,
            "dim": s.dim,
            "heads": s.n_heads,
            "kv_heads": s.kv_heads,
            "ffn": s.ffn_dim,
            "vocab": s.vocab,
            "residual": s.residual,
            "blocks": s.n_blocks - 1 if s.attnres else 0,
            **(_moe_header(s) if s.moe else {}),
        },
        "gpus": req.gpus,
        "cluster": c.name,
        "framework": fw,
        "seq": req.seq,
        "batch": req.batch,
        "dtype": req.dtype,
        "grad_reduce_dtype": req.grad_reduce_dtype,
        "efficiencies": c.efficiencies(),
        "flops": {
            "formula": s.flop_formula(),
            "model_flops_per_sequence": s.model_flops(req.seq),
            "model_flops_per_token": s.model_flops_per_token(req.seq),
            "peak_flops_per_gpu": c.peak(req.dtype),
            "mfu": "model FLOPs (no recompute) per second / (GPUs × peak)",
            "hfu": "the same with recomputed FLOPs counted",
        },
    }


def _moe_header(s: ModelShape) -> dict:
    return {
        "active_params": s.active_params(),
        "moe": {
            "experts": s.n_experts,
            "top_k": s.moe_top_k,
            "shared": s.moe_shared,
            "expert_ffn": s.moe_ffn,
            "layers": len(s.moe_layers),
        },
    }


def _count(n: float) -> str:
    """A parameter count as people write it: 1.04B, 0.78M (not 0.000779B)."""
    return f"{n / 1e9:.3g}B" if n >= 1e9 else f"{n / 1e6:.3g}M"


def _model_line(m: dict) -> str:
    line = f"{m['name'] or 'model'}: {_count(m['params'])} params"
    if "moe" in m:
        moe = m["moe"]
        shared = f" + {moe['shared']} shared" if moe["shared"] else ""
        line += (
            f" ({_count(m['active_params'])} active: top-{moe['top_k']} of {moe['experts']} "
            f"experts{shared} in {moe['layers']} layers)"
        )
    line += (
        f", {m['layers']} layers, d={m['dim']}, {m['heads']} heads ({m['kv_heads']} kv), "
        f"residual={m['residual']}"
    )
    return line + (f" ({m['blocks']} blocks)" if m["blocks"] else "")


def _row(e: Estimate, req: PlanRequest) -> dict:
    row = e.to_json()
    if req.tokens and e.ok:
        row["days"] = e.days(req.tokens)
    return row


def _would_run(row: dict) -> str:
    """A rejected layout's predicted speed, where it was estimated before it was found not to
    fit (out of memory): what fitting it would be worth."""
    if not row.get("tokens_per_s"):
        return ""
    return f" (would run {row['step_s']:.3f} s/step, {row['tokens_per_s']:.0f} tok/s)"


def _efficiency_words(e: dict) -> str:
    return ", ".join(f"{k.removesuffix('_efficiency')} {v['value']:.2g}" for k, v in e.items())


def _efficiency_line(efficiencies: dict) -> str:
    """Which efficiencies are measured and which assumed (a GPU run or --calibrate measures)."""
    parts = []
    for source in ("measured", "assumed"):
        chosen = {k: v for k, v in efficiencies.items() if v["source"] == source}
        if chosen:
            parts.append(f"{source}: {_efficiency_words(chosen)}")
    return "efficiencies " + "; ".join(parts)


def _muon_words(m: dict) -> str:
    if "not_modelled" in m:
        return f"optimizer: muon not modelled here ({m['not_modelled']}; AdamW's estimate)"
    return (
        f"optimizer: muon, NS {m['ns_s'] * 1e3:.3g} ms, redistribution "
        f"{m['redistribution_bytes'] / 1e9:.3g} GB in {m['all_to_all_s'] * 1e3:.3g} ms, "
        f"states {m['optimizer_gb']:.3g} GB"
    )


def format_table(report: dict) -> str:
    m = report["model"]
    lines = [
        _model_line(m),
        f"{report['gpus']} × {report['cluster']} GPUs, {report['framework']}, seq {report['seq']}, "
        f"batch {report['batch']} sequences, {report['dtype']}, gradients reduced in "
        f"{report['grad_reduce_dtype']}",
        _efficiency_line(report["efficiencies"]),
        f"FLOPs: {report['flops']['formula']}; peak {report['flops']['peak_flops_per_gpu'] / 1e12:.3g}"
        " TFLOP/s per GPU",
    ]
    if "considered" in report:
        lines.append(
            f"{report['considered']} layouts considered, {report['fitting']} fit "
            f"({report['seconds']:.2f} s)"
        )
    lines.append("")
    head = f"{'layout':44s} {'step s':>8s} {'MFU':>6s} {'HFU':>6s} {'tok/s':>10s} {'bubble':>7s} {'mem GiB':>8s}"
    if any("days" in r for r in report["layouts"]):
        head += f" {'days':>7s}"
    lines.append(head)
    for r in report["layouts"]:
        if not r["ok"]:
            lines.append(f"{r['label']:44s} rejected{_would_run(r)}: {r['reason']}")
            continue
        line = (
            f"{r['label']:44s} {r['step_s']:8.3f} {r['mfu'] * 100:5.1f}% {r['hfu'] * 100:5.1f}% "
            f"{r['tokens_per_s']:10.0f} {r['bubble'] * 100:6.1f}% {r['peak_gib']:8.1f}"
        )
        if "days" in r:
            line += f" {r['days']:7.2f}"
        if r.get("fits_without_cache") is False:
            line += "  (fits only with the AttnRes cache)"
        if "cp_style" in r:  # the CP style and each option's wire bytes per step (cp ranks)
            c = r["cp_style"]
            options = ", ".join(f"{k} {gb:.3g} GB" for k, gb in c["wire_gb_per_step"].items())
            line += f"  cp: {c['chosen']} ({options})"
        if "muon" in r:
            line += "  " + _muon_words(r["muon"])
        lines.append(line)
    if report.get("rejected_examples"):
        lines += ["", "rejected (one example per reason; counts below):"]
        lines += [
            f"  {r['label']:44s} {r['reason']}{_would_run(r)}" for r in report["rejected_examples"]
        ]
        counts = list(report["rejected_by_reason"].items())
        lines += [f"  {n:6d} × {reason}" for reason, n in counts[:8]]
        if len(counts) > 8:
            lines.append(f"  ... {len(counts) - 8} more reasons (--json lists them)")
    if report.get("goodput"):
        g = report["goodput"]
        lines += ["", f"{g['layout']}: {g['rank_state_gb']:.3g} GB of state per rank"]
        lines += goodput.lines(g)
    launch = report.get("launch")
    if launch:
        where = (
            f"on each of the {launch['nodes']} nodes (RANK 0..{launch['nodes'] - 1}, HOST: node "
            "0's address)"
            if launch["nodes"] > 1
            else "on one node"
        )
        lines += ["", f"train {launch['layout']} {where}:", f"  {launch['command']}"]
    return "\n".join(lines)


def to_json(report: dict) -> str:
    return json.dumps(report, indent=1, default=float)
