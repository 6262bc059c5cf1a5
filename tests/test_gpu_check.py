"""The staged GPU runner (``benchmarks/gpu_check.py``): stage selection, time limits, report parsing.

The stages themselves are rehearsed end to end by ``gpu_check.py --dry-run`` in CI (``.ci/run``); these
tests pin the pieces that a dry run cannot show failing: a stage that overruns is stopped and recorded, a
broken stage does not stop the ones after it, and junit reports are counted right.
"""

from __future__ import annotations

import json
import sys

import pytest

from benchmarks import gpu_check

JUNIT = """<?xml version="1.0" encoding="utf-8"?>
<testsuites><testsuite name="pytest" errors="1" failures="1" skipped="1" tests="4">
<testcase classname="tests.test_a" name="test_ok"/>
<testcase classname="tests.test_a" name="test_bad"><failure message="assert 1 == 2">trace</failure></testcase>
<testcase classname="tests.test_a" name="test_broken"><error message="fixture failed">trace</error></testcase>
<testcase classname="tests.test_a" name="test_skip"><skipped message="needs CUDA"/></testcase>
</testsuite></testsuites>"""


def test_junit_counts_name_failures_and_errors(tmp_path):
    path = tmp_path / "report.xml"
    path.write_text(JUNIT)
    counts = gpu_check._junit_counts(path)
    assert {key: counts[key] for key in ("tests", "failures", "errors", "skipped")} == {
        "tests": 4, "failures": 1, "errors": 1, "skipped": 1
    }  # fmt: skip
    assert counts["failed"] == [
        "tests.test_a::test_bad: assert 1 == 2",
        "tests.test_a::test_broken: fixture failed",
    ]
    assert gpu_check._junit_counts(tmp_path / "missing.xml")["tests"] == 0


def test_parse_stages():
    assert gpu_check.parse_stages("all") == list(gpu_check.STAGES)
    assert gpu_check.parse_stages("env, headline") == ["env", "headline"]
    with pytest.raises(SystemExit, match="unknown stage"):
        gpu_check.parse_stages("env,bogus")


def test_every_full_slice_names_existing_benchmark_files():
    from pathlib import Path

    for name, files, _ in gpu_check.FULL_SLICES:
        assert name in gpu_check.STAGES
        for file in files:
            assert (gpu_check.ROOT / file).is_file(), file
    covered = {file for _, files, _ in gpu_check.FULL_SLICES for file in files}
    every_bench = {f"benchmarks/{path.name}" for path in Path(gpu_check.ROOT / "benchmarks").glob("bench_*.py")}
    assert covered == every_bench, "every benchmark file belongs to exactly one full-* stage"


def test_a_stage_past_its_time_limit_is_stopped_and_recorded(tmp_path):
    ctx = gpu_check.Context(tmp_path, dry_run=True, timeout=1.0, env=gpu_check.base_env(True, None))
    ctx.deadline = 0.0  # already past: the command gets the minimum of one second
    code = ctx.run([sys.executable, "-c", "import time; time.sleep(60)"], "slow.log")
    assert code == 124
    assert "time limit" in (tmp_path / "slow.log").read_text()


def test_a_broken_stage_does_not_stop_the_next(tmp_path, monkeypatch):
    def broken(ctx):
        raise RuntimeError("no device")

    def fine(ctx):
        ctx.write("fine.md", "ok")
        return "passed", {"answer": 42}

    monkeypatch.setattr(gpu_check, "STAGES", {"broken": (broken, ""), "fine": (fine, "")})
    assert gpu_check.main([str(tmp_path), "--stages", "broken,fine", "--dry-run"]) == 1
    record = json.loads((tmp_path / "stages.json").read_text())
    assert record["broken"]["status"] == "error" and "no device" in record["broken"]["error"]
    assert record["fine"]["status"] == "passed" and record["fine"]["answer"] == 42
    assert (tmp_path / "fine.md").read_text() == "ok"


def test_dry_run_env_stage_measures_the_ceilings(tmp_path):
    assert gpu_check.main([str(tmp_path), "--stages", "env", "--dry-run"]) == 0
    facts = json.loads((tmp_path / "env.json").read_text())
    assert facts["copy_bytes_per_second"] > 0 and facts["matmul_bfloat16_flops_per_second"] > 0
    assert facts["torch"] and "copy bandwidth" in (tmp_path / "env.md").read_text()
