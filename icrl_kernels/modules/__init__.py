"""Thin ``nn.Module`` wrappers around the ops."""

from .ngram import NGramAttention

__all__ = ["NGramAttention"]
