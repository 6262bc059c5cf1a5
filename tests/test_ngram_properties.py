"""Property tests of n-gram match attention: hypothesis draws shapes, vocabularies, ``n`` and padding,
and the fast paths must match the dense reference on every draw.

Kept apart from ``test_ngram_attention.py`` so that the parity suite collects and runs where hypothesis
is not installed (the GPU machine's image, a minimal venv): this module skips as a whole there.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("hypothesis", reason="the property tests need hypothesis (pip install hypothesis)")

from _helpers import check_parity, random_ids  # noqa: E402
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from icrl_kernels.testing import triton_devices  # noqa: E402


@settings(max_examples=30, deadline=None)
@given(
    batch=st.integers(1, 3),
    length=st.integers(1, 70),
    dim=st.integers(1, 20),
    vocab=st.integers(1, 6),
    n=st.integers(1, 5),
    padding=st.sampled_from([0.0, 0.1, 0.5]),
    seed=st.integers(0, 2**31 - 1),
)
def test_property_eager_matches_reference(batch, length, dim, vocab, n, padding, seed):
    gen = torch.Generator().manual_seed(seed)
    ids = random_ids(batch, length, vocab, generator=gen, padding=padding)
    check_parity(torch.randn(batch, length, dim, generator=gen), ids, n, "eager")


@pytest.mark.skipif(not triton_devices(), reason="needs TRITON_INTERPRET=1 or CUDA")
@settings(max_examples=12, deadline=None)
@given(
    algorithm=st.sampled_from(["sort", "tiled"]),
    length=st.integers(1, 70),
    dim=st.integers(1, 40),
    vocab=st.integers(1, 5),
    n=st.integers(1, 4),
    padding=st.sampled_from([0.0, 0.2]),
    seed=st.integers(0, 2**31 - 1),
)
def test_property_triton_matches_reference(algorithm, length, dim, vocab, n, padding, seed):
    device = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator().manual_seed(seed)
    ids = random_ids(2, length, vocab, generator=gen, padding=padding)
    check_parity(torch.randn(2, length, dim, generator=gen).to(device), ids.to(device), n, "triton", algorithm)
