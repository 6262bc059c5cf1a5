"""Argument checks of gated, smeared causal attention, shared by :func:`gated_attention` and its checked
reference."""

from __future__ import annotations

from .._validation import FLOAT_DTYPES, check_choice, check_same_device, check_shape, check_tensor
from ..moa.checks import GATES


def check_gated_attention_args(
    q: object, k: object, v: object, gate_logits: object, gate: object, smear_alpha: object
) -> None:
    """The argument checks of :func:`gated_attention` and its reference (shapes, dtypes, devices only).

    Raises:
        TypeError: a non-tensor or non-float input, ``q``, ``k``, ``v`` of different dtypes.
        ValueError: a wrong rank or shape, tensors on different devices, an unknown ``gate``.
    """
    check_tensor(q, "q", ndim=4, dtypes=FLOAT_DTYPES)
    check_tensor(k, "k", ndim=4, dtypes=FLOAT_DTYPES)
    check_tensor(v, "v", ndim=4, dtypes=FLOAT_DTYPES)
    check_shape(k, "k", tuple(q.shape), "q.shape, [B, H, L, Dh]")
    check_shape(v, "v", tuple(q.shape), "q.shape, [B, H, L, Dh]")
    for name, tensor in (("k", k), ("v", v)):
        if tensor.dtype != q.dtype:
            raise TypeError(f"{name} must have q's dtype {q.dtype}, got {tensor.dtype}")
    devices = {"q": q, "k": k, "v": v}
    batch, heads, length, _ = q.shape
    if gate_logits is not None:
        check_tensor(gate_logits, "gate_logits", ndim=3, dtypes=FLOAT_DTYPES)
        check_shape(
            gate_logits, "gate_logits", (batch, length, heads), "(q.shape[0], q.shape[2], q.shape[1]), [B, L, H]"
        )
        devices["gate_logits"] = gate_logits
    if smear_alpha is not None:
        check_tensor(smear_alpha, "smear_alpha", ndim=1, dtypes=FLOAT_DTYPES)
        check_shape(smear_alpha, "smear_alpha", (heads,), "(q.shape[1],), one logit per head")
        devices["smear_alpha"] = smear_alpha
    check_same_device(**devices)
    check_choice(gate, "gate", GATES)
