"""The torch internals the package uses (``icrl_kernels._torch_compat``): each exists in the installed torch
and does what the package relies on, and no other module of the package touches a private torch name.

CI runs this file on torch 2.13 (the CPU wheel) and the GPU runner on torch 2.11, the oldest torch
``pyproject.toml`` allows.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

import icrl_kernels as ik
from icrl_kernels import _library
from icrl_kernels import _torch_compat as compat

PACKAGE = Path(ik.__file__).parent

#: A private torch name: ``torch._x`` / ``torch._C`` / a CustomOpDef internal / a class swap.
_PRIVATE = re.compile(r"\btorch\._\w+|\b_C\.|\._opoverload\b|\._torch_dispatch_fns\b|\.__class__\s*=")


def test_private_torch_names_only_in_the_compat_module():
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.name == "_torch_compat.py":
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            code = line.split("#", 1)[0]
            if _PRIVATE.search(code) and "``" not in code:  # docstrings may name them in ``literals``
                offenders.append(f"{path.relative_to(PACKAGE.parent)}:{number}: {line.strip()}")
    assert not offenders, "private torch names outside _torch_compat:\n" + "\n".join(offenders)


def test_the_fast_path_has_every_probe():
    assert compat.FAST_PATH_SUPPORTED
    assert compat._any_requires_grad_c is not None and compat._c_apply is not None


def test_probes_are_quiet_in_plain_eager_code():
    assert compat.dispatch_mode_depth() == 0
    assert not compat.function_mode_enabled()
    assert compat.jit_tracing_state() is None
    assert compat.functorch_transform() is None
    assert _library._plain_eager_call((torch.ones(2), torch.nn.Parameter(torch.ones(2)), "x", 1.0))


def test_dispatch_mode_probe_sees_fake_tensors():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        assert compat.dispatch_mode_depth() > 0
        assert not _library._plain_eager_call(())


def test_function_mode_probe_sees_a_device_context():
    with torch.device("cpu"):
        assert compat.function_mode_enabled()


@pytest.mark.filterwarnings("ignore:`torch.jit.trace` is deprecated:DeprecationWarning")
def test_jit_probe_sees_tracing():
    seen = []

    def traced(x):
        seen.append(compat.jit_tracing_state() is not None)
        return x * 2

    torch.jit.trace(traced, (torch.ones(2),), check_trace=False)
    assert seen == [True]


@pytest.mark.parametrize("transform", ["vmap", "grad"])
def test_functorch_probe_sees_transforms(transform):
    seen = []

    def fn(x):
        seen.append(compat.functorch_transform() is not None)
        return (x * x).sum()

    if transform == "vmap":
        torch.vmap(fn)(torch.ones(3, 2))
    else:
        torch.func.grad(fn)(torch.ones(2))
    assert seen == [True]


def test_any_requires_grad_matches_the_python_loop():
    plain, leaf = torch.ones(2), torch.ones(2, requires_grad=True)
    for args in [(), (plain,), (plain, None, "x", 3), (leaf,), (plain, leaf), (None, 1.0, leaf)]:
        assert compat.any_requires_grad(*args) == compat._any_requires_grad_fallback(*args), args


def _toy_function():
    calls = []

    def forward(x, scale):
        calls.append("forward")
        return x * scale

    def setup_context(ctx, inputs, output):
        calls.append("setup_context")
        ctx.scale = inputs[1]

    def backward(ctx, grad):
        return grad * ctx.scale, None

    function = type(
        "Toy",
        (torch.autograd.Function,),
        {"forward": staticmethod(forward), "setup_context": staticmethod(setup_context),
         "backward": staticmethod(backward)},
    )  # fmt: skip
    return function, calls


def test_direct_apply_is_function_apply():
    function, calls = _toy_function()
    x = torch.randn(4, requires_grad=True)
    out = compat.direct_apply(function)(x, 3.0)
    assert calls == ["forward", "setup_context"]
    assert type(out.grad_fn).__name__ == "ToyBackward"
    (grad,) = torch.autograd.grad(out.sum(), x)
    expected = function.apply(x, 3.0)
    (expected_grad,) = torch.autograd.grad(expected.sum(), x)
    assert torch.equal(out, expected) and torch.equal(grad, expected_grad)


def test_reclass_keeps_the_registered_op():
    op = torch.library.custom_op(
        "icrl::compat_test_reclass", lambda x: x * 2, mutates_args=(), schema="(Tensor x) -> Tensor"
    )
    op.register_fake(lambda x: torch.empty_like(x))

    class Sub(type(op)):
        def __call__(self, *args):
            return "fast"

    assert compat.reclass_custom_op(op, Sub) is op and type(op) is Sub
    assert op(torch.ones(2)) == "fast"
    assert torch.equal(torch.ops.icrl.compat_test_reclass(torch.ones(2)), torch.full((2,), 2.0))  # the op itself
    torch.library.opcheck(op, (torch.randn(3),))
    with pytest.raises(TypeError, match="must subclass"):
        compat.reclass_custom_op(op, type("Unrelated", (), {}))


def _plus_one(x: torch.Tensor) -> torch.Tensor:
    return x + 1


def test_triton_op_decomposition_rule_is_found():
    custom = torch.library.custom_op("icrl::compat_test_custom", _plus_one, mutates_args=())
    assert compat.triton_op_decomposition(custom) is None
    triton_op = torch.library.triton_op("icrl::compat_test_triton", _plus_one, mutates_args=())
    assert callable(compat.triton_op_decomposition(triton_op))
    assert issubclass(compat.functional_tensor_mode(), torch.utils._python_dispatch.TorchDispatchMode)
    assert compat.export_keeps_triton_ops_whole() is False  # outside torch.export


def test_assert_async_fails_only_when_false():
    compat.assert_async(torch.tensor(True), "never")
    with pytest.raises(RuntimeError):
        compat.assert_async(torch.tensor(False), "expected")


def test_batched_tensors_under_vmap():
    seen = []

    def fn(x):
        seen.append((compat.is_batched_tensor(x), tuple(compat.unwrap_batched(x).shape)))
        return x

    torch.vmap(fn)(torch.ones(5, 3))
    assert seen == [(True, (5, 3))]
    assert not compat.is_batched_tensor(torch.ones(3))


def test_vmap_rules_of_torch_operators_are_registered():
    """``register_aten_vmap`` finds every functorch entry it needs; the package's rule (SDPA's CPU flash kernel,
    ``test_vmap_rules.py``) is registered."""
    assert compat._BATCHED_KEY is not None
    assert all(hasattr(compat._functorch, entry) for entry in compat._VMAP_ENTRIES)
    assert len(compat._vmap_libraries) >= 1
