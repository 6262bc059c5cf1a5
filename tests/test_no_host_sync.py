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

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from _helpers import HostReadDetector, cpu_backends, gpu_value_checks, host_reads

import icrl_kernels as ik

PACKAGE = Path(ik.__file__).parent
#: Files that may read values: the test helpers, and the checker itself.
ALLOWED_FILES = {"testing.py", "_validation.py"}


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


@pytest.mark.parametrize("backend", cpu_backends())
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
