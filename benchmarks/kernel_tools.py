"""Tooling for the Triton kernels, kept out of the wheel: finding every autotuned kernel and recording the
autotuner's choices (benchmarks, tests and ``gpu_check.py`` use these).

Importable without Triton: the kernel modules (which need it) are imported inside the functions.
"""

from __future__ import annotations

import contextlib
import importlib
import pkgutil
from collections.abc import Iterator, Sequence

import icrl_kernels


def autotuned_kernels() -> list:
    """Every kernel of the package declared with ``icrl_kernels._triton.autotune``.

    Kernel modules are imported lazily by the ops, so this first imports every ``icrl_kernels`` module
    whose name ends in ``kernels`` (``ngram.kernels``, ``ngram.tiled_kernels``, ...): a new autotuned
    kernel is found without being listed anywhere.
    """
    from icrl_kernels import _triton

    for module in pkgutil.walk_packages(icrl_kernels.__path__, prefix="icrl_kernels."):
        if module.name.rsplit(".", 1)[-1].endswith("kernels"):
            importlib.import_module(module.name)
    return _triton.imported_autotuned_kernels()


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
    from icrl_kernels._triton import config_name, kernel_name

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
