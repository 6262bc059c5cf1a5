"""Contrastive action scoring (Headless-AD): orthonormal action maps, fused InfoNCE, action selection."""

from .embeddings import OvercompleteEmbeddingWarning, orthonormal_embeddings
from .function import (
    action_logits_reference,
    infonce_loss,
    infonce_loss_reference,
    select_actions,
    select_actions_reference,
)

__all__ = [
    "OvercompleteEmbeddingWarning",
    "action_logits_reference",
    "infonce_loss",
    "infonce_loss_reference",
    "orthonormal_embeddings",
    "select_actions",
    "select_actions_reference",
]
