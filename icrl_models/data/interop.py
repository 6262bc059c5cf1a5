"""Learning histories in standard containers: NumPy ``.npz`` and HDF5 (``.h5`` / ``.hdf5``).

The native ``.icrl`` file (:mod:`~icrl_models.data.storage`: checksummed, memory-mapped) stays the
default; these containers are for exchange with other tools. Both hold the same fields:

* one array per field of :class:`LearningHistories` (``states``, ``actions``, ``rewards``, ``dones``,
  ``lengths``, ``task_ids``, ``action_sets``), with its dtype and shape unchanged;
* ``task/<name>`` per task parameter (in HDF5: dataset ``<name>`` of the group ``task``);
* ``metadata``: the metadata dict as a JSON string (npz: a 0-d string array; HDF5: a root attribute),
  and ``format`` = ``"icrl-histories"`` (same places) naming what the container holds.

Importing checks every field is present (a missing one raises :class:`DatasetError` naming it), then
runs the same validation as loading a native file. HDF5 needs ``h5py`` (``pip install
'icrl-kernels[hdf5]'``), imported only when an HDF5 file is read or written.
"""

from __future__ import annotations

import json
import os
import zipfile
from pathlib import Path
from typing import Any

import numpy as np

from ..files import atomic_open, atomic_path
from .histories import ARRAY_FIELDS, DatasetError, LearningHistories
from .storage import histories_from_arrays

#: Value of the ``format`` entry of an exported container.
CONTAINER_FORMAT = "icrl-histories"
FORMATS = ("npz", "hdf5")
_SUFFIXES = {".npz": "npz", ".h5": "hdf5", ".hdf5": "hdf5"}


class MissingDependencyError(ImportError):
    """An optional package needed for a format is not installed."""


def container_format(path: str | os.PathLike, format: str | None = None) -> str:
    """``format`` if given (checked), else the format of ``path``'s suffix (``.npz``, ``.h5``, ``.hdf5``)."""
    if format is not None:
        if format not in FORMATS:
            raise ValueError(f"format must be one of {FORMATS}, got {format!r}")
        return format
    suffix = Path(path).suffix.lower()
    if suffix not in _SUFFIXES:
        raise ValueError(f"path must end in one of {tuple(_SUFFIXES)} (or give format), got {str(path)!r}")
    return _SUFFIXES[suffix]


def _h5py():
    try:
        import h5py
    except ImportError:
        raise MissingDependencyError(
            "HDF5 files need the h5py package, which is not installed: pip install 'icrl-kernels[hdf5]'"
        ) from None
    return h5py


def export_histories(histories: LearningHistories, path: str | os.PathLike, format: str | None = None) -> Path:
    """Validate ``histories`` and write them to ``path`` as ``.npz`` or HDF5 (atomically); returns the path.

    Args:
        histories: the learning histories (e.g. from :func:`~icrl_models.data.load_histories`).
        path: the file to write; its suffix picks the format unless ``format`` is given.
        format: ``"npz"`` or ``"hdf5"``.
    """
    if not isinstance(histories, LearningHistories):
        raise TypeError(f"histories must be LearningHistories, got {type(histories).__name__}")
    kind = container_format(path, format)
    histories.validate()
    path = Path(path)
    arrays = {name: np.ascontiguousarray(value) for name, value in histories.arrays().items()}
    metadata = json.dumps(histories.metadata)
    if kind == "hdf5":
        h5py = _h5py()
    if kind == "npz":
        with atomic_open(path, "wb") as file:  # a file object: np.savez would append ".npz" to a name
            np.savez(file, metadata=np.array(metadata), format=np.array(CONTAINER_FORMAT), **arrays)
    else:
        with atomic_path(path) as temporary, h5py.File(temporary, "w") as file:
            file.attrs["format"] = CONTAINER_FORMAT
            file.attrs["metadata"] = metadata
            for name, array in arrays.items():
                file.create_dataset(name, data=array)  # "task/x" creates the group "task"
    return path


def import_histories(
    path: str | os.PathLike, format: str | None = None, *, expect: dict[str, Any] | None = None
) -> LearningHistories:
    """Read learning histories from an ``.npz`` or HDF5 file written by :func:`export_histories` (or by
    another tool with the same fields), and validate them as :func:`~icrl_models.data.load_histories` does.

    Args:
        path: the container; its suffix picks the format unless ``format`` (``"npz"``/``"hdf5"``) is given.
        expect: metadata the file must have, as for :func:`~icrl_models.data.load_histories`.

    Raises:
        FileNotFoundError: no file at ``path``.
        DatasetError: not such a container, a missing or malformed field (named), or contents that fail
            validation.
    """
    kind = container_format(path, format)
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no learning-history container at {path}")
    entries = _read_npz(path) if kind == "npz" else _read_hdf5(path)

    if "format" in entries and entries["format"] != CONTAINER_FORMAT:
        raise DatasetError(f"{path}: field 'format' is {entries['format']!r}, expected {CONTAINER_FORMAT!r}")
    if "metadata" not in entries:
        raise DatasetError(f"{path} lacks the field 'metadata' (the JSON metadata string)")
    try:
        metadata = json.loads(entries["metadata"])
    except (TypeError, ValueError):
        raise DatasetError(f"{path}: field 'metadata' is not a JSON string") from None
    arrays = entries["arrays"]
    missing = [name for name in ARRAY_FIELDS if name not in arrays]
    if missing:
        raise DatasetError(f"{path} lacks the field {missing[0]!r}" + (f" (and {missing[1:]})" if missing[1:] else ""))
    for name, array in arrays.items():
        if array.dtype.kind not in "biuf":
            raise DatasetError(f"{path}: field {name!r} has dtype {array.dtype}, expected numbers or bools")
    return histories_from_arrays(path, arrays, metadata, expect=expect)


def _text(value: Any) -> Any:
    if isinstance(value, np.ndarray) and value.ndim == 0:
        value = value[()]
    if isinstance(value, bytes):
        value = value.decode()
    return str(value) if isinstance(value, (str, np.str_)) else value


def _read_npz(path: Path) -> dict[str, Any]:
    try:
        with np.load(path, allow_pickle=False) as file:  # no pickles: a container must not run code
            contents = {name: file[name] for name in file.files}
    except (zipfile.BadZipFile, OSError, EOFError, ValueError) as error:
        raise DatasetError(f"{path} is not a readable .npz file ({error})") from None
    entries: dict[str, Any] = {"arrays": {}}
    for name, value in contents.items():
        if name in ("metadata", "format"):
            entries[name] = _text(value)
        else:
            entries["arrays"][name] = value
    return entries


def _read_hdf5(path: Path) -> dict[str, Any]:
    h5py = _h5py()
    try:
        file = h5py.File(path, "r")
    except OSError as error:
        raise DatasetError(f"{path} is not a readable HDF5 file ({error})") from None
    entries: dict[str, Any] = {"arrays": {}}
    with file:
        for name in ("metadata", "format"):
            if name in file.attrs:
                entries[name] = _text(file.attrs[name])

        def visit(name: str, item) -> None:
            if isinstance(item, h5py.Dataset):
                entries["arrays"][name] = item[()] if item.shape == () else item[...]

        file.visititems(visit)
    return entries
