"""Test fixtures: every kernel output starts NaN-poisoned; bad values raise ``ValueError`` on every device."""

from __future__ import annotations

import pytest
import torch

from icrl_kernels import set_value_checks
from icrl_kernels.testing import poisoned_outputs


@pytest.fixture(autouse=True)
def _poison_kernel_outputs():
    """Kernel outputs start as NaN, so an element a kernel never writes fails its test."""
    with poisoned_outputs():
        yield


@pytest.fixture(autouse=True)
def _synchronous_value_checks(request):
    """Bad values (targets out of range, NaN, ...) raise ``ValueError`` on CUDA too, in the tests that check
    them: every test not marked ``gpu`` (on the CPU "sync" and "auto" are the same), and the ``gpu`` tests
    marked ``sync_value_checks`` (the device-parametrised ones are, by the root conftest). There the default
    ("auto") is an asynchronous device assert, which ends the worker's CUDA context and fails every later
    CUDA test in it. The other ``gpu`` tests (training steps, CUDA graphs, host syncs) run as users run: in
    the default mode. The tests of the asynchronous mode (``test_no_host_sync.py``) choose it explicitly."""
    keywords = request.node.keywords
    if "gpu" in keywords and "sync_value_checks" not in keywords:
        yield
        return
    previous = set_value_checks("sync")
    try:
        yield
    finally:
        set_value_checks(previous)


@pytest.fixture(autouse=True)
def _cuda_state_isolated(request):
    """A ``gpu`` test's asynchronous CUDA errors are reported by that test, not the next one, and a test that
    changed torch's sync-debug mode cannot leave it on."""
    if "gpu" not in request.node.keywords or not torch.cuda.is_available():
        yield
        return
    try:
        yield
        torch.cuda.synchronize()
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.fixture(autouse=True)
def _experiment_trials_in_this_process(request, monkeypatch):
    """Experiment commands run their trials on Ray Tune by default when it is installed; the tests run them
    in this process (a Ray instance per test worker costs seconds and memory), except ``test_sweep.py``,
    which tests the Ray path itself."""
    if request.module.__name__.rsplit(".", 1)[-1] == "test_sweep":
        return
    from icrl_models.experiments import sweep

    monkeypatch.setattr(sweep, "ray_tune_available", lambda: False)


@pytest.fixture
def capturable_on_cpu(monkeypatch):
    """Let Adam's and AdamW's ``capturable=True`` path (the one a CUDA graph records) run on CPU tensors:
    the same tensor-only arithmetic (step counter and bias corrections on the device), so its host reads
    show in the host-read detector of ``test_no_host_sync``."""
    import torch.optim.adam as adam
    import torch.optim.adamw as adamw
    import torch.optim.optimizer as optimizer

    for module in (adam, adamw, optimizer):  # AdamW runs Adam's functions in recent torch
        supported = getattr(module, "_get_capturable_supported_devices", None)
        if supported is not None:
            monkeypatch.setattr(
                module, "_get_capturable_supported_devices", lambda *a, _s=supported, **k: [*_s(*a, **k), "cpu"]
            )
