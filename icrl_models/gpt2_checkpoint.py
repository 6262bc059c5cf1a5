"""Load (and save) GPT-2 weights in Hugging Face's layout onto a GPT-2-architecture model, offline.

A Hugging Face GPT-2 directory holds ``config.json`` and the weights as ``model.safetensors`` or
``pytorch_model.bin`` (or shards listed in ``model.safetensors.index.json`` /
``pytorch_model.bin.index.json``). Nothing is downloaded and ``transformers`` is not needed: the
files are read with ``safetensors`` (an optional dependency, in the ``test`` extra) or ``torch.load``.

Names, with or without the ``transformer.`` prefix (``GPT2LMHeadModel`` vs ``GPT2Model``), map onto
a :class:`~icrl_models.models.dt_moa.DecisionTransformerMoA` as follows (GPT-2's ``Conv1D`` stores
weights as ``[in, out]``, the transpose of ``nn.Linear``'s, so those are transposed):

* ``wpe.weight [n_positions, D]`` -> ``wpe.weight`` (its first rows when the model has fewer positions);
* ``h.{i}.ln_1``, ``h.{i}.ln_2``, ``ln_f`` (weight, bias) -> ``blocks.{i}.ln_1``, ``blocks.{i}.ln_2``, ``ln_f``;
* ``h.{i}.attn.c_attn [D, 3D]`` (``[q | k | v]``, heads contiguous) -> the first ``3D`` rows of
  ``blocks.{i}.attn.qkv`` (weight transposed, and bias): a gated layer's ``qkv`` has ``H`` more rows,
  the MoA gate, after them;
* ``h.{i}.attn.c_proj [D, D]`` -> ``blocks.{i}.attn.out_proj``, transposed;
* ``h.{i}.mlp.c_fc [D, 4D]`` and ``h.{i}.mlp.c_proj [4D, D]`` -> ``blocks.{i}.mlp.c_fc`` / ``c_proj``, transposed.

Ignored: ``wte`` and ``lm_head`` (a Decision Transformer embeds returns, states and actions itself)
and the attention-mask buffers ``h.{i}.attn.bias`` / ``h.{i}.attn.masked_bias``. A checkpoint with
more layers than the model gives its first ``n_layer`` layers (as LaMo does); a different width or
head count raises ``ValueError``. The MoA gates (rows ``3D:`` of a gated layer's ``attn.qkv``) are
not part of GPT-2: they keep their initialisation, and saving writes only the first ``3D`` rows.
The model only needs the attributes ``wpe``, ``blocks[i].{ln_1, attn.qkv, attn.out_proj, ln_2,
mlp.c_fc, mlp.c_proj}``, ``ln_f`` and ``config.{n_layer, n_head, n_embd}``.
"""

from __future__ import annotations

import json
import os
import re
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from .files import atomic_open, atomic_path, write_json

CONFIG_NAME = "config.json"
SAFETENSORS_NAME = "model.safetensors"
BIN_NAME = "pytorch_model.bin"
INDEX_NAMES = {"safetensors": "model.safetensors.index.json", "bin": "pytorch_model.bin.index.json"}
WEIGHT_FORMATS = ("safetensors", "bin")
#: Checkpoint names (without prefix) that never map onto a Decision Transformer.
IGNORED_NAMES = ("wte.weight", "lm_head.weight")
_IGNORED_BUFFER = re.compile(r"^h\.\d+\.attn\.(bias|masked_bias)$")
_LAYER = re.compile(r"^h\.(\d+)\.(.+)$")
#: Per-layer checkpoint names -> (model attribute path inside ``blocks[i]``, Conv1D weight to transpose).
LAYER_PARAMETERS = {
    "ln_1.weight": ("ln_1.weight", False),
    "ln_1.bias": ("ln_1.bias", False),
    "attn.c_attn.weight": ("attn.qkv.weight", True),
    "attn.c_attn.bias": ("attn.qkv.bias", False),
    "attn.c_proj.weight": ("attn.out_proj.weight", True),
    "attn.c_proj.bias": ("attn.out_proj.bias", False),
    "ln_2.weight": ("ln_2.weight", False),
    "ln_2.bias": ("ln_2.bias", False),
    "mlp.c_fc.weight": ("mlp.c_fc.weight", True),
    "mlp.c_fc.bias": ("mlp.c_fc.bias", False),
    "mlp.c_proj.weight": ("mlp.c_proj.weight", True),
    "mlp.c_proj.bias": ("mlp.c_proj.bias", False),
}
TOP_PARAMETERS = {"wpe.weight": "wpe.weight", "ln_f.weight": "ln_f.weight", "ln_f.bias": "ln_f.bias"}


def _safetensors():
    try:
        import safetensors.torch
    except ImportError:
        raise ImportError(
            "reading or writing model.safetensors needs the 'safetensors' package: pip install safetensors "
            "(or pip install 'icrl-kernels[test]'); pytorch_model.bin checkpoints work without it"
        ) from None
    return safetensors.torch


def read_gpt2_config(directory: str | os.PathLike) -> dict:
    """The architecture settings of a Hugging Face GPT-2 directory's ``config.json``.

    Returns ``{"n_layer", "n_head", "n_embd", "n_positions", "layer_norm_epsilon", "activation_function"}``
    (``n_ctx`` is accepted for ``n_positions`` in old configs).
    """
    path = Path(directory) / CONFIG_NAME
    if not path.is_file():
        raise FileNotFoundError(f"no {CONFIG_NAME} in {directory}: expected a Hugging Face GPT-2 directory")
    raw = json.loads(path.read_text())
    missing = [name for name in ("n_layer", "n_head", "n_embd") if name not in raw]
    if missing:
        raise ValueError(f"{path} lacks {missing}: not a GPT-2 config")
    return {
        "n_layer": int(raw["n_layer"]),
        "n_head": int(raw["n_head"]),
        "n_embd": int(raw["n_embd"]),
        "n_positions": int(raw.get("n_positions", raw.get("n_ctx", 1024))),
        "layer_norm_epsilon": float(raw.get("layer_norm_epsilon", 1e-5)),
        "activation_function": raw.get("activation_function", "gelu_new"),
    }


def _read_file(path: Path) -> dict[str, torch.Tensor]:
    if path.suffix == ".safetensors":
        return _safetensors().load_file(str(path), device="cpu")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:  # torch's messages for a bad file span many lines of "weights_only" advice
        raise ValueError(
            f"{path} is not a readable PyTorch weights file ({type(error).__name__}: truncated, corrupt, "
            "or holding objects other than tensors)"
        ) from None
    if not isinstance(state, dict):
        raise ValueError(f"{path} does not hold a state dict")
    return state


def read_gpt2_state_dict(directory: str | os.PathLike) -> dict[str, torch.Tensor]:
    """Every tensor of a GPT-2 directory's weights, names as stored (safetensors preferred over .bin)."""
    directory = Path(directory)
    if (directory / SAFETENSORS_NAME).is_file():
        return _read_file(directory / SAFETENSORS_NAME)
    if (directory / BIN_NAME).is_file():
        return _read_file(directory / BIN_NAME)
    for index_name in INDEX_NAMES.values():
        index = directory / index_name
        if index.is_file():
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
            state: dict[str, torch.Tensor] = {}
            for shard in shards:
                state.update(_read_file(directory / shard))
            return state
    raise FileNotFoundError(f"no {SAFETENSORS_NAME}, {BIN_NAME} or shard index in {directory}")


def _strip_prefix(name: str) -> str:
    return name.removeprefix("transformer.")


def _get(module: nn.Module, dotted: str) -> torch.Tensor:
    for part in dotted.split("."):
        module = getattr(module, part)
    return module


#: Model attributes of which GPT-2 holds only the first rows: a gated MoA layer's projection weight is
#: ``[q | k | v | gate]`` and GPT-2's ``c_attn`` is ``[q | k | v]`` (value: rows in units of ``n_embd``).
_GPT2_ROWS = {"attn.qkv.weight": 3, "attn.qkv.bias": 3}


def _gpt2_part(tensor: torch.Tensor, attribute: str, n_embd: int) -> torch.Tensor:
    """The rows of a model tensor that GPT-2 has (a view, so copying into it fills the model's)."""
    rows = _GPT2_ROWS.get(re.sub(r"^blocks\.\d+\.", "", attribute))
    return tensor if rows is None else tensor[: rows * n_embd]


def _model_geometry(model: nn.Module) -> tuple[int, int, int]:
    config = model.config
    return int(config.n_layer), int(config.n_head), int(config.n_embd)


@dataclass
class GPT2LoadReport:
    """What :func:`load_gpt2_weights` did: checkpoint names loaded, ignored (by rule), skipped (layers
    beyond the model's), missing (model parameters the checkpoint lacks) and unexpected."""

    loaded: list[str] = field(default_factory=list)
    ignored: list[str] = field(default_factory=list)
    skipped_layers: list[int] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)


@torch.no_grad()
def load_gpt2_weights(model: nn.Module, directory: str | os.PathLike, *, strict: bool = True) -> GPT2LoadReport:
    """Copy a local Hugging Face GPT-2 checkpoint into ``model`` (see the module docstring for the mapping).

    Args:
        model: a GPT-2-architecture model (e.g. :class:`~icrl_models.models.dt_moa.DecisionTransformerMoA`).
        directory: a folder with ``config.json`` and ``model.safetensors`` or ``pytorch_model.bin``.
        strict: raise when a GPT-2 parameter of the model is missing from the checkpoint, or when the
            checkpoint holds a tensor that maps nowhere (other than the ignored ones and the layers
            beyond the model's). With ``strict=False`` both are only listed in the report.

    Raises:
        ValueError: the checkpoint's width (``n_embd``) or head count (``n_head``) differs from the
            model's, it has fewer layers or positions than the model, or a tensor has the wrong shape.
    """
    n_layer, n_head, n_embd = _model_geometry(model)
    config = read_gpt2_config(directory)
    if config["n_embd"] != n_embd:
        raise ValueError(f"checkpoint n_embd ({config['n_embd']}) differs from the model's n_embd ({n_embd})")
    if config["n_head"] != n_head:
        raise ValueError(f"checkpoint n_head ({config['n_head']}) differs from the model's n_head ({n_head})")
    if config["n_layer"] < n_layer:
        raise ValueError(f"checkpoint has {config['n_layer']} layers, the model needs n_layer = {n_layer}")
    if config["activation_function"] not in ("gelu_new", "gelu_pytorch_tanh"):
        warnings.warn(
            f"checkpoint activation {config['activation_function']!r}: the model uses GPT-2's tanh GELU",
            stacklevel=2,
        )
    state = {_strip_prefix(name): tensor for name, tensor in read_gpt2_state_dict(directory).items()}
    report = GPT2LoadReport()
    assigned: set[str] = set()
    skipped: set[int] = set()
    for name, tensor in state.items():
        if name in IGNORED_NAMES or _IGNORED_BUFFER.match(name):
            report.ignored.append(name)
            continue
        target, transpose = None, False
        if name in TOP_PARAMETERS:
            target = TOP_PARAMETERS[name]
        elif match := _LAYER.match(name):
            layer, rest = int(match.group(1)), match.group(2)
            if rest in LAYER_PARAMETERS and layer >= n_layer:
                skipped.add(layer)
                continue
            if rest in LAYER_PARAMETERS:
                attribute, transpose = LAYER_PARAMETERS[rest]
                target = f"blocks.{layer}.{attribute}"
        if target is None:
            report.unexpected.append(name)
            continue
        parameter = _gpt2_part(_get(model, target), target, n_embd)
        source = tensor.t() if transpose else tensor
        if target == "wpe.weight" and source.shape[0] >= parameter.shape[0] and source.shape[1:] == parameter.shape[1:]:
            source = source[: parameter.shape[0]]  # the model needs only its first positions
        if source.shape != parameter.shape:
            raise ValueError(
                f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}; the model's {target} needs "
                f"{tuple(parameter.shape)}{' (transposed Conv1D)' if transpose else ''}"
            )
        parameter.copy_(source)
        assigned.add(target)
        report.loaded.append(name)
    report.skipped_layers = sorted(skipped)
    expected = set(TOP_PARAMETERS.values()) | {
        f"blocks.{i}.{attribute}" for i in range(n_layer) for attribute, _ in LAYER_PARAMETERS.values()
    }
    # A bias-free model (bias=False) has no bias to fill.
    expected = {name for name in expected if _get_optional(model, name) is not None}
    report.missing = sorted(expected - assigned)
    if strict and (report.missing or report.unexpected):
        raise ValueError(
            f"GPT-2 checkpoint in {directory} does not match the model: missing {report.missing[:8]}, "
            f"unexpected {report.unexpected[:8]} (strict=False loads what matches)"
        )
    return report


def _get_optional(model: nn.Module, dotted: str):
    try:
        return _get(model, dotted)
    except AttributeError:
        return None


@torch.no_grad()
def gpt2_state_dict(model: nn.Module, *, prefix: str = "") -> dict[str, torch.Tensor]:
    """The model's GPT-2 parameters under Hugging Face names and layouts (Conv1D weights ``[in, out]``),
    each a contiguous CPU copy. No ``wte`` (the model has none) and no mask buffers."""
    n_layer, _, n_embd = _model_geometry(model)
    state = {}
    for name, target in TOP_PARAMETERS.items():
        state[prefix + name] = _get(model, target).detach().cpu().clone()
    for i in range(n_layer):
        for name, (attribute, transpose) in LAYER_PARAMETERS.items():
            tensor = _get_optional(model, f"blocks.{i}.{attribute}")
            if tensor is None:
                continue
            tensor = _gpt2_part(tensor.detach(), attribute, n_embd).cpu()
            state[f"{prefix}h.{i}.{name}"] = (tensor.t() if transpose else tensor).contiguous().clone()
    return state


def save_gpt2_weights(
    model: nn.Module, directory: str | os.PathLike, *, format: str = "safetensors", prefix: str = ""
) -> Path:
    """Write the model's GPT-2 parameters as a Hugging Face GPT-2 directory (``config.json`` and
    ``model.safetensors`` or ``pytorch_model.bin``) that :func:`load_gpt2_weights` reads back exactly.

    ``prefix`` is prepended to every name (``"transformer."`` mimics ``GPT2LMHeadModel``). Returns the
    weights file's path.
    """
    if format not in WEIGHT_FORMATS:
        raise ValueError(f"format must be one of {WEIGHT_FORMATS}, got {format!r}")
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    n_layer, n_head, n_embd = _model_geometry(model)
    config = {
        "model_type": "gpt2",
        "architectures": ["GPT2Model"],
        "n_layer": n_layer,
        "n_head": n_head,
        "n_embd": n_embd,
        "n_positions": int(model.wpe.weight.shape[0]),
        "n_ctx": int(model.wpe.weight.shape[0]),
        "layer_norm_epsilon": float(getattr(model.config, "layer_norm_epsilon", 1e-5)),
        "activation_function": "gelu_new",
    }
    write_json(directory / CONFIG_NAME, config, indent=2)
    state = gpt2_state_dict(model, prefix=prefix)
    if format == "safetensors":
        path = directory / SAFETENSORS_NAME
        with atomic_path(path) as temporary:
            _safetensors().save_file(state, str(temporary), metadata={"format": "pt"})
    else:
        path = directory / BIN_NAME
        with atomic_open(path, "wb") as file:
            torch.save(state, file)
    return path


__all__ = [
    "GPT2LoadReport",
    "gpt2_state_dict",
    "load_gpt2_weights",
    "read_gpt2_config",
    "read_gpt2_state_dict",
    "save_gpt2_weights",
]
