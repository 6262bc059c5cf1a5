"""Argument checks of the fused input injection + LayerNorm, shared by :func:`inject_layer_norm` and its
checked reference."""

from __future__ import annotations

from .._validation import FLOAT_DTYPES, check_positive_float, check_same_device, check_shape, check_tensor


def check_inject_layer_norm_args(
    y: object, prompt: object, pos: object, weight: object, bias: object, eps: object
) -> float:
    """The argument checks of :func:`inject_layer_norm` and its reference (shapes, dtypes, devices, ``eps``;
    no tensor value is read); return ``eps`` as a float.

    Raises:
        TypeError: a non-tensor or non-float input, ``y`` and ``prompt`` of different dtypes.
        ValueError: a wrong rank, a zero width ``D``, a shape that does not match ``prompt`` (the message
            names the argument), tensors on different devices, ``eps`` not > 0 and finite.
    """
    check_tensor(prompt, "prompt", ndim=3, dtypes=FLOAT_DTYPES)
    batch, length, width = prompt.shape
    if width == 0:
        raise ValueError(f"prompt must have a nonzero model width D (last dim), got shape {tuple(prompt.shape)}")
    devices = {"prompt": prompt}
    if y is not None:
        check_tensor(y, "y", ndim=3, dtypes=FLOAT_DTYPES)
        check_shape(y, "y", tuple(prompt.shape), "prompt.shape")
        if y.dtype != prompt.dtype:
            raise TypeError(f"y must have prompt's dtype ({prompt.dtype}), got {y.dtype}; cast one of them first")
        devices["y"] = y
    if pos is not None:
        check_tensor(pos, "pos", ndim=2, dtypes=FLOAT_DTYPES)
        check_shape(pos, "pos", (length, width), "(prompt.shape[1], prompt.shape[2]) = (L, D)")
        devices["pos"] = pos
    check_tensor(weight, "weight", ndim=1, dtypes=FLOAT_DTYPES)
    check_shape(weight, "weight", (width,), "(prompt.shape[2],) = (D,)")
    devices["weight"] = weight
    if bias is not None:
        check_tensor(bias, "bias", ndim=1, dtypes=FLOAT_DTYPES)
        check_shape(bias, "bias", (width,), "(prompt.shape[2],) = (D,)")
        devices["bias"] = bias
    check_same_device(**devices)
    return check_positive_float(eps, "eps")
