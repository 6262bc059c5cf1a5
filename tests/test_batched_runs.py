"""Runs trained as one batched model (:mod:`icrl_models.batched`, ``icrl-compare --batch-runs``).

A run trained inside a batch matches the same run trained alone: the same windows in the same order, losses
and gradient norms equal to fp32 rounding over the first 100 steps, and the same evaluation, for every model
kind the batch supports. Dropout is off in those comparisons: a batch draws its dropout masks from one stream
shared by its runs, so with dropout on a run's masks are not its single run's (the dropout test checks each
run's own rate instead). A batched run's folder holds what an ``icrl-train`` run's holds, in the same formats;
a killed batch resumes per run (also across batched and single training); runs group by model shape; the
per-run scalars really differ; the step reads no device value on the host (one CUDA graph).
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from _helpers import HostReadDetector, gpu_value_checks

import icrl_models.batched as batched
import icrl_models.cuda_graphs as cuda_graphs
import icrl_models.lifecycle as lifecycle
import icrl_models.train as train_module
from icrl_kernels.testing import assert_close_rel
from icrl_models.batched import (
    FLAT_ALIGNMENT,
    RunAdamW,
    RunDropout,
    StackedRuns,
    batched_train_step,
    clip_run_gradients,
    flat_layout,
    flat_rows,
)
from icrl_models.checkpoint import load_checkpoint
from icrl_models.data import HistoryWindows, generate_histories, local_action_batch, save_histories
from icrl_models.experiments.ngram_ad import CompareConfig, build_trials, compare, draw_assignments
from icrl_models.train import (
    TrainConfig,
    TrainRun,
    check_batch,
    group_runs,
    learning_rate_at,
    train,
    train_batched,
)

#: Every model kind a batch trains: (model, env, overrides). Contextual bandits embed vector observations.
MODEL_KINDS = {
    "ngram_ad": ("ngram_ad", "dark_room", {}),
    "ngram_ad-transition": ("ngram_ad", "dark_room", {"ngram_tokens": "transition"}),
    "ad": ("ad", "dark_room", {}),
    "ad-contextual": ("ad", "contextual_bandit", {"num_arms": "4", "source_episodes": 1, "seq_len": 12}),
    # Headless-AD: per-run random action maps every step (each run's from its own stream), InfoNCE under vmap.
    "headless_ad": (
        "headless_ad",
        "bernoulli_bandit",
        {"num_arms": "4", "source_episodes": 1, "seq_len": 12, "embed_dim": 8, "eval_episodes": 1},
    ),
}
#: Per-run scalars of the three runs of a batch: all different.
RUN_SCALARS = [
    dict(seed=0, learning_rate=1e-3, weight_decay=1e-4, label_smoothing=0.0, episode_subsample=2, warmup_steps=5,
         grad_clip=1.0, beta1=0.9, beta2=0.99),
    dict(seed=1, learning_rate=3e-3, weight_decay=1e-2, label_smoothing=0.3, episode_subsample=1, warmup_steps=20,
         grad_clip=0.05, beta1=0.8, beta2=0.999),
    dict(seed=2, learning_rate=5e-4, weight_decay=0.0, label_smoothing=0.6, episode_subsample=4, warmup_steps=1,
         grad_clip=5.0, beta1=0.95, beta2=0.95),
]  # fmt: skip


def _base(tmp_path: Path, kind: str, **overrides) -> TrainConfig:
    model, env, extra = MODEL_KINDS[kind]
    settings = dict(
        model=model, env=env, num_histories=8, source_episodes=8, seq_len=16, d_model=16, num_heads=2, num_layers=1,
        steps=100, batch_size=4, checkpoint_every=50, log_every=1, eval_episodes=2, eval_envs_per_task=1, eval_tasks=3,
        progress=False, backend="eager", threads=1,
    )  # fmt: skip
    settings.update(extra)
    settings.update(overrides)
    config = TrainConfig(**settings)
    data = tmp_path / f"{env}.icrl"
    if not data.exists():
        histories = generate_histories(config.generate_config("train", config.num_histories, config.source_episodes),
                                       progress=False)  # fmt: skip
        save_histories(histories, data)
    return dataclasses.replace(config, data=str(data))


def _runs(tmp_path: Path, kind: str, folder: str, **overrides) -> list[TrainConfig]:
    base = _base(tmp_path, kind, **overrides)
    return [
        dataclasses.replace(base, **scalars, out_dir=str(tmp_path / folder / f"run{index}"))
        for index, scalars in enumerate(RUN_SCALARS)
    ]


def _rows(config: TrainConfig) -> list[dict]:
    return [json.loads(line) for line in (Path(config.out_dir) / "metrics.jsonl").read_text().splitlines()]


def _training_rows(config: TrainConfig) -> list[dict]:
    return [row for row in _rows(config) if "loss" in row]


def _without_time(summary: dict) -> dict:
    return {key: value for key, value in summary.items() if key != "wall_seconds"}


@pytest.fixture
def drawn_windows(monkeypatch):
    """The window indices of every ``HistoryWindows.get_batch`` call (single and batched runs), in call order."""
    calls = []
    original = HistoryWindows.get_batch

    def recording(self, indices):
        calls.append(np.asarray(indices).copy())
        return original(self, indices)

    monkeypatch.setattr(HistoryWindows, "get_batch", recording)
    return calls


# -- equivalence -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", list(MODEL_KINDS))
def test_runs_in_a_batch_match_the_same_runs_trained_alone(tmp_path, kind):
    """100 steps of three runs with different seeds, data streams and every per-run scalar: each run's losses and
    gradient norms match its single run's to fp32 rounding (dropout off: see the module docstring), it draws
    the same windows, ends with the same weights and its evaluation is the single run's."""
    together, alone = _runs(tmp_path, kind, "batched"), _runs(tmp_path, kind, "single")
    summaries = train_batched(together)
    for batch_run, single_run, summary in zip(together, alone, summaries):
        single = train(single_run)  # the same evaluation (in-context returns, references, scores)
        assert _without_time(summary) == _without_time(single)
        got, want = _training_rows(batch_run), _training_rows(single_run)
        assert [row["step"] for row in got] == [row["step"] for row in want] == list(range(1, 101))
        assert [row["lr"] for row in got] == [row["lr"] for row in want]
        # The first steps agree to a few fp32 ulps; later the rounding differences of batched matmuls (another
        # summation order) grow as training amplifies them, most in the gradient norm of the run with the
        # largest learning rate and tightest clipping (run 1; measured: losses 2e-5, its norms 4e-3 by step 100).
        for key, first_steps, all_steps in (("loss", 1e-6, 1e-4), ("grad_norm", 1e-5, 2e-2)):
            a, b = [r[key] for r in got], [r[key] for r in want]
            np.testing.assert_allclose(a[:5], b[:5], rtol=first_steps, err_msg=key)
            np.testing.assert_allclose(a, b, rtol=all_steps, err_msg=key)
        ours = load_checkpoint(Path(batch_run.out_dir) / "checkpoint.pt")
        theirs = load_checkpoint(Path(single_run.out_dir) / "checkpoint.pt")
        assert ours["rng"]["numpy"] == theirs["rng"]["numpy"]  # the same windows were drawn, as many times
        for name, value in theirs["model"].items():  # measured: at most 1.3e-3 of the tensor's largest entry
            torch.testing.assert_close(ours["model"][name], value, rtol=0, atol=1e-2 * float(value.abs().max()),
                                       msg=name)  # fmt: skip
        eval_ours = json.loads((Path(batch_run.out_dir) / "eval.json").read_text())
        assert eval_ours == json.loads((Path(single_run.out_dir) / "eval.json").read_text())


def test_a_batch_draws_each_runs_windows_in_its_single_runs_order(tmp_path, drawn_windows):
    """The window indices of every step: run k's rows of a batch step are what its single run draws at that step."""
    together = [dataclasses.replace(c, steps=6, eval_every=0) for c in _runs(tmp_path, "ad", "batched")]
    train_batched(together)
    batch_draws = list(drawn_windows)
    drawn_windows.clear()
    # Runs 0 and 2 share the data but not the windows (subsample 2 and 4): each step gathers per windows object.
    per_step = len(batch_draws) // 6
    for index, config in enumerate(together):
        train(dataclasses.replace(config, out_dir=config.out_dir.replace("batched", "single")))
        single = list(drawn_windows)
        drawn_windows.clear()
        assert len(single) == 6
        for step in range(6):
            gathered = np.concatenate(batch_draws[step * per_step : (step + 1) * per_step])
            assert np.array_equal(gathered[index * 4 : (index + 1) * 4], single[step]), (index, step)


def test_runs_evaluated_on_different_tasks_in_one_batch_evaluate_as_alone(tmp_path):
    """Evaluation settings are per run: environment counts that differ (rows padded in the batched rollout),
    greedy and sampled actions; each run's evaluation is its single run's."""
    settings = [dict(eval_tasks=2, eval_envs_per_task=1, sample_actions=True),
                dict(eval_tasks=5, eval_envs_per_task=2, sample_actions=False),
                dict(eval_tasks=3, eval_envs_per_task=1, sample_actions=True, num_train_tasks=30)]  # fmt: skip
    together = [
        dataclasses.replace(c, steps=3, **extra) for c, extra in zip(_runs(tmp_path, "ngram_ad", "b"), settings)
    ]
    for summary, config in zip(train_batched(together), together):
        single = dataclasses.replace(config, out_dir=config.out_dir.replace("/b/", "/s/"))
        assert _without_time(summary) == _without_time(train(single))
    assert [summary["num_envs"] for summary in train_batched(together)] == [2, 10, 3]


# -- the folder a batched run leaves -----------------------------------------------------------------------------
def _structure(value):
    """Keys, types, shapes and dtypes of a nested payload, without the values."""
    if isinstance(value, dict):
        return {key: _structure(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [type(value).__name__, [_structure(item) for item in value]]
    if isinstance(value, torch.Tensor):
        return ("tensor", tuple(value.shape), str(value.dtype), value.device.type)
    return type(value).__name__


def test_a_batched_runs_folder_is_an_icrl_train_run_folder(tmp_path):
    together = [dataclasses.replace(c, steps=4, checkpoint_every=2) for c in _runs(tmp_path, "ngram_ad", "b")]
    alone = [dataclasses.replace(c, steps=4, checkpoint_every=2) for c in _runs(tmp_path, "ngram_ad", "s")]
    train_batched(together)
    for batch_run, single_run in zip(together, alone):
        train(single_run)
        ours, theirs = Path(batch_run.out_dir), Path(single_run.out_dir)
        assert sorted(p.name for p in ours.iterdir()) == sorted(p.name for p in theirs.iterdir())
        mine, reference = load_checkpoint(ours / "checkpoint.pt"), load_checkpoint(theirs / "checkpoint.pt")
        assert _structure(mine) == _structure(reference)
        assert mine["config"] == reference["config"] and mine["step"] == reference["step"] == 4
        # The saved optimiser is a plain AdamW state (what a graphed single run saves too), with this run's values.
        assert mine["optimizer"]["param_groups"] == reference["optimizer"]["param_groups"]
        assert [sorted(r) for r in _rows(batch_run)] == [sorted(r) for r in _rows(single_run)]
        assert sorted(json.loads((ours / "eval.json").read_text())) == sorted(
            json.loads((theirs / "eval.json").read_text())
        )
        written = [json.loads((folder / "config.json").read_text()) for folder in (ours, theirs)]
        assert written[0] == {**written[1], "out_dir": batch_run.out_dir}


# -- resuming ----------------------------------------------------------------------------------------------------
class _Killed(Exception):
    pass


def _kill_at(monkeypatch, step: int) -> None:
    """A kill after step ``step`` (its rows logged, its checkpoint saved if due), before the next step."""
    original = TrainRun.learning_rate

    def learning_rate(self, current):
        if current == step:  # 0-based: the step after ``step``
            raise _Killed
        return original(self, current)

    monkeypatch.setattr(TrainRun, "learning_rate", learning_rate)


def test_a_killed_batch_resumes_per_run_and_ends_as_if_never_killed(tmp_path, monkeypatch):
    uninterrupted = [dataclasses.replace(c, steps=12, checkpoint_every=5) for c in _runs(tmp_path, "ngram_ad", "u")]
    killed = [dataclasses.replace(c, steps=12, checkpoint_every=5) for c in _runs(tmp_path, "ngram_ad", "k")]
    expected = train_batched(uninterrupted)
    with monkeypatch.context() as patch:
        _kill_at(patch, 7)  # after the checkpoint of step 5; steps 6 and 7 are logged, then lost
        with pytest.raises(_Killed):
            train_batched(killed)
    assert [row["step"] for row in _training_rows(killed[0])] == list(range(1, 8))
    resumed = train_batched(killed)
    for a, b, summary_a, summary_b in zip(uninterrupted, killed, expected, resumed):
        rows_a, rows_b = _training_rows(a), _training_rows(b)
        assert [row["step"] for row in rows_b] == list(range(1, 13))  # every step logged once
        assert [row["loss"] for row in rows_b] == [row["loss"] for row in rows_a]  # bit for bit
        assert _without_time(summary_b) == _without_time(summary_a)
    # Finished: rerunning trains and evaluates nothing, and adds no row.
    before = [(Path(c.out_dir) / "metrics.jsonl").read_text() for c in killed]
    monkeypatch.setattr(train_module, "evaluate_runs", lambda *a, **k: pytest.fail("evaluated a finished run again"))
    assert [s["final_return"] for s in train_batched(killed)] == [s["final_return"] for s in resumed]
    assert [(Path(c.out_dir) / "metrics.jsonl").read_text() for c in killed] == before


def test_runs_resume_across_single_and_batched_training(tmp_path, monkeypatch):
    """Run 0 killed alone after its checkpoint of step 4, run 1 killed in a batch after the same checkpoint, run
    2 never started: one batch of the three resumes each where it stopped (runs at different steps train as
    consecutive batches) and ends where uninterrupted single runs end."""
    runs = [dataclasses.replace(c, steps=8, checkpoint_every=4) for c in _runs(tmp_path, "ad", "mixed")]
    with monkeypatch.context() as patch:
        original, calls = cuda_graphs.StepRunner.__call__, []

        def killed_alone(self, batch):
            calls.append(batch)
            if len(calls) == 6:
                raise _Killed
            return original(self, batch)

        patch.setattr(cuda_graphs.StepRunner, "__call__", killed_alone)
        with pytest.raises(_Killed):
            train(runs[0])
    with monkeypatch.context() as patch:
        _kill_at(patch, 6)
        with pytest.raises(_Killed):
            train_batched([runs[1]])
    assert [load_checkpoint(Path(c.out_dir) / "checkpoint.pt")["step"] for c in runs[:2]] == [4, 4]
    summaries = train_batched(runs)
    for config, summary in zip(runs, summaries):
        reference = dataclasses.replace(config, out_dir=config.out_dir.replace("mixed", "reference"))
        assert _without_time(summary) == _without_time(train(reference))
        got, want = _training_rows(config), _training_rows(reference)
        assert [r["step"] for r in got] == list(range(1, 9))
        np.testing.assert_allclose([r["loss"] for r in got], [r["loss"] for r in want], rtol=2e-5)


# -- grouping ----------------------------------------------------------------------------------------------------
def test_runs_group_by_model_shape_in_order():
    base = TrainConfig(progress=False)
    draws = draw_assignments([0], 40)[0]
    configs = [dataclasses.replace(base, model=model, out_dir=f"r{i}-{model}", **draw)
               for i, draw in enumerate(draws) for model in ("ad", "ngram_ad")]  # fmt: skip
    batches = group_runs(configs, 3)
    assert sorted(index for batch in batches for index in batch) == list(range(len(configs)))
    shape = ("model", "seq_len", "pre_norm", "qk_norm")
    for batch in batches:
        assert 1 <= len(batch) <= 3 and batch == sorted(batch)
        assert len({tuple(getattr(configs[i], name) for name in shape) for i in batch}) == 1
        check_batch([configs[i] for i in batch])
    # Every shape's runs fill batches of 3 before a new one opens: only each shape's last batch is short.
    by_shape = {}
    for batch in batches:
        by_shape.setdefault(tuple(getattr(configs[batch[0]], name) for name in shape), []).append(len(batch))
    assert all(all(size == 3 for size in sizes[:-1]) for sizes in by_shape.values())
    assert any(len(batch) > 1 for batch in batches)
    # Learning rates, weight decays, dropouts, smoothing and subsampling differ inside a batch; the shape does not.
    mixed = next(batch for batch in batches if len(batch) == 3)
    assert len({configs[i].learning_rate for i in mixed}) == 3


@pytest.mark.parametrize(
    "change, message",
    [({"seq_len": 32}, "must share seq_len"), ({"pre_norm": False}, "must share pre_norm"),
     ({"qk_norm": True}, "must share qk_norm"), ({"d_model": 32}, "must share d_model"),
     ({"ngram_sizes": (1,)}, "must share ngram_sizes"), ({"steps": 7}, "must share steps"),
     ({"model": "ad"}, "must share model"), ({"out_dir": "r0"}, "distinct out_dir")],
)  # fmt: skip
def test_a_batch_must_share_its_shape(change, message):
    first = TrainConfig(out_dir="r0", progress=False)
    with pytest.raises(ValueError, match=message):
        check_batch([first, dataclasses.replace(first, **{"out_dir": "r1", **change})])


@pytest.mark.parametrize(
    "change, message",
    [({"compile": True}, "compile"),
     ({"track": ("tensorboard",)}, "track")],
)  # fmt: skip
def test_runs_that_cannot_batch_say_why_and_group_alone(change, message):
    config = TrainConfig(progress=False)
    for name, value in change.items():  # set after the checks (a tracker's package need not be installed)
        setattr(config, name, value)
    with pytest.raises(ValueError, match=message):
        check_batch([config])
    other = copy.copy(config)
    other.out_dir = "other"
    assert group_runs([config, other], 4) == [[0], [1]]
    with pytest.raises(ValueError, match="configs must hold at least one run"):
        check_batch([])
    with pytest.raises(ValueError, match="batch_runs must be an int >= 1"):
        group_runs([config], 0)


# -- per-run scalars ---------------------------------------------------------------------------------------------
def test_each_run_of_a_batch_keeps_its_own_scalars(tmp_path):
    """Changing one run's learning rate, weight decay, label smoothing or clipping changes that run alone."""
    runs = [dataclasses.replace(c, steps=10) for c in _runs(tmp_path, "ad", "first")]
    train_batched(runs)
    for config in runs:
        lrs = [row["lr"] for row in _training_rows(config)]
        assert lrs == [learning_rate_at(step, config) for step in range(10)]
    changes = {"learning_rate": 2e-2, "weight_decay": 0.5, "label_smoothing": 0.9, "grad_clip": 1e-3}
    for name, value in changes.items():
        changed = [dataclasses.replace(c, out_dir=c.out_dir.replace("first", name)) for c in runs]
        changed[1] = dataclasses.replace(changed[1], **{name: value})
        train_batched(changed)
        for index, (a, b) in enumerate(zip(runs, changed)):
            same = [r["loss"] for r in _training_rows(a)] == [r["loss"] for r in _training_rows(b)]
            assert same == (index != 1), (name, index)


def _torch_optimizers(params, settings, kind):
    """Each run's own optimiser: AdamW with its weight decay on the matrices only (two groups, as icrl-markov's),
    or Adam (icrl-looped's)."""
    optimizers = []
    for run, (lr, decay, betas) in zip(params, settings):
        if kind == "adam":
            optimizers.append(torch.optim.Adam(run, lr=lr, betas=betas))
        else:
            groups = [{"params": [p for p in run if p.dim() >= 2], "weight_decay": decay},
                      {"params": [p for p in run if p.dim() < 2], "weight_decay": 0.0}]  # fmt: skip
            optimizers.append(torch.optim.AdamW(groups, lr=lr, betas=betas))
    return optimizers


@pytest.mark.parametrize("kind", ["adamw-groups", "adam"])
def test_run_adamw_is_each_runs_torch_optimiser(kind):
    """Per-run learning rates, weight decays (on one parameter group only) and betas against each run's own torch
    optimiser, over 30 steps of random gradients, from a state restored mid-way (each run's optimiser state taken
    over by for_runs); each run's exported state is its optimiser's state_dict, which torch loads."""
    g = torch.Generator().manual_seed(0)
    shapes = [(3, 4), (5,), (2, 2)]
    settings = [(1e-2, 0.1, (0.9, 0.99)), (3e-3, 0.0, (0.5, 0.999)), (1e-1, 1e-3, (0.99, 0.9))]
    if kind == "adam":
        settings = [(lr, 0.0, betas) for lr, _, betas in settings]
    params = [[torch.randn(*shape, generator=g, requires_grad=True) for shape in shapes] for _ in settings]
    theirs = _torch_optimizers(params, settings, kind)
    lrs = torch.tensor([s[0] for s in settings], dtype=torch.float64)

    def draw():
        grads = [[torch.randn(*shape, generator=g) for shape in shapes] for _ in settings]
        for run, grad, optimizer in zip(params, grads, theirs):
            for p, x in zip(run, grad):
                p.grad = x
            optimizer.step()
        return flat_rows(grads)

    for _ in range(5):  # the runs' own optimisers first: their state is what a checkpoint restores
        draw()
    flat = torch.nn.Parameter(flat_rows(params))
    ours = RunAdamW.for_runs(flat, params, theirs)
    for _ in range(30):
        flat.grad = draw()
        ours.step(lrs)
    for index, (run, optimizer) in enumerate(zip(params, theirs)):
        torch.testing.assert_close(flat[index], flat_rows([run])[0], rtol=1e-5, atol=1e-6)
        exported = ours.run_state_dict(index, settings[index][0])
        reference = optimizer.state_dict()
        assert exported["param_groups"] == reference["param_groups"]
        for position, state in reference["state"].items():
            for key, value in state.items():
                torch.testing.assert_close(exported["state"][position][key], value, rtol=1e-5, atol=1e-7)
        copies = [p.detach().clone().requires_grad_() for p in run]
        (fresh,) = _torch_optimizers([copies], [settings[index]], kind)
        fresh.load_state_dict(exported)  # a single run resumes from a batched run's optimiser state


def test_per_run_clipping_is_clip_grad_norm_per_run():
    g = torch.Generator().manual_seed(0)
    grads = torch.randn(3, 50, generator=g) * torch.tensor([[0.1], [10.0], [1.0]])
    max_norms = torch.tensor([1.0, 1.0, 0.5])
    clipped = grads.clone()
    norms = clip_run_gradients(clipped, max_norms)
    for index in range(3):
        single = torch.nn.Parameter(torch.zeros(50))
        single.grad = grads[index].clone()
        norm = torch.nn.utils.clip_grad_norm_([single], float(max_norms[index]))
        torch.testing.assert_close(norms[index], norm)
        torch.testing.assert_close(clipped[index], single.grad)


def test_dropout_rates_are_each_runs_own(tmp_path):
    """Run 0 without dropout, runs 1 and 2 with their own rates: the stacked module keeps each run's rate, a
    rate of 0 is the identity in training, and a batch with dropout trains."""
    runs = _runs(tmp_path, "ngram_ad", "dropout", steps=5)
    rates = [(0.0, 0.0), (0.5, 0.1), (0.2, 0.7)]
    runs = [dataclasses.replace(c, embedding_dropout=e, residual_dropout=r) for c, (e, r) in zip(runs, rates)]
    stacked = StackedRuns([run.model for run in _opened(runs)])
    buffers = stacked.buffer_views()
    assert buffers["embedding_dropout.rate"].tolist() == pytest.approx([0.0, 0.5, 0.2])
    assert buffers["blocks.0.dropout.rate"].tolist() == pytest.approx([0.0, 0.1, 0.7])
    x = torch.ones(3, 1000, 8)
    dropped = stacked.train().map(lambda model, row: model.embedding_dropout(row), x)
    assert torch.equal(dropped[0], x[0])
    for index, rate in ((1, 0.5), (2, 0.2)):
        kept = dropped[index] != 0
        assert abs(kept.float().mean().item() - (1 - rate)) < 0.02
        torch.testing.assert_close(dropped[index][kept], torch.full_like(dropped[index][kept], 1 / (1 - rate)))
    assert torch.equal(stacked.eval().map(lambda model, row: model.embedding_dropout(row), x), x)
    assert all(np.isfinite(summary["final_return"]) for summary in train_batched(runs))
    assert RunDropout(0.3).rate.item() == pytest.approx(0.3)


def test_stacked_runs_hold_every_value_in_the_open_and_decode_with_pytree_states(tmp_path):
    """The template is a registered submodule holding no tensor (nothing hidden from ``to()``, ``state_dict()``
    or the guard); decoding states are pytrees of tensors that ``vmap`` takes as they are: one step of all runs
    equals each run's own model stepping its own state."""
    runs = _runs(tmp_path, "ngram_ad", "pytree", steps=1)
    opened = _opened(runs)
    models = [copy.deepcopy(run.model) for run in opened]
    stacked = StackedRuns([run.model for run in opened]).eval()
    assert dict(stacked.named_modules())["call.model"] is stacked.template
    assert list(stacked.template.parameters()) == [] and list(stacked.template.buffers()) == []
    assert set(stacked.state_dict()) == {"flat"} | {n for n in stacked.state_dict() if n.startswith("stacked__")}
    state = stacked.init_decode_state(2, 8)
    leaves, _ = torch.utils._pytree.tree_flatten(state)
    assert leaves and all(isinstance(leaf, torch.Tensor) and leaf.shape[0] == 3 for leaf in leaves)
    singles = [model.eval().init_decode_state(2, 8) for model in models]
    g = torch.Generator().manual_seed(0)
    for _ in range(3):
        inputs = (torch.randint(0, 5, (3, 2), generator=g), torch.randint(-1, 4, (3, 2), generator=g),
                  torch.rand(3, 2, generator=g))  # fmt: skip
        logits, state = stacked.decode_step(state, *inputs)
        for k, (model, single) in enumerate(zip(models, singles)):
            want = model.step(single, *(x[k] for x in inputs))
            torch.testing.assert_close(logits[k], want, rtol=1e-5, atol=1e-6)


# -- one CUDA graph ----------------------------------------------------------------------------------------------
def _opened(configs: list[TrainConfig]) -> list[TrainRun]:
    """The runs of ``configs`` with their folders, data, models and optimisers, as a batch opens them."""
    runs = [TrainRun(config, histories={}) for config in check_batch(configs)]
    lifecycle.open_runs(runs)
    return runs


def _step_inputs(tmp_path, kind: str = "ngram_ad"):
    opened = _opened(_runs(tmp_path, kind, "step", steps=3))
    stacked = StackedRuns([run.model for run in opened])
    optimizer = RunAdamW.for_runs(stacked.flat, [list(run.model.parameters()) for run in opened],
                                  [run.optimizer for run in opened])  # fmt: skip
    norms = torch.tensor([run.config.grad_clip for run in opened])
    batches = []
    for _ in range(3):
        batch = TrainRun.batch_runs(opened, 0)
        batch["label_smoothing"] = torch.tensor([run.config.label_smoothing for run in opened])
        batch["learning_rate"] = torch.tensor([1e-3, 2e-3, 3e-3], dtype=torch.float64)
        batches.append(batch)
    return stacked, optimizer, opened[0].loss, norms, batches


@pytest.mark.parametrize("kind", ["ngram_ad", "ad"])
def test_the_batched_step_reads_no_value_on_host(tmp_path, kind):
    stacked, optimizer, loss, norms, batches = _step_inputs(tmp_path, kind)
    autocast = torch.autocast("cpu", enabled=False)
    with gpu_value_checks(), HostReadDetector() as detector:
        for batch in batches:  # the first step too: a graph's warm-up runs it
            stats = batched_train_step(stacked, optimizer, batch, loss, norms, autocast)
    assert not detector.reads, f"the batched step reads device values on the host: {detector.reads}"
    assert stats.shape == (3, 2) and stats.dtype == torch.float32 and torch.isfinite(stats).all()


def test_the_graphed_runner_trains_a_batch_as_the_eager_one(tmp_path, emulated_cuda_graphs):
    """StepRunner's graphed path (capture emulated on the CPU: static inputs, warm-up with a sync-debug step,
    restore, capture, replay) around the batched step trains exactly as its eager path."""
    autocast = torch.autocast("cpu", enabled=False)
    results = {}
    for graphed in (False, True):
        stacked, optimizer, loss, norms, batches = _step_inputs(tmp_path / str(graphed))
        emulated_cuda_graphs(stacked, optimizer)
        runner = cuda_graphs.StepRunner(
            lambda b, s=stacked, o=optimizer, f=loss, n=norms: batched_train_step(s, o, b, f, n, autocast),
            stacked, optimizer, torch.device("cpu"),
        )  # fmt: skip
        runner.graphed = graphed
        stats = torch.stack([runner(batch) for batch in batches])
        results[graphed] = (stats, stacked.flat.detach().clone())
    torch.testing.assert_close(results[True], results[False], rtol=0, atol=0)


def test_value_checks_inside_vmap_cover_every_run():
    """An action outside its set in one run's rows is an error of the batch (check_values under vmap)."""
    action_set = torch.tensor([[[0, 1, 2]], [[0, 1, 2]]])
    actions = torch.tensor([[[0, 1]], [[2, 7]]])
    batch = {"actions": actions, "prev_actions": actions, "mask": torch.ones_like(actions, dtype=torch.bool),
             "action_set": action_set}  # fmt: skip
    with pytest.raises(ValueError, match="actions must be in their sequence's action set"):
        torch.vmap(lambda rows: local_action_batch(rows)["local_actions"])(batch)
    fine = {**batch, "actions": actions.clamp(max=2), "prev_actions": actions.clamp(max=2)}
    assert torch.vmap(lambda rows: local_action_batch(rows)["local_actions"])(fine).tolist() == [[[0, 1]], [[2, 2]]]


# -- icrl-compare --batch-runs -------------------------------------------------------------------------------------
# Fixed hyperparameters, two seeds and two settings: each model's four runs share a shape (two batches of 2).
TINY_SWEEP = dict(hyperparameters="defaults", num_train_tasks=(10, 20), num_histories=(6,), seeds=(0, 1), steps=3,
                  batch_size=4, d_model=16, num_heads=2, num_layers=1, source_episodes=20, eval_tasks=2,
                  eval_episodes=2, eval_envs_per_task=1, backend="eager", progress=False,
                  scheduler="local")  # fmt: skip


def _scores(result: dict) -> list:
    """Each trial's identity and scores; the scores rounded to 12 digits (fp32 rounding of two paths aside)."""
    return [(t["seed"], t["num_train_tasks"], t["model"], *(None if t[k] is None else round(t[k], 12)
             for k in ("score", "random_score"))) for t in result["trials"]]  # fmt: skip


def test_compare_with_batch_runs_gives_the_sequential_results_and_resumes(tmp_path, monkeypatch, capsys):
    sequential = compare(CompareConfig(out_dir=str(tmp_path / "one"), **TINY_SWEEP))
    config = CompareConfig(out_dir=str(tmp_path / "batched"), batch_runs="2", **TINY_SWEEP)
    seen = []
    original = train_batched
    monkeypatch.setattr("icrl_models.experiments.ngram_ad.train_batched",
                        lambda configs: seen.append(len(configs)) or original(configs))  # fmt: skip
    result = compare(config)
    assert seen == [2, 2, 2, 2] and "8 runs in 4 batches (--batch-runs 2)" in capsys.readouterr().err
    assert _scores(result) == _scores(sequential)
    assert all(t["status"] == "trained" for t in result["trials"])
    # Killed: two runs of one shape lost their results; the rerun trains only those, as one batch, and reads
    # the others back.
    trials = build_trials(config)
    for trial in (trials[0], trials[2]):
        assert trial.model == "ad"
        folder = Path(trial.config.out_dir)
        for name in ("eval.json", "eval.png", "checkpoint.pt", "metrics.jsonl"):
            (folder / name).unlink()
    seen.clear()
    again = compare(config)
    assert seen == [2]
    assert [t["status"] for t in again["trials"]] == ["trained", "reused", "trained"] + ["reused"] * 5
    assert _scores(again) == _scores(sequential)


def test_batch_runs_flag(capsys):
    from icrl_models.experiments.ngram_ad import main

    assert CompareConfig(batch_runs="auto").batch_runs == "auto"
    assert CompareConfig(batch_runs="8").batch_runs == 8
    for bad in ("0", "x", "-2"):
        assert main(["--batch-runs", bad, "--report-only"]) == 2
        err = capsys.readouterr().err.strip()
        assert err.count("\n") == 0 and "batch_runs must be an int >= 1 or 'auto'" in err


@pytest.mark.parametrize(
    "cost, chosen",
    [(lambda k: 1.0 * k, 1), (lambda k: 1.0 + 0.05 * k, 8), (lambda k: 0.05 + 0.95 * k, 1),
     (lambda k: 2.0 + 0.5 * k + (0.6 * k if k > 4 else 0.0), 4)],
    ids=["compute-bound", "overhead-bound", "gain-below-margin", "best-in-the-middle"],
)  # fmt: skip
def test_batch_runs_auto_picks_the_fastest_measured_batch(monkeypatch, cost, chosen):
    """``--batch-runs auto`` times steps of 1, 2, 4, 8 runs (a fake clock: a step of K runs costs ``cost(K)``
    seconds) and picks the K with the most run-steps per second, 1 unless that beats one run alone by 10%."""
    clock = [0.0]
    monkeypatch.setattr(batched.time, "perf_counter", lambda: clock[0])

    def make_step(count):
        def step():
            clock[0] += cost(count)

        return step

    assert batched.auto_batch_runs(make_step, torch.device("cpu"), runs=8) == chosen


def test_batch_runs_auto_probes_icrl_train_runs(capsys):
    """The probe of icrl-compare's runs: real steps of 1 and 2 tiny runs; it says what it measured."""
    config = TrainConfig(device="cpu", d_model=8, num_heads=2, num_layers=1, seq_len=8, batch_size=2,
                         progress=False)  # fmt: skip
    assert train_module.auto_batch_runs(config, runs=2) in (1, 2)
    assert "--batch-runs auto: run-steps per second K=1: " in capsys.readouterr().err
    assert train_module.auto_batch_runs(dataclasses.replace(config, compile=True), runs=4) == 1


# -- GPU -----------------------------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("kind", ["ngram_ad", "ad"])
def test_batched_runs_on_cuda_follow_single_runs_graphed_or_not(tmp_path, kind):
    """On a GPU (bf16 autocast, Triton kernels): a batch trained eagerly, the same batch with its whole step in
    one CUDA graph, and each run trained alone (graphed) log losses and gradient norms that follow each other;
    the batch evaluates and writes every run's files."""
    settings = dict(device="cuda", backend="auto", steps=8, checkpoint_every=4)
    eager = [dataclasses.replace(c, **settings) for c in _runs(tmp_path, kind, "eager")]
    graphed = [dataclasses.replace(c, cuda_graph=True, **settings) for c in _runs(tmp_path, kind, "graphed")]
    alone = [dataclasses.replace(c, cuda_graph=True, **settings) for c in _runs(tmp_path, kind, "alone")]
    summaries = [train_batched(eager), train_batched(graphed), [train(config) for config in alone]]
    assert all(np.isfinite(summary["final_return"]) for batch in summaries for summary in batch)
    for index in range(len(RUN_SCALARS)):
        for name in ("loss", "grad_norm"):
            want = torch.tensor([row[name] for row in _training_rows(alone[index])])
            for runs in (eager, graphed):
                got = torch.tensor([row[name] for row in _training_rows(runs[index])])
                assert_close_rel(got, want, rms_tol=2e-2, name=f"{kind} run {index}: {name}, {runs[0].out_dir}")
        assert (Path(graphed[index].out_dir) / "eval.png").exists()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_batched_step_does_not_synchronise_on_cuda(tmp_path):
    runs = [dataclasses.replace(c, device="cuda", backend="auto") for c in _runs(tmp_path, "ngram_ad", "sync")]
    opened = _opened(runs)
    engine = lifecycle._Stacked(opened)
    first, second = (cuda_graphs.to_device(engine.batch(0, [1e-3] * 3), engine.runs[0].device) for _ in range(2))
    engine.step(first)  # warm-up: compiles, autotunes
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        stats = engine.step(second)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.isfinite(stats).all() and stats.shape == (3, 2)
    assert 0 < train_module.auto_batch_runs(runs[0], runs=8) <= 8


def test_a_diverging_run_stops_its_batch_in_one_line(tmp_path):
    """--nonfinite stop in a batch: each run's steps are watched apart; the batch ends at the first log point
    after run 1 diverges, with one line naming that run and its last good checkpoint (left intact), and no
    non-finite row is written."""
    from icrl_models.nonfinite import TrainingDiverged

    base = _base(tmp_path, "ad", steps=12, checkpoint_every=4, log_every=4)
    good = dataclasses.replace(base, out_dir=str(tmp_path / "good"))
    bad = dataclasses.replace(base, seed=1, learning_rate=1e9, grad_clip=1e12, out_dir=str(tmp_path / "bad"))
    with pytest.raises(TrainingDiverged, match=f"run {bad.out_dir} diverged at step") as failure:
        train_batched([good, bad])
    assert failure.value.checkpoint in (None, str(Path(bad.out_dir) / "checkpoint.pt"))
    for row in _training_rows(good) + _training_rows(bad):
        assert math.isfinite(row["loss"]) and math.isfinite(row["grad_norm"])
    if failure.value.checkpoint is not None:
        payload = load_checkpoint(failure.value.checkpoint)
        assert all(torch.isfinite(v).all() for v in payload["model"].values() if v.is_floating_point())


def test_skipping_non_finite_steps_undoes_only_that_run(tmp_path, monkeypatch, capsys):
    """--nonfinite skip in a batch: a step non-finite for run 1 only (its statistics made NaN at steps 3 and 5)
    is undone for run 1 alone: run 0 trains exactly as it does alone, and the skips are reported for run 1."""
    original = lifecycle.batched_train_step
    calls = []

    def step_with_nan_for_run_1(*args, **kwargs):
        stats = original(*args, **kwargs)
        calls.append(1)
        if len(calls) in (3, 5):
            stats = stats.clone()
            stats[1, 0] = float("nan")
        return stats

    monkeypatch.setattr(lifecycle, "batched_train_step", step_with_nan_for_run_1)
    base = _base(tmp_path, "ad", steps=8, checkpoint_every=4, log_every=4, nonfinite="skip")
    first = dataclasses.replace(base, out_dir=str(tmp_path / "run0"))
    second = dataclasses.replace(base, seed=1, out_dir=str(tmp_path / "run1"))
    train_batched([first, second])
    assert "non-finite step(s), 2 in all (the first at step 3)" in capsys.readouterr().err
    monkeypatch.setattr(lifecycle, "batched_train_step", original)
    alone = dataclasses.replace(first, out_dir=str(tmp_path / "alone"))
    train(alone)
    got = torch.tensor([row["loss"] for row in _training_rows(first)])
    want = torch.tensor([row["loss"] for row in _training_rows(alone)])
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_flat_layout_aligns_every_parameter_and_keeps_the_gaps_zero():
    """Each parameter of every run starts at a multiple of FLAT_ALIGNMENT elements of the flat parameter (so a
    run's weights are aligned for the CPU's matrix products); the gaps between them hold zeros that a training
    step leaves at zero (no gradient reaches them: no norm or update changes)."""
    assert flat_layout([5, 16, 1, 33]) == ([0, 16, 32, 48], 96)
    assert flat_layout([]) == ([], 0)
    models = [
        torch.nn.Sequential(torch.nn.Linear(3, 5), torch.nn.LayerNorm(5), torch.nn.Linear(5, 7)) for _ in range(3)
    ]
    runs = StackedRuns(models)
    offsets, length = flat_layout([p.numel() for p in models[0].parameters()])
    assert runs.flat.shape == (3, length) and length % FLAT_ALIGNMENT == 0
    itemsize = runs.flat.element_size()
    for name, view in runs.parameter_views().items():
        assert (view.data_ptr() - runs.flat.data_ptr()) // itemsize in offsets, name
        assert view.stride(0) == length
    covered = torch.zeros(length, dtype=torch.bool)
    for start, p in zip(offsets, models[0].parameters()):
        covered[start : start + p.numel()] = True
    optimizers = [torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1) for m in models]
    optimizer = RunAdamW.for_runs(runs.flat, [list(m.parameters()) for m in models], optimizers)
    x = torch.randn(3, 4, 3)
    losses = runs.map(lambda model, rows: model(rows).square().mean(), x)
    losses.sum().backward()
    assert torch.count_nonzero(runs.flat.grad[:, ~covered]) == 0
    optimizer.step(torch.full((3,), 1e-2, dtype=torch.float64))
    assert torch.count_nonzero(runs.flat.detach()[:, ~covered]) == 0
