"""Turn a pytest-benchmark JSON file into markdown: per op, times, ratios against the targets, roofline.

Usage::

    python benchmarks/summarize.py RESULTS.json [-o TABLE.md]

Reads only the JSON (``extra_info`` recorded by ``benchmarks/conftest.py`` and the bench files), so
it runs anywhere, without torch. Output:

* a header: device, versions, commit, the measured copy bandwidth and matmul peaks;
* a summary of every target with a verdict: how many cases pass and which fail;
* per benchmark section (the first word of the pytest-benchmark group, e.g. ``ngram-fwd-bwd``; the
  op's name when there is no group), two tables with one row per shape (every ``extra_info`` entry
  that is not a measurement, a run description or the backend):

  1. the median ms per call of every backend, our implementation first (``ours``: the op's own
     kernel; where there are several, e.g. the two n-gram algorithms, the faster one, named), then one
     column per peer: ``peer / ours`` (a speedup: above 1 we are faster) or, for an upper-bound target
     such as MoA's, ``ours / peer``, with ``pass`` / ``FAIL`` where the target of :data:`OPS` applies
     to that shape;
  2. the cost model (bytes moved and FLOPs, from ``benchmarks/cost/<op>.py``), the roofline bound
     ``max(bytes / copy bandwidth, FLOPs / matmul peak)`` with the term that binds, our fraction of it
     (``bound / time``) against the op's roofline target (time at most 1.5x the bound, i.e. >= 67%; n-gram
     attention >= 50%), judged on the CUDA-graph replay of our call (backend ``<ours>+graph``) where it
     was measured, and the peak memory of every backend (CUDA only). Where a replay was measured, the
     first table also gives the eager call's host overhead: its time minus the replay's.

  Sections whose rows vary ``L`` also get crossover lines: per backend, the smallest ``L`` from which
  it stays faster than ``reference`` at every longer measured ``L``.

The backend of a benchmark is ``extra_info["backend"]`` (``"implementation"`` or ``"variant"`` in JSON
files written before those keys were made uniform). CPU entries have no roofline (no bandwidth or peak
is measured there), so a CPU run (e.g. ``-m headline`` as a rehearsal) prints ratios only.

L2: inputs are not rotated between timed calls, so a case whose bytes fit in L2 (50 MB on an H100) can
beat the copy bandwidth; a fraction above 100% is printed as "L2-resident, not a roofline" (or, when
the FLOPs bind, "above the measured matmul peak") with no verdict, and cases whose bytes fit in the
recorded ``l2_cache_bytes`` are marked "(fits L2)".

Headline run (``pytest benchmarks -m headline``): 58 cases on CUDA, of which 53-56 run (the
materialising InfoNCE baselines skip at A = 1M, Liger wherever ``liger_kernel`` is not installed):
n-gram 14 (2 shapes x 7 backends), InfoNCE 12, select_actions 4, MoA layer 8, the mixture_of_heads /
inject_layer_norm / smeared_keys kernels 1 each, looped block 8, model training steps 9. Estimated 4-6
minutes on an H100, not yet measured (no GPU was available when this was written); the estimate adds
up: ~70 s of timed calls (``ICRL_BENCH_SECONDS`` = 1 s of rounds per case plus the warm-up and sizing
calls, ~1.2 s a case); ~2-3 min of ``torch.compile`` (FlexAttention forward + backward and its block
mask, for one or both n-gram shapes, which differ only in the mask; the InfoNCE baseline at two shapes;
the looped step with and without autograd: typically 20-40 s each); ~1 min of Triton compilation and
autotuning (1-2 s per specialisation and config); ~10 s for the A = 1M InfoNCE calls (~2e14 FLOPs,
0.3-1 s each, about 5 calls per backend); ~20 s of start-up, collection and the ceilings (1 GiB copy,
8192^3 matmuls). Slow compiles could push it to ~7 min. On a CPU smoke run ``-m headline`` selects 50
cases (36 run, ~45 s with ``TRITON_INTERPRET=1`` and ``ICRL_BENCH_SECONDS=0.001`` on a 2-core VM).
"""

from __future__ import annotations

import argparse
import json
import math
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

REFERENCE = "reference"

#: ``extra_info`` keys that name the backend, newest first (older JSON files used the later ones).
BACKEND_KEYS = ("backend", "implementation", "variant")

# extra_info entries that describe the run or the measurement rather than the shape.
NOT_SHAPE = {
    "op",
    *BACKEND_KEYS,
    "shape",
    "device",
    "device_type",
    "torch",
    "triton",
    "bytes_moved",
    "flops",
    "bytes_per_second",
    "flops_per_second",
    "peak_memory_bytes",
    "copy_bytes_per_second",
    "matmul_flops_per_second",
    "matmul_flops_per_second_fp32",
    "roofline_flops_per_second",
    "roofline_seconds",
    "roofline_bound",
    "roofline_fraction",
    "l2_cache_bytes",
    "steps_per_second",
    "run_steps_per_second",
    "run_steps_per_round",
    "env_steps_per_second",
    "transitions",
    "transitions_per_second",
    "index_build_seconds",
    "device_busy_seconds",
    "launches_per_call",
    "top_kernels",
    "profile_error",
    "autotune",
    "input_bytes",
    "grad_bytes",
    "algorithm",
    "predicted_peak_over_inputs_bytes",
}

#: The roofline target of every op: measured time at most this many times the roofline bound.
ROOFLINE_MAX_SLOWDOWN = 1.5


@dataclass(frozen=True)
class Target:
    """A peer ratio target. ``kind="speedup"``: ``t_peer / t_ours >= threshold``; ``kind="at_most"``:
    ``t_ours / t_peer <= threshold``. It applies to the rows whose shape fields satisfy ``when``."""

    peer: str
    kind: str
    threshold: float
    when: Callable[[dict], bool] = lambda fields: True
    when_text: str = ""

    def label(self) -> str:
        where = f" at {self.when_text}" if self.when_text else ""
        if self.kind == "speedup":
            return f"{self.peer} / ours (target >= {self.threshold:g}x{where})"
        return f"ours / {self.peer} (target <= {self.threshold:g}{where})"

    def ratio(self, ours: float, peer: float) -> float:
        return peer / ours if self.kind == "speedup" else ours / peer

    def passed(self, ratio: float) -> bool:
        return ratio >= self.threshold if self.kind == "speedup" else ratio <= self.threshold


#: The backend-name suffix of a benchmark that times CUDA-graph replays of our call (``conftest.timed(graphed=True)``):
#: the device time without the host's, on which roofline targets are judged.
GRAPH_SUFFIX = "+graph"


@dataclass(frozen=True)
class OpSpec:
    """How to read one op's benchmarks: our backend(s) per device type, the peers, the targets.

    Ratio targets compare our eager call (``ours``). The roofline target (``roofline_min``, a fraction of the
    bound) is judged on the graph replay of our call (``<ours>+graph``) where it was measured, else on the
    eager call; the difference of the two is the call's host overhead."""

    title: str
    ours: dict[str, tuple[str, ...]]
    targets: tuple[Target, ...] = ()
    peers: tuple[str, ...] = ()
    roofline_target: bool = True
    roofline_min: float = 1 / ROOFLINE_MAX_SLOWDOWN

    def candidates(self, device_type: str) -> tuple[str, ...]:
        return self.ours.get(device_type) or self.ours.get("cpu", ())

    def roofline_label(self, replay: bool) -> str:
        what = "graph replay" if replay else "eager call"
        return f"roofline of the {what} (target >= {100 * self.roofline_min:.0f}%)"


def _field_at_least(name: str, value: float) -> Callable[[dict], bool]:
    return lambda fields: fields.get(name, 0) >= value


def _field_equals(name: str, value: float) -> Callable[[dict], bool]:
    return lambda fields: fields.get(name) == value


def _cpu_sweep(size: str) -> Callable[[dict], bool]:
    """bench_sweep's CPU cases of ``size`` at K = 4 (results recorded before sizes existed were ``tiny``)."""
    return lambda fields: fields.get("runs") == 4 and fields.get("size", "tiny") == size


# The targets of docs/performance.md#targets and the GPU bring-up issue, per op. Speedups are t_peer / t_ours.
# On the CPU our implementation is the eager one that backend="auto" runs there (the Triton kernels
# only run under the interpreter); where a CPU run measured only the kernel, that is ours.
_KERNEL_OURS = {"cuda": ("triton",), "cpu": ("eager", "triton")}
OPS: dict[str, OpSpec] = {
    "ngram_attention": OpSpec(
        "n-gram attention, forward + backward",
        ours={"cuda": ("triton-sort", "triton-tiled"), "cpu": ("eager", "triton-sort", "triton-tiled")},
        targets=(
            Target(REFERENCE, "speedup", 10, _field_at_least("L", 4096), "L >= 4096"),
            Target("reference-tf32", "speedup", 10, _field_at_least("L", 4096), "L >= 4096"),
            Target("flex", "speedup", 1, _field_at_least("vocab", 10_000), "vocab >= 10^4"),
            Target("flex+mask", "speedup", 1, _field_at_least("vocab", 10_000), "vocab >= 10^4"),
        ),
        roofline_min=0.5,
    ),
    "infonce_loss": OpSpec(
        "InfoNCE, forward + backward",
        ours={"cuda": ("fused",), "cpu": ("fused",)},
        targets=(  # issue 42 (the eager call, ours "fused": the public function, its algorithm chosen by A)
            Target(REFERENCE, "speedup", 4.5, _field_equals("A", 4096), "A = 4096"),
            Target(REFERENCE, "speedup", 1.5, _field_equals("A", 125), "A = 125"),
            Target("compile", "speedup", 1.4, _field_equals("A", 4096), "A = 4096"),
            Target("liger", "speedup", 2, _field_equals("A", 4096), "A = 4096"),
            Target("liger", "speedup", 1.3, _field_equals("A", 1_000_000), "A = 1M"),
        ),
    ),
    "select_actions": OpSpec(
        # Sampling against matmul + softmax + multinomial; the argmax target (fused-argmax >= 1x "argmax")
        # is read from the two columns beside it.
        "select_actions (no gradient)",
        ours={"cuda": ("fused-sample",), "cpu": ("fused-sample",)},
        targets=(Target(REFERENCE, "speedup", 3),),
        peers=("fused-argmax", "argmax"),
    ),
    "gated_attention": OpSpec(
        "gated causal attention (gate epilogue, smeared-key prologue), forward + backward",
        ours=_KERNEL_OURS,
        peers=("separate", "compile", REFERENCE),
    ),
    "moa_attention": OpSpec(
        "MoA attention layer, forward + backward",
        ours=_KERNEL_OURS,
        targets=(Target("ungated", "at_most", 1.1),),
        peers=("eager", REFERENCE),
    ),
    "mixture_of_heads": OpSpec("mixture_of_heads op, forward + backward", ours=_KERNEL_OURS),
    "inject_layer_norm": OpSpec("inject_layer_norm, forward + backward", ours=_KERNEL_OURS),
    "smeared_keys": OpSpec("smeared_keys, forward + backward", ours=_KERNEL_OURS),
    "looped_block_train": OpSpec(
        "looped block, training step",
        ours={"cuda": ("fused+graph", "fused-graph", "fused"), "cpu": ("fused",)},
        targets=(Target("eager", "speedup", 5),),
    ),
    "looped_block_inference": OpSpec(
        "looped block, inference loops",
        ours={"cuda": ("fused-graph", "fused-graph-c1", "fused"), "cpu": ("fused",)},
        targets=(Target("eager", "speedup", 5, _field_at_least("loops", 500), "500 loops"),),
    ),
    "looped_model_train_step": OpSpec(
        "looped model, whole training step",
        ours={"cuda": ("graph-step", "compile-ro", "fused"), "cpu": ("fused",)},
        targets=(Target("eager", "speedup", 5),),
    ),
    "ad_train_step": OpSpec(
        "AD / N-Gram AD / Headless-AD training step",
        ours={"cuda": ("auto+graph", "auto"), "cpu": ("auto",)},
        targets=(
            Target(REFERENCE, "speedup", 2, _field_at_least("d_model", 512), "width 512"),
            Target("reference+compile", "speedup", 1.2, _field_at_least("d_model", 512), "width 512"),
        ),
        roofline_target=False,
    ),
    "dt_moa_train_step": OpSpec(
        "DT with MoA training step",
        ours={"cuda": ("moa+graph", "moa-fused+graph", "moa", "moa-fused"), "cpu": ("moa", "moa-fused")},
        peers=("moa-reference", "ungated", "ungated+graph"),
        roofline_target=False,
    ),
    "ad_eval_step": OpSpec(
        "AD in-context evaluation step", ours={"cpu": ("incremental",)}, peers=("recompute",), roofline_target=False
    ),
    # Issues 44, 54: the median is one training step of one run (bench_sweep.py); K = 64 on a GPU, K = 4 on the CPU
    # (every family, tiny and preset sizes).
    "sweep_step": OpSpec(
        "sweep: one training step of one run, batched runs against runs one at a time and worker processes",
        ours={"cuda": ("batched",), "cpu": ("batched",)},
        targets=(
            Target("single", "speedup", 20, _field_at_least("runs", 64), "K = 64"),
            Target("processes", "speedup", 3, _field_at_least("runs", 64), "K = 64"),
            Target("single", "speedup", 1.5, _cpu_sweep("tiny"), "K = 4 (CPU, tiny)"),
            Target("single", "speedup", 1.0, _cpu_sweep("preset"), "K = 4 (CPU, a family's preset size)"),
        ),
        roofline_target=False,
    ),
}


@dataclass
class Row:
    """One shape of one section: the benchmark entry of every backend measured there."""

    fields: dict
    entries: dict[str, dict] = field(default_factory=dict)

    def median(self, backend: str) -> float | None:
        entry = self.entries.get(backend)
        return None if entry is None else entry["stats"]["median"]

    def info(self, backend: str) -> dict:
        return self.entries.get(backend, {}).get("extra_info", {})

    @property
    def device_type(self) -> str:
        infos = [entry["extra_info"] for entry in self.entries.values()]
        for info in infos:
            if "device_type" in info:
                return info["device_type"]
        return "cuda" if any("copy_bytes_per_second" in info for info in infos) else "cpu"

    def any_info(self, key: str):
        return next((e["extra_info"][key] for e in self.entries.values() if e["extra_info"].get(key) is not None), None)


@dataclass
class Section:
    name: str
    op: str | None
    rows: dict[tuple, Row] = field(default_factory=dict)

    @property
    def spec(self) -> OpSpec | None:
        return OPS.get(self.op)

    def backends(self) -> list[str]:
        return sorted({b for row in self.rows.values() for b in row.entries}, key=self._backend_order)

    def _backend_order(self, name: str) -> tuple[int, str]:
        spec = self.spec
        order = [] if spec is None else [*spec.ours.get("cuda", ()), *spec.ours.get("cpu", ())]
        order = [name for backend in order for name in (backend, backend + GRAPH_SUFFIX)]  # a replay beside its call
        if spec is not None:
            order += [t.peer for t in spec.targets] + list(spec.peers)
        order += [REFERENCE]
        return (order.index(name) if name in order else len(order), name)

    def ours(self, row: Row) -> str | None:
        """Our backend in ``row``: the fastest measured of the spec's candidates for the row's device
        (e.g. whichever n-gram algorithm wins at that length, as ``algorithm="auto"`` should pick)."""
        if self.spec is None:
            return None
        measured = [b for b in self.spec.candidates(row.device_type) if row.median(b) is not None]
        return min(measured, key=row.median) if measured else None

    def replay(self, row: Row) -> str | None:
        """The CUDA-graph replay of our call in ``row``: the fastest measured ``<candidate>+graph`` (or ours
        itself when it is a replay); ``None`` when none was measured."""
        ours = self.ours(row)
        if ours is None:
            return None
        if ours.endswith(GRAPH_SUFFIX):
            return ours
        measured = [
            b + GRAPH_SUFFIX for b in self.spec.candidates(row.device_type) if row.median(b + GRAPH_SUFFIX) is not None
        ]
        return min(measured, key=row.median) if measured else None

    def is_replay_of_ours(self, backend: str) -> bool:
        """A ``+graph`` variant of one of our candidates (its time is reported as our host overhead, not as a peer)."""
        if self.spec is None or not backend.endswith(GRAPH_SUFFIX):
            return False
        base = backend.removesuffix(GRAPH_SUFFIX)
        return any(base in names for names in self.spec.ours.values())


@dataclass(frozen=True)
class Verdict:
    """The outcome of one target on one row: ``value`` is the ratio (or roofline fraction)."""

    section: str
    op: str
    target: str
    shape: str
    value: float
    passed: bool


def load(path: Path) -> dict:
    with open(path) as handle:
        return json.load(handle)


def merge(paths: list[Path]) -> dict:
    """Several ``--benchmark-json`` files of one session as one: the first file's run information
    (machine, commit, date) and every file's benchmarks, in order."""
    runs = [load(path) for path in paths]
    return {**runs[0], "benchmarks": [bench for run in runs for bench in run["benchmarks"]]}


def backend_of(bench: dict) -> str:
    info = bench.get("extra_info", {})
    return next((str(info[key]) for key in BACKEND_KEYS if key in info), "-")


def _hashable(value):
    return tuple(value) if isinstance(value, list) else value


def sections(data: dict) -> dict[str, Section]:
    """Benchmarks grouped into sections (group's first word) and rows (shape fields); sections in the
    order of :data:`OPS`, then the others by name."""
    result: dict[str, Section] = {}
    for bench in data["benchmarks"]:
        if not bench.get("stats"):
            continue  # --benchmark-disable: nothing was timed
        info = bench.get("extra_info", {})
        group = bench.get("group")
        name = group.split(" ")[0] if group else info.get("op") or bench["name"].split("[")[0]
        section = result.setdefault(name, Section(name, info.get("op")))
        fields = {k: v for k, v in info.items() if k not in NOT_SHAPE}
        key = tuple((k, _hashable(v)) for k, v in fields.items())
        section.rows.setdefault(key, Row(fields)).entries[backend_of(bench)] = bench
    order = list(OPS)
    return dict(
        sorted(
            result.items(), key=lambda item: (order.index(item[1].op) if item[1].op in order else len(order), item[0])
        )
    )


def roofline_fraction(info: dict, median: float) -> float | None:
    """``bound / time`` from the recorded bytes, FLOPs and ceilings (``None`` on CPU entries)."""
    bound = roofline_seconds(info)
    return None if bound is None else bound / median


def roofline_seconds(info: dict) -> float | None:
    bandwidth = info.get("copy_bytes_per_second")
    if not bandwidth or "bytes_moved" not in info:
        return None
    peak = info.get("roofline_flops_per_second") or info.get("matmul_flops_per_second")
    compute = info.get("flops", 0) / peak if peak else 0.0
    return max(info["bytes_moved"] / bandwidth, compute)


def roofline_term(info: dict) -> str | None:
    if "roofline_bound" in info:
        return info["roofline_bound"]
    bandwidth = info.get("copy_bytes_per_second")
    peak = info.get("roofline_flops_per_second") or info.get("matmul_flops_per_second")
    if not bandwidth or "bytes_moved" not in info:
        return None
    return "flops" if peak and info.get("flops", 0) / peak > info["bytes_moved"] / bandwidth else "bytes"


def _shape_text(row: Row) -> str:
    return ", ".join(f"{k}={v}" for k, v in row.fields.items())


def judged(row: Row) -> bool:
    """Targets are GPU targets (docs/performance.md#targets): CPU rows (smoke runs, rehearsals) get ratios only."""
    return row.device_type == "cuda"


def evaluate(section: Section) -> list[Verdict]:
    """Every target's verdict on every CUDA row of ``section`` where it applies and both sides were measured."""
    spec = section.spec
    if spec is None:
        return []
    verdicts = []
    for row in section.rows.values():
        ours = section.ours(row)
        if ours is None or not judged(row):
            continue
        t_ours = row.median(ours)
        for target in spec.targets:
            t_peer = row.median(target.peer)
            if t_peer is None or not target.when(row.fields):
                continue
            ratio = target.ratio(t_ours, t_peer)
            verdicts.append(Verdict(section.name, section.op, target.label(), _shape_text(row), ratio,
                                    target.passed(ratio)))  # fmt: skip
        replay = section.replay(row)
        judged_backend = replay or ours
        fraction = (
            roofline_fraction(row.info(judged_backend), row.median(judged_backend)) if spec.roofline_target else None
        )
        if fraction is not None and fraction <= 1:  # above 1: not a roofline measurement (L2), no verdict
            verdicts.append(Verdict(section.name, section.op, spec.roofline_label(replay is not None),
                                    _shape_text(row), fraction, fraction >= spec.roofline_min))  # fmt: skip
    return verdicts


# -- formatting ------------------------------------------------------------------------------------


def _fmt_ms(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    ms = seconds * 1e3
    return f"{ms:.3g}" if ms < 100 else f"{ms:.0f}"


def _fmt_ratio(value: float | None) -> str:
    if value is None:
        return "-"
    if value >= 100:
        return f"{value:.0f}"
    return f"{value:.2f}" if value >= 0.1 else f"{value:.2g}"


def _fmt_si(value: float | None, unit: str) -> str:
    if value is None:
        return "-"
    for scale, prefix in ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(value) >= scale:
            return f"{value / scale:.3g} {prefix}{unit}"
    return f"{value:.3g} {unit}"


def _fmt_memory(value: float | None) -> str:
    if not value:
        return "-"
    return f"{value / 2**30:.3g} GiB" if value >= 2**30 else f"{value / 2**20:.3g} MiB"


def _fmt_value(verdict: Verdict) -> str:
    return f"{100 * verdict.value:.0f}%" if verdict.target.startswith("roofline") else _fmt_ratio(verdict.value)


def _fmt_verdict(passed: bool) -> str:
    return "pass" if passed else "**FAIL**"


def _table(columns: list[str], rows: list[list[str]]) -> list[str]:
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    return lines + ["| " + " | ".join(cells) + " |" for cells in rows]


def roofline_cell(info: dict, median: float, minimum: float = 1 / ROOFLINE_MAX_SLOWDOWN) -> tuple[str, bool | None]:
    """Our roofline fraction as text, and its verdict against ``minimum`` (``None`` when there is none)."""
    fraction = roofline_fraction(info, median)
    if fraction is None:
        return "-", None
    percent = f"{100 * fraction:.0f}%"
    if fraction > 1:
        if roofline_term(info) == "flops":
            return f"above the measured matmul peak ({percent})", None
        return f"L2-resident, not a roofline ({percent})", None
    l2 = info.get("l2_cache_bytes")
    note = " (fits L2)" if l2 and info.get("bytes_moved", l2) < l2 else ""
    passed = fraction >= minimum
    return f"{percent}{note} {_fmt_verdict(passed)}", passed


def header(data: dict) -> list[str]:
    """Device, library versions, commit, date and measured ceilings of the run."""
    infos = [bench.get("extra_info", {}) for bench in data["benchmarks"]]

    def values(key: str) -> str:
        return ", ".join(sorted({str(info[key]) for info in infos if key in info})) or "?"

    commit = data.get("commit_info", {})
    commit_id = (commit.get("id") or "?")[:7] + (" (uncommitted changes)" if commit.get("dirty") else "")
    lines = [
        f"- device: {values('device')}",
        f"- torch {values('torch')}; triton {values('triton')}",
        f"- commit {commit_id}; run {data.get('datetime', '?')}",
    ]
    ceilings = next((info for info in infos if info.get("copy_bytes_per_second")), None)
    if ceilings is not None:
        peaks = [f"bf16 {_fmt_si(ceilings.get('matmul_flops_per_second'), 'FLOP/s')}"]
        if ceilings.get("matmul_flops_per_second_fp32"):
            peaks.append(f"fp32 {_fmt_si(ceilings['matmul_flops_per_second_fp32'], 'FLOP/s')}")
        lines.append(
            f"- measured ceilings: copy {_fmt_si(ceilings['copy_bytes_per_second'], 'B/s')} (read + write), "
            f"matmul {', '.join(peaks)}; L2 {_fmt_si(ceilings.get('l2_cache_bytes'), 'B')}"
        )
    lines.append(
        "- times: median ms per call (forward + backward where the op has one); ratios `peer / ours` are "
        "speedups (above 1: ours is faster); roofline: bound / time, the bound being max(bytes / copy "
        "bandwidth, FLOPs / matmul peak of the op's dtype); pass / FAIL: the op's targets, judged on CUDA "
        "rows only"
    )
    return lines


def target_summary(all_sections: dict[str, Section]) -> list[str]:
    """One line per (section, target): how many rows pass, and which fail."""
    counts: dict[tuple[str, str], list[Verdict]] = defaultdict(list)
    for section in all_sections.values():
        for verdict in evaluate(section):
            counts[(section.name, verdict.target)].append(verdict)
    if not counts:
        return ["- targets: no verdicts (no CUDA row measured both sides of a target)", ""]
    rows = []
    for (name, target), verdicts in counts.items():
        failed = [v for v in verdicts if not v.passed]
        failing = "; ".join(f"{v.shape} ({_fmt_value(v)})" for v in failed) or "-"
        rows.append([name, target, str(len(verdicts) - len(failed)), str(len(failed)), failing])
    return ["## Targets", ""] + _table(["section", "target", "pass", "fail", "failing cases"], rows) + [""]


def section_tables(section: Section) -> list[str]:
    """The times/targets table, the cost/roofline table and the crossover lines of one section."""
    spec = section.spec
    backends = section.backends()
    rows = list(section.rows.values())
    shape_names = list(rows[0].fields)
    for row in rows[1:]:
        shape_names += [name for name in row.fields if name not in shape_names]
    title = f"{spec.title} (`{section.name}`)" if spec else section.name
    lines = [f"### {title}", ""]

    ours_of = {id(row): section.ours(row) for row in rows}
    several_ours = spec is not None and any(len(spec.candidates(row.device_type)) > 1 for row in rows)
    targets: dict[str, list[Target]] = defaultdict(list)  # a peer may have several targets (by shape)
    if spec is not None:
        ours_names = {b for row in rows for b in spec.candidates(row.device_type)}
        for target in spec.targets:
            targets[target.peer].append(target)
        peers = [b for b in backends if b not in ours_names and not section.is_replay_of_ours(b)]
    else:
        peers = [b for b in backends if b != REFERENCE] if REFERENCE in backends else []
    # A section of alternatives with no reference and no spec (e.g. a crossover of algorithms): name the fastest.
    fastest = spec is None and not peers and len(backends) > 1
    # Host overhead: our eager call minus its graph replay, where a replay of an eager call was measured.
    replays = {id(row): section.replay(row) for row in rows}
    with_overhead = any(replays[id(row)] not in (None, ours_of[id(row)]) for row in rows)

    columns = shape_names + [f"{b} ms" for b in backends] + (["ours"] if several_ours else [])
    columns += ["host overhead ms (eager - replay)"] if with_overhead else []
    if spec is not None:
        columns += ["; ".join(t.label() for t in targets[p]) if p in targets else f"{p} / ours" for p in peers]
    else:
        columns += [f"{p} / reference" for p in peers] + (["fastest"] if fastest else [])
    table = []
    for row in rows:
        cells = [str(row.fields.get(name, "-")) for name in shape_names]
        cells += [_fmt_ms(row.median(b)) for b in backends]
        ours = ours_of[id(row)]
        if several_ours:
            cells.append(ours or "-")
        if with_overhead:
            replay = replays[id(row)]
            if replay is None or replay == ours:
                cells.append("-")
            else:
                overhead = row.median(ours) - row.median(replay)
                cells.append(f"{_fmt_ms(overhead)} ({100 * overhead / row.median(ours):.0f}%)")
        for peer in peers:
            if spec is None:
                ref = row.median(REFERENCE)
                cells.append(_fmt_ratio(row.median(peer) / ref if ref and row.median(peer) else None))
                continue
            t_ours, t_peer = (row.median(ours) if ours else None), row.median(peer)
            if t_ours is None or t_peer is None:
                cells.append("-")
                continue
            if peer not in targets:
                cells.append(f"{_fmt_ratio(t_peer / t_ours)}x")
                continue
            # The target that applies to this row, else the peer's first (its ratio, without a verdict).
            target = next((t for t in targets[peer] if t.when(row.fields)), targets[peer][0])
            ratio = target.ratio(t_ours, t_peer)
            text = f"{_fmt_ratio(ratio)}x" if target.kind == "speedup" else _fmt_ratio(ratio)
            if target.when(row.fields) and judged(row):
                text += f" {_fmt_verdict(target.passed(ratio))}"
            cells.append(text)
        if fastest:
            measured = [b for b in backends if row.median(b) is not None]
            cells.append(min(measured, key=row.median) if measured else "-")
        table.append(cells)
    lines += _table(columns, table) + [""]

    if any(row.any_info("bytes_moved") is not None for row in rows):
        lines += cost_table(section, rows, shape_names, backends) + [""]
    if REFERENCE in backends:
        others = [b for b in backends if b != REFERENCE]
        series = {tuple((k, _hashable(v)) for k, v in row.fields.items()): row.entries for row in rows}
        lines += crossovers(series, others)
    return lines


def cost_table(section: Section, rows: list[Row], shape_names: list[str], backends: list[str]) -> list[str]:
    """Bytes and FLOPs of the cost model, the roofline bound and our fraction of it, peak memory."""
    with_memory = [b for b in backends if any(row.info(b).get("peak_memory_bytes") for row in rows)]
    spec = section.spec
    roofline = spec is not None and spec.roofline_target
    columns = shape_names + ["bytes", "FLOPs", "bound", "binds"]
    if roofline:
        replayed = any(section.replay(row) is not None for row in rows)
        columns += [f"ours % of roofline, {spec.roofline_label(replayed).removeprefix('roofline of the ')}"]
    columns += [f"{b} peak mem" for b in with_memory]
    # What a backend holds beyond what any implementation must (its inputs and the gradients it returns).
    with_workspace = [b for b in with_memory if any("input_bytes" in row.info(b) for row in rows)]
    columns += [f"{b} peak - inputs - grads" for b in with_workspace]
    table = []
    for row in rows:
        ours = section.replay(row) or section.ours(row)
        info = row.info(ours) if ours else {}
        info = info or next(iter(row.entries.values()))["extra_info"]
        bound = roofline_seconds(info)
        cells = [str(row.fields.get(name, "-")) for name in shape_names]
        cells += [_fmt_si(info.get("bytes_moved"), "B"), _fmt_si(info.get("flops"), "FLOP")]
        cells += [f"{_fmt_ms(bound)} ms" if bound is not None else "-", roofline_term(info) or "-"]
        if roofline:
            cells.append(roofline_cell(info, row.median(ours), spec.roofline_min)[0] if ours else "-")
        cells += [_fmt_memory(row.info(b).get("peak_memory_bytes")) for b in with_memory]
        cells += [_fmt_memory(_workspace(row.info(b))) for b in with_workspace]
        table.append(cells)
    return _table(columns, table)


def _workspace(info: dict) -> float | None:
    """Peak memory beyond the inputs and the returned gradients (``None`` where not recorded)."""
    if info.get("peak_memory_bytes") is None or "input_bytes" not in info:
        return None
    return info["peak_memory_bytes"] - info["input_bytes"] - info.get("grad_bytes", 0)


def crossovers(rows: dict[tuple, dict[str, dict]], backends: list[str]) -> list[str]:
    """Per series over ``L`` (other shape entries fixed) and backend: where it overtakes the reference."""
    series: dict[tuple, list[tuple[int, dict[str, dict]]]] = defaultdict(list)
    for shape, by_backend in rows.items():
        fields = dict(shape)
        if "L" in fields:
            rest = tuple((k, v) for k, v in shape if k != "L")
            series[rest].append((fields["L"], by_backend))

    lines = []
    for rest, points in series.items():
        points.sort(key=lambda point: point[0])
        label = ", ".join(f"{k}={v}" for k, v in rest)
        for backend in backends:
            # Ratios where both were measured (the reference is skipped where it would not fit).
            ratios = [
                (length, by_backend[backend]["stats"]["median"] / by_backend[REFERENCE]["stats"]["median"])
                for length, by_backend in points
                if backend in by_backend and REFERENCE in by_backend
            ]
            if len(ratios) < 2:
                continue
            crossover = None
            for length, ratio in reversed(ratios):
                if ratio > 1:
                    break
                crossover = length
            measured = f"measured L = {ratios[0][0]}..{ratios[-1][0]}"
            if crossover is None:
                text = f"slower than the reference at the longest L ({measured})"
            elif crossover == ratios[0][0]:
                text = f"faster than the reference at every L ({measured})"
            else:
                text = f"faster than the reference from L = {crossover} on ({measured})"
            lines.append(f"- crossover, {backend} ({label}): {text}")
    return lines + ([""] if lines else [])


def profile_table(data: dict) -> list[str]:
    """Where the time goes, for the cases run with ``ICRL_BENCH_PROFILE=1``: the median, the device-busy
    time per call (kernels and copies), busy / median (near 100%: the kernels are the cost; far below:
    the device waits for the host), the launches per call and the longest kernels."""
    rows = []
    for bench in data["benchmarks"]:
        info = bench.get("extra_info", {})
        if "device_busy_seconds" not in info and "profile_error" not in info:
            continue
        median = bench["stats"]["median"]
        if "profile_error" in info:
            rows.append([bench["name"], _fmt_ms(median), "-", "-", "-", info["profile_error"]])
            continue
        busy = info["device_busy_seconds"]
        kernels = "; ".join(f"{name[:48]} {_fmt_ms(seconds)}" for name, seconds in info["top_kernels"][:3])
        rows.append([bench["name"], _fmt_ms(median), _fmt_ms(busy), f"{100 * busy / median:.0f}%",
                     f"{info['launches_per_call']:.0f}", kernels or "-"])  # fmt: skip
    if not rows:
        return []
    columns = ["case", "median ms", "device busy ms", "busy / median", "launches", "longest kernels (ms per call)"]
    return ["## Where the time goes (torch.profiler, per call)", ""] + _table(columns, rows) + [""]


def autotune_table(data: dict) -> list[str]:
    """Every config the autotuner timed, per kernel and key (``extra_info["autotune"]``, recorded on CUDA by
    the benchmarks' warm-up calls): the best config, its time, and each config's time as a multiple of the
    best (``x`` marks the best; ``-`` a config that failed to compile or ran out of resources). A key tuned
    by several cases is listed once, with the first case that tuned it."""
    rows, seen = [], set()
    for bench in data["benchmarks"]:
        for record in bench.get("extra_info", {}).get("autotune", []):
            if (record["kernel"], record["key"]) in seen:
                continue
            seen.add((record["kernel"], record["key"]))
            timings = record["timings_ms"]
            best = timings.get(record["best"])
            cells = []
            for name, ms in timings.items():
                relative = "-" if not math.isfinite(ms) else "x" if name == record["best"] else f"{ms / best:.2f}"
                cells.append(f"{name} {relative}")
            best_text = f"{best:.3f}" if best is not None and math.isfinite(best) else "-"
            rows.append([record["kernel"], bench["name"], record["key"], record["best"], best_text, "; ".join(cells)])
    if not rows:
        return []
    columns = ["kernel", "first case", "key", "best config", "best ms", "every config (time / best)"]
    return ["## Autotuning (every config timed, per kernel and key)", ""] + _table(columns, rows) + [""]


def summarize(path: Path | dict) -> str:
    """Markdown for a ``--benchmark-json`` file (or its loaded/merged content)."""
    data = path if isinstance(path, dict) else load(path)
    all_sections = sections(data)
    lines = header(data) + [""] + target_summary(all_sections)
    for section in all_sections.values():
        lines += section_tables(section)
    lines += profile_table(data)
    lines += autotune_table(data)
    return "\n".join(lines).rstrip() + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "json",
        type=Path,
        nargs="+",
        help="files written by pytest --benchmark-json (several: "
        "one table over all their benchmarks, the first file's run information)",
    )
    parser.add_argument("--merged", type=Path, help="also write the merged JSON of several files here")
    parser.add_argument("-o", "--output", type=Path, help="write the markdown here instead of stdout")
    args = parser.parse_args(argv)
    data = merge(args.json)
    if args.merged:
        args.merged.write_text(json.dumps(data, indent=1))
    text = summarize(data)
    if args.output:
        args.output.write_text(text)
    else:
        print(text, end="")


if __name__ == "__main__":
    main()
