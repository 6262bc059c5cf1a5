"""N-gram match attention (n-gram induction heads, N-Gram AD): reference, plan, eager and Triton paths."""

from .decode import NGramDecodeState
from .function import ngram_attention, ngram_attention_reference, ngram_match_matrix, ngram_plan
from .plan import NGramPlan
from .tokens import transition_ids

__all__ = [
    "NGramDecodeState",
    "NGramPlan",
    "ngram_attention",
    "ngram_attention_reference",
    "ngram_match_matrix",
    "ngram_plan",
    "transition_ids",
]
