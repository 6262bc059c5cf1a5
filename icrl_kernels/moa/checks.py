"""Argument checks of Mixture-of-Attention gating, shared by :func:`mixture_of_heads` and its checked reference."""

from __future__ import annotations

from .._validation import FLOAT_DTYPES, check_choice, check_same_device, check_shape, check_tensor

#: Gate normalisations, in the order the Triton kernels number them.
GATES: tuple[str, ...] = ("softmax", "sigmoid", "linear")


def check_mixture_of_heads_args(head_out: object, gate_logits: object, gate: object) -> None:
    """The argument checks of :func:`mixture_of_heads` and its reference (shapes, dtypes, devices only).

    Raises:
        TypeError: a non-tensor or non-float input. ValueError: a wrong rank, ``gate_logits`` not
            ``head_out.shape[:3]``, tensors on different devices, an unknown ``gate``.
    """
    check_tensor(head_out, "head_out", ndim=4, dtypes=FLOAT_DTYPES)
    check_tensor(gate_logits, "gate_logits", ndim=3, dtypes=FLOAT_DTYPES)
    check_shape(gate_logits, "gate_logits", tuple(head_out.shape[:3]), "head_out.shape[:3], [B, L, H]")
    check_same_device(head_out=head_out, gate_logits=gate_logits)
    check_choice(gate, "gate", GATES)
