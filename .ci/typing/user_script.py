"""A user's script, type-checked by mypy against the installed wheel (.ci/run): the public signatures are seen
(PEP 561 ``py.typed``), so correct calls pass and the mistakes in ``type_errors.py`` are reported."""

from __future__ import annotations

import torch

import icrl_kernels as ik
from icrl_kernels import NGramAttention, ngram_attention
from icrl_models.envs import GYM_IDS, DarkRoom

h = torch.randn(2, 16, 32)
ids = torch.randint(0, 4, (2, 16))
out: torch.Tensor = ngram_attention(h, ids, 2, backend="eager")
layer = NGramAttention(32, 2)
mixed = layer(h, ids)
loss = ik.infonce_loss(torch.randn(8, 16), ik.orthonormal_embeddings(5, 16), torch.randint(0, 5, (8,)), tau=0.5)
hidden, normed = ik.inject_layer_norm(None, h, None, torch.ones(32), None, eps=1e-5)
previous: str = ik.set_value_checks("sync")
env = DarkRoom([0, 10], size=9, episode_length=20)
env_ids: list[str] = sorted(GYM_IDS)
