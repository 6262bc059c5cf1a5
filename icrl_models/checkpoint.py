"""Atomic, validated training checkpoints (resume after a kill; reject a corrupt file clearly)."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

import torch

CHECKPOINT_VERSION = 1
REQUIRED_KEYS = ("version", "step", "config", "model", "optimizer", "rng")


class CheckpointError(ValueError):
    """A checkpoint is truncated, corrupt, or belongs to a different run configuration."""


def save_checkpoint(payload: dict[str, Any], path: str | os.PathLike) -> Path:
    """Write ``payload`` (see :data:`REQUIRED_KEYS`) to ``path`` atomically: a temporary file in the same
    folder, fsync, then rename, so a kill mid-write leaves the previous checkpoint intact."""
    path = Path(path)
    missing = [key for key in REQUIRED_KEYS if key not in payload]
    if missing:
        raise ValueError(f"checkpoint payload lacks {missing}")
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, temporary = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".partial", dir=path.parent)
    try:
        with os.fdopen(handle, "wb") as file:
            torch.save(payload, file)
            file.flush()
            os.fsync(file.fileno())
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise
    return path


def load_checkpoint(path: str | os.PathLike, *, expect_config: dict[str, Any] | None = None) -> dict[str, Any]:
    """Load a checkpoint written by :func:`save_checkpoint` onto the CPU.

    Raises :class:`CheckpointError` when the file cannot be read (truncated, corrupt, not a checkpoint),
    lacks a field, has another version, or when ``expect_config`` is given and any of its keys differ
    from the stored run config (resuming a different run would silently mix the two).
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no checkpoint at {path}")
    try:
        payload = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:  # torch raises RuntimeError, UnpicklingError, EOFError... for bad files
        raise CheckpointError(f"{path} is not a readable checkpoint (truncated or corrupt): {error}") from None
    if not isinstance(payload, dict):
        raise CheckpointError(f"{path} does not hold a checkpoint dict")
    missing = [key for key in REQUIRED_KEYS if key not in payload]
    if missing:
        raise CheckpointError(f"{path} lacks {missing}")
    if payload["version"] != CHECKPOINT_VERSION:
        raise CheckpointError(f"{path} has checkpoint version {payload['version']}, expected {CHECKPOINT_VERSION}")
    if expect_config is not None:
        stored = payload["config"]
        differing = sorted(key for key in expect_config if stored.get(key) != expect_config[key])
        if differing:
            details = ", ".join(f"{key}: {stored.get(key)!r} != {expect_config[key]!r}" for key in differing[:5])
            raise CheckpointError(f"{path} belongs to another run configuration ({details})")
    return payload
