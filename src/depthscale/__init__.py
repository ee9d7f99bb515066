"""depthscale: pre-training language models whose residual stream is an Attention Residual."""

__version__ = "0.1.0"
