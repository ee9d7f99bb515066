"""`train.compile` compiles a bounded number of graphs whatever the depth: each block compiled as the
trainer does (`TransformerBlock.compile`, `setup.compile_blocks`), counted by a backend that counts
what dynamo hands it (one call per graph it produces, recompiles included: what costs Inductor's
compile time on a GPU) and the forward and backward graphs AOT autograd derives from each.

Before: a Block AttnRes block compiled whole was one graph per layer (its depth state grows with
depth), 16 and 64 graphs at 16 and 64 layers."""

from __future__ import annotations

import copy

import pytest
import torch

from depthscale.config import ModelConfig
from depthscale.model.transformer import Transformer, cross_entropy

VOCAB, T = 32, 8


class GraphCounter:
    """A torch.compile backend (AOT autograd, eager kernels) that counts graphs."""

    def __init__(self) -> None:
        self.dynamo = self.forward = self.backward = 0

    def __call__(self, gm, example_inputs):
        from functorch.compile import make_boxed_func
        from torch._dynamo.backends.common import aot_autograd

        def count(kind: str):
            def compiler(graph, inputs):
                setattr(self, kind, getattr(self, kind) + 1)
                return make_boxed_func(graph.forward)

            return compiler

        self.dynamo += 1
        return aot_autograd(fw_compiler=count("forward"), bw_compiler=count("backward"))(
            gm, example_inputs
        )

    def counts(self) -> tuple[int, int, int]:
        return self.dynamo, self.forward, self.backward


def _model(n_layers: int, residual: str, **kw) -> Transformer:
    cfg = ModelConfig(
        vocab_size=VOCAB,
        dim=16,
        n_layers=n_layers,
        n_heads=1,
        max_seq_len=T,
        residual=residual,
        attnres_n_blocks=min(8, n_layers),
        **kw,
    )
    torch.manual_seed(0)
    return Transformer(cfg)


def _grads(model: Transformer, tokens: torch.Tensor) -> list[torch.Tensor]:
    model.zero_grad(set_to_none=True)
    cross_entropy(model(tokens), tokens).backward()
    return [p.grad.clone() for p in model.parameters()]


@pytest.fixture(autouse=True)
def _fresh_dynamo_one_thread():
    """No graphs cached from other tests; one thread: a d = 16 read gains nothing from two, and
    spinning threads on a loaded machine made a step of 64 layers ten times slower."""
    import torch._dynamo

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()
    torch.set_num_threads(threads)


def _compile(model: Transformer) -> GraphCounter:
    counter = GraphCounter()
    for layer in model.layers.values():
        layer.compile(backend=counter, dynamic=False)  # as setup.compile_blocks does
    return counter


def test_block_attnres_compiles_two_graphs_at_16_and_64_layers():
    """Block AttnRes with 8 blocks (2 and 8 layers a block; 9 sources at the last read): at both
    depths two graphs — attention and MLP, each its norm and body — with one forward and one
    backward graph each, none recompiled by a second step; and the compiled model's gradients
    bitwise the eager model's (aot_eager runs the traced ops as they are, and the depth reads run
    eagerly anyway)."""
    tokens = torch.randint(0, VOCAB, (1, T), generator=torch.Generator().manual_seed(1))
    for n_layers in (16, 64):
        torch._dynamo.reset()
        model = _model(n_layers, "block")
        eager = _grads(model, tokens) if n_layers == 16 else None
        counter = _compile(model)
        compiled = _grads(model, tokens)
        assert counter.counts() == (2, 2, 2), (n_layers, counter.counts())
        _grads(model, tokens)
        assert counter.counts() == (2, 2, 2), f"a second step recompiled at {n_layers} layers"
        for name, a, b in zip(dict(model.named_parameters()), compiled, eager or compiled):
            torch.testing.assert_close(a, b, rtol=0, atol=0, msg=name)


@pytest.mark.parametrize(
    ("residual", "kw", "graphs"),
    [
        ("full", {}, 2),
        ("block", {"parallel_block": True}, 1),  # one sublayer a layer: one part
    ],
)
def test_every_residual_compiles_the_same_graphs_at_every_depth(residual, kw, graphs):
    """Full AttnRes (9 and 33 sources) and Block AttnRes in parallel blocks, at 4 and 16 layers:
    the same graphs at both depths. (The standard residual compiles whole: one graph, as before.)"""
    tokens = torch.randint(0, VOCAB, (1, T), generator=torch.Generator().manual_seed(1))
    for n_layers in (4, 16):
        torch._dynamo.reset()
        model = _model(n_layers, residual, **kw)
        counter = _compile(model)
        _grads(model, tokens)
        assert counter.counts() == (graphs, graphs, graphs), (n_layers, counter.counts())


def test_an_attnres_block_compiles_its_sublayer_parts_and_a_standard_one_compiles_whole():
    """What `compile` compiled, by name (the trainer's `compile_blocks` calls it on every block).
    A copy is not compiled, as for `nn.Module.compile`: the compiled parts are bound to the
    original block and would run its parameters, not the copy's."""
    block, standard = _model(2, "block"), _model(2, "standard")
    for model in (block, standard):
        for layer in model.layers.values():
            assert layer.compiled_parts == []
            layer.compile(backend="eager")
    assert block.layers["0"].compiled_parts == ["normed_attention", "normed_mlp"]
    assert standard.layers["0"].compiled_parts == ["layer"]
    assert copy.deepcopy(block).layers["0"].compiled_parts == []
