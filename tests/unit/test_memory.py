"""Recompute and offload change memory, never results."""

import gc
import weakref

import pytest
import torch
from torch import nn

from depthscale.config import ModelConfig
from depthscale.model.transformer import Transformer, cross_entropy
from depthscale.train.offload import (
    DEFAULT_MIN_BYTES,
    DEFAULT_PREFETCH,
    OffloadStats,
    _Offloaded,
    _PackOrder,
    offload_activations,
    retained_bytes,
    saved_activation_bytes,
)


def _model(residual, recompute):
    torch.manual_seed(0)
    cfg = ModelConfig(
        vocab_size=61,
        dim=32,
        n_layers=3,
        n_heads=4,
        n_kv_heads=2,
        max_seq_len=32,
        residual=residual,
        attnres_block_size=3,
    )
    model = Transformer(cfg)
    model.set_recompute(recompute)
    return model


@pytest.mark.parametrize("residual", ["standard", "full", "block"])
def test_recompute_is_exact_and_saves_memory(residual):
    """Every mode gives bitwise the loss and gradients of `none`, and keeps less for backward, in
    the order of what it recomputes: selective (the ops between GEMMs) < sublayer (whole bodies) <
    full (whole layers, reads included). Bytes are everything the forward left allocated."""
    tokens = torch.randint(0, 61, (2, 32), generator=torch.Generator().manual_seed(3))
    results = {}
    for mode in ("none", "selective", "sublayer", "full"):
        model = _model(residual, mode)
        kept = []
        held = retained_bytes(lambda m=model, k=kept: k.append(cross_entropy(m(tokens), tokens)))
        kept[0].backward()
        results[mode] = (
            kept[0].item(),
            {n: p.grad for n, p in model.named_parameters() if p.grad is not None},
            held,
        )
    base_loss, base_grads, base_held = results["none"]
    for mode in ("selective", "sublayer", "full"):
        loss, grads, _ = results[mode]
        assert loss == base_loss
        assert grads.keys() == base_grads.keys()
        for name, g in base_grads.items():
            torch.testing.assert_close(grads[name], g, atol=0, rtol=0, msg=f"{mode}: {name}")
    held = {mode: r[2] for mode, r in results.items()}
    assert held["full"] < held["sublayer"] < held["selective"] < 0.8 * held["none"], held


def test_recompute_is_part_of_the_layer():
    """Set on the model before any wrapper, shown by print(model), and a bad mode is refused."""
    model = _model("block", "selective")
    assert all(layer.recompute == "selective" for layer in model.layers.values())
    assert "recompute=selective" in repr(model)
    assert type(model.layers["0"]).forward is type(model.layers["0"]).__dict__["forward"]
    assert "forward" not in vars(model.layers["0"])  # no instance patch
    with pytest.raises(ValueError, match="allowed: 'none', 'selective', 'sublayer', 'full'"):
        model.set_recompute("some")


def test_retained_bytes_counts_what_is_left_allocated():
    kept = []

    def fn():
        a = torch.ones(1000, 250)  # 1 MB, kept
        b = torch.ones(500, 250)  # 0.5 MB, freed
        kept.append(a * 2)  # 1 MB, kept
        del a, b

    assert retained_bytes(fn) == 1_000_000


def _grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _autocast(dtype):
    return torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16)


def _saved(fn):
    """Every tensor autograd saves while running fn(), in pack order (one entry per save)."""
    saved = []

    def pack(t):
        saved.append(t.detach())
        return t.detach()

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return saved


def _nbytes(t):
    return t.numel() * t.element_size()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_offload_keeps_parameters_and_results_of_the_model(dtype):
    """The Transformer, every size offloaded (min_bytes=0): the gradients are the plain run's, and
    what stays as a parameter is exactly the saved tensors that are a parameter's storage or (under
    autocast) equal to a parameter's bf16 cast or its transpose, found here by value."""
    tokens = torch.randint(0, 61, (2, 16), generator=torch.Generator().manual_seed(4))
    model = _model("block", "none")
    with torch.no_grad():  # zero-initialised pseudo-queries would match zero activations by value
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
    with _autocast(dtype):
        cross_entropy(model(tokens), tokens).backward()
    ref = _grads(model)
    model.zero_grad()
    with _autocast(dtype):
        saved = _saved(lambda: cross_entropy(model(tokens), tokens))
    storages = {p.untyped_storage().data_ptr() for p in model.parameters()}
    casts = [p.detach().to(dtype) for p in model.parameters()]
    casts += [c.t() for c in casts if c.dim() == 2]

    def is_param(t):
        if t.untyped_storage().data_ptr() in storages:
            return True
        return any(c.shape == t.shape and c.dtype == t.dtype and torch.equal(c, t) for c in casts)

    params = [_nbytes(t) for t in saved if is_param(t)]
    acts = [_nbytes(t) for t in saved if not is_param(t)]
    views = {}  # each activation moved once: saves of one storage, view and version share it
    for t in saved:
        if not is_param(t):
            views[(t.untyped_storage().data_ptr(), t.storage_offset(), t.shape, t.stride())] = t
    moved = [_nbytes(t) for t in views.values()]
    with _autocast(dtype), offload_activations(min_bytes=0) as stats:
        loss = cross_entropy(model(tokens), tokens)
    loss.backward()
    assert (stats.param_tensors, stats.param_bytes) == (len(params), sum(params)) != (0, 0)
    assert (stats.tensors, stats.bytes) == (len(moved), sum(moved))
    assert stats.tensors + stats.shared_tensors == len(acts)
    assert stats.bytes + stats.shared_bytes == sum(acts)
    assert stats.tiny_tensors == stats.tiny_bytes == 0
    for n, g in ref.items():
        torch.testing.assert_close(model.get_parameter(n).grad, g, atol=0, rtol=0, msg=n)


B, D, H = 64, 64, 256


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(D, H), nn.GELU(), nn.Linear(H, D))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_offloaded_bytes_are_the_activations(dtype):
    """Linear-GELU-Linear-square on an input that needs no grad saves: the input and the output
    (B×D each), the hidden state before and after GELU (B×H each), and the second weight for the
    hidden state's gradient (D×H: in fp32 a view of the parameter, under bf16 autocast its cast).
    Only the activations are offloaded; the weight (4.19 of the 4.21 MB issue #15 saw offloaded
    for a 1024×1024 linear) stays, counted as a parameter."""
    model, x = _mlp(), torch.randn(B, D, generator=torch.Generator().manual_seed(1))
    size = torch.empty((), dtype=dtype).element_size()
    with _autocast(dtype):
        model(x).square().sum().backward()
    ref = _grads(model)
    model.zero_grad()
    with _autocast(dtype), offload_activations(min_bytes=0) as stats:
        loss = model(x).square().sum()
    assert (stats.tensors, stats.bytes) == (4, (2 * B * D + 2 * B * H) * size)
    assert (stats.param_tensors, stats.param_bytes) == (1, D * H * size)
    # the repo's storage accounting agrees: it counts the cast copy (not a parameter's storage)
    with _autocast(dtype):
        by_storage = saved_activation_bytes(lambda: model(x).square(), list(model.parameters()))
    cast = stats.param_bytes if dtype == torch.bfloat16 else 0
    assert by_storage == stats.bytes + cast
    loss.backward()
    assert (stats.prefetch_misses, stats.prefetch_hits) == (1, 3)  # backward: reverse pack order
    for n, g in ref.items():
        torch.testing.assert_close(model.get_parameter(n).grad, g, atol=0, rtol=0, msg=n)


def test_tiny_threshold():
    """Strictly below min_bytes stays; the default keeps nothing on CPU, where nothing is copied."""
    model, x = _mlp(), torch.randn(B, D)
    with offload_activations(min_bytes=B * H * 4) as stats:  # the hidden states are exactly that
        model(x).sum()
    assert (stats.tensors, stats.bytes) == (2, 2 * B * H * 4)
    assert (stats.tiny_tensors, stats.tiny_bytes) == (1, B * D * 4)
    with offload_activations(min_bytes=B * H * 4 + 1) as stats:
        model(x).sum()
    assert (stats.tensors, stats.tiny_tensors, stats.tiny_bytes) == (0, 3, (B * D + 2 * B * H) * 4)
    assert stats.param_bytes == D * H * 4  # a parameter is a parameter, whatever its size
    with offload_activations() as stats:
        model(x).sum()
    assert (stats.tensors, stats.tiny_tensors) == (3, 0) and DEFAULT_MIN_BYTES == 64 * 1024
    stats.reset()
    assert stats == OffloadStats()


def test_frozen_parameters_need_params():
    """A weight that needs no grad is a leaf like any input: only `params` tells them apart. (Its
    layer then saves the weight and not its input, the hidden state after GELU.)"""
    model, x = _mlp(), torch.randn(B, D)
    model[2].weight.requires_grad_(False)
    with offload_activations(min_bytes=0) as stats:
        model(x).sum()
    assert stats.param_tensors == 0 and stats.bytes == (B * D + B * H + D * H) * 4
    with offload_activations(min_bytes=0, params=model.parameters()) as stats:
        model(x).sum()
    assert (stats.param_tensors, stats.bytes) == (1, (B * D + B * H) * 4)


def test_offload_under_recompute_keeps_results():
    """Checkpointed regions save through their own hooks; what is left offloads as before."""
    tokens = torch.randint(0, 61, (2, 16))
    for mode in ("selective", "full"):
        model = _model("block", mode)
        cross_entropy(model(tokens), tokens).backward()
        ref = _grads(model)
        model.zero_grad()
        with offload_activations() as stats:
            loss = cross_entropy(model(tokens), tokens)
        loss.backward()
        unpacked = stats.prefetch_hits + stats.prefetch_misses
        assert stats.tensors > 0 and unpacked == stats.tensors + stats.shared_tensors
        for n, g in ref.items():
            torch.testing.assert_close(model.get_parameter(n).grad, g, atol=0, rtol=0, msg=n)


def test_graph_dropped_without_backward_is_freed():
    """Kept tensors go back detached: a node saving its own output (exp) forms no reference cycle,
    so an unused graph is freed at once, not at the next garbage collection."""
    x = torch.randn(1000, requires_grad=True)
    gc.disable()
    try:
        for min_bytes in (0, 10**9):  # offloaded, then kept as tiny
            with offload_activations(min_bytes=min_bytes) as stats:
                y = x.exp()
            alive = weakref.ref(y)
            del y
            assert alive() is None and stats.tensors + stats.tiny_tensors == 1
    finally:
        gc.enable()


def _entries(n):
    entries = [_Offloaded(torch.device("cpu"), torch.empty(0)) for _ in range(n)]
    order = _PackOrder(ahead=2)
    for e in entries:
        order.add(e)
    return order, entries


def _unpack(order, e):
    """`_Offloader.unpack` with the copies left out: the pack positions of what it fetches."""
    fetched = order.to_fetch(e)
    for x in fetched:
        x.pending = x.host
    e.unpacks += 1
    if e.used:
        e.pending = None
    return [x.positions[-1] for x in fetched]


def test_prefetch_order():
    """Backward unpacks entry i: fetch it (unless already under way) and the 2 nearest earlier
    entries that are alive and unused; entries under way count towards the 2 but are not fetched
    again."""
    order, e = _entries(7)

    def unpack(i):
        return _unpack(order, e[i])

    assert unpack(6) == [6, 5, 4]
    assert unpack(5) == [3]  # 4 under way
    assert unpack(5) == [5]  # a second unpack (retain_graph) fetches it again
    assert unpack(4) == [2]
    e[1] = None  # the node that saved it is gone: skipped
    assert unpack(2) == [0]  # 2 under way, 1 skipped
    assert unpack(3) == []  # out of order: 3 and 0 under way, 2 used, 1 gone
    assert unpack(0) == []


def test_a_tensor_saved_again_is_fetched_once_and_kept_to_its_last_use():
    """Entries a b c, then a saved again (d): backward unpacks d's save of a first, fetching a and
    then c and b; a's copy stays under way through its second unpack and is dropped after it."""
    a, b, c = (_Offloaded(torch.device("cpu"), torch.empty(0)) for _ in range(3))
    order = _PackOrder(ahead=2)
    for x in (a, b, c, a):
        order.add(x)
    assert (a.positions, a.saves) == ([0, 3], 2)
    assert _unpack(order, a) == [3, 2, 1]  # a, then c and b (a's own first save is not a peer)
    assert a.pending is not None and not a.used
    assert _unpack(order, c) == [] and _unpack(order, b) == []
    assert _unpack(order, a) == []  # still on the device: no second copy back
    assert a.used and a.pending is None


def _block_model(n_layers):
    torch.manual_seed(0)
    cfg = ModelConfig(
        vocab_size=61, dim=32, n_layers=n_layers, n_heads=4, n_kv_heads=2, max_seq_len=32,
        residual="block", attnres_block_size=2,
    )  # fmt: skip
    return Transformer(cfg)


def test_each_attnres_block_goes_to_host_once(monkeypatch):
    """Block AttnRes saves every completed block sum again at each later block's phase-1 read: an
    8-layer model (4 blocks) saved the first block sum 8 times. Copies to the host (counted where
    the offloader makes them) happen once per storage, view and version; results unchanged."""
    from depthscale.train import offload

    model, tokens = _block_model(8), torch.randint(0, 61, (2, 16))
    cross_entropy(model(tokens), tokens).backward()
    ref = _grads(model)
    model.zero_grad()
    copies: dict[tuple, int] = {}
    to_host = offload._Offloader._to_host

    def counted(self, t):
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), t.shape, t.stride(), t._version)
        copies[key] = copies.get(key, 0) + 1
        return to_host(self, t)

    monkeypatch.setattr(offload._Offloader, "_to_host", counted)
    with offload_activations(min_bytes=0) as stats:
        loss = cross_entropy(model(tokens), tokens)
    assert max(copies.values()) == 1 and len(copies) == stats.tensors
    assert stats.shared_tensors >= 8  # the block sums, read again by every later block
    loss.backward()
    for n, g in ref.items():
        torch.testing.assert_close(model.get_parameter(n).grad, g, atol=0, rtol=0, msg=n)


def test_prefetch_by_layer_brings_back_a_layer_ahead(monkeypatch):
    """Given the layers the forward ran, backward's prefetch window is one layer's worth of
    offloaded tensors (here more than the default 2), and backward misses no more than with 2."""
    from depthscale.train import offload

    model, tokens = _block_model(4), torch.randint(0, 61, (2, 16))
    orders = []
    offloader = offload._Offloader.__init__

    def recorded(self, *args, **kwargs):
        offloader(self, *args, **kwargs)
        orders.append(self)

    monkeypatch.setattr(offload._Offloader, "__init__", recorded)
    misses = {}
    for layers in (None, 4):
        with offload_activations(min_bytes=0, layers=layers) as stats:
            loss = cross_entropy(model(tokens), tokens)
        loss.backward()
        misses[layers] = stats.prefetch_misses
    by_count, by_layer = orders
    assert by_count.order.ahead == DEFAULT_PREFETCH
    assert by_layer.order.ahead == -(-by_layer.moved // 4) > DEFAULT_PREFETCH
    assert misses[4] <= misses[None]
