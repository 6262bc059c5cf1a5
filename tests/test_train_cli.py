"""icrl-train as ML users expect it: --threads, --compile (zero graph breaks), --track (TensorBoard / W&B),
idempotent metrics on resume and rerun, and --help without reST markup, doubled defaults or comma lists."""

from __future__ import annotations

import importlib
import json
import sys
import types
from pathlib import Path

import pytest
import tomllib
import torch

import icrl_models.train as train_module
from icrl_models import runtime
from icrl_models.models import ADConfig, ADModel
from icrl_models.models.ad import action_loss
from icrl_models.train import TrainConfig, train

ROOT = Path(__file__).resolve().parents[1]


def _tiny(tmp_path, **overrides) -> TrainConfig:
    settings = dict(
        num_histories=8, source_episodes=8, seq_len=16, d_model=16, num_heads=2, num_layers=1,
        episode_subsample=2, steps=6, batch_size=4, warmup_steps=2, checkpoint_every=3, log_every=1,
        eval_episodes=1, eval_envs_per_task=1, out_dir=str(tmp_path / "run"), progress=False, backend="eager",
    )  # fmt: skip
    settings.update(overrides)
    return TrainConfig(**settings)


def _rows(config: TrainConfig) -> list[dict]:
    return [json.loads(line) for line in (Path(config.out_dir) / "metrics.jsonl").read_text().splitlines()]


def test_rerunning_a_finished_run_adds_no_row_and_does_not_evaluate_again(tmp_path, monkeypatch):
    config = _tiny(tmp_path)
    first = train(config)
    rows = _rows(config)

    def no_evaluation(*args, **kwargs):
        raise AssertionError("a finished run was evaluated again")

    monkeypatch.setattr(train_module, "run_evaluation", no_evaluation)
    assert train(config) == first
    assert _rows(config) == rows
    assert [r["step"] for r in rows if "eval" in r] == [6]


def test_resumed_run_logs_every_step_once(tmp_path, monkeypatch):
    config = _tiny(tmp_path)
    original = train_module.learning_rate_at

    def die_at_step_5(step, cfg):
        if step == 4:  # steps 1-4 logged, the last checkpoint is at step 3
            raise KeyboardInterrupt
        return original(step, cfg)

    monkeypatch.setattr(train_module, "learning_rate_at", die_at_step_5)
    with pytest.raises(KeyboardInterrupt):
        train(config)
    assert [r["step"] for r in _rows(config)] == [1, 2, 3, 4]
    with open(Path(config.out_dir) / "metrics.jsonl", "a") as file:
        file.write('{"step": 5, "lo')  # a row torn by the kill
    monkeypatch.setattr(train_module, "learning_rate_at", original)
    train(config)
    rows = _rows(config)
    assert [r["step"] for r in rows if "loss" in r] == [1, 2, 3, 4, 5, 6]
    assert [r["step"] for r in rows if "eval" in r] == [6]
    assert all(r["steps_per_second"] > 0 for r in rows if "loss" in r)


def test_resolve_threads(monkeypatch):
    assert runtime.resolve_threads(3) == 3
    for cores, expected in ((1, 1), (2, 1), (3, 1), (8, 4), (64, 4)):
        monkeypatch.setattr(runtime, "available_cores", lambda cores=cores: cores)
        assert runtime.resolve_threads(0) == runtime.resolve_threads(None) == expected
    with pytest.raises(ValueError, match="threads must be >= 0"):
        runtime.resolve_threads(-1)
    with pytest.raises(TypeError, match="threads must be an int"):
        runtime.resolve_threads(1.5)
    with pytest.raises(ValueError, match="threads must be an int >= 0"):
        TrainConfig(threads=-2)


def test_training_runs_with_the_threads_asked_for_and_restores_them(tmp_path, monkeypatch):
    seen = []
    monkeypatch.setattr(train_module, "_train", lambda config: seen.append(torch.get_num_threads()) or {})
    before = torch.get_num_threads()
    train(_tiny(tmp_path, threads=1))
    train(_tiny(tmp_path, threads=2))
    assert seen == [1, 2] and torch.get_num_threads() == before


@pytest.mark.parametrize("ngram_sizes", [(), (1, 2)], ids=["ad", "ngram_ad"])
def test_ad_model_compiles_without_graph_breaks(ngram_sizes):
    torch.manual_seed(0)
    model = ADModel(ADConfig(seq_len=12, d_model=16, num_heads=2, num_layers=1, ngram_sizes=ngram_sizes))
    model.eval()  # no dropout: the compiled and the eager gradients must agree exactly
    states, actions = torch.randint(0, 9, (2, 12)), torch.randint(0, 4, (2, 12))
    rewards = torch.rand(2, 12)
    explanation = torch._dynamo.explain(model)(states, actions, rewards)
    assert explanation.graph_break_count == 0, explanation.break_reasons
    # fullgraph=True fails on any break; the eager backend keeps this cheap (no code generation).
    compiled = torch.compile(model, fullgraph=True, backend="eager")
    batch = {"actions": actions, "mask": torch.ones(2, 12, dtype=torch.bool)}
    loss = action_loss(compiled(states, actions, rewards), batch)
    loss.backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    action_loss(model(states, actions, rewards), batch).backward()
    for grad, param in zip(grads, model.parameters()):
        torch.testing.assert_close(grad, param.grad)


def test_compile_flag_compiles_the_training_forward(tmp_path, monkeypatch):
    compiled = []
    original = torch.compile

    def eager_compile(module, **kwargs):
        compiled.append(type(module).__name__)
        return original(module, backend="eager", fullgraph=True)

    monkeypatch.setattr(torch, "compile", eager_compile)
    summary = train(_tiny(tmp_path, compile=True))
    assert compiled == ["ADModel"] and summary["num_tasks"] == 21


class _FakeWriter:
    instances: list = []

    def __init__(self, log_dir):
        self.log_dir, self.scalars, self.closed = log_dir, [], False
        _FakeWriter.instances.append(self)

    def add_text(self, tag, text):
        pass

    def add_scalar(self, name, value, step):
        self.scalars.append((name, value, step))

    def close(self):
        self.closed = True


def test_track_tensorboard_logs_loss_lr_speed_and_eval(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", types.SimpleNamespace(SummaryWriter=_FakeWriter))
    _FakeWriter.instances.clear()
    config = _tiny(tmp_path, track=("tensorboard",))
    train(config)
    (writer,) = _FakeWriter.instances
    assert writer.closed and writer.log_dir == str(Path(config.out_dir) / "tensorboard")
    names = {name for name, _, _ in writer.scalars}
    assert {"train/loss", "train/lr", "train/grad_norm", "train/steps_per_second", "eval/final_return"} <= names
    assert [step for name, _, step in writer.scalars if name == "train/loss"] == [1, 2, 3, 4, 5, 6]


def test_track_wandb_logs_and_finishes(tmp_path, monkeypatch):
    logged, finished, init_kwargs = [], [], {}

    def init(**kwargs):
        init_kwargs.update(kwargs)
        return types.SimpleNamespace(log=lambda values, step: logged.append((step, values)),
                                     finish=lambda: finished.append(True))  # fmt: skip

    monkeypatch.setitem(sys.modules, "wandb", types.SimpleNamespace(init=init))
    train(_tiny(tmp_path, track=("wandb",), wandb_project="p"))
    assert init_kwargs["project"] == "p" and init_kwargs["config"]["d_model"] == 16 and finished == [True]
    assert any("eval/final_return" in values for _, values in logged)


def test_track_without_the_package_is_one_clear_line(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # import raises ImportError
    argv = ["--track", "tensorboard", "--out-dir", str(tmp_path / "run")]
    assert train_module.main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "icrl-train: error: track tensorboard needs the 'tensorboard' package" in err
    assert not (tmp_path / "run").exists()  # refused before anything was written
    with pytest.raises(SystemExit):
        train_module.main(["--track"])  # nargs="+": a tracker must be named
    with pytest.raises(ValueError, match="track must name trackers"):
        TrainConfig(track=("mlflow",))


# -- --help quality --------------------------------------------------------------------------------


def _scripts() -> dict[str, str]:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]


HELP_ARGVS = [(script, ["--help"]) for script in _scripts()] + [
    ("icrl-data", ["generate", "--help"]),
    ("icrl-data", ["export", "--help"]),
    ("icrl-induction", ["phase-change", "--help"]),
    ("icrl-induction", ["ad-report", "--help"]),
]


@pytest.mark.parametrize("script, argv", HELP_ARGVS, ids=[" ".join([s, *a]) for s, a in HELP_ARGVS])
def test_help_is_plain_text_without_doubled_defaults(script, argv, capsys):
    module, _, name = _scripts()[script].partition(":")
    with pytest.raises(SystemExit) as exit_:
        getattr(importlib.import_module(module), name)(argv)
    assert exit_.value.code == 0
    text = capsys.readouterr().out
    for markup in ("``", ":func:", ":class:", ":data:", ":mod:", ":meth:", "::\n"):
        assert markup not in text, f"{script} --help shows reST markup {markup!r}"
    # One option's help (up to the next option) names its default at most once.
    for option_help in text.split("\n  -")[1:]:
        assert option_help.count("(default") <= 1, option_help
    # Lists are list flags (--seeds 0 1 2), not comma strings to split.
    assert "comma-separated" not in text.lower(), f"{script} --help still describes a comma-separated list"


@pytest.mark.parametrize(
    "script, argv, usages",
    [
        ("icrl-markov", ["--help"], ["--tasks TASK [TASK ...]", "--context-lens [K ...]",
                                     "--moa-layers LAYER [LAYER ...]", "--markov-heads [HEAD ...]",
                                     "--key-to-door-layouts KEY:DOOR [KEY:DOOR ...]", "--seeds [SEED ...]"]),
        ("icrl-induction", ["phase-change", "--help"], ["--variants VARIANT [VARIANT ...]"]),
    ],
)  # fmt: skip
def test_experiment_list_flags_in_help(script, argv, usages, capsys):
    module, _, name = _scripts()[script].partition(":")
    with pytest.raises(SystemExit):
        getattr(importlib.import_module(module), name)(argv)
    text = capsys.readouterr().out
    for usage in usages:
        assert usage in text, usage
    if script == "icrl-markov":  # preset-filled fields show each preset's value, not "none"
        seeds = "cpu 0 1 2, paper 0 1 2, memory 0 1 2 3 4, paper-memory 0 1 2 3 4"
        assert f"(default: from --preset, {seeds})" in " ".join(text.split())


def test_list_flags_take_several_values():
    parser = train_module.make_parser("icrl-train", train_module.__doc__)
    train_module.add_config_arguments(parser, TrainConfig)
    for argv, expected in ((["--ngram-sizes", "1", "3"], (1, 3)), (["--ngram-sizes", "1,2"], (1, 2)), ([], (1, 2))):
        config = train_module.config_from_args(TrainConfig, parser.parse_args(argv))
        assert config.ngram_sizes == expected
    assert "--ngram-sizes INT [INT ...]" in parser.format_help()
    assert TrainConfig(ngram_sizes="2,3").ngram_sizes == (2, 3)  # older callers' comma strings
    assert TrainConfig(ngram_sizes=[2]).ngram_sizes == (2,)  # config.json holds lists
    assert TrainConfig(model="ad").ngram_tuple() == ()
    # Checkpoints keep the comma string they always held, so older runs still resume.
    assert train_module.run_identity(TrainConfig())["ngram_sizes"] == "1,2"
