"""Test fixtures: every kernel output starts NaN-poisoned; bad values raise ``ValueError`` on every device."""

from __future__ import annotations

import pytest

from icrl_kernels import set_value_checks
from icrl_kernels.testing import poisoned_outputs


@pytest.fixture(autouse=True)
def _poison_kernel_outputs():
    """Kernel outputs start as NaN, so an element a kernel never writes fails its test."""
    with poisoned_outputs():
        yield


@pytest.fixture(autouse=True)
def _synchronous_value_checks():
    """Bad values (targets out of range, NaN, ...) raise ``ValueError`` on CUDA too. The default ("auto")
    is an asynchronous device assert there, which ends the worker's CUDA context and fails every later
    CUDA test in it; the tests of that mode (``test_no_host_sync.py``) choose it explicitly. On the CPU
    "sync" and "auto" are the same."""
    previous = set_value_checks("sync")
    try:
        yield
    finally:
        set_value_checks(previous)


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
