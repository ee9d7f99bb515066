"""Which AttnRes path runs: the one dispatch rule (device, dtype, overrides, env switch), the
fallback when the CPU kernels do not build or triton is missing, the record of paths taken and
logged once, strict mode, and the paths under bf16 autocast and torch.compile."""

import os
import shutil
import sys

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from kernel_cases import (  # noqa: E402
    DEVICE,
    EPS,
    bf16_case,
    cpu_leaf,
    leaf,
    needs_triton,
    two_phase,
)

from depthscale import kernels  # noqa: E402
from depthscale.config import ModelConfig  # noqa: E402
from depthscale.model.attnres_ops import (  # noqa: E402
    KernelFallbackError,
    choose,
    inter_block_read_chained,
    kernel_paths,
    merge_partial,
    merge_partial_chained,
    multi_query_read,
    reset_kernel_paths,
)
from depthscale.model.kernel_dispatch import describe  # noqa: E402
from depthscale.model.transformer import Transformer, cross_entropy  # noqa: E402


@needs_triton
def test_dispatch_follows_device_and_override():
    sources, queries = [leaf(1, 3, 8) for _ in range(2)], leaf(2, 8)
    partial, query = leaf(1, 3, 8), leaf(8)

    def paths():  # the custom op (stacked read) or the eager autograd Function (merge)
        out, lse = multi_query_read(sources, queries, EPS)
        h = merge_partial(out[0], lse[0], partial, query, EPS)
        names = [t.grad_fn.name() for t in (out, h)]
        return ["depthscale_triton" in n or n.startswith("Triton") for n in names]

    assert paths() == [DEVICE == "cuda"] * 2
    with kernels.use_triton(True):
        assert paths() == [True, True]
        with kernels.use_triton(False):
            assert paths() == [False, False]
        double = [s.double() for s in sources]
        assert (
            "depthscale_triton"
            not in multi_query_read(double, queries.double(), EPS)[0].grad_fn.name()
        )
    assert kernels.triton_override() is None


def test_without_triton_the_pytorch_ops_run(monkeypatch):
    monkeypatch.setitem(sys.modules, "triton", None)  # `import triton` raises ImportError
    for name in ("attnres_triton", "attnres_triton_launch", "attnres_triton_jit"):
        monkeypatch.delitem(sys.modules, f"depthscale.kernels.{name}", raising=False)
        monkeypatch.delattr(kernels, name, raising=False)
    sources, queries = [torch.randn(1, 3, 8) for _ in range(2)], torch.randn(1, 8)
    assert kernels.load_attnres_triton() is None
    with kernels.use_triton(None):
        multi_query_read(sources, queries, EPS)
    with kernels.use_triton(True), pytest.raises(ImportError):
        multi_query_read(sources, queries, EPS)


def test_cpu_dispatch_and_env_switch(cpu_ops, monkeypatch):
    from depthscale.kernels import attnres_cpu

    calls = []

    class Spy:
        def __getattr__(self, name):
            calls.append(name)
            return getattr(cpu_ops, name)

    monkeypatch.setattr(attnres_cpu, "_ops", Spy())
    sources, queries = [cpu_leaf(1, 3, 8) for _ in range(2)], cpu_leaf(2, 8)
    out, lse = multi_query_read(sources, queries, EPS)
    (out.sum() + lse.sum()).backward()
    assert calls == ["read_forward", "read_backward"]
    with torch.no_grad():
        multi_query_read(sources, queries, EPS)
        merge_partial(out[0].detach(), lse[0].detach(), sources[0], queries[0], EPS)
    assert calls[2:] == ["read_forward", "merge_forward"]
    calls.clear()
    with kernels.use_cpu_kernels(False):
        multi_query_read(sources, queries, EPS)
    multi_query_read([s.double() for s in sources], queries.double(), EPS)  # fp64: PyTorch
    with kernels.strict(False):  # a missed kernel: only outside strict mode
        multi_query_read([sources[0], sources[1].bfloat16()], queries, EPS)  # mixed: PyTorch

    class Sharded(torch.Tensor):  # stands in for a DTensor query (tp + dp): no sharding rules
        pass

    multi_query_read(sources, queries.detach().as_subclass(Sharded), EPS)  # subclass: PyTorch
    monkeypatch.setenv("DEPTHSCALE_CPU_KERNELS", "0")
    multi_query_read(sources, queries, EPS)
    assert calls == []
    with kernels.use_cpu_kernels(True), pytest.raises(RuntimeError, match="DEPTHSCALE_CPU_KERNELS"):
        multi_query_read(sources, queries, EPS)


def test_failed_build_falls_back_once_with_a_warning(monkeypatch, caplog):
    """No compiler / a compile error: one warning, the PyTorch ops run, the model trains; a forced
    `use_cpu_kernels(True)` raises instead of silently testing PyTorch against itself."""
    from depthscale.kernels import attnres_cpu

    attempts = []

    def broken(name, cflags, ldflags):
        attempts.append(name)
        raise RuntimeError("Error building extension\nc++: error: unrecognized option")

    monkeypatch.setattr(attnres_cpu, "_build", broken)
    monkeypatch.setattr(attnres_cpu, "_ops", None)
    monkeypatch.setattr(attnres_cpu, "_tried", False)
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=61, dim=24, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=16,
                      residual="block", attnres_block_size=2)  # fmt: skip
    model = Transformer(cfg)
    tokens = torch.randint(0, 61, (2, 7))
    with caplog.at_level("WARNING", logger=attnres_cpu.__name__), kernels.strict(False):
        for _ in range(2):
            cross_entropy(model(tokens), tokens).backward()
    assert attempts == [name for name, _, _ in attnres_cpu.VARIANTS]  # tried once per process
    with kernels.strict(True), pytest.raises(KernelFallbackError, match="CPU kernels not built"):
        cross_entropy(model(tokens), tokens)  # strict: refused
    warnings = [r for r in caplog.records if "unavailable" in r.getMessage()]
    assert len(warnings) == 1 and "unrecognized option" in warnings[0].getMessage()
    assert all(p.grad is not None for n, p in model.named_parameters() if "layers.1" in n)
    with kernels.use_cpu_kernels(True), pytest.raises(RuntimeError, match="did not build"):
        multi_query_read([torch.randn(1, 2, 8)] * 2, torch.randn(1, 8), EPS)


def test_a_library_that_loaded_incomplete_is_not_followed_by_another_variant(monkeypatch, caplog):
    """A variant that loaded but lacks an op (a stale library) has registered its namespaces:
    loading the next variant would register them again and abort the process, so none is tried."""
    from depthscale.kernels import attnres_cpu

    attempts = []

    def stale(name, cflags, ldflags):
        attempts.append(name)
        raise attnres_cpu._LoadedIncomplete(f"{name} loaded without its ops")

    monkeypatch.setattr(attnres_cpu, "_build", stale)
    monkeypatch.setattr(attnres_cpu, "_ops", None)
    monkeypatch.setattr(attnres_cpu, "_tried", False)
    with caplog.at_level("WARNING", logger=attnres_cpu.__name__):
        assert attnres_cpu.load() is None
    assert attempts == [attnres_cpu.VARIANTS[0][0]]
    assert "loaded without its ops" in caplog.text


def test_kernel_paths_and_fallback_reasons_are_recorded_and_logged_once(cpu_ops, caplog):
    blocks, partial, queries, _ = bf16_case()
    mixed = [blocks[0].float(), *blocks[1:]]  # an fp32 embedding before bf16 blocks
    reset_kernel_paths()
    with caplog.at_level("INFO", logger="depthscale.kernels"), kernels.strict(False):
        for _ in range(2):
            two_phase("cpu", blocks, partial, queries)
        assert kernel_paths() == {"phase1": "cpu", "merge": "cpu"}
        for _ in range(2):
            out, lse, _ = two_phase("cpu", mixed, partial, queries)
    assert out[0].dtype == torch.float32  # mixed: sources[0]'s dtype; the merge takes fp32 too
    assert kernel_paths() == {"phase1": "cpu+torch", "merge": "cpu"}
    assert (
        kernel_paths(reasons=True)["phase1"] == "cpu+torch (mixed source dtypes float32/bfloat16)"
    )
    records = [
        (r.levelname, r.getMessage()) for r in caplog.records if r.name == "depthscale.kernels"
    ]
    assert records == [  # once each; the missed kernel as a warning
        ("INFO", "AttnRes phase1 path: cpu"),
        ("INFO", "AttnRes merge path: cpu"),
        ("WARNING", "AttnRes phase1 path: torch (mixed source dtypes float32/bfloat16)"),
    ]

    class Sharded(torch.Tensor):  # stands in for a DTensor query (tp + dp)
        pass

    reset_kernel_paths()
    multi_query_read(blocks, queries.detach().as_subclass(Sharded), EPS)
    multi_query_read([b.double() for b in blocks], queries.double(), EPS)
    with kernels.use_cpu_kernels(False):
        merge_partial(out[1].bfloat16(), lse[1], partial, queries[1], EPS)
    assert kernel_paths(reasons=True) == {  # fallbacks without a kernel: allowed in strict mode
        "read": "torch (Sharded query)+torch (float64 source)",
        "merge": "torch (use_cpu_kernels(False))",
    }


def test_strict_mode_refuses_a_missed_kernel(cpu_ops):
    """Strict (the suite's default): a read that could have run the CPU kernels but did not raises,
    naming the read, the reason and how to turn it off; the same read falls back outside strict."""
    blocks, partial, queries, _ = bf16_case()
    mixed = [blocks[0].float(), *blocks[1:]]
    with kernels.strict(True), pytest.raises(KernelFallbackError) as err:
        two_phase("cpu", mixed, partial, queries)
    message = str(err.value)
    assert "AttnRes phase1 read" in message and "mixed source dtypes float32/bfloat16" in message
    assert "DEPTHSCALE_STRICT_KERNELS=0" in message
    with kernels.strict(False):
        out, _, _ = two_phase("cpu", mixed, partial, queries)
    assert out[0].dtype == torch.float32
    with kernels.strict(True):  # float64 and explicit overrides are not misses
        multi_query_read([b.double() for b in blocks], queries.double(), EPS)
        with kernels.use_cpu_kernels(False):
            multi_query_read(blocks, queries, EPS)


def test_suite_runs_strict():
    if shutil.which(os.environ.get("CXX", "c++")) is None or shutil.which("ninja") is None:
        pytest.skip("no C++ toolchain: the suite runs (and tests) the CPU fallback, not strict")
    if not kernels.strict_from_env():
        pytest.skip("DEPTHSCALE_STRICT_KERNELS turned off by whoever runs the suite")
    assert kernels.strict_mode(), "tests/conftest.py sets DEPTHSCALE_STRICT_KERNELS=1"


def test_strict_is_a_setter_and_a_context_manager(monkeypatch):
    """`kernels.strict(x)` sets strict mode for the process; as a context manager it restores the
    previous setting on leaving the block, also when the block raises. The default comes from
    DEPTHSCALE_STRICT_KERNELS."""
    before = kernels.strict_mode()
    try:
        kernels.strict(False)
        assert not kernels.strict_mode()
        with kernels.strict():
            assert kernels.strict_mode()
            with kernels.strict(False):
                assert not kernels.strict_mode()
            assert kernels.strict_mode()
        assert not kernels.strict_mode()
        with pytest.raises(ValueError), kernels.strict(True):
            raise ValueError
        assert not kernels.strict_mode()
        kernels.strict(True)
        assert kernels.strict_mode()
    finally:
        kernels.strict(before)
    for value, expected in [("1", True), ("yes", True), ("0", False), ("off", False), ("", False)]:
        monkeypatch.setenv("DEPTHSCALE_STRICT_KERNELS", value)
        assert kernels.strict_from_env() is expected, value
    monkeypatch.delenv("DEPTHSCALE_STRICT_KERNELS")
    assert kernels.strict_from_env() is False


def test_choose_returns_the_path_and_the_fallback_reason(cpu_ops):
    """The one rule: (path, ops, reason); a reason only for the PyTorch ops. A missed kernel raises
    in strict mode before anything runs; reads without a kernel never do."""
    blocks, partial, queries, _ = bf16_case()
    mixed = [blocks[0].float(), *blocks[1:]]
    reset_kernel_paths()
    assert choose("phase1", blocks, queries) == ("cpu", cpu_ops, None)
    with kernels.strict(True):
        with pytest.raises(KernelFallbackError, match="phase1 read .* mixed source dtypes"):
            choose("phase1", mixed, queries)
        path, ops, reason = choose("read", [b.double() for b in blocks], queries.double())
        assert (path, ops, describe(reason)) == ("torch", None, "float64 source")
        with kernels.use_cpu_kernels(False):
            assert choose("merge", [partial], queries[0])[::2] == (
                "torch",
                "use_cpu_kernels(False)",
            )
    with kernels.strict(False):
        path, ops, reason = choose("phase1", mixed, queries)
    assert (path, ops, describe(reason)) == ("torch", None, "mixed source dtypes float32/bfloat16")
    assert kernel_paths() == {"phase1": "cpu+torch", "read": "torch", "merge": "torch"}


def test_bf16_autocast_model_runs_the_fused_cpu_kernels(cpu_ops):
    """Under bf16 autocast the whole depth state is bf16 (the embedding included), so every
    two-phase read and merge of a Block AttnRes model runs the C++ kernels, forward and backward."""
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=128, dim=64, n_layers=2, n_heads=4, max_seq_len=16,
                      residual="block", attnres_block_size=2)  # fmt: skip
    model = Transformer(cfg)
    tokens = torch.randint(0, 128, (2, 8))
    reset_kernel_paths()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = cross_entropy(model(tokens), tokens)
    loss.backward()
    assert kernel_paths() == {"phase1": "cpu", "merge": "cpu"}
    assert all(p.grad is not None for n, p in model.named_parameters() if "residual" in n)


def test_kernel_paths_under_torch_compile_cost_no_graph_break_or_recompile():
    """Recording runs once while dynamo traces (assume_constant_result): one graph, no recompile."""
    from torch._dynamo.testing import CompileCounter

    blocks, partial, queries, _ = bf16_case()
    counter = CompileCounter()

    def reads(blocks, partial, queries):
        out, lse, _ = inter_block_read_chained(blocks, queries, EPS)
        return merge_partial_chained(out[1], lse[1], partial, queries[1], EPS)[0]

    compiled = torch.compile(reads, backend=counter, fullgraph=True)
    reset_kernel_paths()
    for _ in range(2):
        compiled(blocks, partial, queries).float().sum().backward()
    assert counter.frame_count == 1
    assert kernel_paths(reasons=True) == {
        "phase1": "torch (torch.compile tracing)",
        "merge": "torch (torch.compile tracing)",
    }


def test_importing_the_model_imports_neither_dynamo_nor_triton():
    """Triton reads TRITON_INTERPRET when it is imported: the model must import it only when a
    Triton read runs (an import at collection time broke every later interpreted test)."""
    import subprocess

    code = (
        "import sys, depthscale.model.transformer, depthscale.model.attnres_ops;"
        "print(sorted(m for m in ('triton', 'torch._dynamo') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


@needs_triton
def test_triton_reads_compile_into_one_graph_with_eager_results():
    """Under torch.compile the Triton reads are custom ops: the compiler keeps them in its graph
    (fullgraph=True raises on a graph break) and AOT autograd, through their fake versions and
    registered backward, gives the eager kernels' values and gradients exactly — eager reads chain
    (a block's two gradients summed in the kernel), compiled ones do not (autograd sums them), and
    a sum of two fp32 terms is the same either way."""
    from torch._dynamo.testing import CompileCounterWithBackend

    def reads(blocks, partial, queries):
        out, lse, blocks = inter_block_read_chained(blocks, queries, EPS)
        h, partial = merge_partial_chained(out[1], lse[1], partial, queries[1], EPS)
        nxt, _, _ = inter_block_read_chained([*blocks, partial], queries, EPS)
        return h + nxt[1]

    torch.manual_seed(0)
    values = [torch.randn(2, 5, 16, device=DEVICE) for _ in range(5)]

    def run(fn):
        *blocks, partial, queries = [v.clone().requires_grad_() for v in values]
        queries = queries[0, :2].detach().requires_grad_()  # [2, 16]
        h = fn(blocks, partial, queries)
        h.square().sum().backward()
        return [h.detach(), *(t.grad for t in (*blocks, partial, queries))]

    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(reads, backend=counter, fullgraph=True)
    with kernels.use_triton(True):
        reset_kernel_paths()
        eager = run(reads)
        assert kernel_paths() == {"phase1": "triton", "merge": "triton"}
        for _ in range(2):
            got = run(compiled)
            for a, b in zip(got, eager, strict=True):
                torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert counter.frame_count == 1
    graph_ops = {str(n.target) for g in counter.graphs for n in g.graph.nodes}
    assert any("depthscale_triton" in op for op in graph_ops), graph_ops
