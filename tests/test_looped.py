"""LoopedBlock (truncated looping, memory, CUDA graphs), the looped model, function classes and baselines."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F

from icrl_kernels import LoopedBlock
from icrl_kernels.testing import assert_close_rel
from icrl_models.experiments.looped import main as looped_main
from icrl_models.function_classes import (
    Curriculum,
    FunctionClassConfig,
    averaging_predictions,
    baseline_predictions,
    least_squares_predictions,
    nearest_neighbours_predictions,
    normalized_squared_error,
    sample_prompts,
)
from icrl_models.models.looped import LoopedConfig, LoopedTransformer, interleave_prompt


def plain_step(block: LoopedBlock, y: torch.Tensor | None, prompt: torch.Tensor) -> torch.Tensor:
    """One loop with unfused PyTorch ops: the spec LoopedBlock.step must match."""
    hidden = prompt + block.wpe.weight[: prompt.shape[1]]
    if y is not None:
        hidden = hidden + y
    first = block.blocks[0]
    h = first(
        hidden, normed=F.layer_norm(hidden, (hidden.shape[-1],), first.ln_1.weight, first.ln_1.bias, first.ln_1.eps)
    )
    for later in block.blocks[1:]:
        h = later(h)
    return block.ln_f(h)


def plain_loop(block: LoopedBlock, prompt: torch.Tensor, loops: int, grad_loops: int) -> torch.Tensor:
    """The plain Python loop of the official code: ``b - T`` loops without grad, then ``T`` with."""
    y = None
    with torch.no_grad():
        for _ in range(loops - grad_loops):
            y = plain_step(block, y, prompt)
    outputs = []
    for _ in range(grad_loops):
        y = plain_step(block, y, prompt)
        outputs.append(y)
    return torch.stack(outputs)


def make_block(d_model=24, n_heads=3, positions=11, n_layers=1, backend="eager", seed=0) -> LoopedBlock:
    torch.manual_seed(seed)
    block = LoopedBlock(d_model, n_heads, positions, n_layers=n_layers, backend=backend)
    with torch.no_grad():  # away from the default init (LayerNorm weight 1, bias 0) so every term matters
        for parameter in block.parameters():
            parameter.add_(0.1 * torch.randn_like(parameter))
    return block


@pytest.mark.parametrize(
    "loops, grad_loops, n_layers, backend",
    [(7, 3, 1, "eager"), (1, 1, 2, "eager"), (5, 5, 1, "reference"), (4, 2, 2, "triton")],
)
def test_looped_block_matches_plain_loop(loops, grad_loops, n_layers, backend):
    if backend == "triton":
        from icrl_kernels._backend import triton_runs_on

        if not triton_runs_on(torch.device("cpu")):
            pytest.skip("Triton runs on CPU only under TRITON_INTERPRET=1")
    block = make_block(n_layers=n_layers, backend=backend)
    prompt = torch.randn(2, 11, 24, requires_grad=True)
    upstream = torch.randn(grad_loops, 2, 11, 24)
    out = block(prompt, loops=loops, grad_loops=grad_loops)
    grads = torch.autograd.grad((out * upstream).sum(), [prompt, *block.parameters()])
    expected = plain_loop(block, prompt, loops, grad_loops)
    expected_grads = torch.autograd.grad((expected * upstream).sum(), [prompt, *block.parameters()])
    assert out.shape == (grad_loops, 2, 11, 24)
    assert_close_rel(out, expected, rms_tol=1e-5, name="iterates")
    names = ["prompt", *(name for name, _ in block.named_parameters())]
    for name, grad, want in zip(names, grads, expected_grads, strict=True):
        assert_close_rel(grad, want, rms_tol=1e-5, name=f"grad {name}")


def test_early_loops_carry_no_gradient():
    """Changing the loss over the last T iterates only through the last T loops: the early iterate is a constant."""
    block = make_block()
    prompt = torch.randn(2, 9, 24)
    y_early = block.run_without_grad(prompt, 3)
    assert not y_early.requires_grad
    out = block(prompt, loops=5, grad_loops=2)
    assert_close_rel(out[0], block.step(y_early, prompt), rms_tol=1e-6, name="first kept iterate, from Y_{b-T}")


def saved_tensor_bytes(block: LoopedBlock, prompt: torch.Tensor, loops: int, grad_loops: int) -> int:
    total = 0

    def pack(tensor):
        nonlocal total
        total += tensor.numel() * tensor.element_size()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        block(prompt, loops=loops, grad_loops=grad_loops).sum().backward()
    return total


def test_activation_memory_depends_on_grad_loops_not_loops():
    block = make_block()
    prompt = torch.randn(3, 11, 24, requires_grad=True)
    base = saved_tensor_bytes(block, prompt, loops=2, grad_loops=2)
    assert base > 0
    assert saved_tensor_bytes(block, prompt, loops=40, grad_loops=2) == base
    # ...and it does grow with T, so the measurement can see a difference.
    assert saved_tensor_bytes(block, prompt, loops=40, grad_loops=4) > 1.8 * base


def test_iterates_equal_forward():
    block = make_block()
    prompt = torch.randn(2, 7, 24)
    with torch.no_grad():
        everything = block(prompt, loops=6)
    assert_close_rel(torch.stack(list(block.iterates(prompt, 6))), everything, rms_tol=1e-6, name="iterates")


def test_single_loop_is_a_gpt2_backbone():
    """``loops=1`` from ``Y_0 = 0``: ln_f(blocks(P + pos)), the unlooped baseline."""
    block = make_block(n_layers=3)
    prompt = torch.randn(2, 5, 24)
    h = prompt + block.wpe.weight[:5]
    for layer in block.blocks:
        h = layer(h)
    assert_close_rel(block(prompt, loops=1)[0], block.ln_f(h), rms_tol=1e-6, name="one loop")


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(loops=0), "loops"),
        (dict(loops=3, grad_loops=4), "grad_loops"),
        (dict(loops=3, grad_loops=0), "grad_loops"),
    ],
)
def test_looped_block_rejects_bad_loop_counts(kwargs, match):
    with pytest.raises(ValueError, match=match):
        make_block()(torch.randn(1, 4, 24), **kwargs)


def test_looped_block_rejects_bad_prompts():
    block = make_block(positions=6)
    with pytest.raises(ValueError, match="prompt"):
        block(torch.randn(1, 4, 20), loops=2)
    with pytest.raises(ValueError, match="max_positions"):
        block(torch.randn(1, 7, 24), loops=2)
    with pytest.raises(ValueError, match="prompt"):
        block(torch.randn(4, 24), loops=2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_graph_loops_match_eager(dtype):
    block = make_block(d_model=64, n_heads=4, positions=41, backend="auto").cuda()
    prompt = torch.randn(8, 41, 64, device="cuda", dtype=dtype)
    graphed = make_block(d_model=64, n_heads=4, positions=41, backend="auto").cuda()
    graphed.load_state_dict(block.state_dict())
    graphed.cuda_graph = True
    block.to(dtype), graphed.to(dtype)
    for loops in (5, 30):  # the second call replays the captured graph
        want = block.run_without_grad(prompt, loops)
        got = graphed.run_without_grad(prompt, loops)
        assert_close_rel(got, want, rms_tol=1e-5 if dtype == torch.float32 else 2e-2, name=f"{loops} graphed loops")
    # Training step with graphs: gradients as without.
    prompt.requires_grad_(True)
    grads = [torch.autograd.grad(m(prompt, loops=12, grad_loops=3).float().square().sum(), prompt)[0]
             for m in (block, graphed)]  # fmt: skip
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    assert_close_rel(grads[1], grads[0], rms_tol=tolerance, name="grad with graphed loops")


# --- the looped model -------------------------------------------------------------------------------


def test_interleave_prompt_layout():
    xs, ys = torch.randn(2, 3, 4), torch.randn(2, 3)
    tokens = interleave_prompt(xs, ys)
    assert tokens.shape == (2, 6, 4)
    assert torch.equal(tokens[:, 0::2], xs)
    assert torch.equal(tokens[:, 1::2, 0], ys)
    assert torch.count_nonzero(tokens[:, 1::2, 1:]) == 0


def test_looped_model_predictions_are_causal():
    """The prediction for y_i reads only x_1..x_i and y_1..y_{i-1}."""
    torch.manual_seed(0)
    model = LoopedTransformer(LoopedConfig(n_dims=3, max_points=6, d_model=16, n_heads=2, backend="eager"))
    xs, ys = torch.randn(2, 6, 3), torch.randn(2, 6)
    before = model(xs, ys, loops=4)
    ys_changed = ys.clone()
    ys_changed[:, 3] += 1.0
    after = model(xs, ys_changed, loops=4)
    assert torch.equal(before[..., :4], after[..., :4])  # y_4 (index 3) is not seen by predictions 0..3
    assert not torch.allclose(before[..., 4:], after[..., 4:])
    per_loop = model.predictions_per_loop(xs, ys, 4)
    assert_close_rel(per_loop, before, rms_tol=1e-6, name="predictions per loop")


def test_looped_model_trains_through_its_loops():
    """Gradient descent through truncated loops fits one fixed linear function (no in-context inference
    needed, so a few steps suffice; in-context learning itself is the experiment's job)."""
    torch.manual_seed(0)
    model = LoopedTransformer(LoopedConfig(n_dims=3, max_points=5, d_model=32, n_heads=2, backend="eager"))
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    weights = torch.randn(3)
    losses = []
    for _ in range(80):
        xs = torch.randn(32, 5, 3)
        loss = model.loss(xs, xs @ weights, loops=3, grad_loops=2) / weights.square().sum()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[0] > 0.5 and sum(losses[-10:]) / 10 < 0.2, losses


# --- function classes and baselines --------------------------------------------------------------


@pytest.mark.parametrize("name", ["linear_regression", "sparse_linear_regression", "decision_tree", "relu_2nn"])
def test_label_variance_matches_samples(name):
    config = FunctionClassConfig(name, n_dims=7, sparsity=3, depth=3, hidden=50)
    xs, ys = sample_prompts(config, 4000, 8, active_dims=5, generator=torch.Generator().manual_seed(1))
    assert xs.shape == (4000, 8, 7) and ys.shape == (4000, 8)
    assert torch.count_nonzero(xs[..., 5:]) == 0  # the dims curriculum zeroes inactive coordinates
    variance = config.label_variance(5)
    assert abs(ys.square().mean().item() / variance - 1) < 0.1


def test_sparse_linear_regression_uses_sparsity_coordinates():
    config = FunctionClassConfig("sparse_linear_regression", n_dims=9, sparsity=3)
    xs, ys = sample_prompts(config, 50, 20, active_dims=6, generator=torch.Generator().manual_seed(2))
    assert torch.count_nonzero(xs[..., 6:]) == 0
    # Recover w on the 6 active coordinates (exact: 20 points, full column rank).
    weights = torch.linalg.lstsq(xs[..., :6].double(), ys.double().unsqueeze(-1)).solution.squeeze(-1)
    assert ((weights.abs() > 1e-6).sum(dim=1) == 3).all()


def test_decision_tree_labels_follow_the_tree():
    """Labels are piecewise constant: flipping no coordinate's sign keeps the label."""
    config = FunctionClassConfig("decision_tree", n_dims=4, depth=2)
    generator = torch.Generator().manual_seed(3)
    xs, ys = sample_prompts(config, 30, 40, generator=generator)
    signs = (xs > 0).long()
    for b in range(30):
        for i in range(40):
            same = (signs[b] == signs[b, i]).all(dim=1)
            assert torch.allclose(ys[b, same], ys[b, i])
        assert ys[b].unique().numel() <= 4


def test_curriculum_schedule():
    schedule = Curriculum(start=15, end=30, increment=2, interval=500)
    assert [schedule.value(s) for s in (0, 499, 500, 3999, 4000, 10**6)] == [15, 15, 17, 29, 30, 30]
    with pytest.raises(ValueError, match="end"):
        Curriculum(5, 4)


def test_least_squares_is_exact_from_d_examples():
    config = FunctionClassConfig("linear_regression", n_dims=4)
    xs, ys = sample_prompts(config, 16, 9, generator=torch.Generator().manual_seed(4))
    errors = normalized_squared_error(least_squares_predictions(xs.double(), ys.double()), ys.double(), 4.0)
    assert (errors[4:] < 1e-10).all()
    assert (errors[:4] > 1e-3).all()
    assert errors[0].item() == pytest.approx(normalized_squared_error(torch.zeros_like(ys), ys, 4.0)[0].item())


def test_averaging_and_nearest_neighbours_match_brute_force():
    generator = torch.Generator().manual_seed(5)
    xs, ys = torch.randn(3, 7, 4, generator=generator), torch.randn(3, 7, generator=generator)
    averaging, nearest = averaging_predictions(xs, ys), nearest_neighbours_predictions(xs, ys, 3)
    for b in range(3):
        assert averaging[b, 0] == 0 and nearest[b, 0] == 0
        for i in range(1, 7):
            w = (ys[b, :i, None] * xs[b, :i]).mean(0)
            assert math.isclose(averaging[b, i].item(), (w @ xs[b, i]).item(), rel_tol=1e-5, abs_tol=1e-6)
            order = (xs[b, :i] - xs[b, i]).norm(dim=1).argsort()[:3]
            assert math.isclose(nearest[b, i].item(), ys[b, order].mean().item(), rel_tol=1e-5, abs_tol=1e-6)
    with pytest.raises(ValueError, match="baseline"):
        baseline_predictions("ridge", xs, ys)


def test_function_class_rejects_bad_settings():
    with pytest.raises(ValueError, match="name"):
        FunctionClassConfig("quadratic")
    with pytest.raises(ValueError, match="active_dims"):
        sample_prompts(FunctionClassConfig(n_dims=3), 2, 4, active_dims=4)


# --- the experiment ----------------------------------------------------------------------------


TINY_RUN = [
    "--batch-size", "8", "--n-dims", "3", "--n-points", "5", "--d-model", "16",
    "--n-heads", "2", "--unlooped-layers", "2", "--loops-start", "2", "--loops-end", "3",
    "--loops-interval", "3", "--grad-loops", "2", "--dims-start", "2", "--points-start", "3",
    "--curriculum-interval", "3", "--eval-prompts", "32", "--eval-loop-factor", "2", "--eval-every", "2",
    "--checkpoint-every", "3", "--backend", "eager",
]  # fmt: skip


def test_icrl_looped_end_to_end(tmp_path, capsys):
    code = looped_main([
        "--steps", "6", *TINY_RUN, "--out-dir", str(tmp_path)
    ])  # fmt: skip
    assert code == 0
    report = json.loads((tmp_path / "looped.json").read_text())
    assert (tmp_path / "looped.png").stat().st_size > 0
    markdown = (tmp_path / "looped.md").read_text()
    assert "| least_squares |" in markdown
    # The summary starts with how it was made (the command as typed, the machine), as does the JSON.
    assert markdown.startswith("Command: `icrl-looped --steps 6 --batch-size 8 ") and "\n\nMachine: " in markdown
    assert report["command"].startswith("icrl-looped --steps 6 ") and f"torch {torch.__version__}" in report["machine"]
    evaluation = report["evaluation"]
    assert set(evaluation["error_at_k"]) == {"least_squares", "averaging", "3nn", "looped", "unlooped"}
    assert len(evaluation["looped_error_vs_loops_at_k"]) == 6  # eval_loop_factor * trained b
    assert all(math.isfinite(v) for v in evaluation["error_at_k"].values())
    assert evaluation["error_at_k"]["least_squares"] < 1e-6  # k = 4 >= d = 3 noiseless examples
    assert len(report["training"]["looped"]["loss"]) == 6
    assert looped_main(["--preset", "laptop"]) == 2
    assert "preset" in capsys.readouterr().err


def test_icrl_looped_seeds_summarise_each_seed(tmp_path, capsys):
    """``--seeds``: each seed runs as ``--seed N`` in ``seed<N>/`` (a finished single-seed run there is reused,
    not trained again), then looped.json / .md / .png hold mean ± sd over seeds and every seed's report."""
    assert looped_main(["--steps", "6", *TINY_RUN, "--seed", "1", "--out-dir", str(tmp_path / "seed1")]) == 0
    single = json.loads((tmp_path / "seed1" / "looped.json").read_text())
    written = {name: (tmp_path / "seed1" / f"{name}.pt").stat().st_mtime_ns for name in ("looped", "unlooped")}
    capsys.readouterr()
    assert looped_main(["--steps", "6", *TINY_RUN, "--seeds", "0", "1", "--out-dir", str(tmp_path)]) == 0
    assert "looped - unlooped (paired)" in capsys.readouterr().out
    report = json.loads((tmp_path / "looped.json").read_text())
    assert report["seeds"] == [0, 1] and set(report["per_seed"]) == {"0", "1"}
    assert report["per_seed"]["1"]["evaluation"] == single["evaluation"]  # seed 1 reused, evaluated alike
    assert {name: (tmp_path / "seed1" / f"{name}.pt").stat().st_mtime_ns for name in written} == written  # no step
    errors = [report["per_seed"][seed]["evaluation"]["error_at_k"] for seed in ("0", "1")]
    stats = report["summary"]["looped_minus_unlooped"]
    assert stats["values"] == pytest.approx([e["looped"] - e["unlooped"] for e in errors]) and stats["n"] == 2
    assert report["summary"]["error_at_k"]["looped"]["values"] == [e["looped"] for e in errors]
    assert "loss" not in report["per_seed"]["0"]["training"]["looped"]
    markdown = (tmp_path / "looped.md").read_text()
    assert markdown.startswith("Command: `icrl-looped --steps 6 ") and "| seed 0 | seed 1 |" in markdown
    assert (tmp_path / "looped.png").stat().st_size > 0
    assert looped_main(["--seeds", "-1", "--out-dir", str(tmp_path)]) == 2


def test_icrl_looped_resumes_exactly(tmp_path):
    """A run stopped after 3 steps and rerun to 6 equals a run of 6 steps straight through."""
    assert looped_main(["--steps", "6", *TINY_RUN, "--out-dir", str(tmp_path / "straight")]) == 0
    assert looped_main(["--steps", "3", *TINY_RUN, "--out-dir", str(tmp_path / "resumed")]) == 0
    assert looped_main(["--steps", "6", *TINY_RUN, "--out-dir", str(tmp_path / "resumed")]) == 0
    straight, resumed = (json.loads((tmp_path / run / "looped.json").read_text()) for run in ("straight", "resumed"))
    for model in ("looped", "unlooped"):
        assert resumed["training"][model]["loss"] == straight["training"][model]["loss"]
        assert resumed["training"][model]["eval_steps"] == [2, 3, 4, 6]  # 3: the end of the first run
    assert resumed["evaluation"]["error_at_k"] == straight["evaluation"]["error_at_k"]
    with pytest.raises(Exception, match="another run configuration"):
        from icrl_models.experiments.looped import LoopedExperimentConfig, run_experiment

        run_experiment(LoopedExperimentConfig(steps=6, d_model=32, out_dir=str(tmp_path / "resumed")))
