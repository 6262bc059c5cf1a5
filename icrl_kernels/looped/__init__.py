"""Looped transformers: the input injection ``Y_t + P + pos`` fused with the block's first LayerNorm."""

from .function import inject_layer_norm, inject_layer_norm_reference

__all__ = ["inject_layer_norm", "inject_layer_norm_reference"]
