"""Reference in-context RL models built on :mod:`icrl_kernels` layers."""

from .ad import ADConfig, ADDecodeState, ADModel, action_loss
from .dt_moa import DecisionTransformerMoA, DTMoAConfig, TrajectoryWindows, rollout_dt
from .looped import LoopedConfig, LoopedTransformer

__all__ = [
    "ADConfig",
    "ADDecodeState",
    "ADModel",
    "DTMoAConfig",
    "DecisionTransformerMoA",
    "LoopedConfig",
    "LoopedTransformer",
    "TrajectoryWindows",
    "action_loss",
    "rollout_dt",
]
