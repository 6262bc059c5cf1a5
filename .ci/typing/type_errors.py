"""Deliberate type errors: mypy must report every line marked ``# E``, or the typing check cannot fail."""

from __future__ import annotations

import torch

import icrl_kernels as ik

h = torch.randn(2, 16, 32)
ids = torch.randint(0, 4, (2, 16))
ik.ngram_attention(h, ids, "2")  # E: n is an int
ik.set_value_checks(mode=True)  # E: mode is a str
name: int = ik.value_checks()  # E: returns a str
ik.NGramAttention(32, 2, bias="yes")  # E: bias is a bool
