"""What every ``icrl-*`` command shares: user errors as one line on stderr and exit status 2.

:func:`command_line` wraps a ``main(argv) -> int``. A *user error* (a bad flag value, a missing or
corrupt file: see :data:`USER_ERRORS`) prints ``"<prog>: error: <message>"`` on one line of stderr and
returns 2, as ``argparse``'s ``parser.error`` does for a malformed command line. Anything else is a bug
and keeps its traceback, except a :class:`ReportedFailure` (failed sweep trials, whose tracebacks are in their
logs): one line, exit status 1. ``ICRL_TRACEBACK=1`` in the environment shows the traceback of both too.

A write the machine refuses (a full disk, a read-only filesystem: :data:`WRITE_REFUSED_ERRNOS`, and
``PermissionError``) is one line with exit status 2 too, naming the file.

The split follows the library's convention: every check of a caller's input raises ``ValueError``
(:class:`~icrl_models.data.DatasetError` and :class:`~icrl_models.checkpoint.CheckpointError` are
subclasses), and a missing path raises ``FileNotFoundError``. A ``TypeError`` means the library was
called wrongly, so it is a bug at the command line (argparse has already converted every flag).
"""

from __future__ import annotations

import argparse
import errno
import functools
import os
import sys
from collections.abc import Callable

import torch

from icrl_kernels.validation import check_device

#: Exceptions reported as one line with exit status 2 instead of a traceback.
USER_ERRORS: tuple[type[BaseException], ...] = (
    ValueError,
    FileNotFoundError,
    FileExistsError,
    IsADirectoryError,
    NotADirectoryError,
    PermissionError,
)
#: ``OSError`` numbers of a write that the machine refused: a full disk or quota, a read-only filesystem, a
#: file too large. Reported like user errors (one line, exit status 2): the user frees space or picks another
#: folder; the files are written atomically (:mod:`icrl_models.files`), so nothing was left half-written.
#: (``EACCES``/``EPERM`` are ``PermissionError``, a user error already.)
WRITE_REFUSED_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EFBIG})
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130


class UsageError(ValueError):
    """A command-line mistake the user can fix (a flag value that is out of range, a device that is absent)."""


class ReportedFailure(RuntimeError):
    """A failure whose details (tracebacks) are already written elsewhere, e.g. the failed trials of a sweep
    with their logs: printed as one line naming them, exit status 1 (a traceback here would show only
    where the failure was collected)."""


EXIT_FAILURE = 1


def one_line(error: BaseException) -> str:
    """The message of ``error`` squeezed onto one line (some exceptions carry several)."""
    text = " ".join(part.strip() for part in str(error).splitlines() if part.strip())
    if isinstance(error, OSError) and error.filename is not None and error.strerror:
        text = f"{error.strerror}: {error.filename}"  # "[Errno 2] No such file ..." reads badly
    return text or type(error).__name__


def command_line(prog: str) -> Callable[[Callable[..., int | None]], Callable[..., int]]:
    """Decorate ``main(argv=None)`` of the command ``prog``: see the module docstring."""

    def decorate(main: Callable[..., int | None]) -> Callable[..., int]:
        @functools.wraps(main)
        def wrapper(argv: list[str] | None = None) -> int:
            try:
                status = main(argv)
            except USER_ERRORS as error:
                if os.environ.get("ICRL_TRACEBACK"):
                    raise
                print(f"{prog}: error: {one_line(error)}", file=sys.stderr)
                return EXIT_USAGE
            except OSError as error:
                if error.errno not in WRITE_REFUSED_ERRNOS or os.environ.get("ICRL_TRACEBACK"):
                    raise
                print(f"{prog}: error: {one_line(error)}", file=sys.stderr)
                return EXIT_USAGE
            except ReportedFailure as error:
                if os.environ.get("ICRL_TRACEBACK"):
                    raise
                print(f"{prog}: error: {one_line(error)}", file=sys.stderr)
                return EXIT_FAILURE
            except KeyboardInterrupt:
                print(f"{prog}: interrupted", file=sys.stderr)
                return EXIT_INTERRUPTED
            return 0 if status is None else status

        return wrapper

    return decorate


def _int_at_least(text: str, minimum: int) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an int, got {text!r}") from None
    if value < minimum:
        raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {value}")
    return value


def positive_int(text: str) -> int:
    """``argparse`` type: an int >= 1."""
    return _int_at_least(text, 1)


def non_negative_int(text: str) -> int:
    """``argparse`` type: an int >= 0."""
    return _int_at_least(text, 0)


def resolve_device(name: str, *, local_rank: int = 0, name_of: str = "device") -> torch.device:
    """The torch device ``name`` names (``"auto"``: CUDA device ``local_rank`` if there is one, else the
    CPU), checked to exist on this machine: a clear :class:`UsageError` instead of an ``AssertionError``
    (CUDA asked for on a machine without it) or a ``RuntimeError`` (a misspelt name) at first use."""
    if isinstance(name, torch.device):
        name = str(name)
    if not isinstance(name, str):
        raise TypeError(f"{name_of} must be a string such as 'cpu' or 'cuda:0', got {type(name).__name__}")
    if name == "auto":
        return torch.device(f"cuda:{local_rank}" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        device = None
    if device is None or device.type not in ("cpu", "cuda"):
        raise UsageError(f"{name_of} must be auto, cpu, cuda or cuda:N, got {name!r}")
    try:
        return check_device(device, name_of)  # CUDA present, the index in range
    except ValueError as error:
        raise UsageError(str(error)) from None
