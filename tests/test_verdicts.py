"""The README's verdicts are the ones ``benchmarks/verdicts.py`` computes from the results files, and its rules
give the verdicts the rules of its docstring define."""

from __future__ import annotations

import math

import pytest

from benchmarks import verdicts
from benchmarks.verdicts import CLAIMS, Claim, Evidence, Interval, judge


def test_readme_and_verdicts_md_are_generated_from_the_module():
    """Editing a verdict, a number of the table or a results file without regenerating fails here."""
    assert verdicts.stale() == [], "run: python -m benchmarks.verdicts --write"


def test_every_claim_has_its_results_files():
    pending = [claim.key for claim in CLAIMS if verdicts._available(claim) is None]
    assert pending == list(verdicts.PENDING), f"claims whose results files are missing: {pending}"


def test_the_readme_table_has_one_row_per_claim_with_n_and_spread():
    table = verdicts.readme_table().splitlines()[2:]
    assert len(table) == len(CLAIMS)
    for claim, row in zip(CLAIMS, table, strict=True):
        assert row.startswith(f"| {claim.claim} |")
        if claim.key not in verdicts.PENDING:
            assert "(n = " in row, f"{claim.key}: the row does not give n"
            assert row.rstrip(" |").endswith(tuple(f"**{v}**" for v in verdicts.VERDICTS))


def test_claim_keys_are_unique_and_rules_complete():
    assert len({c.key for c in CLAIMS}) == len(CLAIMS)
    for claim in CLAIMS:
        assert claim.kind in ("sign", "equivalence", "level")
        if claim.kind == "equivalence":
            assert claim.margin is not None and claim.paper_effect is None
        if claim.kind == "level":
            assert claim.margin is not None and claim.paper_effect is not None


def _evidence(*values: float, baseline: float | None = None) -> Evidence:
    return Evidence(Interval(tuple(values), tuple(range(len(values)))), "", baseline=baseline)


def _claim(kind: str, paper_effect=None, margin=None) -> Claim:
    return Claim("k", "c", "p", "q", kind, lambda: None, paper_effect=paper_effect, margin=margin)


def test_interval_is_the_students_t_interval():
    ci = Interval((1.0, 2.0, 3.0, 4.0, 5.0), tuple(range(5)))
    assert ci.mean == 3.0 and ci.sd == pytest.approx(math.sqrt(2.5))
    assert ci.half_width == pytest.approx(2.776 * math.sqrt(2.5) / math.sqrt(5))
    assert math.isnan(Interval((1.0,), (0,)).low)


def _t_cdf_above_zero(x: float, df: int, steps: int = 4000) -> float:
    """P(0 < T < x) for Student's t, by Simpson's rule on its density."""
    log_c = math.lgamma((df + 1) / 2) - math.lgamma(df / 2) - 0.5 * math.log(df * math.pi)
    density = [math.exp(log_c - (df + 1) / 2 * math.log1p((x * i / steps) ** 2 / df)) for i in range(steps + 1)]
    weights = [1 if i in (0, steps) else 4 if i % 2 else 2 for i in range(steps + 1)]
    return x / steps / 3 * sum(w * d for w, d in zip(weights, density, strict=True))


def test_t_quantiles_are_the_975_quantiles():
    for df in range(1, 31):
        assert _t_cdf_above_zero(verdicts.t_quantile(df), df) == pytest.approx(
            0.475, abs=5e-5
        )  # the table rounds to 3 decimals
    with pytest.raises(ValueError, match="df"):
        verdicts.t_quantile(0)


@pytest.mark.parametrize(
    "values, paper_effect, expected",
    [
        ((0.5, 0.6, 0.55, 0.52), 1.0, "reproduced"),  # CI above 0, not wholly below half the paper's effect
        ((0.05, 0.06, 0.055, 0.052), 1.0, "direction only"),  # significant but far smaller than the paper's
        ((0.05, -0.02, 0.06, 0.01), 1.0, "direction only"),  # right sign, CI includes 0, excludes half the effect
        ((0.3, -0.3, 0.5, -0.4), 1.0, "inconclusive"),  # holds both 0 and half the paper's effect
        ((-0.5, -0.6, -0.55, -0.52), 1.0, "not reproduced"),  # wholly on the wrong side
        ((-0.05, 0.02, -0.06, -0.01), 1.0, "not reproduced"),  # wrong-signed mean, excludes half the effect
        ((0.5, 0.6, 0.55, 0.52), None, "reproduced"),
        ((0.3, -0.3, 0.5, -0.4), None, "inconclusive"),
        ((0.05, -0.02, 0.06, 0.01), None, "inconclusive"),  # no paper effect: "far smaller" cannot be told
        ((0.7,), 1.0, "inconclusive"),  # one seed: no interval
    ],
)
def test_sign_rule(values, paper_effect, expected):
    assert judge(_claim("sign", paper_effect=paper_effect), _evidence(*values)) == expected


@pytest.mark.parametrize(
    "values, expected",
    [
        ((0.001, -0.001, 0.0005, -0.0005), "reproduced"),  # inside ±10% of 0.1
        ((0.05, -0.05, 0.03, -0.02), "inconclusive"),  # straddles the margin
        ((0.5, 0.6, 0.55, 0.52), "not reproduced"),  # wholly outside
    ],
)
def test_equivalence_rule(values, expected):
    assert judge(_claim("equivalence", margin=0.1), _evidence(*values, baseline=0.1)) == expected


@pytest.mark.parametrize(
    "values, expected",
    [
        ((0.95, 0.97, 0.99, 0.96), "reproduced"),  # above 0.98 - 0.1
        ((0.5, 0.55, 0.52, 0.57), "direction only"),  # above random, below the paper's level
        ((0.9, 0.5, 0.95, 0.6), "inconclusive"),  # straddles 0.88
        ((-0.1, -0.12, -0.08, -0.11), "not reproduced"),  # below random
    ],
)
def test_level_rule(values, expected):
    assert judge(_claim("level", paper_effect=0.98, margin=0.1), _evidence(*values)) == expected


def test_readme_markers_are_required(tmp_path):
    with pytest.raises(ValueError, match="markers"):
        verdicts.readme_with_table("no markers here")
