"""The custom-op pattern every op follows, written once.

Each op is a pair of registered operators (forward and backward) with fake (meta) implementations,
linked by ``register_autograd``. Registering ops this way makes them single nodes for ``torch.compile``
(no graph breaks on data-dependent kernels), exportable with ``torch.export``, and checkable with
``torch.library.opcheck``.

Two refinements, both in :func:`differentiable_op` and :func:`inference_op` so that every op gets them:

* **Registration.** An op whose implementation is *traceable* (only torch ops and kernel launches through
  :func:`icrl_kernels._triton.launch`, no host reads of tensor values) is registered with
  ``torch.library.triton_op`` where torch has it (>= 2.6): ``torch.compile`` then traces into it, so
  Inductor sees the Triton kernels (and the eager path's torch ops) instead of an opaque call, while
  ``torch.export`` still keeps the op as one node. Other ops, older torch, and processes where Triton runs
  on its CPU interpreter (whose kernels cannot run on fake tensors) use ``torch.library.custom_op``.
  ``ICRL_TRITON_OP=0`` forces ``custom_op`` everywhere (see :func:`uses_triton_op`).
* **Eager fast path.** A call through the dispatcher costs several Python layers per op (the Autograd
  kernel, a generated ``autograd.Function``, the redispatch, the backend wrapper, aliasing checks), for
  the forward and again for the backward op. In plain eager calls (no ``torch.compile`` tracing, no
  dispatch or function modes, no functorch transforms, no JIT tracing, plain tensors only) the returned
  op instead runs the same forward and backward Python functions through one ``torch.autograd.Function``.
  Outputs, gradients, ``requires_grad`` flags and errors are the same; anything else (fake tensors,
  ``opcheck``, ``torch.compile``, ``torch.export``, ``vmap``, tensor subclasses, double backward) goes
  through the registered op as before. :func:`set_fast_dispatch` (or ``ICRL_FAST_DISPATCH=0``) turns it off.

Kernel wrappers allocate outputs with :func:`empty_output` (or :func:`empty_output_like`, in another
tensor's memory order), which tests switch to NaN-filled allocations
(:func:`icrl_kernels.testing.poisoned_outputs`) so that an element a kernel forgot to write fails the
parity check instead of passing by luck. Every reference and eager path computes in
:func:`compute_dtype` (fp32, fp64 for fp64 inputs).
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch._library.custom_ops import CustomOpDef

from ._backend import triton_available, triton_interpreter_enabled

NAMESPACE = "icrl"

#: ``traceable=`` of :func:`differentiable_op`: True, False, or the ``impl`` values whose code is traceable.
Traceable = bool | Sequence[str]

_poison_outputs = False

_fast_dispatch = os.environ.get("ICRL_FAST_DISPATCH", "1").strip().lower() not in ("0", "false", "no", "off")

#: ``torch.library.triton_op`` (torch >= 2.6), else None.
_TRITON_OP = getattr(torch.library, "triton_op", None)

_Tensor = torch.Tensor
_Parameter = torch.nn.Parameter
_C = torch._C
_any_requires_grad = getattr(_C, "_any_requires_grad", None)
_peek_functorch = getattr(getattr(_C, "_functorch", None), "peek_interpreter_stack", None)
_is_compiling = torch.compiler.is_compiling


def set_output_poisoning(enabled: bool) -> bool:
    """Make :func:`empty_output` fill new outputs with NaN (floats) or -1 (ints); return the old value."""
    global _poison_outputs
    previous, _poison_outputs = _poison_outputs, bool(enabled)
    return previous


def empty_output(shape: Sequence[int], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``torch.empty`` for kernel outputs; poisoned under test so unwritten elements are caught."""
    out = torch.empty(tuple(shape), dtype=dtype, device=device)
    if _poison_outputs:
        out.fill_(float("nan") if out.is_floating_point() else -1)
    return out


def empty_output_like(like: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """:func:`empty_output` of ``like``'s shape whose memory order follows ``like``'s strides (dense, no gaps).

    For a gradient written in its input's own memory order, so that it matches whatever layout the
    producer chose: e.g. PyTorch's flash kernels return ``[B, H, L, Dh]`` outputs that are
    ``[B, L, H, Dh]``-contiguous, while SDPA's math path returns ``[B, H, L, Dh]``-contiguous ones.
    """
    order = sorted(range(like.dim()), key=lambda dim: -like.stride(dim))  # stable: ties keep dim order
    buffer = empty_output([like.shape[dim] for dim in order], dtype=dtype, device=like.device)
    inverse = [order.index(dim) for dim in range(like.dim())]
    return buffer.permute(inverse)


def compute_dtype(*tensors: torch.Tensor) -> torch.dtype:
    """The dtype every op's reference and eager path compute in: fp64 if any of ``tensors`` is fp64, fp32
    otherwise (fp16 and bf16 inputs are upcast). Pass the tensors whose precision the result must keep
    (the activations; parameters of another float dtype are read in this dtype)."""
    return torch.float64 if any(tensor.dtype == torch.float64 for tensor in tensors) else torch.float32


def set_fast_dispatch(enabled: bool) -> bool:
    """Let eager calls of the ops skip the dispatcher (see the module docstring); return the old value.

    Off, every call goes through the registered operator, which is what ``torch.compile`` and
    ``torch.export`` see; tests compare the two paths.
    """
    global _fast_dispatch
    previous, _fast_dispatch = _fast_dispatch, bool(enabled)
    return previous


def uses_triton_op(traceable: bool = True) -> bool:
    """Whether an op declared ``traceable`` is registered with ``torch.library.triton_op`` in this process.

    Needs torch >= 2.6, Triton installed and compiled rather than interpreted (``TRITON_INTERPRET=1`` runs kernels
    eagerly on the host, which fails on the fake tensors a trace uses), and ``ICRL_TRITON_OP`` not ``0``.
    Decided when the op is registered, i.e. at import.
    """
    enabled = os.environ.get("ICRL_TRITON_OP", "1").strip().lower() not in ("0", "false", "no", "off")
    return (
        traceable
        and enabled
        and _TRITON_OP is not None
        and triton_available()  # without Triton, triton_op only warns at import and adds nothing
        and not triton_interpreter_enabled()
    )


def _plain_eager_call(args: tuple) -> bool:
    """True when nothing but plain eager execution can observe this call, so that running the op's Python
    implementation directly is indistinguishable from going through the dispatcher."""
    if not _fast_dispatch or _is_compiling():  # Dynamo constant-folds is_compiling(): this stays traceable
        return False
    if _C._len_torch_dispatch_stack() or _C._is_torch_function_mode_enabled() or _C._get_tracing_state():
        return False  # FakeTensorMode, FunctionalTensorMode, make_fx, opcheck, `with torch.device(...)`, jit
    if _peek_functorch is not None and _peek_functorch() is not None:
        return False  # vmap / grad / jvp wrap plain-looking tensors
    for arg in args:
        if isinstance(arg, _Tensor) and type(arg) is not _Tensor and type(arg) is not _Parameter:
            return False  # FakeTensor, FunctionalTensor, DTensor, ... dispatch on their own
    return True


def _needs_autograd(args: tuple) -> bool:
    if not torch.is_grad_enabled():
        return False
    if _any_requires_grad is not None:
        return _any_requires_grad(*args)
    return any(isinstance(arg, _Tensor) and arg.requires_grad for arg in args)


class _FastCallOp(CustomOpDef):
    """A ``CustomOpDef`` whose ``__call__`` runs ``self._icrl_fast(*args)`` on plain eager calls.

    Everything else (``opcheck``, ``register_*``, ``_opoverload``, the ``torch.ops.icrl`` entry) is the
    registered op, unchanged. Instances are made by re-classing the ``CustomOpDef`` that
    ``torch.library.custom_op`` / ``triton_op`` returned.
    """

    _icrl_fast: Callable[..., Any]

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not kwargs and _plain_eager_call(args):
            return self._icrl_fast(*args)
        return self._opoverload(*args, **kwargs)


def _register(name: str, fn: Callable[..., Any], fake: Callable[..., Any], traceable: Traceable) -> CustomOpDef:
    qualname = f"{NAMESPACE}::{name}"
    if traceable is not True and traceable is not False and "impl" not in inspect.signature(fn).parameters:
        raise ValueError(f"{qualname}: traceable={traceable!r} needs an argument named 'impl' in {fn.__name__}")
    if uses_triton_op(bool(traceable)):
        op = _TRITON_OP(qualname, fn, mutates_args=())
        if traceable is not True:
            _trace_only_impls(op, fn, tuple(traceable))
    else:
        op = torch.library.custom_op(qualname, fn, mutates_args=())
    # triton_op registers ``fn`` itself as the fake; the explicit one is cheaper and tells shapes and
    # strides without running any kernel wrapper. (The functional decomposition under torch.compile
    # still traces ``fn``.)
    op.register_fake(fake)
    return op


def _trace_only_impls(op: CustomOpDef, fn: Callable[..., Any], impls: tuple[str, ...]) -> None:
    """Keep a ``triton_op`` opaque to ``torch.compile`` unless its ``impl`` argument is one of ``impls``.

    ``triton_op`` decomposes the op (runs ``fn`` on functional tensors) whenever AOTAutograd traces it; an
    eager implementation that views outputs in stride-dependent ways, or reads values, must stay a single
    opaque node instead, as with ``custom_op``.
    """
    from torch._subclasses.functional_tensor import FunctionalTensorMode

    decompose = getattr(op, "_torch_dispatch_fns", {}).get(FunctionalTensorMode)
    if decompose is None:  # a torch that keeps no handle on triton_op's rule: the same rule, restated

        def decompose(mode, func, types, args, kwargs):
            try:
                from torch.export._trace import custom_triton_ops_decomposition_disabled as export_keeps_whole
            except ImportError:  # pragma: no cover - depends on the torch version
                export_keeps_whole = bool
            if export_keeps_whole():
                return mode.__torch_dispatch__(func, types, args, kwargs)
            with mode:
                return fn(*args, **kwargs)

    impl_index = list(inspect.signature(fn).parameters).index("impl")

    def decompose_traceable_impls(mode, func, types, args, kwargs):
        impl = kwargs["impl"] if "impl" in kwargs else args[impl_index]
        if impl in impls:
            return decompose(mode, func, types, args, kwargs)
        return mode.__torch_dispatch__(func, types, args, kwargs)  # opaque: one node, fake impl for shapes

    op.register_torch_dispatch(FunctionalTensorMode, decompose_traceable_impls)


def _with_fast_call(op: CustomOpDef, fast: Callable[..., Any]) -> CustomOpDef:
    op.__class__ = _FastCallOp
    op._icrl_fast = fast
    return op


def inference_op(
    name: str, fn: Callable[..., Any], *, fake: Callable[..., Any], traceable: Traceable = False
) -> CustomOpDef:
    """Register ``icrl::<name>`` (an op without autograd, e.g. integer outputs) with the eager fast path.

    The replacement for ``@torch.library.custom_op(...)`` + ``register_fake``: plain eager calls run
    ``fn`` directly; everything else goes through the registered op.

    Args:
        name: op name inside the ``icrl`` namespace.
        fn: the implementation, fully type-annotated (the schema is inferred from it).
        fake: shapes/dtypes of the outputs, for FakeTensor tracing.
        traceable: as in :func:`differentiable_op`.
    """
    op = _register(name, fn, fake, traceable)

    def fast(*args: Any) -> Any:
        if _needs_autograd(args):  # the registered op's (error-raising) autograd behaviour
            return op._opoverload(*args)
        return fn(*args)

    return _with_fast_call(op, fast)


def fold_vmap_into_batch(op: CustomOpDef) -> CustomOpDef:
    """Let ``torch.func.vmap`` run ``op`` as one call with the vmapped dimension folded into the batch.

    For ops whose every tensor argument and output has a leading batch dimension ``B`` whose rows are
    independent (the n-gram ops: one sequence per row; the MoA gating: one token per row). Under ``vmap`` over
    ``K`` slices, each tensor argument becomes ``[K * B, ...]`` (an argument that is not vmapped is repeated for
    every slice), the op runs once, and each output is split back into ``[K, B, ...]``: one launch for ``K``
    models' sequences, which is how many runs train as one batched program (:mod:`icrl_models.batched`). Only
    the forward op needs the rule: a backward runs outside ``vmap``, on the folded tensors autograd saved.
    Returns ``op``. (Ops with per-slice parameters, whose rows cannot simply stack, write their own rule with
    :func:`vmapped_first` and :func:`unfold_first`.)
    """

    def rule(info: Any, in_dims: tuple, *args: Any) -> tuple[Any, Any]:
        size = info.batch_size
        folded = [
            vmapped_first(arg, dim, size).flatten(0, 1) if isinstance(arg, torch.Tensor) else arg
            for arg, dim in zip(args, in_dims)
        ]
        return unfold_first(op(*folded), size)

    op.register_vmap(rule)
    return op


def vmapped_first(value: torch.Tensor, dim: int | None, size: int) -> torch.Tensor:
    """An argument of a vmap rule with its vmapped dimension first, ``[size, ...]`` (a view; an argument that is
    not vmapped, ``dim`` None, is expanded to every slice)."""
    return value.movedim(dim, 0) if dim is not None else value.expand(size, *value.shape)


def unfold_first(output: Any, size: int) -> tuple[Any, Any]:
    """A vmap rule's return value for an op output (a tensor or a tuple of tensors) whose leading dimension holds
    ``size`` slices one after the other: each tensor viewed as ``[size, rows, ...]``, and the out_dims (0)."""
    split = [t.unflatten(0, (size, t.shape[0] // size)) for t in _as_tuple(output)]
    if isinstance(output, tuple):
        return tuple(split), (0,) * len(split)
    return split[0], 0


def _as_tuple(value: Any) -> tuple:
    return value if isinstance(value, tuple) else (value,)


def differentiable_op(
    name: str,
    *,
    forward: Callable[..., Any],
    forward_fake: Callable[..., Any],
    backward: Callable[..., Any],
    backward_fake: Callable[..., Any],
    save: Callable[[tuple, Any], tuple],
    grad_inputs: Sequence[int],
    differentiable_outputs: int | None = None,
    pass_needs_grad: bool = False,
    traceable: Traceable = False,
    materialize_grads: bool = True,
) -> tuple[Any, Any]:
    """Register ``icrl::<name>`` and ``icrl::<name>_backward`` and link them with autograd.

    Args:
        name: op name inside the ``icrl`` namespace.
        forward: the real forward, fully type-annotated (the schema is inferred from it).
        forward_fake: shapes/dtypes of the forward's outputs, for FakeTensor tracing.
        backward: ``backward(*grad_outputs, *saved) -> grads``, fully type-annotated.
        backward_fake: fake implementation of ``backward``.
        save: ``save(inputs, output) -> saved``: the values (tensors or Python scalars/strings) that
            ``backward`` needs after the forward's gradients.
        grad_inputs: for each gradient ``backward`` returns, the index of the forward input it belongs
            to; every other input gets ``None``.
        differentiable_outputs: how many leading outputs of a tuple-returning forward receive
            gradients (the rest, e.g. integer side outputs saved for the backward, are not passed on).
        pass_needs_grad: append ``needs_grad: list[bool]`` (one flag per entry of ``grad_inputs``) to
            the backward's arguments, so it can skip gradients nobody asked for; it returns any tensor
            (e.g. an empty one) in their place, and autograd receives ``None`` for them.
        traceable: ``forward`` and ``backward`` use only torch ops and kernel launches through
            :func:`icrl_kernels._triton.launch`, with no host read of a tensor value and no
            data-dependent output shape, so ``torch.compile`` may trace into them: both ops are then
            registered with ``torch.library.triton_op`` where :func:`uses_triton_op` allows. A sequence of
            strings, e.g. ``("triton",)``, limits that to calls whose ``impl`` argument (found by name in
            ``forward`` and ``backward``) is one of them; other calls stay single opaque nodes.
        materialize_grads: ``False``: autograd passes no zero-filled gradient for the outputs past
            ``differentiable_outputs`` (a side output as large as an input, e.g. a gradient saved for the
            backward, would otherwise cost a memset and its memory in every backward); the backward must
            then never need the gradient of an unused differentiable output.

    Returns:
        ``(forward_op, backward_op)``: ``CustomOpDef`` s of ``torch.ops.icrl.<name>`` and
        ``torch.ops.icrl.<name>_backward``. Calling ``forward_op`` takes the eager fast path where it can
        (module docstring).
    """
    forward_op = _register(name, forward, forward_fake, traceable)
    backward_op = _register(f"{name}_backward", backward, backward_fake, traceable)

    def setup_context(ctx: Any, inputs: tuple, output: Any) -> None:
        if not materialize_grads:
            ctx.set_materialize_grads(False)
        saved = save(inputs, output)
        ctx.num_inputs = len(inputs)
        ctx.tensor_slots = [i for i, v in enumerate(saved) if isinstance(v, torch.Tensor)]
        ctx.constants = [None if isinstance(v, torch.Tensor) else v for v in saved]
        ctx.save_for_backward(*(saved[i] for i in ctx.tensor_slots))

    def gradients(ctx: Any, grad_outputs: tuple, run_backward: Callable[..., Any]) -> tuple:
        saved = list(ctx.constants)
        for slot, tensor in zip(ctx.tensor_slots, ctx.saved_tensors):
            saved[slot] = tensor
        needs = [bool(ctx.needs_input_grad[index]) for index in grad_inputs]
        extra = (needs,) if pass_needs_grad else ()
        grads = _as_tuple(run_backward(*grad_outputs[:differentiable_outputs], *saved, *extra))
        result: list[Any] = [None] * ctx.num_inputs
        for index, grad, needed in zip(grad_inputs, grads, needs):
            result[index] = grad if needed else None
        return tuple(result)

    def autograd_backward(ctx: Any, *grad_outputs: Any) -> tuple:
        return gradients(ctx, grad_outputs, backward_op)

    forward_op.register_autograd(autograd_backward, setup_context=setup_context)

    def fast_forward(ctx: Any, *inputs: Any) -> Any:
        output = forward(*inputs)
        setup_context(ctx, inputs, output)
        return output

    def fast_backward(ctx: Any, *grad_outputs: Any) -> tuple:
        # create_graph=True (grad mode on) or a mode/subclass now active: the registered backward op, whose
        # behaviour (no double backward, tracing) the fast path must not change.
        direct = not torch.is_grad_enabled() and _plain_eager_call(grad_outputs)
        return gradients(ctx, grad_outputs, backward if direct else backward_op)

    # The registered op's autograd without the dispatcher: the same setup_context and backward. Named
    # ``<name>_fast`` so that its grad_fn reads ``<name>_fastBackward``.
    FastFunction = type(
        f"{name}_fast",
        (torch.autograd.Function,),
        {"forward": staticmethod(fast_forward), "backward": staticmethod(fast_backward)},
    )

    def fast(*args: Any) -> Any:
        if _needs_autograd(args):
            return FastFunction.apply(*args)
        return forward(*args)

    return _with_fast_call(forward_op, fast), backward_op
