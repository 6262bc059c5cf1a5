"""What every experiment command shares, written once: presets, seed statistics, the cached training
dataset, and result files that say how they were made.

An experiment module (one per paper) uses these pieces and keeps only its paper's protocol:

* **Presets** (``--preset cpu|paper``): a preset is a dict of field values; a config whose fields default
  to ``None`` calls :func:`fill_from_preset` in ``__post_init__`` so that an explicit flag always wins.
  :func:`check_preset` is the one error for an unknown name, :func:`preset_help` the ``--help`` text of a
  preset-filled field.
* **Seeds**: :func:`seed_stats` summarises one number over seeds (mean, sample standard deviation, range),
  :func:`format_stats` prints it as ``0.500 ± 0.040 (n=3)``; :func:`per_seed_configs` splits a ``--seeds``
  run into single-seed experiments, one folder each.
* **Schedule**: :func:`warmup_then_constant`, the learning rate of the experiments' own training loops.
* **Run folders and datasets**: :func:`run_folder` makes the output folder; :func:`cached_dataset`
  generates the training histories once into ``train.icrl`` and reuses the file on later runs, so that
  several models (and a rerun) train on the same data.
* **CPU time estimates**: :class:`StepCost` (a per-step cost calibrated on a recorded run) and
  :func:`print_cpu_estimate`, the line each command prints before a run starts.
* **Result files**: :func:`write_results` writes ``<stem>.json`` and ``<stem>.md``; both record the
  command line that produced them and :func:`machine_description` of the machine it ran on, so a table
  pasted into a report can be traced and rerun.
* **Plots**: line plots with error bands are :func:`icrl_models.plots.plot_curves`; :func:`pyplot` gives
  matplotlib's ``pyplot`` on the file-only backend for an experiment's own figure.
"""

from __future__ import annotations

import dataclasses
import os
import platform
import shlex
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from ..files import write_json, write_text

if TYPE_CHECKING:  # the training stack is imported only by the commands that generate data
    from ..train import TrainConfig

# --- presets ---------------------------------------------------------------------------------------


def check_preset(name: str, presets: Mapping[str, Any] | Sequence[str]) -> None:
    """Raise ``ValueError("preset must be one of ...")`` unless ``name`` is a key (or entry) of ``presets``."""
    if not isinstance(name, str) or name not in presets:
        raise ValueError(f"preset must be one of {tuple(presets)}, got {name!r}")


def fill_from_preset(config: Any, presets: Mapping[str, Mapping[str, Any]]) -> None:
    """Set every field of ``config`` that is ``None`` and named in ``presets[config.preset]`` to the preset's value.

    The pattern behind ``--preset cpu|paper``: fields default to ``None`` so that an explicit flag always wins.
    """
    check_preset(config.preset, presets)
    for name, value in presets[config.preset].items():
        if getattr(config, name) is None:
            setattr(config, name, value)


def preset_help(presets: Mapping[str, Mapping[str, Any]], name: str, text: str = "") -> str:
    """``text`` and the default of the field ``name`` per preset, as typed on the command line:
    ``"steps (default: from --preset, cpu 1500, paper 20000)"``."""
    shown = {preset: values[name] for preset, values in presets.items()}
    shown = {preset: " ".join(map(str, v)) if isinstance(v, tuple) else str(v) for preset, v in shown.items()}
    return f"{text} (default: from --preset, {', '.join(f'{p} {v}' for p, v in shown.items())})".strip()


# --- seeds -----------------------------------------------------------------------------------------


def seed_stats(values) -> dict:
    """``{"mean", "std", "min", "max", "n", "values"}`` of one number measured over ``n`` seeds.

    ``std`` is the sample standard deviation (``ddof=1``) for ``n > 1`` and ``0.0`` for one seed. ``values``
    must be a non-empty, one-dimensional sequence of numbers without NaN (a NaN would turn every statistic
    into NaN and hide which seed failed): a ``ValueError`` naming ``values`` otherwise.
    """
    try:
        array = np.asarray(values, dtype=np.float64)
    except (TypeError, ValueError):
        raise ValueError(f"values must be a sequence of numbers, got {values!r}") from None
    if array.ndim != 1 or array.size == 0:
        raise ValueError(f"values must be a non-empty 1-D sequence of numbers, got shape {array.shape}")
    if np.isnan(array).any():
        raise ValueError(f"values must not contain NaN, got {array.tolist()}")
    return {
        "mean": float(array.mean()),
        "std": float(array.std(ddof=1)) if array.size > 1 else 0.0,
        "min": float(array.min()),
        "max": float(array.max()),
        "n": int(array.size),
        "values": array.tolist(),
    }


def format_stats(stats: Mapping[str, Any], digits: int = 3) -> str:
    """``"0.500 ± 0.040 (n=3)"`` for a :func:`seed_stats` dict; ``"0.500 (n=1)"`` for a single seed (no spread)."""
    if not isinstance(digits, int) or digits < 0:
        raise ValueError(f"digits must be an int >= 0, got {digits!r}")
    n = stats["n"] if "n" in stats else len(stats["values"])  # summaries written before "n" existed
    if n == 1:
        return f"{stats['mean']:.{digits}f} (n=1)"
    return f"{stats['mean']:.{digits}f} ± {stats['std']:.{digits}f} (n={n})"


def per_seed_configs(config: Any) -> dict[int, Any]:
    """``{seed: config for that seed}`` for a config with ``seed``, ``seeds`` and ``out_dir`` fields: one per
    entry of ``seeds``, with ``seed`` set, ``seeds`` emptied and ``out_dir`` its ``seed<N>`` subfolder, so that
    each seed runs as its own single-seed experiment (a folder a rerun, or an earlier ``--seed N`` run there,
    resumes)."""
    return {
        seed: dataclasses.replace(config, seed=seed, seeds=(), out_dir=str(Path(config.out_dir) / f"seed{seed}"))
        for seed in config.seeds
    }


# --- training schedule -----------------------------------------------------------------------------


def warmup_then_constant(step: int, peak: float, warmup_steps: int) -> float:
    """Learning rate at 0-based ``step``: linear warm-up to ``peak`` over ``warmup_steps`` steps, then
    constant (the schedule of the experiments that locate an event in training time: a decaying rate would
    blur where it happens). ``warmup_steps <= 1`` starts at ``peak``."""
    return peak * min(1.0, (step + 1) / max(1, warmup_steps))


# --- run folders and datasets ----------------------------------------------------------------------


def run_folder(path: str | os.PathLike) -> Path:
    """The output folder ``path``, created with its parents if needed."""
    folder = Path(path)
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def cached_dataset(path: str | os.PathLike, config: TrainConfig, *, progress: bool = True) -> Path:
    """The training histories of ``config`` at ``path`` (``train.icrl`` of a run folder): generated from the
    config's environment, size and source algorithm if the file is absent, reused as they are if it exists
    (a rerun, or the second model of a comparison, trains on identical data). The file is written
    atomically, so an interrupted generation leaves no half file behind to be reused."""
    from ..data import generate_histories, save_histories

    path = Path(path)
    if not path.exists():
        generate = config.generate_config("train", config.num_histories, config.source_episodes)
        save_histories(generate_histories(generate, progress=progress), path)
    return path


# --- CPU time estimates ----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class StepCost:
    """A per-step CPU cost model calibrated on one recorded run: ``seconds`` of process CPU time (user + sys)
    per step of a run whose step did ``work`` units of work (the command's own measure, e.g. windows x tokens x
    layers x width^2 for a transformer step); ``source`` names the run. A step of ``w`` units is taken to cost
    ``seconds * w / work``: linear in the work, no fixed overhead, so small models are under-estimated."""

    seconds: float
    work: float
    source: str

    def estimate(self, steps: float, work: float | None = None) -> float:
        """CPU seconds of ``steps`` steps of ``work`` units each (default: the calibration run's)."""
        return steps * self.seconds * (self.work if work is None else work) / self.work


def transformer_work(batch: int, tokens: int, layers: int, width: int) -> float:
    """The work of one transformer training step in :class:`StepCost` units: sequences x tokens x blocks x
    width^2, the terms the matmul FLOPs grow with (attention's tokens^2 term ignored: short contexts here)."""
    return float(batch) * tokens * layers * width * width


#: icrl-train's training step per model kind, in :func:`transformer_work` units (``seq_len`` tokens, attention
#: and n-gram blocks), and one step of an in-context rollout per environment (env-steps x blocks x width^2),
#: 1 torch thread: the Dark Room main job (N-Gram AD) and the Bernoulli runs of ``headless-bernoulli.json`` (AD,
#: Headless-AD: 190-205 and 289-317 CPU s for 1500 steps; their evaluations, 100 bandits x 300 pulls, 1.9 and
#: 3.3 s each). The main job's Dark Room rollouts cost ~2x the bandits' per unit (environment and Q-learning
#: rerun): its estimate is ~10% low.
TRAIN_STEP_COSTS: dict[str, StepCost] = {
    "ngram_ad": StepCost(0.10, transformer_work(32, 100, 4, 64), "main-job.json"),
    "ad": StepCost(0.133, transformer_work(16, 300, 2, 64), "headless-bernoulli.json"),
    "headless_ad": StepCost(0.20, transformer_work(16, 300, 2, 64), "headless-bernoulli.json"),
}
ROLLOUT_STEP_COST = StepCost(1.1e-4, 2 * 64 * 64, "headless-bernoulli.json")


def train_run_cpu_seconds(config: TrainConfig, evaluations: int = 1) -> float:
    """Estimated CPU seconds of the ``icrl-train`` run ``config`` from scratch: its training steps and
    ``evaluations`` in-context evaluations of its evaluation set (the run's own final one is one)."""
    from ..train import make_eval_env_factory

    blocks = config.num_layers + len(config.ngram_tuple())
    tokens = config.seq_len * (3 if config.step_tokens == "separate" else 1)
    train = TRAIN_STEP_COSTS[config.model].estimate(
        config.steps, transformer_work(config.batch_size, tokens, blocks, config.d_model)
    )
    env = make_eval_env_factory(config)(0)
    rollout_steps = env.num_envs * config.eval_episodes * env.episode_length
    return train + evaluations * ROLLOUT_STEP_COST.estimate(rollout_steps, blocks * config.d_model**2)


def print_cpu_estimate(what: str, seconds: float, *, device: Any = "cpu") -> None:
    """Print, before a run starts, ``icrl: <what>: estimated CPU time ~N min ...`` on stderr. The constants
    behind ``seconds`` (:class:`StepCost`) were measured with one torch thread on the 2-core development VM
    (AMD EPYC); on a GPU (``device`` ``cuda...``, or ``auto`` where CUDA is available) the line says that no
    estimate applies."""
    if str(device) == "auto":
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
    if str(device).startswith("cuda"):
        print(
            f"icrl: {what}: no CPU time estimate on {device} (the cost model is calibrated on a CPU)", file=sys.stderr
        )
        return
    shown = f"{seconds / 60:.0f} min" if seconds >= 90 else f"{seconds:.0f} s"
    print(f"icrl: {what}: estimated CPU time ~{shown} (an estimate: per-step costs measured with 1 torch thread "
          "on a 2-core AMD EPYC VM, scaled by the work per step)", file=sys.stderr)  # fmt: skip


# --- result files ----------------------------------------------------------------------------------


def command_string(prog: str | None = None, argv: Sequence[str] | None = None) -> str:
    """The command line as a user would retype it: ``shlex.join([prog, *argv])``; ``prog`` defaults to the
    running program's file name and ``argv`` to ``sys.argv[1:]``."""
    prog = prog if prog is not None else Path(sys.argv[0]).name if sys.argv and sys.argv[0] else "python"
    return shlex.join([prog, *(sys.argv[1:] if argv is None else argv)])


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.partition(":")[2].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown CPU"


def machine_description(device: Any = None) -> str:
    """One line naming the hardware a result came from: the GPU's name when ``device`` is a CUDA device
    (``None``: CUDA if available), else the CPU model and core count; then the torch and Python versions.
    E.g. ``"AMD EPYC 7B13 (2 cores); torch 2.13.0+cpu; Python 3.11.9"``."""
    import torch

    from icrl_kernels.validation import check_device

    device = check_device(device) if device is not None else None
    use_cuda = device.type == "cuda" if device is not None else torch.cuda.is_available()
    if use_cuda:
        hardware = f"GPU {torch.cuda.get_device_name(device)}"
    else:
        hardware = f"{_cpu_model()} ({os.cpu_count()} cores)"
    return f"{hardware}; torch {torch.__version__}; Python {platform.python_version()}"


def write_results(
    out_dir: str | os.PathLike,
    stem: str,
    result: Mapping[str, Any],
    markdown: str | None,
    *,
    command: str | None = None,
    machine: str | None = None,
) -> dict[str, Path]:
    """Write ``out_dir/<stem>.json`` (``result`` with ``"command"`` and ``"machine"`` added) and, unless
    ``markdown`` is None, ``out_dir/<stem>.md``: the command and machine lines, a blank line, ``markdown``.

    Args:
        result: JSON-serialisable results; it must not hold the keys ``"command"`` or ``"machine"``.
        markdown: the human-readable table(s); None for a command that writes no ``.md``.
        command: the command line that produced the results (default: :func:`command_string`).
        machine: the hardware line (default: :func:`machine_description` of the default device).

    Returns ``{"json": path, "md": path}`` (``"md"`` only when written).
    """
    if not isinstance(stem, str) or not stem or Path(stem).name != stem:
        raise ValueError(f"stem must be a plain file name without folders, got {stem!r}")
    if not isinstance(result, Mapping):
        raise TypeError(f"result must be a dict, got {type(result).__name__}")
    clash = {"command", "machine"} & set(result)
    if clash:
        raise ValueError(f"result must not hold the keys {sorted(clash)}: write_results adds them")
    command = command_string() if command is None else command
    machine = machine_description() if machine is None else machine
    folder = run_folder(out_dir)
    paths = {"json": folder / f"{stem}.json"}
    # The provenance strings first, so that they are the first thing a reader of the file sees.
    write_json(paths["json"], {"command": command, "machine": machine, **result})  # atomic, as every result file
    if markdown is not None:
        paths["md"] = write_text(
            folder / f"{stem}.md", f"Command: `{command}`\n\nMachine: {machine}\n\n{markdown.rstrip()}\n"
        )
    return paths


# --- plots -----------------------------------------------------------------------------------------


def pyplot():
    """``matplotlib.pyplot`` on the ``Agg`` backend: experiments write PNG files and need no display."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt
