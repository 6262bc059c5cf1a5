"""Causal flash attention with an optional per-head gate epilogue (MoA) and smeared-key prologue."""

from .function import gated_attention, gated_attention_reference

__all__ = ["gated_attention", "gated_attention_reference"]
