"""Turn a pytest-benchmark JSON file into markdown tables of time ratios against the reference.

Usage::

    python benchmarks/summarize.py RESULTS.json [-o TABLE.md]

Benchmarks are grouped into sections by the first word of their pytest-benchmark group (for example
``ngram-fwd-bwd``) and into rows by shape: every ``extra_info`` entry that the ``fwd_bwd`` fixture in
``benchmarks/conftest.py`` did not add itself, except ``op`` and ``backend``. Each row gives the median
milliseconds per call of every backend and ``t / t_reference`` (below 1: faster than the dense
reference); on CUDA also the achieved fraction of the measured copy bandwidth (the roofline). For every
series of shapes that differ only in ``L``, the crossover is the smallest ``L`` from which a backend
stays faster than the reference at every longer measured ``L``.
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path

REFERENCE = "reference"

# extra_info entries that describe the run or the measurement rather than the shape.
NOT_SHAPE = {
    "op",
    "backend",
    "shape",
    "device",
    "torch",
    "triton",
    "bytes_moved",
    "bytes_per_second",
    "peak_memory_bytes",
    "copy_bytes_per_second",
    "roofline_fraction",
}

BACKEND_ORDER = ["reference", "eager", "triton-sort", "triton-tiled", "flex"]


def _backend_sort_key(name: str) -> tuple[int, str]:
    return (BACKEND_ORDER.index(name) if name in BACKEND_ORDER else len(BACKEND_ORDER), name)


def _fmt_ms(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    ms = seconds * 1e3
    return f"{ms:.3g}" if ms < 100 else f"{ms:.0f}"


def _fmt_ratio(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:.0f}" if value >= 100 else f"{value:.2f}"


def load(path: Path) -> dict:
    with open(path) as handle:
        return json.load(handle)


def header(data: dict) -> list[str]:
    """Device, library versions, commit and date of the run."""
    infos = [bench["extra_info"] for bench in data["benchmarks"]]
    devices = sorted({info.get("device", "?") for info in infos})
    torch_versions = sorted({info.get("torch", "?") for info in infos})
    triton_versions = sorted({info.get("triton", "?") for info in infos})
    commit = data.get("commit_info", {})
    commit_id = (commit.get("id") or "?")[:7] + (" (uncommitted changes)" if commit.get("dirty") else "")
    return [
        f"- device: {', '.join(devices)}",
        f"- torch {', '.join(torch_versions)}; triton {', '.join(triton_versions)}",
        f"- commit {commit_id}; run {data.get('datetime', '?')}",
        "- times: median ms per forward + backward call; ratio: t / t_reference (below 1: faster)",
    ]


def section_tables(data: dict) -> list[str]:
    """One markdown table, plus crossover lines, per benchmark section."""
    # section -> shape key (tuple of (name, value)) -> backend -> benchmark entry
    sections: dict[str, dict[tuple, dict[str, dict]]] = defaultdict(lambda: defaultdict(dict))
    for bench in data["benchmarks"]:
        info = bench["extra_info"]
        section = (bench.get("group") or bench["name"]).split(" ")[0]
        shape = tuple((k, v) for k, v in info.items() if k not in NOT_SHAPE)
        sections[section][shape][info.get("backend", bench["name"])] = bench

    lines: list[str] = []
    for section, rows in sections.items():
        backends = sorted({b for by_backend in rows.values() for b in by_backend}, key=_backend_sort_key)
        others = [b for b in backends if b != REFERENCE]
        has_reference = REFERENCE in backends
        roofline = [
            b for b in others if any("roofline_fraction" in r.get(b, {}).get("extra_info", {}) for r in rows.values())
        ]
        shape_names = [name for name, _ in next(iter(rows))]
        columns = shape_names + [f"{b} ms" for b in backends]
        if has_reference:
            columns += [f"{b} / ref" for b in others]
        columns += [f"{b} % copy BW" for b in roofline]

        lines += [f"### {section}", "", "| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
        for shape, by_backend in rows.items():
            median = {b: by_backend[b]["stats"]["median"] for b in by_backend}
            cells = [str(value) for _, value in shape]
            cells += [_fmt_ms(median.get(b)) for b in backends]
            if has_reference:
                ref = median.get(REFERENCE)
                cells += [_fmt_ratio(median[b] / ref if ref and b in median else None) for b in others]
            for b in roofline:
                fraction = by_backend.get(b, {}).get("extra_info", {}).get("roofline_fraction")
                cells.append("-" if fraction is None else f"{100 * fraction:.0f}%")
            lines.append("| " + " | ".join(cells) + " |")
        lines.append("")
        if has_reference:
            lines += crossovers(rows, others)
    return lines


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


def summarize(path: Path) -> str:
    data = load(path)
    return "\n".join(header(data) + [""] + section_tables(data)).rstrip() + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("json", type=Path, help="a file written by pytest --benchmark-json")
    parser.add_argument("-o", "--output", type=Path, help="write the markdown here instead of stdout")
    args = parser.parse_args(argv)
    text = summarize(args.json)
    if args.output:
        args.output.write_text(text)
    else:
        print(text, end="")


if __name__ == "__main__":
    main()
