"""Atomic, checksummed training checkpoints (resume after a kill; reject a corrupt file clearly).

File layout::

    b"ICRLCKPT"        8-byte magic
    sha256             32-byte SHA-256 digest of everything after it
    payload            the payload dict as written by ``torch.save`` (a zip archive)

``torch.save``'s zip archive does not protect the tensor bytes: a file with one flipped byte inside a
weight loads without complaint. The digest covers every byte of the payload, so :func:`load_checkpoint`
detects any corruption or truncation and raises :class:`CheckpointError` naming the file.

Checkpoints written before the digest existed are plain ``torch.save`` archives (they start with the zip
magic ``PK``). They still load, unverified, with a :class:`UncheckedCheckpointWarning`; the next save of a
resumed run rewrites them in the checksummed layout.
"""

from __future__ import annotations

import hashlib
import io
import os
import warnings
from pathlib import Path
from typing import Any

import torch

from .files import atomic_open

CHECKPOINT_VERSION = 1
REQUIRED_KEYS = ("version", "step", "config", "model", "optimizer", "rng")
MAGIC = b"ICRLCKPT"
_DIGEST_SIZE = hashlib.sha256().digest_size
_ZIP_MAGIC = b"PK\x03\x04"


class CheckpointError(ValueError):
    """A checkpoint is truncated, corrupt, or belongs to a different run configuration."""


class UncheckedCheckpointWarning(UserWarning):
    """A checkpoint without a checksum (written by an older version) was loaded without verification."""


def save_checkpoint(payload: dict[str, Any], path: str | os.PathLike) -> Path:
    """Write ``payload`` (see :data:`REQUIRED_KEYS`) to ``path`` atomically with a SHA-256 digest: a
    temporary file in the same folder, fsync, then rename (:func:`~icrl_models.files.atomic_open`), so a
    kill or a full disk mid-write leaves the previous checkpoint intact."""
    if not isinstance(payload, dict):
        raise TypeError(f"payload must be a dict, got {type(payload).__name__}")
    path = Path(path)
    missing = [key for key in REQUIRED_KEYS if key not in payload]
    if missing:
        raise ValueError(f"checkpoint payload lacks {missing}")
    if not isinstance(payload["config"], dict):
        raise TypeError(f"payload['config'] must be a dict, got {type(payload['config']).__name__}")
    buffer = io.BytesIO()
    torch.save(payload, buffer)
    data = buffer.getbuffer()
    with atomic_open(path, "wb") as file:
        file.write(MAGIC + hashlib.sha256(data).digest())
        file.write(data)
    return path


def _read_payload_bytes(path: Path) -> bytes:
    """The ``torch.save`` bytes of a checkpoint file, verified against its digest when it has one."""
    raw = path.read_bytes()
    if raw.startswith(MAGIC):
        stored, data = raw[len(MAGIC) : len(MAGIC) + _DIGEST_SIZE], raw[len(MAGIC) + _DIGEST_SIZE :]
        if len(stored) < _DIGEST_SIZE or hashlib.sha256(data).digest() != stored:
            raise CheckpointError(f"{path} fails its SHA-256 checksum: the file is truncated or corrupt")
        return data
    if raw.startswith(_ZIP_MAGIC):
        warnings.warn(
            f"{path} has no checksum (a checkpoint from an older version): it is loaded unverified; "
            "the next checkpoint save rewrites it with one",
            UncheckedCheckpointWarning,
            stacklevel=3,
        )
        return raw
    raise CheckpointError(f"{path} is not a checkpoint: truncated or corrupt, or another kind of file")


def _check_fields(path: Path, payload: dict[str, Any]) -> None:
    """Raise :class:`CheckpointError` naming the field unless the required fields have their kinds: ``step``
    an int >= 0 (not a bool or a float), ``model`` a state dict (names -> tensors), ``optimizer`` and ``rng``
    dicts. A resuming trainer would otherwise fail later with a raw ``AttributeError`` or ``KeyError``."""
    step = payload["step"]
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise CheckpointError(f"{path}: field 'step' must be an int >= 0, got {step!r}")
    model = payload["model"]
    if not isinstance(model, dict) or not all(
        isinstance(name, str) and isinstance(value, torch.Tensor) for name, value in model.items()
    ):
        raise CheckpointError(f"{path}: field 'model' must be a state dict (parameter names -> tensors)")
    for field in ("optimizer", "rng"):
        if not isinstance(payload[field], dict):
            raise CheckpointError(f"{path}: field {field!r} must be a dict, got {type(payload[field]).__name__}")


def checkpoint_field(payload: dict[str, Any], path: str | os.PathLike, *keys: str, kind: type | tuple = object) -> Any:
    """``payload[keys[0]][keys[1]]...`` of a loaded checkpoint, checked to exist and be a ``kind``; a
    :class:`CheckpointError` naming the field (e.g. ``'rng'['numpy']``) otherwise. For the fields a
    trainer adds to :data:`REQUIRED_KEYS` (random states, histories)."""
    value: Any = payload
    for depth, key in enumerate(keys):
        if not isinstance(value, dict) or key not in value:
            field = "".join(f"[{k!r}]" for k in keys[: depth + 1])
            raise CheckpointError(f"{path}: field {field} is missing")
        value = value[key]
    if not isinstance(value, kind):
        field = "".join(f"[{k!r}]" for k in keys)
        raise CheckpointError(f"{path}: field {field} has type {type(value).__name__}, not the one saved")
    return value


def load_checkpoint(path: str | os.PathLike, *, expect_config: dict[str, Any] | None = None) -> dict[str, Any]:
    """Load a checkpoint written by :func:`save_checkpoint` onto the CPU.

    Raises :class:`CheckpointError` when the file cannot be read (not a checkpoint, truncated, a byte
    changed: the SHA-256 digest does not match), lacks a field, has another version or a stored config
    that is not a dict, or when ``expect_config`` is given and any of its keys differ from the stored
    run config (resuming a different run would silently mix the two). A checkpoint without a digest
    (older versions) loads with an :class:`UncheckedCheckpointWarning`.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no checkpoint at {path}")
    if expect_config is not None and not isinstance(expect_config, dict):
        raise TypeError(f"expect_config must be a dict or None, got {type(expect_config).__name__}")
    data = _read_payload_bytes(path)
    try:
        payload = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception as error:  # RuntimeError, UnpicklingError, EOFError...: torch's messages span many lines
        raise CheckpointError(
            f"{path} is not a readable checkpoint: truncated or corrupt, or not written by save_checkpoint "
            f"({type(error).__name__} while unpickling)"
        ) from None
    if not isinstance(payload, dict):
        raise CheckpointError(f"{path} does not hold a checkpoint dict")
    missing = [key for key in REQUIRED_KEYS if key not in payload]
    if missing:
        raise CheckpointError(f"{path} lacks {missing}")
    if payload["version"] != CHECKPOINT_VERSION:
        raise CheckpointError(f"{path} has checkpoint version {payload['version']}, expected {CHECKPOINT_VERSION}")
    stored = payload["config"]
    if not isinstance(stored, dict):
        raise CheckpointError(f"{path} holds a config of type {type(stored).__name__}, expected a dict")
    _check_fields(path, payload)
    if expect_config is not None:
        differing = sorted(key for key in expect_config if stored.get(key) != expect_config[key])
        if differing:
            details = ", ".join(f"{key}: {stored.get(key)!r} != {expect_config[key]!r}" for key in differing[:5])
            raise CheckpointError(f"{path} belongs to another run configuration ({details})")
    return payload
