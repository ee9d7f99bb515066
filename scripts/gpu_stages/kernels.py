"""Stage kernels: the Triton AttnRes kernels at production shapes against the PyTorch ops.

Per case (d, S queries, m sources, N tokens, bf16 sources, fp32 queries), one line with:
- the error against the PyTorch ops run in fp32 on the same (upcast) values, forward (outputs,
  log-sum-exps) and backward (source and query gradients), as ‖got − want‖ / ‖want‖, checked at
  N_ERR tokens so that the reference stays cheap at d = 8192, S = 32;
- first-call seconds forward and backward: the first case of each new kernel variant includes its
  compile (the stage's Triton cache starts empty);
- median fwd and fwd+bwd milliseconds from CUDA events, bwd = their difference;
- GB/s over the fewest bytes each pass must move (every input read once, every output written
  once) and that as a fraction of a device-to-device copy measured in the same stage.

Bounds, for bf16 storage (2^-9 relative rounding per element; Triton may take logits through
tf32 dots): outputs 1e-2, log-sum-exps 1e-3, gradients 2e-2 — about five times what a correct
kernel shows, far below what a wrong index or a race gives (order 1).

Goals (docs/gpu.md), judged at d = 4096 and 8192, which run first: `fwd_of_copy` ≥ 0.80 and
`bwd_of_copy` ≥ 0.65. With `benchmarks/attnres_traffic.py` present, its expected fractions
(`traffic(d, S, m)`) sit beside the measured ones (`traffic_model`). After the first case,
`graph_read` replays that read under `torch.cuda.graph`.

The last lines list every compiled kernel variant with its registers, spills and shared memory
(from Triton's own metadata), the device memory used outside torch's allocator (local-memory
spills make the driver reserve it: ~12 GB for the 43 KB/thread variant the brief found), and the
MoE experts' grouped GEMM.
"""

from __future__ import annotations

import contextlib
import sys
from typing import Any

import torch

from gpu_stages.common import (
    REPO,
    Context,
    OutOfBounds,
    Skipped,
    copy_gbps,
    goal,
    max_abs,
    one_line,
    rel_err,
    seconds_of,
    sig,
    time_ms,
    within,
)

EPS = 1e-6
DTYPE = torch.bfloat16
BOUNDS = {"out": 1e-2, "lse": 1e-3, "grads": 2e-2}
REAL = {"dims": (4096, 8192, 2048), "queries": (1, 8, 16, 32), "sources": (4, 16),
        "B": 4, "T": 2048, "n_err": 1024, "warmup": 3, "reps": 10}  # fmt: skip
DRY = {"dims": (64,), "queries": (1, 3), "sources": (3,),
       "B": 2, "T": 4, "n_err": 8, "warmup": 1, "reps": 2}  # fmt: skip


def run(ctx: Context) -> None:
    shapes = DRY if ctx.dry_run else REAL
    try:
        from depthscale.kernels import attnres_triton  # noqa: F401
    except ImportError as err:
        ctx.emit("triton", status="failed", error=f"depthscale.kernels.attnres_triton: {err}")
        return
    copy = ctx.measure(
        "copy", lambda: {"gb_per_s": sig(copy_gbps(ctx, 2**30 if ctx.cuda else 2**22))}
    )
    gbps = copy["gb_per_s"] if copy else None
    traffic = traffic_model()
    # the dimensions the goals are set at come first (REAL's order): a stage cut short by its
    # time has judged them
    cases = [(d, S, m) for d in shapes["dims"] for S in shapes["queries"]
             for m in shapes["sources"]]  # fmt: skip
    last_d = None
    for d, S, m in cases:
        if d != last_d:
            if last_d is not None:
                ctx.measure(f"memory after d={last_d}", lambda: memory(ctx))
            ctx.measure(f"merge d={d}", lambda d=d: merge_case(ctx, shapes, d, gbps))
            last_d = d
        if ctx.time_left() < 12:
            ctx.emit(f"read d={d} S={S} m={m}", status="skipped",
                     error=f"{ctx.time_left():.0f} s left in the stage")  # fmt: skip
            continue
        ctx.measure(f"read d={d} S={S} m={m}", lambda d=d, S=S, m=m: read_case(
            ctx, shapes, d, S, m, gbps, traffic))  # fmt: skip
        if (d, S, m) == cases[0]:  # its variant is compiled and warm now
            ctx.measure("graph_read", lambda d=d, S=S, m=m: graph_read(ctx, shapes, d, S, m))
    ctx.measure(f"memory after d={last_d}", lambda: memory(ctx))
    ctx.measure("compiled_variants", variants)
    ctx.measure("moe_grouped_mm", lambda: moe_grouped_mm(ctx))


GOAL_DIMS = (4096, 8192)
GOAL_FWD, GOAL_BWD = 0.80, 0.65
"""Goals for the first GPU run (docs/gpu.md): the read at these widths moves its minimal bytes at
≥ 0.80 (forward) and ≥ 0.65 (backward) of the measured device copy's rate."""


def traffic_model():
    """`benchmarks/attnres_traffic.py`'s `traffic(d, S, m, N=)` (its model of the kernels' HBM
    bytes, from their launch plans): a function of (d, S, m, N) giving the fractions of bandwidth
    it expects forward and backward, put beside the measured ones; None while that file does not
    exist. A model that cannot run says why in its place: it is an aid to reading, and never fails
    the measurement."""
    import importlib.util

    path = REPO / "benchmarks" / "attnres_traffic.py"
    if not path.exists():
        return None

    def expected(d: int, S: int, m: int, N: int) -> dict[str, Any]:
        try:
            spec = importlib.util.spec_from_file_location("attnres_traffic", path)
            module = importlib.util.module_from_spec(spec)
            sys.modules["attnres_traffic"] = module  # its dataclasses look themselves up there
            spec.loader.exec_module(module)
            model = module.traffic(d, S, m, N=N)
            return {f"{p}_of_copy": model[k]["expected_bandwidth_fraction"]
                    for p, k in (("fwd", "forward"), ("bwd", "backward"))}  # fmt: skip
        except Exception as err:  # noqa: BLE001 - see the docstring
            return {"error": one_line(err, 200)}

    return expected


def graph_read(ctx: Context, shapes: dict, d: int, S: int, m: int) -> dict:
    """The fused read forward captured once under `torch.cuda.graph` and replayed on new inputs
    copied into the captured buffers (what a CUDA-graphed step does): equal to the eager read on
    those inputs, bitwise (the same kernels on the same data), and its replay's milliseconds
    against eager's (the launches the graph saves). The address table is written on the device
    by a kernel (no host buffer), so capture works. The dry run has no CUDA graphs: a stand-in
    "captures" by keeping the call and "replays" it, so the buffer handling runs the same."""
    from depthscale.kernels.attnres_triton import triton_multi_query_read

    gen = torch.Generator(ctx.device).manual_seed(7)
    B, T = shapes["B"], shapes["T"]
    q = torch.randn(S, d, generator=gen, device=ctx.device) * d**-0.5
    srcs = [torch.randn(B, T, d, generator=gen, device=ctx.device).to(DTYPE) for _ in range(m)]

    def read():
        with torch.no_grad():
            return triton_multi_query_read(srcs, q, EPS)

    read()  # compiled and warm before capture (a capture must not compile)
    ctx.sync()
    if ctx.cuda:
        graph = torch.cuda.CUDAGraph()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            read()  # torch's recipe: one warm call on the capture stream
        torch.cuda.current_stream().wait_stream(stream)
        with torch.cuda.graph(graph):
            static = read()
        replay = graph.replay
    else:
        static = read()

        def replay():  # the dry run's stand-in: the kept call, its outputs into the "captured" ones
            for kept, new in zip(static, read()):
                kept.copy_(new)

    for t in [q, *srcs]:  # new inputs, in place: the graph reads the captured addresses
        t.copy_(torch.randn(t.shape, generator=gen, device=ctx.device).to(t.dtype))
    replay()
    ctx.sync()
    want = read()
    same = all(torch.equal(a, b) for a, b in zip(static, want))
    values = {"d": d, "S": S, "m": m, "captured": ctx.cuda, "replay_equals_eager": same,
              "replay_ms": sig(time_ms(ctx, replay, 2, 10)),
              "eager_ms": sig(time_ms(ctx, read, 2, 10))}  # fmt: skip
    if not same:
        worst = max(rel_err(a.float(), b.float()) for a, b in zip(static, want))
        values["rel_err"] = sig(worst, 3)
        raise OutOfBounds(f"the replayed read differs from the eager one (rel {worst:.2e})", values)
    return values


def _randn(ctx: Context, gen: torch.Generator, *shape: int, scale: float = 1.0,
           dtype: torch.dtype = torch.float32) -> torch.Tensor:  # fmt: skip
    t = torch.randn(*shape, generator=gen, device=ctx.device) * scale
    return t.to(dtype).requires_grad_()


def _reference(call, args: list[torch.Tensor], upstream: list[torch.Tensor]):
    """`call(leaves)` on the PyTorch ops (no Triton, no C++ CPU kernels), in fp32 on fp32 copies
    of `args`: its outputs and the gradients of those copies for `upstream`."""
    from depthscale import kernels

    leaves = [t.detach().float().clone().requires_grad_() for t in args]
    with kernels.use_triton(False), kernels.use_cpu_kernels(False):
        outs = call(leaves)
    outs = outs if isinstance(outs, tuple) else (outs,)
    grads = torch.autograd.grad(outs, leaves, [u.float() for u in upstream])
    return [o.detach() for o in outs], grads


def _errors(outs, ref_outs, grads, ref_grads, names: tuple[str, ...]) -> dict[str, Any]:
    """‖got − want‖ / ‖want‖ per output and the worst over the gradients (what the bounds
    judge), and the largest absolute difference of each output."""
    rel = {name: rel_err(got, want) for name, got, want in zip(names, outs, ref_outs)}
    rel["grads"] = max(rel_err(g, w) for g, w in zip(grads, ref_grads))
    biggest = {name: sig(max_abs(got, want), 3) for name, got, want in zip(names, outs, ref_outs)}
    return {"rel_err": {k: sig(v, 4) for k, v in rel.items()}, "max_abs_err": biggest}


def _check(values: dict[str, Any]) -> dict[str, Any]:
    errors = values["rel_err"]
    over = [f"{k} {v:.2e} > {BOUNDS[k]:.0e}" for k, v in errors.items() if not within(v, BOUNDS[k])]
    if over:
        raise OutOfBounds("error above its bound: " + "; ".join(over), values)
    return values


def _timings(ctx, shapes, fn, args, upstream, fwd_bytes, bwd_bytes, gbps) -> dict[str, Any]:
    """First-call seconds, then median ms of fwd and fwd+bwd, and bandwidths."""

    def fwd():
        with torch.no_grad():
            return fn()

    def fwd_bwd():
        outs = fn()
        outs = outs if isinstance(outs, tuple) else (outs,)
        return torch.autograd.grad(outs, args, upstream)

    first_fwd, _ = seconds_of(ctx, fwd)
    first_all, _ = seconds_of(ctx, fwd_bwd)
    fwd_ms = time_ms(ctx, fwd, shapes["warmup"], shapes["reps"])
    all_ms = time_ms(ctx, fwd_bwd, shapes["warmup"], shapes["reps"])
    bwd_ms = max(all_ms - fwd_ms, 1e-6)
    values = {
        "first_fwd_s": round(first_fwd, 3),
        "first_bwd_s": round(max(first_all - first_fwd, 0.0), 3),
        "fwd_ms": sig(fwd_ms),
        "bwd_ms": sig(bwd_ms),
        "fwd_gb_per_s": sig(fwd_bytes / (fwd_ms * 1e-3) / 1e9),
        "bwd_gb_per_s": sig(bwd_bytes / (bwd_ms * 1e-3) / 1e9),
    }
    if gbps:
        values["fwd_of_copy"] = sig(values["fwd_gb_per_s"] / gbps, 3)
        values["bwd_of_copy"] = sig(values["bwd_gb_per_s"] / gbps, 3)
    return values


def read_case(
    ctx: Context, shapes: dict, d: int, S: int, m: int, gbps: float | None, traffic=None
) -> dict:
    from depthscale.kernels.attnres_triton import triton_multi_query_read
    from depthscale.model.attnres_ops import multi_query_read

    gen = torch.Generator(ctx.device).manual_seed(1000 * d + 10 * S + m)
    B, T, e = shapes["B"], shapes["T"], DTYPE.itemsize
    N = B * T
    values: dict[str, Any] = {"d": d, "S": S, "m": m, "N": N, "dtype": str(DTYPE)}

    # error at n_err tokens, against fp32 PyTorch on the same values
    n_err = min(shapes["n_err"], T)
    q = _randn(ctx, gen, S, d, scale=2 * d**-0.5)
    srcs = [_randn(ctx, gen, 1, n_err, d, dtype=DTYPE) for _ in range(m)]
    out, lse = triton_multi_query_read(srcs, q, EPS)
    up = [torch.randn(out.shape, generator=gen, device=ctx.device).to(out.dtype),
          torch.randn(lse.shape, generator=gen, device=ctx.device)]  # fmt: skip
    grads = torch.autograd.grad((out, lse), [q, *srcs], up)
    ref_outs, ref_grads = _reference(lambda a: multi_query_read(a[1:], a[0], EPS), [q, *srcs], up)
    values |= _errors((out, lse), ref_outs, grads, ref_grads, ("out", "lse"))
    del out, lse, grads, ref_outs, ref_grads, srcs

    # timing at N tokens
    q = _randn(ctx, gen, S, d, scale=2 * d**-0.5)
    srcs = [_randn(ctx, gen, B, T, d, dtype=DTYPE) for _ in range(m)]
    up = [torch.randn(S, B, T, d, generator=gen, device=ctx.device).to(DTYPE),
          torch.randn(S, B, T, generator=gen, device=ctx.device)]  # fmt: skip
    fwd_bytes = m * N * d * e + S * d * 4 + S * N * d * e + S * N * 4
    # read sources, queries, lse, d_out, d_lse; write source and query gradients
    bwd_bytes = 2 * m * N * d * e + S * N * d * e + 2 * S * N * 4 + 2 * S * d * 4
    values |= _timings(ctx, shapes, lambda: triton_multi_query_read(srcs, q, EPS), [q, *srcs],
                       up, fwd_bytes, bwd_bytes, gbps)  # fmt: skip
    if traffic is not None:
        values["traffic_model"] = traffic(d, S, m, N)
    if d in GOAL_DIMS or ctx.dry_run:  # the dry run judges its tiny case, to run the logic
        goal(values, "fwd_of_copy", values.get("fwd_of_copy"), ">=", GOAL_FWD)
        goal(values, "bwd_of_copy", values.get("bwd_of_copy"), ">=", GOAL_BWD)
    return _check(values)


def merge_case(ctx: Context, shapes: dict, d: int, gbps: float | None) -> dict:
    from depthscale.kernels.attnres_triton import triton_merge_partial
    from depthscale.model.attnres_ops import merge_partial

    gen = torch.Generator(ctx.device).manual_seed(d)
    B, T, e = shapes["B"], shapes["T"], DTYPE.itemsize
    N = B * T
    values: dict[str, Any] = {"d": d, "N": N, "dtype": str(DTYPE)}

    def inputs(b: int, t: int) -> list[torch.Tensor]:
        return [
            _randn(ctx, gen, b, t, d, dtype=DTYPE),  # phase-1 output
            _randn(ctx, gen, b, t, scale=3.0),  # its log-sum-exp
            _randn(ctx, gen, b, t, d, dtype=DTYPE),  # the partial sum
            _randn(ctx, gen, d, scale=2 * d**-0.5),  # the query
        ]

    n_err = min(shapes["n_err"], T)
    args = inputs(1, n_err)
    h = triton_merge_partial(*args, EPS)
    up = [torch.randn(h.shape, generator=gen, device=ctx.device).to(h.dtype)]
    grads = torch.autograd.grad((h,), args, up)
    ref_outs, ref_grads = _reference(lambda a: merge_partial(*a, EPS), args, up)
    values |= _errors((h,), ref_outs, grads, ref_grads, ("out",))

    args = inputs(B, T)
    up = [torch.randn(B, T, d, generator=gen, device=ctx.device).to(DTYPE)]
    fwd_bytes = 3 * N * d * e + N * 4 + d * 4  # o, p read, h written; lse; w
    bwd_bytes = 5 * N * d * e + 2 * N * 4 + 2 * d * 4  # o, p, dh read; d_o, d_p written
    values |= _timings(ctx, shapes, lambda: triton_merge_partial(*args, EPS), args, up,
                       fwd_bytes, bwd_bytes, gbps)  # fmt: skip
    return _check(values)


def memory(ctx: Context) -> dict:
    """Device memory in use outside torch's caching allocator (CUDA context, cuBLAS workspaces,
    and the local memory the driver reserves for spilling kernels)."""
    if not ctx.cuda:
        raise Skipped("no CUDA device: device memory outside torch's allocator")
    free, total = torch.cuda.mem_get_info()
    reserved = torch.cuda.memory_reserved()
    return {
        "outside_torch_gib": round((total - free - reserved) / 2**30, 2),
        "torch_reserved_gib": round(reserved / 2**30, 2),
        "total_gib": round(total / 2**30, 1),
    }


def variants() -> dict:
    """Every kernel variant Triton compiled in this process, from its JIT caches: registers,
    spills and shared memory (none under the interpreter, which compiles nothing)."""
    import triton
    from triton.runtime.jit import JITFunction

    found = []
    for mod_name, module in list(sys.modules.items()):
        if not mod_name.startswith("depthscale.kernels") or module is None:
            continue
        for name, obj in vars(module).items():
            fn = obj
            while not isinstance(fn, JITFunction) and hasattr(fn, "fn"):  # autotuner wrappers
                fn = fn.fn
            if isinstance(fn, JITFunction) and getattr(fn, "__module__", mod_name) == mod_name:
                found += [{"kernel": name} | info for info in _compiled(fn)]
    spills = [v for v in found if (v.get("n_spills") or 0) > 0]
    values = {"triton": triton.__version__, "variants": found, "with_spills": len(spills)}
    if spills:
        raise OutOfBounds(f"{len(spills)} variant(s) spill registers to local memory", values)
    return values


def _compiled(fn) -> list[dict]:
    """The compiled kernels in a JITFunction's caches (their layout differs across Triton
    versions: a dict per device, or a tuple whose first item is that dict)."""
    out = []
    for entry in getattr(fn, "device_caches", {}).values():
        cache = entry[0] if isinstance(entry, tuple) else entry
        for kernel in getattr(cache, "values", lambda: [])():
            with contextlib.suppress(Exception):  # the numbers are then reported as missing
                kernel._init_handles()  # fills n_regs / n_spills (lazy in recent Triton)
            md = getattr(kernel, "metadata", None)
            out.append({
                "n_regs": getattr(kernel, "n_regs", None),
                "n_spills": getattr(kernel, "n_spills", None),
                "shared": getattr(md, "shared", None),
                "num_warps": getattr(md, "num_warps", None),
                "num_stages": getattr(md, "num_stages", None),
            })  # fmt: skip
    return out


def moe_grouped_mm(ctx: Context) -> dict:
    """The MoE experts' GEMM (`model/moe.grouped_mm`) in bf16 at a Mixtral-like shape (8 experts,
    4096 → 14336, 8192 routed rows; tiny under --dry-run): the path depthscale chose
    (`grouped`: one `torch._grouped_mm` kernel), forward + backward ms of the grouped and the
    per-expert loop, and the grouped result's error against the loop in fp32 (bf16 bound 2e-2)."""
    from depthscale.model import moe

    E, a, b, rows = (8, 4096, 14336, 8192) if not ctx.dry_run else (4, 64, 96, 256)
    dtype = torch.bfloat16 if ctx.cuda else torch.float32
    gen = torch.Generator(ctx.device).manual_seed(3)
    counts = torch.full((E,), rows // E, device=ctx.device)
    x = _randn(ctx, gen, rows, a, dtype=dtype)
    w = _randn(ctx, gen, E, a, b, scale=a**-0.5, dtype=dtype)
    up = torch.randn(rows, b, generator=gen, device=ctx.device).to(dtype)
    works = moe.grouped_mm_works(ctx.device, dtype)
    values = {"path": moe.grouped_mm_path(ctx.device.type, dtype, (a, b), works),
              "shape": [E, a, b, rows], "dtype": str(dtype).removeprefix("torch.")}  # fmt: skip
    for path in ("grouped", "loop") if works else ("loop",):

        def step(path=path):
            torch.autograd.grad(moe.grouped_mm(x, w, counts, path), (x, w), up)

        values[f"{path}_fwd_bwd_ms"] = sig(time_ms(ctx, step, 2, 5))
    if works:
        values["grouped_over_loop"] = sig(
            values["grouped_fwd_bwd_ms"] / values["loop_fwd_bwd_ms"], 3
        )
        want = moe.grouped_mm(x.detach().float(), w.detach().float(), counts, "loop")
        err = rel_err(moe.grouped_mm(x.detach(), w.detach(), counts, "grouped"), want)
        values["rel_err"] = sig(err, 3)
        if not err <= 2e-2:
            raise OutOfBounds(f"grouped GEMM rel error {err:.2e} > 2e-2", values)
    return values
