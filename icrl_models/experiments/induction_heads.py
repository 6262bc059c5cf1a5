"""``icrl-induction``: the induction-head phase change with and without smeared keys, and AD head scores.

``icrl-induction`` (or ``icrl-induction phase-change``) reproduces the induction-heads lecture's
claims on a synthetic in-context task. Every training sequence is a segment of distinct random tokens
of a random period ``P`` (uniform in ``[min_period, max_period]``) tiled to ``context_len`` tokens;
next-token loss over every position. After the first period the next token is always determined by
the context (find the previous occurrence of the current token, copy its successor), which is exactly
what an induction head computes; the random period rules out purely positional shortcuts. Models are
attention-only transformers (token + learned position embeddings, residual
:class:`~icrl_kernels.modules.smeared_attention.SmearedKeyAttention` layers, no MLP, no LayerNorm,
untied unembedding), one per variant: ``1L`` / ``2L`` (layers) with or without ``-smear``.
Expected: a one-layer model forms an induction head only with smeared keys; a two-layer model forms
one without (a previous-token head in layer 0 composing with layer 1), after a plateau and an abrupt
drop of the loss: the phase change.

Every ``eval_every`` steps each model is scored on a fixed batch of TransformerLens-style sequences
(``eval_seq_len`` random distinct tokens repeated twice, no BOS; :mod:`icrl_models.analysis`):
per-head previous-token, duplicate-token and induction scores, OV copying scores, the loss on the
predictable second repeat and the in-context learning score. At the end: head importance by zero
ablation. Outputs in ``out_dir``: ``induction.json`` (command line, machine, config, curves, final
scores, wall and CPU times), ``induction.md`` (the summary table) and ``induction.png`` (best induction
score and second-repeat loss against training steps). ``--seeds 0 1 2`` runs the experiment once per seed
(each in ``out_dir/seed<N>``, as ``--seed N`` would) and writes the same three files over all seeds: every
seed's report, and mean ± sd over seeds of the final scores.

``icrl-induction ad-report --run-dir DIR`` scores the attention blocks of a trained AD / N-Gram AD run
(``icrl-train``) on its own data, where a "repeated sequence" is a window of whole episodes of a
learning history (starting at an episode start) shown twice; see :func:`ad_report`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from icrl_kernels import BACKENDS, SmearedKeyAttention
from icrl_kernels.validation import check_int

from .._checks import check_float, check_training_fields
from .._cli import command_line, resolve_device
from ..analysis.induction import (
    attention_sites,
    capture_attention,
    detection_patterns,
    detection_score,
    head_ablation_importance,
    head_ov_weights,
    in_context_learning_score,
    ov_copying_score,
    repeat_scores,
    repeated_random_tokens,
    scores_by_site,
    uniform_causal_pattern,
)
from ..config import add_config_arguments, as_tuple, config_from_args, make_parser, torch_threads
from ..cuda_graphs import CUDA_GRAPH_HELP, cuda_graph_mode
from ..files import save_figure, write_json
from ..lifecycle import ReadingRun, Resumed, RunFolder, measure_batch_runs, train_runs
from ..nonfinite import NONFINITE_HELP
from .harness import (
    StepCost,
    command_string,
    format_stats,
    machine_description,
    per_seed_configs,
    print_cpu_estimate,
    pyplot,
    run_folder,
    seed_stats,
    transformer_work,
    warmup_then_constant,
    write_results,
)
from .sweep import (
    SweepOptions,
    TrialBatch,
    reuse_or_run,
    reuse_or_run_batch,
    run_trial_batches,
    settings_key,
    sweep_options,
)


@dataclass
class InductionConfig(SweepOptions):
    """The phase-change experiment; defaults finish in a few minutes on 2 CPU cores. Each variant is one trial
    of :mod:`~icrl_models.experiments.sweep` (on Ray Tune when installed)."""

    # Several values (--variants 1L 2L-smear); a comma-separated 1L,2L-smear (older command lines and
    # induction.json files) is read the same.
    variants: tuple[str, ...] = dataclasses.field(
        default=("1L", "1L-smear", "2L", "2L-smear"),
        metadata={"help": "models to train, each <layers>L or <layers>L-smear", "metavar": "VARIANT"},
    )
    vocab_size: int = 64
    context_len: int = dataclasses.field(default=64, metadata={"help": "tokens per training sequence"})
    min_period: int = dataclasses.field(default=8, metadata={"help": "shortest repeated segment in training"})
    max_period: int = dataclasses.field(default=24, metadata={"help": "longest repeated segment in training"})
    d_model: int = 64
    num_heads: int = 4
    smear_init: float = dataclasses.field(default=0.0, metadata={"help": "initial smearing logit alpha"})
    steps: int = 2000
    batch_size: int = 32
    learning_rate: float = 3e-3
    weight_decay: float = 0.0
    warmup_steps: int = 50
    eval_every: int = 50
    eval_batch: int = 64
    eval_seq_len: int = dataclasses.field(default=20, metadata={"help": "TransformerLens protocol: repeated length"})
    #: Induction score of the best head above which the model "has an induction head".
    threshold: float = 0.4
    backend: str = dataclasses.field(default="auto", metadata={"help": "smeared-key kernels: auto, triton, eager"})
    device: str = dataclasses.field(default="auto", metadata={"help": "auto (CUDA if there is one), cpu, cuda, ..."})
    cuda_graph: str = dataclasses.field(default="auto", metadata={"help": CUDA_GRAPH_HELP, "const": "on"})
    #: Models this small gain nothing from intra-op threads, and on a CPU shared with other jobs a
    #: second OpenMP thread spin-waiting for its core made steps 25x slower (measured, 2 cores).
    num_threads: int = dataclasses.field(
        default=1,
        metadata={"help": "torch CPU threads (0: half the available cores, 1 to 4)", "aliases": ("--threads",)},
    )
    seed: int = 0
    seeds: tuple[int, ...] = dataclasses.field(
        default=(),
        metadata={"help": "several seeds: the experiment once per seed (as --seed, in OUT_DIR/seed<N>), then the "
                  "files over all seeds", "metavar": "SEED"},
    )  # fmt: skip
    out_dir: str = "runs/induction"
    progress: bool = True
    nonfinite: str = dataclasses.field(default="stop", metadata={"help": NONFINITE_HELP})

    def __post_init__(self) -> None:
        super().__post_init__()
        self.variants = as_tuple(self.variants, str, "variants")
        self.seeds = as_tuple(self.seeds, int, "seeds")
        if any(seed < 0 for seed in self.seeds):
            raise ValueError(f"seeds must be ints >= 0, got {self.seeds}")
        check_training_fields(self)
        check_float(self.smear_init, "smear_init")
        check_float(self.threshold, "threshold")
        for name in ("vocab_size", "context_len", "min_period", "d_model", "num_heads", "eval_every", "eval_batch"):
            check_int(getattr(self, name), name, min_value=1)
        if not 2 <= self.min_period <= self.max_period <= min(self.vocab_size, self.context_len):
            raise ValueError("need 2 <= min_period <= max_period <= min(vocab_size, context_len)")
        if not 2 <= self.eval_seq_len <= self.vocab_size or 2 * self.eval_seq_len > self.context_len:
            raise ValueError("need 2 <= eval_seq_len <= vocab_size and 2 * eval_seq_len <= context_len")
        if self.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {self.backend!r}")
        self.cuda_graph = cuda_graph_mode(self.cuda_graph)
        self.variant_specs()

    def variant_specs(self) -> list[tuple[str, int, bool]]:
        """``(name, layers, smear)`` per entry of ``variants``."""
        specs = []
        for name in (str(variant).strip() for variant in self.variants):
            layers, _, suffix = name.partition("L")
            if not layers.isdigit() or int(layers) < 1 or suffix not in ("", "-smear"):
                raise ValueError(f"variants: each variant must look like 1L, 2L-smear, ...; got {name!r}")
            specs.append((name, int(layers), suffix == "-smear"))
        if not specs:
            raise ValueError("variants must name at least one model")
        return specs


class AttentionOnlyTransformer(nn.Module):
    """Attention-only transformer: ``W_U (x + sum of attention layers)``, ``x = W_E[token] + W_pos[position]``.

    No MLP and no LayerNorm, so the direct-path OV circuit of every head is exactly ``W_U W_O W_V W_E``.
    ``forward(tokens [B, L]) -> logits [B, L, vocab_size]``, ``L <= context_len``.
    """

    def __init__(
        self,
        vocab_size: int,
        context_len: int,
        d_model: int,
        num_heads: int,
        num_layers: int,
        *,
        smear: bool,
        smear_init: float = 0.0,
        backend: str = "auto",
    ) -> None:
        super().__init__()
        self.token_embedding = nn.Embedding(vocab_size, d_model)
        self.position_embedding = nn.Embedding(context_len, d_model)
        self.layers = nn.ModuleList(
            SmearedKeyAttention(d_model, num_heads, smear=smear, smear_init=smear_init, backend=backend)
            for _ in range(num_layers)
        )
        self.unembed = nn.Linear(d_model, vocab_size, bias=False)
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=0.02)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.token_embedding(tokens) + self.position_embedding(positions)
        for layer in self.layers:
            x = x + layer(x)
        return self.unembed(x)

    def copying_scores(self) -> dict[str, list[float]]:
        """OV copying score of every head, ``layers.<i> -> [H]`` (direct path through ``W_E`` and ``W_U``)."""
        embed, unembed = self.token_embedding.weight.detach().T, self.unembed.weight.detach()
        return {
            site.name: [ov_copying_score(embed, v, o, unembed) for v, o in head_ov_weights(site.module)]
            for site in attention_sites(self)
        }


def repeated_segments(
    batch: int, length: int, vocab_size: int, min_period: int, max_period: int, *, generator: torch.Generator
) -> torch.Tensor:
    """``[batch, length]`` sequences, each a segment of distinct random tokens of random period tiled to ``length``."""
    periods = torch.randint(min_period, max_period + 1, (batch, 1), generator=generator)
    segments = torch.rand(batch, vocab_size, generator=generator).argsort(dim=1)[:, :max_period]
    return segments.gather(1, torch.arange(length) % periods)


def next_token_losses(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """``[B, L - 1]`` losses of ``logits [B, L, V]`` on ``tokens [B, L]``; entry ``t`` is the loss on token t + 1."""
    return F.cross_entropy(logits[:, :-1].transpose(1, 2).float(), tokens[:, 1:], reduction="none")


def learning_rate_at(step: int, config: InductionConfig) -> float:
    """Linear warm-up, then constant: a decaying rate would blur where the phase change happens."""
    return warmup_then_constant(step, config.learning_rate, config.warmup_steps)


@dataclass
class EvalBatch:
    """The fixed TransformerLens-protocol batch: ``tokens [N, 2T]`` and the positions the metrics read."""

    tokens: torch.Tensor
    seq_len: int

    @property
    def repeat_slice(self) -> slice:
        """Predictions of tokens ``T + 1 .. 2T - 1`` (token ``T`` has no predecessor to look up)."""
        return slice(self.seq_len, 2 * self.seq_len - 1)

    @property
    def first_slice(self) -> slice:
        """Predictions of tokens ``1 .. T - 1``: nothing in the context determines them."""
        return slice(0, self.seq_len - 1)

    @property
    def icl_positions(self) -> tuple[int, int]:
        """``(early, late)`` prediction indices: the middle of the first repeat and the last token."""
        return self.seq_len // 2 - 1, 2 * self.seq_len - 2


@torch.no_grad()
def evaluate_model(model: AttentionOnlyTransformer, batch: EvalBatch) -> dict:
    """Per-head scores, copying scores, losses and ICL score of ``model`` on ``batch``."""
    model.eval()
    with capture_attention(model) as patterns:
        losses = next_token_losses(model(batch.tokens), batch.tokens)
    model.train()
    scores = scores_by_site(patterns, lambda p: repeat_scores(p, batch.seq_len))
    early, late = batch.icl_positions
    best_site, best_head, best = max(
        ((site, head, value) for site, s in scores.items() for head, value in enumerate(s["induction"])),
        key=lambda item: item[2],
    )
    smear = {site.name: site.module.smear_weight().tolist() for site in attention_sites(model) if site.module.smear}
    return {
        "repeat_loss": losses[:, batch.repeat_slice].mean().item(),
        "first_repeat_loss": losses[:, batch.first_slice].mean().item(),
        "icl_score": in_context_learning_score(losses, early=early, late=late),
        "best_induction": {"site": best_site, "head": best_head, "score": best},
        "scores": scores,
        "copying": model.copying_scores(),
        "smear_weight": smear,
    }


def _first_step_at_least(steps: list[int], values: list[float], threshold: float) -> int | None:
    return next((step for step, value in zip(steps, values) if value >= threshold), None)


def _steepest_drop_step(steps: list[int], values: list[float]) -> int | None:
    """The evaluation step that ends the largest loss decrease between consecutive evaluations."""
    if len(values) < 2:
        return None
    drops = np.asarray(values[:-1]) - np.asarray(values[1:])
    return steps[int(drops.argmax()) + 1]


def induction_loss(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """The training loss: the mean next-token loss of ``tokens [B, T]`` over every position."""
    return next_token_losses(model(tokens), tokens).mean()


class InductionRun(ReadingRun):
    """One variant of the experiment in the run lifecycle (:mod:`icrl_models.lifecycle`): the attention-only model
    on the repeated-segment stream (drawn on the CPU from the seed, so every device trains on the same sequences),
    the next-token loss; every ``eval_every`` steps (and at the start and end) the heads are scored on the fixed
    batch and the run is checkpointed in ``<out_dir>/runs/<variant>/``, so a killed run resumes."""

    def __init__(self, name: str, layers: int, smear: bool, config: InductionConfig, eval_batch: EvalBatch, *,
                 position: int = 0, folder: Path, identity: dict) -> None:  # fmt: skip
        self.variant, self.layers, self.smear, self.config, self.position = name, layers, smear, config, position
        self.device = resolve_device(config.device)
        self.eval_batch = EvalBatch(eval_batch.tokens.to(self.device), eval_batch.seq_len)
        self.folder, self.identity = RunFolder(folder), identity
        self.steps, self.cuda_graph, self.nonfinite = config.steps, config.cuda_graph, config.nonfinite
        self.progress = config.progress
        self.log_every = self.eval_every = self.checkpoint_every = config.eval_every

    def prepare(self) -> None:
        super().prepare()
        self.start = time.perf_counter()
        self.generator = torch.Generator().manual_seed(self.config.seed + 1)  # the same stream for every variant

    def build_model(self) -> nn.Module:
        config = self.config
        torch.manual_seed(config.seed)
        return AttentionOnlyTransformer(
            config.vocab_size, config.context_len, config.d_model, config.num_heads, self.layers,
            smear=self.smear, smear_init=config.smear_init, backend=config.backend,
        )  # fmt: skip

    def build_optimizer(self, model: nn.Module) -> torch.optim.Optimizer:
        return torch.optim.AdamW(model.parameters(), self.config.learning_rate, weight_decay=self.config.weight_decay)

    def restore(self, resumed: Resumed) -> None:
        resumed.restore_generator(self.generator, "rng", "data")

    def random_state(self) -> dict:
        return {"data": self.generator.get_state()}

    def learning_rate(self, step: int) -> float:
        return learning_rate_at(step, self.config)

    def next_batch(self, step: int) -> dict[str, torch.Tensor]:
        config = self.config
        tokens = repeated_segments(config.batch_size, config.context_len, config.vocab_size, config.min_period,
                                   config.max_period, generator=self.generator)  # fmt: skip
        return {"tokens": tokens}

    def loss(self, model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return induction_loss(model, batch["tokens"])

    def evaluate(self, model: nn.Module, step: int) -> dict:
        return {"evaluation": evaluate_model(model, self.eval_batch)}

    def finish(self, model: nn.Module, step: int) -> dict:
        # The phase change is a departure from the first reading, at initialisation.
        readings, losses, skipped = self.readings("evaluation")
        curves: dict[str, list] = {"step": [], "train_loss": [], "repeat_loss": [], "icl_score": [],
                                   "best_induction": []}  # fmt: skip
        for row, loss in zip(readings, losses):
            _record(curves, row["step"], loss, row["evaluation"])
        evaluation = readings[-1]["evaluation"]
        eval_batch = self.eval_batch

        def repeat_loss() -> float:
            with torch.no_grad():
                losses = next_token_losses(model(eval_batch.tokens), eval_batch.tokens)
                return losses[:, eval_batch.repeat_slice].mean().item()

        model.eval()
        importance = head_ablation_importance(model, repeat_loss)
        return {
            "layers": self.layers,
            "smear": self.smear,
            "curves": curves,
            "final": evaluation,
            "head_importance_repeat_loss": importance,
            "induction_step": _first_step_at_least(curves["step"], curves["best_induction"], self.config.threshold),
            "steepest_loss_drop_step": _steepest_drop_step(curves["step"], curves["repeat_loss"]),
            "skipped_steps": skipped,
            "wall_seconds": time.perf_counter() - self.start,
        }


def train_variant(
    name: str, layers: int, smear: bool, config: InductionConfig, eval_batch: EvalBatch, *, position: int = 0,
    folder: Path | None = None, identity: dict | None = None,
) -> dict:  # fmt: skip
    """Train one model on ``config.device`` (each step replayed from one CUDA graph under ``--cuda-graph``); return
    its curves, final evaluation, head importance and wall time. ``folder``: the run's folder (its checkpoint, which
    must match ``identity``, and metrics; default ``<out_dir>/runs/<name>``)."""
    folder = Path(config.out_dir) / "runs" / name if folder is None else folder
    run = InductionRun(name, layers, smear, config, eval_batch, position=position, folder=folder,
                       identity=identity if identity is not None else {"variant": name})  # fmt: skip
    (result,) = train_runs([run])
    return result


def _record(curves: dict[str, list], step: int, train_loss: float, evaluation: dict) -> None:
    curves["step"].append(step)
    curves["train_loss"].append(train_loss)
    curves["repeat_loss"].append(evaluation["repeat_loss"])
    curves["icl_score"].append(evaluation["icl_score"])
    curves["best_induction"].append(evaluation["best_induction"]["score"])


def plot_phase_change(runs: dict[str, dict[str, dict]], path: Path, *, threshold: float, log_vocab: float) -> None:
    """Two panels against training steps: best induction score per model, and its second-repeat loss.
    ``runs``: ``{seed label: {variant: result}}`` (one entry labelled ``""`` for one seed); a variant keeps
    its colour over seeds, a seed its line style.

    (:func:`icrl_models.plots.plot_curves` plots against ``1..points`` on one axis; the phase change
    needs the step axis and both quantities on it.)
    """
    plt = pyplot()
    figure, (top, bottom) = plt.subplots(2, 1, figsize=(7, 6), dpi=120, sharex=True)
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for index, results in enumerate(runs.values()):
        for variant, (name, result) in enumerate(results.items()):
            curves, colour = result["curves"], colours[variant % len(colours)]
            label = name if index == 0 else None  # one legend entry per variant; the seeds by line style
            style = ("-", "--", "-.", ":")[index % 4]
            top.plot(curves["step"], curves["best_induction"], label=label, color=colour, linestyle=style)
            bottom.plot(curves["step"], curves["repeat_loss"], label=label, color=colour, linestyle=style)
            if result["induction_step"] is not None and len(runs) == 1:
                for axis in (top, bottom):
                    axis.axvline(result["induction_step"], color=colour, linestyle=":", linewidth=1)
    top.axhline(threshold, color="black", linestyle="--", linewidth=1, label=f"threshold {threshold}")
    bottom.axhline(log_vocab, color="gray", linestyle="--", linewidth=1, label="ln(vocab): no context used")
    top.set_ylabel("best head's induction score")
    bottom.set_ylabel("loss on the repeated half")
    bottom.set_xlabel("training step")
    styles = ", ".join(
        f"{style} {label}" for style, label in zip(("solid", "dashed", "dash-dot", "dotted") * len(runs), runs)
    )
    seeds = f"\n({styles})" if len(runs) > 1 else ""
    top.set_title(f"Induction heads: phase change with and without smeared keys{seeds}", fontsize=10)
    for axis in (top, bottom):
        axis.grid(alpha=0.3)
        axis.legend(fontsize=8)
    figure.tight_layout()
    save_figure(figure, path)


def run_experiment(config: InductionConfig, *, command: str | None = None) -> dict:
    """Train every variant, write ``induction.json``, ``induction.md`` and ``induction.png`` into ``out_dir``;
    return the results. With ``config.seeds``: once per seed in ``out_dir/seed<N>``, then the files over all
    seeds (:func:`seeds_report`). ``command``: the command line recorded in the files (default: this process's)."""
    with torch_threads(config.num_threads):
        if not config.seeds:
            return _run_experiment(config, command)
        resolve_device(config.device)  # a device this machine lacks: one clear error before any trial
        seed_configs = per_seed_configs(config)
        # Every seed's variants at once: with --batch-runs, the seeds of one variant train as one batched model.
        trials = [trial for seed_config in seed_configs.values() for trial in _trials(seed_config)]
        outcomes = _train_trials(config, trials)
        per_seed = len(config.variant_specs())
        reports = {
            seed: _run_experiment(seed_config, command, outcomes[index * per_seed : (index + 1) * per_seed])
            for index, (seed, seed_config) in enumerate(seed_configs.items())
        }
        report = seeds_report(config, reports)
        markdown = format_seeds_summary(report)
        write_results(
            config.out_dir,
            "induction",
            report,
            markdown,
            command=command,
            machine=machine_description(resolve_device(config.device)),
        )
        runs = {f"seed {seed}": seed_report["results"] for seed, seed_report in reports.items()}
        plot_phase_change(runs, Path(config.out_dir) / "induction.png", threshold=config.threshold,
                          log_vocab=math.log(config.vocab_size))  # fmt: skip
        return report


#: CPU seconds of a training step with 1 torch thread on the 2-core VM, the 2-layer variant of the default
#: experiment (cpu-induction-phase-change.json: 35-41 s of CPU for 2000 steps, evaluations included).
STEP_COST = StepCost(0.019, transformer_work(32, 64, 2, 64), "cpu-induction-phase-change.json")


def seeds_report(config: InductionConfig, reports: dict[int, dict]) -> dict:
    """``induction.json`` over seeds: the config, per variant :func:`~.harness.seed_stats` of the final best
    induction score and second-repeat loss, the step each seed's induction head formed (None: never), and
    every seed's own report."""
    variants = list(reports[config.seeds[0]]["summary"])
    summary = {}
    for name in variants:
        per_seed = [reports[seed]["summary"][name] for seed in config.seeds]
        summary[name] = {
            "final_best_induction": seed_stats([s["final_best_induction"]["score"] for s in per_seed]),
            "final_repeat_loss": seed_stats([s["final_repeat_loss"] for s in per_seed]),
            "induction_step": [s["induction_step"] for s in per_seed],
            "steepest_loss_drop_step": [s["steepest_loss_drop_step"] for s in per_seed],
        }
    return {
        "config": dataclasses.asdict(config),
        "seeds": list(config.seeds),
        "summary": summary,
        "cpu_seconds": sum(report["cpu_seconds"] for report in reports.values()),
        "wall_seconds": sum(report["wall_seconds"] for report in reports.values()),
        "per_seed": {str(seed): report for seed, report in reports.items()},
    }


def format_seeds_summary(report: dict) -> str:
    """Markdown: per variant the final best induction score and second-repeat loss (mean ± sd over seeds) and
    the step each seed's induction head formed."""
    seeds = report["seeds"]
    lines = [
        f"Induction heads over seeds {', '.join(map(str, seeds))}: the best head's induction score and the loss on "
        f"the repeated half at the last step (mean ± sd over seeds), and the first step the score reached "
        f"{report['config']['threshold']} (per seed; - never).",
        "",
        "| model | induction score | repeat loss | formed at step (per seed) |",
        "|---|---|---|---|",
    ]
    for name, entry in report["summary"].items():
        formed = " / ".join("-" if step is None else str(step) for step in entry["induction_step"])
        lines.append(f"| {name} | {format_stats(entry['final_best_induction'], 2)} | "
                     f"{format_stats(entry['final_repeat_loss'], 2)} | {formed} |")  # fmt: skip
    lines += ["", f"CPU time of the trainings: {report['cpu_seconds']:.0f} s in all (process user + sys, every seed)."]
    return "\n".join(lines)


@dataclass
class InductionTrial:
    """One variant to train (:func:`train_variant`)."""

    config: InductionConfig
    name: str
    layers: int
    smear: bool
    position: int

    def key(self) -> dict:
        """What the variant's result depends on: the config without where and how it runs, and the variant."""
        # nonfinite: a stored result is of a run that finished, under "stop" one with no non-finite step.
        run_only = ("out_dir", "progress", "num_threads", "variants", "seeds", "nonfinite", "device", "cuda_graph")
        return settings_key(self.config, run_only, variant=self.name)

    def result_path(self) -> Path:
        return Path(self.config.out_dir) / "runs" / f"{self.name}.json"

    @property
    def out_dir(self) -> Path:
        """The run's folder (its checkpoint and metrics while it trains)."""
        return self.result_path().with_suffix("")

    def shape(self) -> str:
        """What runs of one batch share (``--batch-runs``): the variant; seeds differ."""
        return self.name

    def estimate(self) -> None:
        """Say what training the variant from scratch will cost (on stderr)."""
        config = self.config
        work = transformer_work(config.batch_size, config.context_len, self.layers, config.d_model)
        print_cpu_estimate(f"induction {self.name}, seed {config.seed}", STEP_COST.estimate(config.steps, work),
                           device=config.device)  # fmt: skip

    def run(self, *, quiet: bool = False) -> InductionRun:
        """This trial as a run of the lifecycle."""
        config = self.config
        if not quiet:
            self.estimate()
        return InductionRun(self.name, self.layers, self.smear, config, _eval_batch(config), position=self.position,
                            folder=self.out_dir, identity=self.key())  # fmt: skip


def _eval_batch(config: InductionConfig) -> EvalBatch:
    """The fixed evaluation batch every variant is scored on."""
    tokens = repeated_random_tokens(
        config.eval_batch, config.eval_seq_len, config.vocab_size, generator=torch.Generator().manual_seed(12345)
    )
    return EvalBatch(tokens, config.eval_seq_len)


def train_trial(trial: InductionTrial) -> dict:
    """:func:`train_variant` for one trial; its result is kept in ``<out_dir>/runs/<variant>.json`` under the
    config's settings, so a rerun (or a resumed sweep) reuses it, and a run killed before its end resumes from its
    checkpoint in ``<out_dir>/runs/<variant>/``."""

    def run() -> dict:
        config = trial.config
        trial.estimate()
        start = time.process_time()
        result = train_variant(trial.name, trial.layers, trial.smear, config, _eval_batch(config),
                               position=trial.position, folder=trial.out_dir, identity=trial.key())  # fmt: skip
        return {**result, "cpu_seconds": time.process_time() - start}

    return reuse_or_run(trial.result_path(), trial.key(), run)


def train_batch(batch: TrialBatch) -> dict:
    """``--batch-runs``: the trials of ``batch`` (one variant, several seeds) trained as one batched model, each
    kept as :func:`train_trial` keeps it; ``{"outcomes": [...]}`` in the batch's order. ``cpu_seconds``: each
    run's share of the batch's process time."""
    trials = batch.trials

    def run(indices: list[int]) -> list[dict]:
        start = time.process_time()
        results = train_runs([trials[index].run() for index in indices], batched=True)
        share = (time.process_time() - start) / len(indices)
        return [{**result, "cpu_seconds": share} for result in results]

    return {"outcomes": reuse_or_run_batch([t.result_path() for t in trials], [t.key() for t in trials], run)}


def _trials(config: InductionConfig) -> list[InductionTrial]:
    return [InductionTrial(config, name, layers, smear, index)
            for index, (name, layers, smear) in enumerate(config.variant_specs())]  # fmt: skip


def _train_trials(config: InductionConfig, trials: list[InductionTrial]) -> list[dict]:
    """Every trial's outcome (trained, or its stored result): one at a time, or with ``--batch-runs`` the trials of
    one variant (the seeds of ``--seeds``) as batched models."""
    batch_runs = config.batch_runs
    if batch_runs == "auto":
        batch_runs = _auto_batch_runs(config, trials)
    return run_trial_batches(trials, train_trial, train_batch, sweep_options(config), batch_runs=batch_runs,
                             key=InductionTrial.shape, name="induction",
                             storage=Path(config.out_dir) / "ray")  # fmt: skip


def _auto_batch_runs(config: InductionConfig, trials: list[InductionTrial]) -> int:
    """``--batch-runs auto``: the lifecycle's measured probe of the largest variant's runs (a few steps each)."""
    per_variant = max(sum(1 for t in trials if t.name == trial.name) for trial in trials)
    if per_variant < 2:
        return 1
    largest = max(trials, key=lambda trial: trial.layers)
    with tempfile.TemporaryDirectory(prefix="icrl-batch-probe-") as folder:

        def make_runs(count: int) -> list[InductionRun]:
            probe = [dataclasses.replace(largest.config, seed=seed, out_dir=f"{folder}/{count}-{seed}", progress=False)
                     for seed in range(count)]  # fmt: skip
            return [InductionTrial(c, largest.name, largest.layers, largest.smear, 0).run(quiet=True) for c in probe]

        return measure_batch_runs(make_runs, resolve_device(config.device), runs=per_variant,
                                  share=sweep_options(config).trials_at_once(len(trials)))  # fmt: skip


def _run_experiment(config: InductionConfig, command: str | None, outcomes: list[dict] | None = None) -> dict:
    """One seed's experiment: train its variants (unless their ``outcomes`` are given, trained already), write its
    files, return its report."""
    device = resolve_device(config.device)  # a device this machine lacks: one clear error before any trial
    out_dir = run_folder(config.out_dir)
    start = time.perf_counter()
    trials = _trials(config)
    if outcomes is None:
        outcomes = _train_trials(config, trials)
    results = {trial.name: outcome for trial, outcome in zip(trials, outcomes)}
    summary = {
        name: {
            "final_best_induction": r["final"]["best_induction"],
            "final_repeat_loss": r["final"]["repeat_loss"],
            "final_icl_score": r["final"]["icl_score"],
            "induction_step": r["induction_step"],
            "steepest_loss_drop_step": r["steepest_loss_drop_step"],
            "wall_seconds": r["wall_seconds"],
            "cpu_seconds": r.get("cpu_seconds"),  # absent from results kept before it was measured
        }
        for name, r in results.items()
    }
    report = {
        "config": dataclasses.asdict(config),
        "torch_threads": torch.get_num_threads(),
        "summary": summary,
        "results": results,
        "wall_seconds": time.perf_counter() - start,
        # The trainings' own CPU time (user + sys of the process that trained each, kept with its result), summed.
        "cpu_seconds": sum(s["cpu_seconds"] for s in summary.values() if s["cpu_seconds"] is not None),
    }
    machine = machine_description(device)
    write_results(out_dir, "induction", report, f"```\n{format_summary(report)}\n```", command=command, machine=machine)
    log_vocab = math.log(config.vocab_size)
    plot_phase_change({"": results}, out_dir / "induction.png", threshold=config.threshold, log_vocab=log_vocab)
    return report


def format_summary(report: dict) -> str:
    """A plain-text table of the experiment's summary."""
    lines = [
        f"{'model':<10} {'induction':>9} {'(site, head)':>14} {'repeat loss':>11} {'ICL':>7} "
        f"{'formed at':>9} {'steepest drop':>13} {'seconds':>7}"
    ]
    for name, s in report["summary"].items():
        best = s["final_best_induction"]
        where = f"{best['site']}.{best['head']}"
        formed = "-" if s["induction_step"] is None else str(s["induction_step"])
        lines.append(
            f"{name:<10} {best['score']:>9.3f} {where:>14} {s['final_repeat_loss']:>11.3f} "
            f"{s['final_icl_score']:>7.2f} {formed:>9} {str(s['steepest_loss_drop_step']):>13} "
            f"{s['wall_seconds']:>7.0f}"
        )
    lines.append(f"total {report['wall_seconds']:.0f} s wall, {report['cpu_seconds']:.0f} s CPU of the trainings")
    return "\n".join(lines)


# --- AD / N-Gram AD report -------------------------------------------------------------------------

#: Pseudo-site of :func:`ad_report` holding the scores of uniform causal attention.
UNIFORM_BASELINE = "uniform (baseline)"


@torch.no_grad()
def ad_report(run_dir: str | Path, *, repeat_episodes: int = 2, num_windows: int = 32, seed: int = 0) -> dict:
    """Per-head scores of a trained AD / N-Gram AD run (``icrl-train``'s run folder) on its own data.

    Three views, each per attention site (n-gram blocks count as one head, their fixed pattern), with
    the scores of uniform causal attention on the same inputs as a baseline (site
    :data:`UNIFORM_BASELINE`): Dark Room states recur within an episode, so even uniform attention puts
    visible mass on "duplicate" and "induction" keys of natural windows.

    * ``repeated_episodes``: a window of ``repeat_episodes`` whole episodes of a training history's
      (subsampled) stream, starting at an episode start, shown twice back to back (``2T`` tokens of
      (state, previous action, previous reward), positions ``0..2T-1``; the second copy repeats the
      first token exactly, so its previous action is that of the window start, not the last action of
      the first copy). :func:`~icrl_models.analysis.repeat_scores` with ``seq_len = T``.
    * ``repeated_random``: the TransformerLens protocol: uniformly random states, previous actions and
      previous rewards (0/1) for ``T`` steps, repeated twice.
    * ``natural``: training windows of ``seq_len`` steps as the model was trained on, no repetition;
      TransformerLens' token-matching scores with state ids as the tokens
      (:func:`~icrl_models.analysis.detection_score`), the in-context learning score of the action loss
      (step ``seq_len - 1`` minus step ``episode_length // 2``), and head importance (increase of the
      action loss when one head is zeroed).
    """
    from ..checkpoint import load_checkpoint
    from ..data import HistoryWindows, load_histories
    from ..models.ad import ADModel, action_loss
    from ..train import TrainConfig

    run_dir = Path(run_dir)
    config = TrainConfig(**json.loads((run_dir / "config.json").read_text()))
    histories = load_histories(config.data or run_dir / "train.icrl")
    model = ADModel(config.model_config(histories))
    model.load_state_dict(load_checkpoint(run_dir / "checkpoint.pt")["model"])
    model.eval()
    rng = np.random.default_rng(seed)
    dones = np.asarray(histories.dones[0, : histories.lengths[0]])
    episode_length = int(np.flatnonzero(dones)[0]) + 1
    repeat_len = repeat_episodes * episode_length

    def episode_aligned_windows(length: int) -> dict[str, torch.Tensor]:
        windows = HistoryWindows(histories, length, episode_subsample=config.episode_subsample)
        candidates = windows.get_batch(rng.integers(0, len(windows), size=40 * num_windows * episode_length))
        keep = (candidates["episode_start"][:, 0] & candidates["mask"].all(dim=1)).nonzero().flatten()[:num_windows]
        if keep.numel() == 0:
            raise ValueError(f"no episode-aligned windows of {length} steps in {run_dir}")
        return {name: value[keep] for name, value in candidates.items() if value.dim() >= 1}

    def site_scores(states, prev_actions, prev_rewards, score) -> dict:
        with capture_attention(model) as patterns:
            model(states, prev_actions, prev_rewards)
        patterns[UNIFORM_BASELINE] = uniform_causal_pattern(*states.shape)
        return scores_by_site(patterns, score)

    def repeated(window: dict[str, torch.Tensor]) -> tuple[torch.Tensor, ...]:
        return tuple(window[name].repeat(1, 2) for name in ("states", "prev_actions", "prev_rewards"))

    episodes = episode_aligned_windows(repeat_len)
    generator = torch.Generator().manual_seed(seed)
    num_states, num_actions = model.config.num_states, model.config.num_actions
    shape = (episodes["states"].shape[0], repeat_len)
    random_window = {
        "states": torch.randint(0, num_states, shape, generator=generator),
        "prev_actions": torch.randint(0, num_actions, shape, generator=generator),
        "prev_rewards": torch.randint(0, 2, shape, generator=generator).float(),
    }
    natural = episode_aligned_windows(config.seq_len)
    natural_inputs = (natural["states"], natural["prev_actions"], natural["prev_rewards"])

    def natural_detection(pattern: torch.Tensor) -> dict[str, torch.Tensor]:
        return {name: detection_score(pattern, d) for name, d in detection_patterns(natural["states"]).items()}

    per_step_loss = F.cross_entropy(model(*natural_inputs).transpose(1, 2), natural["actions"], reduction="none")

    def natural_loss() -> float:
        return action_loss(model(*natural_inputs), natural).item()

    return {
        "run_dir": str(run_dir),
        "model": config.model,
        "ngram_sizes": list(model.config.ngram_sizes),
        "episode_length": episode_length,
        "repeat_len": repeat_len,
        "num_windows": int(episodes["states"].shape[0]),
        "repeated_episodes": site_scores(*repeated(episodes), lambda p: repeat_scores(p, repeat_len)),
        "repeated_random": site_scores(*repeated(random_window), lambda p: repeat_scores(p, repeat_len)),
        "natural": {
            "detection_scores": site_scores(*natural_inputs, natural_detection),
            "icl_score": in_context_learning_score(per_step_loss, early=episode_length // 2, late=config.seq_len - 1),
            "action_loss": natural_loss(),
            "head_importance_action_loss": head_ablation_importance(model, natural_loss),
        },
    }


def format_ad_report(report: dict) -> str:
    """Per-site, per-head table of an :func:`ad_report`."""
    episodes = report["repeat_len"] // report["episode_length"]
    lines = [
        f"{report['model']} ({report['run_dir']}): T = {report['repeat_len']} steps ({episodes} episodes), "
        f"{report['num_windows']} windows"
    ]
    groups = "  ".join(f"{title:^17}" for title in ("repeated episodes", "repeated random", "natural (detect)"))
    lines.append(f"{'':<18} {'':>4}  {groups}  {'ablation':>8}")
    lines.append(f"{'site':<18} {'head':>4}  " + "  ".join(["prev   dup   ind "] * 3) + f"  {'d loss':>8}")
    natural = report["natural"]
    for site, scores in report["repeated_episodes"].items():
        for head in range(len(scores["induction"])):
            views = [scores, report["repeated_random"][site], natural["detection_scores"][site]]
            cells = "  ".join(
                " ".join(f"{view[name][head]:5.2f}" for name in ("previous_token", "duplicate_token", "induction"))
                for view in views
            )
            importance = natural["head_importance_action_loss"].get(site)
            ablation = "-" if importance is None else f"{importance[head]:+.3f}"
            lines.append(f"{site:<18} {head:>4}  {cells}  {ablation:>8}")
    lines.append(f"action loss {natural['action_loss']:.3f}, ICL score {natural['icl_score']:+.3f}")
    return "\n".join(lines)


# --- command line ----------------------------------------------------------------------------------


def _phase_change_command(args: argparse.Namespace) -> int:
    config = config_from_args(InductionConfig, args)
    report = run_experiment(config, command=args.command_line)
    print(format_seeds_summary(report) if config.seeds else format_summary(report))
    print(f"wrote {Path(args.out_dir) / 'induction.json'} and {Path(args.out_dir) / 'induction.png'}")
    return 0


def _ad_report_command(args: argparse.Namespace) -> int:
    report = ad_report(args.run_dir, repeat_episodes=args.repeat_episodes, num_windows=args.num_windows, seed=args.seed)
    path = Path(args.out) if args.out else Path(args.run_dir) / "induction_heads.json"
    write_json(path, report)
    print(format_ad_report(report))
    print(f"wrote {path}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = make_parser("icrl-induction", __doc__)
    commands = parser.add_subparsers(dest="command")
    phase = commands.add_parser("phase-change", help="the smeared-key / two-layer phase-change experiment (default)")
    add_config_arguments(phase, InductionConfig)
    phase.set_defaults(handler=_phase_change_command)
    ad = commands.add_parser("ad-report", help="induction-head scores of a trained AD / N-Gram AD run")
    ad.add_argument("--run-dir", required=True, help="an icrl-train run folder (config.json, checkpoint.pt)")
    ad.add_argument("--repeat-episodes", type=int, default=2, help="episodes per repeated window (default: 2)")
    ad.add_argument("--num-windows", type=int, default=32, help="windows to average over (default: 32)")
    ad.add_argument("--seed", type=int, default=0, help="(default: 0)")
    ad.add_argument("--out", default=None, help="JSON path (default: RUN_DIR/induction_heads.json)")
    ad.set_defaults(handler=_ad_report_command)
    return parser


@command_line("icrl-induction")
def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    command = command_string("icrl-induction", argv)  # as the user typed it, before the default is inserted
    if not argv or argv[0] not in ("phase-change", "ad-report", "-h", "--help"):
        argv.insert(0, "phase-change")  # the experiment is the default command
    args = build_parser().parse_args(argv)
    args.command_line = command  # (args.command is the subcommand's name)
    return args.handler(args)


if __name__ == "__main__":
    sys.exit(main())
