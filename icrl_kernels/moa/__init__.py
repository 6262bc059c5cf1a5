"""Per-head Mixture-of-Attention gating (GPT2-DTMA): gate normalisation, per-head scaling and head merge."""

from .checks import GATES
from .function import mixture_of_heads, mixture_of_heads_reference
from .reference import gate_weights_reference

__all__ = ["GATES", "gate_weights_reference", "mixture_of_heads", "mixture_of_heads_reference"]
