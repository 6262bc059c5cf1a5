"""Thin ``nn.Module`` wrappers around the ops."""

from .action_map import ActionMap
from .gpt2_block import GPT2MLP, GPT2Block
from .looped import LoopedBlock
from .moa_attention import ATTENTION_IMPLEMENTATIONS, MoAAttention
from .ngram import NGramAttention
from .smeared_attention import SmearedKeyAttention

__all__ = [
    "ATTENTION_IMPLEMENTATIONS",
    "ActionMap",
    "GPT2Block",
    "GPT2MLP",
    "LoopedBlock",
    "MoAAttention",
    "NGramAttention",
    "SmearedKeyAttention",
]
