"""Helpers for writing Triton kernels that also run under the CPU interpreter."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import torch

try:
    import triton
except ImportError as error:  # the eager paths need no Triton; only the kernel modules import this one
    raise ImportError(
        "icrl_kernels' Triton kernels need the triton package: pip install 'icrl-kernels[triton]' (CUDA builds "
        "of torch bring their own); backend='eager' (what CPU tensors use by default) works without it"
    ) from error

from ._backend import triton_interpreter_enabled
from ._torch_compat import dispatch_mode_depth

#: Every kernel made by :func:`autotune`, in import order (see :func:`imported_autotuned_kernels`).
_AUTOTUNED: list = []


def autotune(configs: Sequence[triton.Config], key: Sequence[str], **kwargs):
    """``triton.autotune`` that keeps only the first config under the interpreter.

    A multi-config autotune needs a GPU to time candidates (it crashes in the interpreter), so the
    first config must be a sensible default on every device. The kernel remembers the full list
    (:func:`autotune_configs`), so that tests can still force each config in turn, and is registered
    for :func:`imported_autotuned_kernels`.
    """
    configs = list(configs)
    tuned = configs[:1] if triton_interpreter_enabled() else list(configs)
    decorate = triton.autotune(configs=tuned, key=list(key), **kwargs)

    def register(fn):
        kernel = decorate(fn)
        kernel.all_configs = tuple(configs)
        _AUTOTUNED.append(kernel)
        return kernel

    return register


def autotune_configs(kernel) -> tuple[triton.Config, ...]:
    """Every config ``kernel`` was declared with, also under the interpreter (whose autotuner keeps one)."""
    return kernel.all_configs


def kernel_name(kernel) -> str:
    """Short name of a (possibly autotuned) kernel: ``_ngram_forward_kernel`` -> ``ngram_forward``."""
    fn = kernel
    while hasattr(fn, "fn"):  # Autotuner / Heuristics -> JITFunction (-> the Python function)
        fn = fn.fn
    return fn.__name__.strip("_").removesuffix("_kernel")


def config_name(config: triton.Config) -> str:
    """Readable id of an autotune config, e.g. ``BLOCK_L64-BLOCK_D64-w4`` (``-s2`` where the stages are not
    Triton's default 3)."""
    parts = [f"{name}{value}" for name, value in config.kwargs.items()] + [f"w{config.num_warps}"]
    if config.num_stages != 3:
        parts.append(f"s{config.num_stages}")
    return "-".join(parts)


def imported_autotuned_kernels() -> list:
    """Every kernel declared with :func:`autotune` in the kernel modules imported so far, in import order.

    Kernel modules are imported lazily by the ops; tooling that needs them all imports every
    ``*kernels`` module first (``benchmarks/kernel_tools.py``'s ``autotuned_kernels``).
    """
    return list(_AUTOTUNED)


_wrap_triton = torch.library.wrap_triton
_is_dynamo_compiling = torch.compiler.is_dynamo_compiling


def launch(kernel, grid):
    """``kernel[grid]``; while torch traces (``torch.compile``, the functional decomposition of an op
    registered with ``torch.library.triton_op``, ``make_fx``), ``torch.library.wrap_triton(kernel)[grid]``,
    so that the trace records the kernel (see :mod:`icrl_kernels._library`). Every launch in the package
    goes through here.

    Outside tracing the wrapper would only add a higher-order-op dispatch to every launch, so plain eager
    calls launch directly. Under ``TRITON_INTERPRET=1`` kernels are never wrapped: the interpreter runs them
    on the host at once (it cannot run on fake tensors).
    """
    # Tracing: a dispatch mode (fake, functional or proxy tensors, or a user mode) or Dynamo is active (the
    # other tracers torch.compiler.is_compiling covers run under such modes; it costs two Python frames).
    if (dispatch_mode_depth() > 0 or _is_dynamo_compiling()) and not triton_interpreter_enabled():
        return _wrap_triton(kernel)[grid]
    return kernel[grid]


def per_signature(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` (a launcher's grid, block sizes, constexprs and output layouts, from sizes, strides, dtypes and
    options) computed once per distinct arguments: a repeated call is one ``functools.lru_cache`` lookup.

    While torch traces with symbolic sizes (``torch.compile(dynamic=True)`` into a ``triton_op``) the
    arguments cannot be hashed, and ``fn`` runs every time. At most 256 signatures are kept.
    """
    cached = functools.lru_cache(maxsize=256)(fn)

    @functools.wraps(fn)
    def call(*args: Any) -> Any:
        try:
            return cached(*args)
        except TypeError:  # a SymInt: "unhashable type: non-nested SymInt"
            return fn(*args)

    call.cache_clear = cached.cache_clear  # type: ignore[attr-defined]
    return call


def size_bucket(size: int) -> int:
    """Power-of-two bucket of a problem size (rows, B * L, ...) for autotune keys: configs are re-tuned when
    the size changes by 2x or more, not at every new size. ``size_bucket(6400) == 8192``."""
    return next_power_of_2(max(1, int(size)))


# Host-side size arithmetic for launchers and grids. ``triton.cdiv`` and ``triton.next_power_of_2`` are Triton
# constexpr functions: each host call unwraps its arguments first and costs microseconds (4-7 us measured on
# the CPU VM, Triton 3.9), several per op call. These are the plain-Python equivalents.
def cdiv(numerator: int, denominator: int) -> int:
    """``ceil(numerator / denominator)`` for positive ints (symbolic sizes too)."""
    return -(-numerator // denominator)


def next_power_of_2(n: int) -> int:
    """The smallest power of two ``>= n`` (``n >= 1``; 0 for 0, as ``triton.next_power_of_2``)."""
    if isinstance(n, int):
        return 1 << (n - 1).bit_length() if n > 0 else 0
    return triton.next_power_of_2(n)  # a symbolic size while torch traces
