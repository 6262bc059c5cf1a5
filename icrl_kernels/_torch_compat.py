"""Every use of torch internals that are not public API, in one place.

The package needs a few: probes that tell a plain eager call from one that torch is tracing or
transforming (the ops' eager fast path, :mod:`icrl_kernels._library`), the C entry of
``torch.autograd.Function.apply``, the ``CustomOpDef`` re-class that gives the registered ops their fast
``__call__``, the functional-decomposition rule of ``torch.library.triton_op``, and vmap's batched tensors
(:func:`icrl_kernels._validation.check_values`). Each is named here once, with what it is for and what
the package does where a torch lacks it; ``tests/test_torch_compat.py`` checks each against the installed
torch (CI: torch 2.13; the GPU image: 2.11, the oldest torch ``pyproject.toml`` allows).

Where a probe is missing, :data:`FAST_PATH_SUPPORTED` is False and every call goes through the registered
operator: slower, never wrong.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import torch

_C = torch._C
_functorch = getattr(_C, "_functorch", None)

# -- 1. Is this a plain eager call? (the fast path of icrl_kernels._library) -------------------------
#: Number of active ``TorchDispatchMode`` s (FakeTensorMode, FunctionalTensorMode, ProxyTorchDispatchMode
#: of ``make_fx`` / AOTAutograd, ``opcheck``'s modes, user modes). Public equivalent:
#: ``torch.utils._python_dispatch._get_current_dispatch_mode() is not None`` (a Python function, slower).
dispatch_mode_depth: Callable[[], int] | None = getattr(_C, "_len_torch_dispatch_stack", None)
#: Whether a ``TorchFunctionMode`` is active (``with torch.device(...)``, user modes). Public equivalent:
#: ``torch.overrides._is_torch_function_mode_enabled`` (the same C function, re-exported).
function_mode_enabled: Callable[[], bool] | None = getattr(_C, "_is_torch_function_mode_enabled", None)
#: The TorchScript tracer's state (``torch.jit.trace``), None when not tracing. Public equivalent:
#: ``torch.jit.is_tracing()`` (a Python wrapper around it).
jit_tracing_state: Callable[[], Any] | None = getattr(_C, "_get_tracing_state", None)
#: The innermost functorch transform (``vmap``, ``grad``, ``jvp``, ...), None outside any: their tensors
#: look like plain ``torch.Tensor`` s to ``type()``. No public equivalent.
functorch_transform: Callable[[], Any] | None = getattr(_functorch, "peek_interpreter_stack", None)
#: ``_any_requires_grad(*args)``: whether any tensor among ``args`` requires grad, in C (non-tensors are
#: skipped). The Python loop it replaces is :func:`_any_requires_grad_fallback`.
_any_requires_grad_c: Callable[..., bool] | None = getattr(_C, "_any_requires_grad", None)

FAST_PATH_SUPPORTED = None not in (dispatch_mode_depth, function_mode_enabled, jit_tracing_state, functorch_transform)


def _any_requires_grad_fallback(*args: Any) -> bool:
    return any(isinstance(arg, torch.Tensor) and arg.requires_grad for arg in args)


any_requires_grad: Callable[..., bool] = _any_requires_grad_c or _any_requires_grad_fallback

# -- 2. torch.autograd.Function.apply without its Python wrapper -------------------------------------
_c_apply = getattr(getattr(_C, "_FunctionBase", None), "__dict__", {}).get("apply")


def direct_apply(function: type) -> Callable[..., Any]:
    """``function.apply`` (a ``torch.autograd.Function`` subclass) without its Python wrapper: the C method
    ``torch._C._FunctionBase.apply`` bound to ``function``.

    ``Function.apply`` (Python) first binds default arguments with ``inspect.signature`` when the class
    defines ``setup_context`` (microseconds per call), sends functorch transforms to
    ``custom_function_call`` and unwraps dead functorch wrappers, then calls this method. The fast path runs
    only outside functorch transforms (probe 1), with every argument given positionally, so none of that
    has anything to do there. The C method calls ``forward(*args)`` then ``setup_context(ctx, args,
    output)`` (or ``forward(ctx, *args)`` without a ``setup_context``), one Python frame closer to the
    kernel launch. Falls back to ``function.apply`` where torch has no such method.
    """
    if _c_apply is None:  # pragma: no cover - depends on the torch version
        return function.apply
    return _c_apply.__get__(None, function)


# -- 3. The registered op's class --------------------------------------------------------------------
def reclass_custom_op(op: Any, cls: type) -> Any:
    """Make ``op`` (the ``CustomOpDef`` that ``torch.library.custom_op`` / ``triton_op`` returned) an
    instance of ``cls``, a subclass of ``type(op)`` that only overrides ``__call__``; return ``op``.

    ``CustomOpDef`` is public API, its class (``torch._library.custom_ops.CustomOpDef``) and constructor
    are not, and torch keeps each op's registrations on the instance: a new instance would lose them.
    Re-classing keeps every attribute (``opcheck``, ``register_*``, ``_opoverload``) and adds the fast
    ``__call__``. Relies on ``CustomOpDef`` having no ``__slots__`` (true from torch 2.4 to 2.13).
    """
    if not issubclass(cls, type(op)):
        raise TypeError(f"{cls.__name__} must subclass {type(op).__name__}")
    op.__class__ = cls
    return op


# -- 4. triton_op's functional decomposition ---------------------------------------------------------
def functional_tensor_mode() -> type:
    """``FunctionalTensorMode`` (private module ``torch._subclasses.functional_tensor``): the mode under which
    AOTAutograd runs a ``triton_op``'s decomposition, and for which the package registers its own rule
    (:func:`icrl_kernels._library`'s ``traceable=`` impls) with the public ``CustomOpDef.register_torch_dispatch``."""
    from torch._subclasses.functional_tensor import FunctionalTensorMode

    return FunctionalTensorMode


def triton_op_decomposition(op: Any) -> Callable[..., Any] | None:
    """The rule a ``torch.library.triton_op`` registered for ``FunctionalTensorMode`` (it runs the op's
    Python implementation on functional tensors while AOTAutograd traces, which is how ``torch.compile``
    sees its kernels), or None where torch keeps no handle on it. Read from the private
    ``CustomOpDef._torch_dispatch_fns`` (torch 2.6-2.13), to wrap it (:func:`icrl_kernels._library`'s
    ``traceable=`` impls)."""
    return getattr(op, "_torch_dispatch_fns", {}).get(functional_tensor_mode())


def export_keeps_triton_ops_whole() -> bool:
    """Whether ``torch.export`` is tracing, where a ``triton_op`` stays one node instead of decomposing
    (private ``torch.export._trace.custom_triton_ops_decomposition_disabled``; False where it is missing)."""
    try:
        from torch.export._trace import custom_triton_ops_decomposition_disabled
    except ImportError:  # pragma: no cover - depends on the torch version
        return False
    return custom_triton_ops_decomposition_disabled()


# -- 5. value checks that never stall a GPU (check_values) ------------------------------------------
#: ``torch._assert_async(cond, message)``: fails a CUDA kernel (reported at a later CUDA call) where
#: ``cond`` is False, without a host read; on the CPU it raises ``RuntimeError`` at once. No public
#: equivalent (``torch._assert`` is symbolic-tracing's assert, and reads the value).
assert_async: Callable[[torch.Tensor, str], None] = torch._assert_async


# vmap's batched tensors: check_values reduces a check over every vmapped slice (batched training).
def is_batched_tensor(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is a ``torch.func.vmap`` BatchedTensor (False where torch cannot tell)."""
    return _functorch is not None and _functorch.is_batchedtensor(tensor)


def unwrap_batched(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor inside a vmap BatchedTensor, with the vmapped dimension (one level of nesting)."""
    return _functorch.get_unwrapped(tensor)


# -- 6. vmap rules for torch's own operators ---------------------------------------------------------
#: The dispatch key of vmap's batching rules, and the functorch entries a rule for an aten operator needs:
#: the innermost transform (its level and, for vmap, its size), a tensor unwrapped at a level (with its
#: vmapped dimension) and a tensor wrapped back. No public equivalent: ``torch.library.register_vmap`` takes
#: operators without keyword-only tensor arguments only (SDPA's ``attn_mask`` is one).
_BATCHED_KEY = getattr(getattr(_C, "DispatchKey", None), "FuncTorchBatched", None)
_VMAP_ENTRIES = ("peek_interpreter_stack", "CVmapInterpreterPtr", "_unwrap_batched", "_add_batch_dim")
#: The ``torch.library.Library`` objects holding the registered rules (a rule lives as long as its library).
_vmap_libraries: list = []


def register_aten_vmap(
    name: str, rule: Callable[..., tuple[Any, Any] | None], decomposition: Callable[..., Any] | None = None
) -> bool:
    """Make ``rule`` the ``torch.func.vmap`` rule of the aten operator ``name`` (an overload's name, e.g.
    ``"_scaled_dot_product_flash_attention_for_cpu"``), in place of torch's (or of its per-slice fallback).

    ``rule(size, in_dims, *args, **kwargs)`` is called as a ``torch.library.register_vmap`` rule is: every tensor
    argument unwrapped (positional or keyword; operators whose tensors all sit at the top level, no tensor lists),
    ``size`` the vmapped size, ``in_dims`` shaped like ``(args, kwargs)`` (a tuple and a dict) with each tensor's
    vmapped dimension (None for a tensor that is not vmapped, and for non-tensors); it returns ``(outputs,
    out_dims)`` (a tensor and an int or None, or a tuple of tensors and one such per tensor or one for all), or
    None for a call it leaves to ``decomposition(*args, **kwargs)``, which gets the vmapped arguments themselves
    (torch's own rule for such calls, written with other operators: a registered rule replaces torch's for every
    call). Calls where no tensor is vmapped run the operator itself. The wrapping runs no pytree code: a Python
    rule's host cost per call is what vmap users pay on every op it covers.
    Returns False, registering nothing (vmap keeps torch's own behaviour: slower, never wrong), where this torch
    lacks one of the entries."""
    if _functorch is None or _BATCHED_KEY is None or not all(hasattr(_functorch, e) for e in _VMAP_ENTRIES):
        return False  # pragma: no cover - depends on the torch version
    overload = getattr(torch.ops.aten, name).default
    excluded = _C.DispatchKeySet(_BATCHED_KEY)
    unwrap, wrap, tensor = _functorch._unwrap_batched, _functorch._add_batch_dim, torch.Tensor

    def batched_kernel(*args: Any, **kwargs: Any) -> Any:
        interpreter = _functorch.peek_interpreter_stack()
        level = interpreter.level()
        plain_args, arg_dims = [], []
        for value in args:
            value, dim = unwrap(value, level) if isinstance(value, tensor) else (value, None)
            plain_args.append(value)
            arg_dims.append(dim)
        plain_kwargs, kwarg_dims = {}, {}
        for key, value in kwargs.items():
            plain_kwargs[key], kwarg_dims[key] = unwrap(value, level) if isinstance(value, tensor) else (value, None)
        # The rule's own calls run below vmap's level, as torch's C++ rules run theirs.
        with _C._ExcludeDispatchKeyGuard(excluded):
            if all(dim is None for dim in arg_dims) and all(dim is None for dim in kwarg_dims.values()):
                return overload(*args, **kwargs)
            size = _functorch.CVmapInterpreterPtr(interpreter).batchSize()
            ruled = rule(size, (tuple(arg_dims), kwarg_dims), *plain_args, **plain_kwargs)
        if ruled is None:
            return decomposition(*args, **kwargs)
        outputs, out_dims = ruled
        if isinstance(outputs, tensor):
            return outputs if out_dims is None else wrap(outputs, out_dims, level)
        dims = out_dims if isinstance(out_dims, (tuple, list)) else (out_dims,) * len(outputs)
        return tuple(out if dim is None else wrap(out, dim, level) for out, dim in zip(outputs, dims))

    library = torch.library.Library("aten", "IMPL")
    with warnings.catch_warnings():  # "Overriding a previously registered kernel": torch's rule, on purpose
        warnings.simplefilter("ignore", UserWarning)
        library.impl(name, batched_kernel, "FuncTorchBatched")
    _vmap_libraries.append(library)
    return True
