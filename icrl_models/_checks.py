"""Argument checks of :mod:`icrl_models` that :mod:`icrl_kernels.validation` does not have: numpy-world values
(integer-likes, seeds, finite arrays) and the training configs' fields.

Each check raises ``TypeError`` for a value of the wrong kind and ``ValueError`` for a value of the
right kind out of range, and names the argument, so that a caller's mistake is reported where it is
made instead of as an ``AttributeError`` or a bare ``int()`` error deep inside numpy or torch. The
shared ones (``check_int``, ``check_generator``, the tensor checks) come from
:mod:`icrl_kernels.validation`: one set for both packages.
"""

from __future__ import annotations

import numbers
import sys

import numpy as np

# Neither torch nor icrl_kernels is imported here (nor at the top of the environments' modules, which import
# icrl_kernels.validation inside the functions that need it): the environments (and gymnasium's plugin
# loading) use these checks and must not pay torch's seconds-long import. A value can only be a tensor if
# torch is already imported.


def _torch():
    return sys.modules.get("torch")


def is_integer(value) -> bool:
    """True for a Python int or numpy integer, or a 0-d integer numpy array / torch tensor (not bool)."""
    if isinstance(value, (bool, np.bool_)):
        return False
    if isinstance(value, (int, np.integer)):
        return True
    if isinstance(value, np.ndarray):
        return value.ndim == 0 and value.dtype.kind in "iu"
    torch = _torch()
    if torch is not None and isinstance(value, torch.Tensor):
        return (
            value.dim() == 0 and not value.is_floating_point() and not value.is_complex() and value.dtype != torch.bool
        )
    return False


def check_float(value, name: str, *, low: float | None = None, finite: bool = True) -> float:
    """``value`` as a Python float, checked to be a real number (not a bool or a string), finite, ``>= low``."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a real number, got {type(value).__name__} {value!r}")
    value = float(value)
    if (finite and not np.isfinite(value)) or np.isnan(value):
        raise ValueError(f"{name} must be finite, got {value}")
    if low is not None and not value >= low:
        raise ValueError(f"{name} must be >= {low}, got {value}")
    return value


def check_seed(seed, name: str = "seed"):
    """A seed numpy accepts: None, a non-negative int, a sequence of them, a ``SeedSequence``, or a
    ``numpy.random.Generator`` / ``BitGenerator``. Returned unchanged (ints as Python ints)."""
    if seed is None or isinstance(seed, (np.random.SeedSequence, np.random.Generator, np.random.BitGenerator)):
        return seed
    if is_integer(seed):
        seed = int(seed)
        if seed < 0:
            raise ValueError(f"{name} must be a non-negative int, got {seed}")
        return seed
    if isinstance(seed, (list, tuple)) and seed and all(is_integer(s) for s in seed):
        if any(int(s) < 0 for s in seed):
            raise ValueError(f"{name} must hold non-negative ints, got {seed}")
        return seed
    raise TypeError(f"{name} must be None or a non-negative int, got {type(seed).__name__} {seed!r}")


def check_finite(array: np.ndarray, name: str) -> np.ndarray:
    """``array`` (a float numpy array), checked to hold no NaN or infinity."""
    if not np.isfinite(array).all():
        raise ValueError(f"{name} must be finite, got NaN or infinite values")
    return array


#: Optimiser and schedule fields the training configs share (icrl-train and the experiments), by the range
#: each must lie in. torch would take some wrong values without a word (clipping gradients to a norm <= 0
#: zeroes every update or flips its sign) and refuse others only once training starts, after the data.
TRAINING_FIELD_RANGES = (
    ("> 0", lambda value: value > 0, ("learning_rate", "grad_clip")),
    (">= 0", lambda value: value >= 0, ("weight_decay",)),
    ("in [0, 1)", lambda value: 0 <= value < 1, ("beta1", "beta2", "label_smoothing", "dropout")),
)
#: Integer fields of the same configs: counts >= 1 (``step % checkpoint_every``), and ``warmup_steps >= 0``.
TRAINING_COUNTS = ("steps", "batch_size", "log_every", "checkpoint_every")


#: What a trainer does with a step whose loss or gradient norm is not finite (:mod:`icrl_models.nonfinite`).
NONFINITE_POLICIES = ("stop", "skip")


def check_nonfinite_policy(policy: object) -> str:
    """``policy`` if it is one of :data:`NONFINITE_POLICIES`; ``ValueError`` naming ``nonfinite`` otherwise."""
    if policy not in NONFINITE_POLICIES:
        raise ValueError(f"nonfinite must be one of {NONFINITE_POLICIES}, got {policy!r}")
    return policy


def check_training_fields(config) -> None:
    """Check the optimiser and schedule fields that ``config`` has (see :data:`TRAINING_FIELD_RANGES` and
    :data:`TRAINING_COUNTS`); a field it lacks, or one still ``None`` (a preset fills it later), is skipped.
    Raises ``TypeError`` / ``ValueError`` naming the field."""
    from icrl_kernels.validation import check_int  # here, not at the top: the environments import without torch

    def present(names):
        return [name for name in names if getattr(config, name, None) is not None]

    for name in present(TRAINING_COUNTS):
        check_int(getattr(config, name), name, min_value=1)
    for name in present(("warmup_steps",)):
        check_int(getattr(config, name), name, min_value=0)
    if hasattr(config, "nonfinite"):
        check_nonfinite_policy(config.nonfinite)
    for bounds, inside, names in TRAINING_FIELD_RANGES:
        for name in present(names):
            value = check_float(getattr(config, name), name)  # finite: NaN and inf fail here
            if not inside(value):
                raise ValueError(f"{name} must be {bounds}, got {value}")
