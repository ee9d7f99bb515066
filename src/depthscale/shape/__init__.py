"""Torch-free facts at the bottom of the house, importing nothing of the project but its errors:
what a model is (`model.py`: block assignment, MoE layers, parameter and FLOP counts under one
convention) and what a layout is (`layout.py`: every degree including ep, the divisibility rules,
the sequence multiple, the expert shard, the mesh shapes). The model, the runtime, the planner,
the metrics and the config checks read them here and never restate them."""

from depthscale.shape.layout import EXPERT_SHARD_DIM, MESH_DIMS, Degrees
from depthscale.shape.model import ModelShape, block_assignment, is_moe_layer, moe_layers

__all__ = [
    "EXPERT_SHARD_DIM",
    "MESH_DIMS",
    "Degrees",
    "ModelShape",
    "block_assignment",
    "is_moe_layer",
    "moe_layers",
]
