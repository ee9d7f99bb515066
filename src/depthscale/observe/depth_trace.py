"""What the depth attention learned: per-sublayer softmax weights over sources (the paper's Fig. 8)
and the RMS of every sublayer's output across depth (Fig. 5).

Recording wraps the residual modules' `read`/`write` for the duration of one forward pass, so the
model code carries no tracing hooks.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import Tensor

from depthscale.model.attnres_ops import depth_weights
from depthscale.model.residual import AttnResidual, DepthState
from depthscale.model.transformer import Transformer


@dataclass
class DepthTrace:
    residual: str
    weights: list[list[float]] = field(default_factory=list)
    """Per reading sublayer (and the final output read): mean softmax weight of each source."""
    output_rms: list[float] = field(default_factory=list)
    """Per sublayer: RMS of its output f(norm(h)) over all tokens."""
    block_of_source: list[list[str]] = field(default_factory=list)
    """Per reading sublayer: source labels (b0 = embedding, b1.., p = partial sum)."""


def _labels(state: DepthState) -> list[str]:
    names = [f"b{i}" for i in range(len(state.blocks))]
    return names + (["p"] if state.partial is not None else [])


@contextlib.contextmanager
def _recording(model: Transformer, trace: DepthTrace) -> Iterator[None]:
    residuals = [r for layer in model.layers.values() for r in layer.residuals()]
    if model.output_residual is not None:
        residuals.append(model.output_residual)

    def wrap(res):
        read, write = res.read, res.write

        def traced_read(state: DepthState) -> Tensor:
            if isinstance(res, AttnResidual):
                w = depth_weights(state.sources(), res.pseudo_query, res.key_norm, res.eps)
                trace.weights.append(w.mean(dim=(1, 2)).tolist())
                trace.block_of_source.append(_labels(state))
            return read(state)

        def traced_write(state: DepthState, y: Tensor) -> DepthState:
            trace.output_rms.append(y.float().pow(2).mean().sqrt().item())
            return write(state, y)

        res.read, res.write = traced_read, traced_write

    for res in residuals:
        wrap(res)
    try:
        yield
    finally:
        for res in residuals:
            del res.read, res.write  # drop the instance overrides; the class methods show again


@torch.no_grad()
def trace_depth(model: Transformer, tokens: Tensor) -> DepthTrace:
    trace = DepthTrace(residual=model.cfg.residual)
    was_training = model.training
    model.eval()
    with _recording(model, trace):
        model(tokens)
    model.train(was_training)
    return trace


def plot_depth_trace(trace: DepthTrace, path: Path) -> Path:
    """Two panels: the depth-attention heatmap (AttnRes only) and output RMS per sublayer."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    has_weights = bool(trace.weights)
    fig, axes = plt.subplots(1, 2 if has_weights else 1, figsize=(12 if has_weights else 6, 5))
    axes = np.atleast_1d(axes)
    if has_weights:
        width = max(len(w) for w in trace.weights)
        grid = np.full((len(trace.weights), width), np.nan)
        for row, w in enumerate(trace.weights):
            grid[row, : len(w)] = w
        ax = axes[0]
        im = ax.imshow(grid, aspect="auto", cmap="viridis", vmin=0.0, vmax=1.0)
        ax.set_xlabel("source index (0 = embedding; last column of a row may be the partial sum)")
        ax.set_ylabel("reading sublayer (last row: final output)")
        ax.set_title(f"depth attention weights ({trace.residual} AttnRes)")
        fig.colorbar(im, ax=ax, fraction=0.046)
    ax = axes[-1]
    ax.plot(range(len(trace.output_rms)), trace.output_rms, marker="o")
    ax.set_xlabel("sublayer")
    ax.set_ylabel("output RMS")
    ax.set_yscale("log")
    ax.set_title(f"sublayer output magnitude ({trace.residual})")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
