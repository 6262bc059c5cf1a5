"""Triton kernels of the fused input injection + LayerNorm (looped transformers).

Layout of the work. A program owns a tile of ``BLOCK_L`` positions x the whole feature row
(``BLOCK_D >= D`` lanes, as in the Triton layer-norm tutorial: a row's statistics need no second
pass) and loops over a chunk of ``batch_per_program`` batch entries at those positions. Keeping the
positions fixed inside a program means

* the forward reads its tile of ``pos`` once and reuses it for every batch entry of the chunk;
* the backward sums ``d_x`` over its batch chunk in registers, so ``d_pos`` (the gradient of the
  position embedding, summed over the batch) needs one fp32 partial per batch chunk, not per row.

Forward: ``x = y + prompt + pos`` in fp32, ``mean``, ``rstd = 1 / sqrt(var + eps)`` (biased
variance), ``hidden = x`` and ``normed = (x - mean) * rstd * weight + bias`` stored in the activation
dtype. Nothing else is stored: the statistics are a row's reduction in registers, which the backward
repeats on ``hidden`` (it loads the row anyway) instead of reading them from a side output that every
call would allocate, return and save.

Backward: from ``hidden`` alone (``y`` and ``prompt`` are not kept alive), ``mean`` and ``rstd`` of
``hidden`` as in the forward, ``xhat = (hidden - mean) * rstd``, ``g = d_normed * weight`` and

    d_x = d_hidden + rstd * (g - mean_D(g) - xhat * mean_D(g * xhat))

written once: ``d_y = d_prompt = d_x`` (autograd hands the one tensor to both, as it does for
``y + prompt``). Each program also writes fp32 partial sums of ``d_weight = sum d_normed * xhat``,
``d_bias = sum d_normed`` (one row of ``D`` per program) and ``d_pos`` (one ``[L, D]`` slab per batch
chunk); a second, small kernel sums the partials in a fixed order and stores each parameter's gradient
in its dtype, so every gradient is deterministic (no atomics) and no PyTorch op runs around the kernels.
An upstream gradient that autograd leaves out (``hidden`` or ``normed`` unused) is read as zero, never
materialised. ``hidden`` was rounded to the activation dtype when stored, so with half-precision
activations the backward's statistics and ``xhat`` are those of the rounded sum (well inside
half-precision tolerance; with fp32 activations they are the forward's exactly).

Inputs ``y``, ``prompt``, ``pos``, ``weight``, ``bias``, ``d_hidden`` and ``d_normed`` may have any
strides (integer strides equal to 1 are specialised by Triton, so the usual contiguous last dim gives
vector loads); outputs are contiguous. Each program steps 64-bit scalar base pointers from one batch
entry to the next and addresses its tile with 32-bit offsets (64-bit ones, chosen at launch, if one
``[L, D]`` slice spans 2^31 elements or more), so tensors beyond 2^31 elements are fine.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from .._library import empty_output
from .._triton import cdiv, launch, next_power_of_2, per_signature

#: Elements of one ``[BLOCK_L, BLOCK_D]`` tile; with one warp per 256 of them a thread holds 8 values
#: per tile. Compiled offline for sm_90 (ptxas -v, Triton 3.9, no GPU run): at D = 256 (8 x 256 tile, 8 warps)
#: the forward uses 136-142 registers and the backward 188-194 (bf16-fp32), without spills.
_TILE_ELEMENTS = 2048
#: Programs per streaming multiprocessor to aim for (about what fits at once at D = 256). The backward
#: writes one fp32 ``d_pos`` partial per batch chunk, so fewer, longer programs keep that traffic small.
#: Not tuned on a GPU yet.
_FORWARD_PROGRAMS_PER_SM = 4
_BACKWARD_PROGRAMS_PER_SM = 2
#: The interpreter runs programs one after another (about 2 ms each): few, long programs are fastest.
_INTERPRETER_PROGRAMS = 4


def tile_shape(length: int, width: int) -> tuple[int, int, int]:
    """``(BLOCK_L, BLOCK_D, num_warps)``: whole rows of ``width`` features, about 2048-element tiles,
    a warp per 256 elements (4 to 16 warps)."""
    block_d = max(16, next_power_of_2(width))  # >= 16 lanes: no degenerate layouts for tiny D
    block_l = max(1, min(_TILE_ELEMENTS // block_d, next_power_of_2(length)))
    num_warps = min(16, max(4, block_l * block_d // 256))
    return block_l, block_d, num_warps


@functools.cache
def _multiprocessors(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def batch_per_program(batch: int, position_blocks: int, device: torch.device, programs_per_sm: int) -> int:
    """Batch entries one program loops over, so that the grid has about ``programs_per_sm`` per SM."""
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        target = programs_per_sm * _multiprocessors(index)
    else:  # Triton runs on CPU tensors only under its interpreter
        target = _INTERPRETER_PROGRAMS
    chunks = max(1, min(batch, target // max(1, position_blocks)))
    return cdiv(batch, chunks)


@triton.jit
def _row_statistics(x, mask, D, eps):
    """``(x - mean, rstd)`` of each row of the fp32 tile ``x`` (``[BLOCK_L, BLOCK_D]``, zero in masked lanes):
    ``mean`` and the biased variance over the ``D`` features, ``rstd = 1 / sqrt(var + eps)``; the centred tile
    is zero in masked lanes. The forward and the backward call it on the same values, so with fp32
    activations they get the same statistics."""
    mean = tl.sum(x, axis=1) / D
    centred = tl.where(mask, x - mean[:, None], 0.0)
    rstd = 1.0 / tl.sqrt(tl.sum(centred * centred, axis=1) / D + eps)
    return centred, rstd


@triton.jit
def _inject_layer_norm_forward_kernel(
    y_ptr, prompt_ptr, pos_ptr, weight_ptr, bias_ptr,
    hidden_ptr, normed_ptr,
    eps, B, L, D, batch_per_program,
    stride_yb, stride_yl, stride_yd,
    stride_pb, stride_pl, stride_pd,
    stride_el, stride_ed, stride_w, stride_bias,
    HAS_Y: tl.constexpr, HAS_POS: tl.constexpr, HAS_BIAS: tl.constexpr, WIDE: tl.constexpr,
    BLOCK_L: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    positions = tl.program_id(0) * BLOCK_L + tl.arange(0, BLOCK_L)
    if WIDE:  # one batch entry spans more than 2^31 elements: 64-bit offsets inside it too
        positions = positions.to(tl.int64)
    cols = tl.arange(0, BLOCK_D)
    position_ok = positions < L
    col_ok = cols < D
    mask = position_ok[:, None] & col_ok[None, :]
    # Upcast right after every load: the statistics are fp32 (and the interpreter's bf16 math is wrong).
    weight = tl.load(weight_ptr + cols * stride_w, mask=col_ok, other=0.0).to(tl.float32)
    if HAS_BIAS:
        bias = tl.load(bias_ptr + cols * stride_bias, mask=col_ok, other=0.0).to(tl.float32)
    if HAS_POS:
        pos = tl.load(pos_ptr + positions[:, None] * stride_el + cols[None, :] * stride_ed, mask=mask, other=0.0)
        pos = pos.to(tl.float32)
    prompt_offsets = positions[:, None] * stride_pl + cols[None, :] * stride_pd
    y_offsets = positions[:, None] * stride_yl + cols[None, :] * stride_yd
    out_offsets = positions[:, None] * D + cols[None, :]
    # Scalar base pointers (64-bit) start at the chunk's first batch entry and step one entry per loop;
    # offsets inside an entry stay 32-bit tiles, which keeps register pressure down.
    batch_start = tl.program_id(1) * batch_per_program
    batch_stop = tl.minimum(batch_start + batch_per_program, B)
    first = batch_start.to(tl.int64)
    prompt_base = prompt_ptr + first * stride_pb
    y_base = y_ptr + first * stride_yb
    hidden_base = hidden_ptr + first * L * D
    normed_base = normed_ptr + first * L * D
    for _ in range(batch_start, batch_stop):
        x = tl.load(prompt_base + prompt_offsets, mask=mask, other=0.0).to(tl.float32)
        if HAS_Y:
            x += tl.load(y_base + y_offsets, mask=mask, other=0.0).to(tl.float32)
        if HAS_POS:
            x += pos
        centred, rstd = _row_statistics(x, mask, D, eps)
        normed = centred * rstd[:, None] * weight[None, :]
        if HAS_BIAS:
            normed += bias[None, :]
        tl.store(hidden_base + out_offsets, x.to(hidden_ptr.dtype.element_ty), mask=mask)
        tl.store(normed_base + out_offsets, normed.to(normed_ptr.dtype.element_ty), mask=mask)
        prompt_base += stride_pb
        y_base += stride_yb
        hidden_base += L * D
        normed_base += L * D


@triton.jit
def _inject_layer_norm_backward_kernel(
    grad_hidden_ptr, grad_normed_ptr, hidden_ptr, weight_ptr,
    grad_x_ptr, pos_partial_ptr, weight_partial_ptr, bias_partial_ptr,
    eps, B, L, D, batch_per_program,
    stride_hb, stride_hl, stride_hd,
    stride_nb, stride_nl, stride_nd, stride_w,
    HAS_GRAD_HIDDEN: tl.constexpr, HAS_GRAD_NORMED: tl.constexpr, WRITE_X: tl.constexpr,
    WANT_POS: tl.constexpr, WANT_WEIGHT: tl.constexpr, WANT_BIAS: tl.constexpr, WIDE: tl.constexpr,
    BLOCK_L: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    position_block = tl.program_id(0)
    batch_chunk = tl.program_id(1)
    positions = position_block * BLOCK_L + tl.arange(0, BLOCK_L)
    if WIDE:
        positions = positions.to(tl.int64)
    cols = tl.arange(0, BLOCK_D)
    position_ok = positions < L
    col_ok = cols < D
    mask = position_ok[:, None] & col_ok[None, :]
    weight = tl.load(weight_ptr + cols * stride_w, mask=col_ok, other=0.0).to(tl.float32)
    grad_hidden_offsets = positions[:, None] * stride_hl + cols[None, :] * stride_hd
    grad_normed_offsets = positions[:, None] * stride_nl + cols[None, :] * stride_nd
    offsets = positions[:, None] * D + cols[None, :]  # of the contiguous hidden and d_x
    # Partial sums stay 2-D across the batch loop; rows are reduced once at the end.
    acc_weight = tl.zeros([BLOCK_L, BLOCK_D], dtype=tl.float32)
    acc_bias = tl.zeros([BLOCK_L, BLOCK_D], dtype=tl.float32)
    acc_pos = tl.zeros([BLOCK_L, BLOCK_D], dtype=tl.float32)
    batch_start = batch_chunk * batch_per_program
    batch_stop = tl.minimum(batch_start + batch_per_program, B)
    first = batch_start.to(tl.int64)
    grad_hidden_base = grad_hidden_ptr + first * stride_hb
    grad_normed_base = grad_normed_ptr + first * stride_nb
    hidden_base = hidden_ptr + first * L * D
    grad_x_base = grad_x_ptr + first * L * D
    for _ in range(batch_start, batch_stop):
        if HAS_GRAD_NORMED:
            hidden = tl.load(hidden_base + offsets, mask=mask, other=0.0).to(tl.float32)
            centred, rstd = _row_statistics(hidden, mask, D, eps)
            xhat = centred * rstd[:, None]  # zero in masked lanes
            grad_normed = tl.load(grad_normed_base + grad_normed_offsets, mask=mask, other=0.0).to(tl.float32)
            g = grad_normed * weight[None, :]  # zero in masked lanes: weight and grad_normed load as 0 there
            mean_g = tl.sum(g, axis=1) / D
            mean_g_xhat = tl.sum(g * xhat, axis=1) / D
            grad_x = (g - mean_g[:, None] - xhat * mean_g_xhat[:, None]) * rstd[:, None]
        else:  # normed unused: no gradient through the LayerNorm (and none for weight and bias)
            grad_x = tl.zeros([BLOCK_L, BLOCK_D], dtype=tl.float32)
        if HAS_GRAD_HIDDEN:
            grad_x += tl.load(grad_hidden_base + grad_hidden_offsets, mask=mask, other=0.0).to(tl.float32)
        # Masked lanes of grad_x hold -mean_g * rstd: never stored, and acc_pos is stored masked.
        if WRITE_X:
            tl.store(grad_x_base + offsets, grad_x.to(grad_x_ptr.dtype.element_ty), mask=mask)
        if WANT_WEIGHT and HAS_GRAD_NORMED:
            acc_weight += grad_normed * xhat
        if WANT_BIAS and HAS_GRAD_NORMED:
            acc_bias += grad_normed
        if WANT_POS:
            acc_pos += grad_x
        grad_hidden_base += stride_hb
        grad_normed_base += stride_nb
        hidden_base += L * D
        grad_x_base += L * D
    program = batch_chunk * tl.num_programs(0) + position_block
    if WANT_WEIGHT:
        tl.store(weight_partial_ptr + program * D + cols, tl.sum(acc_weight, axis=0), mask=col_ok)
    if WANT_BIAS:
        tl.store(bias_partial_ptr + program * D + cols, tl.sum(acc_bias, axis=0), mask=col_ok)
    if WANT_POS:
        pos_base = pos_partial_ptr + batch_chunk.to(tl.int64) * L * D
        tl.store(pos_base + offsets, acc_pos, mask=mask)


@triton.jit
def _inject_layer_norm_param_grads_kernel(
    pos_partial_ptr, weight_partial_ptr, bias_partial_ptr, grad_pos_ptr, grad_weight_ptr, grad_bias_ptr,
    chunks, programs, LD, D,
    WANT_POS: tl.constexpr, WANT_WEIGHT: tl.constexpr, WANT_BIAS: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """The parameters' gradients from the backward's fp32 partials, summed in a fixed order and stored in each
    parameter's dtype: ``d_pos [L * D]`` over the ``chunks`` batch chunks, ``d_weight`` and ``d_bias`` ``[D]``
    over the ``programs`` programs. One program per ``BLOCK`` columns."""
    cols = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    if WANT_POS:
        pos_ok = cols < LD
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        chunk_base = pos_partial_ptr  # a 64-bit pointer stepped one [L, D] slab at a time
        for _ in range(0, chunks):
            acc += tl.load(chunk_base + cols, mask=pos_ok, other=0.0)
            chunk_base += LD
        tl.store(grad_pos_ptr + cols, acc.to(grad_pos_ptr.dtype.element_ty), mask=pos_ok)
    if WANT_WEIGHT or WANT_BIAS:
        if tl.program_id(0) * BLOCK < D:
            col_ok = cols < D
            acc_weight = tl.zeros([BLOCK], dtype=tl.float32)
            acc_bias = tl.zeros([BLOCK], dtype=tl.float32)
            for program in range(0, programs):
                if WANT_WEIGHT:
                    acc_weight += tl.load(weight_partial_ptr + program * D + cols, mask=col_ok, other=0.0)
                if WANT_BIAS:
                    acc_bias += tl.load(bias_partial_ptr + program * D + cols, mask=col_ok, other=0.0)
            if WANT_WEIGHT:
                tl.store(grad_weight_ptr + cols, acc_weight.to(grad_weight_ptr.dtype.element_ty), mask=col_ok)
            if WANT_BIAS:
                tl.store(grad_bias_ptr + cols, acc_bias.to(grad_bias_ptr.dtype.element_ty), mask=col_ok)


#: Columns per program of the parameter-gradient kernel.
_PARAM_BLOCK = 1024


def _needs_wide_offsets(length: int, width: int, *strides: tuple[int, ...] | None) -> bool:
    """Whether an offset inside one batch entry (an ``[L, D]`` slice: the last two dims) can reach 2^31, for
    tensors of the given strides (``None``: absent)."""
    largest = length * width
    for stride in strides:
        if stride is not None:
            largest = max(largest, (length - 1) * stride[-2] + (width - 1) * stride[-1])
    return largest >= 2**31


@per_signature
def _forward_config(
    shape: tuple[int, int, int],
    y_strides: tuple[int, ...] | None,
    prompt_strides: tuple[int, ...],
    pos_strides: tuple[int, ...] | None,
    weight_strides: tuple[int],
    bias_strides: tuple[int] | None,
    device: torch.device,
) -> tuple[tuple[int, int], tuple[int, ...], dict]:
    """``(grid, the kernel's size and stride arguments, constexprs)`` of the forward kernel (``None`` strides:
    that input is absent)."""
    batch, length, width = shape
    block_l, block_d, num_warps = tile_shape(length, width)
    position_blocks = cdiv(length, block_l)
    per_program = batch_per_program(batch, position_blocks, device, _FORWARD_PROGRAMS_PER_SM)
    scalars = (
        batch, length, width, per_program,
        *(y_strides or (0, 0, 0)), *prompt_strides, *(pos_strides or (0, 0)),
        weight_strides[0], bias_strides[0] if bias_strides is not None else 0,
    )  # fmt: skip
    constexprs = {
        "HAS_Y": y_strides is not None, "HAS_POS": pos_strides is not None, "HAS_BIAS": bias_strides is not None,
        "WIDE": _needs_wide_offsets(length, width, y_strides, prompt_strides, pos_strides),
        "BLOCK_L": block_l, "BLOCK_D": block_d, "num_warps": num_warps,
    }  # fmt: skip
    return (position_blocks, cdiv(batch, per_program)), scalars, constexprs


class _BackwardConfig(NamedTuple):
    """Launch arguments of the backward kernels for one signature (:func:`_backward_config`)."""

    grid: tuple[int, int]  # of the backward kernel: (position blocks, batch chunks)
    scalars: tuple[int, ...]  # its size and stride arguments
    constexprs: dict
    pos_partial_shape: tuple[int, int, int]  # one fp32 [L, D] slab per batch chunk
    param_partial_shape: tuple[int, int]  # one fp32 row of D per program (d_weight, d_bias)
    param_grid: tuple[int]  # of the parameter-gradient kernel
    param_scalars: tuple[int, ...]
    param_constexprs: dict


@per_signature
def _backward_config(
    shape: tuple[int, int, int],
    grad_hidden_strides: tuple[int, ...] | None,
    grad_normed_strides: tuple[int, ...] | None,
    weight_strides: tuple[int],
    device: torch.device,
    wants: tuple[bool, bool, bool, bool],
) -> _BackwardConfig:
    """The backward kernels' launch arguments (``None`` strides: that upstream gradient is absent)."""
    batch, length, width = shape
    block_l, block_d, num_warps = tile_shape(length, width)
    position_blocks = cdiv(length, block_l)
    per_program = batch_per_program(batch, position_blocks, device, _BACKWARD_PROGRAMS_PER_SM)
    chunks = cdiv(batch, per_program)
    programs = position_blocks * chunks
    want_x, want_pos, want_weight, want_bias = wants
    scalars = (
        batch, length, width, per_program,
        *(grad_hidden_strides or (0, 0, 0)), *(grad_normed_strides or (0, 0, 0)), weight_strides[0],
    )  # fmt: skip
    constexprs = {
        "HAS_GRAD_HIDDEN": grad_hidden_strides is not None, "HAS_GRAD_NORMED": grad_normed_strides is not None,
        "WRITE_X": want_x, "WANT_POS": want_pos, "WANT_WEIGHT": want_weight, "WANT_BIAS": want_bias,
        "WIDE": _needs_wide_offsets(length, width, grad_hidden_strides, grad_normed_strides),
        "BLOCK_L": block_l, "BLOCK_D": block_d, "num_warps": num_warps,
    }  # fmt: skip
    columns = length * width if want_pos else width
    return _BackwardConfig(
        grid=(position_blocks, chunks), scalars=scalars, constexprs=constexprs,
        pos_partial_shape=(chunks, length, width), param_partial_shape=(programs, width),
        param_grid=(cdiv(columns, _PARAM_BLOCK),), param_scalars=(chunks, programs, length * width, width),
        param_constexprs={"WANT_POS": want_pos, "WANT_WEIGHT": want_weight, "WANT_BIAS": want_bias,
                          "BLOCK": _PARAM_BLOCK},
    )  # fmt: skip


def inject_layer_norm_forward_triton(
    y: torch.Tensor | None,
    prompt: torch.Tensor,
    pos: torch.Tensor | None,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton forward: ``(hidden, normed)``, contiguous in ``prompt.dtype``."""
    shape, dtype, device = prompt.shape, prompt.dtype, prompt.device
    grid, scalars, constexprs = _forward_config(
        shape, y.stride() if y is not None else None, prompt.stride(), pos.stride() if pos is not None else None,
        weight.stride(), bias.stride() if bias is not None else None, device,
    )  # fmt: skip
    hidden = empty_output(shape, dtype=dtype, device=device)
    normed = empty_output(shape, dtype=dtype, device=device)
    # Absent inputs get a placeholder pointer; their constexpr flag keeps the kernel off it.
    launch(_inject_layer_norm_forward_kernel, grid)(
        y if y is not None else prompt, prompt, pos if pos is not None else weight, weight,
        bias if bias is not None else weight, hidden, normed, eps, *scalars, **constexprs,
    )  # fmt: skip
    return hidden, normed


def inject_layer_norm_backward_triton(
    grad_hidden: torch.Tensor | None,
    grad_normed: torch.Tensor | None,
    hidden: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    wants: tuple[bool, bool, bool, bool],
    pos_dtype: torch.dtype | None,
    bias_dtype: torch.dtype | None,
) -> tuple[torch.Tensor | None, ...]:
    """Triton backward: ``(d_x, d_pos, d_weight, d_bias)`` for ``wants = (want_x, want_pos, want_weight,
    want_bias)``, ``None`` for each gradient not wanted; ``d_x`` (the gradient of ``y`` and of ``prompt``) is
    contiguous in ``hidden.dtype``, ``d_pos`` in ``pos_dtype``, ``d_weight`` in ``weight.dtype`` and ``d_bias``
    in ``bias_dtype``. A ``None`` upstream gradient (that output unused) counts as zero."""
    shape, device = hidden.shape, hidden.device
    hidden = hidden.contiguous()  # (ours: a no-op)
    config = _backward_config(
        shape, grad_hidden.stride() if grad_hidden is not None else None,
        grad_normed.stride() if grad_normed is not None else None, weight.stride(), device, wants,
    )  # fmt: skip
    want_x, want_pos, want_weight, want_bias = wants
    # Gradients not wanted, and absent upstream gradients, get a placeholder pointer (hidden); their constexpr
    # flag keeps the kernels off it. Partials are poisoned under test like any output: a program that skipped
    # its slot shows as NaN.
    grad_x = empty_output(shape, dtype=hidden.dtype, device=device) if want_x else hidden
    pos_partial = empty_output(config.pos_partial_shape, dtype=torch.float32, device=device) if want_pos else hidden
    weight_partial = (
        empty_output(config.param_partial_shape, dtype=torch.float32, device=device) if want_weight else hidden
    )
    bias_partial = empty_output(config.param_partial_shape, dtype=torch.float32, device=device) if want_bias else hidden
    launch(_inject_layer_norm_backward_kernel, config.grid)(
        grad_hidden if grad_hidden is not None else hidden, grad_normed if grad_normed is not None else hidden,
        hidden, weight, grad_x, pos_partial, weight_partial, bias_partial, eps, *config.scalars,
        **config.constexprs,
    )  # fmt: skip
    if not want_x:
        grad_x = None
    if not (want_pos or want_weight or want_bias):
        return grad_x, None, None, None
    grad_pos = empty_output(shape[1:], dtype=pos_dtype, device=device) if want_pos else hidden
    grad_weight = empty_output(weight.shape, dtype=weight.dtype, device=device) if want_weight else hidden
    grad_bias = empty_output(weight.shape, dtype=bias_dtype, device=device) if want_bias else hidden
    launch(_inject_layer_norm_param_grads_kernel, config.param_grid)(
        pos_partial, weight_partial, bias_partial, grad_pos, grad_weight, grad_bias, *config.param_scalars,
        **config.param_constexprs,
    )  # fmt: skip
    return (
        grad_x,
        grad_pos if want_pos else None,
        grad_weight if want_weight else None,
        grad_bias if want_bias else None,
    )
