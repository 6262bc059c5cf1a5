"""GPT2-DTMA: the Decision Transformer with MoA (shapes, causality, ablation, learning), the offline
GPT-2 checkpoint loader (exact round trips, names, errors), DT data windows and rollouts, and a tiny
end-to-end ``icrl-markov`` run."""

from __future__ import annotations

import dataclasses
import json
import math
import re
import sys

import numpy as np
import pytest
import torch

from icrl_kernels.testing import assert_close_rel
from icrl_models.analysis import markov_heads
from icrl_models.data import LearningHistories
from icrl_models.envs import KeyToDoor, VisibleGoalDarkRoom
from icrl_models.generators import NoiseDistillation, collect_histories
from icrl_models.gpt2_checkpoint import load_gpt2_weights, read_gpt2_state_dict, save_gpt2_weights
from icrl_models.models import DecisionTransformerMoA, DTMoAConfig, TrajectoryWindows, rollout_dt


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny models: a second intra-op thread only spin-waits on a shared CPU (100x slower, measured)."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


# Pinned "eager": the Triton interpreter would make every learning test slow.
SMALL = dict(state_sizes=(9, 5), num_actions=4, context_len=6, max_timestep=16, n_layer=2, n_head=3, n_embd=24,
             n_positions=30, moa_layers=(0,), dropout=0.0, backend="eager")  # fmt: skip


def _model(**overrides) -> DecisionTransformerMoA:
    torch.manual_seed(0)
    return DecisionTransformerMoA(DTMoAConfig(**{**SMALL, **overrides})).eval()


def _inputs(batch: int, steps: int, config: DTMoAConfig, seed: int = 1):
    generator = torch.Generator().manual_seed(seed)
    rtg = torch.rand(batch, steps, generator=generator) * 5
    states = torch.randint(0, config.num_states, (batch, steps), generator=generator)
    actions = torch.randint(0, config.num_actions, (batch, steps), generator=generator)
    timesteps = torch.randint(0, config.max_timestep, (batch, steps), generator=generator)
    return rtg, states, actions, timesteps


# --- the model ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("gate", ["softmax", "sigmoid", "linear"])
def test_shapes_and_gates(gate):
    model = _model(gate=gate, moa_layers=(0, 1))
    inputs = _inputs(3, 5, model.config)
    logits, gates = model(*inputs, return_gates=True)
    assert logits.shape == (3, 5, 4) and torch.isfinite(logits).all()
    assert sorted(gates) == [0, 1] and gates[0].shape == (3, 15, 3)
    if gate == "softmax":
        assert_close_rel(gates[0].sum(-1), torch.ones(3, 15))
    ungated = _model(moa_layers=())
    assert ungated(*inputs, return_gates=True)[1] == {}


@pytest.mark.parametrize("gate", ["softmax", "linear"])
def test_fused_attention_of_the_moa_layers_equals_sdpa(gate):
    """``attention="fused"`` (one gated_attention kernel in the MoA layers) computes what SDPA + the gating op
    does: the same parameters give the same logits and gradients; it needs dropout 0."""
    sdpa, fused = _model(gate=gate, moa_layers=(0, 1)), _model(gate=gate, moa_layers=(0, 1), attention="fused")
    fused.load_state_dict(sdpa.state_dict())
    inputs = _inputs(2, 5, sdpa.config)
    want, got = sdpa(*inputs), fused(*inputs)
    assert_close_rel(got, want, name="logits")
    want.square().sum().backward()
    got.square().sum().backward()
    for (name, a), b in zip(sdpa.named_parameters(), fused.parameters()):
        assert_close_rel(b.grad, a.grad, name=f"grad {name}")
    with pytest.raises(ValueError, match="attention='fused' needs dropout=0"):
        DTMoAConfig(**{**SMALL, "attention": "fused", "dropout": 0.1})
    with pytest.raises(ValueError, match="attention must be one of"):
        DTMoAConfig(**{**SMALL, "attention": "flash"})


def test_causal_future_steps_do_not_change_earlier_logits():
    model = _model()
    rtg, states, actions, timesteps = _inputs(2, 6, model.config)
    logits = model(rtg, states, actions, timesteps)
    other = _inputs(2, 6, model.config, seed=9)
    t0 = 3
    mixed = [
        torch.cat([a[:, : t0 + 1], b[:, t0 + 1 :]], dim=1) for a, b in zip((rtg, states, actions, timesteps), other)
    ]
    # The action of step t0 itself comes after its state token: it must not change logits[:, t0] either.
    mixed[2][:, t0] = (actions[:, t0] + 1) % 4
    changed = model(*mixed)
    assert torch.equal(changed[:, : t0 + 1], logits[:, : t0 + 1])
    assert not torch.allclose(changed[:, t0 + 1 :], logits[:, t0 + 1 :])


def test_packed_state_parts_are_embedded_separately():
    """``state = part0 + 9 * part1``: the embedding is the sum of each part's table row."""
    model = _model()
    states = torch.tensor([[0, 7 + 9 * 3]])
    x = model.embed_state[0](states % 9) + model.embed_state[1](states // 9)
    direct = model.embed_state[0].weight[7] + model.embed_state[1].weight[3]
    assert torch.equal(x[0, 1], direct)
    assert model.config.num_states == 45


def test_input_and_config_validation():
    model = _model()
    rtg, states, actions, timesteps = _inputs(1, 4, model.config)
    with pytest.raises(ValueError, match="states"):
        model(rtg, states + 45, actions, timesteps)
    with pytest.raises(TypeError, match="states"):
        model(rtg, states.float(), actions, timesteps)
    with pytest.raises(ValueError, match="timesteps"):
        model(rtg, states, actions, timesteps + 16)
    with pytest.raises(ValueError, match=r"\[B, T\]"):
        model(rtg[:, :3], states, actions, timesteps)
    too_long = _inputs(1, 11, model.config)
    with pytest.raises(ValueError, match="positions"):
        model(*too_long)
    for bad in (dict(moa_layers=(2,)), dict(gate="relu"), dict(n_head=5), dict(context_len=11), dict(backend="x")):
        with pytest.raises(ValueError):
            DTMoAConfig(**{**SMALL, **bad})


@pytest.mark.parametrize("layer", [0, 1])  # gated and ungated
def test_head_mask_ablates_exactly_one_head(layer):
    """With head h of a layer zeroed, that head's value weights no longer matter and other heads' do."""
    model = _model()
    inputs = _inputs(2, 5, model.config)
    head, head_dim = 1, 8
    mask = torch.ones(3)
    mask[head] = 0.0
    ablated = model(*inputs, head_masks={layer: mask})
    intact = model(*inputs)
    assert not torch.allclose(ablated, intact)
    assert torch.equal(model(*inputs, head_masks={layer: torch.ones(3)}).argmax(-1), intact.argmax(-1))
    values = model.blocks[layer].attn.qkv.weight
    with torch.no_grad():
        rows = slice(2 * 24 + head * head_dim, 2 * 24 + (head + 1) * head_dim)
        values[rows] += torch.randn_like(values[rows])
        assert torch.equal(model(*inputs, head_masks={layer: mask}), ablated)
        other = slice(2 * 24, 2 * 24 + head_dim)  # head 0's value rows
        values[other] += torch.randn_like(values[other])
        assert not torch.allclose(model(*inputs, head_masks={layer: mask}), ablated)


def _batch(model: DecisionTransformerMoA, batch: int = 4, steps: int = 6) -> dict:
    rtg, states, actions, timesteps = _inputs(batch, steps, model.config)
    mask = torch.ones(batch, steps, dtype=torch.bool)
    mask[0, 4:] = False
    return {"rtg": rtg, "states": states, "actions": actions, "timesteps": timesteps, "mask": mask}


def test_gate_weights_and_head_importance():
    model = _model()
    batch = _batch(model)
    for tokens in ("all", "state"):
        weights = model.gate_weights(batch, tokens=tokens)
        assert list(weights) == [0] and weights[0].shape == (3,)
        assert weights[0].sum().item() == pytest.approx(1.0, abs=1e-5)
    # A head whose output projection is zero contributes nothing: importance exactly 0.
    with torch.no_grad():
        model.blocks[1].attn.out_proj.weight[:, 16:24] = 0.0
    importance = model.head_importance(batch)
    assert importance.shape == (2, 3) and torch.isfinite(importance).all() and (importance >= 0).all()
    assert importance[1, 2] == 0.0 and importance[0].min() > 0 and importance[1, :2].min() > 0
    assert not model.training  # restored
    model.train()
    model.gate_weights(batch)
    assert model.training


def test_markov_init_makes_markov_heads():
    model = _model(n_head=4, n_embd=32)
    before = markov_heads(model)
    assert before.heads() == []
    model.markov_init_(0, [0, 2], generator=torch.Generator().manual_seed(0))
    report = markov_heads(model)
    assert report.heads() == [("blocks.0.attn", 0), ("blocks.0.attn", 2)]
    assert report.ratio[0][0] > 1.5 * report.r  # about (D - 1) / (D / Dh - 1) = 10.3, less the noise
    with pytest.raises(ValueError, match="head"):
        model.markov_init_(0, [4])


def test_act_uses_the_last_context_len_steps():
    model = _model()
    inputs = _inputs(3, 9, model.config)  # longer than context_len = 6
    cropped = [t[:, -6:] for t in inputs]
    assert torch.equal(model.act(*inputs), model(*cropped)[:, -1].argmax(-1))
    sampled = model.act(*inputs, sample=True, generator=torch.Generator().manual_seed(0))
    assert sampled.shape == (3,) and sampled.max() < 4


# --- data and rollouts ---------------------------------------------------------------------------------


def _histories() -> LearningHistories:
    """Two histories: [ep 3 steps, ep 2 steps] and [ep 2 steps + padding]."""
    states = np.array([[1, 2, 3, 4, 5], [6, 7, 0, 0, 0]], dtype=np.int32)
    actions = np.array([[0, 1, 2, 3, 0], [1, 1, 0, 0, 0]], dtype=np.int16)
    rewards = np.array([[1, 0, 2, 0, 1], [0, 3, 0, 0, 0]], dtype=np.float32)
    dones = np.array([[0, 0, 1, 0, 1], [0, 1, 0, 0, 0]], dtype=bool)
    return LearningHistories(
        states=states, actions=actions, rewards=rewards, dones=dones, lengths=np.array([5, 2]),
        task_ids=np.array([0, 1]), action_sets=np.tile(np.arange(4, dtype=np.int16), (2, 1)),
        task_params={}, metadata={},
    )  # fmt: skip


def test_trajectory_windows_returns_to_go_and_episode_bounds():
    windows = TrajectoryWindows(_histories(), context_len=3)
    assert len(windows) == 7 and windows.max_timestep == 3
    np.testing.assert_array_equal(windows.rtg, [3, 2, 2, 1, 1, 3, 3])
    np.testing.assert_array_equal(windows.timesteps, [0, 1, 2, 0, 1, 0, 1])
    np.testing.assert_array_equal(windows.episode_returns, [3, 1, 3])
    batch = windows.get_batch([0, 1, 3, 5])
    np.testing.assert_array_equal(batch["mask"].numpy(), [[1, 1, 1], [1, 1, 0], [1, 1, 0], [1, 1, 0]])
    np.testing.assert_array_equal(batch["states"].numpy(), [[1, 2, 3], [2, 3, 0], [4, 5, 0], [6, 7, 0]])
    np.testing.assert_array_equal(batch["rtg"].numpy(), [[3, 2, 2], [2, 2, 0], [1, 1, 0], [3, 3, 0]])


def test_visible_goal_dark_room_is_dark_room_with_the_goal_observed():
    from icrl_models.envs import DarkRoom

    goals = np.arange(0, 81, 7)
    hidden, visible = DarkRoom(goals), VisibleGoalDarkRoom(goals)
    assert visible.num_observations == 81**2 and visible.observation_parts == (81, 81)
    np.testing.assert_array_equal(visible.reset(), hidden.reset() + 81 * goals)
    actions = np.random.default_rng(0).integers(0, 5, (20, goals.size))
    for step in actions:
        a, b = hidden.step(step), visible.step(step)
        np.testing.assert_array_equal(b.observations, a.observations + 81 * goals)
        np.testing.assert_array_equal(b.rewards, a.rewards)
        np.testing.assert_array_equal(b.truncated, a.truncated)
    np.testing.assert_array_equal(visible.learner_states(), hidden.observations())
    np.testing.assert_array_equal(visible.optimal_returns(), hidden.optimal_returns())


def test_rollouts_in_terminating_and_visible_goal_envs():
    model = _model(state_sizes=(81,), num_actions=5, max_timestep=20)
    returns = rollout_dt(model, KeyToDoor([40, 3], [0, 3], episode_length=12, seed=0), 2.0, num_episodes=2)
    assert returns.shape == (2, 2) and np.isfinite(returns).all() and returns.max() <= 2
    visible = _model(state_sizes=(81, 81), num_actions=5, max_timestep=20)
    returns = rollout_dt(visible, VisibleGoalDarkRoom([10, 40], episode_length=5), [5.0, 5.0], sample=True)
    assert returns.shape == (2, 1) and np.isfinite(returns).all() and returns.max() <= 5


def test_rollout_reward_bookkeeping():
    model = _model(state_sizes=(81, 81), num_actions=5, max_timestep=20)
    with torch.no_grad():  # always noop: the agent stays on the centre cell
        model.action_head.weight.zero_()
        model.action_head.bias.copy_(torch.tensor([10.0, 0, 0, 0, 0]))
    returns = rollout_dt(model, VisibleGoalDarkRoom([10, 40], episode_length=5), [5.0, 5.0], num_episodes=2)
    np.testing.assert_array_equal(returns, [[0, 0], [5, 5]])


def test_tiny_training_lowers_the_loss():
    env = VisibleGoalDarkRoom(np.arange(0, 81, 4), episode_length=8)
    histories = collect_histories(env, NoiseDistillation(), 6, progress=False)
    windows = TrajectoryWindows(histories, 4)
    torch.manual_seed(0)
    config = DTMoAConfig(state_sizes=(81, 81), context_len=4, max_timestep=8, n_layer=1, n_head=2, n_embd=32,
                         n_positions=12, dropout=0.0, backend="eager")  # fmt: skip
    model = DecisionTransformerMoA(config)
    rng = np.random.default_rng(0)
    fixed = windows.sample(256, rng)
    with torch.no_grad():
        before = model.loss(fixed).item()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for _ in range(80):
        loss = model.loss(windows.sample(64, rng))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    with torch.no_grad():
        after = model.loss(fixed).item()
    assert before == pytest.approx(math.log(5), abs=0.05)
    assert after < before - 0.3


# --- GPT-2 checkpoints --------------------------------------------------------------------------------

VOCAB, WIDTH, HEADS, LAYERS, POSITIONS = 50, 24, 3, 3, 30


def _hf_gpt2_state(prefix: str = "transformer.", seed: int = 0) -> dict[str, torch.Tensor]:
    """A random GPT-2 state dict with Hugging Face's names and shapes (Conv1D weights are [in, out])."""
    generator = torch.Generator().manual_seed(seed)
    rand = lambda *shape: torch.randn(*shape, generator=generator)
    d = WIDTH
    state = {f"{prefix}wte.weight": rand(VOCAB, d), f"{prefix}wpe.weight": rand(POSITIONS, d)}
    for i in range(LAYERS):
        h = f"{prefix}h.{i}."
        state.update({
            h + "ln_1.weight": rand(d), h + "ln_1.bias": rand(d),
            h + "attn.bias": torch.tril(torch.ones(POSITIONS, POSITIONS)).view(1, 1, POSITIONS, POSITIONS),
            h + "attn.masked_bias": torch.tensor(-1e4),
            h + "attn.c_attn.weight": rand(d, 3 * d), h + "attn.c_attn.bias": rand(3 * d),
            h + "attn.c_proj.weight": rand(d, d), h + "attn.c_proj.bias": rand(d),
            h + "ln_2.weight": rand(d), h + "ln_2.bias": rand(d),
            h + "mlp.c_fc.weight": rand(d, 4 * d), h + "mlp.c_fc.bias": rand(4 * d),
            h + "mlp.c_proj.weight": rand(4 * d, d), h + "mlp.c_proj.bias": rand(d),
        })  # fmt: skip
    state[f"{prefix}ln_f.weight"], state[f"{prefix}ln_f.bias"] = rand(d), rand(d)
    state["lm_head.weight"] = state[f"{prefix}wte.weight"].clone()  # tied in HF; safetensors stores copies
    return state


def _write_hf_dir(path, state: dict, *, fmt: str, n_layer: int = LAYERS, n_head: int = HEADS, n_embd: int = WIDTH):
    path.mkdir(parents=True, exist_ok=True)
    config = {"model_type": "gpt2", "n_layer": n_layer, "n_head": n_head, "n_embd": n_embd,
              "n_positions": POSITIONS, "vocab_size": VOCAB, "layer_norm_epsilon": 1e-5,
              "activation_function": "gelu_new"}  # fmt: skip
    (path / "config.json").write_text(json.dumps(config))
    if fmt == "safetensors":
        safetensors_torch = pytest.importorskip("safetensors.torch", reason="safetensors is not installed")
        safetensors_torch.save_file(state, str(path / "model.safetensors"))
    else:
        torch.save(state, path / "pytorch_model.bin")
    return path


def _dt_from(directory, **overrides) -> DecisionTransformerMoA:
    config = DTMoAConfig.from_gpt2(directory, state_sizes=(81,), context_len=10, dropout=0.0, backend="eager",
                                   **overrides)  # fmt: skip
    return DecisionTransformerMoA(config)


@pytest.mark.parametrize("fmt", ["safetensors", "bin"])
@pytest.mark.parametrize("prefix", ["transformer.", ""])
def test_gpt2_round_trip_is_exact(tmp_path, fmt, prefix):
    original = _hf_gpt2_state(prefix)
    source = _write_hf_dir(tmp_path / "source", original, fmt=fmt)
    model = _dt_from(source)
    assert (model.config.n_layer, model.config.n_head, model.config.n_embd, model.config.n_positions) == (3, 3, 24, 30)
    report = load_gpt2_weights(model, source)
    ignored = {
        name
        for name in original
        if re.fullmatch(r"(transformer\.)?(wte\.weight|lm_head\.weight|h\.\d\.attn\.(bias|masked_bias))", name)
    }
    assert sorted(report.ignored) == sorted(name.removeprefix("transformer.") for name in ignored)
    assert not report.missing and not report.unexpected and report.skipped_layers == []
    save_gpt2_weights(model, tmp_path / "saved", format=fmt, prefix=prefix)
    saved = read_gpt2_state_dict(tmp_path / "saved")
    assert set(saved) == set(original) - ignored
    for name, tensor in saved.items():
        assert tensor.dtype == original[name].dtype and torch.equal(tensor, original[name]), name
    # And the reloaded copy is a model with identical parameters.
    again = _dt_from(tmp_path / "saved")
    load_gpt2_weights(again, tmp_path / "saved")
    for name, parameter in again.state_dict().items():
        if name.startswith(("blocks.", "wpe.", "ln_f.")):
            expected = model.state_dict()[name]
            if name.endswith(("attn.qkv.weight", "attn.qkv.bias")):  # a gated layer's rows 3D: are its MoA gate
                parameter, expected = parameter[: 3 * 24], expected[: 3 * 24]
            assert torch.equal(parameter, expected), name


def test_gpt2_conv1d_layout_is_transposed_correctly(tmp_path):
    """The loaded layers compute what GPT-2's Conv1D computes: ``x @ W + b``."""
    original = _hf_gpt2_state("")
    model = _dt_from(_write_hf_dir(tmp_path, original, fmt="bin"))
    load_gpt2_weights(model, tmp_path)
    x = torch.randn(5, WIDTH)
    block = model.blocks[1]
    for module, name in ((block.attn.qkv, "attn.c_attn"), (block.attn.out_proj, "attn.c_proj"),
                         (block.mlp.c_fc, "mlp.c_fc")):  # fmt: skip
        expected = x @ original[f"h.1.{name}.weight"] + original[f"h.1.{name}.bias"]
        assert_close_rel(module(x), expected)
    hidden = torch.randn(5, 4 * WIDTH)
    assert_close_rel(
        block.mlp.c_proj(hidden), hidden @ original["h.1.mlp.c_proj.weight"] + original["h.1.mlp.c_proj.bias"]
    )


def test_gpt2_first_layers_only_and_fewer_positions(tmp_path):
    original = _hf_gpt2_state()
    source = _write_hf_dir(tmp_path, original, fmt="bin")
    model = _dt_from(source, n_layer=2)
    report = model.load_gpt2(source)
    assert report.skipped_layers == [2]
    assert torch.equal(model.blocks[1].ln_2.weight, original["transformer.h.1.ln_2.weight"])
    short = DecisionTransformerMoA(DTMoAConfig(state_sizes=(81,), context_len=4, n_layer=3, n_head=HEADS,
                                               n_embd=WIDTH, n_positions=12, backend="eager"))  # fmt: skip
    load_gpt2_weights(short, source)
    assert torch.equal(short.wpe.weight, original["transformer.wpe.weight"][:12])


def test_gpt2_mismatches_raise(tmp_path):
    original = _hf_gpt2_state()
    source = _write_hf_dir(tmp_path / "ok", original, fmt="bin")
    base = dict(state_sizes=(81,), context_len=4, n_layer=2, n_positions=POSITIONS, backend="eager")
    with pytest.raises(ValueError, match="n_embd"):
        load_gpt2_weights(DecisionTransformerMoA(DTMoAConfig(**base, n_head=HEADS, n_embd=30)), source)
    with pytest.raises(ValueError, match="n_head"):
        load_gpt2_weights(DecisionTransformerMoA(DTMoAConfig(**base, n_head=4, n_embd=WIDTH)), source)
    with pytest.raises(ValueError, match="layers"):
        load_gpt2_weights(DecisionTransformerMoA(DTMoAConfig(**{**base, "n_layer": 4}, n_head=HEADS, n_embd=WIDTH)),
                          source)  # fmt: skip
    long = DecisionTransformerMoA(DTMoAConfig(**{**base, "n_positions": 40}, n_head=HEADS, n_embd=WIDTH))
    with pytest.raises(ValueError, match="wpe"):
        load_gpt2_weights(long, source)
    # A config that lies about the width: the tensor shapes catch it.
    lying = _write_hf_dir(tmp_path / "lying", _hf_gpt2_state(), fmt="bin", n_embd=WIDTH)
    state = read_gpt2_state_dict(lying)
    state["transformer.h.0.attn.c_proj.weight"] = torch.randn(WIDTH, WIDTH + 1)
    torch.save(state, lying / "pytorch_model.bin")
    with pytest.raises(ValueError, match="c_proj"):
        load_gpt2_weights(_dt_from(lying), lying)


def test_gpt2_strict_missing_and_unexpected(tmp_path):
    state = _hf_gpt2_state()
    del state["transformer.ln_f.bias"]
    state["transformer.h.0.attn.extra"] = torch.ones(2)
    source = _write_hf_dir(tmp_path, state, fmt="bin")
    model = _dt_from(source)
    with pytest.raises(ValueError, match="ln_f.bias"):
        load_gpt2_weights(model, source)
    report = load_gpt2_weights(model, source, strict=False)
    assert report.missing == ["ln_f.bias"] and report.unexpected == ["h.0.attn.extra"]
    assert torch.equal(model.ln_f.weight, state["transformer.ln_f.weight"])


def test_gpt2_sharded_checkpoint(tmp_path):
    """Shards listed in ``pytorch_model.bin.index.json`` are merged."""
    original = _hf_gpt2_state("")
    names = sorted(original)
    _write_hf_dir(tmp_path, {}, fmt="bin")
    (tmp_path / "pytorch_model.bin").unlink()
    shards = {"pytorch_model-00001-of-00002.bin": names[::2], "pytorch_model-00002-of-00002.bin": names[1::2]}
    for shard, shard_names in shards.items():
        torch.save({name: original[name] for name in shard_names}, tmp_path / shard)
    weight_map = {name: shard for shard, shard_names in shards.items() for name in shard_names}
    (tmp_path / "pytorch_model.bin.index.json").write_text(json.dumps({"weight_map": weight_map}))
    state = read_gpt2_state_dict(tmp_path)
    assert set(state) == set(original) and all(torch.equal(state[n], original[n]) for n in names)
    model = _dt_from(tmp_path)
    assert not load_gpt2_weights(model, tmp_path).missing


def test_gpt2_missing_files_and_safetensors(tmp_path, monkeypatch):
    with pytest.raises(FileNotFoundError, match="config.json"):
        DTMoAConfig.from_gpt2(tmp_path)
    _write_hf_dir(tmp_path / "empty", {}, fmt="bin")
    (tmp_path / "empty" / "pytorch_model.bin").unlink()
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        read_gpt2_state_dict(tmp_path / "empty")
    source = _write_hf_dir(tmp_path / "st", _hf_gpt2_state(), fmt="safetensors")
    monkeypatch.setitem(sys.modules, "safetensors", None)
    monkeypatch.setitem(sys.modules, "safetensors.torch", None)
    with pytest.raises(ImportError, match="pip install safetensors"):
        read_gpt2_state_dict(source)


# --- the experiment end to end -------------------------------------------------------------------------


def test_icrl_markov_tiny_end_to_end(tmp_path):
    from icrl_models.experiments.markov_heads import main

    out = tmp_path / "markov"
    argv = ["--steps", "6", "--eval-every", "3", "--num-histories", "6", "--episodes-per-history", "3",
            "--analysis-windows", "8", "--eval-envs", "4", "--n-layer", "1", "--n-head", "2", "--n-embd", "16",
            "--markov-heads", "0", "--context-lens", "3", "4", "--key-to-door-episode-length", "10",
            "--seeds", "0,1", "--tasks", "dark_room_visible,key_to_door", "--backend", "eager", "--no-progress",
            "--scheduler", "local", "--out-dir", str(out)]  # fmt: skip
    assert main(argv) == 0
    for name in ("markov.json", "markov.md", "markov.png"):
        assert (out / name).stat().st_size > 0
    report = json.loads((out / "markov.json").read_text())
    runs = [(task, k, seed) for seed in (0, 1) for k in (3, 4) for task in ("dark_room_visible", "key_to_door")]
    assert [(r["task"], r["k"], r["seed"]) for r in report["results"]] == runs
    summary = report["summary"]["key_to_door"]["4"]
    assert summary["seeds"] == [0, 1] and len(summary["g_markov"]["values"]) == 2
    assert summary["g_markov"]["mean"] == pytest.approx(np.mean(summary["g_markov"]["values"]))
    for result in report["results"]:
        assert result["markov_before"]["markov_heads"] == [["blocks.0.attn", 0]]
        numbers = [*result["returns"].values(), result["held_out_loss"], *result["g_markov_init_heads"].values(),
                   *np.ravel(result["head_importance"]), *result["gate_weights_all_tokens"]["0"]]  # fmt: skip
        assert all(math.isfinite(v) for v in numbers)
        assert len(result["curve"]["step"]) == 3
    table = (out / "markov.md").read_text()
    assert "R_Markov" in table and "key_to_door" in table
    assert table.startswith("Command: `icrl-markov --steps 6 ") and table.splitlines()[2].startswith("Machine: ")
    assert report["command"] == table.splitlines()[0][len("Command: `") : -1]
    assert "(n=2)" in table  # mean ± sd over the two seeds
    # Each run keeps its own CPU time, so a rerun that reuses every run still reports what the runs cost.
    cpu = sum(result["cpu_seconds"] for result in report["results"])
    assert cpu > 0 and f"the 8 runs' own CPU time, recorded when each trained: {cpu:.0f} s" in table
    assert main(argv) == 0
    rerun = (out / "markov.md").read_text()
    assert f"the 8 runs' own CPU time, recorded when each trained: {cpu:.0f} s" in rerun
    assert main(["--tasks", "nope", "--out-dir", str(out)]) == 2


def test_icrl_markov_list_flags_and_older_comma_strings():
    from icrl_models.config import config_from_args
    from icrl_models.experiments.markov_heads import MarkovConfig, build_parser
    from icrl_models.experiments.markov_report import _listed

    def parse(*argv):
        return config_from_args(MarkovConfig, build_parser().parse_args(list(argv)))

    lists = parse("--tasks", "key_to_door", "dark_room", "--context-lens", "3", "4", "--seeds", "0", "2",
                  "--moa-layers", "0", "1", "--markov-heads", "1",
                  "--key-to-door-layouts", "40:0", "10:80")  # fmt: skip
    commas = parse("--tasks", "key_to_door,dark_room", "--context-lens", "3,4", "--seeds", "0,2", "--moa-layers",
                   "0,1", "--markov-heads", "1", "--key-to-door-layouts", "40:0,10:80")  # fmt: skip
    assert lists == commas
    assert (lists.tasks, lists.context_lens, lists.seeds, lists.moa_layers) == (
        ("key_to_door", "dark_room"), (3, 4), (0, 2), (0, 1))  # fmt: skip
    assert lists.key_to_door_task_ids().tolist() == [40 * 81, 10 * 81 + 80]
    # Python callers and markov.json files of older runs hold comma strings; newer ones lists.
    old = MarkovConfig(tasks="key_to_door,dark_room", context_lens="3,4", seeds="0,2", moa_layers="0,1",
                       markov_heads="1", key_to_door_layouts="40:0,10:80")  # fmt: skip
    assert old == lists == MarkovConfig(**json.loads(json.dumps(dataclasses.asdict(lists))))
    # Presets fill the list fields; "--markov-heads" with no value means no Markov heads, "none" the preset's.
    default, paper = parse(), parse("--preset", "paper", "--markov-heads", "none")
    assert (default.context_lens, default.markov_heads, default.seeds) == ((10,), (0, 1), (0, 1, 2))
    assert (paper.context_lens, paper.markov_heads) == ((10, 20, 30, 40, 50), (1, 5, 10))
    assert parse("--markov-heads").markov_heads == () == parse("--markov-heads", "").markov_heads
    assert default.task_list() == list(default.tasks) and default.moa_layer_list() == (0,)
    # markov.md shows the lists comma-separated.
    assert _listed([0, 1]) == "0,1"


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--tasks", "nope"], "tasks must be one or more of"),
        (["--seeds", "x"], "argument --seeds: expected int values, got 'x'"),
        (["--seeds"], "seeds must be one or more ints >= 0"),
        (["--seeds", "1", "-1"], "seeds must be one or more ints >= 0"),
        (["--context-lens", "4,0"], "context_lens must be one or more ints >= 1"),
        (["--moa-layers", ""], "moa_layers must be one or more ints >= 0"),
        (["--markov-heads", "-2"], "markov_heads must be ints >= 0"),
        (["--key-to-door-layouts", "40:0", "99:0"],
         "key_to_door_layouts must be KEY:DOOR cells in [0, 81), got '99:0'"),
        (["--key-to-door-layouts", "40"], "key_to_door_layouts must be KEY:DOOR cells"),
    ],
)  # fmt: skip
def test_icrl_markov_bad_list_flags_are_one_line_errors(argv, message, tmp_path, capsys):
    from icrl_models.experiments.markov_heads import main

    try:
        status = main([*argv, "--out-dir", str(tmp_path / "markov")])
    except SystemExit as exit_:  # argparse's own errors
        status = exit_.code
    err = capsys.readouterr().err
    assert status == 2
    lines = [line for line in err.splitlines() if line.startswith("icrl-markov: error: ")]
    assert len(lines) == 1 and message in lines[0], err
    assert not (tmp_path / "markov").exists()  # refused before any training


def test_icrl_markov_from_a_local_gpt2_checkpoint(tmp_path):
    from icrl_models.experiments.markov_heads import main

    source = _write_hf_dir(tmp_path / "gpt2", _hf_gpt2_state(), fmt="safetensors")
    out = tmp_path / "markov"
    argv = ["--gpt2", str(source), "--n-layer", "2", "--tasks", "dark_room_visible", "--steps", "2",
            "--eval-every", "2", "--num-histories", "4", "--episodes-per-history", "2", "--analysis-windows", "4",
            "--eval-envs", "2", "--context-lens", "3", "--seeds", "0", "--backend", "eager", "--no-progress",
            "--out-dir", str(out)]  # fmt: skip
    assert main(argv) == 0
    report = json.loads((out / "markov.json").read_text())
    assert report["model_config"]["n_embd"] == WIDTH and report["model_config"]["n_layer"] == 2
    assert "GPT-2 weights from" in (out / "markov.md").read_text()
