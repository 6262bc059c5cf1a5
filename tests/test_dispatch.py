"""The eager fast path of the registered ops (:mod:`icrl_kernels._library`) against the dispatcher path.

Plain eager calls of an op run its forward and backward through one ``torch.autograd.Function``;
everything else (``torch.compile``, fake tensors, modes, double backward) goes through the registered
operator. Both paths run the same Python implementations, so outputs and gradients must be *identical*
(``torch.equal``, not a tolerance), errors the same, and ``torch.compile`` must still see the op.
"""

from __future__ import annotations

import contextlib
import os

import pytest
import torch

import icrl_kernels as ik
from icrl_kernels import _library
from icrl_kernels.testing import fast_impls, triton_devices

IMPLS = fast_impls()


@contextlib.contextmanager
def fast_dispatch(enabled: bool):
    previous = _library.set_fast_dispatch(enabled)
    try:
        yield
    finally:
        _library.set_fast_dispatch(previous)


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _cases(impl: str):
    """``name -> (make_inputs, call)``: odd sizes, fp32 and bf16, masks and padding; inputs are fresh leaves."""
    g = _gen(0)
    ids = torch.randint(0, 3, (2, 13), generator=g)
    ids[1, -3:] = -1  # padding
    targets = torch.randint(0, 7, (2, 5), generator=g)
    targets[0, 1] = -100  # ignored row
    mask = torch.ones(7, dtype=torch.bool)
    mask[3] = False
    targets[targets == 3] = 4

    def leaves(*shapes, dtype=torch.float32, seed=1):
        gen = _gen(seed)
        return tuple(torch.randn(*s, generator=gen).to(dtype).requires_grad_(True) for s in shapes)

    cases = {
        "ngram_attention-sort": (
            lambda: leaves((2, 13, 6)),
            lambda h: ik.ngram_attention(h, ids, 2, backend=impl, algorithm="sort" if impl == "triton" else "auto"),
        ),
        "infonce_loss-masked": (
            lambda: leaves((2, 5, 12), (7, 12)),
            lambda p, e: ik.infonce_loss(p, e, targets, mask=mask, tau=0.7, reduction="none", backend=impl),
        ),
        "mixture_of_heads-bf16": (
            lambda: leaves((2, 5, 3, 4), (2, 5, 3), dtype=torch.bfloat16),
            lambda h, lg: ik.mixture_of_heads(h, lg, backend=impl),
        ),
        "mixture_of_heads-sdpa-view": (
            lambda: (
                tuple(t.detach().transpose(1, 2).requires_grad_(True) for t in leaves((2, 3, 5, 4)))
                + leaves((2, 5, 3), seed=2)
            ),
            lambda h, lg: ik.mixture_of_heads(h, lg, gate="sigmoid", backend=impl),
        ),
        "inject_layer_norm": (
            lambda: leaves((2, 5, 9), (2, 5, 9), (5, 9), (9,), (9,)),
            lambda y, p, pos, w, b: ik.inject_layer_norm(y, p, pos, w, b, backend=impl),
        ),
        "smeared_keys": (
            lambda: leaves((2, 3, 5, 4), (3,)),
            lambda k, a: ik.smeared_keys(k, a, backend=impl),
        ),
    }
    if impl == "triton":
        cases["ngram_attention-tiled"] = (
            lambda: leaves((2, 13, 16)),
            lambda h: ik.ngram_attention(h, ids, 2, backend=impl, algorithm="tiled"),
        )
    return cases


def _graph_node_names(out: torch.Tensor) -> set[str]:
    """Names of every node of the autograd graph behind ``out``."""
    names, stack, seen = set(), [out.grad_fn], set()
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        names.add(type(node).__name__)
        stack.extend(next_node for next_node, _ in node.next_functions)
    return names


def _run(make_inputs, call, *, fast: bool):
    """Outputs, input gradients and the autograd node names of one forward + backward."""
    with fast_dispatch(fast):
        inputs = make_inputs()
        out = call(*inputs)
        outs = out if isinstance(out, tuple) else (out,)
        loss = sum((o.float() * (i + 1)).square().sum() for i, o in enumerate(outs))
        grads = torch.autograd.grad(loss, inputs)
    return outs, grads, _graph_node_names(outs[0])


@pytest.mark.parametrize("impl,case", [(impl, case) for impl in IMPLS for case in _cases(impl)])
def test_fast_path_matches_dispatcher_exactly(impl, case):
    make_inputs, call = _cases(impl)[case]
    fast_outs, fast_grads, fast_nodes = _run(make_inputs, call, fast=True)
    slow_outs, slow_grads, slow_nodes = _run(make_inputs, call, fast=False)
    # The two paths really are different: one autograd.Function vs the dispatcher's generated one.
    assert any(n.endswith("_fastBackward") for n in fast_nodes), fast_nodes
    assert not any(n.startswith("GeneratedBackwardFor_icrl_") for n in fast_nodes), fast_nodes
    assert any(n.startswith("GeneratedBackwardFor_icrl_") for n in slow_nodes), slow_nodes
    assert not any(n.endswith("_fastBackward") for n in slow_nodes), slow_nodes
    for fast, slow in zip(fast_outs, slow_outs):
        assert fast.dtype == slow.dtype and fast.shape == slow.shape and fast.stride() == slow.stride()
        assert fast.requires_grad == slow.requires_grad
        assert torch.equal(fast, slow)
    for fast, slow in zip(fast_grads, slow_grads):
        assert fast.dtype == slow.dtype and fast.stride() == slow.stride()
        assert torch.equal(fast, slow)


@pytest.mark.parametrize("impl", IMPLS)
def test_side_outputs_match(impl):
    """An op's non-differentiable side outputs (infonce_loss's log-sum-exps and the gradients its forward
    computed) behave the same on both paths."""
    from icrl_kernels.contrastive.algorithms import EAGER, FUSED
    from icrl_kernels.contrastive.function import infonce_op

    g = _gen(3)
    pred, embeds = torch.randn(2, 5, 8, generator=g, requires_grad=True), torch.randn(7, 8, generator=g)
    targets = torch.randint(0, 7, (2, 5), generator=g)
    algorithm = EAGER if impl == "eager" else FUSED
    results = []
    for fast in (True, False):
        with fast_dispatch(fast):
            results.append(infonce_op(pred, embeds, targets, None, 1.0, -100, "mean", 1, True, False, algorithm))
    for fast, slow in zip(*results):
        assert fast.requires_grad == slow.requires_grad and torch.equal(fast, slow)


@pytest.mark.parametrize("impl", IMPLS)
def test_no_grad_and_inference_calls_skip_autograd(impl):
    h = torch.randn(2, 4, 3, 5, requires_grad=True)
    logits = torch.randn(2, 4, 3)
    with torch.no_grad():
        out = ik.mixture_of_heads(h, logits, backend=impl)
    assert out.grad_fn is None and not out.requires_grad
    with torch.inference_mode():
        out = ik.mixture_of_heads(h, logits, backend=impl)
    assert out.grad_fn is None and torch.equal(out, ik.mixture_of_heads(h.detach(), logits, backend=impl))


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("wanted", [(0,), (1, 3), (2, 4), (0, 1, 2, 3, 4)])
def test_needs_grad_skipping_on_fast_path(impl, wanted, monkeypatch):
    """Only the gradients asked for are computed (the backward sees the flags) and returned."""
    import icrl_kernels.looped.function as looped

    seen = []
    if impl == "triton":
        import icrl_kernels.looped.kernels as kernels

        original = kernels.inject_layer_norm_backward_triton

        def spy(*args):
            seen.append(args[5])  # wants: d_x (y and prompt), d_pos, d_weight, d_bias
            return original(*args)

        monkeypatch.setattr(kernels, "inject_layer_norm_backward_triton", spy)
    else:
        original = looped.inject_layer_norm_backward_eager

        def spy(*args):
            seen.append(args[5:8])  # want_weight, want_bias, want_pos
            return original(*args)

        monkeypatch.setattr(looped, "inject_layer_norm_backward_eager", spy)
    g = _gen(4)
    inputs = [torch.randn(*s, generator=g) for s in ((2, 5, 9), (2, 5, 9), (5, 9), (9,), (9,))]
    for index in wanted:
        inputs[index].requires_grad_(True)
    hidden, normed = ik.inject_layer_norm(*inputs, backend=impl)
    (hidden.sum() + normed.square().sum()).backward()
    assert type(normed.grad_fn).__name__ == "inject_layer_norm_fastBackward"
    flags = [i in wanted for i in range(5)]
    if impl == "triton":
        assert seen == [(flags[0] or flags[1], flags[2], flags[3], flags[4])]
    else:
        assert seen == [(flags[3], flags[4], flags[2])]
    for index, tensor in enumerate(inputs):
        assert (tensor.grad is not None) == (index in wanted)


def test_errors_are_unchanged():
    pred = torch.randn(2, 5, 12, requires_grad=True)
    embeds = torch.randn(7, 12)
    bad = torch.full((2, 5), 9)
    messages = []
    for fast in (True, False):
        with fast_dispatch(fast), pytest.raises(ValueError, match="targets must lie in") as info:
            ik.infonce_loss(pred, embeds, bad, backend="eager")
        messages.append(str(info.value))
    assert messages[0] == messages[1]


@pytest.mark.parametrize("fast", [True, False])
def test_double_backward_still_refused(fast):
    """The registered backward op has no autograd: create_graph=True does not silently differentiate
    the eager backward on the fast path either."""
    h = torch.randn(2, 3, 2, 4, requires_grad=True)
    logits = torch.randn(2, 3, 2, requires_grad=True)
    with fast_dispatch(fast):
        out = ik.mixture_of_heads(h, logits, backend="eager")
        (grad_h,) = torch.autograd.grad(out.square().sum(), h, create_graph=True)
        with pytest.raises(RuntimeError, match="no autograd formula"):
            grad_h.sum().backward()


def test_modes_and_subclasses_take_the_dispatcher():
    from torch._subclasses.fake_tensor import FakeTensorMode

    h = torch.randn(2, 3, 2, 4, requires_grad=True)
    logits = torch.randn(2, 3, 2, requires_grad=True)
    assert type(ik.mixture_of_heads(h, logits, backend="eager").grad_fn).__name__ == "mixture_of_heads_fastBackward"
    with torch.device("cpu"):  # a torch-function mode
        out = ik.mixture_of_heads(h, logits, backend="eager")
    assert type(out.grad_fn).__name__.startswith("GeneratedBackwardFor_icrl_")
    with FakeTensorMode() as mode:
        fake = ik.mixture_of_heads(mode.from_tensor(h), mode.from_tensor(logits), backend="eager")
    assert fake.shape == (2, 3, 8) and type(fake).__name__ == "FakeTensor"
    # vmap's batched tensors look plain to type(): the functorch-stack check sends them to the registered
    # op (its batching fallback loops over the batch), never into the fast path's autograd.Function.
    # (The fast path would run the eager code on batched tensors, which rejects its out= ops.)
    batch = torch.randn(3, 2, 3, 2, 4, requires_grad=True)
    mapped = torch.vmap(lambda x: ik.mixture_of_heads(x, logits.detach(), backend="eager"))(batch)
    looped = torch.stack([ik.mixture_of_heads(x, logits.detach(), backend="eager") for x in batch])
    assert torch.equal(mapped, looped) and mapped.requires_grad


#: Token ids of the n-gram cases below: three ids, a padded tail.
_NGRAM_IDS = torch.randint(0, 3, (2, 13), generator=torch.Generator().manual_seed(5))
_NGRAM_IDS[1, -3:] = -1


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize(
    "op,make_inputs,call",
    [
        ("mixture_of_heads", lambda: (torch.randn(2, 5, 3, 4), torch.randn(2, 5, 3)),
         lambda impl, h, lg: ik.mixture_of_heads(h, lg, backend=impl)),
        ("smeared_keys", lambda: (torch.randn(2, 3, 5, 4), torch.randn(3)),
         lambda impl, k, a: ik.smeared_keys(k, a, backend=impl)),
        ("inject_layer_norm", lambda: (torch.randn(2, 5, 8), torch.randn(2, 5, 8), None, torch.ones(8), None),
         lambda impl, *args: ik.inject_layer_norm(*args, backend=impl)[1]),
        ("ngram_attention", lambda: (torch.randn(2, 13, 6),),
         lambda impl, h: ik.ngram_attention(h, _NGRAM_IDS, 2, backend=impl, algorithm="sort" if impl == "triton"
                                            else "auto")),
        ("ngram_attention_tiled", lambda: (torch.randn(2, 13, 16),),
         lambda impl, h: ik.ngram_attention(h, _NGRAM_IDS, 2, backend=impl, algorithm="tiled")),
    ],
    ids=lambda value: value if isinstance(value, str) else "",
)  # fmt: skip
def test_compile_keeps_the_op_in_the_graph(impl, op, make_inputs, call):
    """Dynamo records the registered op (not the fast path's autograd.Function) and the compiled result
    and gradients match the eager fast path. (Without the interpreter the ops are ``triton_op`` s and
    the compiled graph holds their kernels instead: ``test_traceable_ops_compile_into_their_kernels``.)"""
    if op == "ngram_attention_tiled" and impl != "triton":
        pytest.skip("the tiled n-gram kernel is Triton-only")
    graphs = []

    def capture(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    inputs = [t.requires_grad_(True) if t is not None else None for t in make_inputs()]
    torch._dynamo.reset()
    compiled = torch.compile(lambda *args: call(impl, *args), fullgraph=True, backend=capture)
    out = compiled(*inputs)
    targets = [node.target for gm in graphs for node in gm.graph.nodes if node.op == "call_function"]
    assert getattr(torch.ops.icrl, op).default in targets, targets
    leaves = [t for t in inputs if t is not None]
    grads = torch.autograd.grad(out.square().sum(), leaves)
    expected = call(impl, *inputs)
    assert type(expected.grad_fn).__name__ == f"{op}_fastBackward"
    expected_grads = torch.autograd.grad(expected.square().sum(), leaves)
    assert torch.equal(out, expected)
    for grad, grad_ref in zip(grads, expected_grads):
        assert torch.equal(grad, grad_ref)


# --- registration: triton_op where the implementation is traceable -----------------------------------


def _toy_forward(x: torch.Tensor, impl: str) -> torch.Tensor:
    return x * 3.0 + 1.0


def _toy_backward(grad: torch.Tensor, impl: str) -> torch.Tensor:
    return grad * 3.0


@pytest.fixture(scope="module")
def toy_op():
    """A differentiable op registered as a ``triton_op`` traceable for ``impl="traced"`` only (forced here,
    since under ``TRITON_INTERPRET=1`` the package's ops are plain custom ops)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(_library, "triton_interpreter_enabled", lambda: False)
        patch.delenv("ICRL_TRITON_OP", raising=False)
        forward_op, _ = _library.differentiable_op(
            "dispatch_test_toy",
            forward=_toy_forward,
            forward_fake=lambda x, impl: torch.empty_like(x),
            backward=_toy_backward,
            backward_fake=lambda grad, impl: torch.empty_like(grad),
            save=lambda inputs, output: (inputs[1],),
            grad_inputs=(0,),
            traceable=("traced",),
        )
    return forward_op


@pytest.mark.parametrize("impl,decomposed", [("traced", True), ("opaque", False)])
def test_triton_op_decomposes_only_traceable_impls(toy_op, impl, decomposed):
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    graphs = []

    def capture(gm, example_inputs):
        graphs.append(gm)
        return make_boxed_func(gm.forward)

    x = torch.randn(5, requires_grad=True)
    torch._dynamo.reset()
    compiled = torch.compile(lambda t: toy_op(t, impl), fullgraph=True, backend=aot_autograd(fw_compiler=capture))
    out = compiled(x)
    out.sum().backward()
    assert torch.equal(out, x.detach() * 3.0 + 1.0) and torch.equal(x.grad, torch.full((5,), 3.0))
    targets = {node.target for node in graphs[0].graph.nodes if node.op == "call_function"}
    assert (torch.ops.icrl.dispatch_test_toy.default in targets) != decomposed, targets
    assert (torch.ops.aten.mul.Tensor in targets) == decomposed, targets
    torch.library.opcheck(toy_op, (torch.randn(3, requires_grad=True), impl))


def test_triton_op_is_kept_whole_by_export(toy_op):
    class Toy(torch.nn.Module):
        def forward(self, x):
            return toy_op(x, "traced")

    exported = torch.export.export(Toy(), (torch.randn(4),))
    targets = [node.target for node in exported.graph.nodes if node.op == "call_function"]
    assert targets == [torch.ops.icrl.dispatch_test_toy.default]


def test_registration_choice():
    assert not _library.uses_triton_op(False)
    # Interpreted kernels run on the host at once and cannot be traced: never triton_op under the interpreter.
    from icrl_kernels._backend import triton_interpreter_enabled

    if triton_interpreter_enabled():
        assert not _library.uses_triton_op(True)


_TRACE_INTO_KERNELS = """
import json

import torch
from functorch.compile import make_boxed_func
from torch._dynamo.backends.common import aot_autograd

import triton
from triton.backends.compiler import GPUTarget

import icrl_kernels as ik
from icrl_kernels import _backend, _library

assert _library.uses_triton_op(True), "no triton_op registration in this process"
_backend.triton_runs_on = lambda device: True  # CPU tensors take the Triton backend: traced, never run


class OfflineDriver:
    # What torch's trace of a kernel asks the driver: the target to lower the kernel to TTIR for, to find
    # which arguments it writes (without a driver it assumes every one, and the partition fails).
    def get_current_target(self):
        return GPUTarget("cuda", 90, 32)


triton.runtime.driver.set_active(OfflineDriver())


def leaves(*shapes):
    return [torch.randn(*shape, requires_grad=True) for shape in shapes]


ids = torch.randint(0, 4, (2, 24))
cases = {
    "ngram_attention-sort": (lambda: leaves((2, 24, 16)),
                             lambda h: ik.ngram_attention(h, ids, 2, backend="triton", algorithm="sort")),
    "ngram_attention-tiled": (lambda: leaves((2, 24, 16)),
                              lambda h: ik.ngram_attention(h, ids, 2, backend="triton", algorithm="tiled")),
    "mixture_of_heads": (lambda: leaves((2, 5, 3, 16), (2, 5, 3)),
                         lambda h, g: ik.mixture_of_heads(h, g, backend="triton")),
    "smeared_keys": (lambda: leaves((2, 3, 5, 16), (3,)), lambda k, a: ik.smeared_keys(k, a, backend="triton")),
    "inject_layer_norm": (lambda: leaves((2, 5, 16), (2, 5, 16), (5, 16), (16,), (16,)),
                          lambda *args: ik.inject_layer_norm(*args, backend="triton")[1]),
    "gated_attention": (lambda: leaves((2, 3, 5, 16), (2, 3, 5, 16), (2, 3, 5, 16), (2, 5, 3), (3,)),
                        lambda q, k, v, g, a: ik.gated_attention(q, k, v, g, smear_alpha=a, backend="triton")),
}
targets, embeds = torch.randint(0, 7, (2, 5)), torch.randn(7, 16)
for algorithm in ("small", "fused", "row_chunks", "action_chunks"):  # each InfoNCE algorithm, both ops
    cases[f"infonce_loss-{algorithm}"] = (
        lambda: leaves((2, 5, 16)),
        lambda p, a=algorithm: ik.infonce_loss(p, embeds, targets, tau=0.7, backend="triton", algorithm=a))
    cases[f"select_actions-{algorithm}"] = (  # sampling: the seed is drawn in the graph too
        lambda: [torch.randn(2, 5, 16)],
        lambda p, a=algorithm: ik.select_actions(p, embeds, backend="triton", algorithm=a))


def stand_in(gm, example_inputs):
    # Zeros of the graph's output shapes: the traced kernels need a GPU to run.
    outputs = [getattr(node, "meta", {}).get("val") for node in gm.graph.output_node().args[0]]
    graphs.append(gm)
    return make_boxed_func(lambda *args: [torch.zeros(o.shape, dtype=o.dtype) if isinstance(o, torch.Tensor) else o
                                          for o in outputs])


for name, (make_inputs, call) in cases.items():
    graphs = []
    torch._dynamo.reset()
    compiled = torch.compile(call, fullgraph=True, backend=aot_autograd(fw_compiler=stand_in, bw_compiler=stand_in))
    out = compiled(*make_inputs())
    if out.requires_grad:
        out.float().sum().backward()
    called = [[str(node.target) for node in gm.graph.nodes if node.op == "call_function"] for gm in graphs]
    print(json.dumps({"case": name, "kernels": [sum("triton_kernel_wrapper" in target for target in graph)
                                                for graph in called],
                      "icrl_ops": [target for graph in called for target in graph if target.startswith("icrl.")]}))
"""

#: Triton kernels in the forward and backward graphs of each case of ``_TRACE_INTO_KERNELS``.
TRACED_KERNELS = {
    "ngram_attention-sort": [4, 1],  # the plan's rank, key and meta kernels, the forward; the backward
    "ngram_attention-tiled": [1, 1],
    "mixture_of_heads": [1, 1],
    "smeared_keys": [1, 2],  # forward; backward and its alpha-gradient kernel
    "inject_layer_norm": [1, 2],  # forward; backward and the parameters' gradients
    "gated_attention": [1, 5],  # forward; preprocess, dk/dv, dq, and smeared keys' two backward kernels
    # The small and chunked algorithms compute the gradients in the forward (the backward scales them); a selection
    # has no backward graph.
    **{f"infonce_loss-{algorithm}": [1, 0] for algorithm in ("small", "row_chunks", "action_chunks")},
    "infonce_loss-fused": [1, 2],  # forward; the backward's grad_pred and grad_embeds kernels
    **{f"select_actions-{algorithm}": [1] for algorithm in ("small", "fused", "row_chunks", "action_chunks")},
}


@pytest.mark.slow  # a fresh Python compiles fourteen functions (about 12 s)
@pytest.mark.skipif(torch.cuda.is_available(), reason="the CUDA tests compile and run the ops for real")
def test_traceable_ops_compile_into_their_kernels():
    """Without the interpreter the ops are ``triton_op`` s: ``torch.compile(fullgraph=True)`` of each public
    function (each InfoNCE algorithm of both contrastive ops) has no graph break and traces through the op into its
    Triton kernels: the forward graph, and the backward graph of a differentiable op, hold the kernels (as many as
    pinned) and no ``icrl`` op. The kernels are traced, not run (no GPU here); the values and gradients of compiled
    calls are checked under the interpreter (``test_compile_keeps_the_op_in_the_graph`` and each op's compile
    test)."""
    from benchmarks.kernel_tools import run_offline_compile

    reports = {report["case"]: report for report in run_offline_compile(_TRACE_INTO_KERNELS)}
    assert set(reports) == set(TRACED_KERNELS)
    for case, report in reports.items():
        assert not report["icrl_ops"], report
        assert report["kernels"] == TRACED_KERNELS[case], report


@pytest.mark.skipif("cpu" not in triton_devices(), reason="needs TRITON_INTERPRET=1 (the Triton path on CPU tensors)")
def test_triton_host_overhead_measure_counts_launches_and_restores_them():
    """``benchmarks/dispatch_overhead.py --triton-host``: every op's Triton path runs with its kernels
    stubbed (launches counted, nothing executed), and the real launches and value checks are back after."""
    from benchmarks import dispatch_overhead
    from icrl_kernels import _triton
    from icrl_kernels.ngram import kernels as ngram_kernels

    checks = ik.value_checks()
    rows = {row["op"]: row for row in dispatch_overhead.triton_host_rows(repeats=1)}
    assert set(rows) == set(dispatch_overhead._cases())
    for name, row in rows.items():
        assert row["triton_launches"] >= 1 and row["triton_host_us"] > 0, name
    # int64 ids, n = 2: the plan's rank, key and meta kernels and the forward and backward kernels.
    assert rows["ngram_attention (sort path)"]["triton_launches"] == 5
    assert ngram_kernels.launch is _triton.launch and ik.value_checks() == checks


#: Kernels launched by one forward + backward call of each op's Triton path on the tiny inputs of
#: ``benchmarks/dispatch_overhead.py`` (value checks off): (Triton launches, other PyTorch kernel ops). Each
#: launch costs host time on a GPU (issue: a lean host path for every op), so the counts are pinned: a change
#: that adds a launch fails here; one that removes a launch lowers its entry.
LAUNCHES_PER_CALL = {
    "ngram_attention": (2, 2),  # the tiled kernel; no zero gradient made for its match counts
    "ngram_attention (sort path)": (5, 4),
    "infonce_loss": (1, 4),  # A = 8: the small algorithm, its kernel counts the mean (contrastive/small_kernels.py)
    "select_actions (no grad)": (1, 0),  # argmax: no seed drawn, the placeholder made once per device
    "mixture_of_heads": (2, 2),
    # The harness's two ops and autograd's copy of the one gradient of y and prompt into the second leaf's .grad
    # (as for y + prompt; the kernel writes it once); the unused hidden output's gradient is never materialised.
    "inject_layer_norm": (2, 3),
    # Forward, backward preprocess, dk/dv, dq; the harness's two ops (lse's zero gradient no longer made).
    "gated_attention": (4, 2),
    "gated_attention (gated, smeared)": (6, 2),  # + smeared keys' backward and its alpha-gradient kernel
    "smeared_keys": (3, 2),  # the alpha gradient's reduction is a kernel, not 5 PyTorch ops
}


@pytest.mark.skipif("cpu" not in triton_devices(), reason="needs TRITON_INTERPRET=1 (the Triton path on CPU tensors)")
def test_launches_per_call_are_pinned():
    from benchmarks import dispatch_overhead
    from icrl_kernels._library import set_output_poisoning

    poisoning = set_output_poisoning(False)  # the tests' NaN fill of new outputs is one more op per output
    try:
        rows = {row["op"]: row for row in dispatch_overhead.triton_host_rows(repeats=1)}
    finally:
        set_output_poisoning(poisoning)
    counted = {name: (row["triton_launches"], row["torch_kernel_ops"]) for name, row in rows.items()}
    assert counted == LAUNCHES_PER_CALL, "launches per call changed (Triton, PyTorch): update the pin if they fell"


#: Most Python frames from a public function (itself included) to the function that launches a kernel: on
#: a GPU each frame is host time before the launch. The fast path is public function -> the op's
#: ``__call__`` -> (autograd.Function.apply, in C) -> the op's forward -> the launcher.
MAX_FRAMES_TO_LAUNCH = 5


@pytest.mark.skipif("cpu" not in triton_devices(), reason="needs TRITON_INTERPRET=1 (the Triton path on CPU tensors)")
@pytest.mark.parametrize("grad", [True, False], ids=["grad", "no-grad"])
def test_public_functions_are_few_frames_from_their_launches(grad):
    import sys

    from benchmarks import dispatch_overhead

    names = ("ngram_attention", "mixture_of_heads", "inject_layer_norm", "gated_attention", "smeared_keys",
             "infonce_loss", "select_actions")  # fmt: skip
    public = {name: getattr(ik, name).__code__ for name in names}
    depths: dict[str, int] = {}

    def on_launch(kernel):
        frame, depth = sys._getframe(2), 1  # the launcher (1: this hook, the stub's launch)
        while frame is not None and frame.f_code not in public.values():
            frame, depth = frame.f_back, depth + 1
        if frame is not None:
            depths[f"{frame.f_code.co_name}:{kernel}"] = max(depth, depths.get(f"{frame.f_code.co_name}:{kernel}", 0))

    cases = {name: case for name, case in dispatch_overhead._cases().items() if name.split(" ")[0] in public}
    with dispatch_overhead.stubbed_kernel_launches(on_launch), torch.set_grad_enabled(grad):
        previous = ik.set_value_checks("off")
        try:
            for case in cases.values():
                case.ours("triton", *case.make_inputs())
        finally:
            ik.set_value_checks(previous)
    assert {key.split(":")[0] for key in depths} == set(public)
    assert max(depths.values()) <= MAX_FRAMES_TO_LAUNCH, depths


def test_host_size_arithmetic_equals_tritons():
    """The launchers' plain-Python ``cdiv`` / ``next_power_of_2`` (Triton's are constexpr functions, microseconds
    a host call) give Triton's values."""
    triton = pytest.importorskip("triton")
    from icrl_kernels._triton import cdiv, next_power_of_2

    for n in [0, 1, 2, 3, 4, 5, 63, 64, 65, 1000, 4096, 4097, 2**31 - 1, 2**31, 2**40 + 3]:
        assert next_power_of_2(n) == triton.next_power_of_2(n), n
        for d in (1, 2, 3, 16, 64, 127):
            assert cdiv(n, d) == triton.cdiv(n, d), (n, d)


@pytest.mark.parametrize("value", [None, "1", "0", "", "true", "on", "no", " 1 ", "TRUE", "Off", "2"])
def test_interpreter_flag_follows_os_environ(monkeypatch, value):
    """``triton_interpreter_enabled`` (read on every CPU call, from os.environ's own dict) sees every write
    through ``os.environ`` and parses like ``os.environ.get`` would."""
    from icrl_kernels._backend import triton_interpreter_enabled

    if value is None:
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    else:
        monkeypatch.setenv("TRITON_INTERPRET", value)
    expected = os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "yes", "on")
    assert triton_interpreter_enabled() == expected
