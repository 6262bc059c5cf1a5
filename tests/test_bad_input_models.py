"""Bad input on the models side: checkpoints, environments, argument types, CLIs, gymnasium, packaging.

Every check here names the argument (or file) at fault and fails with one clear error, instead of
loading silently, truncating a float, or surfacing as an AttributeError / traceback.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import io
import json
import re
import struct
import subprocess
import sys
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch

try:
    import tomllib  # Python >= 3.11
except ImportError:  # Python 3.10
    tomllib = pytest.importorskip("tomli")

from icrl_models.checkpoint import (
    CHECKPOINT_VERSION,
    MAGIC,
    CheckpointError,
    UncheckedCheckpointWarning,
    checkpoint_field,
    load_checkpoint,
    save_checkpoint,
)
from icrl_models.data import (
    DatasetError,
    GenerateConfig,
    HistoryWindows,
    generate_histories,
    load_histories,
    save_histories,
)
from icrl_models.envs import (
    BernoulliBandit,
    ContextualBandit,
    DarkRoom,
    SingleEnv,
    action_moves,
    bernoulli_arm_means,
    composite_action_sets,
    contextual_bandit_arms,
    task_split,
)
from icrl_models.function_classes import FunctionClassConfig, sample_prompts
from icrl_models.generators import collect_histories, make_agent
from icrl_models.models.ad import ADConfig
from icrl_models.models.headless_ad import HeadlessADConfig
from icrl_models.train import TrainConfig

ROOT = Path(__file__).resolve().parents[1]

# =================================================================================================
# checkpoints
# =================================================================================================

#: A weight whose bytes are easy to find in the file (no other tensor holds this value).
MARKER = 1.2345678


def _payload(config=None) -> dict:
    return {
        "version": CHECKPOINT_VERSION,
        "step": 3,
        "config": {"d_model": 16} if config is None else config,
        "model": {"weight": torch.full((64,), MARKER), "bias": torch.arange(5.0)},
        "optimizer": {"state": {}, "param_groups": []},
        "rng": {"numpy": [], "torch": torch.get_rng_state()},
    }


def _flip_byte_in_weight(path: Path) -> None:
    raw = bytearray(path.read_bytes())
    position = raw.find(struct.pack("<f", MARKER) * 4)
    assert position > 0, "the marker weight must be stored verbatim in the file"
    raw[position + 2] ^= 0x10  # one bit of one float of the weight
    path.write_bytes(bytes(raw))


def test_checkpoint_round_trip(tmp_path):
    path = save_checkpoint(_payload(), tmp_path / "ckpt.pt")
    assert path.read_bytes().startswith(MAGIC)
    loaded = load_checkpoint(path, expect_config={"d_model": 16})
    torch.testing.assert_close(loaded["model"]["weight"], torch.full((64,), MARKER), rtol=0, atol=0)
    assert loaded["step"] == 3


def test_checkpoint_with_one_flipped_byte_in_a_weight_is_rejected(tmp_path):
    path = save_checkpoint(_payload(), tmp_path / "ckpt.pt")
    _flip_byte_in_weight(path)
    with pytest.raises(CheckpointError, match="ckpt.pt fails its SHA-256 checksum") as info:
        load_checkpoint(path)
    assert "\n" not in str(info.value)


def test_flipped_byte_is_silent_without_the_checksum(tmp_path):
    """Why the digest exists: torch's own archive loads the flipped weight without complaint."""
    path = tmp_path / "plain.pt"
    torch.save(_payload(), path)
    _flip_byte_in_weight(path)
    loaded = torch.load(path, weights_only=True)
    assert not torch.equal(loaded["model"]["weight"], torch.full((64,), MARKER))


def test_legacy_checkpoint_without_checksum_loads_with_a_warning(tmp_path):
    path = tmp_path / "legacy.pt"
    torch.save(_payload(), path)  # the layout older versions wrote
    with pytest.warns(UncheckedCheckpointWarning, match="legacy.pt has no checksum"):
        loaded = load_checkpoint(path)
    assert loaded["step"] == 3
    # Re-saving (what the next checkpoint of a resumed run does) adds the digest.
    save_checkpoint(loaded, path)
    assert path.read_bytes().startswith(MAGIC)


@pytest.mark.parametrize(
    "content",
    [b"not a checkpoint", b"", MAGIC + b"\0" * 10, b"PK\x03\x04" + b"\0" * 40],
    ids=["garbage", "empty", "short-digest", "broken-zip"],
)
def test_garbage_checkpoint_gives_one_clear_line(tmp_path, content):
    path = tmp_path / "bad.pt"
    path.write_bytes(content)
    with pytest.warns() if content.startswith(b"PK") else _no_warning():
        with pytest.raises(CheckpointError, match="bad.pt") as info:
            load_checkpoint(path)
    message = str(info.value)
    assert "\n" not in message and "weights_only" not in message


class _no_warning:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def test_truncated_checkpoint_is_rejected(tmp_path):
    path = save_checkpoint(_payload(), tmp_path / "ckpt.pt")
    path.write_bytes(path.read_bytes()[:-100])
    with pytest.raises(CheckpointError, match="truncated or corrupt"):
        load_checkpoint(path)


def _write_with_digest(payload, path: Path) -> None:
    buffer = io.BytesIO()
    torch.save(payload, buffer)
    data = buffer.getvalue()
    path.write_bytes(MAGIC + hashlib.sha256(data).digest() + data)


@pytest.mark.parametrize("config", [[1, 2], "d_model=16", None], ids=["list", "str", "none"])
def test_checkpoint_config_must_be_a_dict(tmp_path, config):
    payload = _payload()
    payload["config"] = config
    path = tmp_path / "ckpt.pt"
    _write_with_digest(payload, path)
    with pytest.raises(CheckpointError, match="ckpt.pt holds a config of type"):
        load_checkpoint(path, expect_config={"d_model": 16})
    with pytest.raises(TypeError, match="payload\\['config'\\] must be a dict"):
        save_checkpoint(payload, tmp_path / "other.pt")


@pytest.mark.parametrize(
    "field,value,named",
    [
        ("step", "3", "field 'step'"),
        ("step", -1, "field 'step'"),
        ("step", 3.0, "field 'step'"),
        ("step", True, "field 'step'"),
        ("model", [1, 2], "field 'model'"),
        ("model", {"weight": [1.0]}, "field 'model'"),
        ("optimizer", None, "field 'optimizer'"),
        ("rng", [1], "field 'rng'"),
    ],
)
def test_checkpoint_field_of_the_wrong_kind_is_named(tmp_path, field, value, named):
    """A checkpoint with a valid digest whose standard fields have the wrong kinds: CheckpointError naming
    the field at load time, not a raw error once a trainer uses it."""
    payload = _payload()
    payload[field] = value
    path = tmp_path / "ckpt.pt"
    _write_with_digest(payload, path)
    with pytest.raises(CheckpointError, match=re.escape(f"ckpt.pt: {named}")):
        load_checkpoint(path)


def test_checkpoint_field_helper_names_nested_fields(tmp_path):
    path = save_checkpoint(_payload(), tmp_path / "ckpt.pt")
    payload = load_checkpoint(path)
    assert checkpoint_field(payload, path, "rng", "numpy", kind=list) == []
    with pytest.raises(CheckpointError, match=re.escape("field ['rng']['cuda'] is missing")):
        checkpoint_field(payload, path, "rng", "cuda")
    with pytest.raises(CheckpointError, match=re.escape("field ['rng']['torch'] has type Tensor")):
        checkpoint_field(payload, path, "rng", "torch", kind=list)
    with pytest.raises(CheckpointError, match=re.escape("field ['step']['x'] is missing")):
        checkpoint_field(payload, path, "step", "x")


def test_checkpoint_payload_not_a_dict(tmp_path):
    path = tmp_path / "ckpt.pt"
    _write_with_digest([1, 2, 3], path)
    with pytest.raises(CheckpointError, match="does not hold a checkpoint dict"):
        load_checkpoint(path)


# =================================================================================================
# environments
# =================================================================================================


def _single_dark_room() -> SingleEnv:
    env = SingleEnv(DarkRoom([10], episode_length=4))
    env.reset(seed=0)
    return env


@pytest.mark.parametrize("action", [1.7, 1.0, True, np.float32(2.0), "1", None, torch.tensor(1.0), np.array([1])])
def test_single_env_rejects_non_integer_actions(action):
    env = _single_dark_room()
    with pytest.raises(TypeError, match="action must be an int"):
        env.step(action)


@pytest.mark.parametrize("action", [1, np.int64(1), np.uint8(1), np.array(1), torch.tensor(1)])
def test_single_env_accepts_integer_actions(action):
    env, reference = _single_dark_room(), DarkRoom([10], episode_length=4)
    reference.reset()
    observation, reward, *_ = env.step(action)
    expected = reference.step([1])
    assert observation == int(expected.observations[0]) and reward == float(expected.rewards[0])


@pytest.mark.parametrize("action", [-1, 5, 100])
def test_single_env_rejects_out_of_range_actions(action):
    with pytest.raises(ValueError, match=r"action must lie in \[0, 5\)"):
        _single_dark_room().step(action)


def test_single_env_rejects_bad_seed_and_action_ids():
    env = SingleEnv(DarkRoom([10]))
    with pytest.raises(ValueError, match="seed must be a non-negative int"):
        env.reset(seed=-1)
    with pytest.raises(TypeError, match="seed must be None or a non-negative int"):
        env.reset(seed=1.5)
    with pytest.raises(TypeError, match="action_ids must hold integers"):
        SingleEnv(DarkRoom([10]), action_ids=[0.5, 1.5])
    with pytest.raises(ValueError, match="action_ids must lie in"):
        SingleEnv(DarkRoom([10]), action_ids=[0, 7])
    with pytest.raises(TypeError, match="batched must be a BatchedEnv"):
        SingleEnv("dark_room")


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_contextual_bandit_rejects_non_finite_arm_features(bad):
    arms = np.ones((2, 3, 2))
    arms[1, 2, 0] = bad
    with pytest.raises(ValueError, match="arms must be finite"):
        ContextualBandit(arms)


def test_contextual_bandit_noise_std_checks():
    with pytest.raises(ValueError, match="noise_std must be finite"):
        ContextualBandit(np.ones((1, 2, 2)), noise_std=np.inf)
    with pytest.raises(ValueError, match="noise_std must be finite"):
        ContextualBandit(np.ones((1, 2, 2)), noise_std=np.nan)
    with pytest.raises(TypeError, match="noise_std must be a real number"):
        ContextualBandit(np.ones((1, 2, 2)), noise_std="1.0")
    with pytest.raises(ValueError, match="noise_std must be >= 0"):
        ContextualBandit(np.ones((1, 2, 2)), noise_std=-0.5)


def test_bernoulli_bandit_rejects_nan_means():
    with pytest.raises(ValueError, match="means must lie in"):
        BernoulliBandit([[0.5, np.nan]])


@pytest.mark.parametrize("actions", [125, -1, [3, 200], np.array([[0, 125]])])
def test_action_moves_rejects_out_of_range(actions):
    with pytest.raises(ValueError, match=r"actions must lie in \[0, 125\)"):
        action_moves(actions)


@pytest.mark.parametrize("actions", [1.5, [1.0, 2.0], True])
def test_action_moves_rejects_non_integers(actions):
    with pytest.raises(TypeError, match="actions must hold integers"):
        action_moves(actions)


def test_action_moves_still_decodes_base_5():
    np.testing.assert_array_equal(action_moves([0, 7, 124]), [[0, 0, 0], [0, 1, 2], [4, 4, 4]])


# -- datasets and windows --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def small_histories():
    return generate_histories(
        GenerateConfig(env="dark_room", num_histories=3, num_episodes=3, episode_length=5), progress=False
    )


@pytest.mark.parametrize("indices", [[0.5], np.array([1.0, 2.0]), torch.tensor([0.0]), [True, False]])
def test_get_batch_rejects_non_integer_indices(small_histories, indices):
    windows = HistoryWindows(small_histories, 4)
    with pytest.raises(TypeError, match="indices must hold integers"):
        windows.get_batch(indices)


def test_get_batch_accepts_integer_indices_of_every_kind(small_histories):
    windows = HistoryWindows(small_histories, 4)
    expected = windows.get_batch(np.array([0, 2]))
    for indices in ([0, 2], np.array([0, 2], dtype=np.uint8), torch.tensor([0, 2]), (0, 2)):
        batch = windows.get_batch(indices)
        for name, value in expected.items():
            torch.testing.assert_close(batch[name], value, rtol=0, atol=0)
    assert windows.get_batch([])["actions"].shape == (0, 4)


@pytest.mark.parametrize(
    "indices,error,message",
    [
        ([5], ValueError, r"indices must lie in \[0, 3\)"),
        ([-1], ValueError, r"indices must lie in \[0, 3\)"),
        ([0.5], TypeError, "indices must hold integers"),
        ([True, False, True], TypeError, "indices must hold integers"),
        ([[0, 1]], ValueError, "indices must be 1-D"),
    ],
)
def test_histories_subset_checks_its_indices(small_histories, indices, error, message):
    with pytest.raises(error, match=message):
        small_histories.subset(indices)


def test_trajectory_windows_check_their_starts(small_histories):
    from icrl_models.models.dt_moa import TrajectoryWindows

    windows = TrajectoryWindows(small_histories, 4)
    assert windows.get_batch([0, len(windows) - 1])["states"].shape == (2, 4)
    with pytest.raises(ValueError, match=rf"starts must lie in \[0, {len(windows)}\)"):
        windows.get_batch([len(windows)])
    with pytest.raises(TypeError, match="starts must hold integers"):
        windows.get_batch([1.5])
    with pytest.raises(ValueError, match="starts must be 1-D"):
        windows.get_batch([[0]])


@pytest.mark.parametrize(
    "call",
    [
        lambda device: sample_prompts(FunctionClassConfig("linear_regression", 4), 2, 3, device=device),
        lambda device: __import__("icrl_models.analysis.induction", fromlist=["x"]).uniform_causal_pattern(
            2, 3, device=device
        ),
        lambda device: __import__("icrl_models.experiments.harness", fromlist=["x"]).machine_description(device),
        lambda device: __import__("icrl_models.train", fromlist=["x"]).load_trained(TrainConfig(), device),
        lambda device: __import__("icrl_models.cuda_graphs", fromlist=["x"]).to_device({"x": torch.ones(2)}, device),
        lambda device: __import__("icrl_models.cuda_graphs", fromlist=["x"]).pinned({"x": torch.ones(2)}, device),
        lambda device: __import__("icrl_models.cuda_graphs", fromlist=["x"]).StepRunner(
            lambda batch: batch["x"].sum(), torch.nn.Linear(2, 2), None, device
        ),
    ],
    ids=[
        "sample_prompts",
        "uniform_causal_pattern",
        "machine_description",
        "load_trained",
        "to_device",
        "pinned",
        "StepRunner",
    ],  # fmt: skip
)
def test_device_arguments_are_checked_and_named(call):
    """Every public icrl_models function that takes a device checks it first: a misspelt name, another
    type, or CUDA where there is none, instead of torch's raw list of device types or an AssertionError."""
    with pytest.raises(ValueError, match="device must name a device such as 'cpu'"):
        call("gpu")
    with pytest.raises(TypeError, match="device must be a torch.device, str or int"):
        call(1.5)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="device 'cuda' asked for CUDA, but CUDA is not available"):
            call("cuda")


def test_window_item_rejects_float_index(small_histories):
    windows = HistoryWindows(small_histories, 4)
    with pytest.raises(TypeError, match="index must be an int"):
        windows[1.0]
    torch.testing.assert_close(windows[np.int64(1)]["actions"], windows[1]["actions"], rtol=0, atol=0)
    with pytest.raises(TypeError, match="histories must be LearningHistories"):
        HistoryWindows({"actions": np.zeros((2, 2))}, 4)


BAD_METADATA = [
    (lambda m: m.__setitem__("env", "dark_room"), r"metadata\['env'\] must be a dict"),
    (lambda m: m["env"].__setitem__("num_actions", "5"), r"metadata\['env'\]\['num_actions'\] must be an int"),
    (lambda m: m["env"].__setitem__("num_actions", 5.0), r"metadata\['env'\]\['num_actions'\] must be an int"),
    (lambda m: m["env"].__setitem__("observation_dim", True), r"\['observation_dim'\] must be an int"),
    (lambda m: m["env"].__setitem__("num_observations", None), r"\['num_observations'\] must be an int"),
    (lambda m: m["env"].__setitem__("reward_range", "0-1"), r"\['reward_range'\] must be \[low, high\]"),
    (lambda m: m["env"].__setitem__("reward_range", [1, 0]), r"\['reward_range'\] must be \[low, high\]"),
    (lambda m: m["env"].__setitem__("name", 3), r"metadata\['env'\]\['name'\] must be a string"),
    (lambda m: m["env"].__setitem__("config", []), r"metadata\['env'\]\['config'\] must be a dict"),
    (lambda m: m.__setitem__("num_episodes", "3"), r"metadata\['num_episodes'\] must be an int"),
    (lambda m: m.__setitem__("generator", "q_learning"), r"metadata\['generator'\] must be a dict"),
    (lambda m: m.__setitem__("split", 1), r"metadata\['split'\] must be a string"),
]


@pytest.mark.parametrize("mutate, message", BAD_METADATA)
def test_metadata_with_wrong_field_types(small_histories, mutate, message):
    histories = small_histories.subset(np.arange(3))
    histories.metadata = json.loads(json.dumps(small_histories.metadata))
    mutate(histories.metadata)
    with pytest.raises(DatasetError, match=message):
        histories.validate()


def _rewrite_header(path: Path, mutate) -> None:
    """Rewrite a history file's header (with a valid CRC), moving the array bytes to its new data start."""
    raw = path.read_bytes()
    (size,) = struct.unpack("<Q", raw[8:16])
    header = json.loads(raw[24 : 24 + size])
    old_start = -(-(24 + size) // 64) * 64
    mutate(header)
    encoded = json.dumps(header).encode()
    new_start = -(-(24 + len(encoded)) // 64) * 64
    prefix = MAGIC_HIST + struct.pack("<QII", len(encoded), zlib.crc32(encoded), 0) + encoded
    path.write_bytes(prefix + b"\0" * (new_start - len(prefix)) + raw[old_start:])


MAGIC_HIST = b"ICRLHIST"


def test_file_header_with_wrong_field_types(small_histories, tmp_path):
    path = save_histories(small_histories, tmp_path / "h.icrl")
    _rewrite_header(path, lambda h: h["metadata"]["env"].__setitem__("observation_dim", "0"))
    with pytest.raises(DatasetError, match=r"h.icrl: metadata\['env'\]\['observation_dim'\] must be an int"):
        load_histories(path)
    path = save_histories(small_histories, tmp_path / "g.icrl")
    _rewrite_header(path, lambda h: h.__setitem__("metadata", ["not", "a", "dict"]))
    with pytest.raises(DatasetError, match=r"g.icrl: header field .metadata. must be a dict"):
        load_histories(path)


def test_rewritten_header_still_loads_when_unchanged(small_histories, tmp_path):
    """The header rewriter itself is sound (so the failures above are the checks, not the rewrite)."""
    path = save_histories(small_histories, tmp_path / "h.icrl")
    _rewrite_header(path, lambda h: h["metadata"].__setitem__("note", "x" * 100))
    loaded = load_histories(path)
    np.testing.assert_array_equal(loaded.actions, small_histories.actions)


# =================================================================================================
# argument types
# =================================================================================================


@pytest.mark.parametrize("num_arms", [4.0, "4", (4.0, 8), (2, 4, 6), None])
def test_num_arms_must_be_int_or_pair(num_arms):
    for sample in (bernoulli_arm_means, contextual_bandit_arms):
        with pytest.raises((TypeError, ValueError), match="num_arms"):
            sample(5, num_arms=num_arms)


@pytest.mark.parametrize("seed, error", [(-1, ValueError), (1.5, TypeError), ("0", TypeError), (True, TypeError)])
def test_seed_checks(seed, error):
    with pytest.raises(error, match="seed"):
        DarkRoom([0], seed=seed)
    with pytest.raises(error, match="seed"):
        bernoulli_arm_means(3, seed=seed)
    with pytest.raises(error, match="seed"):
        contextual_bandit_arms(3, seed=seed)
    with pytest.raises(error, match="seed"):
        composite_action_sets(seed)
    with pytest.raises(error, match="seed"):
        task_split(10, 5, seed=seed)
    with pytest.raises(error, match="seed"):
        collect_histories(DarkRoom([0], episode_length=3), make_agent("random"), 1, seed=seed, progress=False)


def test_valid_seeds_still_work():
    DarkRoom([0], seed=np.random.SeedSequence(3))
    DarkRoom([0], seed=np.int64(4))
    means, _ = bernoulli_arm_means(3, seed=[1, 2])
    again, _ = bernoulli_arm_means(3, seed=[1, 2])
    np.testing.assert_array_equal(means, again)


@pytest.mark.parametrize("generator", [42, "42", np.random.default_rng(0)])
def test_generator_must_be_a_torch_generator(generator):
    with pytest.raises(TypeError, match="generator must be a torch.Generator"):
        sample_prompts(FunctionClassConfig("linear_regression", 4), 2, 3, generator=generator)


def test_sample_prompts_integer_arguments():
    config = FunctionClassConfig("linear_regression", 4)
    with pytest.raises(TypeError, match="batch must be an int"):
        sample_prompts(config, 2.0, 3)
    with pytest.raises(TypeError, match="n_points must be an int"):
        sample_prompts(config, 2, "3")
    with pytest.raises(ValueError, match="active_dims must be in"):
        sample_prompts(config, 2, 3, active_dims=5)
    xs, ys = sample_prompts(config, 2, 3, generator=torch.Generator().manual_seed(0))
    assert xs.shape == (2, 3, 4) and ys.shape == (2, 3)


@pytest.mark.parametrize(
    "overrides, error, name",
    [
        ({"num_states": 81.0}, TypeError, "num_states"),
        ({"d_model": "64"}, TypeError, "d_model"),
        ({"num_actions": 0}, ValueError, "num_actions"),
        ({"ngram_sizes": "12"}, TypeError, "ngram_sizes"),
        ({"ngram_sizes": (1, 2.5)}, TypeError, "ngram_sizes"),
        ({"ngram_sizes": (0,)}, ValueError, "ngram_sizes"),
        ({"residual_dropout": 1.5}, ValueError, "residual_dropout"),
        ({"embedding_dropout": "0.1"}, TypeError, "embedding_dropout"),
    ],
)
def test_ad_config_argument_types(overrides, error, name):
    with pytest.raises(error, match=name):
        ADConfig(**overrides)


@pytest.mark.parametrize(
    "overrides, error, name",
    [
        ({"d_model": 0}, ValueError, "d_model"),  # 0 % num_heads == 0: the head-split check alone passed it
        ({"num_heads": 0}, ValueError, "num_heads"),  # was a ZeroDivisionError
        ({"seq_len": 0}, ValueError, "seq_len"),
        ({"embed_dim": 0}, ValueError, "embed_dim"),
        ({"embed_dim": 8.0}, TypeError, "embed_dim"),
        ({"tau": float("nan")}, ValueError, "tau"),
        ({"tau": "1"}, TypeError, "tau"),
        ({"select_tau": "0.5"}, TypeError, "select_tau"),
        ({"attention_dropout": 1.0}, ValueError, "attention_dropout"),
    ],
)
def test_headless_ad_config_argument_types(overrides, error, name):
    with pytest.raises(error, match=name):
        HeadlessADConfig(**overrides)


@pytest.mark.parametrize(
    "overrides, error, name",
    [
        # torch would train on these without a word: clipping to 0 zeroes every update, to < 0 flips its sign
        ({"grad_clip": 0.0}, ValueError, "grad_clip"),
        ({"grad_clip": -1.0}, ValueError, "grad_clip"),
        ({"warmup_steps": -5}, ValueError, "warmup_steps"),
        ({"eval_every": -1}, ValueError, "eval_every"),
        # torch (AdamW, cross_entropy) or the loop (step % 0) would refuse these only after the data is generated
        ({"learning_rate": 0.0}, ValueError, "learning_rate"),
        ({"learning_rate": float("nan")}, ValueError, "learning_rate"),
        ({"beta1": 1.0}, ValueError, "beta1"),
        ({"beta2": -0.1}, ValueError, "beta2"),
        ({"weight_decay": -1e-4}, ValueError, "weight_decay"),
        ({"label_smoothing": 1.5}, ValueError, "label_smoothing"),
        ({"log_every": 0}, ValueError, "log_every"),
        ({"checkpoint_every": 0}, ValueError, "checkpoint_every"),
        ({"num_histories": 0}, ValueError, "num_histories"),
        ({"eval_tasks": 0}, ValueError, "eval_tasks"),
        ({"steps": 2.5}, TypeError, "steps"),
        # the model's fields, checked by the model's config with placeholder environment sizes
        ({"d_model": 0}, ValueError, "d_model"),
        ({"d_model": 48, "num_heads": 5}, ValueError, "num_heads"),
        ({"model": "headless_ad", "embed_dim": 0}, ValueError, "embed_dim"),
        ({"model": "headless_ad", "tau": -1.0}, ValueError, "tau"),
        ({"residual_dropout": 1.0}, ValueError, "residual_dropout"),
    ],
)
def test_train_config_refuses_bad_values_before_any_data(overrides, error, name):
    with pytest.raises(error, match=name):
        TrainConfig(**overrides)


@pytest.mark.parametrize(
    "experiment, config_class",
    [("markov_heads", "MarkovConfig"), ("looped", "LoopedExperimentConfig"), ("induction_heads", "InductionConfig")],
)
@pytest.mark.parametrize(
    "overrides, error, name",
    [
        ({"learning_rate": -1e-3}, ValueError, "learning_rate"),
        ({"learning_rate": float("inf")}, ValueError, "learning_rate"),
        ({"warmup_steps": -1}, ValueError, "warmup_steps"),
        ({"steps": 0}, ValueError, "steps"),
        ({"batch_size": 1.5}, TypeError, "batch_size"),
    ],
)
def test_experiment_configs_check_the_shared_training_fields(experiment, config_class, overrides, error, name):
    cls = getattr(importlib.import_module(f"icrl_models.experiments.{experiment}"), config_class)
    cls()  # the defaults (and the preset's values) pass
    with pytest.raises(error, match=name):
        cls(**overrides)


@pytest.mark.parametrize(
    "experiment, config_class, overrides, name",
    [
        ("markov_heads", "MarkovConfig", {"grad_clip": 0.0}, "grad_clip"),  # clip_grad_norm_ zeroed every update
        ("markov_heads", "MarkovConfig", {"dropout": 1.0}, "dropout"),
        ("markov_heads", "MarkovConfig", {"weight_decay": -0.1}, "weight_decay"),
        ("looped", "LoopedExperimentConfig", {"eval_every": 0}, "eval_every"),  # was `step % 0` mid-training
        ("looped", "LoopedExperimentConfig", {"checkpoint_every": 0}, "checkpoint_every"),
        ("looped", "LoopedExperimentConfig", {"loops_increment": -2}, "loops_increment"),  # b would shrink
        ("looped", "LoopedExperimentConfig", {"eval_loop_factor": 0}, "eval_loop_factor"),
        ("induction_heads", "InductionConfig", {"weight_decay": float("nan")}, "weight_decay"),
        ("induction_heads", "InductionConfig", {"smear_init": float("nan")}, "smear_init"),
        ("markov_heads", "MarkovConfig", {"markov_scale": float("inf")}, "markov_scale"),
        # a NaN passed `min(...) <= 0` and `< 0`: the run started and used it
        (
            "headless_ad",
            "HeadlessExperimentConfig",
            {"select_temperatures": (0.5, float("nan"))},
            "select_temperatures",
        ),
        ("markov_heads", "MarkovConfig", {"trial_gpus": float("nan")}, "trial_gpus"),
        ("looped", "LoopedExperimentConfig", {"trial_cpus": float("inf")}, "trial_cpus"),
    ],
)
def test_experiment_configs_refuse_their_own_bad_fields(experiment, config_class, overrides, name):
    cls = getattr(importlib.import_module(f"icrl_models.experiments.{experiment}"), config_class)
    with pytest.raises(ValueError, match=name):
        cls(**overrides)


# =================================================================================================
# command lines
# =================================================================================================


def _scripts() -> dict[str, str]:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]


def _main_of(script: str):
    module, _, name = _scripts()[script].partition(":")
    return getattr(importlib.import_module(module), name)


def _run(main, argv) -> int:
    """Exit status of ``main(argv)``, whether it returns it or raises SystemExit (argparse)."""
    try:
        return main(argv)
    except SystemExit as exit_:
        return exit_.code


def test_every_cli_main_uses_the_shared_error_handler():
    for script in _scripts():
        main = _main_of(script)
        assert getattr(main, "__wrapped__", None) is not None, f"{script}'s main is not wrapped by command_line"


CLI_CASES = [
    ("icrl-compare", ["--env", "foo"], "env must be one of"),
    ("icrl-compare", ["--runs", "0"], "runs must be >= 1"),
    ("icrl-demo", ["--n", "0"], "argument --n: must be >= 1, got 0"),
    ("icrl-demo", ["--lengths", "16", "-3"], "argument --lengths: must be >= 1"),
    ("icrl-train", ["--env", "foo"], "env must be one of"),
    ("icrl-train", ["--ngram-sizes", "1,x"], "argument --ngram-sizes: expected int values, got '1,x'"),
    ("icrl-train", ["--ngram-sizes", "0"], "ngram_sizes must be ints >= 1"),
    ("icrl-train", ["--seed", "-1"], "seed must be >= 0"),
    ("icrl-train", ["--grad-clip", "0"], "grad_clip must be > 0"),
    ("icrl-train", ["--d-model", "0"], "d_model must be >= 1"),
    ("icrl-train", ["--device", "gpu"], "device must be auto, cpu, cuda or cuda:N"),
    ("icrl-data", ["generate", "--env", "foo", "-o", "x.icrl"], "env must be one of"),
    ("icrl-headless", ["--experiment", "foo"], "experiment must be one of"),
    ("icrl-induction", ["--variants", "3X"], "variant must look like"),
    ("icrl-induction", ["ad-report", "--run-dir", "/nonexistent/run"], "/nonexistent/run"),
    ("icrl-markov", ["--tasks", "nope"], "tasks must be one or more of"),
    ("icrl-looped", ["--dims-start", "0"], "dims_start must be in"),
]


@pytest.mark.parametrize("script, argv, message", CLI_CASES, ids=[f"{c[0]} {' '.join(c[1])}" for c in CLI_CASES])
def test_cli_user_error_is_one_line_and_exit_2(script, argv, message, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("ICRL_TRACEBACK", raising=False)
    status = _run(_main_of(script), argv)
    err = capsys.readouterr().err
    assert status == 2
    lines = [line for line in err.splitlines() if line.strip() and not line.startswith("usage:")]
    lines = [line for line in lines if not line.startswith(" ")]  # argparse's wrapped usage continuation
    assert len(lines) == 1, err
    assert lines[0].startswith(f"{script}: error: ") and message in lines[0], err
    assert "Traceback" not in err


def test_cli_cuda_device_without_cuda(capsys, tmp_path, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    status = _run(_main_of("icrl-train"), ["--device", "cuda", "--out-dir", str(tmp_path / "run")])
    err = capsys.readouterr().err
    assert status == 2 and err.count("\n") == 1
    assert err.startswith("icrl-train: error: device 'cuda' asked for CUDA, but CUDA is not available")
    assert not (tmp_path / "run" / "train.icrl").exists()  # refused before any data was generated


def test_cli_garbage_checkpoint(capsys, tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "checkpoint.pt").write_bytes(b"\x00garbage" * 10)
    argv = ["--out-dir", str(run), "--num-histories", "4", "--source-episodes", "2", "--steps", "1",
            "--seq-len", "8", "--d-model", "16", "--num-heads", "2", "--num-layers", "1", "--episode-subsample", "1",
            "--no-progress"]  # fmt: skip
    status = _run(_main_of("icrl-train"), argv)
    err = capsys.readouterr().err
    assert status == 2 and err.count("\n") == 1, err
    assert err.startswith("icrl-train: error: ") and "checkpoint.pt is not a checkpoint" in err


def test_cli_missing_and_garbage_dataset(capsys, tmp_path):
    main = _main_of("icrl-data")
    assert _run(main, ["info", str(tmp_path / "missing.icrl")]) == 2
    assert capsys.readouterr().err.startswith("icrl-data: error: ")
    (tmp_path / "garbage.icrl").write_bytes(b"garbage")
    assert _run(main, ["info", str(tmp_path / "garbage.icrl")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "garbage.icrl is not a learning-history file" in err


def test_cli_bugs_keep_their_traceback(monkeypatch):
    import icrl_models.experiments.ngram_ad as compare_module

    def broken(config, **kwargs):
        raise RuntimeError("a bug")

    monkeypatch.setattr(compare_module, "compare", broken)
    with pytest.raises(RuntimeError, match="a bug"):
        compare_module.main([])


def test_cli_failed_sweep_trials_are_one_line_and_exit_1(monkeypatch, capsys):
    import icrl_models.experiments.ngram_ad as compare_module
    from icrl_models.experiments.sweep import TrialsFailed

    def failing(config, **kwargs):
        raise TrialsFailed("trials failed in worker processes (1: ValueError: bad (log: runs/trial-0001.log)): [1]")

    monkeypatch.setattr(compare_module, "compare", failing)
    monkeypatch.delenv("ICRL_TRACEBACK", raising=False)
    assert compare_module.main([]) == 1  # not 2: the trials failed, the command line was fine
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("icrl-compare: error: trials failed in worker processes")
    monkeypatch.setenv("ICRL_TRACEBACK", "1")
    with pytest.raises(TrialsFailed):
        compare_module.main([])


def test_cli_traceback_on_request(monkeypatch):
    monkeypatch.setenv("ICRL_TRACEBACK", "1")
    with pytest.raises(ValueError, match="env must be one of"):
        _main_of("icrl-compare")(["--env", "foo"])


def test_resolve_device_errors(monkeypatch):
    from icrl_models._cli import UsageError, resolve_device

    assert resolve_device("cpu") == torch.device("cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device("auto") == torch.device("cpu")
    with pytest.raises(UsageError, match="CUDA is not available"):
        resolve_device("cuda:0")
    with pytest.raises(UsageError, match="must be auto, cpu, cuda or cuda:N"):
        resolve_device("tpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(UsageError, match="has 1 CUDA device"):
        resolve_device("cuda:3")


# =================================================================================================
# gymnasium and packaging
# =================================================================================================


def _fresh_python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)


def _has_gymnasium() -> bool:
    return importlib.util.find_spec("gymnasium") is not None


@pytest.mark.skipif(not _has_gymnasium(), reason="gymnasium is not installed")
def test_gymnasium_entry_point_registers_the_ids_from_a_fresh_interpreter():
    """What gymnasium 0.26-0.29 does on ``import gymnasium``: load every ``gymnasium.envs`` entry point
    and call it inside ``namespace(<entry point name>)``. Done by hand here so that it is also checked
    with gymnasium >= 1.0, which dropped the plugin loader."""
    code = """
import sys
from importlib import metadata
import gymnasium
from gymnasium.envs.registration import namespace
assert "icrl_models" not in sys.modules
(plugin,) = [e for e in metadata.entry_points(group="gymnasium.envs") if e.value.startswith("icrl_models")]
with namespace(plugin.name):
    plugin.load()()
env = gymnasium.make("icrl/DarkRoom-v0", goal=10)
assert env.unwrapped.batched.goals.tolist() == [10]
print("ok")
"""
    result = _fresh_python(code)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr


@pytest.mark.skipif(not _has_gymnasium(), reason="gymnasium is not installed")
def test_gymnasium_make_from_a_fresh_interpreter():
    code = """
import gymnasium
major = int(gymnasium.__version__.split(".")[0])
if major < 1:  # the plugin loader ran on import
    env = gymnasium.make("icrl/DarkRoom-v0", goal=10)
else:  # gymnasium 1.x: the module-prefixed id imports the package first
    env = gymnasium.make("icrl_models.envs:icrl/DarkRoom-v0", goal=10)
obs, info = env.reset(seed=0)
assert env.unwrapped.batched.goals.tolist() == [10] and obs == 40
print("ok")
"""
    result = _fresh_python(code)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr


def test_package_metadata_and_typed_markers():
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    project = pyproject["project"]
    assert project["license"] == "Apache-2.0" and project["license-files"] == ["LICENSE"]
    assert "Apache License" in (ROOT / "LICENSE").read_text() and "Version 2.0" in (ROOT / "LICENSE").read_text()
    assert project["optional-dependencies"]["gym"] == ["gymnasium>=0.29", "pyyaml>=6"]
    entry = project["entry-points"]["gymnasium.envs"]["icrl"]
    module, _, name = entry.partition(":")
    assert callable(getattr(importlib.import_module(module), name))
    for package in ("icrl_kernels", "icrl_models"):
        assert (ROOT / package / "py.typed").is_file()
        assert "py.typed" in pyproject["tool"]["setuptools"]["package-data"][package]
    assert any(req.startswith("setuptools>=77") for req in pyproject["build-system"]["requires"])
