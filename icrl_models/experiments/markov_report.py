"""The reporting of ``icrl-markov`` (:mod:`icrl_models.experiments.markov_heads`, the protocol): from the runs'
raw results, the summary over seeds (NaN-tolerant), the cue tasks' paired differences, the Markdown tables
and the figures ``markov.png`` and ``markov-memory.png``.

Everything here reads the results list and the report dict that the protocol writes to ``<stem>.json``,
so a report can be redrawn from that file alone.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from ..files import save_figure
from .harness import format_stats, pyplot, seed_stats


def grid_view(report: dict) -> dict:
    """``report`` with only the grid-world tasks' results and summary rows (those without a corridor length)."""
    results = [r for r in report["results"] if r.get("corridor_length") is None]
    summary = {row: by_k for row, by_k in report["summary"].items()
               if next(iter(by_k.values())).get("corridor_length") is None}  # fmt: skip
    return {**report, "results": results, "summary": summary}


def _g(result: dict, key: str = "g_markov_init_heads") -> float:
    """G_Markov summed over the gated layers."""
    return float(sum(result[key].values()))


def nan_tolerant_stats(values) -> dict:
    """:func:`seed_stats` of the finite values, where a NaN (or inf) can legitimately occur (a diverged
    training's loss, gate weights and G_Markov): ``"nan"`` counts the values left out, ``"values"`` keeps
    every value in seed order, and ``"n"`` is the finite count (mean, sd, min and max NaN when it is 0)."""
    array = np.asarray(values, dtype=np.float64).reshape(-1)
    finite = np.isfinite(array)
    if finite.any():
        stats = seed_stats(array[finite])
    else:
        stats = {"mean": math.nan, "std": math.nan, "min": math.nan, "max": math.nan, "n": 0}
    return {**stats, "values": array.tolist(), "nan": int((~finite).sum())}


def _fmt(stats: dict, digits: int = 3) -> str:
    """:func:`format_stats`, with the values a NaN left out of the mean counted: ``0.5 ± 0.1 (n=4, 1 NaN)``."""
    bad = stats.get("nan", 0)
    if stats["n"] == 0:
        return f"NaN (n=0, {bad} NaN)"
    text = format_stats(stats, digits)
    return f"{text[:-1]}, {bad} NaN)" if bad else text


def _nan_mean(rows) -> list:
    """The mean over seeds of per-seed lists, NaN entries left out (NaN where every seed's is)."""
    array = np.asarray(rows, dtype=np.float64)
    finite = np.isfinite(array)
    counts = finite.sum(axis=0)
    sums = np.where(finite, array, 0.0).sum(axis=0)
    return np.where(counts > 0, sums / np.maximum(counts, 1), math.nan).tolist()


def summarize(results: list[dict]) -> dict:
    """Per row (the task, or ``<task>_C<C>`` for a cue task) and ``k``: mean, standard deviation (over seeds)
    and per-seed values of the headline numbers. NaN-tolerant (:func:`nan_tolerant_stats`): a diverged run
    is counted, not fatal."""
    summary: dict = {}
    stats = nan_tolerant_stats
    for key in dict.fromkeys((r.get("row", r["task"]), r["k"]) for r in results):
        group = [r for r in results if (r.get("row", r["task"]), r["k"]) == key]
        first = group[0]
        gates = {layer: _nan_mean([r["gate_weights_all_tokens"][layer] for r in group])
                 for layer in first["gate_weights_all_tokens"]}  # fmt: skip
        cue = {}
        if first.get("corridor_length") is not None:
            cue = {name: stats([r[name] for r in group])
                   for name in ("success_rate", "success_rate_data", "success_rate_random")}  # fmt: skip
        summary.setdefault(key[0], {})[str(key[1])] = {
            "task": first["task"],
            "label": first.get("label", first["task"]),
            "corridor_length": first.get("corridor_length"),
            "memory_need": first.get("memory_need"),
            "horizon": first["horizon"],
            "seeds": [r["seed"] for r in group],
            "g_markov_at_init": stats([sum(r["g_markov_at_init"].values()) for r in group]),
            "g_markov": stats([_g(r) for r in group]),
            "g_markov_state_tokens": stats([_g(r, "g_markov_init_heads_state_tokens") for r in group]),
            "g_markov_final_heads": stats([_g(r, "g_markov_final_heads") for r in group]),
            "gate_weights_all_tokens_mean": gates,
            "head_importance_mean": np.asarray(_nan_mean([np.ravel(r["head_importance"]) for r in group]))
            .reshape(np.shape(first["head_importance"]))
            .tolist(),
            "markov_heads_still_markov": [
                r["markov_after"]["markov_heads"] == r["markov_before"]["markov_heads"] for r in group
            ],  # fmt: skip
            **{f"return_{name}": stats([r["returns"][name] for r in group]) for name in first["returns"]},
            **cue,
            "held_out_loss": stats([r["held_out_loss"] for r in group]),
            "train_seconds": stats([r["train_seconds"] for r in group]),
        }
    return summary


#: The G_Markov numbers compared between the cue tasks: summary name -> result key.
PAIRED_METRICS = {"g_markov": "g_markov_init_heads", "g_markov_state_tokens": "g_markov_init_heads_state_tokens"}


def paired_differences(results: list[dict], metric: str = "g_markov") -> list[dict]:
    """``cue_visible`` minus ``cue_hidden`` G_Markov, seed by seed, per corridor length and ``k``.

    Both tasks of a seed and corridor length start from the same backbone and train on the same
    trajectories, so the per-seed difference removes the variation between initialisations and datasets.
    ``metric``: ``"g_markov"`` (all tokens) or ``"g_markov_state_tokens"``. One dict per ``(C, k)`` run by
    both tasks, in run order: ``corridor_length``, ``k``, ``seeds`` (run by both), ``differences`` (per
    seed), ``stats`` (:func:`nan_tolerant_stats` of them) and ``paper_sign``, how many differences are
    positive (the paper's short-term G_Markov above the long-term one).
    """
    key = PAIRED_METRICS[metric]
    by_point: dict = {}
    for r in results:
        if r.get("corridor_length") is not None:
            by_point.setdefault((r["corridor_length"], r["k"]), {}).setdefault(r["task"], {})[r["seed"]] = _g(r, key)
    pairs = []
    for (corridor_length, k), tasks in by_point.items():
        visible, hidden = tasks.get("cue_visible", {}), tasks.get("cue_hidden", {})
        seeds = [seed for seed in visible if seed in hidden]
        if not seeds:
            continue
        differences = [visible[seed] - hidden[seed] for seed in seeds]
        pairs.append({"corridor_length": corridor_length, "k": k, "seeds": seeds, "differences": differences,
                      "stats": nan_tolerant_stats(differences),
                      "paper_sign": int(sum(d > 0 for d in differences))})  # fmt: skip
    return pairs


def memory_pairs(results: list[dict]) -> list[dict]:
    """:func:`paired_differences` for both metrics, merged per ``(C, k)``: the report's ``"memory_pairs"``."""
    merged: dict = {}
    for metric in PAIRED_METRICS:
        for pair in paired_differences(results, metric):
            entry = merged.setdefault((pair["corridor_length"], pair["k"]), {
                "corridor_length": pair["corridor_length"], "k": pair["k"], "seeds": pair["seeds"]})  # fmt: skip
            entry[metric] = {"differences": pair["differences"], **pair["stats"], "paper_sign": pair["paper_sign"]}
    return list(merged.values())


def _paired_lines(summary: dict, k: str) -> list[str]:
    """Short-term minus long-term G_Markov per seed: both tasks start from the same backbone in a seed,
    so the paired difference removes the (large) variation between initialisations."""
    short = [task for task, by_k in summary.items() if by_k[k]["horizon"] == "short-term"]
    long = [task for task, by_k in summary.items() if by_k[k]["horizon"] == "long-term"]
    if not short or not long or len(summary[short[0]][k]["seeds"]) < 2:
        return []
    lines = ["", "Paired by seed (same backbone), G_Markov trained of the short-term task minus the long-term one:"]
    for name in ("g_markov", "g_markov_state_tokens"):
        where = "all tokens" if name == "g_markov" else "state tokens"
        for task in long:
            diff = np.subtract(summary[short[0]][k][name]["values"], summary[task][k][name]["values"])
            per_seed = [round(float(v), 3) for v in diff]
            lines.append(f"- {short[0]} - {task} ({where}): per seed {per_seed}, mean {_fmt(nan_tolerant_stats(diff))}")
    return lines


def _head_table(rows: list[tuple[str, str, list[str]]], heads: int) -> list[str]:
    lines = ["| task | layer | " + " | ".join(f"head {h}" for h in range(heads)) + " |", "|---|---|" + "---|" * heads]
    return lines + [f"| {task} | {layer} | " + " | ".join(cells) + " |" for task, layer, cells in rows]


def _listed(values) -> str:
    """A list field of a report's config as the tables show it: ``0,1``."""
    return ",".join(str(value) for value in values)


def run_times(report: dict) -> str:
    """The invocation's wall and CPU time, and the runs' own CPU time as each run recorded it when it trained
    (an invocation that reuses finished runs costs little itself; runs from before the record say so)."""
    results = report["results"]
    recorded = [r["cpu_seconds"] for r in results if "cpu_seconds" in r]
    runs = (
        f"the {len(results)} runs' own CPU time, recorded when each trained: {sum(recorded):.0f} s"
        if len(recorded) == len(results)
        else f"{len(results) - len(recorded)} of the {len(results)} runs trained before runs recorded their CPU time"
        + (f" (the other {len(recorded)}: {sum(recorded):.0f} s)" if recorded else "")
    )
    return (
        f"This invocation: wall time {report['wall_seconds']:.0f} s, process CPU time {report['cpu_seconds']:.0f} s "
        f"({report['device']}, {report['torch_threads']} torch threads); {runs}."
    )


def format_tables(report: dict) -> str:
    """Markdown: for the grid-world tasks, returns and G_Markov per task (mean ± sd over seeds), gate weight,
    importance and Markov ratio per head, and G_Markov against k when several k were run; for the cue
    tasks, G_Markov against memory need and against k with the paired differences (:func:`memory_tables`)."""
    config, results = report["config"], report["results"]
    model = report["model_config"]
    seeds = list(dict.fromkeys(r["seed"] for r in results))
    backbone = (f"GPT-2 weights from {config['gpt2']}" if config["gpt2"]
                else f"Markov-initialised heads {_listed(config['markov_heads'])} of layer 0")  # fmt: skip
    lines = [
        f"# Markov heads and MoA weights, short- vs long-term tasks (preset {config['preset']})",
        "",
        f"Model: {model['n_layer']} layers x {model['n_head']} heads x {model['n_embd']}, MoA ({config['gate']}) "
        f"in layers {_listed(config['moa_layers'])}; {backbone}; {config['steps']} steps per run; seeds {seeds} "
        f"(mean ± sd over seeds). {run_times(report)}",
    ]
    grid = grid_view(report)
    if grid["results"]:
        lines += _grid_tables(grid)
    if len(grid["results"]) < len(results):
        lines += memory_tables(report)
    nan = sum(stats.get("nan", 0) for by_k in report["summary"].values() for s in by_k.values()
              for stats in s.values() if isinstance(stats, dict))  # fmt: skip
    if nan:
        lines += ["", f"NaN: {nan} per-seed numbers came out NaN (a diverged training: its loss, gate weights and "
                  "G_Markov); each mean ± sd leaves them out and says so (`1 NaN`); the JSON keeps them "
                  "under \"values\" and the raw \"results\"."]  # fmt: skip
    return "\n".join(lines)


def _grid_tables(report: dict) -> list[str]:
    """The grid-world tasks' tables (``report`` holds only their results and summary rows)."""
    results, summary = report["results"], report["summary"]
    model = report["model_config"]
    first_k = min(r["k"] for r in results)
    tasks = list(summary)
    seeds = summary[tasks[0]][str(first_k)]["seeds"]
    lines = [
        "",
        f"## Returns and G_Markov (k = {first_k})",
        "",
        "G_Markov: the summed MoA weight of the heads that were Markov at initialisation, averaged over "
        "every token (or the state tokens, where the action is read) of held-out windows.",
        "",
        "| task | horizon | model return | data mean | data last 10% | random | optimal | held-out loss | "
        "G_Markov init | G_Markov trained | G_Markov trained (state tokens) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for task in tasks:
        s = summary[task][str(first_k)]
        returns = [_fmt(s[f"return_{name}"], 2) for name in ("model", "data_mean", "data_last_tenth",
                                                              "random", "optimal")]  # fmt: skip
        losses_and_g = [_fmt(s[name]) for name in ("held_out_loss", "g_markov_at_init", "g_markov",
                                                   "g_markov_state_tokens")]  # fmt: skip
        lines.append(f"| {task} | {s['horizon']} | " + " | ".join(returns + losses_and_g) + " |")
    lines += [
        "",
        "Per seed, G_Markov trained: "
        + "; ".join(
            f"{task} {[round(v, 3) for v in summary[task][str(first_k)]['g_markov']['values']]}" for task in tasks
        ),
    ]
    lines += _paired_lines(summary, str(first_k))
    heads = model["n_head"]
    markov_before = {tuple(pair) for pair in results[0]["markov_before"]["markov_heads"]}
    rows = []
    for task in tasks:
        for layer, weights in summary[task][str(first_k)]["gate_weights_all_tokens_mean"].items():
            rows.append((task, layer, [f"{w:.3f}{' (M)' if (f'blocks.{layer}.attn', h) in markov_before else ''}"
                                       for h, w in enumerate(weights)]))  # fmt: skip
    lines += ["", f"## MoA weight per head after training (all tokens, k = {first_k}, mean over seeds)", ""]
    lines += _head_table(rows, heads) + ["", "(M): a Markov head at initialisation."]
    rows = [
        (task, str(layer), [f"{v:.4f}" for v in row])
        for task in tasks
        for layer, row in enumerate(summary[task][str(first_k)]["head_importance_mean"])
    ]
    lines += ["", "## Head importance (zero-ablation, mean over held-out steps of ||a - a_-i||_2, mean over seeds)", ""]
    lines += _head_table(rows, heads)
    first_seed = [r for r in results if r["k"] == first_k and r["seed"] == seeds[0]]
    rows = []
    for r in first_seed:
        before, after = r["markov_before"], r["markov_after"]
        for layer, (ratios_before, ratios_after) in enumerate(zip(before["ratio"], after["ratio"])):
            flags = after["diagonal_positive"][layer]
            rows.append((r["task"], str(layer), [f"{b:.2f} -> {a:.2f}{'' if ok else ' (diag<=0)'}"
                                                 for b, a, ok in zip(ratios_before, ratios_after, flags)]))  # fmt: skip
    lines += ["", f"## Markov ratio before -> after training (Definition 4.1, r = {first_seed[0]['r']:.2f}, "
              f"seed {seeds[0]})", ""]  # fmt: skip
    lines += _head_table(rows, heads)
    kept = {task: summary[task][str(first_k)]["markov_heads_still_markov"] for task in tasks}
    lines += ["", "Heads Markov at initialisation still Markov after training (per seed): "
              + "; ".join(f"{task} {flags}" for task, flags in kept.items())]  # fmt: skip
    ks = sorted({r["k"] for r in results})
    if len(ks) > 1:
        lines += ["", "## G_Markov against context length k (R_Markov: relative to the smallest k)", ""]
        lines += ["| k | " + " | ".join(f"{t} return | {t} G_Markov | {t} R_Markov" for t in tasks) + " |",
                  "|---|" + "---|---|---|" * len(tasks)]  # fmt: skip
        for k in ks:
            cells = []
            for task in tasks:
                s, base = summary[task][str(k)], summary[task][str(ks[0])]["g_markov"]["mean"]
                ratio = s["g_markov"]["mean"] / base if base else math.nan
                model_return, g = _fmt(s["return_model"], 2), _fmt(s["g_markov"])
                cells.append(f"{model_return} | {g} | {100 * ratio:.1f}%")
            lines.append(f"| {k} | " + " | ".join(cells) + " |")
    return lines


def _cue_axes(results: list[dict]) -> tuple[dict, dict, list[str]]:
    """The cue runs' two axes: ``{k: corridor lengths}`` of each memory-need table (each k run at several
    corridor lengths; every k when no axis has two points), ``{C: ks}`` of each k table (each corridor length
    run at several k), and the cue tasks that ran."""
    cs_by_k: dict = {}
    ks_by_c: dict = {}
    for r in results:
        if r.get("corridor_length") is not None:
            cs_by_k.setdefault(r["k"], set()).add(r["corridor_length"])
            ks_by_c.setdefault(r["corridor_length"], set()).add(r["k"])
    memory_axes = {k: sorted(cs) for k, cs in sorted(cs_by_k.items()) if len(cs) > 1}
    k_axes = {c: sorted(ks) for c, ks in sorted(ks_by_c.items()) if len(ks) > 1}
    if not memory_axes and not k_axes:
        memory_axes = {k: sorted(cs) for k, cs in sorted(cs_by_k.items())}
    tasks = [task for task in ("cue_visible", "cue_hidden") if any(r["task"] == task for r in results)]
    return memory_axes, k_axes, tasks


def memory_tables(report: dict) -> list[str]:
    """The cue tasks' tables: per memory-need axis (one ``k``) and per k axis (one corridor length), G_Markov
    (all tokens, state tokens) and success per (task, C, k), then the paired differences visible - hidden."""
    summary, results = report["summary"], report["results"]
    pairs = {(p["corridor_length"], p["k"]): p for p in report["memory_pairs"]}
    memory_axes, k_axes, tasks = _cue_axes(results)
    lines = [
        "",
        "## Cue Corridor: G_Markov against memory need and context length",
        "",
        "cue_visible shows the cue on every step (memory need 0), cue_hidden on the first step only (memory need "
        "C, the corridor length); episodes last C + 4 steps, the optimal one C + 1, and a DT window never leaves "
        "its episode. G_Markov: the summed MoA weight of the heads Markov at initialisation, over all tokens and "
        "over the state tokens (where the action is read) of held-out windows. Success: the fraction of episodes "
        "ending on the cued end (the trained policy with target return 1; the data; a random policy). "
        "Visible - hidden: per seed (same backbone, same trajectories), mean ± sd, and how many seeds have the "
        "paper's sign (> 0: more Markov-head weight on the short-term task).",
    ]
    for k, corridors in memory_axes.items():
        lines += ["", f"### Against memory need (k = {k})", ""]
        lines += _cue_table(summary, [(task, c, k) for c in corridors for task in tasks])
        lines += _pair_table(pairs, [(c, k) for c in corridors])
    for c, ks in k_axes.items():
        lines += ["", f"### Against context length k (C = {c}: the cue is in the context at the junction from "
                  f"k = {c + 1}; an episode lasts at most {c + 4} steps)", ""]  # fmt: skip
        lines += _cue_table(summary, [(task, c, k) for k in ks for task in tasks])
        lines += _pair_table(pairs, [(c, k) for k in ks])
    return lines


def _cue_table(summary: dict, points: list[tuple[str, int, int]]) -> list[str]:
    lines = [
        "| task | C | memory need | k | success (trained) | success (data) | success (random) | held-out loss | "
        "G_Markov init | G_Markov (all tokens) | G_Markov (state tokens) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for task, c, k in points:
        s = summary.get(f"{task}_C{c}", {}).get(str(k))
        if s is None:
            continue
        cells = [_fmt(s[name], 2) for name in ("success_rate", "success_rate_data", "success_rate_random")]
        cells += [_fmt(s[name]) for name in ("held_out_loss", "g_markov_at_init", "g_markov", "g_markov_state_tokens")]
        lines.append(f"| {task} | {c} | {s['memory_need']} | {k} | " + " | ".join(cells) + " |")
    return lines


def _pair_table(pairs: dict, points: list[tuple[int, int]]) -> list[str]:
    rows = [pairs[point] for point in points if point in pairs]
    if not rows:
        return []
    lines = ["", "| C | k | visible - hidden (all tokens) | per seed | paper's sign | visible - hidden (state tokens) "
             "| per seed | paper's sign |", "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for pair in rows:
        cells = []
        for metric in PAIRED_METRICS:
            entry = pair[metric]
            per_seed = ", ".join(f"{d:+.3f}" for d in entry["differences"])
            cells += [_fmt(entry), f"{per_seed}", f"{entry['paper_sign']}/{len(entry['differences'])}"]
        lines.append(f"| {pair['corridor_length']} | {pair['k']} | " + " | ".join(cells) + " |")
    return lines


def plot_memory(report: dict, path: Path) -> None:
    """The cue tasks. Left: G_Markov against memory need (0: cue_visible at each corridor length, side by
    side; C: cue_hidden) at the first memory-need axis's k. Right: G_Markov against k at the first k axis's
    corridor length. All tokens and state tokens; error bars: sample sd over seeds."""
    plt = pyplot()
    summary = report["summary"]
    memory_axes, k_axes, tasks = _cue_axes(report["results"])
    figure, (left, right) = plt.subplots(1, 2, figsize=(11, 4), dpi=120)
    where = {"g_markov": "all tokens", "g_markov_state_tokens": "state tokens"}

    def point(task, c, k, metric):
        s = summary.get(f"{task}_C{c}", {}).get(str(k))
        return (math.nan, math.nan) if s is None else (s[metric]["mean"], s[metric]["std"])

    if memory_axes:
        k, corridors = next(iter(memory_axes.items()))
        for color, metric in zip(("C0", "C1"), where):
            if "cue_hidden" in tasks:
                y, e = zip(*(point("cue_hidden", c, k, metric) for c in corridors))
                left.errorbar(corridors, y, yerr=e, color=color, marker="s", capsize=3,
                              label=f"cue_hidden ({where[metric]})")  # fmt: skip
            if "cue_visible" in tasks:
                # Every cue_visible point has memory need 0: side by side around 0, in corridor order.
                offsets = 0.04 * max(corridors) * (np.arange(len(corridors)) - (len(corridors) - 1) / 2)
                y, e = zip(*(point("cue_visible", c, k, metric) for c in corridors))
                left.errorbar(offsets, y, yerr=e, color=color, marker="o", linestyle="none", mfc="white", capsize=3,
                              label=f"cue_visible, C = {', '.join(map(str, corridors))} ({where[metric]})")  # fmt: skip
                for x, value, c in zip(offsets, y, corridors):
                    left.annotate(f"C={c}", (x, value), textcoords="offset points", xytext=(3, 3), fontsize=6)
        left.set_xticks([0, *corridors])
        left.set_title(f"G_Markov against memory need (k = {k})")
    else:
        left.set_title("G_Markov against memory need: one corridor length only")
    left.set_xlabel("memory need (steps): 0 for cue_visible, C for cue_hidden")
    if k_axes:
        c, ks = next(iter(k_axes.items()))
        for color, metric in zip(("C0", "C1"), where):
            for task, style in (("cue_visible", "--"), ("cue_hidden", "-")):
                if task in tasks:
                    y, e = zip(*(point(task, c, k, metric) for k in ks))
                    right.errorbar(ks, y, yerr=e, color=color, linestyle=style, marker="o", capsize=3,
                                   label=f"{task} ({where[metric]})")  # fmt: skip
        right.axvline(c + 1, color="gray", linestyle=":", linewidth=1, label=f"k = C + 1 = {c + 1}")
        right.set_title(f"G_Markov against context length (C = {c})")
    else:
        right.set_title("G_Markov against context length: one k per corridor length")
    right.set_xlabel("context length k (steps)")
    for axis in (left, right):
        axis.set_ylabel("G_Markov (mean ± sd over seeds)")
        axis.grid(alpha=0.3)
        if axis.get_legend_handles_labels()[0]:
            axis.legend(fontsize=7)
    figure.tight_layout()
    save_figure(figure, path)


def plot_markov(report: dict, path: Path) -> None:
    """Left: MoA weight per head (first gated layer, mean over seeds) per task, Markov heads hatched.
    Right: G_Markov against training steps per task, mean over seeds (the paper's Appendix G)."""
    from matplotlib.patches import Patch

    plt = pyplot()

    results, summary = report["results"], report["summary"]
    first_k = min(r["k"] for r in results)
    tasks = list(summary)
    figure, (left, right) = plt.subplots(1, 2, figsize=(11, 4), dpi=120)
    width = 0.8 / len(tasks)
    markov = {tuple(pair) for pair in results[0]["markov_before"]["markov_heads"]}
    for index, task in enumerate(tasks):
        group = [r for r in results if r["task"] == task and r["k"] == first_k]
        layer = next(iter(group[0]["gate_weights_all_tokens"]))
        weights = np.array([r["gate_weights_all_tokens"][layer] for r in group])
        label = f"{task} ({group[0]['horizon']})"
        x = np.arange(weights.shape[1]) + index * width
        errors = weights.std(axis=0, ddof=1) if len(group) > 1 else None
        bars = left.bar(x, weights.mean(axis=0), width, yerr=errors, capsize=2, label=label)
        for head, bar in enumerate(bars):
            if (f"blocks.{layer}.attn", head) in markov:
                bar.set_hatch("//")
                bar.set_edgecolor("black")
        curves = np.array([[sum(g.values()) for g in r["curve"]["g_markov"]] for r in group])
        (line,) = right.plot(group[0]["curve"]["step"], curves.mean(axis=0), label=label)
        if len(group) > 1:
            spread = curves.std(axis=0, ddof=1)
            right.fill_between(group[0]["curve"]["step"], curves.mean(0) - spread, curves.mean(0) + spread,
                               color=line.get_color(), alpha=0.2)  # fmt: skip
    heads = report["model_config"]["n_head"]
    uniform = left.axhline(1.0 / heads, color="gray", linestyle="--", linewidth=1, label="uniform")
    # Legend swatches without hatching (the first bar of each task is a Markov head's), plus one hatch key.
    handles = [Patch(color=container.patches[0].get_facecolor(), label=container.get_label())
               for container in left.containers if hasattr(container, "patches")]  # fmt: skip
    handles += [Patch(facecolor="white", edgecolor="black", hatch="//", label="Markov head at init"),
                uniform]  # fmt: skip
    left.set_xticks(np.arange(heads) + 0.4 - width / 2, [f"head {h}" for h in range(heads)])
    left.set_ylabel("mean MoA weight (held-out tokens)")
    left.set_title(f"MoA weight per head, k = {first_k} (hatched: Markov at init)")
    right.set_xlabel("training step")
    right.set_ylabel("G_Markov (sum of Markov heads' weights)")
    right.set_title("G_Markov during training (mean ± sd over seeds)")
    for axis in (left, right):
        axis.grid(alpha=0.3)
    left.legend(handles=handles, fontsize=8)
    right.legend(fontsize=8)
    figure.tight_layout()
    save_figure(figure, path)


def format_summary(report: dict) -> str:
    """A plain-text table of the summary (mean ± sd over seeds) and the run's time."""
    lines = [f"{'task':<20} {'k':>3} {'return':>18} {'data':>6} {'random':>6} {'G_init':>7} {'G_trained':>21}"]
    for by_k in report["summary"].values():
        for k, s in by_k.items():
            model_return, g = _fmt(s["return_model"], 2), _fmt(s["g_markov"])
            lines.append(
                f"{s.get('label', s.get('task')):<20} {k:>3} {model_return:>18} {s['return_data_mean']['mean']:>6.2f} "
                f"{s['return_random']['mean']:>6.2f} {s['g_markov_at_init']['mean']:>7.3f} {g:>21}"
            )
    lines.append(f"total {report['wall_seconds']:.0f} s wall, {report['cpu_seconds']:.0f} s CPU")
    return "\n".join(lines)
