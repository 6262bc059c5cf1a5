"""Smeared keys (induction-heads lecture): per-head blend of each key with the previous position's key."""

from .function import smeared_keys, smeared_keys_reference

__all__ = ["smeared_keys", "smeared_keys_reference"]
