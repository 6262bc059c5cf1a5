"""Helpers for writing Triton kernels that also run under the CPU interpreter."""

from __future__ import annotations

import contextlib
import importlib
import pkgutil
from collections.abc import Iterator, Sequence

import torch

try:
    import triton
except ImportError as error:  # the eager paths need no Triton; only the kernel modules import this one
    raise ImportError(
        "icrl_kernels' Triton kernels need the triton package: pip install 'icrl-kernels[triton]' (CUDA builds "
        "of torch bring their own); backend='eager' (what CPU tensors use by default) works without it"
    ) from error

from ._backend import triton_interpreter_enabled

#: Every kernel made by :func:`autotune`, in import order (see :func:`autotuned_kernels`).
_AUTOTUNED: list = []


def autotune(configs: Sequence[triton.Config], key: Sequence[str], **kwargs):
    """``triton.autotune`` that keeps only the first config under the interpreter.

    A multi-config autotune needs a GPU to time candidates (it crashes in the interpreter), so the
    first config must be a sensible default on every device. The kernel remembers the full list
    (:func:`autotune_configs`), so that tests can still force each config in turn, and is registered
    for :func:`autotuned_kernels`.
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


def autotuned_kernels() -> list:
    """Every kernel of the package declared with :func:`autotune`.

    Kernel modules are imported lazily by the ops, so this first imports every ``icrl_kernels`` module
    whose name ends in ``kernels`` (``ngram.kernels``, ``ngram.tiled_kernels``, ...): a new autotuned
    kernel is found without being listed anywhere.
    """
    import icrl_kernels

    for module in pkgutil.walk_packages(icrl_kernels.__path__, prefix="icrl_kernels."):
        if module.name.rsplit(".", 1)[-1].endswith("kernels"):
            importlib.import_module(module.name)
    return list(_AUTOTUNED)


@contextlib.contextmanager
def recorded_autotuning(kernels: Sequence | None = None) -> Iterator[list[dict]]:
    """Within the block, record every autotuning of ``kernels`` (default: :func:`autotuned_kernels`).

    Yields a list that fills as the block runs, one entry per newly tuned key of a kernel::

        {"kernel": "infonce_grad_pred", "key": "(512, 4096, 17, 'torch.bfloat16', ...)",
         "best": "BLOCK_N64-BLOCK_D64-MAX_DO512-w8", "timings_ms": {config name: median ms, ...}}

    ``timings_ms`` holds every config the autotuner timed (``inf`` for one that failed to compile or ran out
    of resources), in the declared order, so a benchmark run on a GPU also says how far each config is from
    the best (the data to choose the configs and the interpreter's default, the first, from). Keys tuned
    before the block are not re-tuned, so they are not recorded; under the interpreter, whose autotuner
    keeps one config, nothing is tuned and the list stays empty. Each kernel's ``run`` is wrapped for the
    block only and restored afterwards, even if the block raises.
    """
    records: list[dict] = []
    wrapped = list(autotuned_kernels() if kernels is None else kernels)

    def recording(kernel, run):
        def run_and_record(*args, **kwargs):
            before = set(kernel.cache)
            result = run(*args, **kwargs)
            timings = getattr(kernel, "configs_timings", None) or {}
            for key in set(kernel.cache) - before:  # one new key per call: the timings are its own
                records.append({
                    "kernel": kernel_name(kernel),
                    "key": str(key),
                    "best": config_name(kernel.cache[key]),
                    "timings_ms": {config_name(config): float(_median(times)) for config, times in timings.items()},
                })  # fmt: skip
            return result

        return run_and_record

    saved = [(kernel, kernel.__dict__.get("run")) for kernel in wrapped]
    for kernel in wrapped:
        kernel.run = recording(kernel, kernel.run)  # an instance attribute over the class's method
    try:
        yield records
    finally:
        for kernel, previous in saved:
            if previous is None:
                del kernel.run
            else:
                kernel.run = previous


def _median(times) -> float:
    """The autotuner's timing of a config: ``do_bench``'s quantiles ``[median, p20, p80]`` or one number."""
    return times[0] if isinstance(times, (list, tuple)) else times


#: ``torch.library.wrap_triton`` (torch >= 2.6), else None.
_wrap_triton = getattr(torch.library, "wrap_triton", None)


def launch(kernel, grid):
    """``kernel[grid]``; while torch traces (``torch.compile``, the functional decomposition of an op
    registered with ``torch.library.triton_op``, ``make_fx``), ``torch.library.wrap_triton(kernel)[grid]``,
    so that the trace records the kernel (see :mod:`icrl_kernels._library`). Every launch in the package
    goes through here.

    Outside tracing the wrapper would only add a higher-order-op dispatch to every launch, so plain eager
    calls launch directly. Under ``TRITON_INTERPRET=1`` kernels are never wrapped: the interpreter runs them
    on the host at once (it cannot run on fake tensors), and older torch's ``wrap_triton`` rejects
    interpreted kernels.
    """
    if _wrap_triton is not None and _tracing() and not triton_interpreter_enabled():
        return _wrap_triton(kernel)[grid]
    return kernel[grid]


def _tracing() -> bool:
    """Whether a dispatch mode (fake, functional or proxy tensors, or a user mode) or Dynamo is active."""
    return torch._C._len_torch_dispatch_stack() > 0 or torch.compiler.is_compiling()


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
