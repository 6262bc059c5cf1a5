"""Learning-history datasets (docs/models.md#learning-histories):
storage round trips, atomic writes, corruption and validation
errors, episode returns, training windows, generation and the icrl-data command line."""

from __future__ import annotations

import copy
import errno
import json
import os
import re
import struct
import zlib

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from icrl_models.data import (
    ENV_NAMES,
    NO_ACTION,
    DatasetError,
    GenerateConfig,
    HistoryWindows,
    LearningHistories,
    generate_histories,
    load_histories,
    read_header,
    save_histories,
    storage,
)
from icrl_models.data.cli import main
from icrl_models.data.histories import ARRAY_FIELDS
from icrl_models.envs import grid_task_split

GRID_ENVS = ("dark_room", "key_to_door", "dark_room_composite")


def _generate(env, **settings) -> LearningHistories:
    return generate_histories(GenerateConfig(env=env, **settings), progress=False)


@pytest.fixture(scope="module")
def datasets() -> dict[str, LearningHistories]:
    """Small datasets of every kind; tests must copy before mutating (see _copy)."""
    return {
        "dark_room": _generate("dark_room", num_histories=5, num_episodes=3, episode_length=6),
        # noise distillation opens the door early: variable episode and history lengths
        "key_to_door": _generate(
            "key_to_door", generator="noise_distillation", num_histories=6, num_episodes=4, episode_length=12, seed=2
        ),
        "contextual_bandit": _generate("contextual_bandit", num_histories=3, episode_length=12, num_arms="3-5"),
        "bernoulli_bandit": _generate("bernoulli_bandit", num_histories=6, episode_length=10, num_arms="3-6"),
        "dark_room_composite": _generate("dark_room_composite", num_histories=3, num_episodes=2),
    }


def _copy(histories: LearningHistories) -> LearningHistories:
    return LearningHistories(
        **{name: np.array(getattr(histories, name)) for name in ARRAY_FIELDS},
        task_params={name: np.array(value) for name, value in histories.task_params.items()},
        metadata=copy.deepcopy(histories.metadata),
    )


def _assert_identical(a: LearningHistories, b: LearningHistories) -> None:
    for name in ARRAY_FIELDS:
        x, y = getattr(a, name), getattr(b, name)
        assert x.dtype == y.dtype and x.shape == y.shape, name
        np.testing.assert_array_equal(x, y, err_msg=name)
    assert sorted(a.task_params) == sorted(b.task_params)
    for name in a.task_params:
        assert a.task_params[name].dtype == b.task_params[name].dtype, name
        np.testing.assert_array_equal(a.task_params[name], b.task_params[name], err_msg=name)
    assert a.metadata == b.metadata


def test_datasets_fixture_is_as_intended(datasets):
    k2d = datasets["key_to_door"]
    assert np.unique(k2d.lengths).size > 1 and k2d.lengths.min() < k2d.max_length
    assert datasets["contextual_bandit"].states.shape == (3, 12, 2)
    for histories in datasets.values():
        histories.validate()


# -- storage round trip ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["dark_room", "contextual_bandit", "key_to_door", "bernoulli_bandit"])
@pytest.mark.parametrize("mmap", [True, False])
def test_round_trip_exact(datasets, tmp_path, name, mmap):
    histories = datasets[name]
    path = save_histories(histories, tmp_path / "sub" / "data.icrl")
    assert path == tmp_path / "sub" / "data.icrl" and path.is_file()
    loaded = load_histories(path, mmap=mmap)
    _assert_identical(histories, loaded)
    if mmap:
        assert isinstance(loaded.actions, np.memmap) and not loaded.actions.flags.writeable
    else:
        assert not isinstance(loaded.actions, np.memmap)
    assert loaded.metadata["env"]["name"] == name
    # a loaded dataset saves again, byte for byte the same
    again = save_histories(loaded, tmp_path / "again.icrl")
    assert again.read_bytes() == path.read_bytes()


def test_header_layout(datasets, tmp_path):
    path = save_histories(datasets["dark_room"], tmp_path / "d.icrl")
    header, data_start = read_header(path)
    assert data_start % storage.ALIGNMENT == 0
    assert set(header["arrays"]) == set(ARRAY_FIELDS) | {"task/goal", "task/optimal_return"}
    for entry in header["arrays"].values():
        assert entry["offset"] % storage.ALIGNMENT == 0
    assert path.read_bytes()[:8] == b"ICRLHIST"


def test_expect_metadata(datasets, tmp_path):
    path = save_histories(datasets["dark_room"], tmp_path / "d.icrl")
    load_histories(path, expect={"env": {"name": "dark_room", "num_actions": 5}, "split": "train", "num_episodes": 3})
    with pytest.raises(DatasetError, match=r"'env\.name' is 'dark_room', expected 'key_to_door'"):
        load_histories(path, expect={"env": {"name": "key_to_door"}})
    with pytest.raises(DatasetError, match=r"'split' is 'train', expected 'test'"):
        load_histories(path, expect={"split": "test"})
    with pytest.raises(DatasetError, match=r"metadata has no 'env\.colour'"):
        load_histories(path, expect={"env": {"colour": "red"}})
    with pytest.raises(DatasetError, match=r"metadata has no 'nonsense'"):
        load_histories(path, expect={"nonsense": 1})


# -- atomic writes --------------------------------------------------------------------------------------------


def test_save_leaves_no_temporary_files(datasets, tmp_path):
    save_histories(datasets["dark_room"], tmp_path / "d.icrl")
    save_histories(datasets["key_to_door"], tmp_path / "d.icrl")  # overwrite
    assert [p.name for p in tmp_path.iterdir()] == ["d.icrl"]
    assert load_histories(tmp_path / "d.icrl").metadata["env"]["name"] == "key_to_door"


def _boom(*args, **kwargs):
    raise OSError("simulated failure")


@pytest.mark.parametrize("existing", [False, True])
def test_failed_replace_leaves_nothing(datasets, tmp_path, monkeypatch, existing):
    target = tmp_path / "d.icrl"
    if existing:
        save_histories(datasets["key_to_door"], target)
    before = target.read_bytes() if existing else None
    monkeypatch.setattr(storage.os, "replace", _boom)
    with pytest.raises(OSError, match="simulated failure"):
        save_histories(datasets["dark_room"], target)
    monkeypatch.undo()
    if existing:
        assert target.read_bytes() == before
        assert [p.name for p in tmp_path.iterdir()] == ["d.icrl"]
    else:
        assert not target.exists()
        assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("budget", [0, 30, 1000, 2000])
def test_failed_write_midway_leaves_nothing(datasets, tmp_path, fill_disk, budget):
    """The disk fills up after ``budget`` bytes (in the header, in an array, near the end): ENOSPC naming the
    file, and no file, partial or whole, is left behind."""
    target = tmp_path / "d.icrl"
    assert save_histories(datasets["dark_room"], tmp_path / "whole" / "d.icrl").stat().st_size > 2000
    fill_disk(tmp_path, budget)
    with pytest.raises(OSError, match=re.escape(f"No space left on device: '{target}'")) as info:
        save_histories(datasets["dark_room"], target)
    assert info.value.errno == errno.ENOSPC
    assert [p.name for p in tmp_path.iterdir()] == ["whole"]


def test_interrupt_during_write_cleans_up(datasets, tmp_path, monkeypatch):
    def interrupt(fd):
        raise KeyboardInterrupt

    monkeypatch.setattr(storage.os, "fsync", interrupt)
    with pytest.raises(KeyboardInterrupt):
        save_histories(datasets["dark_room"], tmp_path / "d.icrl")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("umask", [0o022, 0o002])
def test_file_permissions_follow_umask(datasets, tmp_path, umask):
    old = os.umask(umask)
    try:
        path = save_histories(datasets["dark_room"], tmp_path / "d.icrl")
    finally:
        os.umask(old)
    mode = path.stat().st_mode & 0o777
    assert mode == 0o666 & ~umask
    assert mode != 0o600


def test_save_refuses_invalid_histories(datasets, tmp_path):
    bad = _copy(datasets["dark_room"])
    bad.actions[0, 0] = 9
    with pytest.raises(DatasetError, match="actions must lie"):
        save_histories(bad, tmp_path / "d.icrl")
    assert list(tmp_path.iterdir()) == []


# -- corrupt and truncated files ------------------------------------------------------------------------------


@pytest.fixture
def saved(datasets, tmp_path):
    return save_histories(datasets["dark_room"], tmp_path / "d.icrl")


#: Byte where the header JSON starts: the magic, then the size / CRC-32 prefix.
HEADER_START = len(storage.MAGIC) + storage._PREFIX.size


def _aligned(offset: int) -> int:
    return -(-offset // storage.ALIGNMENT) * storage.ALIGNMENT


def _rewrite_header(path, mutate) -> None:
    """Rewrite ``path`` with ``mutate(header)`` applied to its header, keeping the array bytes."""
    header, data_start = read_header(path)
    data = path.read_bytes()[data_start:]
    mutate(header)
    raw = json.dumps(header).encode()
    prefix = storage.MAGIC + storage._PREFIX.pack(len(raw), zlib.crc32(raw), 0)
    padding = b"\0" * (_aligned(len(prefix) + len(raw)) - len(prefix) - len(raw))
    path.write_bytes(prefix + raw + padding + data)


def _flip(path, position: int, mask: int = 0xFF) -> None:
    data = bytearray(path.read_bytes())
    data[position] ^= mask
    path.write_bytes(bytes(data))


def test_rewrite_header_helper_keeps_file_valid(datasets, saved):
    _rewrite_header(saved, lambda header: header["metadata"].update(note="x" * 37))
    assert load_histories(saved).metadata["note"] == "x" * 37


def test_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError):
        load_histories(tmp_path / "nope.icrl")
    with pytest.raises(FileNotFoundError):
        load_histories(tmp_path)  # a folder


@pytest.mark.parametrize("where", ["empty", "inside_magic", "inside_size", "inside_header", "inside_array", "last"])
@pytest.mark.parametrize("mmap", [True, False])
def test_truncated_file(saved, where, mmap):
    header, data_start = read_header(saved)
    size = saved.stat().st_size
    header_size = struct.unpack("<Q", saved.read_bytes()[8:16])[0]
    cut = {
        "empty": 0,
        "inside_magic": 4,
        "inside_size": 12,
        "inside_header": HEADER_START + header_size // 2,
        "inside_array": data_start + header["arrays"]["actions"]["offset"] + 3,
        "last": size - 1,
    }[where]
    saved.write_bytes(saved.read_bytes()[:cut])
    with pytest.raises(DatasetError, match="truncated|not a learning-history file|shorter than its header"):
        load_histories(saved, mmap=mmap)


def test_truncated_message_names_array(saved):
    header, data_start = read_header(saved)
    last = max(header["arrays"], key=lambda name: header["arrays"][name]["offset"])
    saved.write_bytes(saved.read_bytes()[:-1])
    with pytest.raises(DatasetError, match=rf"{saved} is truncated: array '{last}'"):
        load_histories(saved)


@pytest.mark.parametrize("array", ["states", "actions", "rewards", "dones", "lengths", "task/goal"])
@pytest.mark.parametrize("mmap", [True, False])
def test_flipped_array_byte_fails_checksum(saved, array, mmap):
    header, data_start = read_header(saved)
    entry = header["arrays"][array]
    _flip(saved, data_start + entry["offset"] + entry["nbytes"] // 2, 0x01)
    with pytest.raises(DatasetError, match=rf"array '{array}' fails its checksum"):
        load_histories(saved, mmap=mmap)


def test_verify_false_skips_checksum(saved):
    header, data_start = read_header(saved)
    _flip(saved, data_start + header["arrays"]["states"]["offset"], 0x01)
    loaded = load_histories(saved, verify=False)
    assert loaded.states.shape == (5, 18)


@pytest.mark.parametrize("where", [0, 1, 0.5, -1])
def test_flipped_header_byte(saved, where):
    header_size = struct.unpack("<Q", saved.read_bytes()[8:16])[0]
    position = HEADER_START + (int(where * header_size) if isinstance(where, float) else where % header_size)
    _flip(saved, position)
    with pytest.raises(DatasetError, match="corrupt header"):
        load_histories(saved)


def test_flipped_header_quote(saved):
    raw = saved.read_bytes()
    _flip(saved, raw.index(b'"', 16), 0x01)  # '"' -> '#': invalid JSON
    with pytest.raises(DatasetError, match="corrupt header"):
        load_histories(saved)


def test_flipped_metadata_bit_detected(saved):
    raw = saved.read_bytes()
    _flip(saved, raw.index(b"dark_room", 16), 0x01)  # "dark_room" -> "eark_room"
    with pytest.raises(DatasetError):
        load_histories(saved)


def test_wrong_magic(saved):
    raw = saved.read_bytes()
    saved.write_bytes(b"NOTAHIST" + raw[8:])
    with pytest.raises(DatasetError, match="not a learning-history file"):
        load_histories(saved)
    saved.write_bytes(b"hello")
    with pytest.raises(DatasetError, match="not a learning-history file"):
        load_histories(saved)


def test_header_size_beyond_file(saved):
    raw = saved.read_bytes()
    saved.write_bytes(raw[:8] + struct.pack("<Q", 10**12) + raw[16:])
    with pytest.raises(DatasetError, match="truncated: its header alone needs"):
        load_histories(saved)


def test_header_shape_mismatch(saved):
    _rewrite_header(saved, lambda h: h["arrays"]["rewards"]["shape"].__setitem__(1, 19))
    with pytest.raises(DatasetError, match=r"array 'rewards' declares \d+ bytes for shape \(5, 19\)"):
        load_histories(saved)


def test_header_nbytes_mismatch(saved):
    _rewrite_header(saved, lambda h: h["arrays"]["actions"].__setitem__("nbytes", 7))
    with pytest.raises(DatasetError, match="array 'actions' declares 7 bytes"):
        load_histories(saved)


def test_missing_array(saved):
    _rewrite_header(saved, lambda h: h["arrays"].pop("lengths"))
    with pytest.raises(DatasetError, match=r"lacks the arrays \['lengths'\]"):
        load_histories(saved)


def test_malformed_array_entry(saved):
    _rewrite_header(saved, lambda h: h["arrays"]["actions"].pop("dtype"))
    with pytest.raises(DatasetError, match=r"header field 'arrays'\['actions'\] lacks \['dtype'\]"):
        load_histories(saved)


def _set_entry(array: str, key: str, value):
    return lambda header: header["arrays"][array].__setitem__(key, value)


@pytest.mark.parametrize(
    "mutate,field",
    [
        (lambda h: h.__setitem__("arrays", [1, 2]), "'arrays'"),
        (lambda h: h.__setitem__("arrays", "actions"), "'arrays'"),
        (lambda h: h.__setitem__("metadata", [1]), "'metadata'"),
        (lambda h: h.__setitem__("metadata", None), "'metadata'"),
        (lambda h: h["arrays"].__setitem__("actions", [1]), "'arrays'['actions']"),
        (_set_entry("actions", "dtype", 5), "'arrays'['actions']['dtype']"),
        (_set_entry("actions", "dtype", "zz"), "'arrays'['actions']['dtype']"),
        (_set_entry("actions", "dtype", "|O"), "'arrays'['actions']['dtype']"),
        (_set_entry("actions", "shape", "ab"), "'arrays'['actions']['shape']"),
        (_set_entry("actions", "shape", [-3, -5]), "'arrays'['actions']['shape']"),
        (_set_entry("actions", "shape", [3.5, 5]), "'arrays'['actions']['shape']"),
        (_set_entry("actions", "offset", -64), "'arrays'['actions']['offset']"),
        (_set_entry("actions", "offset", 64.5), "'arrays'['actions']['offset']"),
        (_set_entry("actions", "offset", "64"), "'arrays'['actions']['offset']"),
        (_set_entry("actions", "offset", True), "'arrays'['actions']['offset']"),
        (_set_entry("actions", "nbytes", -1), "'arrays'['actions']['nbytes']"),
        (_set_entry("actions", "crc32", "x"), "'arrays'['actions']['crc32']"),
        (_set_entry("actions", "crc32", 2**32), "'arrays'['actions']['crc32']"),
    ],
)
@pytest.mark.parametrize("verify", [True, False])
def test_malformed_header_field_is_named(saved, mutate, field, verify):
    """A header with a valid CRC but a field of the wrong kind (a list where an object belongs, a float or
    bool offset, a negative shape) raises DatasetError naming the field, with or without verification,
    not an AttributeError or a silently truncated int."""
    _rewrite_header(saved, mutate)
    with pytest.raises(DatasetError, match=re.escape(f"header field {field}")):
        load_histories(saved, verify=verify)


def test_array_offset_past_end(saved):
    _rewrite_header(saved, lambda h: h["arrays"]["states"].__setitem__("offset", 10**6))
    with pytest.raises(DatasetError, match="truncated: array 'states'"):
        load_histories(saved)


def test_header_without_metadata(saved):
    _rewrite_header(saved, lambda h: h.pop("metadata"))
    with pytest.raises(DatasetError, match="without 'metadata' and 'arrays'"):
        load_histories(saved)


def test_wrong_checksum_in_header(saved):
    _rewrite_header(saved, lambda h: h["arrays"]["dones"].__setitem__("crc32", 12345))
    with pytest.raises(DatasetError, match="array 'dones' fails its checksum"):
        load_histories(saved)


def test_bad_format_version_in_file(saved):
    _rewrite_header(saved, lambda h: h["metadata"].__setitem__("format_version", 99))
    with pytest.raises(DatasetError, match=rf"{saved}: format_version 99 is not supported"):
        load_histories(saved)


def test_invalid_contents_in_file(datasets, tmp_path, monkeypatch):
    bad = _copy(datasets["dark_room"])
    bad.rewards[1, 2] = 5.0
    path = tmp_path / "bad.icrl"
    with monkeypatch.context() as patch:
        patch.setattr(LearningHistories, "validate", lambda self: None)
        save_histories(bad, path)
    with pytest.raises(DatasetError, match=rf"{path}: rewards must lie in \[0.0, 1.0\]"):
        load_histories(path)
    assert load_histories(path, verify=False).rewards[1, 2] == 5.0


# -- validation -----------------------------------------------------------------------------------------------


def _set(array_name, index, value):
    def mutate(h):
        getattr(h, array_name)[index] = value

    return mutate


def _replace(array_name, make):
    def mutate(h):
        setattr(h, array_name, make(getattr(h, array_name)))

    return mutate


def _short_history(h):
    return int(np.argmin(h.lengths))


def _narrow_bandit(h):
    return int(np.argmin(h.task_params["num_arms"]))


def _done_after_length(h):
    row = _short_history(h)
    h.dones[row, h.lengths[row]] = True


def _not_ending_with_done(h):
    row = _short_history(h)
    h.dones[row, h.lengths[row] - 1] = False


def _action_outside_bandit_set(h):
    row = _narrow_bandit(h)
    h.actions[row, 3] = h.task_params["num_arms"][row]  # an arm the widest bandit has, this one not


def _action_outside_composite_set(h):
    outside = np.setdiff1d(np.arange(125), h.action_sets[1])[0]
    h.actions[1, 4] = outside


VALIDATION_CASES = {
    "action_too_large": ("dark_room", _set("actions", (0, 3), 5), r"actions must lie in \[0, 5\)"),
    "action_negative": ("dark_room", _set("actions", (1, 0), -1), r"actions must lie in \[0, 5\)"),
    "action_not_in_bandit_set": (
        "bernoulli_bandit",
        _action_outside_bandit_set,
        "step 3: action .* not in its action set",
    ),
    "action_not_in_composite_set": (
        "dark_room_composite",
        _action_outside_composite_set,
        "history 1 step 4: action .* not in its action set",
    ),
    "state_too_large": ("dark_room", _set("states", (0, 2), 81), r"states must lie in \[0, 81\)"),
    "state_nan": ("contextual_bandit", _set("states", (0, 1, 0), np.nan), "states hold NaN"),
    "state_inf": ("contextual_bandit", _set("states", (2, 11, 1), np.inf), "states hold NaN or infinite"),
    "reward_too_large": ("dark_room", _set("rewards", (0, 0), 2.0), r"rewards must lie in \[0.0, 1.0\]"),
    "reward_negative": ("key_to_door", _set("rewards", (0, 0), -0.5), r"rewards must lie in \[0.0, 2.0\]"),
    "reward_nan": ("dark_room", _set("rewards", (2, 4), np.nan), "rewards hold NaN"),
    "reward_inf_contextual": ("contextual_bandit", _set("rewards", (1, 1), np.inf), "rewards hold NaN or infinite"),
    "done_after_length": ("key_to_door", _done_after_length, "dones marks a step past a history's length"),
    "no_final_done": ("key_to_door", _not_ending_with_done, "does not end with a finished episode"),
    "extra_episode": ("dark_room", _set("dones", (0, 2), True), r"num_episodes=3 episodes, found \[3, 4\]"),
    "episode_count_meta": (
        "dark_room",
        lambda h: h.metadata.update(num_episodes=4),
        r"num_episodes=4 episodes, found \[3\]",
    ),
    "format_version": ("dark_room", lambda h: h.metadata.update(format_version=2), "format_version 2 is not supported"),
    "missing_seed": ("dark_room", lambda h: h.metadata.pop("seed"), r"metadata lacks \['seed'\]"),
    "missing_split_and_generator": (
        "dark_room",
        lambda h: (h.metadata.pop("split"), h.metadata.pop("generator")),
        r"metadata lacks \['generator', 'split'\]",
    ),
    "missing_env_key": (
        "dark_room",
        lambda h: h.metadata["env"].pop("reward_range"),
        r"metadata\['env'\] lacks \['reward_range'\]",
    ),
    "rewards_shape": ("dark_room", _replace("rewards", lambda a: a[:, :-1]), r"rewards must have shape \(5, 18\)"),
    "states_shape_vector": (
        "contextual_bandit",
        _replace("states", lambda a: a[..., 0]),
        r"states must have shape \(3, 12, 2\)",
    ),
    "states_shape_grid": (
        "dark_room",
        _replace("states", lambda a: a[:, :, None]),
        r"states must have shape \(5, 18\)",
    ),
    "dones_shape": ("key_to_door", _replace("dones", lambda a: a[:-1]), "dones must have shape"),
    "lengths_shape": ("dark_room", _replace("lengths", lambda a: a[:-1]), r"lengths must have shape \(5,\)"),
    "task_ids_shape": ("dark_room", _replace("task_ids", lambda a: a[:, None]), "task_ids must have shape"),
    "actions_1d": ("dark_room", _replace("actions", lambda a: a[0]), r"actions must be \[H, T\]"),
    "action_sets_empty": ("dark_room", _replace("action_sets", lambda a: a[:, :0]), "action_sets must be"),
    "action_sets_padding_only": (
        "dark_room",
        _set("action_sets", (2, slice(None)), -1),
        "at least one available action",
    ),
    "action_sets_out_of_range": ("dark_room", _set("action_sets", (0, 0), 7), "action_sets must hold ids"),
    "task_param_rows": (
        "dark_room",
        lambda h: h.task_params.update(goal=h.task_params["goal"][:-1]),
        "task/goal must have 5 rows",
    ),
    "no_optimal_return": ("dark_room", lambda h: h.task_params.pop("optimal_return"), "optimal_return"),
    "rewards_dtype": ("dark_room", _replace("rewards", lambda a: a.astype(np.int32)), "rewards has dtype int32"),
    "dones_dtype": ("dark_room", _replace("dones", lambda a: a.astype(np.uint8)), "dones has dtype uint8"),
    "states_dtype_grid": ("dark_room", _replace("states", lambda a: a.astype(np.float32)), "states has dtype float32"),
    "states_dtype_vector": (
        "contextual_bandit",
        _replace("states", lambda a: a.astype(np.int32)),
        "states has dtype int32",
    ),
    "actions_dtype": ("dark_room", _replace("actions", lambda a: a.astype(np.float32)), "actions has dtype float32"),
    "lengths_dtype": ("dark_room", _replace("lengths", lambda a: a.astype(np.float64)), "lengths has dtype float64"),
    "length_zero": ("dark_room", _set("lengths", 0, 0), r"lengths must lie in \[1, 18\]"),
    "length_too_long": ("dark_room", _set("lengths", 4, 19), r"lengths must lie in \[1, 18\]"),
}


@pytest.mark.parametrize("case", list(VALIDATION_CASES))
def test_validation_names_the_problem(datasets, case):
    env, mutate, message = VALIDATION_CASES[case]
    histories = _copy(datasets[env])
    histories.validate()  # the copy is valid
    mutate(histories)
    with pytest.raises(DatasetError, match=message):
        histories.validate()


def test_validation_does_not_touch_originals(datasets):
    for histories in datasets.values():
        histories.validate()


# -- episode returns ------------------------------------------------------------------------------------------


def _returns_by_hand(histories):
    result = []
    for h in range(histories.num_histories):
        returns, total = [], 0.0
        for t in range(int(histories.lengths[h])):
            total += float(histories.rewards[h, t])
            if histories.dones[h, t]:
                returns.append(total)
                total = 0.0
        result.append(returns)
    width = max(len(r) for r in result)
    return np.array([r + [np.nan] * (width - len(r)) for r in result])


@pytest.mark.parametrize("name", ["dark_room", "key_to_door", "dark_room_composite", "bernoulli_bandit"])
def test_episode_returns_match_hand_computation(datasets, name):
    histories = datasets[name]
    returns = histories.episode_returns()
    assert returns.dtype == np.float64
    assert returns.shape == (histories.num_histories, histories.metadata["num_episodes"])
    np.testing.assert_allclose(returns, _returns_by_hand(histories), rtol=1e-6)
    np.testing.assert_allclose(returns.sum(axis=1), histories.rewards.astype(np.float64).sum(axis=1), rtol=1e-6)


def test_episode_returns_handmade():
    dones = np.zeros((2, 6), dtype=bool)
    dones[0, [2, 5]] = True
    dones[1, [0, 3]] = True
    rewards = np.array([[1, 2, 3, 4, 5, 6], [10, 20, 30, 40, 0, 0]], dtype=np.float32)
    histories = LearningHistories(
        states=np.zeros((2, 6), np.uint8),
        actions=np.zeros((2, 6), np.int16),
        rewards=rewards,
        dones=dones,
        lengths=np.array([6, 4]),
        task_ids=np.array([0, 1]),
        action_sets=np.zeros((2, 1), np.int16),
        task_params={},
        metadata={},
    )
    np.testing.assert_array_equal(histories.episode_returns(), [[6.0, 15.0], [10.0, 90.0]])
    # a history with fewer episodes: NaN after its last one; unfinished trailing steps are not an episode
    histories.dones[1, 0] = False
    histories.rewards[1, 4] = 7.0  # past its length: ignored
    np.testing.assert_array_equal(histories.episode_returns(), [[6.0, 15.0], [100.0, np.nan]])


# -- training windows -----------------------------------------------------------------------------------------


def _reference_windows(histories, seq_len, subsample, stride):
    """Every window as (history, stream steps, start): streams built episode by episode in Python."""
    windows = []
    for h in range(histories.num_histories):
        steps, episodes = [], []
        for t in range(int(histories.lengths[h])):
            steps.append(t)
            if histories.dones[h, t]:
                episodes.append(steps)
                steps = []
        for offset in range(subsample):
            chosen = episodes[offset::subsample]
            if not chosen:
                continue
            stream = [t for episode in chosen for t in episode]
            for w in range(max(len(stream) - seq_len, 0) // stride + 1):
                windows.append((h, stream, w * stride))
    return windows


def _expected_window(histories, h, stream, start, seq_len):
    steps = stream[start : start + seq_len]
    m = len(steps)
    state_shape = histories.states.shape[2:]
    states = np.zeros((seq_len, *state_shape), dtype=np.float64)
    states[:m] = histories.states[h, steps]
    previous = [stream[start + j - 1] if start + j > 0 else None for j in range(m)]
    pad = seq_len - m
    return {
        "states": states,
        "actions": [int(histories.actions[h, t]) for t in steps] + [0] * pad,
        "rewards": [float(histories.rewards[h, t]) for t in steps] + [0.0] * pad,
        "prev_actions": [NO_ACTION if p is None else int(histories.actions[h, p]) for p in previous]
        + [NO_ACTION] * pad,
        "prev_rewards": [0.0 if p is None else float(histories.rewards[h, p]) for p in previous] + [0.0] * pad,
        "episode_start": [t == 0 or bool(histories.dones[h, t - 1]) for t in steps] + [False] * pad,
        "mask": [True] * m + [False] * pad,
        "history": h,
        "task_id": int(histories.task_ids[h]),
        "action_set": histories.action_sets[h].astype(np.int64),
    }


def _check_against_reference(histories, seq_len, subsample, stride):
    windows = HistoryWindows(histories, seq_len, episode_subsample=subsample, stride=stride)
    reference = _reference_windows(histories, seq_len, subsample, stride)
    assert len(windows) == len(reference)
    batch = windows.get_batch(np.arange(len(windows)))
    for index, (h, stream, start) in enumerate(reference):
        expected = _expected_window(histories, h, stream, start, seq_len)
        mask = np.array(expected["mask"])
        got_states = batch["states"][index].numpy()
        np.testing.assert_array_equal(got_states[mask], expected["states"][mask], err_msg=f"window {index}")
        for key in ("actions", "prev_actions", "episode_start", "mask", "history", "task_id", "action_set"):
            np.testing.assert_array_equal(batch[key][index].numpy(), expected[key], err_msg=f"{key} window {index}")
        for key in ("rewards", "prev_rewards"):
            np.testing.assert_allclose(batch[key][index].numpy(), expected[key], rtol=1e-6, err_msg=key)


# dark_room: 5 histories of 3 episodes of 6 steps (T = 18); key_to_door: lengths [48, 34, 48, 40, 48, 48] in
# 4 episodes of at most 12 steps; contextual_bandit: 3 histories of one 12-step episode, vector states.
WINDOW_SETTINGS = [(5, 1, 1), (4, 1, 3), (1, 1, 1), (12, 1, 1), (5, 2, 1), (3, 3, 2), (6, 2, 5), (6, 4, 5), (6, 2, 4)]


@pytest.mark.parametrize("name", ["dark_room", "key_to_door", "contextual_bandit"])
@pytest.mark.parametrize(("seq_len", "subsample", "stride"), WINDOW_SETTINGS)
def test_windows_match_reference(datasets, name, seq_len, subsample, stride):
    _check_against_reference(datasets[name], seq_len, subsample, stride)


@pytest.mark.parametrize(("seq_len", "subsample", "stride"), [(45, 1, 1), (45, 1, 2), (20, 2, 3)])
def test_windows_match_reference_padded_middle_streams(datasets, seq_len, subsample, stride):
    # histories 1 and 3 (34 and 40 steps) give padded windows; the last history's streams are long enough
    histories = datasets["key_to_door"]
    assert histories.lengths[-1] == 48 and sorted(histories.lengths.tolist())[:2] == [34, 40]
    _check_against_reference(histories, seq_len, subsample, stride)


@pytest.mark.parametrize(
    ("name", "seq_len", "subsample", "stride"),
    [
        ("dark_room", 30, 1, 1),
        ("dark_room", 40, 2, 1),
        ("dark_room", 12, 2, 4),
        ("contextual_bandit", 30, 1, 1),
        ("key_to_door", 60, 1, 1),
        ("key_to_door", 40, 2, 1),
    ],
)
def test_windows_match_reference_padded_last_stream(datasets, name, seq_len, subsample, stride):
    _check_against_reference(datasets[name], seq_len, subsample, stride)


def test_windows_dtypes_and_shapes(datasets):
    for name, state_shape, state_dtype in [("dark_room", (), torch.int64), ("contextual_bandit", (2,), torch.float32)]:
        histories = datasets[name]
        batch = HistoryWindows(histories, 6).get_batch([0, 1, 2])
        assert batch["states"].shape == (3, 6, *state_shape) and batch["states"].dtype == state_dtype
        assert batch["actions"].dtype == batch["prev_actions"].dtype == torch.int64
        assert batch["rewards"].dtype == batch["prev_rewards"].dtype == torch.float32
        assert batch["mask"].dtype == batch["episode_start"].dtype == torch.bool
        assert batch["history"].shape == batch["task_id"].shape == (3,)
        assert batch["action_set"].shape == (3, histories.action_sets.shape[1])


@pytest.mark.parametrize(
    ("seq_len", "subsample", "stride", "expected"),
    [
        (5, 1, 1, 5 * 14),  # T = 18: 18 - 5 + 1 starts per history
        (5, 1, 3, 5 * 5),  # (18 - 5) // 3 + 1
        (18, 1, 1, 5),
        (25, 1, 1, 5),  # shorter stream: one padded window
        (5, 2, 1, 5 * (8 + 2)),  # streams of 12 (episodes 0, 2) and 6 (episode 1) steps
        (8, 2, 1, 5 * (5 + 1)),
        (5, 4, 1, 5 * 3 * 2),  # more streams than episodes: 3 streams of 6
        (3, 3, 2, 5 * 3 * 2),
    ],
)
def test_windows_len_formula(datasets, seq_len, subsample, stride, expected):
    histories = datasets["dark_room"]
    assert histories.actions.shape == (5, 18)
    assert len(HistoryWindows(histories, seq_len, episode_subsample=subsample, stride=stride)) == expected


def test_padding_of_short_streams_grid(datasets):
    histories = datasets["key_to_door"]
    windows = HistoryWindows(histories, 45)  # histories of 34 and 40 steps: one padded window each
    lengths = np.asarray(histories.lengths)
    assert len(windows) == int(np.sum(np.maximum(lengths - 45, 0) + 1))
    batch = windows.get_batch(np.arange(len(windows)))
    mask_lengths = batch["mask"].sum(dim=1).numpy()
    assert sorted(mask_lengths.tolist()) == [34, 40] + [45] * (len(windows) - 2)
    pad = ~batch["mask"]
    for key in ("states", "actions", "rewards", "prev_rewards", "episode_start"):
        assert not batch[key][pad].any(), key
    assert (batch["prev_actions"][pad] == NO_ACTION).all()


def test_padding_of_short_streams_vector_states(datasets):
    windows = HistoryWindows(datasets["contextual_bandit"], 20)
    batch = windows.get_batch(np.arange(len(windows)))
    assert not batch["actions"][~batch["mask"]].any() and not batch["rewards"][~batch["mask"]].any()
    pad = ~batch["mask"]
    assert pad.any()
    assert not batch["states"][pad].any()


def test_stream_start_has_no_previous(datasets):
    windows = HistoryWindows(datasets["key_to_door"], 10, episode_subsample=2, stride=10)
    batch = windows.get_batch(np.arange(len(windows)))
    first_of_stream = batch["episode_start"][:, 0] & (batch["prev_actions"][:, 0] == NO_ACTION)
    assert first_of_stream.sum() == datasets["key_to_door"].num_histories * 2  # two streams per history
    assert (batch["prev_rewards"][first_of_stream, 0] == 0).all()


def test_getitem_equals_get_batch_row(datasets):
    windows = HistoryWindows(datasets["key_to_door"], 7, episode_subsample=2, stride=2)
    indices = np.array([0, 3, len(windows) - 1, 5, 3])
    batch = windows.get_batch(indices)
    for row, index in enumerate(indices):
        item = windows[int(index)]
        assert item.keys() == batch.keys()
        for key, value in item.items():
            torch.testing.assert_close(value, batch[key][row], rtol=0, atol=0)
    last, negative = windows[len(windows) - 1], windows[-1]
    for key in last:
        torch.testing.assert_close(last[key], negative[key], rtol=0, atol=0)
    assert windows[-len(windows)]["history"] == windows[0]["history"]


def test_windows_index_errors(datasets):
    windows = HistoryWindows(datasets["dark_room"], 5)
    with pytest.raises(IndexError):
        windows[len(windows)]
    with pytest.raises(IndexError):
        windows[-len(windows) - 1]
    with pytest.raises(IndexError):
        windows.get_batch([0, len(windows)])
    with pytest.raises(IndexError):
        windows.get_batch([-1])
    with pytest.raises(IndexError):
        windows.get_batch([[0, 1]])
    assert windows.get_batch([])["actions"].shape == (0, 5)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"seq_len": 0},
        {"seq_len": -3},
        {"seq_len": 2.5},
        {"seq_len": True},
        {"seq_len": "4"},
        {"seq_len": 4, "episode_subsample": 0},
        {"seq_len": 4, "episode_subsample": 1.0},
        {"seq_len": 4, "stride": 0},
        {"seq_len": 4, "stride": -1},
    ],
)
def test_windows_bad_arguments(datasets, kwargs):
    with pytest.raises(ValueError):
        HistoryWindows(datasets["dark_room"], **kwargs)


@pytest.mark.parametrize("name", ["dark_room", "contextual_bandit"])
def test_windows_with_dataloader(datasets, name):
    histories = datasets[name]
    windows = HistoryWindows(histories, 5, stride=2)
    loader = DataLoader(windows, batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(0))
    seen = []
    for batch in loader:
        size = batch["actions"].shape[0]
        assert size <= 4
        assert batch["states"].shape == (size, 5, *histories.states.shape[2:])
        assert batch["mask"].shape == batch["prev_actions"].shape == batch["rewards"].shape == (size, 5)
        assert batch["history"].shape == (size,)
        assert batch["action_set"].shape == (size, histories.action_sets.shape[1])
        seen.append(batch)
    assert sum(b["actions"].shape[0] for b in seen) == len(windows)
    # every window exactly once: compare sorted (history, first action, ...) signatures with get_batch
    everything = windows.get_batch(np.arange(len(windows)))
    key = lambda b: sorted(zip(b["history"].tolist(), b["prev_actions"].tolist(), b["rewards"].tolist()))  # noqa: E731
    merged = {name: torch.cat([b[name] for b in seen]) for name in ("history", "prev_actions", "rewards")}
    assert key(merged) == key(everything)


@pytest.mark.parametrize("name", ["dark_room", "key_to_door", "contextual_bandit"])
@pytest.mark.parametrize("subsample", [1, 2])
def test_windows_on_memory_mapped_dataset(datasets, tmp_path, name, subsample):
    path = save_histories(datasets[name], tmp_path / "d.icrl")
    loaded = load_histories(path, mmap=True)
    assert isinstance(loaded.states, np.memmap)
    mapped = HistoryWindows(loaded, 6, episode_subsample=subsample, stride=2)
    in_memory = HistoryWindows(datasets[name], 6, episode_subsample=subsample, stride=2)
    assert len(mapped) == len(in_memory)
    indices = np.arange(len(mapped))
    a, b = mapped.get_batch(indices), in_memory.get_batch(indices)
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=0, atol=0)
    next(iter(DataLoader(mapped, batch_size=3)))


# -- generation -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("env", ENV_NAMES)
def test_every_env_generates_a_valid_dataset(tmp_path, env):
    grid = env in GRID_ENVS
    histories = _generate(env, num_histories=5, num_episodes=2 if grid else None, episode_length=8)
    histories.validate()
    meta = histories.metadata
    assert meta["env"]["name"] == env and meta["split"] == "train" and meta["config"]["env"] == env
    assert histories.num_histories == 5 and meta["num_episodes"] == (2 if grid else 1)
    path = save_histories(histories, tmp_path / f"{env}.icrl")
    _assert_identical(histories, load_histories(path, expect={"env": {"name": env}, "split": "train"}))


@pytest.mark.parametrize("env", GRID_ENVS)
def test_train_and_test_tasks_are_disjoint(env):
    split = grid_task_split(env)
    tasks = {}
    for part in ("train", "test"):
        histories = _generate(env, split=part, num_histories=split[part].size, num_episodes=1, episode_length=1)
        tasks[part] = set(np.asarray(histories.task_ids).tolist())
        assert tasks[part] == set(split[part].tolist())  # every task of the split, each once
        assert histories.metadata["split"] == part
    assert not tasks["train"] & tasks["test"]


def test_num_tasks_limits_distinct_tasks():
    histories = _generate("dark_room", num_histories=23, num_tasks=7, num_episodes=1, episode_length=2)
    tasks, counts = np.unique(histories.task_ids, return_counts=True)
    assert tasks.size == 7 and histories.metadata["num_tasks"] == 7
    assert counts.min() >= 23 // 7 and counts.max() <= 23 // 7 + 1 and counts.sum() == 23
    assert set(tasks.tolist()) <= set(grid_task_split("dark_room")["train"].tolist())


@pytest.mark.parametrize(
    "settings",
    [
        {"env": "mountain_car"},
        {"split": "validation"},
        {"num_histories": 0},
        {"num_episodes": 0},
    ],
)
def test_bad_generate_config(settings):
    with pytest.raises(ValueError):
        GenerateConfig(**settings)


@pytest.mark.parametrize(
    "settings",
    [
        {"env": "bernoulli_bandit", "num_arms": "abc"},
        {"env": "bernoulli_bandit", "num_arms": "0"},
        {"env": "contextual_bandit", "num_arms": "9-3"},
        {"env": "dark_room", "num_tasks": 61},
        {"env": "dark_room", "num_tasks": 0},
        {"env": "dark_room", "split": "test", "num_tasks": 22},
        {"env": "bernoulli_bandit", "generator": "q_learning"},
        {"env": "dark_room", "generator": "linucb"},
        {"env": "dark_room", "generator": "nope"},
        {"env": "bernoulli_bandit", "alpha": 0.5},  # thompson has no alpha
    ],
)
def test_bad_generate_settings(settings):
    with pytest.raises(ValueError):
        _generate(num_histories=3, episode_length=4, **{"num_episodes": None, **settings})


def test_generation_is_reproducible():
    a = _generate("key_to_door", num_histories=4, num_episodes=3, episode_length=10, seed=3)
    b = _generate("key_to_door", num_histories=4, num_episodes=3, episode_length=10, seed=3)
    for name in ARRAY_FIELDS:
        np.testing.assert_array_equal(getattr(a, name), getattr(b, name))
    assert a.metadata["config"] == b.metadata["config"]


# -- command line ---------------------------------------------------------------------------------------------


def test_cli_generate_and_info(tmp_path, capsys):
    path = tmp_path / "out" / "dark.icrl"
    argv = ["generate", "--env", "dark_room", "--num-histories", "8", "--num-episodes", "5"]
    assert main([*argv, "-o", str(path), "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "dark_room" in out and str(path) in out
    histories = load_histories(path)
    assert histories.num_histories == 8 and histories.metadata["num_episodes"] == 5
    assert histories.metadata["config"]["num_histories"] == 8
    assert [p.name for p in path.parent.iterdir()] == ["dark.icrl"]

    assert main(["info", str(path)]) == 0
    captured = capsys.readouterr()
    assert "dark_room" in captured.out and "q_learning" in captured.out and captured.err == ""


@pytest.mark.parametrize("env", ["dark_room", "bernoulli_bandit"])
def test_cli_plots_the_learning_curve(tmp_path, capsys, env):
    path, plot = tmp_path / "d.icrl", tmp_path / "curve.png"
    argv = ["generate", "--env", env, "--num-histories", "6", "--num-episodes", "3" if env == "dark_room" else "1"]
    assert main([*argv, "-o", str(path), "--no-progress", "--plot", str(plot)]) == 0
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    plot.unlink()
    assert main(["info", str(path), "--plot", str(plot)]) == 0
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and str(plot) in capsys.readouterr().out


def test_cli_info_errors(tmp_path, capsys, datasets):
    path = save_histories(datasets["dark_room"], tmp_path / "d.icrl")
    header, data_start = read_header(path)
    _flip(path, data_start + header["arrays"]["rewards"]["offset"], 0x01)
    assert main(["info", str(path)]) == 2
    captured = capsys.readouterr()
    assert "icrl-data: error" in captured.err and "checksum" in captured.err and captured.out == ""

    path.write_bytes(path.read_bytes()[:100])
    assert main(["info", str(path)]) == 2
    assert "icrl-data: error" in capsys.readouterr().err

    assert main(["info", str(tmp_path / "missing.icrl")]) == 2
    assert "icrl-data: error" in capsys.readouterr().err


def test_cli_generate_bad_env(tmp_path, capsys):
    path = tmp_path / "x.icrl"
    assert main(["generate", "--env", "mountain_car", "-o", str(path), "--no-progress"]) == 2
    assert "env must be one of" in capsys.readouterr().err
    assert not path.exists()
