"""The H100 prediction table: every headline case has a positive bound, and the binding term is right."""

from __future__ import annotations

from benchmarks.predict_h100 import COPY_BANDWIDTH, MATMUL_PEAK, headline_cases, markdown_table, predict


def test_every_case_predicts_a_positive_bound():
    rows = [predict(case) for case in headline_cases()]
    assert rows and all(row["bound_s"] > 0 and row["target_s"] == 1.5 * row["bound_s"] for row in rows)
    table = markdown_table(rows)
    assert table.count("\n") == len(rows) + 1


def test_bound_is_the_larger_term():
    for case in headline_cases():
        row = predict(case)
        memory = case.cost.bytes / COPY_BANDWIDTH
        compute = case.cost.flops / MATMUL_PEAK[case.dtype]
        assert row["bound_s"] == max(memory, compute)
        assert row["binding"] == ("flops" if compute > memory else "bytes")
