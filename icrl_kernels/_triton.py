"""Helpers for writing Triton kernels that also run under the CPU interpreter."""

from __future__ import annotations

from collections.abc import Sequence

import triton

from ._backend import triton_interpreter_enabled


def autotune(configs: Sequence[triton.Config], key: Sequence[str], **kwargs):
    """``triton.autotune`` that keeps only the first config under the interpreter.

    A multi-config autotune needs a GPU to time candidates (it crashes in the interpreter), so the
    first config must be a sensible default on every device.
    """
    if triton_interpreter_enabled():
        configs = list(configs)[:1]
    return triton.autotune(configs=list(configs), key=list(key), **kwargs)
