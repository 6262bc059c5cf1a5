"""Per-op cost models (``benchmarks/cost/<op>.py``): each formula against a case worked by hand, the
parameter counts against the real modules, and the projection FLOPs against PyTorch's own FLOP counter.

The hand-worked numbers are the ones spelled out in each function's docstring.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from benchmarks.cost import OpCost, itemsize, roofline
from benchmarks.cost.contrastive import infonce_fwd_bwd_cost, select_actions_cost
from benchmarks.cost.looped import (
    inference_cost,
    inject_layer_norm_fwd_bwd_cost,
    loop_forward_flops,
    loop_params,
    train_step_cost,
)
from benchmarks.cost.moa import (
    attention_fwd_bwd_cost,
    attention_pairs,
    attention_params,
    mixture_of_heads_fwd_bwd_cost,
)
from benchmarks.cost.ngram import fwd_bwd_cost as ngram_cost
from benchmarks.cost.smeared import fwd_bwd_cost as smeared_cost
from icrl_kernels import LoopedBlock, MoAAttention


def test_op_cost_arithmetic_and_itemsize():
    assert OpCost(10, 3) + OpCost(5, 4) == OpCost(15, 7)
    assert 3 * OpCost(2, 5) == OpCost(6, 15) == OpCost(2, 5) * 3
    assert itemsize(torch.bfloat16) == itemsize("bfloat16") == itemsize("torch.bfloat16") == 2
    assert itemsize("float32") == 4


def test_roofline_takes_the_larger_term():
    # 1e9 bytes at 1e12 B/s = 1 ms; 1e12 FLOPs at 1e15 FLOP/s = 1 ms (a tie goes to bytes).
    assert roofline(OpCost(10**9, 10**12), 1e12, 1e15) == (pytest.approx(1e-3), "bytes")
    assert roofline(OpCost(10**9, 4 * 10**12), 1e12, 1e15) == (pytest.approx(4e-3), "flops")
    assert roofline(OpCost(3 * 10**9, 10**12), 1e12, 1e15) == (pytest.approx(3e-3), "bytes")


def test_ngram_hand_case():
    # 4 tensors of 2*3*4 fp32 (h, out, grad_out, grad_h) + int64 ids read in both passes; 6 FLOPs/element.
    assert ngram_cost(2, 3, 4, dtype=torch.float32) == OpCost(4 * 24 * 4 + 2 * 6 * 8, 6 * 24) == OpCost(480, 144)
    assert ngram_cost(2, 3, 4, dtype="bfloat16", ids_itemsize=4) == OpCost(4 * 24 * 2 + 2 * 6 * 4, 144)


def test_infonce_hand_case():
    # pred 4x8 bf16 (64 B) read twice + grad_pred written; map 3x8 (48 B) read twice; targets 32 B read
    # twice; lse 16 B written and read. Dots: forward, recompute, grad_pred: 3 x 2*4*3*8.
    assert infonce_fwd_bwd_cost(4, 8, 3, dtype=torch.bfloat16) == OpCost(3 * 64 + 2 * 48 + 2 * 32 + 2 * 16, 576)
    assert infonce_fwd_bwd_cost(4, 8, 3, dtype=torch.bfloat16) == OpCost(384, 576)
    assert infonce_fwd_bwd_cost(4, 8, 3, dtype=torch.bfloat16, grad_embeds=True) == OpCost(432, 768)
    # Per-sequence maps: the map traffic scales with the number of maps, the FLOPs do not.
    assert infonce_fwd_bwd_cost(4, 8, 3, dtype=torch.bfloat16, maps=2) == OpCost(384 + 2 * 48, 576)


def test_select_actions_hand_case():
    assert select_actions_cost(4, 8, 3, dtype=torch.bfloat16) == OpCost(64 + 48 + 32, 2 * 4 * 3 * 8) == OpCost(144, 192)


def test_moa_attention_hand_case():
    # D = 4, H = 2: qkv 3*16 + 12 for q, k, v and 8 + 2 for its gate rows, out_proj 16 + 4 = 90 parameters.
    assert attention_params(4, 2) == 90
    assert attention_pairs(1, 2, 2) == 6  # 2 heads x 3 causal (query, key) pairs
    cost = attention_fwd_bwd_cost(1, 2, 2, 2, dtype=torch.float32)
    assert cost == OpCost(4 * 8 * 4 + 3 * 90 * 4, 2 * 2 * 4 * 18 * 3 + 14 * 2 * 6) == OpCost(1208, 1032)
    # Without weight gradients the parameters are read twice and the projections' backward halves.
    assert attention_fwd_bwd_cost(1, 2, 2, 2, dtype=torch.float32, weight_grads=False) == OpCost(
        128 + 2 * 90 * 4, 2 * 2 * 4 * 18 * 2 + 168
    )


@pytest.mark.parametrize("gated", [True, False], ids=["gated", "ungated"])
def test_moa_attention_matches_the_module(gated: bool):
    """Parameter count of the real layer; projection FLOPs (fwd + bwd with weight gradients) as PyTorch
    counts them. The attention core (PyTorch's CPU SDPA is not counted by its FLOP counter) is checked
    by hand above."""
    B, L, H, Dh = 2, 5, 3, 4
    layer = MoAAttention(H * Dh, H, gate="softmax" if gated else None, backend="eager")
    assert sum(p.numel() for p in layer.parameters()) == attention_params(H * Dh, H, gated=gated)
    x = torch.randn(B, L, H * Dh, requires_grad=True)
    with FlopCounterMode(display=False) as counter:
        y = layer(x)
        y.backward(torch.randn_like(y))
    counts = counter.get_flop_counts()["Global"]
    linear_flops = sum(flops for op, flops in counts.items() if str(op) in ("aten.mm", "aten.addmm"))
    cost = attention_fwd_bwd_cost(B, L, H, Dh, dtype=torch.float32, gated=gated)
    assert linear_flops == cost.flops - 14 * Dh * attention_pairs(B, L, H)


def test_mixture_of_heads_hand_case():
    # 24 head elements x 5 passes x 2 B + 6 logits x 3 passes x 2 B; 4 FLOPs/element + 14/logit.
    assert mixture_of_heads_fwd_bwd_cost(1, 2, 3, 4, dtype=torch.bfloat16) == OpCost(276, 180)
    assert mixture_of_heads_fwd_bwd_cost(1, 2, 3, 4, dtype=torch.bfloat16, logits_dtype=torch.float32) == OpCost(
        240 + 3 * 6 * 4, 180
    )


def test_inject_layer_norm_hand_case():
    # 9 activations of 2*3*4 fp32, pos and d_pos (3*4), 5 vectors of D, mean/rstd written and read.
    assert inject_layer_norm_fwd_bwd_cost(2, 3, 4, dtype=torch.float32) == OpCost(768 + 96 + 80, 672)


def test_looped_hand_case():
    # Block 12*16 + 13*4 = 244, ln_f 8, 2 position rows 8: 260 parameters, 1040 B; one iterate 32 B.
    assert loop_params(2, 4) == 260
    assert loop_forward_flops(1, 2, 4) == 24 * 2 * 16 + 2 * 4 * 2 * 3 == 816
    assert inference_cost(1, 2, 4, loops=3, dtype=torch.float32) == OpCost(3 * (1040 + 96) - 32, 3 * 816)
    assert train_step_cost(1, 2, 4, loops=3, grad_loops=1, dtype=torch.float32) == OpCost(
        3376 + 3 * 1040 + 6 * 32, 2448 + 48 * 2 * 16 + 5 * 4 * 2 * 3
    )
    assert train_step_cost(1, 2, 4, loops=3, grad_loops=1, dtype=torch.float32) == OpCost(6688, 4104)


def test_looped_matches_the_module():
    """Parameters of ``LoopedBlock`` (position table of exactly ``L`` rows) and the loop's linear FLOPs as
    PyTorch counts them; the causal attention term is ``2 B D L (L + 1)`` on top."""
    B, L, D, H = 2, 5, 16, 2
    block = LoopedBlock(D, H, L, backend="reference")
    assert sum(p.numel() for p in block.parameters()) == loop_params(L, D)
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        block.step(None, torch.randn(B, L, D))
    counts = counter.get_flop_counts()["Global"]
    linear_flops = sum(flops for op, flops in counts.items() if str(op) in ("aten.mm", "aten.addmm"))
    assert linear_flops == loop_forward_flops(B, L, D) - 2 * B * D * L * (L + 1)


def test_smeared_keys_hand_case():
    # 24 bf16 elements x 5 tensors + fp32 alpha x 3 (2 heads); 9 FLOPs/element.
    assert smeared_cost(1, 2, 3, 4, dtype=torch.bfloat16) == OpCost(5 * 24 * 2 + 3 * 2 * 4, 216) == OpCost(264, 216)
    # Without the alpha gradient the backward does not read k.
    assert smeared_cost(1, 2, 3, 4, dtype=torch.bfloat16, alpha_grad=False) == OpCost(4 * 48 + 2 * 8, 6 * 24)
