"""``icrl-train --cuda-graph``: every model's whole training step captured in one CUDA graph.

On CPU: each model's step (forward, loss, backward, clipping, capturable AdamW) reads no device value on
the host (the dispatch-mode detector of test_no_host_sync, value checks in their GPU mode), the padded
steps leave the loss without boolean indexing (same values as before), checkpoints of capturable
optimisers load into eager ones and back, and the flag's bad combinations fail in one line. On a GPU
(``gpu`` marker): graphed runs of every model against eager runs of the same seed, and resuming across
the two modes.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from _helpers import HostReadDetector, cpu_backends, gpu_value_checks

import icrl_kernels
import icrl_models.cuda_graphs as cuda_graphs
import icrl_models.lifecycle as lifecycle
from icrl_kernels import ActionMap
from icrl_kernels.testing import assert_close_rel
from icrl_models.cuda_graphs import eager_optimizer_state, prepare_capturable
from icrl_models.data import HistoryWindows, generate_histories
from icrl_models.models.ad import masked_cross_entropy
from icrl_models.train import TrainConfig, _next_batch, train, train_step

MODELS = [("ngram_ad", "dark_room"), ("ad", "dark_room"), ("headless_ad", "bernoulli_bandit")]


def _tiny(tmp_path: Path, model: str, env: str, **overrides) -> TrainConfig:
    settings = dict(
        model=model, env=env, num_histories=8, source_episodes=8, seq_len=16, d_model=16, num_heads=2,
        num_layers=1, episode_subsample=2, steps=6, batch_size=4, warmup_steps=2, checkpoint_every=3, log_every=1,
        eval_episodes=1, eval_envs_per_task=1, out_dir=str(tmp_path / "run"), progress=False,
    )  # fmt: skip
    settings.update(overrides)
    return TrainConfig(**settings)


def _rows(config: TrainConfig) -> list[dict]:
    lines = (Path(config.out_dir) / "metrics.jsonl").read_text().splitlines()
    return [row for row in map(json.loads, lines) if "loss" in row]


# -- CPU: the step can be captured -------------------------------------------------------------------
@pytest.mark.parametrize("backend", cpu_backends())
@pytest.mark.parametrize("model, env", MODELS)
def test_whole_training_step_reads_no_value_on_host(capturable_on_cpu, tmp_path, model, env, backend):
    config = _tiny(tmp_path, model, env, backend=backend, residual_dropout=0.1, label_smoothing=0.1)
    histories = generate_histories(config.generate_config("train", 8, 8), progress=False)
    windows = HistoryWindows(histories, config.seq_len, episode_subsample=config.episode_subsample)
    torch.manual_seed(0)
    net = config.build_model(histories)
    optimizer = torch.optim.AdamW(net.parameters(), torch.tensor(1e-3), weight_decay=1e-4, capturable=True)
    rng = np.random.default_rng(0)
    autocast = torch.autocast("cpu", enabled=False)
    # Drawing the batch (numpy and CPU tensors, plus the action map) is outside the step, as in the loop.
    batches = [_next_batch(windows, rng, config, net, torch.device("cpu")) for _ in range(2)]
    with gpu_value_checks(), HostReadDetector() as detector:
        for batch in batches:  # the first step too: AdamW creates its state there, as a graph's warm-up does
            stats = train_step(net, net, optimizer, batch, config, autocast)
    assert not detector.reads, f"{model}'s training step reads device values on the host: {detector.reads}"
    assert stats.shape == (2,) and stats.dtype == torch.float32 and torch.isfinite(stats).all()


@pytest.mark.parametrize("policy", ["stop", "skip"])
@pytest.mark.parametrize("model, env", MODELS)
def test_watched_training_step_reads_no_value_on_host(capturable_on_cpu, tmp_path, model, env, policy):
    """icrl-train's step watched by the NonFiniteGuard (under "skip" it backs up and conditionally restores the
    whole state every step) stays free of host reads, so the graphed step keeps the guard in the graph."""
    from icrl_models.nonfinite import NonFiniteGuard

    config = _tiny(tmp_path, model, env, backend="eager")
    histories = generate_histories(config.generate_config("train", 8, 8), progress=False)
    windows = HistoryWindows(histories, config.seq_len, episode_subsample=config.episode_subsample)
    torch.manual_seed(0)
    net = config.build_model(histories)
    optimizer = torch.optim.AdamW(net.parameters(), torch.tensor(1e-3), capturable=True)
    guard = NonFiniteGuard(net, optimizer, policy=policy)
    autocast = torch.autocast("cpu", enabled=False)
    step = guard.watch(lambda batch: train_step(net, net, optimizer, batch, config, autocast))
    rng = np.random.default_rng(0)
    batches = [_next_batch(windows, rng, config, net, torch.device("cpu")) for _ in range(3)]
    with gpu_value_checks(), HostReadDetector() as detector:
        for batch in batches:
            step(batch)
    assert not detector.reads, f"the watched {model} step reads device values on the host: {detector.reads}"
    assert guard.check() == 0


@pytest.mark.parametrize("policy", ["stop", "skip"])
def test_graphed_runner_with_a_guard_equals_the_eager_one(
    emulated_cuda_graphs, capturable_on_cpu, monkeypatch, tmp_path, policy
):
    """The guard inside StepRunner's graphed path (capture emulated on the CPU): the capture's warm-up steps
    leave its counters as they were (the extra state restored), and a non-finite step in a replay is
    recorded at the step the eager runner records it, and (skip) undone alike."""
    from icrl_models.nonfinite import NonFiniteGuard, TrainingDiverged

    config = _tiny(tmp_path, "ngram_ad", "dark_room", backend="eager")
    histories = generate_histories(config.generate_config("train", 8, 8), progress=False)
    windows = HistoryWindows(histories, config.seq_len, episode_subsample=config.episode_subsample)
    autocast = torch.autocast("cpu", enabled=False)
    results = {}
    for graphed in (False, True):
        torch.manual_seed(0)
        net = config.build_model(histories)
        optimizer = torch.optim.AdamW(net.parameters(), 1e-2)
        prepare_capturable(optimizer)
        guard = NonFiniteGuard(net, optimizer, policy=policy, step=10, log=lambda line: None)
        emulated_cuda_graphs(net, optimizer, guard.state_tensors())
        runner = cuda_graphs.StepRunner(
            lambda batch, n=net, o=optimizer: train_step(n, n, o, batch, config, autocast), net, optimizer,
            torch.device("cpu"), guard=guard,
        )  # fmt: skip
        runner.graphed = graphed
        rng = np.random.default_rng(0)
        batches = [_next_batch(windows, rng, config, net, torch.device("cpu")) for _ in range(5)]
        batches[3]["prev_rewards"] = batches[3]["prev_rewards"] * float("nan")  # step 14 is not finite
        for batch in batches:
            runner(batch)
        try:
            outcome = guard.check()
        except TrainingDiverged as error:
            outcome = error.step
        results[graphed] = (outcome, int(guard.steps), [p.detach().clone() for p in net.parameters()])
    assert results[True][:2] == results[False][:2] == ((14 if policy == "stop" else 1), 15)
    for got, want in zip(results[True][2], results[False][2]):
        torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)


def _dt_moa(backend: str, gate: str = "softmax", device="cpu"):
    from icrl_models.models.dt_moa import DecisionTransformerMoA, DTMoAConfig

    torch.manual_seed(0)
    sizes = dict(state_sizes=(9, 5), num_actions=4, context_len=6, max_timestep=16, n_layer=2, n_head=3, n_embd=24)
    config = DTMoAConfig(**sizes, n_positions=30, moa_layers=(0, 1), dropout=0.0, backend=backend, gate=gate)
    return DecisionTransformerMoA(config).to(device)


def _dt_batches(count: int, config) -> list[dict]:
    g = torch.Generator().manual_seed(1)
    batches = []
    for _ in range(count):
        mask = torch.ones(4, 6, dtype=torch.bool)
        mask[0, 4:] = False
        batches.append({
            "rtg": torch.rand(4, 6, generator=g), "states": torch.randint(0, config.num_states, (4, 6), generator=g),
            "actions": torch.randint(0, 4, (4, 6), generator=g), "timesteps": torch.randint(0, 16, (4, 6), generator=g),
            "mask": mask,
        })  # fmt: skip
    return batches


def _dt_train_step(model, optimizer, batch, autocast):
    """icrl-markov's training step of one run: the lifecycle's step of the DT-MoA's loss, clipped to norm 1."""
    return lifecycle.train_step(model, optimizer, batch, lambda m, b: m.loss(b), grad_clip=1.0, autocast=autocast)


@pytest.mark.parametrize("backend", cpu_backends())
@pytest.mark.parametrize("gate", ["softmax", "sigmoid", "linear"])
def test_dt_moa_training_step_reads_no_value_on_host(capturable_on_cpu, backend, gate):
    """icrl-markov's step (the DT with MoA, the lifecycle's step): its input range checks were host reads
    (``int(x.max())``)."""

    model = _dt_moa(backend, gate)
    optimizer = torch.optim.AdamW(model.parameters(), torch.tensor(1e-3), capturable=True, foreach=True)
    autocast = torch.autocast("cpu", enabled=False)
    with gpu_value_checks(), HostReadDetector() as detector:
        for batch in _dt_batches(2, model.config):
            stats = _dt_train_step(model, optimizer, batch, autocast)
    assert not detector.reads, f"the DT-MoA training step reads device values on the host: {detector.reads}"
    assert stats.shape == (2,) and torch.isfinite(stats).all()  # loss, gradient norm


@pytest.mark.parametrize("model, env", MODELS)
def test_graphed_runner_equals_eager_runner_with_an_emulated_graph(
    emulated_cuda_graphs, capturable_on_cpu, monkeypatch, tmp_path, model, env
):
    """StepRunner's graphed path (static inputs by name, warm-up on the first batch with a sync-debug step,
    restored, then the capture and the replays) around icrl-train's step trains exactly as its eager path, for
    every model; in synchronous value-check mode too (the tests' default, ``ICRL_VALUE_CHECKS=sync`` for
    users): the checks inside the sync-debug step and the capture must not read the device."""
    assert icrl_kernels.value_checks() == "sync"
    config = _tiny(tmp_path, model, env, backend="eager")
    histories = generate_histories(config.generate_config("train", 8, 8), progress=False)
    windows = HistoryWindows(histories, config.seq_len, episode_subsample=config.episode_subsample)
    autocast = torch.autocast("cpu", enabled=False)
    losses, weights = {}, {}
    for graphed in (False, True):
        torch.manual_seed(0)
        net = config.build_model(histories)
        optimizer = torch.optim.AdamW(net.parameters(), 1e-2)
        prepare_capturable(optimizer)
        graphs = emulated_cuda_graphs(net, optimizer)
        runner = cuda_graphs.StepRunner(
            lambda batch, n=net, o=optimizer: train_step(n, n, o, batch, config, autocast), net, optimizer,
            torch.device("cpu"),
        )  # fmt: skip
        runner.graphed = graphed  # the graphed path, with the capture emulated
        rng = np.random.default_rng(0)
        torch.manual_seed(1)  # the same Headless-AD maps in both runs
        losses[graphed] = torch.stack(
            [runner(_next_batch(windows, rng, config, net, torch.device("cpu"))) for _ in range(4)]
        )
        weights[graphed] = [p.detach().clone() for p in net.parameters()]
        assert graphs.captures == graphed
    torch.testing.assert_close(losses[True], losses[False], rtol=0, atol=0)
    for got, want in zip(weights[True], weights[False]):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.parametrize("backend", cpu_backends())
def test_induction_step_graphed_equals_eager_and_reads_no_value_on_host(
    emulated_cuda_graphs, capturable_on_cpu, backend
):
    """icrl-induction's step (an attention-only model with smeared keys) reads no device value on the host, and
    StepRunner's graphed path (capture emulated, a guard, a learning rate changing every step) trains it exactly
    as the eager path."""
    from icrl_models.cuda_graphs import StepRunner, set_learning_rate
    from icrl_models.experiments.induction_heads import AttentionOnlyTransformer, induction_loss, repeated_segments
    from icrl_models.nonfinite import NonFiniteGuard

    losses, weights = {}, {}
    for graphed in (False, True):
        torch.manual_seed(0)
        model = AttentionOnlyTransformer(16, 12, 16, 2, 2, smear=True, backend=backend)
        optimizer = torch.optim.AdamW(model.parameters(), 1e-2)
        prepare_capturable(optimizer)
        guard = NonFiniteGuard(model, optimizer, policy="stop", log=lambda line: None)
        graphs = emulated_cuda_graphs(model, optimizer, guard.state_tensors())
        runner = StepRunner(
            lambda batch, m=model, o=optimizer: lifecycle.train_step(m, o, batch, lambda m, b: induction_loss(
                m, b["tokens"])), model, optimizer,
            torch.device("cpu"), guard=guard,
        )  # fmt: skip
        runner.graphed = graphed
        generator = torch.Generator().manual_seed(1)
        steps = []
        with gpu_value_checks(), HostReadDetector() as detector:
            for step in range(4):
                set_learning_rate(optimizer, 1e-2 * (step + 1) / 4)
                steps.append(runner({"tokens": repeated_segments(4, 12, 16, 2, 4, generator=generator)}))
        if not graphed:  # the graphed path reads on purpose: its emulation restores the warm-up state
            assert not detector.reads, f"the induction step reads device values on the host: {detector.reads}"
        assert graphs.captures == graphed and guard.check() == 0
        losses[graphed] = torch.stack(steps)
        weights[graphed] = [p.detach().clone() for p in model.parameters()]
    torch.testing.assert_close(losses[True], losses[False], rtol=0, atol=0)
    for got, want in zip(weights[True], weights[False]):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_induction_cuda_graph_flag_off_cuda(tmp_path, capsys):
    """``icrl-induction --cuda-graph`` (the flag alone is "on") on the CPU notes in one line that it is ignored and
    trains as ``--cuda-graph off``; a bad mode names the flag."""
    from icrl_models.experiments.induction_heads import main

    args = ["--variants", "1L-smear", "--steps", "2", "--eval-every", "1", "--vocab-size", "12", "--context-len", "12",
            "--min-period", "3", "--max-period", "5", "--eval-seq-len", "5", "--d-model", "8", "--num-heads", "2",
            "--eval-batch", "2", "--batch-size", "2", "--backend", "eager", "--device", "cpu",
            "--no-progress"]  # fmt: skip
    summaries = {}
    for mode in ("off", None):
        out = tmp_path / str(mode)
        flags = ["--cuda-graph"] if mode is None else ["--cuda-graph", mode]
        assert main([*args, *flags, "--out-dir", str(out)]) == 0
        err = capsys.readouterr().err
        assert ("cuda_graph: ignored on cpu (CUDA only); training eagerly" in err) == (mode is None)
        report = json.loads((out / "induction.json").read_text())
        summaries[mode] = report["results"]["1L-smear"]["curves"]["train_loss"]
    assert summaries[None] == summaries["off"]
    assert main([*args, "--cuda-graph", "yes", "--out-dir", str(tmp_path / "bad")]) == 2
    assert "cuda_graph must be one of" in capsys.readouterr().err
    if not torch.cuda.is_available():  # a device this machine lacks: one line, before any trial starts
        args[args.index("--device") + 1] = "cuda"
        assert main([*args, "--scheduler", "local", "--out-dir", str(tmp_path / "nocuda")]) == 2
        assert capsys.readouterr().err.strip().splitlines()[-1] == (
            "icrl-induction: error: device 'cuda' asked for CUDA, but CUDA is not available on this machine"
        )
        assert not (tmp_path / "nocuda" / "runs").exists()


def _linear_step(model, optimizer, *, read_on_call=None):
    """A tiny training step; with ``read_on_call=k`` its k-th call reads a device value on the host."""
    calls = []

    def step(x):
        calls.append(1)
        optimizer.zero_grad(set_to_none=True)
        loss = torch.nn.functional.dropout(model(x), 0.5).square().mean()
        if read_on_call is not None and len(calls) == read_on_call:
            loss = loss * float(loss.detach())  # a host read
        loss.backward()
        optimizer.step()
        return loss.detach()

    return step, calls


@pytest.mark.parametrize("read_on_call, where", [(3, "sync-debug warm-up step"), (4, "capture")])
def test_a_failed_capture_raises_one_error_and_changes_nothing(
    emulated_cuda_graphs, capturable_on_cpu, monkeypatch, read_on_call, where
):
    """A host read in the step fails the capture with one CaptureError, whether the sync-debug warm-up step
    (the third of three) or the capture itself (the fourth call) meets it; the model, the optimiser state and
    the random generator are as before the attempt; StepRunner does not try again."""
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.AdamW(model.parameters(), 1e-2)
    prepare_capturable(optimizer)
    step, calls = _linear_step(model, optimizer, read_on_call=read_on_call)
    graphs = emulated_cuda_graphs(model, optimizer)
    batch = {"x": torch.randn(4, 3)}
    before = {name: t.clone() for name, t in model.state_dict().items()}
    rng_before = torch.get_rng_state()
    runner = cuda_graphs.StepRunner(lambda batch: step(batch["x"]), model, optimizer, torch.device("cpu"))
    runner.graphed = True
    with pytest.raises(cuda_graphs.CaptureError, match="synchronizing") as failure:
        runner(batch)
    assert "--cuda-graph off" in str(failure.value) and graphs.captures == (where == "capture")
    for name, value in model.state_dict().items():
        assert torch.equal(value, before[name]), f"{name} changed by the failed capture ({where})"
    assert all(torch.count_nonzero(v) == 0 for state in optimizer.state.values() for v in state.values())
    assert torch.equal(torch.get_rng_state(), rng_before)
    attempts = len(calls)
    with pytest.raises(cuda_graphs.CaptureError):
        runner({"x": torch.randn(4, 3)})
    assert len(calls) == attempts, "a failed runner must not capture again"


def test_auto_mode_falls_back_to_eager_steps_when_the_capture_fails(
    emulated_cuda_graphs, capturable_on_cpu, monkeypatch, capsys
):
    """``--cuda-graph auto`` (StepRunner's ``fallback``): a failed capture prints one line and the run goes on
    eagerly from the same state, so it trains exactly as an eager run."""
    results = {}
    for fallback in (None, True):
        torch.manual_seed(0)
        model = torch.nn.Linear(3, 2)
        optimizer = torch.optim.AdamW(model.parameters(), 1e-2)
        prepare_capturable(optimizer)
        step, _ = _linear_step(model, optimizer, read_on_call=3 if fallback else None)
        runner = cuda_graphs.StepRunner(
            lambda batch, step=step: step(batch["x"]), model, optimizer, torch.device("cpu"), fallback=bool(fallback)
        )
        if fallback:
            emulated_cuda_graphs(model, optimizer)
            runner.graphed = True
        torch.manual_seed(1)
        results[fallback] = torch.stack([runner({"x": torch.randn(4, 3)}) for _ in range(4)])
    assert not runner.graphed and "training eagerly (--cuda-graph off skips this)" in capsys.readouterr().err
    torch.testing.assert_close(results[True], results[None], rtol=0, atol=0)


def test_cuda_graph_modes():
    """auto graphs on CUDA unless something excludes it, on insists (or notes that it is ignored off CUDA), off
    never graphs; bools of older configs are on / off; the flag alone means on."""
    from icrl_models.config import add_config_arguments, config_from_args, make_parser
    from icrl_models.cuda_graphs import cuda_graph_mode, use_cuda_graph

    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert use_cuda_graph("auto", cuda) and use_cuda_graph("on", cuda)
    assert not use_cuda_graph("off", cuda) and not use_cuda_graph("auto", cpu)
    assert not use_cuda_graph("auto", cuda, excluded="--compile excludes graphs")
    with pytest.raises(ValueError, match="--compile excludes graphs"):
        use_cuda_graph("on", cuda, excluded="--compile excludes graphs")
    assert (cuda_graph_mode(True), cuda_graph_mode(False)) == ("on", "off")
    with pytest.raises(ValueError, match="cuda_graph must be one of"):
        cuda_graph_mode("yes")
    parser = make_parser("icrl-train", None)
    add_config_arguments(parser, TrainConfig)
    for argv, mode in (([], "auto"), (["--cuda-graph"], "on"), (["--cuda-graph", "off"], "off")):
        assert config_from_args(TrainConfig, parser.parse_args(argv)).cuda_graph == mode
    assert TrainConfig(compile=True).cuda_graph == "auto"  # auto gives way to --compile: no error


def test_capture_needs_two_warm_up_steps(capturable_on_cpu):
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.AdamW(model.parameters(), 1e-2)
    prepare_capturable(optimizer)
    with pytest.raises(ValueError, match="warmup_steps must be an int >= 2"):
        cuda_graphs.capture_train_step(lambda x: x.sum(), model, optimizer, [torch.ones(2)], warmup_steps=1)
    with pytest.raises(ValueError, match="example_inputs must be CUDA tensors"):
        cuda_graphs.capture_train_step(lambda x: x.sum(), model, optimizer, [torch.ones(2)])


def test_capture_warm_up_of_headless_ad_is_undone(capturable_on_cpu, tmp_path):
    """Capturing warms up on real steps and then restores the model and optimiser state; Headless-AD's
    step replaces its action map (a non-persistent buffer) with the graph's input, which the restore must
    survive (it did not while it restored every buffer by position: the map's shape changes)."""
    config = _tiny(tmp_path, "headless_ad", "bernoulli_bandit", backend="eager")
    histories = generate_histories(config.generate_config("train", 8, 8), progress=False)
    windows = HistoryWindows(histories, config.seq_len, episode_subsample=config.episode_subsample)
    torch.manual_seed(0)
    net = config.build_model(histories)
    start = {name: t.clone() for name, t in net.state_dict().items()}
    optimizer = torch.optim.AdamW(net.parameters(), torch.tensor(1e-2), capturable=True)
    rng = np.random.default_rng(0)
    autocast = torch.autocast("cpu", enabled=False)
    saved = cuda_graphs._snapshot(net, optimizer)
    for _ in range(2):
        train_step(net, net, optimizer, _next_batch(windows, rng, config, net, torch.device("cpu")), config, autocast)
    assert net.action_map.embeddings.shape[0] > 0  # the map was replaced
    cuda_graphs._restore(saved, net, optimizer)
    for name, value in net.state_dict().items():
        assert torch.equal(value, start[name]), name
    assert all(torch.count_nonzero(v) == 0 for state in optimizer.state.values() for v in state.values())


def test_detector_sees_boolean_indexing_of_the_loss():
    """The padded-step selection the loss used before (``logits[mask]``) is flagged: the test above can fail."""
    logits, mask = torch.randn(2, 5, 3, requires_grad=True), torch.rand(2, 5) > 0.5
    with HostReadDetector() as detector:
        F.cross_entropy(logits[mask], torch.zeros(int(mask.sum()), dtype=torch.long))
    assert detector.reads


@pytest.mark.parametrize("label_smoothing", [0.0, 0.1])
def test_masked_cross_entropy_equals_the_boolean_indexed_loss(label_smoothing):
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 7, 5, generator=g).requires_grad_()
    targets = torch.randint(0, 5, (3, 7), generator=g)
    mask = torch.rand(3, 7, generator=g) > 0.4
    targets[~mask] = -1  # padding ids that are no class: must not reach the loss
    got = masked_cross_entropy(logits, targets, mask, label_smoothing)
    want = F.cross_entropy(logits[mask], targets[mask], label_smoothing=label_smoothing)
    torch.testing.assert_close(got, want)
    got_grad, want_grad = torch.autograd.grad(got, logits)[0], torch.autograd.grad(want, logits)[0]
    torch.testing.assert_close(got_grad, want_grad)
    assert masked_cross_entropy(logits, targets, torch.zeros_like(mask)).isnan()  # no step: NaN, as before


# -- CPU: checkpoints across the two modes -----------------------------------------------------------
def _adam_steps(model, optimizer, steps: int, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        optimizer.zero_grad(set_to_none=True)
        model(torch.randn(4, 3, generator=g)).square().mean().backward()
        optimizer.step()


def test_capturable_checkpoints_load_into_eager_optimisers_and_back(capturable_on_cpu):
    torch.manual_seed(0)
    reference = torch.nn.Linear(3, 2)
    graphed, eager = torch.nn.Linear(3, 2), torch.nn.Linear(3, 2)
    graphed.load_state_dict(reference.state_dict())
    ref_opt = torch.optim.AdamW(reference.parameters(), 1e-2)
    graphed_opt = torch.optim.AdamW(graphed.parameters(), torch.tensor(1e-2), capturable=True)
    _adam_steps(reference, ref_opt, 3, seed=1)
    _adam_steps(graphed, graphed_opt, 3, seed=1)

    saved = eager_optimizer_state(graphed_opt)
    group = saved["param_groups"][0]
    assert group["capturable"] is False and type(group["lr"]) is float
    assert all(state["step"].device.type == "cpu" for state in saved["state"].values())
    assert graphed_opt.param_groups[0]["capturable"]  # the live optimiser is unchanged

    eager.load_state_dict(graphed.state_dict())
    eager_opt = torch.optim.AdamW(eager.parameters(), 1e-2)
    eager_opt.load_state_dict(saved)
    _adam_steps(eager, eager_opt, 2, seed=2)
    _adam_steps(reference, ref_opt, 2, seed=2)
    for got, want in zip(eager.parameters(), reference.parameters()):
        torch.testing.assert_close(got, want)

    # And back: an eager checkpoint resumed by a graphed run.
    back = torch.optim.AdamW(graphed.parameters(), torch.tensor(1e-2), capturable=True)
    graphed.load_state_dict(eager.state_dict())
    back.load_state_dict(eager_optimizer_state(eager_opt))
    prepare_capturable(back)
    _adam_steps(graphed, back, 2, seed=3)
    _adam_steps(reference, ref_opt, 2, seed=3)
    for got, want in zip(graphed.parameters(), reference.parameters()):
        torch.testing.assert_close(got, want)


# -- CPU: the flag ------------------------------------------------------------------------------------
def test_cuda_graph_with_compile_is_refused_in_one_line():
    with pytest.raises(ValueError, match="cuda_graph and compile exclude each other"):
        TrainConfig(cuda_graph=True, compile=True)


def test_cuda_graph_is_ignored_off_cuda_with_a_note(tmp_path, capsys):
    eager = _tiny(tmp_path / "eager", "ngram_ad", "dark_room", backend="eager", device="cpu")
    flagged = _tiny(tmp_path / "flagged", "ngram_ad", "dark_room", backend="eager", device="cpu", cuda_graph=True)
    train(eager)
    assert "cuda_graph" not in capsys.readouterr().err  # the default, auto: nothing to say off CUDA
    train(flagged)
    assert "cuda_graph: ignored on cpu" in capsys.readouterr().err
    assert [row["loss"] for row in _rows(flagged)] == [row["loss"] for row in _rows(eager)]


def test_cuda_graph_refuses_data_parallel_runs(tmp_path, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setattr("torch.distributed.is_initialized", lambda: True)  # no process group is started
    config = _tiny(tmp_path, "ad", "dark_room", backend="eager", device="cpu", cuda_graph=True)
    with pytest.raises(ValueError, match="cuda_graph does not support data-parallel runs"):
        train(config)


def test_step_runner_runs_eagerly_off_cuda():
    seen = []

    def step(batch):
        seen.append(batch)
        return batch["x"].sum()

    model = torch.nn.Linear(2, 2)
    runner = cuda_graphs.StepRunner(
        step, model, torch.optim.AdamW(model.parameters()), torch.device("cpu"), cuda_graph=True
    )
    assert not runner.graphed
    batch = cuda_graphs.pinned({"x": torch.ones(3)}, torch.device("cpu"))  # pinning only for CUDA
    assert runner(batch) == 3 and seen[-1]["x"].device.type == "cpu"
    assert runner({"x": torch.ones(5)}) == 5  # eager steps take any shape


def test_headless_loss_with_a_given_map_equals_drawing_it(tmp_path):
    config = _tiny(tmp_path, "headless_ad", "bernoulli_bandit", backend="eager")
    histories = generate_histories(config.generate_config("train", 8, 8), progress=False)
    windows = HistoryWindows(histories, config.seq_len, episode_subsample=config.episode_subsample)
    torch.manual_seed(0)
    net = config.build_model(histories)
    from icrl_models.data import local_action_batch

    batch = local_action_batch(windows.get_batch(np.arange(4)))
    arms = batch["available"].shape[1]
    drawn = net.loss(batch, generator=torch.Generator().manual_seed(5))
    given = net.loss(batch, action_map=net.draw_action_map(arms, generator=torch.Generator().manual_seed(5)))
    torch.testing.assert_close(given, drawn)
    with pytest.raises(ValueError, match=r"embeddings must be \[A, 64\]"):
        net.loss(batch, action_map=torch.zeros(arms, 3))


def test_action_map_set_map_checks_its_argument():
    action_map = ActionMap(4, 8)
    embeddings = torch.randn(5, 8)
    assert action_map.set_map(embeddings) is embeddings and action_map.num_actions == 5
    assert action_map.embeddings is embeddings
    with pytest.raises(TypeError, match="embeddings"):
        action_map.set_map(torch.zeros(5, 8, dtype=torch.long))
    with pytest.raises(ValueError, match="embeddings must be"):
        action_map.set_map(torch.zeros(8))
    with pytest.raises(ValueError, match="embeddings must be"):
        action_map.set_map(torch.zeros(0, 8))


# -- GPU ---------------------------------------------------------------------------------------------
def _killed_then_resumed(config: TrainConfig, resumed: TrainConfig, monkeypatch) -> list[dict]:
    """Train ``config`` until step 5 (its last checkpoint at step 4), then resume it as ``resumed``."""
    import icrl_models.train as train_module

    original = train_module.learning_rate_at

    def die_at_step_6(step, cfg):
        if step == 5:
            raise KeyboardInterrupt
        return original(step, cfg)

    monkeypatch.setattr(train_module, "learning_rate_at", die_at_step_6)
    with pytest.raises(KeyboardInterrupt):
        train(config)
    monkeypatch.setattr(train_module, "learning_rate_at", original)
    train(resumed)
    return _rows(resumed)


def test_resuming_across_the_flag_on_cpu(tmp_path, monkeypatch):
    """The kill-and-resume of the GPU test below, on the CPU (where the flag is ignored): its plumbing."""
    config = _tiny(tmp_path, "ad", "dark_room", backend="eager", steps=8, checkpoint_every=4)
    rows = _killed_then_resumed(config, TrainConfig(**{**config.__dict__, "cuda_graph": True}), monkeypatch)
    assert [row["step"] for row in rows] == list(range(1, 9))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("model, env", MODELS)
def test_graphed_training_matches_eager_training(tmp_path, monkeypatch, model, env):
    """Same seed, same batches, no dropout: the graphed run's logged losses and gradient norms follow the
    eager run's (bf16 autocast, Triton kernels), and its checkpoint resumes eagerly."""
    settings = dict(device="cuda", backend="auto", steps=8, checkpoint_every=4)
    eager = _tiny(tmp_path / "eager", model, env, **settings)
    graphed = _tiny(tmp_path / "graphed", model, env, cuda_graph=True, **settings)
    train(eager)
    train(graphed)
    for name in ("loss", "grad_norm"):
        got = torch.tensor([row[name] for row in _rows(graphed)])
        want = torch.tensor([row[name] for row in _rows(eager)])
        assert_close_rel(got, want, rms_tol=2e-2, name=f"{model}: {name} per step, graphed against eager")
    # A graphed run's checkpoint resumes in an eager run, and an eager one's in a graphed run; each resumed
    # run's losses follow the uninterrupted run's.
    for source, resume_graphed in ((graphed, False), (eager, True)):
        interrupted = TrainConfig(**{**source.__dict__, "out_dir": str(tmp_path / f"resumed-{resume_graphed}")})
        resumed = TrainConfig(**{**interrupted.__dict__, "cuda_graph": resume_graphed})
        rows = _killed_then_resumed(interrupted, resumed, monkeypatch)
        assert [row["step"] for row in rows] == list(range(1, 9))
        got = torch.tensor([row["loss"] for row in rows])
        want = torch.tensor([row["loss"] for row in _rows(source)])
        assert_close_rel(
            got, want, rms_tol=2e-2, name=f"{model}: losses of the run resumed with cuda_graph={resume_graphed}"
        )


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("gate", ["softmax", "linear"])
def test_graphed_dt_moa_steps_match_eager(gate):
    """icrl-markov --cuda-graph: the DT-MoA step replayed from a graph follows the eager step (bf16 autocast)."""

    autocast = torch.autocast("cuda", dtype=torch.bfloat16)
    losses = {}
    for graphed in (False, True):
        model = _dt_moa("auto", gate, device="cuda")
        optimizer = torch.optim.AdamW(model.parameters(), 1e-3)
        prepare_capturable(optimizer)
        runner = cuda_graphs.StepRunner(
            lambda batch, m=model, o=optimizer: _dt_train_step(m, o, batch, autocast), model, optimizer,
            torch.device("cuda"), cuda_graph=graphed,
        )  # fmt: skip
        batches = [cuda_graphs.pinned(b, torch.device("cuda")) for b in _dt_batches(6, model.config)]
        losses[graphed] = torch.stack([runner(batch) for batch in batches]).float().cpu()
        assert runner.graphed == graphed
    assert_close_rel(losses[True], losses[False], rms_tol=2e-2, name=f"DT-MoA ({gate}) losses, graphed against eager")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_graphed_induction_training_matches_eager(tmp_path):
    """icrl-induction on CUDA: the variants trained with each step replayed from a graph (Triton smeared keys)
    follow the eagerly trained ones, loss curve and final induction score."""
    from icrl_models.experiments.induction_heads import InductionConfig, run_experiment

    reports = {}
    for mode in ("off", "on"):
        config = InductionConfig(
            variants=("1L-smear", "2L"), vocab_size=16, context_len=16, min_period=3, max_period=6, d_model=16,
            num_heads=2, steps=12, batch_size=8, warmup_steps=2, eval_every=4, eval_batch=8, eval_seq_len=6,
            device="cuda", cuda_graph=mode, out_dir=str(tmp_path / mode), progress=False,
        )  # fmt: skip
        reports[mode] = run_experiment(config)
    for variant in ("1L-smear", "2L"):
        got, want = (reports[mode]["results"][variant] for mode in ("on", "off"))
        assert_close_rel(
            torch.tensor(got["curves"]["train_loss"][1:]), torch.tensor(want["curves"]["train_loss"][1:]),
            rms_tol=1e-3, name=f"induction {variant}: training loss, graphed against eager",
        )  # fmt: skip
        assert got["final"]["best_induction"]["score"] == pytest.approx(
            want["final"]["best_induction"]["score"], abs=1e-4
        )


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("model, env", MODELS)
def test_eager_training_step_does_not_synchronise(tmp_path, model, env):
    """The eager step on a GPU (default AdamW, bf16 autocast, Triton kernels) under torch's sync-debug mode:
    what the CPU detector above checks, on the device (the batch and Headless-AD's map are drawn before)."""
    device = torch.device("cuda")
    config = _tiny(tmp_path, model, env, device="cuda", backend="auto")
    histories = generate_histories(config.generate_config("train", 8, 8), progress=False)
    windows = HistoryWindows(histories, config.seq_len, episode_subsample=config.episode_subsample)
    torch.manual_seed(0)
    net = config.build_model(histories).to(device)
    optimizer = torch.optim.AdamW(net.parameters(), 1e-3)
    autocast = torch.autocast("cuda", dtype=torch.bfloat16)
    rng = np.random.default_rng(0)
    first, second = (cuda_graphs.to_device(_next_batch(windows, rng, config, net, device), device) for _ in range(2))
    train_step(net, net, optimizer, first, config, autocast)  # warm-up: compiles, autotunes, AdamW's state
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        stats = train_step(net, net, optimizer, second, config, autocast)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.isfinite(stats).all()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_synchronous_value_checks_do_not_break_a_capture():
    """With ``ICRL_VALUE_CHECKS=sync`` a value check inside a user's own CUDA graph capture queues its device
    assert instead of reading the device (which would invalidate the capture), and the graph replays it."""
    previous = icrl_kernels.set_value_checks("sync")
    try:
        targets = torch.randint(0, 5, (8,), device="cuda")
        embeddings = icrl_kernels.orthonormal_embeddings(5, 16, device="cuda")
        pred = torch.randn(8, 16, device="cuda")
        icrl_kernels.infonce_loss(pred, embeddings, targets)  # warm-up: compiles outside the capture
        icrl_kernels.select_actions(pred, embeddings, mode="argmax")
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            loss = icrl_kernels.infonce_loss(pred, embeddings, targets)
            actions = icrl_kernels.select_actions(pred, embeddings, mode="argmax")
        graph.replay()
        torch.testing.assert_close(loss, icrl_kernels.infonce_loss(pred, embeddings, targets))
        torch.testing.assert_close(actions, (pred @ embeddings.T).argmax(-1))
    finally:
        icrl_kernels.set_value_checks(previous)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_failed_capture_leaves_cuda_usable():
    """A step that reads the device on the host fails at the sync-debug warm-up step with CaptureError; the
    model and the default CUDA generator are as before, random draws outside graphs still work, and a good step
    captures afterwards (a failed capture used to leave the generator marked as capturing: "Offset increment
    outside graph capture encountered unexpectedly" at the next random op)."""
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2).cuda()
    optimizer = torch.optim.AdamW(model.parameters(), 1e-2)
    prepare_capturable(optimizer)
    before = [p.detach().clone() for p in model.parameters()]
    rng_before = torch.cuda.get_rng_state()
    bad, _ = _linear_step(model, optimizer, read_on_call=3)
    with pytest.raises(cuda_graphs.CaptureError, match="synchroniz"):
        cuda_graphs.capture_train_step(bad, model, optimizer, [torch.randn(4, 3, device="cuda")])
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before))
    assert torch.equal(torch.cuda.get_rng_state(), rng_before)
    torch.rand(5, device="cuda")
    torch.nn.functional.dropout(torch.ones(5, device="cuda"), 0.5)
    good, _ = _linear_step(model, optimizer)
    graphed = cuda_graphs.capture_train_step(good, model, optimizer, [torch.randn(4, 3, device="cuda")])
    assert torch.isfinite(graphed(torch.randn(4, 3, device="cuda"))).all()
    torch.rand(5, device="cuda")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_non_default_generator_is_registered_with_the_graph():
    """A step that draws from its own CUDA generator: each replay draws fresh numbers, the same sequence as
    eager steps with an identically seeded generator."""
    results = {}
    for graphed in (False, True):
        torch.manual_seed(0)
        model = torch.nn.Linear(3, 2).cuda()
        optimizer = torch.optim.AdamW(model.parameters(), 1e-2)
        prepare_capturable(optimizer)
        noise = torch.Generator(device="cuda").manual_seed(7)

        def step(x, model=model, optimizer=optimizer, noise=noise):
            optimizer.zero_grad(set_to_none=True)
            jitter = torch.randn(x.shape, device=x.device, generator=noise)
            loss = model(x + jitter).square().mean()
            loss.backward()
            optimizer.step()
            return loss.detach()

        x = torch.randn(4, 3, device="cuda", generator=torch.Generator(device="cuda").manual_seed(1))
        if graphed:
            run = cuda_graphs.capture_train_step(step, model, optimizer, [x], generators=[noise])
            results[graphed] = torch.stack([run(x) for _ in range(4)])
        else:
            # The capture's warm-up draws 3 steps' noise (then restores the model, not the generator).
            for _ in range(3):
                torch.randn(x.shape, device="cuda", generator=noise)
            results[graphed] = torch.stack([step(x) for _ in range(4)])
    assert len(set(results[True].tolist())) == 4, "replays must draw fresh noise"
    torch.testing.assert_close(results[True], results[False])
