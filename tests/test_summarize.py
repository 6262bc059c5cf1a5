"""``benchmarks/summarize.py`` on a small fake pytest-benchmark JSON with CUDA-like ``extra_info``: the
ratios, the pass/fail verdicts of the targets, the roofline fraction (and the L2 flag), the grouping of
the looped (old ``implementation`` key), MoA (gated vs ungated) and FlexAttention (with and without the
block-mask build) benchmarks, the crossover lines, and the command line.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from benchmarks import summarize
from benchmarks.cost import OpCost, roofline
from benchmarks.cost.contrastive import infonce_fwd_bwd_cost
from benchmarks.cost.looped import inference_cost, train_step_cost
from benchmarks.cost.moa import attention_fwd_bwd_cost
from benchmarks.cost.ngram import fwd_bwd_cost as ngram_cost
from benchmarks.cost.smeared import fwd_bwd_cost as smeared_cost

COPY = 3e12  # B/s
PEAKS = {"bfloat16": 7.5e14, "float32": 5e13}  # FLOP/s
L2 = 50 * 2**20


def cuda_info(cost: OpCost, dtype: str, median: float, **info) -> dict:
    """``extra_info`` as ``benchmarks/conftest.py`` records it on CUDA."""
    peak = PEAKS["bfloat16" if dtype == "bfloat16" else "float32"]
    seconds, bound = roofline(cost, COPY, peak)
    return {
        **info,
        "dtype": dtype,
        "device": "NVIDIA H100 80GB HBM3",
        "device_type": "cuda",
        "torch": "2.13.0",
        "triton": "3.9.0",
        "bytes_moved": cost.bytes,
        "flops": cost.flops,
        "copy_bytes_per_second": COPY,
        "matmul_flops_per_second": PEAKS["bfloat16"],
        "matmul_flops_per_second_fp32": PEAKS["float32"],
        "roofline_flops_per_second": peak,
        "roofline_seconds": seconds,
        "roofline_bound": bound,
        "l2_cache_bytes": L2,
        "bytes_per_second": cost.bytes / median,
        "peak_memory_bytes": 2**30,
        "roofline_fraction": seconds / median,
    }


def entry(group: str, info: dict, median: float) -> dict:
    backend = info.get("backend") or info.get("implementation")
    name = f"test_{info['op']}[{group.split(' ')[-1]}-{backend}]"
    stats = {"median": median, "min": median, "max": median, "mean": median, "rounds": 5}
    return {"group": group, "name": name, "fullname": f"benchmarks/x.py::{name}", "extra_info": info, "stats": stats}


def ngram_entries(B, L, D, vocab, times: dict[str, float], device_type: str = "cuda") -> list[dict]:
    shape = {"B": B, "L": L, "D": D, "vocab": vocab, "n": 2}
    cost = ngram_cost(B, L, D, dtype="float32")
    out = []
    for backend, median in times.items():
        info = {"op": "ngram_attention", "backend": backend, **shape}
        if device_type == "cuda":
            info = cuda_info(cost, "float32", median, **info)
        else:
            info = {**info, "dtype": "float32", "device": "CPU", "device_type": "cpu", "bytes_moved": cost.bytes}
        group = "ngram-fwd-bwd" if device_type == "cuda" else "ngram-cpu-crossover"
        out.append(entry(f"{group} B{B}-L{L}-V{vocab}", info, median))
    return out


def fake_results() -> dict:
    benchmarks = []
    # n-gram at the headline shapes: ours is the faster Triton algorithm (sort, 1 ms).
    headline = {"triton-sort": 1e-3, "triton-tiled": 3e-3, "eager": 5e-3, "reference": 20e-3,
                "reference-tf32": 8e-3, "flex": 0.8e-3, "flex+mask": 1.5e-3}  # fmt: skip
    # At vocabulary 10^4 the sort path's call was also replayed from a CUDA graph: 0.35 ms of device time.
    benchmarks += ngram_entries(16, 4096, 512, 10_000, {**headline, "triton-sort+graph": 0.35e-3})
    benchmarks += ngram_entries(16, 4096, 512, 81, {**headline, "flex": 2e-3, "flex+mask": 3e-3})
    # An L series for the crossover: the sort path loses at 1024, wins from 2048 on.
    for L, (ours, ref) in {1024: (2e-3, 1e-3), 2048: (2e-3, 3e-3), 8192: (4e-3, 40e-3)}.items():
        benchmarks += ngram_entries(8, L, 512, 81, {"triton-sort": ours, "reference": ref})
    # The CPU crossover sweep (same op, other section): ratios, no verdicts.
    benchmarks += ngram_entries(8, 4096, 256, 81, {"eager": 0.12, "reference": 1.9}, device_type="cpu")

    # InfoNCE at A = 4096 (compute-bound) and A = 1M (Liger only).
    infonce = {4096: {"fused": 1.5e-3, "reference": 6e-3, "compile": 2e-3}, 1_000_000: {"fused": 0.8, "liger": 0.9}}
    for A, times in infonce.items():
        cost = infonce_fwd_bwd_cost(65536, 512, A, dtype="bfloat16")
        shape = {"N": 65536, "D": 512, "A": A, "wrt": "pred"}
        for backend, median in times.items():
            info = cuda_info(cost, "bfloat16", median, op="infonce_loss", backend=backend, **shape)
            benchmarks.append(entry(f"infonce-fwd-bwd N65536-D512-A{A}-pred", info, median))

    # MoA: gated within 1.1x of ungated at B = 16, not at B = 64.
    for B, (gated, ungated) in {16: (1.05e-3, 1e-3), 64: (4.6e-3, 4e-3)}.items():
        for backend, median in {"triton": gated, "ungated": ungated, "reference": 2 * gated}.items():
            cost = attention_fwd_bwd_cost(B, 1024, 12, 64, dtype="bfloat16", gated=backend != "ungated")
            info = cuda_info(cost, "bfloat16", median, op="moa_attention", backend=backend, B=B, L=1024, H=12, Dh=64)
            benchmarks.append(entry(f"moa-attention-fwd-bwd B{B}-L1024", info, median))

    # Looped train step written with the old "implementation" key; inference with "backend".
    shape = {"B": 64, "L": 81, "D": 256, "H": 8, "loops": 30, "grad_loops": 15}
    cost = train_step_cost(64, 81, 256, loops=30, grad_loops=15, dtype="bfloat16")
    for implementation, median in {"fused": 10e-3, "fused-graph": 12e-3, "fused+graph": 7e-3, "eager": 40e-3}.items():
        info = cuda_info(cost, "bfloat16", median, op="looped_block_train", implementation=implementation, **shape)
        benchmarks.append(entry("looped-train B64-L81-b30", info, median))
    shape = {**shape, "loops": 500, "grad_loops": 0}
    cost = inference_cost(64, 81, 256, loops=500, dtype="bfloat16")
    for backend, median in {"fused-graph": 20e-3, "fused": 50e-3, "eager": 90e-3}.items():
        info = cuda_info(cost, "bfloat16", median, op="looped_block_inference", backend=backend, **shape)
        benchmarks.append(entry("looped-infer B64-L81-b500", info, median))

    # A small elementwise case that stays in L2: faster than the copy bandwidth allows.
    cost = smeared_cost(2, 3, 70, 24, dtype="float32")
    bound = cost.bytes / COPY
    for backend, median in {"triton": bound / 2, "reference": bound * 3}.items():
        info = cuda_info(cost, "float32", median, op="smeared_keys", backend=backend, B=2, H=3, L=70, Dh=24)
        benchmarks.append(entry("smeared-keys-fwd-bwd B2", info, median))
    return {"benchmarks": benchmarks, "commit_info": {"id": "0123456789", "dirty": True}, "datetime": "2026-01-01"}


@pytest.fixture
def results_path(tmp_path):
    path = tmp_path / "results.json"
    path.write_text(json.dumps(fake_results()))
    return path


def verdicts(path) -> dict[tuple[str, str, str], summarize.Verdict]:
    """``(section, first word of the target label, shape text) -> verdict``."""
    found = {}
    for section in summarize.sections(summarize.load(path)).values():
        for verdict in summarize.evaluate(section):
            found[(section.name, verdict.target.split(" ")[0], verdict.shape)] = verdict
    return found


NGRAM_V4 = "B=16, L=4096, D=512, vocab=10000, n=2, dtype=float32"
NGRAM_V81 = "B=16, L=4096, D=512, vocab=81, n=2, dtype=float32"


def test_ngram_ratios_against_every_peer(results_path):
    found = verdicts(results_path)
    # Ours is the faster of the two Triton algorithms: triton-sort at 1 ms.
    assert found[("ngram-fwd-bwd", "reference", NGRAM_V4)].value == pytest.approx(20)
    assert found[("ngram-fwd-bwd", "reference", NGRAM_V4)].passed
    assert found[("ngram-fwd-bwd", "reference-tf32", NGRAM_V4)].value == pytest.approx(8)
    assert not found[("ngram-fwd-bwd", "reference-tf32", NGRAM_V4)].passed
    # FlexAttention with and without building its block mask are two backends with their own verdicts.
    assert not found[("ngram-fwd-bwd", "flex", NGRAM_V4)].passed  # 0.8 ms: faster than ours
    assert found[("ngram-fwd-bwd", "flex+mask", NGRAM_V4)].passed  # 1.5 ms with the mask built
    # The flex target applies at vocabulary 10^4 only; the 10x target only from L = 4096.
    assert ("ngram-fwd-bwd", "flex", NGRAM_V81) not in found
    assert not any(key[2].startswith("B=8, L=1024") and key[1] == "reference" for key in found)
    # The CPU sweep is a separate section and gets no verdicts.
    assert not any(key[0] == "ngram-cpu-crossover" for key in found)


def test_roofline_fraction_and_l2_flag(results_path):
    found = verdicts(results_path)
    # n-gram: 4 * 16*4096*512 * 4 B + ids, bytes-bound: 0.179 ms bound / 1 ms measured.
    roof = found[("ngram-fwd-bwd", "roofline", NGRAM_V81)]
    expected_bytes = 4 * 16 * 4096 * 512 * 4 + 2 * 16 * 4096 * 8
    assert roof.value == pytest.approx(expected_bytes / COPY / 1e-3)
    assert not roof.passed and roof.target == "roofline of the eager call (target >= 50%)"
    # Where the call was also replayed from a CUDA graph, the roofline is judged on the replay (0.35 ms: 51%).
    roof = found[("ngram-fwd-bwd", "roofline", NGRAM_V4)]
    assert roof.value == pytest.approx(expected_bytes / COPY / 0.35e-3)
    assert roof.passed and roof.target == "roofline of the graph replay (target >= 50%)"
    # InfoNCE at A = 4096: FLOPs-bound (2 N A D x 3 / bf16 peak = 1.10 ms) against 1.5 ms: 73%, passes.
    shape = "N=65536, D=512, A=4096, wrt=pred, dtype=bfloat16"
    roof = found[("infonce-fwd-bwd", "roofline", shape)]
    assert roof.value == pytest.approx(2 * 65536 * 4096 * 512 * 3 / PEAKS["bfloat16"] / 1.5e-3)
    assert roof.passed
    # Twice as fast as the copy bandwidth allows: L2-resident, no verdict, flagged in the table.
    assert not any(key[0] == "smeared-keys-fwd-bwd" for key in found)
    text = summarize.summarize(results_path)
    assert "L2-resident, not a roofline (200%)" in text


def test_replay_is_our_host_overhead_not_a_peer(results_path):
    """The ``+graph`` replay of our call gets the host-overhead column (eager - replay), not a peer ratio."""
    text = summarize.summarize(results_path)
    header = next(
        line for line in text.splitlines() if line.startswith("| B | L | D | vocab | n | dtype | triton-sort")
    )
    assert "host overhead ms (eager - replay)" in header and "triton-sort+graph / ours" not in header
    row = next(line for line in text.splitlines() if line.startswith("| 16 | 4096 | 512 | 10000 |"))
    assert "| 0.65 (65%) |" in row


def test_infonce_targets(results_path):
    found = verdicts(results_path)
    shape = "N=65536, D=512, A=4096, wrt=pred, dtype=bfloat16"
    assert found[("infonce-fwd-bwd", "reference", shape)].value == pytest.approx(4)
    assert not found[("infonce-fwd-bwd", "reference", shape)].passed  # the target is 4.5x at A = 4096
    assert found[("infonce-fwd-bwd", "compile", shape)].value == pytest.approx(2 / 1.5)
    assert not found[("infonce-fwd-bwd", "compile", shape)].passed  # 1.33x of 1.4x
    liger = found[("infonce-fwd-bwd", "liger", "N=65536, D=512, A=1000000, wrt=pred, dtype=bfloat16")]
    assert liger.value == pytest.approx(0.9 / 0.8) and not liger.passed  # 1.125x of 1.3x


def test_moa_gated_against_ungated(results_path):
    found = verdicts(results_path)
    b16 = found[("moa-attention-fwd-bwd", "ours", "B=16, L=1024, H=12, Dh=64, dtype=bfloat16")]
    b64 = found[("moa-attention-fwd-bwd", "ours", "B=64, L=1024, H=12, Dh=64, dtype=bfloat16")]
    assert b16.value == pytest.approx(1.05) and b16.passed
    assert b64.value == pytest.approx(1.15) and not b64.passed
    text = summarize.summarize(results_path)
    assert "ours / ungated (target <= 1.1)" in text
    assert "| 16 | 1024 | 12 | 64 | bfloat16 | 1.05 | 1 | 2.1 | 1.05 pass | 2.00x |" in text


def test_looped_rows_group_by_either_backend_key(results_path):
    all_sections = summarize.sections(summarize.load(results_path))
    train = all_sections["looped-train"]
    (row,) = train.rows.values()  # one shape row: "implementation" is the backend, not a shape field
    assert set(row.entries) == {"fused", "fused-graph", "fused+graph", "eager"}
    assert train.ours(row) == "fused+graph"  # the fastest fused variant: the whole step replayed from a graph
    found = verdicts(results_path)
    train_shape = "B=64, L=81, D=256, H=8, loops=30, grad_loops=15, dtype=bfloat16"
    assert found[("looped-train", "eager", train_shape)].value == pytest.approx(40 / 7)
    assert found[("looped-train", "eager", train_shape)].passed  # >= 5x
    infer = found[("looped-infer", "eager", "B=64, L=81, D=256, H=8, loops=500, grad_loops=0, dtype=bfloat16")]
    assert infer.value == pytest.approx(4.5) and not infer.passed  # ours: fused-graph, 5x needed


def test_markdown_tables_and_crossover(results_path, tmp_path, capsys):
    out = tmp_path / "table.md"
    summarize.main([str(results_path), "-o", str(out)])
    text = out.read_text()
    assert "measured ceilings: copy 3 TB/s" in text
    assert "## Targets" in text
    assert "### n-gram attention, forward + backward (`ngram-fwd-bwd`)" in text
    # Every n-gram backend has a time column, ours is named, and each peer has its ratio column.
    for backend in ("triton-sort", "triton-tiled", "eager", "reference", "reference-tf32", "flex", "flex+mask"):
        assert f"| {backend} ms |" in text or f" {backend} ms |" in text
    assert "flex+mask / ours (target >= 1x at vocab >= 10^4)" in text
    assert "20.00x pass" in text and "8.00x **FAIL**" in text
    # The crossover of the L series (B=8, D=512), and on the CPU sweep's own section.
    series = "triton-sort (B=8, D=512, vocab=81, n=2, dtype=float32)"
    assert f"- crossover, {series}: faster than the reference from L = 2048 on" in text
    assert "### n-gram attention, forward + backward (`ngram-cpu-crossover`)" in text
    summarize.main([str(results_path)])
    assert capsys.readouterr().out == text


def test_cpu_only_results_print_ratios_without_verdicts(tmp_path):
    data = {"benchmarks": ngram_entries(2, 64, 64, 81, {"eager": 1e-3, "reference": 4e-4}, device_type="cpu")}
    path = tmp_path / "cpu.json"
    path.write_text(json.dumps(data))
    text = summarize.summarize(path)
    assert "no verdicts" in text
    assert " pass |" not in text and "FAIL**" not in text
    assert "0.40x" in text  # reference / ours: eager is 2.5x slower than the dense matmul at L = 64


def test_profile_table_reports_busy_fraction_and_longest_kernels(tmp_path):
    data = fake_results()
    profiled = data["benchmarks"][0]  # n-gram triton-sort, median 1 ms
    profiled["extra_info"].update(device_busy_seconds=2.5e-4, launches_per_call=9.0,
                                  top_kernels=[["_ngram_fwd_kernel", 1e-4], ["radixSort", 5e-5]])  # fmt: skip
    data["benchmarks"][1]["extra_info"]["profile_error"] = "RuntimeError: no CUPTI"
    path = tmp_path / "profiled.json"
    path.write_text(json.dumps(data))
    text = summarize.summarize(path)
    table = text.split("## Where the time goes")[1]
    row = next(line for line in table.splitlines() if profiled["name"] in line)
    assert "| 1 | 0.25 | 25% | 9 | _ngram_fwd_kernel 0.1; radixSort 0.05 |" in row
    assert "RuntimeError: no CUPTI" in table
    # Profile entries are measurements, not shape columns.
    assert "device_busy_seconds" not in text.split("## Where the time goes")[0]


def test_profile_table_absent_without_profiled_cases(results_path):
    assert "Where the time goes" not in summarize.summarize(results_path)


def test_autotune_table_lists_every_config_against_the_best(tmp_path):
    data = fake_results()
    record = {"kernel": "infonce_grad_pred", "key": "(512, 4096, 'torch.bfloat16')", "best": "BLOCK_N64-w8",
              "timings_ms": {"BLOCK_N32-w8": 3.0, "BLOCK_N64-w8": 2.0, "BLOCK_N128-w8": float("inf")}}  # fmt: skip
    data["benchmarks"][0]["extra_info"]["autotune"] = [record]
    data["benchmarks"][1]["extra_info"]["autotune"] = [dict(record, timings_ms={"BLOCK_N32-w8": 9.0})]  # same key
    path = tmp_path / "tuned.json"
    path.write_text(json.dumps(data))
    text = summarize.summarize(path)
    table = text.split("## Autotuning")[1]
    rows = [line for line in table.splitlines() if "infonce_grad_pred" in line]
    assert len(rows) == 1, "a key tuned by two cases is listed once"
    assert data["benchmarks"][0]["name"] in rows[0]
    assert "| BLOCK_N64-w8 | 2.000 | BLOCK_N32-w8 1.50; BLOCK_N64-w8 x; BLOCK_N128-w8 - |" in rows[0]
    assert "autotune" not in text.split("## Autotuning")[0], "the records are measurements, not shape columns"


def test_autotune_table_absent_without_records(results_path):
    assert "## Autotuning" not in summarize.summarize(results_path)


def test_recorded_autotuning_keeps_each_new_key_and_restores_run():
    pytest.importorskip("triton")
    from benchmarks.kernel_tools import recorded_autotuning

    class FakeAutotuner:  # the parts of triton's Autotuner the recorder reads (a GPU is needed to tune for real)
        def __init__(self):
            self.cache, self.configs_timings = {}, {}
            self.fn = SimpleNamespace(fn=self._ngram_forward_kernel)  # Autotuner -> JITFunction -> function

        @staticmethod
        def _ngram_forward_kernel():
            pass

        def run(self, *args, key, **kwargs):
            if key not in self.cache:
                fast, slow = Config({"BLOCK_L": 64}, num_warps=4), Config({"BLOCK_L": 128}, num_warps=8)
                self.configs_timings = {fast: [1.0, 0.9, 1.1], slow: [2.5, 2.4, 2.6]}
                self.cache[key] = fast
            return "launched"

    from triton import Config

    kernel = FakeAutotuner()
    with recorded_autotuning([kernel]) as records:
        assert kernel.run(key=("a",)) == "launched"
        kernel.run(key=("a",))  # cached: not tuned again, not recorded again
        kernel.run(key=("b",))
    assert [r["key"] for r in records] == ["('a',)", "('b',)"]
    assert records[0] == {"kernel": "ngram_forward", "key": "('a',)", "best": "BLOCK_L64-w4",
                          "timings_ms": {"BLOCK_L64-w4": 1.0, "BLOCK_L128-w8": 2.5}}  # fmt: skip
    assert "run" not in vars(kernel), "the wrapper is removed after the block"
    kernel.run(key=("c",))
    assert len(records) == 2


def test_union_of_device_intervals():
    from benchmarks.conftest import _union_seconds

    # [0, 10] and [5, 20] overlap (20 us covered), [30, 31] is apart: 21 us.
    assert _union_seconds([(30.0, 31.0), (5.0, 20.0), (0.0, 10.0)]) == pytest.approx(21e-6)
    assert _union_seconds([]) == 0.0


def test_device_profile_runs_without_cuda_work():
    import torch

    from benchmarks.conftest import device_profile

    x = torch.randn(64, 64)
    found = device_profile(lambda: x @ x, calls=2)
    assert found == {"device_busy_seconds": 0.0, "launches_per_call": 0.0, "top_kernels": []}


def test_several_files_merge_into_one_summary(results_path, tmp_path):
    data = fake_results()
    first, second = dict(data, benchmarks=data["benchmarks"][:7]), dict(data, benchmarks=data["benchmarks"][7:])
    first["commit_info"] = {"id": "aaaaaaaaaa", "dirty": False}
    paths = [tmp_path / "a.json", tmp_path / "b.json"]
    for path, part in zip(paths, (first, second)):
        path.write_text(json.dumps(part))
    merged_path, out = tmp_path / "merged.json", tmp_path / "merged.md"
    summarize.main([*map(str, paths), "--merged", str(merged_path), "-o", str(out)])
    merged = json.loads(merged_path.read_text())
    assert merged["benchmarks"] == data["benchmarks"] and merged["commit_info"]["id"] == "aaaaaaaaaa"
    # The same tables as the single file's, but the header's commit (the first file's).
    whole = summarize.summarize(results_path)
    assert out.read_text() == whole.replace("commit 0123456 (uncommitted changes)", "commit aaaaaaa")


def test_crossover_of_algorithms_names_the_fastest_and_the_workspace(tmp_path):
    """A section of alternatives with no reference (``infonce-crossover``) gets a "fastest" column; entries
    that record their inputs and gradients get their peak memory beyond them."""
    shape = {"N": 65536, "D": 512, "A": 4096}
    cost = infonce_fwd_bwd_cost(65536, 512, 4096, dtype="bfloat16")
    grads = 65536 * 512 * 2
    benchmarks = []
    for backend, median in {"fused": 3e-3, "row-chunks": 1.2e-3, "action-chunks": 1.5e-3}.items():
        info = cuda_info(cost, "bfloat16", median, op="infonce_crossover", backend=backend, **shape)
        info.update(input_bytes=grads + 4096 * 512 * 2 + 8 * 65536, grad_bytes=grads, algorithm=backend)
        info["peak_memory_bytes"] = info["input_bytes"] + grads + 64 * 2**20
        benchmarks.append(entry("infonce-crossover N65536-D512-A4096", info, median))
    path = tmp_path / "crossover.json"
    path.write_text(json.dumps({"benchmarks": benchmarks}))
    text = summarize.summarize(path)
    header = next(line for line in text.splitlines() if "| fused ms |" in line)
    row = text.splitlines()[text.splitlines().index(header) + 2]
    assert header.endswith("| fastest |") and row.endswith("| row-chunks |"), (header, row)
    assert "| row-chunks peak - inputs - grads |" in text and "| 64 MiB | 64 MiB | 64 MiB |" in text
