"""Argument checks of smeared keys, shared by :func:`smeared_keys` and its checked reference."""

from __future__ import annotations

from .._validation import FLOAT_DTYPES, check_same_device, check_shape, check_tensor


def check_smeared_keys_args(k: object, alpha: object) -> None:
    """The argument checks of :func:`smeared_keys` and its reference (shapes, dtypes, devices only).

    Raises:
        TypeError: a non-tensor or non-float input. ValueError: ``k`` not 4-D, ``alpha`` not
            ``[k.shape[1]]``, tensors on different devices.
    """
    check_tensor(k, "k", ndim=4, dtypes=FLOAT_DTYPES)
    check_tensor(alpha, "alpha", ndim=1, dtypes=FLOAT_DTYPES)
    check_shape(alpha, "alpha", (k.shape[1],), "(k.shape[1],), one logit per head")
    check_same_device(k=k, alpha=alpha)
