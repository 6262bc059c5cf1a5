"""Reference in-context RL models built on :mod:`icrl_kernels` layers."""

from .ad import ADConfig, ADDecodeState, ADModel, action_loss

__all__ = ["ADConfig", "ADDecodeState", "ADModel", "action_loss"]
