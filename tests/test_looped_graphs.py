"""The looped training step and long inference in CUDA graphs (icrl_models.looped_step, LoopedBlock).

On CPU: the whole step (no-grad loops, grad loops, backward, capturable Adam step) reads no device value
on the host (the dispatch-mode detector of test_no_host_sync, with value checks in their GPU mode, and a
static scan of the step's source), the graph-ready step equals the training step it replaced, and
capturing's warm-up is undone exactly. On a GPU (``gpu`` marker): the step captured with
``torch.cuda.graph`` and compiled with ``mode="reduce-overhead"`` against eager, and the chunked
inference graphs against the eager loop.
"""

from __future__ import annotations

import inspect

import pytest
import torch
from _helpers import HostReadDetector, cpu_backends, gpu_value_checks, host_reads

import icrl_models.cuda_graphs as cuda_graphs
import icrl_models.looped_step as looped_step
import icrl_models.models.looped as looped_model
from icrl_kernels import LoopedBlock
from icrl_kernels.testing import assert_close_rel
from icrl_models.cuda_graphs import prepare_capturable, set_learning_rate
from icrl_models.looped_step import make_graphed_train_step, make_optimizer, train_step
from icrl_models.models.looped import LoopedConfig, LoopedTransformer


def make_model(device="cpu", *, backend="eager", cuda_graph=False, seed=0) -> LoopedTransformer:
    torch.manual_seed(seed)
    config = LoopedConfig(n_dims=3, max_points=5, d_model=32, n_heads=4, backend=backend, cuda_graph=cuda_graph)
    return LoopedTransformer(config).to(device)


def batches(n, device="cpu", *, batch=4, points=5, dims=3, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(batch, points, dims, generator=g).to(device), torch.randn(batch, points, generator=g).to(device))
        for _ in range(n)
    ]


def params(model):
    return [p.detach().clone() for p in model.parameters()]


# -- CPU: no host syncs ------------------------------------------------------------------------------
@pytest.mark.parametrize("foreach", [False, True])
@pytest.mark.parametrize("backend", cpu_backends())
def test_train_step_reads_no_value_on_host(capturable_on_cpu, backend, foreach):
    model = make_model(backend=backend)
    optimizer = torch.optim.Adam(model.parameters(), lr=torch.tensor(1e-3), capturable=True, foreach=foreach)
    (xs, ys), (xs2, ys2) = batches(2)
    with gpu_value_checks(), HostReadDetector() as detector:
        # The first step too: Adam creates its state there (as a graph's warm-up does).
        train_step(model, optimizer, xs, ys, loops=4, grad_loops=2)
        set_learning_rate(optimizer, 5e-4)
        loss = train_step(model, optimizer, xs2, ys2, loops=4, grad_loops=2)
    assert not detector.reads, f"the training step reads device values on the host: {detector.reads}"
    assert loss.shape == () and not loss.requires_grad


def test_detector_sees_the_default_optimizers_host_read():
    """Without capturable, Adam reads its step counter on the host: the detector must flag it (so the
    test above can fail)."""
    model = make_model()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3, foreach=False)
    (xs, ys), (xs2, ys2) = batches(2)
    train_step(model, optimizer, xs, ys, loops=3, grad_loops=1)
    with HostReadDetector() as detector:
        train_step(model, optimizer, xs2, ys2, loops=3, grad_loops=1)
    assert detector.reads


def test_step_source_has_no_host_reads():
    for module in (looped_step, cuda_graphs, looped_model):
        found = host_reads(inspect.getsource(module))
        assert not found, f"{module.__name__}: host reads {found}"


# -- CPU: same results as the training step it replaced ------------------------------------------------
def test_train_step_equals_the_previous_training_step():
    """``train_step`` with the default (non-capturable) Adam reproduces the loop body ``train_model`` had
    before it: autocast off on CPU, forward, zero_grad, backward, step; bit for bit."""
    ref, new = make_model(), make_model()
    ref_opt = torch.optim.Adam(ref.parameters(), lr=1e-3)
    new_opt = make_optimizer(new.parameters(), 1e-3)
    for step, (xs, ys) in enumerate(batches(4)):
        lr = 1e-3 * min(1.0, (step + 1) / 2)
        for group in ref_opt.param_groups:
            group["lr"] = lr
        ref_loss = ref.loss(xs, ys, loops=5, grad_loops=2)
        ref_opt.zero_grad(set_to_none=True)
        ref_loss.backward()
        ref_opt.step()
        set_learning_rate(new_opt, lr)
        new_loss = train_step(new, new_opt, xs, ys, loops=5, grad_loops=2)
        assert torch.equal(new_loss, ref_loss.detach())
    for got, want in zip(params(new), params(ref)):
        assert torch.equal(got, want)


def test_capturable_step_matches_the_default_step(capturable_on_cpu):
    """The optimiser a graph needs (capturable, tensor learning rate set in place) trains as the default
    one. Not bit for bit: the capturable path computes the bias corrections in float32 tensors and adds
    ``eps`` in another order, so the parameter updates agree to ~1e-5 relative (1e-4 asserted; a wrong
    learning rate or a missed schedule step is off by > 10%)."""
    ref, new = make_model(), make_model()
    start = params(ref)
    ref_opt = make_optimizer(ref.parameters(), 1e-3)
    new_opt = make_optimizer(new.parameters(), 1e-3, capturable=True)
    assert isinstance(new_opt.param_groups[0]["lr"], torch.Tensor)
    for step, (xs, ys) in enumerate(batches(4)):
        for optimizer in (ref_opt, new_opt):
            set_learning_rate(optimizer, 1e-3 * (step + 1) / 4)
        ref_loss = train_step(ref, ref_opt, xs, ys, loops=4, grad_loops=2)
        new_loss = train_step(new, new_opt, xs, ys, loops=4, grad_loops=2)
        torch.testing.assert_close(new_loss, ref_loss, rtol=1e-5, atol=1e-7)
    update = [torch.cat([(p - p0).flatten() for p, p0 in zip(params(m), start)]) for m in (new, ref)]
    assert_close_rel(update[0], update[1], rms_tol=1e-4, name="parameter updates")


def test_capture_warm_up_is_undone(capturable_on_cpu):
    """The snapshot/restore around a capture's warm-up: warm-up steps (which create Adam's state) leave
    no trace, so the first replayed step equals a fresh model's first step."""
    ref, new = make_model(), make_model()
    ref_opt = make_optimizer(ref.parameters(), 1e-2, capturable=True)
    new_opt = make_optimizer(new.parameters(), 1e-2, capturable=True)
    (xs, ys), (xs2, ys2) = batches(2)
    saved = cuda_graphs._snapshot(new, new_opt)
    for _ in range(3):
        train_step(new, new_opt, xs2, ys2, loops=3, grad_loops=2)
    assert new_opt.state and not all(torch.equal(a, b) for a, b in zip(params(new), params(ref)))
    cuda_graphs._restore(saved, new, new_opt)
    assert all(p.grad is None for p in new.parameters())
    for _ in range(2):
        want = train_step(ref, ref_opt, xs, ys, loops=3, grad_loops=2)
        got = train_step(new, new_opt, xs, ys, loops=3, grad_loops=2)
        assert torch.equal(got, want)
    for got, want in zip(params(new), params(ref)):
        assert torch.equal(got, want)


def test_prepare_capturable_after_loading_a_plain_state(capturable_on_cpu):
    model = make_model()
    plain = make_optimizer(model.parameters(), 1e-3)
    train_step(model, plain, *batches(1)[0], loops=2, grad_loops=1)
    optimizer = make_optimizer(model.parameters(), 1e-3, capturable=True)
    optimizer.load_state_dict(plain.state_dict())
    prepare_capturable(optimizer)
    group = optimizer.param_groups[0]
    assert group["capturable"] and isinstance(group["lr"], torch.Tensor)
    train_step(model, optimizer, *batches(1)[0], loops=2, grad_loops=1)


def test_graphed_step_rejects_what_cannot_be_captured():
    model = make_model()
    batch = batches(1)[0]
    with pytest.raises(TypeError, match="optimizer must be"):
        make_graphed_train_step(model, torch.optim.SGD(model.parameters(), lr=0.1), batch, loops=2, grad_loops=1)
    with pytest.raises(ValueError, match="capturable=True"):
        make_graphed_train_step(model, make_optimizer(model.parameters(), 1e-3), batch, loops=2, grad_loops=1)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    optimizer.param_groups[0]["capturable"] = True
    with pytest.raises(ValueError, match="CUDA"):
        make_graphed_train_step(model, optimizer, batch, loops=2, grad_loops=1)


def test_graph_chunk_is_checked():
    with pytest.raises(ValueError, match="graph_chunk"):
        LoopedBlock(32, 4, 8, graph_chunk=0)


# -- GPU ---------------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("autocast_dtype", [None, torch.bfloat16])
def test_graphed_train_step_matches_eager(autocast_dtype):
    eager, graphed = make_model("cuda", backend="auto"), make_model("cuda", backend="auto", cuda_graph=True)
    eager_opt = make_optimizer(eager.parameters(), 1e-2, capturable=True)
    graphed_opt = make_optimizer(graphed.parameters(), 1e-2, capturable=True)
    data = batches(5, "cuda")
    step = make_graphed_train_step(graphed, graphed_opt, data[0], loops=6, grad_loops=3, autocast_dtype=autocast_dtype)
    # Capturing (warm-up included) left the model as it was.
    for got, want in zip(params(graphed), params(eager)):
        assert torch.equal(got, want)
    tolerance = 1e-5 if autocast_dtype is None else 2e-2
    for i, (xs, ys) in enumerate(data):
        for optimizer in (eager_opt, graphed_opt):
            set_learning_rate(optimizer, 1e-2 / (i + 1))  # a schedule must reach the graph
        want = train_step(eager, eager_opt, xs, ys, loops=6, grad_loops=3, autocast_dtype=autocast_dtype)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")  # replaying reads nothing on the host
        try:
            got = step(xs, ys)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        assert_close_rel(got, want, rms_tol=tolerance, name=f"loss at step {i}")
    for got, want in zip(params(graphed), params(eager)):
        assert_close_rel(got, want, rms_tol=tolerance, name="parameters after 5 steps")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_eager_train_step_does_not_synchronise():
    model = make_model("cuda", backend="auto")
    optimizer = make_optimizer(model.parameters(), 1e-3, capturable=True)
    (xs, ys), (xs2, ys2) = batches(2, "cuda")
    train_step(model, optimizer, xs, ys, loops=5, grad_loops=2)  # warm-up: compiles, autotunes
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        train_step(model, optimizer, xs2, ys2, loops=5, grad_loops=2)
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_compiled_reduce_overhead_train_step_matches_eager():
    eager, compiled_model = make_model("cuda", backend="auto"), make_model("cuda", backend="auto")
    # SGD, not Adam: Adam divides each gradient by its own running scale, so a coordinate whose gradient is
    # near zero moves by ~lr whatever its sign, and inductor's different rounding flips such signs (seen on
    # an H200: parameters 1e-2 apart after 4 Adam steps while every step's loss agreed to 1e-3). Under SGD
    # a parameter moves by lr x its gradient, so rounding differences stay at rounding level.
    eager_opt = torch.optim.SGD(eager.parameters(), lr=1e-2)
    compiled_opt = torch.optim.SGD(compiled_model.parameters(), lr=1e-2)
    compiled = torch.compile(train_step, mode="reduce-overhead")
    for xs, ys in batches(4, "cuda"):
        want = train_step(eager, eager_opt, xs, ys, loops=6, grad_loops=3)
        got = compiled(compiled_model, compiled_opt, xs, ys, loops=6, grad_loops=3)
        # Inductor fuses (and so rounds) differently from eager.
        assert_close_rel(got.clone(), want, rms_tol=1e-3, name="compiled loss")
    for got, want in zip(params(compiled_model), params(eager)):
        assert_close_rel(got, want, rms_tol=1e-3, name="compiled parameters")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunked_inference_graphs_match_eager(dtype):
    torch.manual_seed(0)
    block = LoopedBlock(64, 4, 41, backend="auto").cuda().eval()
    graphed = LoopedBlock(64, 4, 41, backend="auto", cuda_graph=True, graph_chunk=7).cuda().eval()
    graphed.load_state_dict(block.state_dict())
    prompt = torch.randn(8, 41, 64, device="cuda")
    read_out = torch.nn.Linear(64, 1).cuda()
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    with torch.autocast("cuda", dtype=dtype, enabled=dtype != torch.float32):
        for loops in (3, 7, 23, 23):  # fewer than a chunk, one chunk, chunks + remainder, replay only
            want = block.run_without_grad(prompt, loops)
            got = graphed.run_without_grad(prompt, loops)
            assert_close_rel(got, want, rms_tol=tolerance, name=f"Y after {loops} graphed loops")
        for out in (None, read_out, lambda y: y[:, ::2]):  # a view of Y as read-out: copied in time
            want = torch.stack(list(block.iterates(prompt, 16, read_out=out)))
            got = torch.stack(list(graphed.iterates(prompt, 16, read_out=out)))
            assert_close_rel(got, want, rms_tol=tolerance, name=f"iterates, read_out={out}")
        # Two generators interleaved on the same graphs keep their own iterates.
        first, second = graphed.iterates(prompt, 14), graphed.iterates(prompt * 2, 14)
        pairs = [(next(first), next(second)) for _ in range(14)]
        assert_close_rel(torch.stack([a for a, _ in pairs]), torch.stack(list(block.iterates(prompt, 14))),
                         rms_tol=tolerance, name="interleaved iterates")  # fmt: skip
    # In-place parameter updates reach the graphs without recapture.
    with torch.no_grad():
        for a, b in zip(block.parameters(), graphed.parameters()):
            a.mul_(1.1), b.mul_(1.1)
    assert_close_rel(graphed.run_without_grad(prompt, 23), block.run_without_grad(prompt, 23), rms_tol=1e-5,
                     name="after a parameter update")  # fmt: skip
