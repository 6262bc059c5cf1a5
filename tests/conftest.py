"""Test fixtures: every kernel output starts NaN-poisoned."""

from __future__ import annotations

import pytest

from icrl_kernels.testing import poisoned_outputs


@pytest.fixture(autouse=True)
def _poison_kernel_outputs():
    """Kernel outputs start as NaN, so an element a kernel never writes fails its test."""
    with poisoned_outputs():
        yield
