"""Backend selection shared by every op.

``backend="auto"`` picks Triton for CUDA tensors, Triton through its CPU interpreter when
``TRITON_INTERPRET=1`` is set (that is how CI exercises the kernels), and eager PyTorch otherwise.
``"triton"``, ``"eager"`` and ``"reference"`` force a path:

* ``"reference"``: the readable fp32 reference that defines the op (may be O(L^2) or slower);
* ``"eager"``: an eager PyTorch version of the fast algorithm (what CPUs run by default);
* ``"triton"``: the fused Triton kernels (CUDA, or the interpreter).
"""

from __future__ import annotations

import functools
import importlib.util
import os
from collections.abc import Callable, Mapping
from typing import Literal

import torch

from ._validation import KERNEL_FLOAT_DTYPES, check_device

Backend = Literal["auto", "triton", "eager", "reference"]
BACKENDS: tuple[str, ...] = ("auto", "triton", "eager", "reference")


_INTERPRET_VARIABLE = "TRITON_INTERPRET"
_TRUE_VALUES = ("1", "true", "yes", "on")
# Every op's argument checks read the flag on every call with CPU tensors (``backend="auto"`` depends on it),
# and ``os.environ.get`` runs five Python frames (Mapping.get, __getitem__, the key's encoding, the value's
# decoding): about 3 us of a 45 us call in ``benchmarks/dispatch_overhead.py``. CPython's ``os.environ`` keeps
# its encoded items in a plain dict (``os._Environ._data``, updated by every write through ``os.environ``, as
# ``monkeypatch.setenv`` does): the usual spellings are looked up there directly; any other value, and a
# Python without that dict, go through ``os.environ.get``. ``tests/test_dispatch.py`` checks that both agree.
_ENVIRON_ITEMS = getattr(os.environ, "_data", None)
if _ENVIRON_ITEMS is not None:
    _INTERPRET_KEY = os.environ.encodekey(_INTERPRET_VARIABLE)
    #: The flag of each usual spelling, by its encoded value.
    _FLAG_OF_VALUE = {
        os.environ.encodevalue(value): value in _TRUE_VALUES for value in (*_TRUE_VALUES, "0", "false", "no", "off", "")
    }


#: ``interpreter_setting()``: a value that changes whenever ``TRITON_INTERPRET`` does (its raw setting, or
#: None), for cache keys (:func:`icrl_kernels._library.checked_per_signature`); a dict lookup called from C,
#: no Python frame.
interpreter_setting: Callable[[], object]
if _ENVIRON_ITEMS is not None:
    interpreter_setting = functools.partial(_ENVIRON_ITEMS.get, _INTERPRET_KEY)


def triton_interpreter_enabled() -> bool:
    """True when ``TRITON_INTERPRET`` asks Triton to run kernels on the CPU interpreter (read at each call)."""
    if _ENVIRON_ITEMS is not None:
        value = _ENVIRON_ITEMS.get(_INTERPRET_KEY)
        if value is None:
            return False
        flag = _FLAG_OF_VALUE.get(value)
        if flag is not None:
            return flag
    return os.environ.get(_INTERPRET_VARIABLE, "0").strip().lower() in _TRUE_VALUES


if _ENVIRON_ITEMS is None:  # pragma: no cover - CPython always has it
    interpreter_setting = triton_interpreter_enabled


#: Looked up once: ``torch.compile`` cannot trace ``importlib.util.find_spec`` (a graph break, an error
#: under ``fullgraph=True``), and the answer does not change within a process.
_TRITON_INSTALLED = importlib.util.find_spec("triton") is not None


def triton_available() -> bool:
    """True when the ``triton`` package can be imported (it is Linux-only)."""
    return _TRITON_INSTALLED


def triton_runs_on(device: torch.device) -> bool:
    """Whether a Triton kernel can run on tensors of ``device`` in this process."""
    if not triton_available():
        return False
    if device.type == "cuda":
        return True
    return device.type == "cpu" and triton_interpreter_enabled()


def resolve_backend(
    backend: str,
    device: torch.device,
    *,
    has_eager: bool = True,
    kernel_inputs: Mapping[str, torch.Tensor | None] | None = None,
) -> str:
    """Turn a user's ``backend=`` argument into ``"triton"``, ``"eager"`` or ``"reference"``.

    Args:
        backend: one of ``"auto"``, ``"triton"``, ``"eager"``, ``"reference"``.
        device: the device of the op's inputs (a ``torch.device``; a name such as ``"cuda"`` is checked).
        has_eager: whether the op has an eager fast path; without one ``"eager"`` means the reference.
        kernel_inputs: the op's float tensor arguments by name (``None`` entries are skipped). When the
            result is ``"triton"``, each must be fp16, bf16 or fp32, the dtypes the kernels take (fp64 runs
            on the eager and reference backends only).

    Raises:
        ValueError: unknown backend, a device name that names no device here, or ``"triton"`` where
            Triton cannot run.
        TypeError: a device that is not a ``torch.device``, ``str`` or ``int``; ``"triton"`` with a
            ``kernel_inputs`` tensor of another dtype (the message names it).
    """
    if not isinstance(backend, str) or backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if not isinstance(device, torch.device):  # a name or index: checked (the ops pass a tensor's device)
        device = check_device(device)
    if backend == "auto":
        backend = "triton" if triton_runs_on(device) else "eager"
    elif backend == "triton":
        if not triton_available():
            raise ValueError("backend='triton' needs the triton package, which is not installed")
        if not triton_runs_on(device):
            raise ValueError(
                f"backend='triton' needs CUDA tensors (got device {device}) "
                "or TRITON_INTERPRET=1 set before triton is imported"
            )
    if backend == "triton":
        for name, tensor in (kernel_inputs or {}).items():
            if tensor is not None and tensor.dtype not in KERNEL_FLOAT_DTYPES:
                raise TypeError(f"{name} must be float16, bfloat16 or float32 for backend='triton', got {tensor.dtype}")
        return "triton"
    if backend == "eager" and not has_eager:
        return "reference"
    return backend
