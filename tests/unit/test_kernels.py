"""Fused AttnRes kernels against the PyTorch ops, forward and every gradient.

Triton: without a GPU the kernels run under TRITON_INTERPRET=1, which must be set before the
kernels are defined (at import of `depthscale.kernels.attnres_triton`, which only these tests
trigger). C++ CPU kernels: built on first use (once per process, cached on disk); the tests also
check their determinism (bitwise) and the chained gradient sums. Which path runs (dispatch, env
switch, a failed build, strict mode) is tested in test_kernel_dispatch.py; shared cases and
helpers are in kernel_cases.py.

Tolerances: kernels and reference do the same fp32 arithmetic on the same inputs in a different
order, so fp32 results — lse, d_queries, d_lse, and for fp32 phase-1 outputs out and d_inter_out —
differ by at most `fp32_sum_bound` of the op's reduction chain (`read_terms`, `merge_terms`; see
tests/tolerances.py), relative to the tensor's largest entry (d_queries sums over tokens and sources:
its rounding error scales with the terms, which the chain's length covers). Results stored in bf16
(fp16) — out (phase-1 outputs are in the sources' dtype), d_sources, h, d_partial, d_inter_out — can
round to a neighbouring value: one ulp, at most 2^-7 (2^-10) relative, so they are compared at two
ulps, rtol 2^-6 (2^-9), with atol 1e-4 × the largest entry for entries that cancel to near zero.
The bf16 two-phase read against the fp32 reference has its own derived bound (`bf16_bounds`).
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from kernel_cases import (  # noqa: E402
    CPU_DTYPES,
    DEVICE,
    EPS,
    PATHS,
    U_BF16,
    U_BF16_TRUNCATED,
    assert_close,
    bf16_bounds,
    bf16_case,
    cpu_leaf,
    grads_of,
    leaf,
    merge_terms,
    needs_triton,
    on_cpu,
    pytorch,
    read_terms,
    two_phase,
)

from depthscale import kernels  # noqa: E402
from depthscale.config import ModelConfig  # noqa: E402
from depthscale.model.attnres_ops import (  # noqa: E402
    inter_block_read,
    inter_block_read_chained,
    kernel_paths,
    merge_partial,
    merge_partial_chained,
    multi_query_read,
    reset_kernel_paths,
)
from depthscale.model.transformer import Transformer, cross_entropy  # noqa: E402
from tolerances import check, fp32_model_bound, scaled_err  # noqa: E402

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


@needs_triton
@pytest.mark.parametrize(
    "dtype,m,S,B,T,d,use_lse",
    [
        (torch.float32, 4, 3, 2, 7, 24, True),  # several sources, S not a power of two, odd d
        (torch.float32, 1, 1, 1, 7, 40, True),  # one source, one query
        (torch.float32, 3, 5, 4, 16, 64, False),  # 64 tokens: several blocks; lse unused
        (torch.bfloat16, 4, 3, 2, 7, 40, True),
        (torch.bfloat16, 1, 1, 2, 7, 24, True),
        (torch.float16, 2, 2, 1, 7, 24, True),
    ],
)
def test_multi_query_read_matches_pytorch(dtype, m, S, B, T, d, use_lse):
    from depthscale.kernels.attnres_triton import triton_multi_query_read

    sources = [leaf(B, T, d, dtype=dtype, scale=1 + 0.5 * i) for i in range(m)]
    queries = leaf(S, d, scale=0.5)
    got = triton_multi_query_read(sources, queries, EPS)
    want = pytorch(multi_query_read, sources, queries, EPS)
    assert got[0].shape == (S, B, T, d) and got[1].shape == (S, B, T)
    terms = read_terms(m, S, B, T, d)
    for g, w, name in zip(got, want, ("out", "lse")):
        assert_close(g, w, name, terms)
    upstream = [torch.randn_like(want[0]), torch.randn_like(want[1]) if use_lse else None]
    inputs = [queries, *sources]
    names = ["d_queries", *(f"d_source{i}" for i in range(m))]
    for g, w, name in zip(grads_of(got, upstream, inputs), grads_of(want, upstream, inputs), names):
        assert_close(g, w, name, terms)


@needs_triton
def test_multi_query_read_unaligned_sources():
    """A contiguous view 4 bytes into its storage: the kernels must not assume 16-byte alignment."""
    from depthscale.kernels.attnres_triton import triton_multi_query_read

    flat = torch.randn(2 * 7 * 24 + 1, device=DEVICE)
    sources = [flat[1:].view(2, 7, 24).requires_grad_(), leaf(2, 7, 24)]
    assert sources[0].data_ptr() % 16
    queries = leaf(2, 24)
    got = triton_multi_query_read(sources, queries, EPS)
    want = pytorch(multi_query_read, sources, queries, EPS)
    upstream = [torch.randn_like(want[0]), torch.randn_like(want[1])]
    for g, w in zip([*got, *grads_of(got, upstream, [queries, *sources])],
                    [*want, *grads_of(want, upstream, [queries, *sources])]):  # fmt: skip
        assert_close(g, w, "unaligned", read_terms(2, 2, 2, 7, 24))


@needs_triton
@pytest.mark.parametrize(
    "dtype,B,T,d",
    [
        (torch.float32, 2, 7, 24),
        (torch.float32, 4, 16, 64),  # several blocks, strided backward loop
        (torch.bfloat16, 2, 7, 40),
        (torch.float16, 1, 7, 24),
    ],
)
def test_merge_partial_matches_pytorch(dtype, B, T, d):
    from depthscale.kernels.attnres_triton import triton_merge_partial

    inter_out, partial = leaf(B, T, d), leaf(B, T, d, dtype=dtype)
    inter_lse = leaf(B, T, scale=3.0)  # both sides of the gate win somewhere
    query = leaf(d, scale=0.5)
    inputs = [inter_out, inter_lse, partial, query]
    got, want = triton_merge_partial(*inputs, EPS), pytorch(merge_partial, *inputs, EPS)
    terms = merge_terms(B, T, d)
    assert_close(got, want, "h", terms)
    upstream = [torch.randn_like(want, dtype=torch.float32)]
    names = ["d_inter_out", "d_inter_lse", "d_partial", "d_query"]
    for g, w, name in zip(
        grads_of([got], upstream, inputs), grads_of([want], upstream, inputs), names
    ):
        assert_close(g, w, name, terms)


def _launched_variants(monkeypatch) -> list:
    """Records the variant of every kernel launch of the Triton reads."""
    from depthscale.kernels import attnres_triton_launch as launch

    seen, real = [], launch._launch

    def spy(variant, grid, *args):
        seen.append(variant)
        real(variant, grid, *args)

    monkeypatch.setattr(launch, "_launch", spy)
    return seen


@needs_triton
@pytest.mark.parametrize(
    "dtype,m,S,d",
    [
        (torch.float32, 3, 3, 2048),  # S_PAD 4, d a multiple of every BLOCK_D: the ALIGNED variants
        (torch.bfloat16, 2, 1, 4096),  # S = 1 (full AttnRes) at a production width
    ],
)
def test_triton_read_and_merge_at_a_production_width(monkeypatch, dtype, m, S, d):
    """The variants production shapes launch (chunked d, no column masks) against the PyTorch ops,
    on two tokens: and each launched variant is one the AOT test compiles for sm_90a/sm_80."""
    from depthscale.kernels.attnres_triton import triton_merge_partial, triton_multi_query_read
    from depthscale.kernels.attnres_triton_config import grid_variants

    launched = _launched_variants(monkeypatch)
    sources = [leaf(1, 2, d, dtype=dtype, scale=1 + 0.5 * i) for i in range(m)]
    queries = leaf(S, d, scale=0.5)
    got = triton_multi_query_read(sources, queries, EPS)
    want = pytorch(multi_query_read, sources, queries, EPS)
    terms = read_terms(m, S, 1, 2, d)
    upstream = [torch.randn_like(want[0]), torch.randn_like(want[1])]
    inputs = [queries, *sources]
    for g, w in zip([*got, *grads_of(got, upstream, inputs)],
                    [*want, *grads_of(want, upstream, inputs)]):  # fmt: skip
        assert_close(g, w, f"d={d}", terms)
    merge_inputs = [got[0][0].detach().requires_grad_(), got[1][0].detach().requires_grad_(),
                    sources[0], queries[0]]  # fmt: skip
    h = triton_merge_partial(*merge_inputs, EPS)
    h_want = pytorch(merge_partial, *merge_inputs, EPS)
    up = [torch.randn_like(h_want, dtype=torch.float32)]
    for g, w in zip([h, *grads_of([h], up, merge_inputs)],
                    [h_want, *grads_of([h_want], up, merge_inputs)]):  # fmt: skip
        assert_close(g, w, f"merge d={d}", merge_terms(1, 2, d))
    kernels_run = {v.kernel for v in launched}  # all but the address-table writer
    assert len(kernels_run) == 4 and all(dict(v.constexprs).get("ALIGNED", True) for v in launched)
    assert set(launched) <= set(grid_variants())


@needs_triton
def test_triton_forward_runs_every_work_item_once(monkeypatch):
    """The one-launch read (`_read_forward_kernel`): every program took one ticket, every token
    block's m × n_parts logits items arrived and its ready flag was set (its weighted-sum items
    ran after it), and the result is the PyTorch read's — at a width of two logits parts, so the
    last arriver's sum over parts is exercised."""
    from depthscale.kernels import attnres_triton_config as config
    from depthscale.kernels import attnres_triton_launch as launch
    from depthscale.kernels.attnres_triton import triton_multi_query_read

    seen, real = [], launch._launch

    def spy(variant, grid, *args):
        real(variant, grid, *args)
        seen.append((variant, grid, args))

    monkeypatch.setattr(launch, "_launch", spy)
    m, S, N, d = 3, 2, 20, 2 * config.LOGIT_PART
    sources = [leaf(1, N, d, scale=1 + 0.5 * i) for i in range(m)]
    queries = leaf(S, d, scale=0.5)
    with torch.no_grad():
        got = triton_multi_query_read(sources, queries, EPS)
        want = pytorch(multi_query_read, sources, queries, EPS)
    for g, w in zip(got, want, strict=True):
        assert_close(g, w, "forward", read_terms(m, S, 1, N, d))
    ((variant, grid, args),) = [x for x in seen if x[0].kernel == "_read_forward_kernel"]
    plan = config.read_forward_launch(N, d, m, S, "fp32")
    sync, blocks = args[7].tolist(), plan.n_blocks
    assert plan.n_parts == 2 and blocks == 2 and grid == plan.grid == sync[0]
    assert sync[1 : 1 + blocks] == [m * plan.n_parts] * blocks
    assert sync[1 + blocks :] == [1] * blocks


@needs_triton
@pytest.mark.parametrize(
    "block_bytes,m,S,N,d,dtype",
    [
        (2**30, 3, 3, 40, 128, torch.float32),  # 16-token blocks, two logits parts, 3 lanes
        (1, 5, 16, 6, 48, torch.float32),  # 1-token blocks: 16 sources a tile; S_PAD 16: tl.dot
        (4 * 11 * 64 * 2, 3, 5, 21, 64, torch.bfloat16),  # 4 tokens × 4 sources a tile
    ],
)
def test_triton_backward_runs_every_work_item_once(monkeypatch, block_bytes, m, S, N, d, dtype):
    """The one-launch backward (`_read_backward_kernel`), at each block size (tile rows of one
    source, of 4 sources × 4 tokens, of 16 sources × 1 token): every program took one ticket,
    every block's logits items arrived and its ready flag was set, every dw lane was added to once
    per block it holds (the chain's turns), and every gradient is the PyTorch read's — one
    upstream gradient absent (zero), lse's gradient used, dw summed over several lanes."""
    from depthscale.kernels import attnres_triton_config as config
    from depthscale.kernels import attnres_triton_launch as launch
    from depthscale.kernels.attnres_triton import triton_multi_query_read

    monkeypatch.setattr(config, "BACKWARD_BLOCK_BYTES", block_bytes)
    monkeypatch.setattr(config, "LOGIT_PART", 64)  # two parts at d = 128: their sum in order
    plan = config.read_backward_launch(N, d, m, S, launch.dtype_name(dtype))
    row = (2 * m + S) * d * plan.element
    monkeypatch.setattr(config, "DW_LANE_SPACING", 3 * plan.block_n * row)  # 3 lanes
    plan = config.read_backward_launch(N, d, m, S, launch.dtype_name(dtype))
    seen, real = [], launch._launch

    def spy(variant, grid, *args):
        real(variant, grid, *args)
        seen.append((variant, grid, args))

    monkeypatch.setattr(launch, "_launch", spy)
    sources = [leaf(1, N, d, dtype=dtype, scale=1 + 0.5 * i) for i in range(m)]
    queries = leaf(S, d, scale=0.5)
    inputs = [queries, *sources]
    got = triton_multi_query_read(sources, queries, EPS)
    want = pytorch(multi_query_read, sources, queries, EPS)
    upstream = [torch.randn_like(want[0]), torch.randn_like(want[1])]
    upstream[0][1] = 0  # one query's output unused: its upstream gradient is zero
    names = ["d_queries", *(f"d_source{i}" for i in range(m))]
    for g, w, name in zip(grads_of(got, upstream, inputs), grads_of(want, upstream, inputs), names):
        assert_close(g, w, name, read_terms(m, S, 1, N, d))
    ((variant, grid, args),) = [x for x in seen if x[0].kernel == "_read_backward_kernel"]
    assert variant == plan.variant and grid == plan.grid and plan.n_lanes == min(3, plan.n_blocks)
    assert plan.block_n == {2**30: 16, 1: 1}.get(block_bytes, 4)
    sync, blocks, lanes = args[8].tolist(), plan.n_blocks, plan.n_lanes
    assert sync[0] == grid
    assert sync[1 : 1 + blocks] == [plan.n_groups * plan.n_parts] * blocks
    assert sync[1 + blocks : 1 + 2 * blocks] == [1] * blocks
    turns = [-(-(blocks - lane) // lanes) for lane in range(lanes) for _ in range(plan.n_chunks)]
    assert sync[1 + 2 * blocks :] == turns


@needs_triton
def test_triton_merge_backward_reduces_dw_over_several_programs(monkeypatch):
    """The merge's query gradient is summed in two levels (per-program partials, then their sum):
    with as many programs as a GPU of 3 SMs would run, every partial row is written and counted."""
    from depthscale.kernels import attnres_triton_launch as launch
    from depthscale.kernels.attnres_triton import triton_merge_partial

    monkeypatch.setattr(launch, "_sms", lambda device: 3)
    source, query = leaf(2, 16, 24), leaf(24, scale=0.5)
    merge_inputs = [leaf(2, 16, 24), leaf(2, 16, scale=3.0), source, query]
    up = [torch.randn(2, 16, 24, device=DEVICE)]
    h, h_want = triton_merge_partial(*merge_inputs, EPS), pytorch(merge_partial, *merge_inputs, EPS)
    assert_close(grads_of([h], up, merge_inputs)[3], grads_of([h_want], up, merge_inputs)[3],
                 "merge d_query", merge_terms(2, 16, 24))  # fmt: skip


@needs_triton
def test_triton_address_tables_are_written_on_the_device(monkeypatch):
    """Hazard #13: the kernels' address tables come from a kernel whose arguments are the addresses
    (a CUDA graph captures them by value), never from host memory copied to the device (a graph
    would replay that copy from a host buffer long freed): no pinned buffer, no host tensor."""
    from depthscale.kernels.attnres_triton_launch import address_table

    tensors = [torch.empty(3, device=DEVICE) for _ in range(20)]
    tensors[5] = None
    want = [0 if t is None else t.data_ptr() for t in tensors]

    def refuse(*args, **kwargs):
        raise AssertionError("an address table went through host memory")

    monkeypatch.setattr(torch.Tensor, "pin_memory", refuse)
    monkeypatch.setattr(torch, "tensor", refuse)
    table = address_table(tensors, torch.device(DEVICE))
    assert table.device.type == DEVICE and table.dtype == torch.int64
    assert table.tolist() == want  # 20 entries: two launches of 16 slots
    blocks, partial, queries, upstream = bf16_case(DEVICE)
    outs = two_phase("triton", blocks, partial, queries)[2]
    grads_of(outs, upstream, [*blocks, partial, queries])


@needs_triton
@pytest.mark.parametrize("read", ["two_phase", "efficient"])
def test_model_with_triton_matches_pytorch(read):
    torch.manual_seed(1)
    cfg = ModelConfig(vocab_size=61, dim=24, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=16,
                      residual="block", attnres_block_size=2, attnres_read=read)  # fmt: skip
    model = Transformer(cfg).to(DEVICE)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("pseudo_query"):
                p.normal_(0, 0.5)
    tokens = torch.randint(0, 61, (2, 7), device=DEVICE)

    def run(triton: bool):
        model.zero_grad()
        with kernels.use_triton(triton):
            logits = model(tokens)
            cross_entropy(logits, tokens).backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        return logits.detach(), grads

    (ref_logits, ref_grads), (logits, grads) = run(False), run(True)
    bound = fp32_model_bound(cfg, 7, 2)  # the reads add in another order (tests/tolerances.py)
    check(scaled_err(logits, ref_logits), bound, "logits")
    for name, g in ref_grads.items():
        check(scaled_err(grads[name], g), bound, name)


@pytest.mark.parametrize("dtype", CPU_DTYPES)
@pytest.mark.parametrize(
    "m,S,B,T,d",
    [
        (4, 3, 2, 7, 24),  # d < 32: partial 16-lane block and zero-padded tail
        (1, 1, 1, 7, 40),  # one source
        (3, 6, 2, 5, 17),  # S > 4: two query groups (4 + 2); d not a multiple of 16
        (5, 2, 1, 3, 48),  # d a multiple of 16, not of 32
        (18, 2, 1, 3, 24),  # m > 16: the softmax's exp runs on two 16-lane chunks
    ],
)
def test_cpu_read_matches_pytorch(cpu_ops, dtype, m, S, B, T, d):
    sources = [cpu_leaf(B, T, d, dtype=dtype, scale=1 + 0.5 * i) for i in range(m)]
    queries = cpu_leaf(S, d, scale=0.5)
    got = on_cpu(multi_query_read, sources, queries, EPS, kernels_on=True)
    want = on_cpu(multi_query_read, sources, queries, EPS, kernels_on=False)
    terms = read_terms(m, S, B, T, d)
    for g, w, name in zip(got, want, ("out", "lse")):
        assert_close(g, w, name, terms)
    upstream = [torch.randn_like(want[0]), torch.randn_like(want[1])]
    upstream[0][0] = 0  # one query's output unused: its upstream gradient is zero
    inputs = [queries, *sources]
    names = ["d_queries", *(f"d_source{i}" for i in range(m))]
    for g, w, name in zip(grads_of(got, upstream, inputs), grads_of(want, upstream, inputs), names):
        assert_close(g, w, name, terms)


@pytest.mark.parametrize("dtype", CPU_DTYPES)
@pytest.mark.parametrize("B,T,d", [(2, 7, 24), (1, 5, 33)])
def test_cpu_merge_matches_pytorch(cpu_ops, dtype, B, T, d):
    inter_out, partial = cpu_leaf(B, T, d), cpu_leaf(B, T, d, dtype=dtype)
    inter_lse = cpu_leaf(B, T, scale=3.0)  # both sides of the gate win somewhere
    query = cpu_leaf(d, scale=0.5)
    inputs = [inter_out, inter_lse, partial, query]
    got = on_cpu(merge_partial, *inputs, EPS, kernels_on=True)
    want = on_cpu(merge_partial, *inputs, EPS, kernels_on=False)
    terms = merge_terms(B, T, d)
    assert_close(got, want, "h", terms)
    upstream = [torch.randn_like(want, dtype=torch.float32)]
    names = ["d_inter_out", "d_inter_lse", "d_partial", "d_query"]
    for g, w, name in zip(
        grads_of([got], upstream, inputs), grads_of([want], upstream, inputs), names
    ):
        assert_close(g, w, name, terms)


def _read_then_merge(blocks, partial, queries):
    """A block's reads as the model chains them: phase 1 (passing the blocks on), a merge with the
    partial sum (passing it on), then the next block's phase 1 over the passed-on blocks + 1."""
    out, lse, blocks = inter_block_read_chained(blocks, queries[:2], EPS)
    h, partial = merge_partial_chained(out[1], lse[1], partial, queries[1], EPS)
    nxt, _, _ = inter_block_read_chained([*blocks, partial * 1.5], queries[2:], EPS)
    return [out[0], h, *nxt, partial]


@pytest.mark.parametrize("path", ["cpu", "torch", pytest.param("triton", marks=needs_triton)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chained_reads_sum_gradients_like_autograd_bitwise(request, path, dtype):
    """Chaining moves the summation of a source's gradients from autograd's buffers into the reads'
    backward, in the same order and with autograd's rounding (bf16: each term rounded, then the
    sum): gradients are bitwise those of unchained reads of the same tensors."""
    if path == "cpu":
        request.getfixturevalue("cpu_ops")
    device = DEVICE if path == "triton" else "cpu"

    def leaf_(*shape, scale=1.0, dt=dtype):
        return (torch.randn(*shape, device=device) * scale).to(dt).requires_grad_()

    blocks = [leaf_(2, 5, 24, scale=1 + 0.3 * i) for i in range(3)]
    partial, queries = leaf_(2, 5, 24), leaf_(4, 24, scale=0.5, dt=torch.float32)
    inputs = [*blocks, partial, queries]

    def unchained():
        out, lse = inter_block_read(blocks, queries[:2], EPS)
        h = merge_partial(out[1], lse[1], partial, queries[1], EPS)
        nxt, _ = inter_block_read([*blocks, partial * 1.5], queries[2:], EPS)
        return [out[0], h, *nxt, partial]

    use_triton, use_cpu = PATHS[path]
    reset_kernel_paths()
    with kernels.use_triton(use_triton), kernels.use_cpu_kernels(use_cpu):
        outs_a = _read_then_merge(blocks, partial, queries)
        outs_b = unchained()
        upstream = [torch.randn_like(o) for o in outs_a]
        for a, b in zip(outs_a, outs_b):
            assert torch.equal(a, b)
        grads_a, grads_b = grads_of(outs_a, upstream, inputs), grads_of(outs_b, upstream, inputs)
    assert kernel_paths() == {"phase1": path, "merge": path}
    if path == "triton" and dtype == torch.bfloat16 and INTERPRETED:
        # the interpreter rounds a kernel's bf16 stores by truncation, autograd's bf16 add to
        # nearest: the chained sum (rounded in the kernel) can be one ulp off; on a GPU both round
        # to nearest and the gradients are bitwise equal
        for a, b in zip(grads_a, grads_b):
            torch.testing.assert_close(a, b, rtol=2**-7, atol=0)
        return
    for a, b in zip(grads_a, grads_b):
        assert torch.equal(a, b)


def test_cpu_kernels_are_deterministic_and_layout_independent(cpu_ops):
    """Bitwise: run to run, 1 vs 2 threads, and per token independent of the batch it came in
    (pipeline parity relies on it) and of the sources' alignment."""
    B, T, d = 3, 37, 40
    sources = [cpu_leaf(B, T, d, scale=1 + 0.5 * i) for i in range(3)]
    queries = cpu_leaf(2, d, scale=0.5)
    upstream = [torch.randn(2, B, T, d), torch.randn(2, B, T)]

    def run(srcs, q=queries, up=upstream):
        with kernels.use_cpu_kernels(True):
            out = multi_query_read(srcs, q, EPS)
            return [*out, *grads_of(out, up, [q, *srcs])]

    first = run(sources)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        single = run(sources)
    finally:
        torch.set_num_threads(threads)
    for a, b, c in zip(first, run(sources), single):
        assert torch.equal(a, b) and torch.equal(a, c)
    # one batch row alone: outputs and source gradients per token are the same bits
    row = [s.detach()[1:2].clone().requires_grad_() for s in sources]
    alone = run(row, up=[u[:, 1:2] for u in upstream])
    assert torch.equal(alone[0], first[0][:, 1:2]) and torch.equal(alone[1], first[1][:, 1:2])
    for a, b in zip(alone[3:], first[3:]):
        assert torch.equal(a, b[1:2])
    # a source 4 bytes into its storage (not 16-byte aligned)
    flat = torch.empty(B * T * d + 1)
    shifted = flat[1:].view(B, T, d).copy_(sources[0].detach()).requires_grad_()
    assert shifted.data_ptr() % 16
    moved = run([shifted, *sources[1:]])
    for a, b in zip(moved, first):
        assert torch.equal(a, b)


def test_cpu_path_float64_runs_in_pytorch_and_passes_gradcheck(cpu_ops):
    """float64 (gradcheck) is outside the kernels: dispatch falls back; chained reads and merges
    still have exact gradients."""
    blocks = [torch.randn(1, 3, 6, dtype=torch.float64, requires_grad=True) for _ in range(2)]
    partial = torch.randn(1, 3, 6, dtype=torch.float64, requires_grad=True)
    queries = torch.randn(4, 6, dtype=torch.float64, requires_grad=True)
    with kernels.use_cpu_kernels(True):
        assert torch.autograd.gradcheck(
            lambda b0, b1, p, q: tuple(_read_then_merge([b0, b1], p, q)),
            (*blocks, partial, queries),
        )


@pytest.mark.parametrize("path", ["torch", "cpu", pytest.param("triton", marks=needs_triton)])
def test_two_phase_bf16_within_rounding_bound_of_fp32_reference(request, path):
    """bf16 sources, fp32 queries: phase-1 outputs come out (and are saved) in bf16, log-sum-exps
    in fp32, and outputs and gradients stay within `bf16_bounds` of the fp32 reference on every
    path; the fused paths take the bf16 phase-1 outputs (no fallback)."""
    if path == "cpu":
        request.getfixturevalue("cpu_ops")
    blocks, partial, queries, upstream = bf16_case(DEVICE if path == "triton" else "cpu")
    reset_kernel_paths()
    out, lse, outs = two_phase(path, blocks, partial, queries)
    assert kernel_paths() == {"phase1": path, "merge": path}
    assert {o.dtype for o in out} == {torch.bfloat16} and {x.dtype for x in lse} == {torch.float32}
    u = U_BF16_TRUNCATED if path == "triton" and INTERPRETED else U_BF16
    ref_outs, ref_grads, out_bounds, grad_bounds = bf16_bounds(
        blocks, partial, queries, upstream, u
    )
    for s, (h, ref, bound) in enumerate(zip(outs, ref_outs, out_bounds)):
        assert h.dtype == torch.bfloat16
        check((h.float() - ref).abs().max().item(), bound, f"{path}: h{s}")
    inputs = [*blocks, partial, queries]
    names = [*(f"d_block{i}" for i in range(len(blocks))), "d_partial", "d_queries"]
    for g, ref, bound, name in zip(grads_of(outs, upstream, inputs), ref_grads, grad_bounds, names):
        check((g.float() - ref).abs().max().item(), bound, f"{path}: {name}")


def test_two_phase_bf16_cpu_kernels_match_pytorch(cpu_ops):
    """Both are within `bf16_bounds` of the same fp32 reference, so within twice it of each other."""
    blocks, partial, queries, upstream = bf16_case()
    _, out_bounds, grad_bounds = bf16_bounds(blocks, partial, queries, upstream)[1:]
    inputs = [*blocks, partial, queries]
    runs = {}
    for path in ("cpu", "torch"):
        outs = two_phase(path, blocks, partial, queries)[2]
        runs[path] = [*outs, *grads_of(outs, upstream, inputs)]
    for i, (a, b, bound) in enumerate(zip(*runs.values(), [*out_bounds, *grad_bounds])):
        assert a.dtype == b.dtype
        check((a.float() - b.float()).abs().max().item(), 2 * bound, f"cpu vs torch, result {i}")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("path", ["cpu", pytest.param("triton", marks=needs_triton)])
def test_merge_takes_inter_out_in_the_partial_dtype(request, path, dtype):
    """A phase-1 output in the partial sum's dtype is read as such by the fused merges (no
    fallback), and its gradient comes back in that dtype; same results as the PyTorch op."""
    if path == "cpu":
        request.getfixturevalue("cpu_ops")
    device = DEVICE if path == "triton" else "cpu"
    B, T, d = 2, 7, 40
    inter_out = (torch.randn(B, T, d, device=device)).to(dtype).requires_grad_()
    partial = torch.randn(B, T, d, device=device).to(dtype).requires_grad_()
    inter_lse = (torch.randn(B, T, device=device) * 3).requires_grad_()
    query = (torch.randn(d, device=device) * 0.5).requires_grad_()
    inputs = [inter_out, inter_lse, partial, query]
    use_triton, use_cpu = PATHS[path]
    reset_kernel_paths()
    with kernels.use_triton(use_triton), kernels.use_cpu_kernels(use_cpu):
        got = merge_partial(*inputs, EPS)
    assert kernel_paths() == {"merge": path}
    want = pytorch(merge_partial, *inputs, EPS)
    terms = merge_terms(B, T, d)
    assert_close(got, want, "h", terms)
    upstream = [torch.randn_like(want, dtype=torch.float32)]
    got_grads, want_grads = grads_of([got], upstream, inputs), grads_of([want], upstream, inputs)
    assert got_grads[0].dtype == dtype
    for g, w, name in zip(got_grads, want_grads, ["d_inter_out", "d_lse", "d_partial", "d_query"]):
        assert_close(g, w, name, terms)
