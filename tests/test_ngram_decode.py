"""Incremental decoding: stepping one position at a time equals the full op."""

from __future__ import annotations

import pytest
import torch

from icrl_kernels import NGramAttention, NGramDecodeState, ngram_attention_reference
from icrl_kernels.testing import assert_close_rel


@pytest.mark.parametrize(
    "length,vocab,n,padding",
    [(60, 3, 1, 0.0), (75, 2, 2, 0.1), (50, 4, 3, 0.0), (40, 1, 2, 0.0), (30, 10_000, 1, 0.0), (9, 3, 12, 0.0)],
)
def test_decode_equals_full(length, vocab, n, padding):
    gen = torch.Generator().manual_seed(length * 31 + n)
    batch, dim = 3, 11
    ids = torch.randint(0, vocab, (batch, length), generator=gen)
    ids[torch.rand(batch, length, generator=gen) < padding] = -1
    h = torch.randn(batch, length, dim, generator=gen)
    state = NGramDecodeState(batch, dim, n, max_len=length)
    stepped = torch.stack([state.step(h[:, i], ids[:, i]) for i in range(length)], dim=1)
    assert_close_rel(stepped, ngram_attention_reference(h, ids, n), name="decoded")


def test_decode_probing_under_collisions():
    """A table barely larger than the context forces long probe chains; results must stay exact."""
    gen = torch.Generator().manual_seed(4)
    length, n = 200, 2
    ids = torch.randint(0, 50, (2, length), generator=gen)
    h = torch.randn(2, length, 4, generator=gen)
    state = NGramDecodeState(2, 4, n, max_len=length)
    assert state.capacity <= 4 * length
    stepped = torch.stack([state.step(h[:, i], ids[:, i]) for i in range(length)], dim=1)
    assert_close_rel(stepped, ngram_attention_reference(h, ids, n), name="decoded")


def test_decode_reset_rows():
    gen = torch.Generator().manual_seed(5)
    ids = torch.randint(0, 3, (2, 30), generator=gen)
    h = torch.randn(2, 30, 5, generator=gen)
    state = NGramDecodeState(2, 5, 1, max_len=30)
    for _ in range(10):
        state.step(torch.randn(2, 5, generator=gen), torch.randint(0, 3, (2,), generator=gen))
    state.reset(torch.tensor([True, True]))
    stepped = torch.stack([state.step(h[:, i], ids[:, i]) for i in range(20)], dim=1)
    assert_close_rel(stepped, ngram_attention_reference(h[:, :20], ids[:, :20], 1), name="after reset")


def test_decode_rejects_overflow_and_bad_input():
    state = NGramDecodeState(1, 2, 1, max_len=2)
    state.step(torch.zeros(1, 2), torch.tensor([0]))
    state.step(torch.zeros(1, 2), torch.tensor([0]))
    with pytest.raises(ValueError, match="max_len"):
        state.step(torch.zeros(1, 2), torch.tensor([0]))
    fresh = NGramDecodeState(2, 3, 1, max_len=4)
    with pytest.raises(ValueError, match="h_t"):
        fresh.step(torch.zeros(2, 4), torch.tensor([0, 1]))
    with pytest.raises(TypeError, match="ids_t"):
        fresh.step(torch.zeros(2, 3), torch.tensor([0.0, 1.0]))
    with pytest.raises(ValueError, match="n"):
        NGramDecodeState(1, 2, 0, max_len=3)


def test_module_step_equals_forward():
    torch.manual_seed(0)
    layer = NGramAttention(12, 2, backend="eager")
    ids = torch.randint(0, 3, (2, 25))
    h = torch.randn(2, 25, 12)
    full = layer(h, ids)
    state = layer.init_decode_state(2, max_len=25)
    stepped = torch.stack([layer.step(state, h[:, i], ids[:, i]) for i in range(25)], dim=1)
    assert_close_rel(stepped.detach(), full.detach(), name="module step")


def test_decode_partial_reset_by_index_and_overflow_check():
    """Rows reset by index start over (exactly); the host-side length bound does not outlive the reset (no
    false max_len error), and the check still fires once a row is really full."""
    gen = torch.Generator().manual_seed(6)
    length, dim = 12, 4
    ids = torch.randint(0, 2, (2, length), generator=gen)
    h = torch.randn(2, length, dim, generator=gen)
    state = NGramDecodeState(2, dim, 2, max_len=length)
    for _ in range(5):
        state.step(torch.randn(2, dim, generator=gen), torch.randint(0, 2, (2,), generator=gen))
    state.reset(torch.tensor([0, 1]))  # every row, by index: the state cannot tell without reading the values
    stepped = torch.stack([state.step(h[:, i], ids[:, i]) for i in range(length)], dim=1)
    assert_close_rel(stepped, ngram_attention_reference(h, ids, 2), name="after reset by index")
    with pytest.raises(ValueError, match="max_len"):
        state.step(h[:, 0], ids[:, 0])


def test_decode_distinct_keys_fill_the_table():
    """Every position a new n-gram (the worst case for the table): max_len entries suffice, results exact."""
    length = 33
    ids = torch.arange(length).view(1, length).repeat(2, 1)
    ids[1, length // 2 :] = ids[1, : length - length // 2].clone()  # row 1 repeats its first half
    h = torch.randn(2, length, 3)
    state = NGramDecodeState(2, 3, 1, max_len=length)
    stepped = torch.stack([state.step(h[:, i], ids[:, i]) for i in range(length)], dim=1)
    assert_close_rel(stepped, ngram_attention_reference(h, ids, 1), name="decoded")
    # Keys are the n-grams ending at 0 .. L - 2: one entry per distinct one.
    assert state.num_keys.tolist() == [len(set(row[:-1].tolist())) for row in ids] == [length - 1, length // 2]
