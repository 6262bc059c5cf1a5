"""icrl-kernels: fused Triton kernels for in-context reinforcement learning transformers.

Every op has a readable eager reference (the spec), a Triton forward and backward registered as a
torch custom op, a public function and a thin module. CUDA tensors run Triton; CPU tensors run eager
PyTorch, or the Triton interpreter when ``TRITON_INTERPRET=1``; ``backend=`` overrides.

The public API: the names below, :mod:`icrl_kernels.modules` (every ``nn.Module``),
:mod:`icrl_kernels.validation` (the argument and value checks) and :mod:`icrl_kernels.testing` (parity
helpers for tests); see docs/architecture.md.
"""

from ._backend import BACKENDS, resolve_backend
from ._validation import VALUE_CHECK_MODES, device_side_value_checks, set_value_checks, value_checks
from .attention import gated_attention, gated_attention_reference
from .contrastive import (
    OvercompleteEmbeddingWarning,
    infonce_loss,
    infonce_loss_reference,
    orthonormal_embeddings,
    select_actions,
    select_actions_reference,
)
from .looped import inject_layer_norm, inject_layer_norm_reference
from .moa import mixture_of_heads, mixture_of_heads_reference
from .modules import ActionMap, LoopedBlock, MoAAttention, NGramAttention, SmearedKeyAttention
from .ngram import (
    NGramDecodeState,
    NGramPlan,
    ngram_attention,
    ngram_attention_reference,
    ngram_match_matrix,
    ngram_plan,
    transition_ids,
)
from .smeared import smeared_keys, smeared_keys_reference

__version__ = "0.1.0"

__all__ = [
    "BACKENDS",
    "VALUE_CHECK_MODES",
    "ActionMap",
    "LoopedBlock",
    "MoAAttention",
    "NGramAttention",
    "NGramDecodeState",
    "NGramPlan",
    "OvercompleteEmbeddingWarning",
    "device_side_value_checks",
    "gated_attention",
    "gated_attention_reference",
    "infonce_loss",
    "infonce_loss_reference",
    "inject_layer_norm",
    "inject_layer_norm_reference",
    "mixture_of_heads",
    "mixture_of_heads_reference",
    "ngram_attention",
    "ngram_attention_reference",
    "ngram_match_matrix",
    "ngram_plan",
    "orthonormal_embeddings",
    "resolve_backend",
    "select_actions",
    "select_actions_reference",
    "set_value_checks",
    "SmearedKeyAttention",
    "smeared_keys",
    "smeared_keys_reference",
    "transition_ids",
    "value_checks",
]
