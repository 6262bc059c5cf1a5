"""Repository-wide pytest hooks (tests/ and benchmarks/): the ``gpu`` marker skips cleanly without CUDA."""

from __future__ import annotations

import os

import pytest
import torch

# Under pytest-xdist (`-n N`) each worker gets an equal share of the cores: N processes each running
# torch's default of one OpenMP thread per core oversubscribe the machine, which slowed CPU work
# 2-25x on a shared 2-core VM.
_XDIST_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _XDIST_WORKERS > 1:
    torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // _XDIST_WORKERS))


def _runs_on_cuda(item) -> bool:
    """Whether a test is parametrised with the device ``"cuda"`` (as ``icrl_kernels.testing.triton_devices``
    gives it), alone or inside a tuple of parameters."""
    params = getattr(getattr(item, "callspec", None), "params", {})
    values = [part for value in params.values() for part in (value if isinstance(value, tuple) else (value,))]
    return any(isinstance(value, str) and value == "cuda" for value in values)


@pytest.hookimpl(tryfirst=True)  # before ``-m`` deselects by marker
def pytest_collection_modifyitems(config, items):
    for item in items:
        if _runs_on_cuda(item):
            # Device-parametrised tests check ValueErrors on every device: on CUDA that needs synchronous checks.
            item.add_marker(pytest.mark.gpu)
            item.add_marker(pytest.mark.sync_value_checks)
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)
