"""Markov heads (Definition 4.1 of the Markov-heads paper): detection on constructed matrices, the
default threshold, per-head products of attention modules, and G_Markov."""

from __future__ import annotations

import math

import pytest
import torch

from icrl_kernels import MoAAttention
from icrl_kernels.testing import assert_close_rel
from icrl_models.analysis import (
    default_markov_threshold,
    g_markov,
    is_markov_head,
    markov_conditions,
    markov_heads,
    markov_ratio,
    qk_products,
)


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny models: a second intra-op thread only spin-waits on a shared CPU (100x slower, measured)."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


def _constant_offdiag(d: int, diag: float, off: float) -> torch.Tensor:
    """``off`` everywhere, ``diag`` on the diagonal: ratio exactly ``|diag| / |off|``."""
    return torch.full((d, d), off, dtype=torch.float64) + (diag - off) * torch.eye(d, dtype=torch.float64)


def test_default_threshold():
    assert default_markov_threshold(64) == pytest.approx(math.log(63) + 1)  # 5.143
    assert default_markov_threshold(768) == pytest.approx(7.642, abs=1e-3)  # GPT-2 small's width
    assert default_markov_threshold(2) == 1.0
    for bad in (1, 0, 3.0, True):
        with pytest.raises((ValueError, TypeError)):
            default_markov_threshold(bad)


@pytest.mark.parametrize("d", [5, 37, 64])
def test_scaled_identity_plus_noise_is_markov(d):
    generator = torch.Generator().manual_seed(d)
    matrix = 3.0 * torch.eye(d) + 0.01 * torch.randn(d, d, generator=generator)
    assert is_markov_head(matrix)
    positive, ratio, large = markov_conditions(matrix)
    assert positive and large and ratio > 50


def test_ratio_matches_definition():
    generator = torch.Generator().manual_seed(0)
    matrix = torch.randn(11, 11, generator=generator)
    off = ~torch.eye(11, dtype=torch.bool)
    expected = matrix.diagonal().abs().mean() / matrix[off].abs().mean()
    assert markov_ratio(matrix) == pytest.approx(float(expected), rel=1e-6)  # fp32 reference


@pytest.mark.parametrize("seed", range(5))
def test_random_gaussian_is_not_markov(seed):
    matrix = torch.randn(48, 48, generator=torch.Generator().manual_seed(seed))
    assert not is_markov_head(matrix)
    assert markov_ratio(matrix) < 2  # about 1: diagonal and off-diagonal entries alike


def test_one_negative_diagonal_entry_fails_condition_i():
    matrix = 5.0 * torch.eye(20) + 0.01 * torch.randn(20, 20, generator=torch.Generator().manual_seed(1))
    matrix[7, 7] = -5.0
    positive, ratio, large = markov_conditions(matrix)
    assert not positive and large  # (ii) alone holds: |diag| is still large
    assert not is_markov_head(matrix)
    matrix[7, 7] = 0.0  # zero is not positive either
    assert not is_markov_head(matrix)


@pytest.mark.parametrize("d", [9, 64])
def test_ratio_just_below_and_above_threshold(d):
    r = default_markov_threshold(d)
    below = _constant_offdiag(d, diag=r * (1 - 1e-6), off=1.0)
    above = _constant_offdiag(d, diag=r * (1 + 1e-6), off=1.0)
    assert markov_ratio(below) < r < markov_ratio(above)
    assert not is_markov_head(below)
    assert is_markov_head(above)
    # Off-diagonal signs do not matter (absolute values); a custom r moves the boundary.
    signed = above.clone()
    signed[0, 1:] *= -1
    assert is_markov_head(signed)
    assert not is_markov_head(above, r=8.0) and is_markov_head(_constant_offdiag(d, 8.001, 1.0), r=8.0)


def test_zero_offdiagonal_gives_infinite_ratio():
    matrix = torch.diag(torch.tensor([1.0, 2.0, 3.0]))
    assert markov_ratio(matrix) == math.inf and is_markov_head(matrix)


def test_bad_matrices_raise():
    with pytest.raises(ValueError, match="square"):
        markov_ratio(torch.ones(3, 4))
    with pytest.raises(ValueError, match="square"):
        markov_ratio(torch.ones(1, 1))
    with pytest.raises(TypeError, match="float"):
        markov_ratio(torch.ones(3, 3, dtype=torch.long))
    with pytest.raises(TypeError):
        markov_ratio([[1.0, 0.0], [0.0, 1.0]])


def _markov_attention(d_model: int, heads: int, markov: list[int], seed: int = 0) -> MoAAttention:
    """A MoAAttention whose ``markov`` heads have ``W_q = W_k = 0/1 residue pattern`` (others GPT-2 random)."""
    torch.manual_seed(seed)
    module = MoAAttention(d_model, heads, gate="softmax", backend="eager")
    head_dim = d_model // heads
    pattern = (torch.arange(d_model)[:, None] % head_dim == torch.arange(head_dim)[None, :]).float()
    with torch.no_grad():
        torch.nn.init.normal_(module.qkv.weight, std=0.02)
        for h in markov:
            for part in (0, 1):
                rows = slice(part * d_model + h * head_dim, part * d_model + (h + 1) * head_dim)
                module.qkv.weight[rows] = pattern.t()
    return module


def test_markov_heads_of_a_module():
    module = _markov_attention(40, 4, markov=[1, 3])
    report = markov_heads(module)
    assert report.d == 40 and report.r == pytest.approx(math.log(39) + 1)
    assert report.mask(0).tolist() == [False, True, False, True]
    assert report.heads() == [("", 1), ("", 3)]
    # W_q = W_k = S: M = S S^T has 1 on the diagonal and on the D/Dh - 1 = 3 same-residue entries per row.
    assert report.ratio[0][1] == pytest.approx(39 / 3)
    table = report.table()
    assert table.count("\n| ") == 5 and "| yes |" in table
    assert report.to_dict()["markov_heads"] == [("", 1), ("", 3)]


def test_qk_products_are_the_score_bilinear_form():
    """``x_i M_h x_j^T / sqrt(Dh)`` equals head h's attention score ``q_i . k_j / sqrt(Dh)`` (zero biases)."""
    torch.manual_seed(3)
    module = MoAAttention(30, 3, gate=None, bias=False, backend="eager")
    x = torch.randn(1, 7, 30)
    q, k, _ = module.project(x)  # [1, H, L, Dh]
    scores = q @ k.transpose(-1, -2)
    products = qk_products(module)  # [H, D, D]
    bilinear = torch.einsum("bid,hde,bje->bhij", x, products, x)
    assert_close_rel(bilinear, scores)


def test_markov_heads_of_a_model_needs_attention():
    with pytest.raises(ValueError, match="no MoAAttention"):
        markov_heads(torch.nn.Linear(3, 3))


def test_g_markov_on_hand_made_gates():
    gates = torch.tensor(
        [[[0.1, 0.2, 0.3, 0.4], [0.25, 0.25, 0.25, 0.25]], [[0.7, 0.1, 0.1, 0.1], [0.0, 0.5, 0.5, 0.0]]]
    )
    mask = torch.tensor([True, False, True, False])
    expected = torch.tensor([[0.4, 0.5], [0.8, 0.5]])
    assert_close_rel(g_markov(gates, mask), expected)
    assert_close_rel(g_markov(gates.mean(dim=(0, 1)), mask), expected.mean())
    assert g_markov(gates, torch.zeros(4, dtype=torch.bool)).abs().max() == 0
    assert_close_rel(g_markov(gates, torch.ones(4, dtype=torch.bool)), gates.sum(-1))
    with pytest.raises(ValueError, match="heads"):
        g_markov(gates, torch.tensor([True, False]))
    with pytest.raises(ValueError, match="bool"):
        g_markov(gates, torch.tensor([1, 0, 1, 0]))
