"""No op, launcher or module forward reads a tensor value on the host (a GPU stall).

Three layers: a static scan of the package's source for host reads; a CPU run of every op's forward
and backward (and every module's forward) under a dispatch mode that fails on any op whose result needs
a device value on the host, with value checks in their GPU mode (``"async"``); and on a GPU,
``torch.cuda.set_sync_debug_mode("error")`` around the same calls.

Value checks go through ``icrl_kernels._validation.check_values`` (or ``check_status_codes``, which
calls it), the one allowed place (their ``details`` text, built only when a synchronous check fails, may
read values).
"""

from __future__ import annotations

import ast
import contextlib
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch._library.custom_ops import _maybe_get_opdef
from torch.utils._python_dispatch import TorchDispatchMode

import icrl_kernels as ik
from icrl_kernels._backend import triton_runs_on

PACKAGE = Path(ik.__file__).parent
#: Files that may read values: the test helpers, and the checker itself.
ALLOWED_FILES = {"testing.py", "_validation.py"}
#: The value checks, whose arguments may read values (``details``, run only when a synchronous check fails).
VALUE_CHECKS = {"check_values", "check_status_codes"}
#: Methods that copy a device value to the host (or a whole tensor).
HOST_READ_METHODS = {"item", "tolist", "cpu", "numpy", "nonzero"}
#: Tensor reductions whose result, passed to bool()/int()/float() or tested by `if`, is a host read.
REDUCTIONS = {"any", "all", "max", "min", "sum", "amax", "amin", "count_nonzero", "mean", "prod"}


def _calls_reduction(node: ast.AST) -> bool:
    return any(
        isinstance(sub, ast.Call) and isinstance(sub.func, ast.Attribute) and sub.func.attr in REDUCTIONS
        for sub in ast.walk(node)
    )


def host_reads(source: str) -> list[tuple[int, str]]:
    """``(line, text)`` of every host read in ``source`` outside the arguments of ``check_values(...)``
    and ``check_status_codes(...)``."""
    tree = ast.parse(source)
    skipped: set[int] = set()
    for node in ast.walk(tree):  # the arguments of the value checks may read values (details on failure)
        if isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", "")) in VALUE_CHECKS:
            skipped.update(id(sub) for arg in node.args + [k.value for k in node.keywords] for sub in ast.walk(arg))
    found = []
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in HOST_READ_METHODS:
            found.append((node.lineno, f".{node.func.attr}()"))
        elif isinstance(node, ast.Call) and getattr(node.func, "id", None) in ("bool", "int", "float"):
            if node.args and _calls_reduction(node.args[0]):
                found.append((node.lineno, f"{node.func.id}(<tensor reduction>)"))
        elif isinstance(node, (ast.If, ast.While, ast.IfExp, ast.Assert)) and _calls_reduction(node.test):
            found.append((node.lineno, f"{type(node).__name__.lower()} on a tensor reduction"))
    return sorted(found)


def test_scanner_finds_host_reads():
    source = (
        "def f(x, check_values):\n"
        "    a = x.sum().item()\n"
        "    b = x.tolist()\n"
        "    if x.any():\n"
        "        pass\n"
        "    c = int(x.max())\n"
        "    check_values(x.any(), 'fine', lambda: str(x.tolist()))\n"
        "    check_status_codes(x, ((1, 'fine', lambda b: str(x[b].tolist())),), 'fine')\n"
        "    rules = ((1, 'not fine', lambda b: str(x[b].tolist())),)\n"
        "    return bool(flag)\n"
    )
    assert sorted(line for line, _ in host_reads(source)) == [2, 3, 4, 6, 9]


def test_package_source_has_no_host_reads():
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.name in ALLOWED_FILES:
            continue
        for line, what in host_reads(path.read_text()):
            offenders.append(f"{path.relative_to(PACKAGE.parent)}:{line}: {what}")
    assert not offenders, "host reads (GPU stalls) outside check_values:\n" + "\n".join(offenders)


# -- runtime: no host read while the ops run -----------------------------------------------------------
class HostReadDetector(TorchDispatchMode):
    """Records every dispatched op whose CUDA version would wait for the device: a value read on the host,
    or an output whose shape depends on values (``nonzero``, boolean indexing, ``unique``, ...)."""

    VALUE_DEPENDENT = {"nonzero", "masked_select", "unique", "_unique", "_unique2", "unique_consecutive", "unique_dim"}

    def __init__(self) -> None:
        super().__init__()
        self.reads: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.namespace == "icrl":  # a custom op: run its Python body with the mode on, to see inside
            opdef = _maybe_get_opdef(func)
            with self:
                return opdef._init_fn(*args, **kwargs)
        name = func.overloadpacket.__name__
        if name in ("_local_scalar_dense", "is_nonzero", "equal") or name in self.VALUE_DEPENDENT:
            self.reads.append(str(func))
        elif name in ("index", "index_put", "index_put_") and any(
            isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in (args[1] or ())
        ):
            self.reads.append(f"{func} with a boolean index")
        elif name == "repeat_interleave" and (kwargs or {}).get("output_size") is None and len(args) == 1:
            self.reads.append(f"{func} without output_size")
        return func(*args, **kwargs)


@contextlib.contextmanager
def gpu_value_checks():
    previous = ik.set_value_checks("async")
    try:
        yield
    finally:
        ik.set_value_checks(previous)


def _backward(out: torch.Tensor) -> None:
    if out.requires_grad:
        out.float().square().sum().backward()


def _op_cases(device: torch.device) -> dict[str, Callable[[str], torch.Tensor]]:
    """``name -> run(backend)``: forward (+ backward) of each public op on small valid inputs."""
    g = torch.Generator().manual_seed(0)
    # Drawn on the device itself: a copy from pageable CPU memory is a synchronising CUDA operation, and
    # the inputs of each run are drawn inside the checked region.
    g_device = torch.Generator(device=device).manual_seed(0)

    def rand(*shape, grad=True):
        return torch.randn(*shape, generator=g_device, device=device).requires_grad_(grad)

    ids = torch.randint(0, 3, (2, 40), generator=g).to(device)
    ids[1, -5:] = -1  # padding
    embeds = rand(12, 16, grad=False)
    targets = torch.randint(0, 12, (2, 9), generator=g).to(device)
    targets[0, 0] = -100
    mask = torch.ones(12, dtype=torch.bool, device=device)
    mask[3] = False
    targets[targets == 3] = 4

    def run_ngram(backend):
        out = ik.ngram_attention(rand(2, 40, 24), ids, 2, backend=backend)
        _backward(out)
        return out

    def run_infonce(backend):
        out = ik.infonce_loss(rand(2, 9, 16), embeds, targets, mask=mask, backend=backend)
        _backward(out)
        return out

    def run_select(backend):
        return ik.select_actions(rand(2, 9, 16, grad=False), embeds, mask=mask, backend=backend)

    def run_moa(backend):
        out = ik.mixture_of_heads(rand(2, 7, 3, 16), rand(2, 7, 3), backend=backend)
        _backward(out)
        return out

    def run_inject(backend):
        out = ik.inject_layer_norm(rand(2, 7, 32), rand(2, 7, 32), rand(7, 32), rand(32), rand(32), backend=backend)[1]
        _backward(out)
        return out

    def run_smeared(backend):
        out = ik.smeared_keys(rand(2, 3, 7, 16), rand(3), backend=backend)
        _backward(out)
        return out

    def run_gated_attention(backend):
        out = ik.gated_attention(
            rand(2, 3, 7, 16), rand(2, 3, 7, 16), rand(2, 3, 7, 16), rand(2, 7, 3), smear_alpha=rand(3), backend=backend
        )
        _backward(out)
        return out

    return {
        "gated_attention": run_gated_attention,
        "ngram_attention": run_ngram,
        "infonce_loss": run_infonce,
        "select_actions": run_select,
        "mixture_of_heads": run_moa,
        "inject_layer_norm": run_inject,
        "smeared_keys": run_smeared,
    }


def _module_cases(device: torch.device) -> dict[str, Callable[[], torch.Tensor]]:
    """``name -> run()``: forward (+ backward) of each module with ``backend="auto"``."""
    torch.manual_seed(0)
    x = torch.randn(2, 9, 32, device=device, requires_grad=True)
    ids = torch.randint(0, 3, (2, 9), device=device)

    # The modules are built and moved here, outside the checked region (moving parameters to the GPU
    # copies from pageable memory, which synchronises).
    modules = {
        "ngram": ik.NGramAttention(32, 2).to(device),
        "moa": ik.MoAAttention(32, 4).to(device),
        "smeared": ik.SmearedKeyAttention(32, 4).to(device),
        "moa_fused": ik.MoAAttention(32, 4, attention="fused").to(device),
        "smeared_fused": ik.SmearedKeyAttention(32, 4, attention="fused").to(device),
        "looped": ik.LoopedBlock(32, 4, 16).to(device),
    }
    action_map = ik.ActionMap(6, 32)
    action_map.regenerate(device=device)
    targets = torch.randint(0, 6, (2, 9), device=device)

    def ngram():
        return modules["ngram"](x, ids)

    def moa():
        return modules["moa"](x)

    def smeared():
        return modules["smeared"](x)

    def moa_fused():
        return modules["moa_fused"](x)

    def smeared_fused():
        return modules["smeared_fused"](x)

    def looped():
        return modules["looped"](x, loops=3, grad_loops=2)

    def action_map_case():
        loss = action_map.loss(x, targets)
        action_map.embed(targets)
        action_map.select(x.detach(), mode="sample")
        return loss

    return {"NGramAttention": ngram, "MoAAttention": moa, "SmearedKeyAttention": smeared,
        "MoAAttention-fused": moa_fused, "SmearedKeyAttention-fused": smeared_fused, "LoopedBlock": looped,
            "ActionMap": action_map_case}  # fmt: skip


def _cpu_backends() -> list[str]:
    return ["eager", "triton"] if triton_runs_on(torch.device("cpu")) else ["eager"]


@pytest.mark.parametrize("backend", _cpu_backends())
@pytest.mark.parametrize("op", list(_op_cases(torch.device("cpu"))))
def test_op_reads_no_value_on_host(op, backend):
    run = _op_cases(torch.device("cpu"))[op]
    run(backend)  # warm-up: lazy imports, Triton's first compile
    with gpu_value_checks(), HostReadDetector() as detector:
        run(backend)
    assert not detector.reads, f"{op} (backend={backend}) reads device values on the host: {detector.reads}"


@pytest.mark.parametrize("module", list(_module_cases(torch.device("cpu"))))
def test_module_forward_reads_no_value_on_host(module):
    run = _module_cases(torch.device("cpu"))[module]
    _backward(run())
    with gpu_value_checks(), HostReadDetector() as detector:
        _backward(run())
    assert not detector.reads, f"{module} reads device values on the host: {detector.reads}"


def test_detector_catches_reads():
    x = torch.randn(5)
    with HostReadDetector() as detector:
        x.sum().item()
        x[x > 0]
        torch.nonzero(x)
    assert len(detector.reads) == 3


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("case", list(_op_cases(torch.device("cpu"))) + list(_module_cases(torch.device("cpu"))))
def test_cuda_sync_debug_mode(case):
    device = torch.device("cuda")
    ops, modules = _op_cases(device), _module_cases(device)
    run = (lambda: ops[case]("auto")) if case in ops else (lambda: _backward(modules[case]()))
    previous = ik.set_value_checks("auto")  # the default, which never reads a device value on the host
    try:
        run()  # warm-up: compiles and autotunes (which synchronise) outside the checked region
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            run()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    finally:
        ik.set_value_checks(previous)


# -- the value-check modes ---------------------------------------------------------------------------
@pytest.mark.parametrize(
    "mode, error", [("auto", ValueError), ("sync", ValueError), ("async", RuntimeError), ("off", None)]
)
def test_value_check_modes(mode, error):
    from icrl_kernels._validation import check_values

    previous = ik.set_value_checks(mode)
    try:
        check_values(torch.tensor(False), "never raised")
        if error is None:
            check_values(torch.tensor(True), "x must be positive")
        else:
            with pytest.raises(error, match="x must be positive"):
                check_values(torch.tensor(True), "x must be positive", lambda: ", got -1")
    finally:
        assert ik.set_value_checks(previous) == mode


def test_value_check_details_only_in_sync_errors():
    from icrl_kernels._validation import check_values

    with pytest.raises(ValueError, match=r"^x must be positive, got \[-1\]$"):
        check_values(torch.tensor(True), "x must be positive", lambda: ", got [-1]")


def test_set_value_checks_rejects_unknown_modes():
    with pytest.raises(ValueError, match="mode must be one of"):
        ik.set_value_checks("lazy")


@pytest.mark.parametrize("mode", ["auto", "sync"])
def test_value_checks_are_device_side_while_capturing(monkeypatch, mode):
    """Inside a CUDA graph capture (emulated: the capture query answers True) and inside
    ``device_side_value_checks()`` no mode reads the device: a synchronous check there would invalidate the
    capture. Outside, "sync" reads on CUDA and "auto" does not; the CPU reads in both."""
    from icrl_kernels._validation import check_values, synchronous_value_checks

    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)  # a CPU build has no query
    previous = ik.set_value_checks(mode)
    try:
        assert synchronous_value_checks(cuda) == (mode == "sync") and synchronous_value_checks(cpu)
        with ik.device_side_value_checks():
            assert not synchronous_value_checks(cuda) and not synchronous_value_checks(cpu)
            with HostReadDetector() as detector, pytest.raises(RuntimeError, match="x must be positive"):
                check_values(torch.tensor(True), "x must be positive")  # the assert, not a ValueError
            assert not detector.reads
        assert synchronous_value_checks(cpu)  # the scope ended
        monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
        assert not synchronous_value_checks(cuda) and synchronous_value_checks(cpu)
    finally:
        ik.set_value_checks(previous)
