"""Argument checks shared by every public function of both packages: errors name the offending argument.

The implementation; :mod:`icrl_kernels.validation` is its public face (what :mod:`icrl_models` and users
import).
"""

from __future__ import annotations

import contextlib
import numbers
import os
from collections.abc import Callable, Iterable, Iterator, Sequence

import torch

from ._torch_compat import assert_async, is_batched_tensor, unwrap_batched

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
KERNEL_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
INT_DTYPES = (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8)


def check_tensor(
    value: object,
    name: str,
    *,
    ndim: int | Iterable[int] | None = None,
    dtypes: Iterable[torch.dtype] | None = None,
    nonempty: bool = False,
) -> torch.Tensor:
    """Check that ``value`` is a tensor with an allowed rank and dtype; return it.

    Raises:
        TypeError: not a tensor, or a dtype outside ``dtypes``.
        ValueError: wrong number of dimensions, or an empty tensor when ``nonempty``.
    """
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    if ndim is not None:
        allowed = (ndim,) if isinstance(ndim, int) else tuple(ndim)
        if value.dim() not in allowed:
            want = " or ".join(f"{d}-D" for d in allowed)
            raise ValueError(f"{name} must be {want}, got shape {tuple(value.shape)}")
    if dtypes is not None:
        allowed_dtypes = tuple(dtypes)
        if value.dtype not in allowed_dtypes:
            names = ", ".join(str(d).replace("torch.", "") for d in allowed_dtypes)
            raise TypeError(f"{name} must have dtype in ({names}), got {str(value.dtype).replace('torch.', '')}")
    if nonempty and value.numel() == 0:
        raise ValueError(f"{name} must not be empty, got shape {tuple(value.shape)}")
    return value


def check_shape(value: torch.Tensor, name: str, expected: tuple[int, ...], described_as: str) -> None:
    """Raise ``ValueError`` unless ``value.shape == expected`` (``described_as`` says what it must match)."""
    if tuple(value.shape) != tuple(expected):
        raise ValueError(f"{name} must have shape {described_as} = {tuple(expected)}, got {tuple(value.shape)}")


def check_same_device(**tensors: torch.Tensor) -> torch.device:
    """Raise ``ValueError`` unless every tensor lives on one device; return that device."""
    items = list(tensors.items())
    first_name, first = items[0]
    for name, tensor in items[1:]:
        if tensor.device != first.device:
            raise ValueError(
                f"{name} is on {tensor.device} but {first_name} is on {first.device}; move them to one device"
            )
    return first.device


def check_device(value: object, name: str = "device") -> torch.device:
    """A device argument (a ``torch.device``, a string such as ``"cpu"`` or ``"cuda:1"``, or a CUDA index)
    as the ``torch.device`` it names, checked to exist on this machine; return it.

    Raises:
        TypeError: not a ``torch.device``, ``str`` or ``int``.
        ValueError: a string that names no device type (torch's own error lists every type torch knows),
            CUDA asked for where CUDA is not available, or a CUDA index past the last device.
    """
    if isinstance(value, bool) or not isinstance(value, (torch.device, str, int)):
        raise TypeError(f"{name} must be a torch.device, str or int, got {type(value).__name__}")
    try:
        device = torch.device(value)
    except RuntimeError:  # e.g. "gpu"
        raise ValueError(f"{name} must name a device such as 'cpu', 'cuda' or 'cuda:1', got {value!r}") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"{name} {str(device)!r} asked for CUDA, but CUDA is not available on this machine")
        count = torch.cuda.device_count()
        if device.index is not None and device.index >= count:
            raise ValueError(f"{name} {str(device)!r} does not exist: this machine has {count} CUDA device(s)")
    return device


def row_mask(rows: object, name: str, num_rows: int, device: torch.device) -> torch.Tensor:
    """The rows a caller selects, as a bool mask ``[num_rows]`` on ``device``.

    ``rows``: a bool mask ``[num_rows]``, or integer row indices in ``[0, num_rows)`` (a 1-D tensor, or a
    list/tuple of ints). Indices are scattered into the mask (boolean indexing would size its result
    from the values: a host sync); their range is a value check (``check_values``: no host read on GPU).

    Raises:
        TypeError: not a tensor, list or tuple; a dtype that is neither bool nor integer.
        ValueError: a mask of another length, indices that are not 1-D or lie outside ``[0, num_rows)``.
    """
    if isinstance(rows, (list, tuple)):
        flags = [isinstance(row, bool) for row in rows]
        if all(flags) and rows:
            rows = torch.tensor(rows, dtype=torch.bool)
        elif any(flags) or not all(isinstance(row, numbers.Integral) for row in rows):
            raise TypeError(f"{name} must hold ints (row indices) or only bools (a mask), got {rows!r}")
        else:
            rows = torch.tensor(rows, dtype=torch.int64)
    if not isinstance(rows, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, list or tuple (row indices or a bool mask), got {rows!r}")
    check_tensor(rows, name, ndim=1, dtypes=(torch.bool,) + INT_DTYPES)
    if rows.dtype == torch.bool:
        check_shape(rows, name, (num_rows,), "(num_rows,)")
        return rows.to(device)
    indices = rows.to(device).long()
    outside = (indices < 0) | (indices >= num_rows)
    message = f"{name} must be row indices in [0, {num_rows})"
    check_values(outside.any(), message, lambda: f", got {indices[outside][:5].tolist()}")
    # With value checks off, an index outside the rows selects nothing (an extra slot, dropped).
    mask = torch.zeros(num_rows + 1, dtype=torch.bool, device=device)
    return mask.index_fill(0, torch.where(outside, num_rows, indices), True)[:num_rows]


def check_int(value: object, name: str, *, min_value: int | None = None, max_value: int | None = None) -> int:
    """Check an integer argument against optional inclusive bounds; return it as a Python ``int``.

    Python and numpy integers pass; a bool, a float (even ``4.0``), a string or a tensor does not (a tensor
    would need a host read, and an int-valued float is usually a mistake upstream).

    Raises:
        TypeError: not an integer (the message names the argument and shows the value).
        ValueError: below ``min_value`` or above ``max_value``.
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    value = int(value)
    if (min_value is not None and value < min_value) or (max_value is not None and value > max_value):
        if max_value is None:
            bounds = f">= {min_value}"
        elif min_value is None:
            bounds = f"<= {max_value}"
        else:
            bounds = f"in [{min_value}, {max_value}]"
        raise ValueError(f"{name} must be {bounds}, got {value}")
    return value


def check_positive_float(value: object, name: str) -> float:
    """Check a strictly positive, finite real number (e.g. a temperature); return it as ``float``."""
    value = _real(value, name)
    if not (value > 0.0 and value != float("inf")):
        raise ValueError(f"{name} must be > 0 and finite, got {value}")
    return value


def check_choice(value: object, name: str, choices: Iterable[str]) -> str:
    """Check that ``value`` is one of the allowed strings; return it."""
    options = tuple(choices)
    if value not in options:
        raise ValueError(f"{name} must be one of {options}, got {value!r}")
    return value  # type: ignore[return-value]


def check_bool(value: object, name: str) -> bool:
    """Check a flag: a real ``bool`` (``"yes"`` or ``1`` would pass silently as truthy); return it."""
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__}")
    return value


def _real(value: object, name: str) -> float:
    """``value`` as ``float`` if it is a real number (bool is rejected: ``True`` is no temperature)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a real number, got {type(value).__name__}")
    return float(value)


def check_finite_float(value: object, name: str) -> float:
    """Check a finite real number (bool is rejected); return it as ``float``."""
    value = _real(value, name)
    if value != value or value in (float("inf"), float("-inf")):
        raise ValueError(f"{name} must be finite, got {value}")
    return value


def check_probability(value: object, name: str) -> float:
    """Check a dropout-style probability in ``[0, 1)``; return it as ``float``."""
    value = check_finite_float(value, name)
    if not 0.0 <= value < 1.0:
        raise ValueError(f"{name} must be in [0, 1), got {value}")
    return value


def check_features(
    value: object, name: str, width: int, *, width_name: str = "d_model", dims: str = "B, L"
) -> torch.Tensor:
    """Check a module activation ``[*dims, width]``: a float tensor of that rank whose last dim is ``width``.

    ``dims`` names the leading dimensions (``"B, L"`` for ``[B, L, D]``); the messages say the expected
    shape, e.g. ``x must have shape [B, L, 64] (d_model=64), got [2, 5, 63]``. Shapes and dtypes only.
    """
    rank = len(dims.split(",")) + 1
    tensor = check_tensor(value, name, ndim=rank, dtypes=FLOAT_DTYPES)
    if tensor.shape[-1] != width:
        raise ValueError(f"{name} must have shape [{dims}, {width}] ({width_name}={width}), got {list(tensor.shape)}")
    return tensor


_AUTOCAST_DEVICE_TYPES = ("cpu", "cuda", "xpu", "mps", "hpu")


def check_matches_params(value: torch.Tensor, name: str, param: torch.Tensor) -> None:
    """Raise when a module input is on another device than its parameters (``param``: ``ValueError``) or
    has another dtype (``TypeError``), unless autocast is on for its device (autocast casts both sides
    of each matmul itself)."""
    if value.device != param.device:
        raise ValueError(
            f"{name} is on {value.device} but the module's parameters are on {param.device}; "
            f"move one of them (module.to(device))"
        )
    if value.dtype == param.dtype:
        return
    device_type = value.device.type
    if device_type in _AUTOCAST_DEVICE_TYPES and torch.is_autocast_enabled(device_type):
        return
    dtype, want = str(value.dtype).replace("torch.", ""), str(param.dtype).replace("torch.", "")
    raise TypeError(
        f"{name} has dtype {dtype} but the module's parameters are {want}: cast the input or the module "
        f"(module.to(torch.{dtype})), or run under torch.autocast"
    )


def check_generator(value: object, name: str = "generator") -> torch.Generator | None:
    """Check an optional ``torch.Generator`` (a seed such as ``42`` is not one); return it."""
    if value is not None and not isinstance(value, torch.Generator):
        raise TypeError(
            f"{name} must be a torch.Generator or None, got {type(value).__name__} {value!r} "
            "(for a seed, pass torch.Generator().manual_seed(seed))"
        )
    return value


# -- value checks that never stall a GPU -----------------------------------------------------------
#: ``"auto"``: clear ``ValueError`` for CPU tensors (no GPU to stall); on CUDA an asynchronous device
#: assert (``torch._assert_async``), which, like an out-of-range target in ``F.cross_entropy``, is
#: reported at a later CUDA call and ends the process's CUDA context. ``"sync"``: the clear
#: ``ValueError`` on every device (one host sync per check: for debugging). ``"async"``: the device
#: assert on every device (on CPU it raises ``RuntimeError`` at once; tests use it to run the GPU's
#: code path on CPU). ``"off"``: no value checks. While a CUDA stream is capturing a graph every mode but
#: ``"off"`` takes the device assert: nothing is read on the host inside a capture.
VALUE_CHECK_MODES = ("auto", "sync", "async", "off")
_value_check_mode = os.environ.get("ICRL_VALUE_CHECKS", "auto").strip().lower()
if _value_check_mode not in VALUE_CHECK_MODES:
    raise ValueError(f"ICRL_VALUE_CHECKS must be one of {VALUE_CHECK_MODES}, got {_value_check_mode!r}")


def set_value_checks(mode: str) -> str:
    """Choose how ops check data-dependent conditions (targets in range, a row with no available action,
    ids in range, NaN); return the previous mode. See ``VALUE_CHECK_MODES``; the default comes from the
    environment variable ``ICRL_VALUE_CHECKS`` (``"auto"`` when unset)."""
    global _value_check_mode
    check_choice(mode, "mode", VALUE_CHECK_MODES)
    previous, _value_check_mode = _value_check_mode, mode
    return previous


def value_checks() -> str:
    """The current value-check mode (see :func:`set_value_checks`)."""
    return _value_check_mode


_device_side_scopes = 0


@contextlib.contextmanager
def device_side_value_checks() -> Iterator[None]:
    """Inside this context every value check queues its device assert, whatever the mode (but ``"off"``):
    nothing is read on the host. What a CUDA graph capture does by itself; graph capture helpers also wrap
    the warm-up step that they run under torch's sync-debug mode, so that it checks exactly what the
    graph will."""
    global _device_side_scopes
    _device_side_scopes += 1
    try:
        yield
    finally:
        _device_side_scopes -= 1


def synchronous_value_checks(device: torch.device) -> bool:
    """Whether a value check on ``device`` reads its result on the host and raises ``ValueError`` at once
    (mode ``"sync"``, or ``"auto"`` on the CPU), rather than queueing a device assert.

    Never while the current CUDA stream is capturing a graph, whatever the mode: a host read there would
    invalidate the capture (and a check read once at capture time would not run at replay). The device
    assert is recorded in the graph instead and runs at every replay. Nor inside
    :func:`device_side_value_checks`."""
    if _device_side_scopes or _capturing(device):
        return False
    if device.type == "cpu":
        return _value_check_mode in ("sync", "auto")
    return _value_check_mode == "sync"


def _capturing(device: torch.device) -> bool:
    """Whether a CUDA graph capture is underway on the current stream (False off CUDA)."""
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def check_values(bad: torch.Tensor, message: str, details: Callable[[], str] | None = None) -> None:
    """Raise ``ValueError`` if the 0-d bool tensor ``bad`` is True, without a host sync on GPU.

    This is the only place an op may read a tensor value on the host (a test scans the package for
    others). ``message`` names the argument and the rule; ``details`` (optional) returns extra text, such
    as offending values, and runs only when a synchronous check fails. Under ``torch.func.vmap`` (batched
    training of many runs, :mod:`icrl_models.batched`) ``bad`` is reduced over the vmapped dimensions
    first: the check fails when any slice is bad, and ``details`` is left out.
    """
    if _value_check_mode == "off":
        return
    batched = is_batched_tensor(bad)
    while is_batched_tensor(bad):  # inside torch.func.vmap: the check covers every vmapped slice
        bad = unwrap_batched(bad).any()
    if synchronous_value_checks(bad.device):
        if bool(bad):
            # details() would read values of the vmapped tensors, which vmap forbids: the message alone there.
            raise ValueError(message + (details() if details is not None and not batched else ""))
        return
    assert_async(~bad, message)


def check_status_codes(
    status: torch.Tensor,
    rules: Sequence[tuple[int, str, Callable[[torch.Tensor], str] | None]],
    async_message: str,
) -> None:
    """The value checks a kernel reported as a per-row status (0: the row is fine, else a rule's code).

    ``rules``: ``(code, message, details)`` in the order to report them; ``details(bad_rows)`` (or None)
    returns extra text and, like :func:`check_values`'s, runs only when a synchronous check fails. Where
    checks are synchronous (CPU tensors, or mode ``"sync"``) each code raises its own ``ValueError``; on
    the asynchronous path (CUDA) one device assert with ``async_message`` covers every rule: three small
    ops (reduce, negate, assert) whatever their number.
    """
    if _value_check_mode == "off":
        return
    if synchronous_value_checks(status.device):
        if not bool(status.any()):  # the common case, every row fine: one reduction, not one per rule
            return
        for code, message, details in rules:
            bad = status == code
            check_values(bad.any(), message, details and (lambda b=bad, d=details: d(b)))
        return
    check_values(status.any(), async_message)
