"""Bad input to every public op and module of ``icrl_kernels`` (the n-gram functions: test_ngram_bad_input.py).

Data-driven: ``ERROR_CASES`` lists calls that must raise ``ValueError``/``TypeError`` whose message names
the argument at fault; ``EQUAL_CASES`` lists odd-but-legal inputs (NaN, empty, huge stride-0 views)
whose result must equal the reference. ``test_every_public_name_is_swept`` makes a new public name fail
until it gets cases here (or in the n-gram file), so no op can skip the sweep.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

import icrl_kernels as K
from icrl_kernels._backend import triton_runs_on
from icrl_kernels.contrastive import action_logits_reference
from icrl_kernels.modules import GPT2Block

NGRAM_FILE = Path(__file__).with_name("test_ngram_bad_input.py")
#: Swept by helper A's n-gram file.
NGRAM_NAMES = {
    "ngram_attention",
    "ngram_attention_reference",
    "ngram_match_matrix",
    "ngram_plan",
    "NGramPlan",
    "NGramDecodeState",
    "transition_ids",
}
#: Public names that are not ops: nothing to feed bad tensors to.
EXEMPT = {
    "BACKENDS": "a tuple of backend names (resolve_backend's bad input is swept instead)",
    "VALUE_CHECK_MODES": "a tuple of mode names (set_value_checks' bad input is swept instead)",
    "value_checks": "a getter with no arguments",
    "device_side_value_checks": "a context manager with no arguments",
    "OvercompleteEmbeddingWarning": "a warning class (orthonormal_embeddings' strict mode is swept instead)",
}


@dataclass(frozen=True)
class Case:
    api: str  # the public name under test
    label: str
    call: Callable[[], object]
    error: type[Exception] = ValueError
    names: str = ""  # regex the message must match: it names the argument (default: label's first word)


def f32(*shape: int, **kwargs) -> torch.Tensor:
    return torch.randn(*shape, **kwargs)


def ids(*shape: int, high: int = 3, **kwargs) -> torch.Tensor:
    return torch.randint(0, high, shape, **kwargs)


def huge(*shape: int, dtype=torch.float32) -> torch.Tensor:
    """A tensor of a huge shape that owns one element (stride 0): shape checks must run before any work."""
    return torch.ones(1, dtype=dtype).expand(*shape)


def action_map(num_actions: int = 3, dim: int = 8, batch: int | None = None) -> K.ActionMap:
    module = K.ActionMap(num_actions, dim)
    module.regenerate(batch, generator=torch.Generator().manual_seed(0))
    return module


META = {"device": "meta"}
NAN = float("nan")
INF = float("inf")

# -- calls that must raise, naming the argument --------------------------------------------------
ERROR_CASES: list[Case] = [
    # backend resolution and value-check modes
    Case("resolve_backend", "backend unknown", lambda: K.resolve_backend("cuda", torch.device("cpu"))),
    Case("resolve_backend", "backend not a str", lambda: K.resolve_backend(1, torch.device("cpu"))),
    Case("resolve_backend", "device unknown", lambda: K.resolve_backend("auto", "gpu")),
    Case("resolve_backend", "device a list", lambda: K.resolve_backend("auto", ["cpu"]), TypeError),
    Case("set_value_checks", "mode unknown", lambda: K.set_value_checks("loud")),
    Case("set_value_checks", "mode not a str", lambda: K.set_value_checks(None)),
    # infonce_loss
    Case("infonce_loss", "pred not a tensor", lambda: K.infonce_loss([1.0], f32(3, 8), ids(1)), TypeError),
    Case("infonce_loss", "pred int", lambda: K.infonce_loss(ids(2, 8), f32(3, 8), ids(2)), TypeError),
    Case("infonce_loss", "pred rank 1", lambda: K.infonce_loss(f32(8), f32(3, 8), ids(1))),
    Case("infonce_loss", "pred rank 4", lambda: K.infonce_loss(f32(1, 2, 2, 8), f32(3, 8), ids(1, 2, 2))),
    Case("infonce_loss", "pred empty", lambda: K.infonce_loss(f32(0, 8), f32(3, 8), ids(0))),
    Case("infonce_loss", "action_embeds empty (A = 0)", lambda: K.infonce_loss(f32(2, 8), f32(0, 8), ids(2))),
    Case("infonce_loss", "action_embeds width", lambda: K.infonce_loss(f32(2, 8), f32(3, 7), ids(2))),
    Case(
        "infonce_loss", "action_embeds dtype", lambda: K.infonce_loss(f32(2, 8), f32(3, 8).double(), ids(2)), TypeError
    ),
    Case("infonce_loss", "action_embeds batch", lambda: K.infonce_loss(f32(2, 4, 8), f32(3, 5, 8), ids(2, 4))),
    Case("infonce_loss", "action_embeds on meta", lambda: K.infonce_loss(f32(2, 8), f32(3, 8, **META), ids(2))),
    Case("infonce_loss", "targets shape", lambda: K.infonce_loss(f32(2, 8), f32(3, 8), ids(3))),
    Case("infonce_loss", "targets float", lambda: K.infonce_loss(f32(2, 8), f32(3, 8), ids(2).float()), TypeError),
    Case("infonce_loss", "targets on meta", lambda: K.infonce_loss(f32(2, 8), f32(3, 8), ids(2, **META))),
    Case("infonce_loss", "targets out of range", lambda: K.infonce_loss(f32(2, 8), f32(3, 8), torch.tensor([0, 3]))),
    Case("infonce_loss", "targets negative", lambda: K.infonce_loss(f32(2, 8), f32(3, 8), torch.tensor([0, -5]))),
    Case(
        "infonce_loss",
        "targets unavailable",
        lambda: K.infonce_loss(f32(2, 8), f32(3, 8), torch.tensor([0, 2]), mask=torch.tensor([True, True, False])),
    ),
    Case(
        "infonce_loss",
        "mask shape",
        lambda: K.infonce_loss(f32(2, 8), f32(3, 8), ids(2), mask=torch.ones(4, dtype=torch.bool)),
    ),
    Case(
        "infonce_loss",
        "mask dtype",
        lambda: K.infonce_loss(f32(2, 8), f32(3, 8), ids(2), mask=torch.ones(3)),
        TypeError,
    ),
    Case(
        "infonce_loss",
        "mask row with no action",
        lambda: K.infonce_loss(f32(2, 8), f32(3, 8), ids(2), mask=torch.zeros(3, dtype=torch.bool)),
    ),
    Case("infonce_loss", "tau zero", lambda: K.infonce_loss(f32(2, 8), f32(3, 8), ids(2), tau=0.0)),
    Case("infonce_loss", "tau NaN", lambda: K.infonce_loss(f32(2, 8), f32(3, 8), ids(2), tau=NAN)),
    Case("infonce_loss", "tau inf", lambda: K.infonce_loss(f32(2, 8), f32(3, 8), ids(2), tau=INF)),
    Case(
        "infonce_loss",
        "tau a tensor",
        lambda: K.infonce_loss(f32(2, 8), f32(3, 8), ids(2), tau=torch.tensor(1.0)),
        TypeError,
    ),
    Case("infonce_loss", "tau a str", lambda: K.infonce_loss(f32(2, 8), f32(3, 8), ids(2), tau="1"), TypeError),
    Case("infonce_loss", "reduction unknown", lambda: K.infonce_loss(f32(2, 8), f32(3, 8), ids(2), reduction="max")),
    Case(
        "infonce_loss",
        "ignore_index float",
        lambda: K.infonce_loss(f32(2, 8), f32(3, 8), ids(2), ignore_index=-100.0),
        TypeError,
    ),
    Case("infonce_loss", "backend unknown", lambda: K.infonce_loss(f32(2, 8), f32(3, 8), ids(2), backend="cuda")),
    # select_actions
    Case("select_actions", "pred not a tensor", lambda: K.select_actions(None, f32(3, 8)), TypeError),
    Case("select_actions", "pred NaN", lambda: K.select_actions(torch.full((2, 8), NAN), f32(3, 8))),
    Case(
        "select_actions",
        "pred or action_embeds NaN (in action_embeds)",
        lambda: K.select_actions(f32(2, 8), torch.full((3, 8), NAN)),
        names="action_embeds",
    ),
    Case("select_actions", "action_embeds width", lambda: K.select_actions(f32(2, 8), f32(3, 9))),
    Case(
        "select_actions",
        "mask on meta",
        lambda: K.select_actions(f32(2, 8), f32(3, 8), mask=torch.ones(3, dtype=torch.bool, **META)),
    ),
    Case(
        "select_actions",
        "mask with no action",
        lambda: K.select_actions(f32(2, 8), f32(3, 8), mask=torch.zeros(3, dtype=torch.bool)),
    ),
    Case("select_actions", "mode unknown", lambda: K.select_actions(f32(2, 8), f32(3, 8), mode="greedy")),
    Case("select_actions", "generator an int", lambda: K.select_actions(f32(2, 8), f32(3, 8), generator=42), TypeError),
    Case("select_actions", "tau negative", lambda: K.select_actions(f32(2, 8), f32(3, 8), tau=-1.0)),
    # the reference functions of the contrastive ops: the same spec, no fused path
    # orthonormal_embeddings
    Case("orthonormal_embeddings", "num_actions zero", lambda: K.orthonormal_embeddings(0, 4)),
    Case("orthonormal_embeddings", "num_actions float", lambda: K.orthonormal_embeddings(3.0, 4), TypeError),
    Case("orthonormal_embeddings", "dim negative", lambda: K.orthonormal_embeddings(3, -4)),
    Case("orthonormal_embeddings", "batch zero", lambda: K.orthonormal_embeddings(3, 4, batch=0)),
    Case("orthonormal_embeddings", "dtype a str", lambda: K.orthonormal_embeddings(3, 4, dtype="float32"), TypeError),
    Case("orthonormal_embeddings", "dtype int", lambda: K.orthonormal_embeddings(3, 4, dtype=torch.int64), TypeError),
    Case("orthonormal_embeddings", "generator an int", lambda: K.orthonormal_embeddings(3, 4, generator=42), TypeError),
    Case("orthonormal_embeddings", "device unknown", lambda: K.orthonormal_embeddings(3, 4, device="gpu0")),
    Case("orthonormal_embeddings", "device a float", lambda: K.orthonormal_embeddings(3, 4, device=1.5), TypeError),
    Case(
        "orthonormal_embeddings",
        "device cuda where there is none",
        lambda: K.orthonormal_embeddings(3, 4, device="cuda:7"),
        names=r"device 'cuda:7' (asked for CUDA|does not exist)",
    ),
    Case(
        "ActionMap", "device unknown (regenerate)", lambda: K.ActionMap(3, 8).regenerate(device="gpu"), names="device"
    ),
    Case("orthonormal_embeddings", "strict a str", lambda: K.orthonormal_embeddings(3, 4, strict="yes"), TypeError),
    Case("orthonormal_embeddings", "num_actions > dim (strict)", lambda: K.orthonormal_embeddings(5, 4, strict=True)),
    # mixture_of_heads
    Case("mixture_of_heads", "head_out not a tensor", lambda: K.mixture_of_heads([1.0], f32(2, 3, 4)), TypeError),
    Case("mixture_of_heads", "head_out rank", lambda: K.mixture_of_heads(f32(2, 3, 32), f32(2, 3, 4))),
    Case("mixture_of_heads", "head_out int", lambda: K.mixture_of_heads(ids(2, 3, 4, 8), f32(2, 3, 4)), TypeError),
    Case("mixture_of_heads", "gate_logits shape", lambda: K.mixture_of_heads(f32(2, 3, 4, 8), f32(2, 3, 5))),
    Case("mixture_of_heads", "gate_logits on meta", lambda: K.mixture_of_heads(f32(2, 3, 4, 8), f32(2, 3, 4, **META))),
    Case(
        "mixture_of_heads",
        "gate_logits huge head_out",
        lambda: K.mixture_of_heads(huge(2**20, 2**20, 4, 8), f32(2, 3, 4)),
    ),
    Case("mixture_of_heads", "gate unknown", lambda: K.mixture_of_heads(f32(2, 3, 4, 8), f32(2, 3, 4), gate="relu")),
    Case("mixture_of_heads", "gate not a str", lambda: K.mixture_of_heads(f32(2, 3, 4, 8), f32(2, 3, 4), gate=1)),
    Case(
        "mixture_of_heads", "backend unknown", lambda: K.mixture_of_heads(f32(2, 3, 4, 8), f32(2, 3, 4), backend="fast")
    ),
    Case(
        "mixture_of_heads_reference",
        "gate unknown",
        lambda: K.mixture_of_heads_reference(f32(2, 3, 4, 8), f32(2, 3, 4), gate="relu"),
    ),
    # gated_attention
    Case(
        "gated_attention",
        "q not a tensor",
        lambda: K.gated_attention(None, f32(1, 2, 3, 8), f32(1, 2, 3, 8)),
        TypeError,
    ),
    Case("gated_attention", "q rank", lambda: K.gated_attention(f32(2, 3, 8), f32(2, 3, 8), f32(2, 3, 8))),
    Case("gated_attention", "k shape", lambda: K.gated_attention(f32(1, 2, 3, 8), f32(1, 2, 4, 8), f32(1, 2, 3, 8))),
    Case(
        "gated_attention",
        "v dtype",
        lambda: K.gated_attention(f32(1, 2, 3, 8), f32(1, 2, 3, 8), f32(1, 2, 3, 8).double()),
        TypeError,
    ),
    Case(
        "gated_attention",
        "gate_logits shape",
        lambda: K.gated_attention(f32(1, 2, 3, 8), f32(1, 2, 3, 8), f32(1, 2, 3, 8), f32(1, 2, 3)),
    ),
    Case(
        "gated_attention",
        "gate_logits on meta",
        lambda: K.gated_attention(f32(1, 2, 3, 8), f32(1, 2, 3, 8), f32(1, 2, 3, 8), f32(1, 3, 2, **META)),
    ),
    Case(
        "gated_attention",
        "gate unknown",
        lambda: K.gated_attention(f32(1, 2, 3, 8), f32(1, 2, 3, 8), f32(1, 2, 3, 8), f32(1, 3, 2), gate="relu"),
    ),
    Case(
        "gated_attention",
        "smear_alpha shape",
        lambda: K.gated_attention(f32(1, 2, 3, 8), f32(1, 2, 3, 8), f32(1, 2, 3, 8), smear_alpha=f32(3)),
    ),
    Case(
        "gated_attention",
        "smear_alpha int",
        lambda: K.gated_attention(f32(1, 2, 3, 8), f32(1, 2, 3, 8), f32(1, 2, 3, 8), smear_alpha=ids(2)),
        TypeError,
    ),
    Case(
        "gated_attention",
        "k huge",
        lambda: K.gated_attention(f32(1, 2, 3, 8), huge(2**20, 2, 2**20, 8), f32(1, 2, 3, 8)),
    ),
    Case(
        "gated_attention",
        "backend unknown",
        lambda: K.gated_attention(f32(1, 2, 3, 8), f32(1, 2, 3, 8), f32(1, 2, 3, 8), backend="flash"),
    ),
    # smeared_keys
    Case("smeared_keys", "k rank", lambda: K.smeared_keys(f32(3, 5, 4), f32(3))),
    Case("smeared_keys", "k not a tensor", lambda: K.smeared_keys(1.0, f32(3)), TypeError),
    Case("smeared_keys", "alpha shape", lambda: K.smeared_keys(f32(2, 3, 5, 4), f32(4))),
    Case("smeared_keys", "alpha a list", lambda: K.smeared_keys(f32(2, 3, 5, 4), [0.0, 0.0, 0.0]), TypeError),
    Case("smeared_keys", "alpha int", lambda: K.smeared_keys(f32(2, 3, 5, 4), ids(3)), TypeError),
    Case("smeared_keys", "alpha on meta", lambda: K.smeared_keys(f32(2, 3, 5, 4), f32(3, **META))),
    Case("smeared_keys", "alpha huge k", lambda: K.smeared_keys(huge(2**16, 7, 2**16, 64), f32(3))),
    Case("smeared_keys", "backend unknown", lambda: K.smeared_keys(f32(2, 3, 5, 4), f32(3), backend="x")),
    # inject_layer_norm
    Case("inject_layer_norm", "prompt rank", lambda: K.inject_layer_norm(None, f32(3, 8), None, f32(8), None)),
    Case("inject_layer_norm", "prompt width zero", lambda: K.inject_layer_norm(None, f32(2, 3, 0), None, f32(0), None)),
    Case(
        "inject_layer_norm",
        "prompt int",
        lambda: K.inject_layer_norm(None, ids(2, 3, 8), None, f32(8), None),
        TypeError,
    ),
    Case("inject_layer_norm", "y shape", lambda: K.inject_layer_norm(f32(2, 4, 8), f32(2, 3, 8), None, f32(8), None)),
    Case(
        "inject_layer_norm",
        "y dtype",
        lambda: K.inject_layer_norm(f32(2, 3, 8).half(), f32(2, 3, 8), None, f32(8), None),
        TypeError,
    ),
    Case("inject_layer_norm", "pos shape", lambda: K.inject_layer_norm(None, f32(2, 3, 8), f32(4, 8), f32(8), None)),
    Case("inject_layer_norm", "weight width", lambda: K.inject_layer_norm(None, f32(2, 3, 8), None, f32(7), None)),
    Case(
        "inject_layer_norm",
        "weight on meta",
        lambda: K.inject_layer_norm(None, f32(2, 3, 8), None, f32(8, **META), None),
    ),
    Case(
        "inject_layer_norm",
        "weight huge prompt",
        lambda: K.inject_layer_norm(None, huge(2**20, 2**20, 8), None, f32(7), None),
    ),
    Case("inject_layer_norm", "bias width", lambda: K.inject_layer_norm(None, f32(2, 3, 8), None, f32(8), f32(9))),
    Case("inject_layer_norm", "eps zero", lambda: K.inject_layer_norm(None, f32(2, 3, 8), None, f32(8), None, eps=0.0)),
    Case("inject_layer_norm", "eps NaN", lambda: K.inject_layer_norm(None, f32(2, 3, 8), None, f32(8), None, eps=NAN)),
    Case(
        "inject_layer_norm",
        "eps a tensor",
        lambda: K.inject_layer_norm(None, f32(2, 3, 8), None, f32(8), None, eps=torch.tensor(1e-5)),
        TypeError,
    ),
    # MoAAttention
    Case("MoAAttention", "d_model zero", lambda: K.MoAAttention(0, 1)),
    Case("MoAAttention", "d_model float", lambda: K.MoAAttention(64.0, 4), TypeError),
    Case("MoAAttention", "n_heads not dividing d_model", lambda: K.MoAAttention(64, 5), names="n_heads"),
    Case("MoAAttention", "n_heads zero", lambda: K.MoAAttention(64, 0)),
    Case("MoAAttention", "gate unknown", lambda: K.MoAAttention(64, 4, gate="relu")),
    Case("MoAAttention", "dropout 1", lambda: K.MoAAttention(64, 4, dropout=1.0)),
    Case("MoAAttention", "dropout NaN", lambda: K.MoAAttention(64, 4, dropout=NAN)),
    Case("MoAAttention", "dropout a str", lambda: K.MoAAttention(64, 4, dropout="0.1"), TypeError),
    Case("MoAAttention", "bias a str", lambda: K.MoAAttention(64, 4, bias="yes"), TypeError),
    Case("MoAAttention", "backend unknown", lambda: K.MoAAttention(64, 4, backend="cuda")),
    Case(
        "MoAAttention",
        "x width",
        lambda: K.MoAAttention(64, 4)(f32(2, 5, 63)),
        names=r"x must have shape \[B, L, 64\] \(d_model=64\), got \[2, 5, 63\]",
    ),
    Case("MoAAttention", "x rank", lambda: K.MoAAttention(64, 4)(f32(5, 64))),
    Case("MoAAttention", "x int", lambda: K.MoAAttention(64, 4)(ids(2, 5, 64)), TypeError),
    Case("MoAAttention", "x not a tensor", lambda: K.MoAAttention(64, 4)([[0.0] * 64]), TypeError),
    Case("MoAAttention", "x fp16 with fp32 parameters", lambda: K.MoAAttention(64, 4)(f32(2, 5, 64).half()), TypeError),
    Case("MoAAttention", "x on meta", lambda: K.MoAAttention(64, 4)(f32(2, 5, 64, **META))),
    Case("MoAAttention", "x huge", lambda: K.MoAAttention(8, 2)(huge(2**20, 2**20, 7))),
    Case("MoAAttention", "gate_input width", lambda: K.MoAAttention(64, 4)(f32(2, 5, 64), gate_input=f32(2, 5, 32))),
    Case("MoAAttention", "gate_input length", lambda: K.MoAAttention(64, 4)(f32(2, 5, 64), gate_input=f32(2, 4, 64))),
    Case(
        "MoAAttention",
        "gate_input shape (ungated)",
        lambda: K.MoAAttention(64, 4, gate=None)(f32(2, 5, 64), gate_input=f32(2, 4, 64)),
    ),
    Case(
        "MoAAttention",
        "gate_input dtype",
        lambda: K.MoAAttention(64, 4)(f32(2, 5, 64), gate_input=f32(2, 5, 64).double()),
        TypeError,
    ),
    Case(
        "MoAAttention",
        "attn_mask shape",
        lambda: K.MoAAttention(64, 4)(f32(2, 5, 64), attn_mask=torch.ones(3, 3, dtype=torch.bool)),
    ),
    Case(
        "MoAAttention",
        "attn_mask rank 5",
        lambda: K.MoAAttention(64, 4)(f32(2, 5, 64), attn_mask=torch.ones(1, 1, 1, 5, 5, dtype=torch.bool)),
    ),
    Case(
        "MoAAttention",
        "attn_mask float",
        lambda: K.MoAAttention(64, 4)(f32(2, 5, 64), attn_mask=torch.ones(5, 5)),
        TypeError,
    ),
    Case(
        "MoAAttention",
        "attn_mask on meta",
        lambda: K.MoAAttention(64, 4)(f32(2, 5, 64), attn_mask=torch.ones(5, 5, dtype=torch.bool, **META)),
    ),
    Case("MoAAttention", "head_mask shape", lambda: K.MoAAttention(64, 4)(f32(2, 5, 64), head_mask=torch.ones(3))),
    Case(
        "MoAAttention",
        "head_mask bool",
        lambda: K.MoAAttention(64, 4)(f32(2, 5, 64), head_mask=torch.ones(4, dtype=torch.bool)),
        TypeError,
    ),
    # GPT2Block (the loop body; not exported at the top level, but LoopedBlock's public building block)
    Case("LoopedBlock", "d_model negative (GPT2Block)", lambda: GPT2Block(-1, 4), names="d_model"),
    Case("LoopedBlock", "eps negative (GPT2Block)", lambda: GPT2Block(64, 4, eps=-1.0), names="eps"),
    Case("LoopedBlock", "dropout 2 (GPT2Block)", lambda: GPT2Block(64, 4, dropout=2.0), names="dropout"),
    Case(
        "LoopedBlock",
        "x width (GPT2Block)",
        lambda: GPT2Block(64, 4)(f32(2, 5, 63)),
        names=r"x must have shape \[B, L, 64\]",
    ),
    Case("LoopedBlock", "x int (GPT2Block)", lambda: GPT2Block(64, 4)(ids(2, 5, 64)), TypeError, names="x"),
    Case("LoopedBlock", "x fp16 (GPT2Block)", lambda: GPT2Block(64, 4)(f32(2, 5, 64).half()), TypeError, names="x"),
    Case(
        "LoopedBlock",
        "normed shape (GPT2Block)",
        lambda: GPT2Block(64, 4)(f32(2, 5, 64), normed=f32(2, 4, 64)),
        names="normed",
    ),
    Case(
        "LoopedBlock",
        "head_mask shape (GPT2Block)",
        lambda: GPT2Block(64, 4)(f32(2, 5, 64), head_mask=torch.ones(2)),
        names="head_mask",
    ),
    # LoopedBlock
    Case("LoopedBlock", "n_heads not dividing d_model", lambda: K.LoopedBlock(64, 5, 16), names="n_heads"),
    Case("LoopedBlock", "max_positions zero", lambda: K.LoopedBlock(64, 4, 0)),
    Case("LoopedBlock", "n_layers zero", lambda: K.LoopedBlock(64, 4, 16, n_layers=0)),
    Case("LoopedBlock", "dropout negative", lambda: K.LoopedBlock(64, 4, 16, dropout=-0.1)),
    Case("LoopedBlock", "cuda_graph a str", lambda: K.LoopedBlock(64, 4, 16, cuda_graph="no"), TypeError),
    Case("LoopedBlock", "backend unknown", lambda: K.LoopedBlock(64, 4, 16, backend="fast")),
    Case(
        "LoopedBlock",
        "prompt width",
        lambda: K.LoopedBlock(64, 4, 16)(f32(2, 5, 63), loops=2),
        names=r"prompt must have shape \[B, L, 64\]",
    ),
    Case(
        "LoopedBlock",
        "prompt length > max_positions",
        lambda: K.LoopedBlock(64, 4, 4)(f32(2, 5, 64), loops=2),
        names="prompt length",
    ),
    Case("LoopedBlock", "prompt fp16", lambda: K.LoopedBlock(64, 4, 16)(f32(2, 5, 64).half(), loops=2), TypeError),
    Case("LoopedBlock", "prompt int", lambda: K.LoopedBlock(64, 4, 16)(ids(2, 5, 64), loops=2), TypeError),
    Case("LoopedBlock", "prompt on meta", lambda: K.LoopedBlock(64, 4, 16)(f32(2, 5, 64, **META), loops=2)),
    Case(
        "LoopedBlock", "prompt width (step)", lambda: K.LoopedBlock(64, 4, 16).step(None, f32(2, 5, 63)), names="prompt"
    ),
    Case(
        "LoopedBlock",
        "prompt width (iterates)",
        lambda: K.LoopedBlock(64, 4, 16).iterates(f32(2, 5, 63), 2),
        names="prompt",
    ),
    Case(
        "LoopedBlock", "y shape (step)", lambda: K.LoopedBlock(64, 4, 16).step(f32(2, 4, 64), f32(2, 5, 64)), names="y"
    ),
    Case("LoopedBlock", "loops zero", lambda: K.LoopedBlock(64, 4, 16)(f32(2, 5, 64), loops=0)),
    Case("LoopedBlock", "loops float", lambda: K.LoopedBlock(64, 4, 16)(f32(2, 5, 64), loops=2.0), TypeError),
    Case("LoopedBlock", "grad_loops > loops", lambda: K.LoopedBlock(64, 4, 16)(f32(2, 5, 64), loops=2, grad_loops=3)),
    Case(
        "LoopedBlock",
        "read_out not callable",
        lambda: K.LoopedBlock(64, 4, 16)(f32(2, 5, 64), loops=2, read_out=3),
        TypeError,
    ),
    # SmearedKeyAttention
    Case(
        "SmearedKeyAttention", "num_heads not dividing d_model", lambda: K.SmearedKeyAttention(64, 5), names="num_heads"
    ),
    Case("SmearedKeyAttention", "d_model a str", lambda: K.SmearedKeyAttention("64", 4), TypeError),
    Case("SmearedKeyAttention", "smear_init NaN", lambda: K.SmearedKeyAttention(64, 4, smear_init=NAN)),
    Case("SmearedKeyAttention", "smear_init a str", lambda: K.SmearedKeyAttention(64, 4, smear_init="0"), TypeError),
    Case("SmearedKeyAttention", "smear a str", lambda: K.SmearedKeyAttention(64, 4, smear="yes"), TypeError),
    Case("SmearedKeyAttention", "backend unknown", lambda: K.SmearedKeyAttention(64, 4, backend="fast")),
    Case(
        "SmearedKeyAttention",
        "x width",
        lambda: K.SmearedKeyAttention(64, 4)(f32(2, 5, 63)),
        names=r"x must have shape \[B, L, 64\]",
    ),
    Case("SmearedKeyAttention", "x rank", lambda: K.SmearedKeyAttention(64, 4)(f32(5, 64))),
    Case("SmearedKeyAttention", "x int", lambda: K.SmearedKeyAttention(64, 4)(ids(2, 5, 64)), TypeError),
    Case(
        "SmearedKeyAttention",
        "x fp16 with fp32 parameters",
        lambda: K.SmearedKeyAttention(64, 4)(f32(2, 5, 64).half()),
        TypeError,
    ),
    Case(
        "SmearedKeyAttention",
        "x width (attention_pattern)",
        lambda: K.SmearedKeyAttention(64, 4).attention_pattern(f32(2, 5, 63)),
    ),
    # NGramAttention (the module; the functional op is helper A's sweep)
    Case("NGramAttention", "d_model zero", lambda: K.NGramAttention(0, 2)),
    Case("NGramAttention", "n zero", lambda: K.NGramAttention(8, 0)),
    Case("NGramAttention", "n float", lambda: K.NGramAttention(8, 2.0), TypeError),
    Case("NGramAttention", "bias a str", lambda: K.NGramAttention(8, 2, "no"), TypeError),
    Case("NGramAttention", "backend unknown", lambda: K.NGramAttention(8, 2, backend="fast")),
    Case(
        "NGramAttention",
        "h width",
        lambda: K.NGramAttention(64, 2)(f32(2, 5, 63), ids(2, 5)),
        names=r"h must have shape \[B, L, 64\] \(d_model=64\)",
    ),
    Case("NGramAttention", "h rank", lambda: K.NGramAttention(8, 2)(f32(5, 8), ids(2, 5))),
    Case("NGramAttention", "h int", lambda: K.NGramAttention(8, 2)(ids(2, 5, 8), ids(2, 5)), TypeError),
    Case(
        "NGramAttention",
        "h fp16 with fp32 parameters",
        lambda: K.NGramAttention(8, 2)(f32(2, 5, 8).half(), ids(2, 5)),
        TypeError,
    ),
    Case("NGramAttention", "h on meta", lambda: K.NGramAttention(8, 2)(f32(2, 5, 8, **META), ids(2, 5))),
    Case("NGramAttention", "ids shape", lambda: K.NGramAttention(8, 2)(f32(2, 5, 8), ids(2, 4))),
    Case("NGramAttention", "ids float", lambda: K.NGramAttention(8, 2)(f32(2, 5, 8), ids(2, 5).float()), TypeError),
    Case("NGramAttention", "ids on meta", lambda: K.NGramAttention(8, 2)(f32(2, 5, 8), ids(2, 5, **META))),
    Case("NGramAttention", "h_t width (step)", lambda: _ngram_step(h_t=f32(2, 7)), names="h_t"),
    Case("NGramAttention", "h_t rank (step)", lambda: _ngram_step(h_t=f32(2, 1, 8)), names="h_t"),
    Case("NGramAttention", "ids_t shape (step)", lambda: _ngram_step(ids_t=ids(2, 2)), names="ids_t"),
    Case("NGramAttention", "state of another layer (step)", lambda: _ngram_step(state_n=3), names="state"),
    Case(
        "NGramAttention",
        "state not a state (step)",
        lambda: K.NGramAttention(8, 2).step(None, f32(2, 8), ids(2)),
        TypeError,
        names="state",
    ),
    # ActionMap
    Case("ActionMap", "num_actions zero", lambda: K.ActionMap(0, 8)),
    Case("ActionMap", "embed_dim float", lambda: K.ActionMap(3, 8.0), TypeError),
    Case("ActionMap", "tau zero", lambda: K.ActionMap(3, 8, tau=0)),
    Case("ActionMap", "backend unknown", lambda: K.ActionMap(3, 8, backend="cuda")),
    Case(
        "ActionMap",
        "map missing (regenerate first)",
        lambda: K.ActionMap(3, 8)(f32(2, 8), ids(2)),
        RuntimeError,
        names="regenerate",
    ),
    Case(
        "ActionMap",
        "generator an int (regenerate)",
        lambda: K.ActionMap(3, 8).regenerate(generator=42),
        TypeError,
        names="generator",
    ),
    Case("ActionMap", "batch zero (regenerate)", lambda: K.ActionMap(3, 8).regenerate(0), names="batch"),
    Case(
        "ActionMap",
        "num_actions zero (regenerate)",
        lambda: K.ActionMap(3, 8).regenerate(num_actions=0),
        names="num_actions",
    ),
    Case("ActionMap", "actions float (embed)", lambda: action_map().embed(f32(2)), TypeError, names="actions"),
    Case("ActionMap", "actions out of range (embed)", lambda: action_map().embed(torch.tensor([3])), names="actions"),
    Case("ActionMap", "actions below -1 (embed)", lambda: action_map().embed(torch.tensor([-2])), names="actions"),
    Case("ActionMap", "actions on meta (embed)", lambda: action_map().embed(ids(2, **META)), names="actions"),
    Case(
        "ActionMap",
        "actions batch (embed, per sequence)",
        lambda: action_map(batch=2).embed(ids(3, 4)),
        names="actions",
    ),
    Case("ActionMap", "batch_size a str (prompt)", lambda: action_map().prompt("2"), TypeError, names="batch_size"),
    Case("ActionMap", "batch_size (prompt, per sequence)", lambda: action_map(batch=2).prompt(3), names="batch_size"),
    Case("ActionMap", "pred not a tensor (forward)", lambda: action_map()([0.0] * 8, ids(1)), TypeError, names="pred"),
    Case("ActionMap", "pred width (forward)", lambda: action_map()(f32(2, 7), ids(2)), names="pred"),
    Case("ActionMap", "targets shape (forward)", lambda: action_map()(f32(2, 8), ids(3)), names="targets"),
    Case(
        "ActionMap",
        "targets out of range (forward)",
        lambda: action_map()(f32(2, 8), torch.tensor([0, 3])),
        names="targets",
    ),
    Case(
        "ActionMap",
        "reduction unknown (forward)",
        lambda: action_map()(f32(2, 8), ids(2), reduction="avg"),
        names="reduction",
    ),
    Case("ActionMap", "pred not a tensor (select)", lambda: action_map().select("x"), TypeError, names="pred"),
    Case("ActionMap", "mode unknown (select)", lambda: action_map().select(f32(2, 8), mode="best"), names="mode"),
]


def _ngram_step(*, h_t=None, ids_t=None, state_n: int = 2):
    layer = K.NGramAttention(8, 2)
    state = K.NGramDecodeState(2, 8, state_n, 4)
    return layer.step(state, f32(2, 8) if h_t is None else h_t, ids(2) if ids_t is None else ids_t)


def _argument_pattern(case: Case) -> str:
    if case.names:
        return case.names
    return r"\b" + re.escape(case.label.split()[0]) + r"\b"


@pytest.mark.parametrize("case", ERROR_CASES, ids=lambda c: f"{c.api}: {c.label}")
def test_bad_input_raises_naming_the_argument(case: Case):
    with pytest.raises(case.error, match=_argument_pattern(case)):
        case.call()


# -- the reference functions: the readable spec, with the public ops' argument checks ---------------
REFERENCE_CASES: list[Case] = [
    Case(
        "mixture_of_heads_reference",
        "gate_logits shape",
        lambda: K.mixture_of_heads_reference(f32(2, 3, 4, 8), f32(2, 3, 5)),
    ),
    Case("smeared_keys_reference", "alpha shape", lambda: K.smeared_keys_reference(f32(2, 3, 5, 4), f32(4))),
    Case(
        "gated_attention_reference",
        "gate_logits shape",
        lambda: K.gated_attention_reference(f32(1, 2, 3, 8), f32(1, 2, 3, 8), f32(1, 2, 3, 8), f32(1, 2, 3)),
    ),
    Case(
        "gated_attention_reference",
        "smear_alpha not a tensor",
        lambda: K.gated_attention_reference(f32(1, 2, 3, 8), f32(1, 2, 3, 8), f32(1, 2, 3, 8), smear_alpha=[0.0]),
        TypeError,
    ),
    Case(
        "infonce_loss_reference", "action_embeds width", lambda: K.infonce_loss_reference(f32(2, 8), f32(3, 7), ids(2))
    ),
    Case("select_actions_reference", "action_embeds width", lambda: K.select_actions_reference(f32(2, 8), f32(3, 7))),
    Case(
        "inject_layer_norm_reference",
        "weight width",
        lambda: K.inject_layer_norm_reference(None, f32(2, 3, 8), None, f32(7), None),
    ),
    Case(
        "infonce_loss_reference",
        "reduction unknown",
        lambda: K.infonce_loss_reference(f32(2, 8), f32(3, 8), ids(2), reduction="max"),
    ),
    Case(
        "select_actions_reference", "pred not a tensor", lambda: K.select_actions_reference([0.0], f32(3, 8)), TypeError
    ),
    Case("infonce_loss_reference", "pred rank 1", lambda: K.infonce_loss_reference(f32(8), f32(3, 8), ids(1))),
    Case(
        "infonce_loss_reference",
        "action_embeds dtype",
        lambda: K.infonce_loss_reference(f32(2, 8), f32(3, 8).double(), ids(2)),
        TypeError,
    ),
    Case("infonce_loss_reference", "targets shape", lambda: K.infonce_loss_reference(f32(2, 8), f32(3, 8), ids(3))),
    Case(
        "infonce_loss_reference",
        "targets float",
        lambda: K.infonce_loss_reference(f32(2, 8), f32(3, 8), ids(2).float()),
        TypeError,
    ),
    Case(
        "infonce_loss_reference",
        "targets out of range",
        lambda: K.infonce_loss_reference(f32(2, 8), f32(3, 8), torch.tensor([0, 3])),
    ),
    Case(
        "infonce_loss_reference",
        "targets unavailable",
        lambda: K.infonce_loss_reference(
            f32(2, 8), f32(3, 8), torch.tensor([0, 2]), mask=torch.tensor([True, True, False])
        ),
    ),
    Case(
        "infonce_loss_reference",
        "mask shape",
        lambda: K.infonce_loss_reference(f32(2, 8), f32(3, 8), ids(2), mask=torch.ones(4, dtype=torch.bool)),
    ),
    Case(
        "infonce_loss_reference",
        "mask row with no action",
        lambda: K.infonce_loss_reference(f32(2, 8), f32(3, 8), ids(2), mask=torch.zeros(3, dtype=torch.bool)),
    ),
    Case("infonce_loss_reference", "tau zero", lambda: K.infonce_loss_reference(f32(2, 8), f32(3, 8), ids(2), tau=0.0)),
    Case(
        "infonce_loss_reference",
        "ignore_index float",
        lambda: K.infonce_loss_reference(f32(2, 8), f32(3, 8), ids(2), ignore_index=-100.0),
        TypeError,
    ),
    Case(
        "select_actions_reference",
        "action_embeds batch",
        lambda: K.select_actions_reference(f32(2, 4, 8), f32(3, 5, 8)),
    ),
    Case(
        "select_actions_reference",
        "mask with no action",
        lambda: K.select_actions_reference(f32(2, 8), f32(3, 8), mask=torch.zeros(3, dtype=torch.bool)),
    ),
    Case(
        "select_actions_reference",
        "tau a str",
        lambda: K.select_actions_reference(f32(2, 8), f32(3, 8), tau="1"),
        TypeError,
    ),
    Case(
        "select_actions_reference",
        "pred NaN",
        lambda: K.select_actions_reference(torch.full((2, 8), NAN), f32(3, 8), mask=torch.tensor([False, True, True])),
    ),
    Case(
        "select_actions_reference",
        "action_embeds NaN (argmax)",
        lambda: K.select_actions_reference(f32(2, 8), torch.full((3, 8), NAN)),
    ),
    Case(
        "select_actions",
        "pred NaN (reference backend, masked)",
        lambda: K.select_actions(
            torch.full((2, 8), NAN),
            f32(3, 8),
            mode="argmax",
            mask=torch.tensor([False, True, True]),
            backend="reference",
        ),
    ),
    Case(
        "select_actions_reference",
        "gumbel shape",
        lambda: K.select_actions_reference(f32(2, 8), f32(3, 8), gumbel=f32(2, 4)),
    ),
    Case(
        "mixture_of_heads_reference",
        "head_out rank",
        lambda: K.mixture_of_heads_reference(f32(2, 3, 32), f32(2, 3, 4)),
    ),
    Case(
        "mixture_of_heads_reference",
        "gate_logits int",
        lambda: K.mixture_of_heads_reference(f32(2, 3, 4, 8), ids(2, 3, 4)),
        TypeError,
    ),
    Case(
        "mixture_of_heads_reference",
        "gate_logits on meta",
        lambda: K.mixture_of_heads_reference(f32(2, 3, 4, 8), f32(2, 3, 4, **META)),
    ),
    Case("smeared_keys_reference", "k rank", lambda: K.smeared_keys_reference(f32(3, 5, 4), f32(3))),
    Case(
        "smeared_keys_reference",
        "alpha a list",
        lambda: K.smeared_keys_reference(f32(2, 3, 5, 4), [0.0] * 3),
        TypeError,
    ),
    Case(
        "inject_layer_norm_reference",
        "prompt rank",
        lambda: K.inject_layer_norm_reference(None, f32(3, 8), None, f32(8), None),
    ),
    Case(
        "inject_layer_norm_reference",
        "y dtype",
        lambda: K.inject_layer_norm_reference(f32(2, 3, 8).double(), f32(2, 3, 8), None, f32(8), None),
        TypeError,
    ),
    Case(
        "inject_layer_norm_reference",
        "pos shape",
        lambda: K.inject_layer_norm_reference(None, f32(2, 3, 8), f32(4, 8), f32(8), None),
    ),
    Case(
        "inject_layer_norm_reference",
        "bias width",
        lambda: K.inject_layer_norm_reference(None, f32(2, 3, 8), None, f32(8), f32(9)),
    ),
    Case(
        "inject_layer_norm_reference",
        "eps zero",
        lambda: K.inject_layer_norm_reference(None, f32(2, 3, 8), None, f32(8), None, eps=0.0),
    ),
]


@pytest.mark.parametrize("case", REFERENCE_CASES, ids=lambda c: f"{c.api}: {c.label}")
def test_reference_bad_input_names_the_argument(case: Case):
    """The references (the readable spec) run the public ops' argument checks first: a clear error
    naming the argument instead of torch's RuntimeError/AttributeError, or silently accepted input."""
    with pytest.raises(case.error, match=_argument_pattern(case)):
        case.call()


def test_action_logits_reference_checks_its_arguments():
    """``icrl_kernels.contrastive.action_logits_reference`` (public in the subpackage) checks as the others."""
    with pytest.raises(ValueError, match=r"\baction_embeds\b"):
        action_logits_reference(f32(2, 8), f32(3, 7))
    with pytest.raises(ValueError, match=r"\bmask\b"):
        action_logits_reference(f32(2, 8), f32(3, 8), mask=torch.ones(2, 3, 1, dtype=torch.bool))
    with pytest.raises(TypeError, match=r"\btau\b"):
        action_logits_reference(f32(2, 8), f32(3, 8), tau=None)
    # good input: the logits, -inf where masked
    pred, embeds, mask = f32(2, 8), f32(3, 8), torch.tensor([True, False, True])
    want = (pred @ embeds.T / 0.5).masked_fill(~mask, float("-inf"))
    torch.testing.assert_close(action_logits_reference(pred, embeds, tau=0.5, mask=mask), want)


# -- odd but legal input: the result equals the reference ----------------------------------------
@dataclass(frozen=True)
class Equal:
    api: str
    label: str
    got: Callable[[], object]
    want: Callable[[], object]


def _seeded(fn):
    def call():
        torch.manual_seed(0)
        return fn()

    return call


def _huge_actions(dtype=torch.float32):
    # A = 2**21 actions: a stride-0 view of one row plus a distinct last row (memory O(D) for the map).
    embeds = torch.cat([huge(2**21 - 1, 8, dtype=dtype), torch.full((1, 8), 2.0, dtype=dtype)])
    return f32(2, 8).abs().to(dtype), embeds, torch.tensor([0, 2**21 - 1])


def _loss_fp64(pred, embeds, targets):
    """The loss's definition evaluated in fp64: the fp32 reference's own logsumexp over 2**21 terms is
    off by ~2e-5 relative, more than the eager path's error (~1e-9), so it cannot be the yardstick here."""
    logits = pred @ embeds.T
    return (logits.logsumexp(-1) - logits.gather(1, targets[:, None])[:, 0]).mean()


def _seeded_module(module_fn, call):
    """``run(backend)``: build the module with a fixed seed on ``backend`` and call it (same weights for
    every backend)."""

    def run(backend):
        torch.manual_seed(0)
        module = module_fn(backend)
        return call(module)

    return run


EQUAL_CASES: list[Equal] = [
    Equal(
        "infonce_loss",
        "NaN pred propagates",
        lambda: K.infonce_loss(torch.full((2, 8), NAN), torch.eye(3, 8), ids(2), backend="eager"),
        lambda: K.infonce_loss_reference(torch.full((2, 8), NAN), torch.eye(3, 8), ids(2)),
    ),
    Equal(
        "infonce_loss",
        "inf in pred (masked action)",
        lambda: K.infonce_loss(
            torch.tensor([[1e30, 0.0]]),
            torch.eye(2),
            torch.tensor([1]),
            mask=torch.tensor([False, True]),
            backend="eager",
        ),
        lambda: K.infonce_loss_reference(
            torch.tensor([[1e30, 0.0]]), torch.eye(2), torch.tensor([1]), mask=torch.tensor([False, True])
        ),
    ),
    Equal(
        "infonce_loss",
        "huge A (2**21 actions, stride-0 map)",
        _seeded(lambda: K.infonce_loss(*_huge_actions(), backend="eager")),
        _seeded(lambda: _loss_fp64(*_huge_actions(torch.float64))),
    ),
    Equal(
        "infonce_loss",
        "every target ignored (mean of nothing)",
        lambda: K.infonce_loss(torch.ones(2, 8), torch.eye(3, 8), torch.tensor([-100, -100]), backend="eager"),
        lambda: K.infonce_loss_reference(torch.ones(2, 8), torch.eye(3, 8), torch.tensor([-100, -100])),
    ),
    Equal(
        "infonce_loss_reference",
        "reduction none: one loss per row",
        lambda: K.infonce_loss(
            torch.ones(2, 3, 8), torch.eye(3, 8), torch.zeros(2, 3, dtype=torch.long), reduction="none", backend="eager"
        ),
        lambda: K.infonce_loss_reference(
            torch.ones(2, 3, 8), torch.eye(3, 8), torch.zeros(2, 3, dtype=torch.long), reduction="none"
        ),
    ),
    Equal(
        "select_actions",
        "overflowing logit (masked): argmax still an available action",
        lambda: K.select_actions(
            torch.tensor([[3e38, 1.0]]),
            10 * torch.eye(2),
            mode="argmax",
            mask=torch.tensor([False, True]),
            backend="eager",
        ),
        lambda: torch.tensor([1]),
    ),
    Equal(
        "select_actions_reference",
        "argmax ties: lowest id",
        lambda: K.select_actions(torch.ones(2, 4), torch.ones(3, 4), mode="argmax", backend="eager"),
        lambda: K.select_actions_reference(torch.ones(2, 4), torch.ones(3, 4)),
    ),
    Equal(
        "mixture_of_heads",
        "NaN logits propagate",
        lambda: K.mixture_of_heads(torch.ones(1, 2, 3, 4), torch.full((1, 2, 3), NAN), backend="eager"),
        lambda: K.mixture_of_heads_reference(torch.ones(1, 2, 3, 4), torch.full((1, 2, 3), NAN)),
    ),
    Equal(
        "mixture_of_heads_reference",
        "empty sequence",
        lambda: K.mixture_of_heads(torch.ones(2, 0, 3, 4), torch.ones(2, 0, 3), backend="eager"),
        lambda: K.mixture_of_heads_reference(torch.ones(2, 0, 3, 4), torch.ones(2, 0, 3)),
    ),
    Equal(
        "smeared_keys",
        "inf logit: weight exactly 1 (no smearing)",
        _seeded(lambda: K.smeared_keys(f32(1, 2, 5, 4), torch.tensor([INF, -INF]), backend="eager")),
        _seeded(lambda: K.smeared_keys_reference(f32(1, 2, 5, 4), torch.tensor([INF, -INF]))),
    ),
    Equal(
        "smeared_keys_reference",
        "empty batch",
        lambda: K.smeared_keys(torch.ones(0, 2, 5, 4), torch.zeros(2), backend="eager"),
        lambda: K.smeared_keys_reference(torch.ones(0, 2, 5, 4), torch.zeros(2)),
    ),
    Equal(
        "inject_layer_norm",
        "constant rows (zero variance)",
        lambda: K.inject_layer_norm(None, torch.ones(2, 3, 8), None, torch.ones(8), None, backend="eager"),
        lambda: K.inject_layer_norm_reference(None, torch.ones(2, 3, 8), None, torch.ones(8), None),
    ),
    Equal(
        "inject_layer_norm_reference",
        "empty sequence",
        lambda: K.inject_layer_norm(None, torch.ones(2, 0, 8), None, torch.ones(8), None, backend="eager"),
        lambda: K.inject_layer_norm_reference(None, torch.ones(2, 0, 8), None, torch.ones(8), None),
    ),
    Equal(
        "orthonormal_embeddings",
        "one action, one dim: +-1",
        lambda: K.orthonormal_embeddings(1, 1, generator=torch.Generator().manual_seed(0)).abs(),
        lambda: torch.ones(1, 1),
    ),
    Equal(
        "ActionMap",
        "prompt of a huge batch is a stride-0 view",
        lambda: action_map().prompt(2**40)[2**40 - 1],
        lambda: action_map().embeddings,
    ),
    Equal(
        "ActionMap",
        "forward is the loss",
        _seeded(lambda: action_map()(f32(4, 8), torch.tensor([0, 1, 2, -100]))),
        _seeded(lambda: K.infonce_loss_reference(f32(4, 8), action_map().embeddings, torch.tensor([0, 1, 2, -100]))),
    ),
    Equal(
        "MoAAttention",
        "empty sequence",
        lambda: _seeded_module(lambda b: K.MoAAttention(8, 2, backend=b), lambda m: m(torch.ones(2, 0, 8)))("eager"),
        lambda: torch.ones(2, 0, 8),
    ),
    Equal(
        "SmearedKeyAttention",
        "empty batch",
        lambda: _seeded_module(lambda b: K.SmearedKeyAttention(8, 2, backend=b), lambda m: m(torch.ones(0, 3, 8)))(
            "eager"
        ),
        lambda: torch.ones(0, 3, 8),
    ),
    Equal(
        "LoopedBlock",
        "empty sequence",
        lambda: _seeded_module(lambda b: K.LoopedBlock(8, 2, 4, backend=b), lambda m: m(torch.ones(2, 0, 8), loops=2))(
            "eager"
        ),
        lambda: torch.ones(2, 2, 0, 8),
    ),
]


def _equal(got, want) -> bool:
    if isinstance(got, tuple):
        return len(got) == len(want) and all(_equal(a, b) for a, b in zip(got, want))
    if isinstance(got, torch.Tensor):
        return got.shape == want.shape and torch.allclose(
            got.float(), want.float(), rtol=1e-5, atol=1e-6, equal_nan=True
        )
    return got == want


@pytest.mark.parametrize("case", EQUAL_CASES, ids=lambda c: f"{c.api}: {c.label}")
def test_odd_input_matches_reference(case: Equal):
    got = case.got()
    want = case.want()
    assert _equal(got, want), f"{case.api} ({case.label}): got {got}, want {want}"


def test_module_forwards_match_the_reference_backend():
    """The checks added to the forwards change nothing for good input: default path == reference ops."""
    x = f32(2, 5, 8)
    for make in (
        lambda b: K.MoAAttention(8, 2, backend=b),
        lambda b: K.MoAAttention(8, 2, gate=None, backend=b),
        lambda b: K.SmearedKeyAttention(8, 2, backend=b),
        lambda b: K.LoopedBlock(8, 2, 8, backend=b),
    ):
        call = (lambda m: m(x, loops=2)) if isinstance(make("eager"), K.LoopedBlock) else (lambda m: m(x))
        got = _seeded_module(make, call)("eager")
        want = _seeded_module(make, call)("reference")
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_action_map_forward_is_the_loss_and_differentiable():
    module = action_map(num_actions=5, dim=8, batch=2)
    pred = f32(2, 3, 8, requires_grad=True)
    targets = torch.tensor([[0, 4, -100], [1, 2, 3]])
    mask = torch.tensor([[True] * 5, [False, True, True, True, True]])
    loss = module(pred, targets, mask=mask)
    want = K.infonce_loss_reference(pred, module.embeddings, targets, mask=mask)
    torch.testing.assert_close(loss, want, rtol=1e-5, atol=1e-6)
    (grad,) = torch.autograd.grad(loss, pred)
    (want_grad,) = torch.autograd.grad(want, pred)
    torch.testing.assert_close(grad, want_grad, rtol=1e-5, atol=1e-6)
    rows = module(pred, targets, mask=mask, reduction="none")
    assert rows.shape == (2, 3) and rows[0, 2] == 0
    torch.testing.assert_close(rows.sum() / 5, loss)


# -- the Triton interpreter: the same checks run before any launch --------------------------------
interpreter = pytest.mark.skipif(not triton_runs_on(torch.device("cpu")), reason="needs TRITON_INTERPRET=1 and triton")
TRITON_ERROR_CASES = [
    Case(
        "mixture_of_heads",
        "head_out fp64",
        lambda: K.mixture_of_heads(f32(1, 2, 2, 16).double(), f32(1, 2, 2).double(), backend="triton"),
        TypeError,
    ),
    Case(
        "mixture_of_heads",
        "gate_logits shape",
        lambda: K.mixture_of_heads(f32(1, 2, 2, 16), f32(1, 2, 3), backend="triton"),
    ),
    Case("smeared_keys", "alpha shape", lambda: K.smeared_keys(f32(1, 2, 3, 16), f32(3), backend="triton")),
    Case(
        "gated_attention",
        "q fp64",
        lambda: K.gated_attention(*(f32(1, 2, 3, 16).double() for _ in range(3)), backend="triton"),
        TypeError,
    ),
    Case(
        "gated_attention",
        "smear_alpha shape",
        lambda: K.gated_attention(*(f32(1, 2, 3, 16) for _ in range(3)), smear_alpha=f32(3), backend="triton"),
    ),
    Case(
        "inject_layer_norm",
        "weight width",
        lambda: K.inject_layer_norm(None, f32(1, 2, 16), None, f32(15), None, backend="triton"),
    ),
    Case(
        "infonce_loss",
        "targets out of range",
        lambda: K.infonce_loss(f32(2, 16), f32(3, 16), torch.tensor([0, 3]), backend="triton"),
    ),
    Case(
        "select_actions", "pred NaN", lambda: K.select_actions(torch.full((2, 16), NAN), f32(3, 16), backend="triton")
    ),
    Case("MoAAttention", "x width", lambda: K.MoAAttention(32, 2, backend="triton")(f32(1, 3, 31))),
]


@interpreter
@pytest.mark.parametrize("case", TRITON_ERROR_CASES, ids=lambda c: f"{c.api}: {c.label}")
def test_bad_input_raises_on_the_triton_backend(case: Case):
    with pytest.raises(case.error, match=_argument_pattern(case)):
        case.call()


@interpreter
def test_odd_input_on_the_triton_backend_matches_reference():
    nan_pred = torch.full((2, 16), NAN)
    embeds, targets = torch.eye(3, 16), torch.tensor([0, 2])
    got = K.infonce_loss(nan_pred, embeds, targets, backend="triton")
    assert torch.isnan(got), got
    head_out = f32(1, 2, 2, 16)
    logits = torch.tensor([[[NAN, 0.0], [1.0, 2.0]]])
    got = K.mixture_of_heads(head_out, logits, backend="triton")
    torch.testing.assert_close(got, K.mixture_of_heads_reference(head_out, logits), equal_nan=True)
    # A NaN gate logit poisons only its own row (softmax over that row's heads); other rows stay finite.
    q = f32(1, 2, 3, 16)
    nan_logits = torch.tensor([[[NAN, 0.0], [1.0, 2.0], [0.0, 0.0]]])
    got = K.gated_attention(q, q, q, nan_logits, backend="triton")
    torch.testing.assert_close(got, K.gated_attention_reference(q, q, q, nan_logits), equal_nan=True)
    assert got[:, 0].isnan().all() and torch.isfinite(got[:, 1:]).all()
    # A constant row has zero variance: rstd = 1/sqrt(eps), normed = bias (zero here), hidden = prompt.
    hidden, normed = K.inject_layer_norm(None, torch.ones(1, 2, 16), None, torch.ones(16), None, backend="triton")
    want_hidden, want_normed = K.inject_layer_norm_reference(None, torch.ones(1, 2, 16), None, torch.ones(16), None)
    torch.testing.assert_close((hidden, normed), (want_hidden, want_normed))


# -- no public name skips the sweep ---------------------------------------------------------------
def test_every_public_name_is_swept():
    swept = {case.api for case in ERROR_CASES + REFERENCE_CASES} | {case.api for case in EQUAL_CASES}
    missing = set(K.__all__) - swept - NGRAM_NAMES - set(EXEMPT)
    assert not missing, f"public names without bad-input cases: {sorted(missing)} (add cases to this file)"
    assert not (set(EXEMPT) | NGRAM_NAMES) - set(K.__all__), "stale names in EXEMPT or NGRAM_NAMES"
    assert not swept - set(K.__all__), f"cases for names that are not public: {sorted(swept - set(K.__all__))}"


def test_ngram_names_are_swept_in_the_ngram_file():
    if not NGRAM_FILE.exists():
        pytest.skip("tests/test_ngram_bad_input.py (helper A) is not in the tree yet")
    text = NGRAM_FILE.read_text()
    absent = sorted(name for name in NGRAM_NAMES if name not in text)
    assert not absent, f"{NGRAM_FILE.name} has no cases for {absent}"


def test_exempt_names_are_not_ops():
    for name in EXEMPT:
        value = getattr(K, name)
        assert isinstance(value, (tuple, type)) or (callable(value) and value.__code__.co_argcount == 0), name
