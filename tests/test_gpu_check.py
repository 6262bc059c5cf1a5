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


def test_captured_lines_keep_the_errors_of_passing_tests(tmp_path):
    path = tmp_path / "report.xml"
    path.write_text(
        '<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest" tests="3">'
        '<testcase classname="tests.t" name="test_pass[bf16]"><system-out>setup\n'
        "softmax grad k: relative RMS error 2.900e-02 (PyTorch bf16: 4.0e-03)\n</system-out></testcase>"
        '<testcase classname="tests.t" name="test_quiet"><system-out>nothing here</system-out></testcase>'
        '<testcase classname="tests.t" name="test_silent"/></testsuite></testsuites>'
    )
    assert gpu_check._captured_lines(path, "relative RMS error") == {
        "tests.t::test_pass[bf16]": ["softmax grad k: relative RMS error 2.900e-02 (PyTorch bf16: 4.0e-03)"]
    }
    assert gpu_check._captured_lines(tmp_path / "missing.xml", "error") == {}


def test_parse_stages():
    assert gpu_check.parse_stages("all", 60) == [(name, 60) for name in gpu_check.STAGES]
    assert gpu_check.parse_stages("env, headline", 60) == [("env", 60), ("headline", 60)]
    assert gpu_check.parse_stages("parity:250,train", 60) == [("parity", 250.0), ("train", 60)]
    with pytest.raises(SystemExit, match="unknown stage"):
        gpu_check.parse_stages("env,bogus")
    with pytest.raises(SystemExit, match="must be seconds"):
        gpu_check.parse_stages("parity:soon")
    with pytest.raises(SystemExit, match="must be positive"):
        gpu_check.parse_stages("parity:0")


def test_sanitizer_selection_is_one_run_per_part():
    for part in gpu_check.SANITIZER_PARTS:
        selection = gpu_check.sanitizer_selection(part, "cuda")
        files = {path for path, _ in part.selection}
        assert set(selection[:-2]) == files and selection[-2] == "-k"
        templated = sum("{device}" in expression for _, expression in part.selection)
        assert selection[-1].count("and cuda") == templated and "{device}" not in selection[-1]
    assert [part.tool for part in gpu_check.SANITIZER_PARTS] == ["memcheck"] * 3 + ["racecheck"]


def test_sanitizer_parts_cover_every_kernel_file_and_each_selection_finds_tests():
    """Every Triton kernel module has a memcheck part and a racecheck test, and every (file, -k) pair of every
    part selects at least one test (collected once under the interpreter and matched with pytest's own -k
    grammar): a renamed test must not silently drop a kernel from the sanitizer."""
    import subprocess

    from _pytest.mark.expression import Expression

    kernel_tests = {
        "ngram/kernels.py": "tests/test_ngram_attention.py", "ngram/tiled_kernels.py": "tests/test_ngram_attention.py",
        "ngram/plan_kernels.py": "tests/test_ngram_plan_kernels.py",
        "contrastive/kernels.py": "tests/test_contrastive_kernels.py", "moa/kernels.py": "tests/test_moa_kernels.py",
        "contrastive/fused_kernels.py": "tests/test_contrastive_kernels.py",
        "contrastive/small_kernels.py": "tests/test_contrastive_algorithms.py",
        "contrastive/chunked_kernels.py": "tests/test_contrastive_algorithms.py",
        "looped/kernels.py": "tests/test_looped_kernels.py", "smeared/kernels.py": "tests/test_smeared_kernels.py",
        "attention/kernels.py": "tests/test_attention_kernels.py",
    }  # fmt: skip
    modules = {
        str(p.relative_to(gpu_check.ROOT / "icrl_kernels"))
        for p in (gpu_check.ROOT / "icrl_kernels").rglob("*kernels.py")
    }
    assert modules == set(kernel_tests)
    for tool in ("memcheck", "racecheck"):
        covered = {path for part in gpu_check.SANITIZER_PARTS if part.tool == tool for path, _ in part.selection}
        assert set(kernel_tests.values()) <= covered, tool
    files = sorted({path for part in gpu_check.SANITIZER_PARTS for path, _ in part.selection})
    env = {**gpu_check.base_env(True, None)}
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *files],
        cwd=gpu_check.ROOT, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    ids = [line for line in result.stdout.splitlines() if "::" in line]
    for part in gpu_check.SANITIZER_PARTS:
        for path, expression in part.selection:
            compiled = Expression.compile(expression.format(device="cpu"))
            chosen = [
                i for i in ids if i.startswith(path) and compiled.evaluate(lambda word, i=i: word.lower() in i.lower())
            ]
            assert chosen, f"{part.name}: {path} -k {expression!r} selects no test"


def test_sanitizer_errors_are_read_from_the_summaries():
    log = (
        "========= COMPUTE-SANITIZER\n....\n========= ERROR SUMMARY: 0 errors\n"
        "========= RACECHECK SUMMARY: 2 hazards displayed (1 error, 1 warning)\n"
    )
    assert gpu_check.sanitizer_errors(log) == 1
    assert gpu_check.sanitizer_errors("========= ERROR SUMMARY: 3 errors\n") == 3
    assert gpu_check.sanitizer_errors("no sanitizer here") is None
    assert gpu_check.parse_sanitizer_parts(None) is None
    assert gpu_check.parse_sanitizer_parts("racecheck, memcheck-ngram") == ("racecheck", "memcheck-ngram")
    with pytest.raises(SystemExit, match="unknown sanitizer part"):
        gpu_check.parse_sanitizer_parts("memcheck-everything")


def test_dry_run_memcheck_stage_writes_each_part(tmp_path):
    """The memcheck stage rehearsed on the CPU (one small part: the full dry run is the slow test below and
    CI's): its selection runs under the interpreter, and memcheck.json/.md name the part and its counts."""
    argv = [str(tmp_path), "--stages", "memcheck", "--dry-run", "--sanitizer-parts", "memcheck-contrastive"]
    assert gpu_check.main(argv) == 0
    report = json.loads((tmp_path / "memcheck.json").read_text())
    (part,) = report["parts"]
    assert part["part"] == "memcheck-contrastive" and part["status"] == "passed" and part["tests"] >= 5
    assert "| memcheck-contrastive | memcheck | passed |" in (tmp_path / "memcheck.md").read_text()
    assert json.loads((tmp_path / "stages.json").read_text())["memcheck"]["status"] == "passed"


@pytest.mark.slow
def test_dry_run_memcheck_stage_passes_every_part(tmp_path):
    assert gpu_check.main([str(tmp_path), "--stages", "memcheck:900", "--dry-run"]) == 0
    report = json.loads((tmp_path / "memcheck.json").read_text())
    assert [part["part"] for part in report["parts"]] == [part.name for part in gpu_check.SANITIZER_PARTS]
    assert all(part["status"] == "passed" and part["tests"] > 0 for part in report["parts"])


def test_a_memcheck_stage_at_its_limit_records_the_parts_not_run(tmp_path):
    ctx = gpu_check.Context(tmp_path, dry_run=True, timeout=1.0, env=gpu_check.base_env(True, None))
    ctx.deadline = 0.0  # already past
    status, details = gpu_check.stage_memcheck(ctx)
    assert status == "timed out" and set(details["parts"].values()) == {"not run (stage time limit)"}
    report = json.loads((tmp_path / "memcheck.json").read_text())
    assert [part["part"] for part in report["parts"]] == [part.name for part in gpu_check.SANITIZER_PARTS]


def test_profile_files_hold_every_headline_benchmark_of_ours():
    from pathlib import Path

    root = Path(gpu_check.ROOT)
    assert all((root / path).is_file() for path in gpu_check.PROFILE_FILES)
    ours = {"bench_ngram_attention", "bench_moa", "bench_smeared_keys", "bench_inject_layer_norm", "bench_infonce",
            "bench_looped"}  # fmt: skip
    assert {Path(path).stem for path in gpu_check.PROFILE_FILES} == ours


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


def test_dry_run_infonce_crossover_stage_times_every_algorithm(tmp_path):
    """The sweep behind the InfoNCE / selection thresholds (``contrastive/algorithms.py``) runs end to end on
    the CPU smoke shapes: every algorithm of both ops, and a table that names the fastest per shape."""
    assert gpu_check.main([str(tmp_path), "--stages", "infonce-crossover", "--dry-run"]) == 0
    backends = {bench["extra_info"]["backend"] for bench in json.loads((tmp_path / "infonce-crossover.json")
                                                                       .read_text())["benchmarks"]}  # fmt: skip
    assert {"small", "fused", "row_chunks", "action_chunks", "row_chunks@16MiB"} <= backends
    table = (tmp_path / "infonce-crossover.md").read_text()
    assert "### infonce-crossover" in table and "### select-crossover" in table and "| fastest |" in table


# -- what the parity stage selects on a CUDA machine ------------------------------------------------
def test_cuda_tests_get_plain_devices_and_the_gpu_marker(tmp_path):
    """On a CUDA machine every Triton test gets the device as the plain string ``"cuda"`` (a nested
    ``pytest.param`` once reached 139 tests as their device on an H200) and the ``gpu`` marker, which
    ``-m gpu`` (the parity stage) selects. CUDA is faked for collection only: nothing runs."""
    import os
    import subprocess
    from pathlib import Path

    (tmp_path / "sitecustomize.py").write_text("import torch\ntorch.cuda.is_available = lambda: True\n")
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(root)])}
    env.pop("TRITON_INTERPRET", None)
    files = ["tests/test_smeared_kernels.py", "tests/test_contrastive_kernels.py", "tests/test_ngram_robustness.py"]
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", "-m", "gpu", *files],
        cwd=root, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    selected = [line for line in result.stdout.splitlines() if "::" in line]
    assert {line.split("::")[0] for line in selected} == set(files), result.stdout[-3000:]
    # ids name the device, or (test_ngram_robustness, whose device is not a parameter) the Triton backend
    assert all("cuda" in line or "triton" in line for line in selected), selected
    assert "ParameterSet" not in result.stdout


def test_triton_devices_are_plain_strings(monkeypatch):
    import torch

    from icrl_kernels import testing

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert testing.triton_devices()[-1] == "cuda"
    assert all(isinstance(value, str) for param in testing.fast_paths() for value in param.values)


def test_loss_trend_of_a_training_run(tmp_path):
    rows = [{"step": step, "loss": 2.0 - step / 10, "steps_per_second": speed}
            for step, speed in zip(range(1, 11), [1.0, 5, 6, 7, 8, 9, 10, 11, 12, 13])]  # fmt: skip
    rows.insert(5, {"step": 5, "eval": {"final_return": 1.0}})  # evaluation rows are skipped
    path = tmp_path / "metrics.jsonl"
    path.write_text("\n".join(json.dumps(row) for row in rows) + "\n")
    trend = gpu_check._loss_trend(path)
    assert trend["rows"] == 10 and trend["steps_per_second"] == 9  # the median after the first (warm-up) row
    assert trend["loss_first"] == pytest.approx(1.7) and trend["loss_last"] == pytest.approx(1.2)
    assert trend["loss_falls"]


def test_headline_files_take_every_benchmark_once_ours_first():
    files = gpu_check.headline_files()
    every_bench = {f"benchmarks/{path.name}" for path in (gpu_check.ROOT / "benchmarks").glob("bench_*.py")}
    assert len(files) == len(set(files)) and set(files) == every_bench
    assert files[: len(gpu_check.PROFILE_FILES)] == gpu_check.PROFILE_FILES


def test_headline_k_narrows_the_headline_stage(tmp_path, monkeypatch):
    seen = []
    monkeypatch.setattr(
        gpu_check, "_benchmark_stage", lambda ctx, name, args, **kwargs: seen.append(args) or ("passed", {})
    )
    for headline_k in (None, "bench_looped or select"):
        ctx = gpu_check.Context(tmp_path, True, 10, {}, headline_k=headline_k)
        gpu_check.stage_headline(ctx)
    assert seen[0][-2:] == ["-m", "headline"]
    assert seen[1][-4:] == ["-m", "headline", "-k", "bench_looped or select"]
