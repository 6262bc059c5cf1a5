"""The custom-op pattern every op follows, written once.

Each op is a pair of registered operators (forward and backward) with fake (meta) implementations,
linked by ``register_autograd``. Registering ops this way makes them single nodes for ``torch.compile``
(no graph breaks on data-dependent kernels), exportable with ``torch.export``, and checkable with
``torch.library.opcheck``.

Two refinements, both in :func:`differentiable_op` and :func:`inference_op` so that every op gets them:

* **Registration.** An op whose implementation is *traceable* (only torch ops and kernel launches through
  :func:`icrl_kernels._triton.launch`, no host reads of tensor values) is registered with
  ``torch.library.triton_op``: ``torch.compile`` then traces into it, so Inductor sees the Triton kernels
  (and the eager path's torch ops) instead of an opaque call, while ``torch.export`` still keeps the op as
  one node. Other ops, and processes where Triton runs on its CPU interpreter (whose kernels cannot run on
  fake tensors), use ``torch.library.custom_op``.
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

import functools
import inspect
import os
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch

from . import _torch_compat as compat
from ._backend import interpreter_setting, triton_available, triton_interpreter_enabled

NAMESPACE = "icrl"

#: ``traceable=`` of :func:`differentiable_op`: True, False, or the ``impl`` values whose code is traceable.
Traceable = bool | Sequence[str]

_poison_outputs = False

_fast_dispatch = compat.FAST_PATH_SUPPORTED and os.environ.get("ICRL_FAST_DISPATCH", "1").strip().lower() not in (
    "0",
    "false",
    "no",
    "off",
)

_Tensor = torch.Tensor
_Parameter = torch.nn.Parameter
_PLAIN_TENSOR_TYPES = (torch.Tensor, torch.nn.Parameter)
#: Argument types of an op call that are certainly not tensor subclasses.
_PLAIN_ARGUMENT_TYPES = frozenset((*_PLAIN_TENSOR_TYPES, type(None), bool, int, float, str, torch.dtype, torch.device))
#: Whether Dynamo is tracing (constant-folded to True there). ``torch.compiler.is_compiling`` also covers
#: non-Dynamo tracing, which the probes below see anyway (its modes, its fake tensors), and costs a second
#: Python frame (``torch.jit.is_scripting``) on every eager call.
_is_compiling = torch.compiler.is_dynamo_compiling
_grad_enabled = torch.is_grad_enabled
_dispatch_mode_depth = compat.dispatch_mode_depth
_function_mode_enabled = compat.function_mode_enabled
_jit_tracing_state = compat.jit_tracing_state
_functorch_transform = compat.functorch_transform
_any_requires_grad = compat.any_requires_grad


def set_output_poisoning(enabled: bool) -> bool:
    """Make :func:`empty_output` fill new outputs with NaN (floats) or -1 (ints); return the old value."""
    global _poison_outputs
    previous, _poison_outputs = _poison_outputs, bool(enabled)
    return previous


def empty_output(shape: Sequence[int], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``torch.empty`` for kernel outputs; poisoned under test so unwritten elements are caught."""
    # Sizes as separate arguments: torch parses them about twice as fast as one tuple or torch.Size.
    out = torch.empty(*shape, dtype=dtype, device=device) if len(shape) else torch.empty((), dtype=dtype, device=device)
    if _poison_outputs:
        out.fill_(float("nan") if out.is_floating_point() else -1)
    return out


def empty_output_like(like: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """:func:`empty_output` of ``like``'s shape whose memory order follows ``like``'s strides (dense, no gaps).

    For a gradient written in its input's own memory order, so that it matches whatever layout the
    producer chose: e.g. PyTorch's flash kernels return ``[B, H, L, Dh]`` outputs that are
    ``[B, L, H, Dh]``-contiguous, while SDPA's math path returns ``[B, H, L, Dh]``-contiguous ones.
    (``torch.empty_like`` keeps a dense tensor's strides and gives any other strided tensor dense strides
    in the same order.)
    """
    out = torch.empty_like(like, dtype=dtype)
    if _poison_outputs:
        out.fill_(float("nan") if out.is_floating_point() else -1)
    return out


def compute_dtype(*tensors: torch.Tensor) -> torch.dtype:
    """The dtype every op's reference and eager path compute in: fp64 if any of ``tensors`` is fp64, fp32
    otherwise (fp16 and bf16 inputs are upcast). Pass the tensors whose precision the result must keep
    (the activations; parameters of another float dtype are read in this dtype)."""
    return torch.float64 if any(tensor.dtype == torch.float64 for tensor in tensors) else torch.float32


def set_fast_dispatch(enabled: bool) -> bool:
    """Let eager calls of the ops skip the dispatcher (see the module docstring); return the old value.

    Off, every call goes through the registered operator, which is what ``torch.compile`` and
    ``torch.export`` see; tests compare the two paths. Always off where this torch lacks one of the probes
    the fast path needs (``_torch_compat.FAST_PATH_SUPPORTED``).
    """
    global _fast_dispatch
    previous, _fast_dispatch = _fast_dispatch, bool(enabled) and compat.FAST_PATH_SUPPORTED
    return previous


#: Distinct argument signatures :func:`checked_per_signature` remembers per op before it starts over.
SIGNATURES_PER_OP = 256
#: Argument types of a signature kept with their type (``1``, ``1.0`` and ``True`` are equal keys otherwise).
_TAGGED_VALUE_TYPES = frozenset((int, float, bool, torch.dtype, torch.device))

T = TypeVar("T")


def checked_per_signature(check: Callable[..., T]) -> Callable[..., T]:
    """``check(*args)`` (an op's argument checks and backend choice) run once per argument signature.

    The signature of a call is, for each argument, a tensor's shape, dtype and device, or the value of a
    ``str`` / ``int`` / ``float`` / ``bool`` / ``None`` / dtype / device (with its type: ``1``, ``1.0`` and
    ``True`` differ), plus the setting of ``TRITON_INTERPRET`` (on CPU tensors ``backend="auto"`` depends on
    it; :func:`icrl_kernels._backend.interpreter_setting`, a dict lookup). A call
    with a signature seen before returns the result that ``check`` returned then, in O(1); a check that
    raised left nothing behind, so bad input raises the same error every time. Checks may read only what
    the signature holds (shapes, dtypes, devices, option values), never strides (every op takes any
    strides; the launchers' configs key on them), tensor values (those go through
    :func:`icrl_kernels._validation.check_values` inside the op) or global state.

    Calls that cannot be keyed run ``check`` every time: an argument of another type (a list, an
    ``NGramPlan``, a tensor subclass such as a fake or functional tensor, whose sizes may be symbolic),
    and any call while ``torch.compile`` traces (Dynamo traces the checks themselves into its guards). At
    most :data:`SIGNATURES_PER_OP` signatures are kept per op; then the cache starts over.
    """
    cache: dict = {}

    def checked(*args: Any) -> T:
        if _is_compiling():
            return check(*args)
        key = [interpreter_setting()]
        for arg in args:
            kind = type(arg)
            if kind is _Tensor or kind is _Parameter:
                key.append((arg.shape, arg.dtype, arg.device))
            elif kind is str or arg is None:  # equal only to itself
                key.append(arg)
            elif kind in _TAGGED_VALUE_TYPES:
                key.append((kind, arg))
            else:
                return check(*args)
        key = tuple(key)
        try:
            return cache[key]
        except KeyError:
            pass
        result = check(*args)
        if len(cache) >= SIGNATURES_PER_OP:
            cache.clear()
        cache[key] = result
        return result

    checked.__wrapped__ = check  # type: ignore[attr-defined]
    checked.cache = cache  # type: ignore[attr-defined]
    return checked


#: ``torch.library.triton_op``.
_TRITON_OP = torch.library.triton_op


def uses_triton_op(traceable: bool = True) -> bool:
    """Whether an op declared ``traceable`` is registered with ``torch.library.triton_op`` in this process.

    Needs Triton installed and compiled rather than interpreted (``TRITON_INTERPRET=1`` runs kernels
    eagerly on the host, which fails on the fake tensors a trace uses), and ``ICRL_TRITON_OP`` not ``0``.
    Decided when the op is registered, i.e. at import.
    """
    enabled = os.environ.get("ICRL_TRITON_OP", "1").strip().lower() not in ("0", "false", "no", "off")
    return (
        traceable
        and enabled
        and triton_available()  # without Triton, triton_op only warns at import and adds nothing
        and not triton_interpreter_enabled()
    )


def _plain_eager_call(args: tuple) -> bool:
    """True when nothing but plain eager execution can observe this call, so that running the op's Python
    implementation directly is indistinguishable from going through the dispatcher."""
    if not _fast_dispatch or _is_compiling():  # Dynamo constant-folds the probe: this stays traceable
        return False
    if _dispatch_mode_depth() or _function_mode_enabled() or _jit_tracing_state() is not None:
        return False  # FakeTensorMode, FunctionalTensorMode, make_fx, opcheck, `with torch.device(...)`, jit
    if _functorch_transform() is not None:
        return False  # vmap / grad / jvp wrap plain-looking tensors
    if _PLAIN_ARGUMENT_TYPES.issuperset(map(type, args)):  # the usual call, checked without a Python loop
        return True
    for arg in args:
        if isinstance(arg, _Tensor) and type(arg) not in _PLAIN_TENSOR_TYPES:
            return False  # FakeTensor, FunctionalTensor, DTensor, ... dispatch on their own
    return True


def _fast_call(self: Any, *args: Any, **kwargs: Any) -> Any:
    """``__call__`` of the registered ops (see :func:`_fast_call_class`): on plain eager calls with every
    argument positional, the op's autograd.Function (``_icrl_autograd``, applied from C) when a tensor
    needs grad, else its forward itself (``_icrl_forward``); anything else, the registered operator."""
    if kwargs or not _plain_eager_call(args):
        return self._icrl_registered(*args, **kwargs)
    if _grad_enabled() and _any_requires_grad(*args):
        return self._icrl_autograd(*args)
    return self._icrl_forward(*args)


@functools.cache
def _fast_call_class(base: type) -> type:
    """The subclass of ``base`` (the ``CustomOpDef`` class of this torch) whose instances take the fast path.

    Only ``__call__`` differs: ``opcheck``, ``register_*`` and the ``torch.ops.icrl`` entry are the
    registered op's (:func:`icrl_kernels._torch_compat.reclass_custom_op`)."""
    return type("FastCallOp", (base,), {"__call__": _fast_call, "__doc__": _fast_call_class.__doc__})


def _register(name: str, fn: Callable[..., Any], fake: Callable[..., Any], traceable: Traceable) -> Any:
    qualname = f"{NAMESPACE}::{name}"
    parameters = list(inspect.signature(fn).parameters)
    if traceable is not True and traceable is not False and "impl" not in parameters:
        raise ValueError(f"{qualname}: traceable={traceable!r} needs an argument named 'impl' in {fn.__name__}")
    if uses_triton_op(bool(traceable)):
        op = _TRITON_OP(qualname, fn, mutates_args=())
        if traceable is not True:
            _trace_only_impls(op, fn, tuple(traceable), parameters.index("impl"))
    else:
        op = torch.library.custom_op(qualname, fn, mutates_args=())
    # triton_op registers ``fn`` itself as the fake; the explicit one is cheaper and tells shapes and
    # strides without running any kernel wrapper. (The functional decomposition under torch.compile
    # still traces ``fn``.)
    op.register_fake(fake)
    return op


def _trace_only_impls(op: Any, fn: Callable[..., Any], impls: tuple[str, ...], impl_index: int) -> None:
    """Keep a ``triton_op`` opaque to ``torch.compile`` unless its ``impl`` argument is one of ``impls``.

    ``triton_op`` decomposes the op (runs ``fn`` on functional tensors) whenever AOTAutograd traces it; an
    eager implementation that views outputs in stride-dependent ways, or reads values, must stay a single
    opaque node instead, as with ``custom_op``.
    """
    decompose = compat.triton_op_decomposition(op)
    if decompose is None:  # a torch that keeps no handle on triton_op's rule: the same rule, restated

        def decompose(mode, func, types, args, kwargs):
            if compat.export_keeps_triton_ops_whole():
                return mode.__torch_dispatch__(func, types, args, kwargs)
            with mode:
                return fn(*args, **kwargs)

    def decompose_traceable_impls(mode, func, types, args, kwargs):
        impl = kwargs["impl"] if "impl" in kwargs else args[impl_index]
        if impl in impls:
            return decompose(mode, func, types, args, kwargs)
        return mode.__torch_dispatch__(func, types, args, kwargs)  # opaque: one node, fake impl for shapes

    op.register_torch_dispatch(compat.functional_tensor_mode(), decompose_traceable_impls)


def _with_fast_call(op: Any, name: str, forward: Callable[..., Any], autograd: Callable[..., Any] | None = None) -> Any:
    """``op`` (registered as ``icrl::<name>``) re-classed to take the fast path: ``forward`` on plain eager
    calls, ``autograd`` (default: the registered operator) where a tensor needs grad."""
    compat.reclass_custom_op(op, _fast_call_class(type(op)))
    op._icrl_registered = getattr(getattr(torch.ops, NAMESPACE), name).default
    op._icrl_forward = forward
    op._icrl_autograd = autograd or op._icrl_registered
    return op


def inference_op(name: str, fn: Callable[..., Any], *, fake: Callable[..., Any], traceable: Traceable = False) -> Any:
    """Register ``icrl::<name>`` (an op without autograd, e.g. integer outputs) with the eager fast path.

    The replacement for ``@torch.library.custom_op(...)`` + ``register_fake``: plain eager calls run
    ``fn`` directly; everything else (and a call with an input that requires grad, whose error is the
    registered op's) goes through the registered op.

    Args:
        name: op name inside the ``icrl`` namespace.
        fn: the implementation, fully type-annotated (the schema is inferred from it).
        fake: shapes/dtypes of the outputs, for FakeTensor tracing.
        traceable: as in :func:`differentiable_op`.
    """
    op = _register(name, fn, fake, traceable)
    return _with_fast_call(op, name, fn)


def fold_vmap_into_batch(op: Any) -> Any:
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


def _fold_cpu_flash_attention(
    size: int,
    in_dims: tuple,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    *,
    attn_mask: torch.Tensor | None = None,
    scale: float | None = None,
) -> tuple[Any, Any]:
    """vmap rule of ``F.scaled_dot_product_attention``'s CPU flash kernel: the ``size`` slices folded into its
    batch, ``[size * B, H, L, E]``, one call (torch has no rule for this kernel: its fallback calls it once per
    slice, and its backward zero-fills and adds a whole ``[size, B, H, L, E]`` gradient per slice). Rows of
    the kernel are independent, so each slice gets its own call's values exactly. The mask, 2-D ``[L, S]`` or
    4-D ``[B or 1, H or 1, L, S]`` per slice (the shapes this kernel takes), broadcasts as it does per slice.
    The kernel has no dropout (it refuses ``dropout_p > 0`` itself), so no random stream is involved."""
    (q_dim, k_dim, v_dim, *_), kwarg_dims = in_dims
    query, key, value = (vmapped_first(t, dim, size) for t, dim in ((query, q_dim), (key, k_dim), (value, v_dim)))
    batch = query.shape[1]
    mask_dim = kwarg_dims.get("attn_mask")
    if attn_mask is not None and (mask_dim is not None or (attn_mask.dim() == 4 and attn_mask.shape[0] != 1)):
        # A mask whose batch differs per slice (or per row): [size, B or 1, H or 1, L, S], then one per row.
        mask = vmapped_first(attn_mask, mask_dim, size)
        mask = mask.reshape(size, *(1,) * (5 - mask.dim()), *mask.shape[1:])
        attn_mask = mask.expand(size, batch, *mask.shape[2:]).reshape(size * batch, *mask.shape[2:])
    out, logsumexp = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        *(t.reshape(size * batch, *t.shape[2:]) for t in (query, key, value)),
        dropout_p,
        is_causal,
        attn_mask=attn_mask,
        scale=scale,
    )
    return unfold_first((out, logsumexp), size)


compat.register_aten_vmap("_scaled_dot_product_flash_attention_for_cpu", _fold_cpu_flash_attention)


def _nones_as_empty(backward: Callable[..., Any]) -> Callable[..., Any]:
    """``backward`` as the registered backward op runs it: each ``None`` it returns (a gradient of an absent
    input, or one nobody asked for) becomes an empty tensor of the first tensor argument's dtype and device,
    a distinct one each (outputs of a custom op are tensors and may not alias). The fast path calls
    ``backward`` itself and skips those allocations; the op's fake returns the same placeholders."""

    @functools.wraps(backward)
    def registered(*args: Any) -> Any:
        grads = backward(*args)
        if isinstance(grads, tuple) and any(grad is None for grad in grads):
            like = first_tensor(args)
            grads = tuple(grad if grad is not None else like.new_empty(0) for grad in grads)
        return grads

    # The op's schema is inferred from this signature; its annotations, evaluated where backward was written
    # (as strings they would be looked up in this module).
    registered.__signature__ = inspect.signature(backward, eval_str=True)  # type: ignore[attr-defined]
    return registered


def first_tensor(args: Sequence[Any]) -> torch.Tensor:
    """The first tensor among ``args`` (the placeholder gradients of :func:`differentiable_op` take its
    dtype and device)."""
    return next(arg for arg in args if isinstance(arg, _Tensor))


#: Where a tensor went to ``ctx.save_for_backward`` in the values a backward receives.
_SAVED_TENSOR = object()


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
    saved_tensors: int | None = None,
) -> tuple[Any, Any]:
    """Register ``icrl::<name>`` and ``icrl::<name>_backward`` and link them with autograd.

    Args:
        name: op name inside the ``icrl`` namespace.
        forward: the real forward, fully type-annotated (the schema is inferred from it).
        forward_fake: shapes/dtypes of the forward's outputs, for FakeTensor tracing.
        backward: ``backward(*grad_outputs, *saved) -> grads``, fully type-annotated. It must return ``None``
            for the gradient of an absent (``None``) input, and may for one nobody asked for (with
            ``pass_needs_grad``); autograd receives ``None`` there, and the registered backward op returns an
            empty tensor in its place (:func:`first_tensor`'s dtype and device), as its fake must too.
        backward_fake: fake implementation of ``backward``.
        save: ``save(inputs, output) -> saved``: the values (tensors or Python scalars/strings) that
            ``backward`` needs after the forward's gradients.
        grad_inputs: for each gradient ``backward`` returns, the index of the forward input it belongs
            to, or a tuple of indices for one gradient that several inputs share (``y`` and ``prompt`` of
            ``y + prompt``: autograd hands the one tensor to each, as for torch's own add, and the registered
            backward op returns it once, since outputs of a custom op may not alias); every other input gets
            ``None``.
        differentiable_outputs: how many leading outputs of a tuple-returning forward receive
            gradients (the rest, e.g. integer side outputs saved for the backward, are not passed on).
        pass_needs_grad: append ``needs_grad: list[bool]`` (whether each input named in ``grad_inputs``
            needs a gradient, in order, the inputs of a shared gradient one by one) to
            the backward's arguments, so it can skip gradients nobody asked for; it returns ``None`` in their
            place (or, for a tensor input, any tensor: autograd drops it).
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
        saved_tensors: the number of leading values of ``save``'s result that are tensors or ``None`` (the
            rest being constants, e.g. ``impl``): they go to ``ctx.save_for_backward`` as they are, instead
            of being sorted from the constants in every call. ``None`` (default): sorted per call.

    Returns:
        ``(forward_op, backward_op)``: ``CustomOpDef`` s of ``torch.ops.icrl.<name>`` and
        ``torch.ops.icrl.<name>_backward``. Calling ``forward_op`` takes the eager fast path where it can
        (module docstring): with every argument positional, ``forward_op(*inputs)`` is then
        ``forward(*inputs)`` inside one ``torch.autograd.Function``, two Python frames from the public
        function that calls it.
    """
    forward_op = _register(name, forward, forward_fake, traceable)
    backward_op = _register(f"{name}_backward", _nones_as_empty(backward), backward_fake, traceable)
    # (input index, position among the backward's gradients) of every input that gets a gradient, in order
    # (inputs that share one gradient are each listed); ``needs_grad`` has one flag per route.
    routes = tuple(
        (index, position)
        for position, entry in enumerate(grad_inputs)
        for index in (entry if isinstance(entry, tuple) else (entry,))
    )
    flagged = tuple(index for index, _ in routes)
    # The usual layout, gradients for the leading inputs in order: their flags are a slice of autograd's, and
    # without shared gradients (``aligned``) backward's gradients are autograd's, padded with None.
    leading = len(flagged) if flagged == tuple(range(len(flagged))) else None
    aligned = leading is not None and len(routes) == len(grad_inputs)
    padding = (None,) * (len(inspect.signature(forward).parameters) - len(routes))

    def setup_context(ctx: Any, inputs: tuple, output: Any) -> None:
        if not materialize_grads:
            ctx.set_materialize_grads(False)
        saved = save(inputs, output)
        if saved_tensors is not None:  # the layout declared: tensors (or None) first, then constants
            ctx.save_for_backward(*saved[:saved_tensors])
            ctx.constants = saved[saved_tensors:]
            return
        tensors = [value for value in saved if isinstance(value, _Tensor)]
        ctx.save_for_backward(*tensors)
        # Non-tensors are kept as they are, tensors (saved above) as a marker.
        ctx.constants = [_SAVED_TENSOR if isinstance(value, _Tensor) else value for value in saved]

    def gradients(ctx: Any, *grad_outputs: Any, fast: bool = False) -> tuple:
        """The backward of both autograd paths: through the registered backward op, or with ``fast`` (the
        eager fast path's ``autograd.Function``) through ``backward`` itself, except where create_graph=True
        (grad mode on) or a mode or subclass now active could see the difference (double backward, tracing)."""
        direct = fast and not _grad_enabled() and _plain_eager_call(grad_outputs)
        if saved_tensors is not None:
            saved = (*ctx.saved_tensors, *ctx.constants)
        else:
            tensors = iter(ctx.saved_tensors)
            saved = [next(tensors) if value is _SAVED_TENSOR else value for value in ctx.constants]
        flags = ctx.needs_input_grad
        if pass_needs_grad:
            needs = flags[:leading] if leading is not None else tuple(flags[index] for index in flagged)
            grads = (backward if direct else backward_op)(*grad_outputs[:differentiable_outputs], *saved, needs)
        else:
            grads = (backward if direct else backward_op)(*grad_outputs[:differentiable_outputs], *saved)
        if not isinstance(grads, tuple):
            grads = (grads,)
        if direct and aligned:
            # backward's own gradients, one per leading input: None for an absent input (and, with
            # pass_needs_grad, for one nobody asked for); autograd drops any for an input that needs none.
            return (*grads, *padding)
        result: list[Any] = [None] * len(flags)  # the registered op's placeholders become None here
        for index, position in routes:
            if flags[index]:
                result[index] = grads[position]
        return tuple(result)

    forward_op.register_autograd(gradients, setup_context=setup_context)

    # The registered op's autograd without the dispatcher: ``forward`` itself, the same setup_context and
    # backward (a partial: no Python frame of its own). Named ``<name>_fast`` so that its grad_fn reads
    # ``<name>_fastBackward``.
    function = type(
        f"{name}_fast",
        (torch.autograd.Function,),
        {
            "forward": staticmethod(forward),
            "setup_context": staticmethod(setup_context),
            "backward": staticmethod(functools.partial(gradients, fast=True)),
        },
    )
    return _with_fast_call(forward_op, name, forward, compat.direct_apply(function)), backward_op
