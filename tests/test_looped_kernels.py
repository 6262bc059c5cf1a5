"""Fused input injection + LayerNorm (looped transformers): Triton and eager paths against the fp32
reference (both outputs, every gradient from both upstream gradients), optional inputs, strides,
mixed parameter dtypes, the custom-op registration and argument errors.

Every test draws fresh random inputs; kernel outputs and the backward's partial sums start
NaN-poisoned (tests/conftest.py).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from benchmarks.kernel_tools import run_offline_compile
from icrl_kernels import inject_layer_norm, inject_layer_norm_reference, resolve_backend
from icrl_kernels.looped.function import inject_layer_norm_backward_op, inject_layer_norm_op
from icrl_kernels.testing import (
    RMS_TOLERANCE,
    TESTED_DTYPES,
    assert_close_rel,
    fast_impls,
    fast_paths,
    triton_devices,
)

FAST_PATHS = fast_paths()
IMPLS = fast_impls()
DTYPES = list(TESTED_DTYPES)
NAMES = ("y", "prompt", "pos", "weight", "bias")


def random_inputs(
    batch, length, width, *, dtype=torch.float32, param_dtype=None, device="cpu", seed=0,
    has_y=True, has_pos=True, has_bias=True,
):  # fmt: skip
    """``(y, prompt, pos, weight, bias)`` as leaves; a non-zero mean and spread per row, so the
    normalisation matters; ``param_dtype`` (default ``dtype``) for ``pos``, ``weight``, ``bias``."""
    gen = torch.Generator().manual_seed(seed)
    param_dtype = param_dtype or dtype

    def draw(*shape, scale=1.0, shift=0.0, dt=dtype):
        return (shift + scale * torch.randn(*shape, generator=gen)).to(device=device, dtype=dt)

    y = draw(batch, length, width, scale=2.0, shift=0.5) if has_y else None
    prompt = draw(batch, length, width, shift=-0.3)
    pos = draw(length, width, scale=0.5, dt=param_dtype) if has_pos else None
    weight = draw(width, scale=0.3, shift=1.0, dt=param_dtype)
    bias = draw(width, scale=0.5, dt=param_dtype) if has_bias else None
    return y, prompt, pos, weight, bias


def _leaves(tensors, requires_grad=True):
    return [t.detach().clone().requires_grad_(requires_grad) if t is not None else None for t in tensors]


def check_parity(inputs, backend, *, upstream=("hidden", "normed"), frozen=(), eps=1e-5, grad_layout=None):
    """Outputs and the gradient of every input not in ``frozen`` against the reference evaluated in
    fp32 on the same values. ``upstream`` says which outputs receive a (random) gradient;
    ``grad_layout(name, grad)`` maps a contiguous upstream gradient to the layout handed to autograd."""
    leaves = [
        t.detach().requires_grad_(name not in frozen) if t is not None else None for name, t in zip(NAMES, inputs)
    ]
    refs = [t.detach().float().requires_grad_(name not in frozen) if t is not None else None
            for name, t in zip(NAMES, inputs)]  # fmt: skip
    hidden, normed = inject_layer_norm(*leaves, eps=eps, backend=backend)
    hidden_ref, normed_ref = inject_layer_norm_reference(*refs, eps=eps)
    dtype = inputs[1].dtype
    for name, out, ref in (("hidden", hidden, hidden_ref), ("normed", normed, normed_ref)):
        assert out.dtype == dtype and out.shape == inputs[1].shape and out.is_contiguous()
        assert_close_rel(out, ref, rms_tol=RMS_TOLERANCE[dtype], name=f"{backend} {name}")

    gen = torch.Generator().manual_seed(99)
    grads_out = {name: torch.randn(inputs[1].shape, generator=gen).to(hidden) for name in upstream}
    if grad_layout is not None:
        grads_out = {name: grad_layout(name, grad) for name, grad in grads_out.items()}
    outs = {"hidden": hidden, "normed": normed}
    outs_ref = {"hidden": hidden_ref, "normed": normed_ref}
    wanted = [i for i, (name, t) in enumerate(zip(NAMES, inputs)) if t is not None and name not in frozen]
    grads = torch.autograd.grad(
        [outs[name] for name in upstream],
        [leaves[i] for i in wanted],
        [grads_out[name] for name in upstream],
        allow_unused=True,
    )
    grads_ref = torch.autograd.grad(
        [outs_ref[name] for name in upstream], [refs[i] for i in wanted],
        [grads_out[name].float() for name in upstream], allow_unused=True,
    )  # fmt: skip
    for i, grad, grad_ref in zip(wanted, grads, grads_ref):
        name = NAMES[i]
        if grad_ref is None:  # e.g. weight and bias with only d_hidden upstream
            assert grad is None or not grad.any(), f"{backend} grad {name}: expected none or zero"
            continue
        assert grad is not None, f"{backend} grad {name} is missing"
        assert grad.dtype == inputs[i].dtype and grad.shape == inputs[i].shape, name
        # Gradients of fp32 parameters still inherit the rounding of the half-precision activations.
        assert_close_rel(grad, grad_ref, rms_tol=RMS_TOLERANCE[dtype], name=f"{backend} grad {name}")
    return grads


# Under the interpreter the grid has at most 4 programs (tile 8 x 256 at D = 256, one position block
# otherwise here), so a batch above 4 makes each program loop over several batch entries.
SHAPES = [
    (2, 7, 37),  # odd width, rows not a multiple of any block
    (10, 3, 96),  # width not a power of two; 4 chunks of 3 batch entries, the last one short
    (5, 12, 256),  # the looped-transformer width; a 2 x 2 grid (position blocks x batch chunks of 3 and 2)
    (4, 1, 5),  # L = 1
    (1, 1, 5),  # B * L = 1
]


@pytest.mark.parametrize("backend,device", FAST_PATHS)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_parity(backend, device, dtype, shape):
    check_parity(random_inputs(*shape, dtype=dtype, device=device, seed=sum(shape)), backend)


@pytest.mark.parametrize("backend,device", FAST_PATHS)
@pytest.mark.parametrize(
    "has_y,has_pos,has_bias",
    [(False, True, True), (True, False, True), (True, True, False), (False, False, False)],
    ids=["y0", "no-pos", "no-bias", "prompt-only"],
)
def test_optional_inputs(backend, device, has_y, has_pos, has_bias):
    inputs = random_inputs(2, 6, 21, device=device, seed=1, has_y=has_y, has_pos=has_pos, has_bias=has_bias)
    check_parity(inputs, backend)


@pytest.mark.parametrize("backend,device", FAST_PATHS)
@pytest.mark.parametrize("upstream", [("hidden",), ("normed",)], ids=lambda u: u[0])
def test_upstream_gradient_on_one_output(backend, device, upstream):
    check_parity(random_inputs(3, 5, 19, device=device, seed=2), backend, upstream=upstream)


@pytest.mark.parametrize("backend,device", FAST_PATHS)
@pytest.mark.parametrize(
    "frozen", [("y",), ("prompt",), ("pos", "weight"), ("bias",), ("y", "prompt")], ids=lambda f: "-".join(f)
)
def test_some_inputs_need_no_gradient(backend, device, frozen):
    """The backward skips what nobody asked for (frozen LayerNorm, a detached iterate) and still gets the rest."""
    check_parity(random_inputs(2, 5, 13, device=device, seed=3), backend, frozen=frozen)


@pytest.mark.parametrize("backend,device", FAST_PATHS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=lambda d: str(d).removeprefix("torch."))
def test_strided_inputs_and_upstream_gradients(backend, device, dtype):
    """Sequence-major buffers seen as ``[B, L, D]``, a feature slice, a transposed ``pos`` and permuted gradients."""
    batch, length, width = 7, 6, 20  # 7: programs step their pointers across batch entries
    y, prompt, pos, weight, bias = random_inputs(batch, length, width, dtype=dtype, device=device, seed=4)
    y = y.transpose(0, 1).contiguous().transpose(0, 1)  # [L, B, D] storage
    prompt = torch.cat([prompt, prompt], dim=-1)[..., ::2]  # feature stride 2
    pos = pos.t().contiguous().t()  # [D, L] storage
    assert not (y.is_contiguous() or prompt.is_contiguous() or pos.is_contiguous())

    def grad_layout(name, grad):  # two different layouts, so the kernel cannot mix up their strides
        if name == "hidden":
            return grad.transpose(0, 1).contiguous().transpose(0, 1)
        return grad.permute(2, 0, 1).contiguous().permute(1, 2, 0)

    check_parity((y, prompt, pos, weight, bias), backend, grad_layout=grad_layout)


@pytest.mark.parametrize("backend,device", FAST_PATHS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=lambda d: str(d).removeprefix("torch."))
def test_fp32_parameters_with_half_activations(backend, device, dtype):
    """What autocast hands the op: half-precision activations, fp32 ``pos``/``weight``/``bias``; each
    gradient comes back in its input's dtype."""
    check_parity(random_inputs(2, 7, 24, dtype=dtype, param_dtype=torch.float32, device=device, seed=5), backend)


@pytest.mark.parametrize("backend", ["eager", "reference"] + (["triton"] if triton_devices() else []))
def test_under_autocast(backend):
    """Under CPU bf16 autocast a Linear read-in yields bf16 ``prompt`` while the parameters stay fp32; the
    op runs as is (custom ops are not autocast) and returns bf16."""
    torch.manual_seed(6)
    read_in = torch.nn.Linear(5, 16)
    ln = torch.nn.LayerNorm(16)
    pos = torch.nn.Parameter(0.1 * torch.randn(9, 16))
    x = torch.randn(2, 9, 5)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        prompt = read_in(x)
        hidden, normed = inject_layer_norm(None, prompt, pos, ln.weight, ln.bias, backend=backend)
    assert prompt.dtype == hidden.dtype == normed.dtype == torch.bfloat16
    hidden_ref, normed_ref = inject_layer_norm_reference(None, prompt.float(), pos, ln.weight, ln.bias)
    assert_close_rel(normed, normed_ref, name="autocast normed")
    normed.float().square().sum().backward()
    assert pos.grad.dtype == ln.weight.grad.dtype == read_in.weight.grad.dtype == torch.float32
    assert torch.isfinite(read_in.weight.grad).all()


def test_reference_is_torch_layer_norm():
    """The spec equals ``F.layer_norm(y + prompt + pos)`` (biased variance, eps inside the root) in fp64."""
    y, prompt, pos, weight, bias = random_inputs(2, 5, 11, dtype=torch.float64, seed=7)
    hidden, normed = inject_layer_norm_reference(y, prompt, pos, weight, bias, eps=1e-3)
    torch.testing.assert_close(hidden, y + prompt + pos)
    torch.testing.assert_close(normed, F.layer_norm(y + prompt + pos, (11,), weight, bias, eps=1e-3))
    hidden, normed = inject_layer_norm_reference(None, prompt, None, weight, None)
    torch.testing.assert_close(normed, F.layer_norm(prompt, (11,), weight, None))


@pytest.mark.parametrize("backend", ["eager", "reference"])
def test_float64_gradcheck(backend):
    y, prompt, pos, weight, bias = _leaves(random_inputs(2, 3, 5, dtype=torch.float64, seed=8))
    fn = lambda *args: inject_layer_norm(*args, eps=1e-2, backend=backend)  # noqa: E731
    assert torch.autograd.gradcheck(fn, (y, prompt, pos, weight, bias))
    assert torch.autograd.gradcheck(lambda p, w: fn(None, p, None, w, None), (prompt, weight))


@pytest.mark.skipif(not triton_devices(), reason="needs TRITON_INTERPRET=1 or CUDA")
def test_wide_offsets_path(monkeypatch):
    """The 64-bit in-entry offsets (chosen for slices of 2^31+ elements) compute the same thing."""
    from icrl_kernels.looped import kernels

    configs = (kernels._forward_config, kernels._backward_config)  # cached per signature: recomputed here
    monkeypatch.setattr(kernels, "_needs_wide_offsets", lambda *args: True)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        for config in configs:
            config.cache_clear()
        check_parity(random_inputs(5, 9, 21, device=device, seed=21), "triton")
    finally:
        for config in configs:
            config.cache_clear()


@pytest.mark.parametrize("backend,device", FAST_PATHS)
def test_gradients_are_deterministic(backend, device):
    inputs = _leaves(random_inputs(5, 9, 30, device=device, seed=9))
    gen = torch.Generator().manual_seed(10)
    grad_hidden, grad_normed = (torch.randn(5, 9, 30, generator=gen).to(device) for _ in range(2))

    def grads():
        hidden, normed = inject_layer_norm(*inputs, backend=backend)
        return torch.autograd.grad((hidden, normed), inputs, (grad_hidden, grad_normed))

    for first, second in zip(grads(), grads()):
        assert torch.equal(first, second)


@pytest.mark.parametrize("backend,device", FAST_PATHS)
def test_y_and_prompt_share_one_gradient(backend, device):
    """The backward writes ``d_x`` once and autograd hands it to both ``y`` and ``prompt``, as for ``y + prompt``;
    accumulated into leaves' ``.grad`` it becomes two tensors (autograd copies a gradient it cannot own)."""
    y, prompt, *rest = _leaves(random_inputs(2, 3, 8, device=device, seed=11))
    hidden, normed = inject_layer_norm(y, prompt, *rest, backend=backend)
    grad_y, grad_prompt = torch.autograd.grad(normed.sum() + hidden.sum(), (y, prompt))
    assert torch.equal(grad_y, grad_prompt)
    hidden, normed = inject_layer_norm(y, prompt, *rest, backend=backend)
    (normed.sum() + hidden.sum()).backward()
    assert torch.equal(y.grad, grad_y) and torch.equal(prompt.grad, grad_y)
    assert y.grad.data_ptr() != prompt.grad.data_ptr()


@pytest.mark.parametrize("backend", ["eager", "reference"] + (["triton"] if triton_devices() else []))
def test_empty_batch(backend):
    device = "cuda" if backend == "triton" and torch.cuda.is_available() else "cpu"
    y, prompt, pos, weight, bias = random_inputs(0, 4, 6, device=device, seed=12)
    hidden, normed = inject_layer_norm(y, prompt, pos, weight, bias, backend=backend)
    assert hidden.shape == normed.shape == (0, 4, 6)


@pytest.mark.parametrize("backend", IMPLS)
def test_modifying_hidden_in_place_is_caught(backend):
    """The backward reads ``hidden``: an in-place residual add must fail loudly, not corrupt the gradient."""
    inputs = _leaves(random_inputs(2, 3, 8, seed=13))
    hidden, normed = inject_layer_norm(*inputs, backend=backend)
    hidden += normed
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        hidden.sum().backward()


# --- custom-op registration, compile, errors ------------------------------------------------------


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("optional", [True, False], ids=["all-inputs", "y0-no-pos-no-bias"])
def test_opcheck(impl, optional):
    device = "cuda" if impl == "triton" and torch.cuda.is_available() else "cpu"
    y, prompt, pos, weight, bias = random_inputs(
        2, 5, 12, device=device, seed=14, has_y=optional, has_pos=optional, has_bias=optional
    )
    if optional:  # a strided iterate, as a [L, B, D] buffer
        y = y.transpose(0, 1).contiguous().transpose(0, 1)
    args = (*_leaves((y, prompt, pos, weight, bias)), 1e-5, impl)
    torch.library.opcheck(inject_layer_norm_op, args)
    hidden, _ = inject_layer_norm_op(*args)
    gen = torch.Generator().manual_seed(15)
    grad_hidden, grad_normed = (torch.randn(2, 5, 12, generator=gen).to(device) for _ in range(2))
    needs = [optional, True, optional, True, optional]  # y, prompt, pos, weight, bias
    dtypes = [t.dtype if t is not None else None for t in (pos, bias)]
    backward_args = (grad_hidden, grad_normed.transpose(0, 1).contiguous().transpose(0, 1), hidden.detach(),
                     weight, 1e-5, *dtypes, impl, needs)  # fmt: skip
    torch.library.opcheck(inject_layer_norm_backward_op, backward_args)


@pytest.mark.parametrize("backend", IMPLS)
def test_compiles_fullgraph(backend):
    """A custom op is opaque to Dynamo: the public function (validation included) compiles without breaks."""
    inputs = _leaves(random_inputs(2, 6, 10, seed=16))

    def step(y, prompt, pos, weight, bias):
        hidden, normed = inject_layer_norm(y, prompt, pos, weight, bias, backend=backend)
        return hidden, normed, (hidden * normed).sum()

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    hidden, normed, loss = compiled(*inputs)
    hidden_ref, normed_ref, loss_ref = step(*inputs)
    assert_close_rel(normed, normed_ref, name="compiled normed")
    for grad, grad_ref in zip(torch.autograd.grad(loss, inputs), torch.autograd.grad(loss_ref, inputs)):
        assert_close_rel(grad, grad_ref, name="compiled grad")


@pytest.mark.parametrize(
    "make_args,error,match",
    [
        (lambda y, p, e, w, b: (y[:, :-1], p, e, w, b), ValueError, r"y must have shape prompt.shape"),
        (lambda y, p, e, w, b: (y, p[0], e, w, b), ValueError, "prompt must be 3-D"),
        (lambda y, p, e, w, b: (y, p, e[:-1], w, b), ValueError, r"pos must have shape \(prompt.shape\[1\]"),
        (lambda y, p, e, w, b: (y, p, e[None], w, b), ValueError, "pos must be 2-D"),
        (lambda y, p, e, w, b: (y, p, e, w[:-1], b), ValueError, r"weight must have shape \(prompt.shape\[2\],\)"),
        (lambda y, p, e, w, b: (y, p, e, w, b[:-1]), ValueError, r"bias must have shape \(prompt.shape\[2\],\)"),
        (lambda y, p, e, w, b: (y.long(), p, e, w, b), TypeError, "y must have dtype"),
        (lambda y, p, e, w, b: (y, p.int(), e, w, b), TypeError, "prompt must have dtype"),
        (lambda y, p, e, w, b: (y, p, e.long(), w, b), TypeError, "pos must have dtype"),
        (lambda y, p, e, w, b: (y, p, e, w.long(), b), TypeError, "weight must have dtype"),
        (lambda y, p, e, w, b: (y.half(), p, e, w, b), TypeError, "y must have prompt's dtype"),
        (lambda y, p, e, w, b: ([1.0], p, e, w, b), TypeError, "y must be a torch.Tensor"),
        (lambda y, p, e, w, b: (y, p, e.to("meta"), w, b), ValueError, "pos is on meta but prompt is on cpu"),
        (lambda y, p, e, w, b: (y, p, e, w, b.to("meta")), ValueError, "bias is on meta but prompt is on cpu"),
        (lambda y, p, e, w, b: (y, p[..., :0], e[:, :0], w[:0], b[:0]), ValueError, "nonzero model width"),
    ],
)
def test_bad_input_names_the_argument(make_args, error, match):
    inputs = random_inputs(2, 3, 4, seed=17)
    with pytest.raises(error, match=match):
        inject_layer_norm(*make_args(*inputs))


@pytest.mark.parametrize("eps", [0.0, -1e-5, float("nan")])
def test_bad_eps(eps):
    with pytest.raises(ValueError, match="eps must be > 0"):
        inject_layer_norm(*random_inputs(1, 2, 3, seed=18), eps=eps)


def test_bad_backend():
    with pytest.raises(ValueError, match="backend must be one of"):
        inject_layer_norm(*random_inputs(1, 2, 3, seed=19), backend="cuda")


@pytest.mark.skipif(not triton_devices(), reason="needs TRITON_INTERPRET=1 or CUDA")
def test_triton_rejects_float64():
    device = "cuda" if torch.cuda.is_available() else "cpu"
    assert resolve_backend("auto", torch.device(device)) == "triton"
    y, prompt, pos, weight, bias = random_inputs(1, 2, 3, device=device, seed=20)
    with pytest.raises(TypeError, match="prompt must be float16, bfloat16 or float32"):
        inject_layer_norm(None, prompt.double(), pos, weight, bias, backend="triton")
    with pytest.raises(TypeError, match="weight must be float16, bfloat16 or float32"):
        inject_layer_norm(y, prompt, pos, weight.double(), bias, backend="triton")


# --- compiled (non-interpreter) kernels, without a GPU --------------------------------------------

_OFFLINE_COMPILE = """
from icrl_kernels.looped import kernels
from benchmarks.kernel_tools import CompileJob, compile_offline

FP32_POINTERS = {"mean_ptr", "rstd_ptr", "pos_partial_ptr", "weight_partial_ptr", "bias_partial_ptr"}


def job(fn, activation, constexprs, num_warps, **info):
    signature = {
        name: ("*fp32" if name in FP32_POINTERS else "*" + activation) if name.endswith("_ptr")
        else "fp32" if name == "eps" else "i32"
        for name in fn.arg_names if name not in constexprs
    }
    # Triton specialises integer arguments equal to 1 (a contiguous feature stride) into constants.
    for name in ("stride_yd", "stride_pd", "stride_ed", "stride_hd", "stride_nd", "stride_w", "stride_bias"):
        if name in signature:
            signature[name] = 1
    return CompileJob(fn, signature, constexprs, num_warps, info={"dtype": activation, **info})


# The looped transformer's tile (benchmarks/bench_inject_layer_norm.py: D = 256, L = 81..201 all give the same
# tile) in bf16 and fp32 with every input, and a tiny tile with every flag flipped.
forward, backward = kernels._inject_layer_norm_forward_kernel, kernels._inject_layer_norm_backward_kernel
params = kernels._inject_layer_norm_param_grads_kernel
flags = ("HAS_GRAD_HIDDEN", "HAS_GRAD_NORMED", "WRITE_Y", "WRITE_PROMPT", "WANT_POS", "WANT_WEIGHT", "WANT_BIAS")
param_flags = ("WANT_POS", "WANT_WEIGHT", "WANT_BIAS")
jobs = []
for activation, on, wide, (L, D) in [("bf16", True, False, (201, 256)), ("fp32", True, False, (201, 256)),
                                     ("fp32", False, True, (3, 5))]:
    block_l, block_d, warps = kernels.tile_shape(L, D)
    blocks = {"WIDE": wide, "BLOCK_L": block_l, "BLOCK_D": block_d}
    param_blocks = {**dict.fromkeys(param_flags, True), "BLOCK": kernels._PARAM_BLOCK}
    jobs += [job(forward, activation, dict(HAS_Y=on, HAS_POS=on, HAS_BIAS=on, **blocks), warps, L=L, D=D, **blocks),
             job(backward, activation, {**dict.fromkeys(flags, on), **blocks}, warps, L=L, D=D, **blocks),
             job(params, activation, param_blocks, 4, L=L, D=D, BLOCK=kernels._PARAM_BLOCK)]
compile_offline(jobs)
"""


@pytest.mark.slow  # the exhaustive tier: every config compiled for sm_90 (docs/testing.md#test-tiers)
@pytest.mark.skipif(torch.cuda.is_available(), reason="the CUDA tests run the compiled kernels for real")
def test_kernels_compile_for_sm90_offline():
    """CI has no GPU and runs the kernels in the interpreter, which accepts code the compiler rejects
    (and the reverse): compile the three kernels to an sm_90 cubin (TTIR -> PTX -> ptxas) in a subprocess
    without ``TRITON_INTERPRET``, for the looped-transformer tile in bf16 and fp32 and a tiny one with every
    flag flipped, and check that none spills more than ``MAX_SPILL_BYTES`` per thread."""
    from benchmarks.kernel_tools import check_offline_reports

    reports = run_offline_compile(_OFFLINE_COMPILE)
    assert len(reports) == 9
    check_offline_reports(
        reports,
        {"_inject_layer_norm_forward_kernel", "_inject_layer_norm_backward_kernel",
         "_inject_layer_norm_param_grads_kernel"},
    )  # fmt: skip
