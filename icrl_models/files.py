"""Crash-safe files: every file a command writes is either complete or not there (its previous version intact).

A process can die at any instruction (``SIGKILL``, a time limit, a full disk, a power cut). Writing a file in
place leaves half of it behind, which a later run then reads as if it were whole. Every file of this package
(checkpoints, datasets, ``config.json``, ``eval.json`` / ``eval.png``, experiment JSON, Markdown and PNG) is
therefore written the one way :func:`atomic_path` implements: into a temporary file next to the target
(``.<name>.<random>.partial``), flushed and ``fsync``-ed, then renamed over the target (atomic on POSIX and
Windows), and the folder ``fsync``-ed so that the rename itself survives a power cut. A failure removes the
temporary file and leaves the target as it was.

``metrics.jsonl`` is the exception by design: it grows by one line per log point. :class:`JsonLines` appends
(a killed write leaves at most a torn last line, which :func:`read_json_lines` drops) and :meth:`JsonLines.sync`
forces the rows written so far to disk, which trainers do before each checkpoint: a checkpoint never refers to
rows that a crash could still lose.

A write that fails for lack of space or permission (``ENOSPC``, ``EDQUOT``, ``EROFS``, ``EACCES``, ...) raises
the ``OSError`` with the target's path as its ``filename``, which the commands print as one line (exit 2).
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """A temporary path beside ``path`` to write the file at; when the block ends normally the file is
    ``fsync``-ed and renamed to ``path`` (and the folder ``fsync``-ed). For writers that need a file name
    (HDF5, ``savefig``); :func:`atomic_open` gives a file object. The folder is created if needed.

    Raises the ``OSError`` of a failed write with ``path`` as its filename (the temporary file removed).
    """
    path = Path(path)
    with _naming(path):
        path.parent.mkdir(parents=True, exist_ok=True)
        handle, name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".partial", dir=path.parent)
        os.close(handle)
        temporary = Path(name)
        try:
            yield temporary
            _fsync_file(temporary)
            umask = os.umask(0)
            os.umask(umask)
            os.chmod(temporary, 0o666 & ~umask)  # mkstemp creates 0600; give the file the usual permissions
            os.replace(temporary, path)
        except BaseException:
            temporary.unlink(missing_ok=True)
            raise
        _fsync_folder(path.parent)


@contextlib.contextmanager
def atomic_open(path: str | os.PathLike, mode: str = "w", **kwargs: Any) -> Iterator[IO]:
    """``open(path, mode)`` (``"w"`` or ``"wb"``), written atomically as :func:`atomic_path` describes."""
    if mode not in ("w", "wb"):
        raise ValueError(f"mode must be 'w' or 'wb', got {mode!r}")
    with atomic_path(path) as temporary, open(temporary, mode, **kwargs) as file:
        yield file


def write_text(path: str | os.PathLike, text: str) -> Path:
    """Write ``text`` (UTF-8) to ``path`` atomically; returns the path."""
    with atomic_open(path, "w", encoding="utf-8") as file:
        file.write(text)
    return Path(path)


def write_bytes(path: str | os.PathLike, data: bytes | memoryview) -> Path:
    """Write ``data`` to ``path`` atomically; returns the path."""
    with atomic_open(path, "wb") as file:
        file.write(data)
    return Path(path)


def write_json(path: str | os.PathLike, value: Any, *, indent: int | None = 1) -> Path:
    """Write ``json.dumps(value, indent=indent)`` to ``path`` atomically; returns the path."""
    return write_text(path, json.dumps(value, indent=indent))


def save_figure(figure: Any, path: str | os.PathLike, **kwargs: Any) -> Path:
    """``figure.savefig(path, **kwargs)`` (a matplotlib figure) written atomically, then the figure closed
    (pyplot keeps every open figure otherwise). The format comes from ``path``'s suffix, as ``savefig`` would
    take it (the temporary file's name ends in ``.partial``)."""
    import matplotlib.pyplot as plt

    path = Path(path)
    kwargs.setdefault("format", path.suffix.lstrip(".") or None)
    try:
        with atomic_path(path) as temporary:
            figure.savefig(temporary, **kwargs)
    finally:
        plt.close(figure)
    return path


def remove_partial_files(folder: str | os.PathLike) -> list[Path]:
    """Delete the temporary files that writes killed midway left in ``folder`` (``.<name>.*.partial``; the
    targets themselves are whole); returns them. Only for a folder no other process is writing into."""
    removed = []
    for path in Path(folder).glob(".*.partial"):
        if path.is_file():
            path.unlink(missing_ok=True)
            removed.append(path)
    return removed


class JsonLines:
    """An append-only JSON-lines file (``metrics.jsonl``): :meth:`write` appends one row; :meth:`sync` forces
    every row written so far to disk. Rows are never rewritten in place; a write killed midway leaves at most
    a torn last line, which :func:`read_json_lines` drops. A failed write raises its ``OSError`` naming the file.
    """

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        with _naming(self.path):
            self._file = open(self.path, "a", encoding="utf-8")

    def write(self, record: dict) -> None:
        """Append ``record`` as one line (handed to the operating system at once: a killed process keeps it)."""
        with _naming(self.path):
            self._file.write(json.dumps(record) + "\n")
            self._file.flush()

    def sync(self) -> None:
        """``fsync`` the file: the rows written so far survive a crash of the machine too."""
        with _naming(self.path):
            self._file.flush()
            os.fsync(self._file.fileno())

    def close(self) -> None:
        with _naming(self.path):
            self._file.close()

    def __enter__(self) -> JsonLines:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def read_json_lines(path: str | os.PathLike) -> list[dict]:
    """The rows of a JSON-lines file (none if it does not exist); a torn line (a kill mid-write) is dropped."""
    path = Path(path)
    if not path.exists():
        return []
    records = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return records


@contextlib.contextmanager
def _naming(path: Path) -> Iterator[None]:
    """Give an ``OSError`` raised inside (``file.write`` sets no filename) ``path`` as its filename, so a full
    disk reads ``No space left on device: run/checkpoint.pt`` rather than ``[Errno 28] No space left...``."""
    try:
        yield
    except OSError as error:
        if error.filename is not None or error.errno is None:
            raise
        raise OSError(error.errno, error.strerror or os.strerror(error.errno), str(path)) from error


def _fsync_file(path: Path) -> None:
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def _fsync_folder(folder: Path) -> None:
    """``fsync`` a folder so that a rename in it is durable (a no-op where folders cannot be opened)."""
    try:
        descriptor = os.open(folder, os.O_RDONLY)
    except OSError:  # e.g. Windows
        return
    try:
        os.fsync(descriptor)
    except OSError:  # some filesystems refuse fsync on a folder: the rename is then as durable as they make it
        pass
    finally:
        os.close(descriptor)
