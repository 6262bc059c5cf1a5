"""Shared fixtures: NaN-poisoned kernel outputs, the ``gpu`` marker, devices to test on."""

from __future__ import annotations

import pytest
import torch

from icrl_kernels._backend import triton_available, triton_interpreter_enabled
from icrl_kernels.testing import poisoned_outputs

HAS_CUDA = torch.cuda.is_available()


def pytest_collection_modifyitems(config, items):
    if HAS_CUDA:
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(autouse=True)
def _poison_kernel_outputs():
    """Every kernel output starts as NaN, so an element a kernel never writes fails its test."""
    with poisoned_outputs():
        yield


def triton_devices() -> list:
    """Devices where the Triton path can run here: the interpreter on CPU and/or CUDA."""
    devices = []
    if triton_available() and triton_interpreter_enabled():
        devices.append("cpu")
    if HAS_CUDA:
        devices.append(pytest.param("cuda", marks=pytest.mark.gpu))
    return devices
