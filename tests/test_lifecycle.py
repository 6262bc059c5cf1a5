"""The run lifecycle (:mod:`icrl_models.lifecycle`) of every trainer: validated resume, per-run resume inside a
batch, and batched runs of every family equal to the same runs trained alone.

* Resume: for each trainer (icrl-train, icrl-markov, icrl-induction, icrl-looped), a truncated, foreign or
  malformed checkpoint (a model, optimiser or random state that does not fit) is a ``CheckpointError`` naming the
  file and what is wrong, never a ``KeyError``.
* Batched runs (``--batch-runs``) of DT-MoA / Markov, the looped transformer and induction heads: each run's losses,
  readings and results equal its single run's to fp32 rounding (dropout off: a batch shares one dropout stream);
  AD / N-Gram AD and Headless-AD are in ``test_batched_runs.py``. A batch killed mid-way resumes per run.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch

import icrl_models.lifecycle as lifecycle
from icrl_models.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from icrl_models.experiments import induction_heads, looped, markov_heads
from icrl_models.train import TrainConfig, TrainRun

# -- tiny runs of every trainer ---------------------------------------------------------------------------------------
MARKOV = ["--steps", "4", "--eval-every", "2", "--num-histories", "4", "--episodes-per-history", "3",
          "--analysis-windows", "8", "--eval-envs", "4", "--n-layer", "1", "--n-head", "2", "--n-embd", "16",
          "--markov-heads", "0", "--corridor-lengths", "2", "--context-lens", "3", "--tasks", "cue_hidden",
          "--dropout", "0", "--backend", "eager", "--no-progress", "--scheduler", "local",
          "--device", "cpu"]  # fmt: skip
INDUCTION = ["--variants", "1L-smear", "2L", "--steps", "4", "--eval-every", "2", "--vocab-size", "12",
             "--context-len", "16", "--min-period", "3", "--max-period", "6", "--eval-seq-len", "6", "--eval-batch",
             "4", "--d-model", "16", "--batch-size", "4", "--no-progress", "--scheduler", "local"]  # fmt: skip
LOOPED = ["--batch-size", "8", "--n-dims", "3", "--n-points", "5", "--d-model", "16", "--n-heads", "2",
          "--unlooped-layers", "2", "--loops-start", "2", "--loops-end", "3", "--loops-interval", "3", "--grad-loops",
          "2", "--dims-start", "2", "--points-start", "3", "--curriculum-interval", "3", "--eval-prompts", "16",
          "--eval-loop-factor", "2", "--eval-every", "2", "--checkpoint-every", "3", "--backend", "eager",
          "--steps", "7", "--scheduler", "local"]  # fmt: skip


def _train_run(tmp_path: Path) -> TrainRun:
    config = TrainConfig(num_histories=6, source_episodes=6, seq_len=12, d_model=16, num_heads=2, num_layers=1,
                         steps=3, batch_size=2, checkpoint_every=3, eval_episodes=1, eval_envs_per_task=1, eval_tasks=2,
                         out_dir=str(tmp_path / "train"), progress=False)  # fmt: skip
    return TrainRun(config)


def _markov_run(tmp_path: Path) -> markov_heads.MarkovRun:
    config = markov_heads.config_from_args(markov_heads.MarkovConfig, markov_heads.build_parser().parse_args(
        [*MARKOV, "--seeds", "0", "--out-dir", str(tmp_path / "markov")]))  # fmt: skip
    return markov_heads.MarkovTrial(config, 0, "cue_hidden", 2, 3).run(quiet=True)


def _induction_run(tmp_path: Path) -> induction_heads.InductionRun:
    config = induction_heads.InductionConfig(variants=("2L",), vocab_size=12, context_len=16, min_period=3,
                                             max_period=6, eval_seq_len=6, eval_batch=4, d_model=16, batch_size=4,
                                             steps=4, eval_every=2, progress=False,
                                             out_dir=str(tmp_path / "induction"))  # fmt: skip
    return induction_heads.InductionTrial(config, "2L", 2, False, 0).run(quiet=True)


def _looped_run(tmp_path: Path) -> looped.LoopedRun:
    config = looped.LoopedExperimentConfig(n_dims=3, n_points=5, d_model=16, n_heads=2, steps=3, batch_size=4,
                                           loops_start=2, loops_end=2, grad_loops=1, dims_start=3, points_start=5,
                                           eval_prompts=8, eval_every=3, checkpoint_every=3, backend="eager",
                                           out_dir=str(tmp_path / "looped"))  # fmt: skip
    return looped.LoopedRun(config, True)


TRAINERS = {"icrl-train": _train_run, "icrl-markov": _markov_run, "icrl-induction": _induction_run,
            "icrl-looped": _looped_run}  # fmt: skip
#: Per trainer: the checkpoint field of its own random stream, and a value that is no such state.
OWN_STREAM = {"icrl-train": (("rng", "numpy"), [{"bit_generator": "nonsense"}]),
              "icrl-markov": (("rng", "numpy"), [{"bit_generator": "nonsense"}]),
              "icrl-induction": (("rng", "data"), torch.zeros(3, dtype=torch.uint8)),
              "icrl-looped": (("rng", "prompts"), torch.zeros(3, dtype=torch.uint8))}  # fmt: skip


def _rewrite(path: Path, change) -> None:
    payload = load_checkpoint(path)
    change(payload)
    save_checkpoint(payload, path)  # a valid file (checksum and all): only the content is wrong


def _set(keys, value):
    def change(payload):
        target = payload
        for key in keys[:-1]:
            target = target[key]
        target[keys[-1]] = value

    return change


def _malformed(trainer: str) -> dict:
    """Named changes of a checkpoint and the message each must give."""
    keys, bad_state = OWN_STREAM[trainer]
    field = "".join(f"[{key!r}]" for key in keys)
    return {
        "foreign": (lambda p: p["config"].update({key: "another" for key in list(p["config"])[:1]}),
                    "belongs to another run configuration"),
        "model-missing-a-tensor": (lambda p: p["model"].pop(next(iter(p["model"]))), "field 'model' does not fit"),
        "model-wrong-shape": (lambda p: p["model"].update({name: value[..., :1] for name, value in
                                                          list(p["model"].items())[:1]}), "field 'model' does not fit"),
        "optimizer-groups": (_set(("optimizer", "param_groups"), []), "field 'optimizer' does not fit"),
        "optimizer-state": (lambda p: p["optimizer"]["state"].update({0: {"step": "x"}}), "field 'optimizer'"),
        "own-stream": (_set(keys, bad_state), f"field {re_escape(field)}"),
        "torch-stream-missing": (lambda p: p["rng"].pop("torch"), r"field \['rng'\]\['torch'\] is missing"),
        "rng-not-a-dict": (_set(("rng",), [1, 2]), "field 'rng' must be a dict"),
        "step-past-the-end": (_set(("step",), 10_000), "past the run's"),
    }  # fmt: skip


def re_escape(text: str) -> str:
    import re

    return re.escape(text)


@pytest.mark.parametrize("trainer", list(TRAINERS))
def test_a_truncated_foreign_or_malformed_checkpoint_is_a_checkpoint_error(tmp_path, trainer):
    """Every trainer resumes through the lifecycle: each broken checkpoint is one CheckpointError naming the file
    and the field, before any step; a whole checkpoint resumes."""
    make = TRAINERS[trainer]
    lifecycle.train_runs([make(tmp_path)])
    path = make(tmp_path).folder.checkpoint
    good = path.read_bytes()
    assert lifecycle.open_runs([make(tmp_path)]) is not None  # the checkpoint as written resumes
    path.write_bytes(good[: len(good) // 2])
    with pytest.raises(CheckpointError, match="truncated or corrupt"):
        lifecycle.open_runs([make(tmp_path)])
    for name, (change, message) in _malformed(trainer).items():
        path.write_bytes(good)
        _rewrite(path, change)
        with pytest.raises(CheckpointError, match=message) as error:
            lifecycle.open_runs([make(tmp_path)])
        assert str(path) in str(error.value), name


# -- batched runs of every family equal the same runs alone -------------------------------------------------------
def _both(main, argv: list[str], out: Path, batch_runs: str = "3") -> None:
    assert main([*argv, "--out-dir", str(out / "alone")]) == 0
    assert main([*argv, "--out-dir", str(out / "batched"), "--batch-runs", batch_runs]) == 0


def _close(got, want, rtol: float = 1e-5) -> None:
    np.testing.assert_allclose(np.asarray(got, dtype=float), np.asarray(want, dtype=float), rtol=rtol, atol=1e-6)


def test_markov_runs_in_a_batch_equal_the_runs_alone(tmp_path, capsys):
    """DT-MoA / Markov: three seeds of one task and k as one batch (one backbone and dataset per seed) give each
    run's curve of losses and G_Markov readings, its held-out loss and its returns."""
    _both(markov_heads.main, [*MARKOV, "--seeds", "0", "1", "2"], tmp_path)
    assert "3 runs in 1 batches (--batch-runs 3)" in capsys.readouterr().err
    alone, batched = (json.loads((tmp_path / kind / "markov-memory.json").read_text())["results"]
                      for kind in ("alone", "batched"))  # fmt: skip
    assert [r["seed"] for r in batched] == [0, 1, 2]
    for a, b in zip(alone, batched):
        assert a["curve"]["step"] == b["curve"]["step"] == [0, 2, 4]
        _close(b["curve"]["loss"][1:], a["curve"]["loss"][1:])
        _close([g["0"] for g in b["curve"]["g_markov"]], [g["0"] for g in a["curve"]["g_markov"]])
        _close(b["held_out_loss"], a["held_out_loss"])
        assert b["returns"] == a["returns"] and b["markov_after"]["markov_heads"] == a["markov_after"]["markov_heads"]


def test_induction_runs_in_a_batch_equal_the_runs_alone(tmp_path):
    """Induction heads: each variant's three seeds as one batch give each seed's curves and final scores."""
    _both(induction_heads.main, [*INDUCTION, "--seeds", "0", "1", "2"], tmp_path)
    alone, batched = (json.loads((tmp_path / kind / "induction.json").read_text())["per_seed"]
                      for kind in ("alone", "batched"))  # fmt: skip
    for seed in ("0", "1", "2"):
        for variant in ("1L-smear", "2L"):
            a, b = alone[seed]["results"][variant], batched[seed]["results"][variant]
            for curve in ("train_loss", "repeat_loss", "best_induction"):
                _close(b["curves"][curve][1:], a["curves"][curve][1:])
            _close(b["final"]["icl_score"], a["final"]["icl_score"])


def test_looped_runs_in_a_batch_equal_the_runs_alone(tmp_path):
    """The looped transformer (and its unlooped baseline): three seeds per model as one batch, through the loop and
    prompt curricula (a new shape at each stage), give each seed's per-step losses and errors."""
    _both(looped.main, [*LOOPED, "--seeds", "0", "1", "2"], tmp_path)
    for seed in (0, 1, 2):
        a, b = (json.loads((tmp_path / kind / f"seed{seed}" / "looped.json").read_text())
                for kind in ("alone", "batched"))  # fmt: skip
        for model in ("looped", "unlooped"):
            assert len(b["training"][model]["loss"]) == 7
            _close(b["training"][model]["loss"], a["training"][model]["loss"])
        _close(list(b["evaluation"]["error_at_k"].values()), list(a["evaluation"]["error_at_k"].values()), rtol=1e-4)


class _Killed(Exception):
    pass


def test_a_killed_batch_resumes_per_run(tmp_path, monkeypatch):
    """Induction runs killed in a batch after their checkpoint of step 2 (rows of step 3 lost): the rerun resumes
    every run from its own checkpoint, logs each step once and ends where the uninterrupted batch ends."""
    argv = [*INDUCTION, "--variants", "2L", "--seeds", "0", "1", "--batch-runs", "2", "--steps", "6"]
    assert induction_heads.main([*argv, "--out-dir", str(tmp_path / "straight")]) == 0
    original = induction_heads.InductionRun.learning_rate

    def killed(self, step):
        if step == 3:  # 0-based: steps 1-3 done, the checkpoint of step 2 written
            raise _Killed
        return original(self, step)

    with monkeypatch.context() as patch:
        patch.setattr(induction_heads.InductionRun, "learning_rate", killed)
        with pytest.raises(_Killed):
            induction_heads.main([*argv, "--out-dir", str(tmp_path / "killed")])
    for seed in (0, 1):
        folder = tmp_path / "killed" / f"seed{seed}" / "runs" / "2L"
        assert load_checkpoint(folder / "checkpoint.pt")["step"] == 2
    assert induction_heads.main([*argv, "--out-dir", str(tmp_path / "killed")]) == 0
    for seed in (0, 1):
        rows = lifecycle.read_metrics(tmp_path / "killed" / f"seed{seed}" / "runs" / "2L" / "metrics.jsonl")
        assert [r["step"] for r in rows if "loss" in r] == [2, 4, 6]  # each log point once
        straight, resumed = (json.loads((tmp_path / kind / f"seed{seed}" / "induction.json").read_text())
                             for kind in ("straight", "killed"))  # fmt: skip
        assert resumed["results"]["2L"]["curves"] == straight["results"]["2L"]["curves"]


def test_headless_experiment_trains_its_seeds_as_batches(tmp_path, monkeypatch):
    """icrl-headless --batch-runs 2: each model's two training seeds train as one batch (Headless-AD with its
    per-run action maps, AD), and the experiment then evaluates the finished runs."""
    import icrl_models.experiments.headless_ad as experiments

    for name, value in (("num_histories", 16), ("seq_len", 30), ("episode_length", 30)):
        monkeypatch.setitem(experiments._BANDIT_BASE, name, value)
    sets = [s for s in experiments.EVAL_SETS["bernoulli"] if s[0] == "uniform, 4-20 arms"]
    monkeypatch.setitem(experiments.EVAL_SETS, "bernoulli", sets)
    seen = []
    original = experiments.train_batched
    monkeypatch.setattr(experiments, "train_batched", lambda configs: seen.append(
        sorted({c.model for c in configs})) or original(configs))  # fmt: skip
    argv = ["--experiment", "bernoulli", "--steps", "2", "--eval-tasks", "4", "--out-dir", str(tmp_path),
            "--no-progress", "--training-seeds", "0", "1", "--select-temperatures", "1", "--selection-seeds", "5",
            "--report-seeds", "6", "--batch-runs", "2"]  # fmt: skip
    assert experiments.main(argv) == 0
    assert seen == [["headless_ad"], ["ad"]]
    results = json.loads((tmp_path / "headless.json").read_text())
    assert set(results["models"]) == {"headless_ad", "ad"}
    for seed in (0, 1):
        assert load_checkpoint(tmp_path / f"seed{seed}" / "headless_ad" / "checkpoint.pt")["step"] == 2
    assert dataclasses.is_dataclass(experiments.HeadlessExperimentConfig(batch_runs="auto"))


@pytest.mark.parametrize("environment, expected", [({}, True), ({"MALLOC_TRIM_THRESHOLD_": "0"}, False)])
def test_cpu_training_keeps_freed_memory_unless_glibc_is_told_otherwise(environment, expected):
    """``retain_freed_memory`` sets glibc's thresholds once per process (a fresh process here: it is cached), and
    leaves them alone where the user set glibc's own variables."""
    import platform
    import subprocess
    import sys

    if platform.libc_ver()[0] != "glibc":
        pytest.skip("glibc only")
    code = "from icrl_models.runtime import retain_freed_memory as r; print(r(), r())"
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")} | environment
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.split() == [str(expected)] * 2
