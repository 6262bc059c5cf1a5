"""The shared helpers every op uses: validation, output poisoning, the comparison helper."""

from __future__ import annotations

import pytest
import torch

from icrl_kernels._library import empty_output
from icrl_kernels._validation import check_choice, check_int, check_positive_float, check_tensor
from icrl_kernels.testing import assert_close_rel, poisoned_outputs, relative_rms_error


def test_check_positive_float():
    assert check_positive_float(0.5, "tau") == 0.5
    for bad in (0.0, -1.0, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="tau must be > 0"):
            check_positive_float(bad, "tau")
    with pytest.raises(TypeError, match="tau must be a real number"):
        check_positive_float("1", "tau")


def test_check_int_and_choice():
    assert check_int(3, "n", min_value=1, max_value=3) == 3
    with pytest.raises(ValueError, match="n must be <= 3"):
        check_int(4, "n", max_value=3)
    with pytest.raises(ValueError, match="gate must be one of"):
        check_choice("tanh", "gate", ("softmax", "sigmoid"))


def test_check_tensor_rank_and_dtype():
    x = torch.zeros(2, 3)
    assert check_tensor(x, "x", ndim=(2, 3), dtypes=(torch.float32,)) is x
    with pytest.raises(ValueError, match="x must be 3-D, got shape"):
        check_tensor(x, "x", ndim=3)
    with pytest.raises(ValueError, match="x must not be empty"):
        check_tensor(torch.zeros(0, 3), "x", nonempty=True)


def test_empty_output_is_poisoned_only_under_test_flag():
    with poisoned_outputs():
        assert torch.isnan(empty_output((3,), dtype=torch.float32, device=torch.device("cpu"))).all()
        assert (empty_output((3,), dtype=torch.int32, device=torch.device("cpu")) == -1).all()


def test_assert_close_rel_catches_nan_and_outliers():
    expected = torch.randn(100, generator=torch.Generator().manual_seed(0))
    assert relative_rms_error(expected, expected) == 0.0
    with pytest.raises(AssertionError, match="non-finite"):
        assert_close_rel(torch.where(torch.arange(100) == 7, float("nan"), expected), expected)
    with pytest.raises(AssertionError, match="relative RMS error"):
        assert_close_rel(expected * 1.01, expected)
    one_wrong = expected.clone()
    one_wrong[3] += 0.02  # RMS error ~2e-3 / 10: only the max-abs check sees it in fp16
    with pytest.raises(AssertionError, match="max abs error"):
        assert_close_rel(one_wrong.half(), expected.half(), rms_tol=5e-3, max_abs_tol=1e-2)
