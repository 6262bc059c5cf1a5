"""One-file storage for :class:`~icrl_models.data.histories.LearningHistories`.

Layout (little-endian)::

    b"ICRLHIST"            8-byte magic
    header_size            uint64
    header_crc32           uint32, then 4 reserved zero bytes
    header                 UTF-8 JSON: {"metadata": {...}, "arrays": {name: {dtype, shape, offset, nbytes, crc32}}}
    array bytes            each array C-contiguous at its offset (64-byte aligned), in header order

Files are written atomically (a temporary file in the same folder, fsync, then rename:
:mod:`icrl_models.files`), so an interrupted run never leaves a file that looks complete. Loading checks
the magic, the header, the file size against the arrays it declares, the header's and every array's
CRC-32, and then the contents (:meth:`LearningHistories.validate`); any problem raises
:class:`DatasetError` naming it. Arrays are memory-mapped by default, so a dataset larger than memory can
be sampled without reading it whole.
"""

from __future__ import annotations

import json
import os
import struct
import zlib
from pathlib import Path
from typing import Any

import numpy as np

from ..files import atomic_open
from .histories import ARRAY_FIELDS, DatasetError, LearningHistories

MAGIC = b"ICRLHIST"
_PREFIX = struct.Struct("<QII")  # header size, header CRC-32, reserved
ALIGNMENT = 64
_CRC_CHUNK = 1 << 24


def _crc32(array: np.ndarray) -> int:
    flat = np.ascontiguousarray(array).reshape(-1).view(np.uint8)
    crc = 0
    for start in range(0, flat.size, _CRC_CHUNK):
        crc = zlib.crc32(flat[start : start + _CRC_CHUNK], crc)
    return crc


def _aligned(offset: int) -> int:
    return -(-offset // ALIGNMENT) * ALIGNMENT


def save_histories(histories: LearningHistories, path: str | os.PathLike) -> Path:
    """Validate ``histories`` and write them to ``path`` atomically; returns the path."""
    histories.validate()
    path = Path(path)
    arrays = {name: np.ascontiguousarray(value) for name, value in histories.arrays().items()}
    table: dict[str, dict[str, Any]] = {}
    offset = 0
    for name, array in arrays.items():
        offset = _aligned(offset)
        table[name] = {
            "dtype": array.dtype.str,
            "shape": list(array.shape),
            "offset": offset,
            "nbytes": array.nbytes,
            "crc32": _crc32(array),
        }
        offset += array.nbytes
    header = json.dumps({"metadata": histories.metadata, "arrays": table}).encode()
    data_start = _aligned(len(MAGIC) + _PREFIX.size + len(header))

    with atomic_open(path, "wb") as file:
        file.write(MAGIC + _PREFIX.pack(len(header), zlib.crc32(header), 0) + header)
        for name, array in arrays.items():
            file.seek(data_start + table[name]["offset"])
            file.write(array.reshape(-1).view(np.uint8).data)
        file.truncate(data_start + offset)
    return path


def read_header(path: str | os.PathLike) -> tuple[dict[str, Any], int]:
    """The parsed header of a history file and the offset where its array bytes start."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no learning-history file at {path}")
    size = path.stat().st_size
    with open(path, "rb") as file:
        prefix = file.read(len(MAGIC) + _PREFIX.size)
        if len(prefix) < len(MAGIC) + _PREFIX.size or prefix[: len(MAGIC)] != MAGIC:
            raise DatasetError(f"{path} is not a learning-history file (bad magic bytes or shorter than its header)")
        header_size, header_crc, _ = _PREFIX.unpack(prefix[len(MAGIC) :])
        if len(MAGIC) + _PREFIX.size + header_size > size:
            raise DatasetError(f"{path} is truncated: its header alone needs {header_size} bytes")
        raw = file.read(header_size)
    if zlib.crc32(raw) != header_crc:
        raise DatasetError(f"{path} has a corrupt header (its checksum does not match)")
    try:
        header = json.loads(raw.decode())
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise DatasetError(f"{path} has a corrupt header: {error}") from None
    if not isinstance(header, dict) or not {"metadata", "arrays"} <= set(header):
        raise DatasetError(f"{path} has a header without 'metadata' and 'arrays'")
    for field, what in (("metadata", "a dict (a JSON object)"), ("arrays", "a dict (array name -> entry)")):
        if not isinstance(header[field], dict):
            raise DatasetError(f"{path}: header field {field!r} must be {what}, got {type(header[field]).__name__}")
    for name, entry in header["arrays"].items():
        _check_array_entry(path, name, entry)
    return header, _aligned(len(MAGIC) + _PREFIX.size + header_size)


#: The fields of one array's header entry and what each must be.
_ENTRY_FIELDS = ("dtype", "shape", "offset", "nbytes", "crc32")


def _check_array_entry(path: Path, name: str, entry: Any) -> None:
    """Raise :class:`DatasetError` naming the field unless ``entry`` is a well-formed array entry: a numpy
    dtype string of a plain (non-object) type, a shape of ints >= 0, an offset and a byte count >= 0, a
    CRC-32 in ``[0, 2^32)``; JSON bools and floats are not ints (``int()`` would quietly accept them)."""
    field = f"header field 'arrays'[{name!r}]"
    if not isinstance(entry, dict):
        raise DatasetError(f"{path}: {field} must be a dict with {list(_ENTRY_FIELDS)}, got {type(entry).__name__}")
    missing = [key for key in _ENTRY_FIELDS if key not in entry]
    if missing:
        raise DatasetError(f"{path}: {field} lacks {missing}")

    def is_count(value: Any, high: int | None = None) -> bool:
        return type(value) is int and value >= 0 and (high is None or value < high)

    try:
        dtype = np.dtype(entry["dtype"]) if isinstance(entry["dtype"], str) else None
    except TypeError:
        dtype = None
    if dtype is None or dtype.hasobject or dtype.itemsize == 0:
        raise DatasetError(f"{path}: {field}['dtype'] must name a numpy dtype such as '<i8', got {entry['dtype']!r}")
    shape = entry["shape"]
    if not isinstance(shape, list) or not all(is_count(size) for size in shape):
        raise DatasetError(f"{path}: {field}['shape'] must be a list of ints >= 0, got {shape!r}")
    for key, high in (("offset", None), ("nbytes", None), ("crc32", 2**32)):
        if not is_count(entry[key], high):
            bound = "in [0, 2^32)" if high else ">= 0"
            raise DatasetError(f"{path}: {field}[{key!r}] must be an int {bound}, got {entry[key]!r}")


def load_histories(
    path: str | os.PathLike,
    *,
    mmap: bool = True,
    verify: bool = True,
    expect: dict[str, Any] | None = None,
) -> LearningHistories:
    """Load histories written by :func:`save_histories`.

    Args:
        path: the file.
        mmap: memory-map the arrays (read-only) instead of reading them into memory.
        verify: check every array's CRC-32 and validate the contents (reads the whole file once).
        expect: metadata the file must have, e.g. ``{"env": {"name": "dark_room"}, "split": "train"}``
            (nested dicts match by the keys given); a mismatch raises :class:`DatasetError`.
    """
    path = Path(path)
    header, data_start = read_header(path)
    size = path.stat().st_size
    arrays: dict[str, np.ndarray] = {}
    for name, entry in header["arrays"].items():  # each entry checked by read_header
        dtype, shape, offset, nbytes = np.dtype(entry["dtype"]), tuple(entry["shape"]), entry["offset"], entry["nbytes"]
        if dtype.itemsize * int(np.prod(shape)) != nbytes:
            raise DatasetError(f"{path}: array {name!r} declares {nbytes} bytes for shape {shape} of {dtype}")
        end = data_start + offset + nbytes
        if end > size:
            raise DatasetError(f"{path} is truncated: array {name!r} ends at byte {end}, the file has {size}")
        if nbytes == 0:
            array = np.zeros(shape, dtype=dtype)
        elif mmap:
            array = np.memmap(path, dtype=dtype, mode="r", offset=data_start + offset, shape=shape)
        else:
            array = np.fromfile(path, dtype=dtype, count=int(np.prod(shape)), offset=data_start + offset).reshape(shape)
        if verify and _crc32(array) != entry["crc32"]:
            raise DatasetError(f"{path}: array {name!r} fails its checksum (the file is corrupt)")
        arrays[name] = array

    missing = [name for name in ARRAY_FIELDS if name not in arrays]
    if missing:
        raise DatasetError(f"{path} lacks the arrays {missing}")
    return histories_from_arrays(path, arrays, header["metadata"], verify=verify, expect=expect)


def histories_from_arrays(
    path: Any, arrays: dict[str, np.ndarray], metadata: Any, *, verify: bool = True, expect: dict[str, Any] | None
) -> LearningHistories:
    """Assemble loaded arrays (``ARRAY_FIELDS`` plus ``task/<name>`` entries) into validated histories;
    errors name ``path``. Shared by the native format and the npz/HDF5 importers."""
    histories = LearningHistories(
        **{name: arrays[name] for name in ARRAY_FIELDS},
        task_params={name[len("task/") :]: value for name, value in arrays.items() if name.startswith("task/")},
        metadata=metadata,
    )
    if verify:
        try:
            histories.validate()
        except DatasetError as error:
            raise DatasetError(f"{path}: {error}") from None
    if expect:
        _check_expected(path, histories.metadata, expect, prefix="")
    return histories


def _check_expected(path: Path, metadata: Any, expect: dict[str, Any], prefix: str) -> None:
    for key, wanted in expect.items():
        name = f"{prefix}{key}"
        if not isinstance(metadata, dict) or key not in metadata:
            raise DatasetError(f"{path}: metadata has no {name!r} (expected {wanted!r})")
        if isinstance(wanted, dict):
            _check_expected(path, metadata[key], wanted, prefix=f"{name}.")
        elif metadata[key] != wanted:
            raise DatasetError(f"{path}: metadata {name!r} is {metadata[key]!r}, expected {wanted!r}")
