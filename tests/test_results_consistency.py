"""The numbers README.md and benchmarks/results/README.md quote from results files agree with those files.

Each claim is a piece of a README's text with ``{}`` where a number stands, the results file it comes from and
how to read each number out of that file (a key path, or a function of the parsed JSON). The test finds the
text in the README (whitespace and line breaks are ignored), reads the quoted numbers, and compares each with
the file's value to the precision quoted: ``0.81`` agrees with anything in [0.805, 0.815]. Editing a quoted
number, or a result file, without the other makes it fail; so does rewording a claim's text (update its entry
here with it). A claim may give its own tolerance where the README rounds differently (a percentage, a range
rounded outwards). Every results file a README names must exist and, for JSON, parse.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
DOCS = {"README": ROOT / "README.md", "results": RESULTS / "README.md"}
NUMBER = r"([-+]?\d+(?:\.\d+)?)"


@cache
def load(name: str):
    """A results file (relative to benchmarks/results), parsed once."""
    return json.loads((RESULTS / name).read_text())


@cache
def doc_text(doc: str) -> str:
    """A README's text with every run of whitespace collapsed to one space."""
    return re.sub(r"\s+", " ", DOCS[doc].read_text())


def at(*path) -> Callable:
    """The value at ``path`` (keys and indices) of a parsed JSON file."""

    def read(data):
        for key in path:
            data = data[key]
        return data

    return read


@dataclass(frozen=True)
class Claim:
    doc: str  # "README" or "results"
    text: str  # the README's text, "{}" for each number
    file: str  # results file, relative to benchmarks/results
    values: Callable  # parsed JSON -> one number per "{}" (a list), or one number
    tolerance: float | None = None  # default: half a unit of the quoted number's last digit
    occurrence: int | None = None  # the n-th place the text appears (tables repeat row labels); None: every one

    def __str__(self) -> str:
        return f"{self.doc}: {self.text[:70]}"


def _pattern(text: str) -> re.Pattern:
    """``text`` (whitespace collapsed) as a regex whose groups are the numbers standing at its ``{}``."""
    return re.compile(NUMBER.join(re.escape(part) for part in re.sub(r"\s+", " ", text).split("{}")))


def _half_unit(quoted: str) -> float:
    decimals = len(quoted.partition(".")[2])
    return 0.5 * 10.0**-decimals + 1e-12


def check(claim: Claim) -> None:
    matches = list(_pattern(claim.text).finditer(doc_text(claim.doc)))
    assert matches, f"{claim}: text not found in the {claim.doc} README (reworded? update the claim)"
    expected = claim.values(load(claim.file))
    expected = [expected] if np.ndim(expected) == 0 else list(expected)
    if claim.occurrence is not None:
        assert len(matches) > claim.occurrence, (
            f"{claim}: found {len(matches)} times, wanted occurrence {claim.occurrence}"
        )
        matches = [matches[claim.occurrence]]
    for match in matches:
        quoted = match.groups()
        assert len(quoted) == len(expected), f"{claim}: {len(quoted)} numbers quoted, {len(expected)} read"
        for text, value in zip(quoted, expected):
            tolerance = claim.tolerance if claim.tolerance is not None else _half_unit(text)
            assert abs(float(text) - float(value)) <= tolerance, f"{claim}: quotes {text}, {claim.file} holds {value}"


# --- reading helpers ---------------------------------------------------------------------------------


def setting(data, **keys) -> dict:
    """The ``settings`` entry of an icrl-compare file with these keys (num_train_tasks=..., ...)."""
    (found,) = [s for s in data["settings"] if all(s[k] == v for k, v in keys.items())]
    return found


def trials(data, **keys) -> list[dict]:
    return [t for t in data["trials"] if all(t[k] == v for k, v in keys.items())]


def emp(model: str, index: int, **keys) -> Callable:
    """Mean and sd over seeds of a model's Expected Max Performance after ``index + 1`` assignments."""

    def read(data):
        entry = setting(data, **keys)["expected_max_performance"][model]
        return [entry["mean"][index], entry["std"][index]]

    return read


def scores(model: str, **keys) -> Callable:
    """Mean ± sd over seeds of a model's score (one run per seed: icrl-compare's default hyperparameters)."""

    def read(data):
        values = [t["score"] for t in trials(data, model=model, **keys)]
        return [np.mean(values), np.std(values, ddof=1)]

    return read


def per_seed(model: str, key: str = "score", **keys) -> Callable:
    return lambda data: [t[key] for t in sorted(trials(data, model=model, **keys), key=lambda t: t["seed"])]


def paired(**keys) -> Callable:
    """N-Gram AD minus AD on the same seed: mean ± sd."""

    def read(data):
        differences = paired_per_seed(data, **keys)
        return [np.mean(differences), np.std(differences, ddof=1)]

    return read


def paired_per_seed(data, **keys) -> list[float]:
    """N-Gram AD minus AD on the same seed, in seed order."""
    ad = {t["seed"]: t["score"] for t in trials(data, model="ad", **keys)}
    ngram = {t["seed"]: t["score"] for t in trials(data, model="ngram_ad", **keys)}
    return [ngram[seed] - ad[seed] for seed in sorted(ad)]


def ahead(**keys) -> Callable:
    """On how many seeds N-Gram AD scored above AD."""

    def read(data):
        ad = {t["seed"]: t["score"] for t in trials(data, model="ad", **keys)}
        return sum(t["score"] > ad[t["seed"]] for t in trials(data, model="ngram_ad", **keys))

    return read


def ranged(values: Callable) -> Callable:
    """``[min, max]`` of a list of numbers."""
    return lambda data: [min(values(data)), max(values(data))]


def stats(*path) -> Callable:
    """``[mean, std]`` of a seed_stats dict at ``path``."""
    return lambda data: [at(*path)(data)["mean"], at(*path)(data)["std"]]


CLAIMS: list[Claim] = []


def claims(*entries: Claim) -> None:
    CLAIMS.extend(entries)


def success(model: str, **keys) -> Callable:
    def read(data):
        values = [t["success_rate"] for t in trials(data, model=model, **keys)]
        return [np.mean(values), np.std(values, ddof=1)]

    return read


# --- N-Gram AD, Dark Room (results README, sections 1 and 2, and the 10k check) ---------------------------

GOALS, DEFAULTS, GOALS_10K = "ngram-ad-goals.json", "ngram-ad-goals-defaults.json", "ngram-ad-goals-10k-steps.json"
for _goals in (10, 20, 30):
    claims(
        Claim(
            "results",
            f"| {_goals} | 0, 1, 2 | {{}} ± {{}} / {{}} ± {{}} / {{}} ± {{}} | {{}} ± {{}} / {{}} ± {{}} / "
            "{} ± {} |",
            GOALS,
            lambda d, g=_goals: [
                v for m in ("ad", "ngram_ad") for i in (0, 1, 3) for v in emp(m, i, num_train_tasks=g)(d)
            ],
        ),
        Claim(
            "results",
            f"| {_goals} | {{}} ± {{}} | {{}} ± {{}} | {{}} ± {{}} (",
            DEFAULTS,
            lambda d, g=_goals: [
                *scores("ad", num_train_tasks=g)(d),
                *scores("ngram_ad", num_train_tasks=g)(d),
                *paired(num_train_tasks=g)(d),
            ],
        ),
        Claim(
            "results",
            f"| {_goals} | {{}} ± {{}} | {{}} ± {{}} | {{}} ± {{}} ({{}} of 5{' seeds' if _goals == 10 else ''}) "
            f"| {{}} | {' / '.join(['{}'] * 5)} | {' / '.join(['{}'] * 5)} |",
            DEFAULTS,
            lambda d, g=_goals: [
                *scores("ad", num_train_tasks=g)(d),
                *scores("ngram_ad", num_train_tasks=g)(d),
                *paired(num_train_tasks=g)(d),
                ahead(num_train_tasks=g)(d),
                setting(d, num_train_tasks=g)["source"]["random_score"]["mean"],
                *per_seed("ad", num_train_tasks=g)(d),
                *per_seed("ngram_ad", num_train_tasks=g)(d),
            ],
        ),
    )
claims(
    Claim(
        "results",
        "| 10k | {} ± {} | {} ± {} | {} ± {} (3 of 4) | {} / {} / {} / {} | {} / {} / {} / {} |",
        GOALS_10K,
        lambda d: [
            *scores("ad")(d),
            *scores("ngram_ad")(d),
            *paired()(d),
            *per_seed("ad")(d),
            *per_seed("ngram_ad")(d),
        ],
    ),
)

# --- N-Gram AD, Key-to-Door ------------------------------------------------------------------------------

K2D, K2D_10K = "key-to-door-defaults.json", "key-to-door-10k-steps.json"
K2D_27X, K2D_27X_10K = "key-to-door-ad-27x-data.json", "key-to-door-ad-27x-data-10k-steps.json"
for _histories in (500, 750, 1000):
    claims(
        Claim(
            "results",
            f"| {_histories} | {{}} ± {{}} | {{}} ± {{}} | {{}} ± {{}} (",
            K2D,
            lambda d, h=_histories: [
                *scores("ad", num_histories=h)(d),
                *scores("ngram_ad", num_histories=h)(d),
                *paired(num_histories=h)(d),
            ],
        ),
    )
K2D_CURVE = "key-to-door-data-curve.json"


claims(
    Claim(
        "results",
        "| 50 | 5 | {} ± {} | {} ± {} | {} / {} / {} / {} / {} | {} / {} |",
        K2D_CURVE,
        lambda d: [
            *scores("ad", num_histories=50)(d),
            *scores("ngram_ad", num_histories=50)(d),
            *paired_per_seed(d, num_histories=50),
            success("ad", num_histories=50)(d)[0],
            success("ngram_ad", num_histories=50)(d)[0],
        ],
    ),
    Claim(
        "results",
        "ahead of AD on every seed, by {} ± {}",
        K2D_CURVE,
        paired(num_histories=50),
    ),
    Claim(
        "README",
        "on 50 histories it falls to {} ± {}, and N-Gram AD with it ({} ± {}",
        K2D_CURVE,
        lambda d: [*scores("ad", num_histories=50)(d), *scores("ngram_ad", num_histories=50)(d)],
    ),
)
claims(
    Claim(
        "results",
        "| {} ± {} | {} ± {} | return {} ± {}, success {} ± {} | {} of Q-learning's return |",
        K2D,
        lambda d: [
            *success("ad", num_histories=500)(d),
            *success("ngram_ad", num_histories=500)(d),
            *stats("settings", 0, "source", "source_final_return")(d),
            *stats("settings", 0, "source", "source_success_rate")(d),
            setting(d, num_histories=500)["source"]["random_score"]["mean"],
        ],
    ),
    Claim(
        "results",
        "| 2500 | AD | 100 | 13,500 (27x) | 5 | {} ± {} | {} ± {} | {} / {} / {} / {} / {} |",
        K2D_27X,
        lambda d: [
            *scores("ad", num_train_tasks=100)(d),
            *success("ad", num_train_tasks=100)(d),
            *per_seed("ad", num_train_tasks=100)(d),
        ],
    ),
    Claim(
        "results",
        "| 2500 | AD | 2048 | 13,500 (27x) | 5 | {} ± {} | {} ± {} | {} / {} / {} / {} / {} |",
        K2D_27X,
        lambda d: [
            *scores("ad", num_train_tasks=2048)(d),
            *success("ad", num_train_tasks=2048)(d),
            *per_seed("ad", num_train_tasks=2048)(d),
        ],
    ),
    Claim(
        "results",
        "| 10k | N-Gram AD | 100 | 500 | 5 | {} ± {} | {} ± {} | {} / {} / {} / {} / {} |",
        K2D_10K,
        lambda d: [*scores("ngram_ad")(d), *success("ngram_ad")(d), *per_seed("ngram_ad")(d)],
    ),
    Claim(
        "results",
        "| 10k | AD | 100 | 500 | 5 | {} ± {} | {} ± {} | {} / {} / {} / {} / {} |",
        K2D_10K,
        lambda d: [*scores("ad")(d), *success("ad")(d), *per_seed("ad")(d)],
    ),
    Claim(
        "results",
        "| 10k | AD | 100 | 13,500 (27x) | 5 | {} ± {} | {} ± {} | {} / {} / {} / {} / {} |",
        K2D_27X_10K,
        lambda d: [
            *scores("ad", num_train_tasks=100)(d),
            *success("ad", num_train_tasks=100)(d),
            *per_seed("ad", num_train_tasks=100)(d),
        ],
    ),
    Claim(
        "results",
        "| 10k | AD | 2048 | 13,500 (27x) | 5 | {} ± {} | {} ± {} | {} / {} / {} / {} / {} |",
        K2D_27X_10K,
        lambda d: [
            *scores("ad", num_train_tasks=2048)(d),
            *success("ad", num_train_tasks=2048)(d),
            *per_seed("ad", num_train_tasks=2048)(d),
        ],
    ),
    Claim(
        "results",
        "Q-learning's success rate on the held-out tasks {}-{} over the 5 seeds of the 100-goal split, "
        "{}-{} over those of the 2048-goal split",
        K2D_27X,
        lambda d: [
            *ranged(per_seed("ad", "source_success_rate", num_train_tasks=100))(d),
            *ranged(per_seed("ad", "source_success_rate", num_train_tasks=2048))(d),
        ],
    ),
    Claim(
        "results",
        "(random policy {}-{} of Q-learning's return, the mean over seeds of each setting;",
        K2D_27X,
        lambda d: sorted(np.mean(per_seed("ad", "random_score", num_train_tasks=n)(d)) for n in (100, 2048)),
    ),
    Claim(
        "results",
        "| 500 | {} / {} | {} / {} | return {}, success {} | {} of Q-learning's return (seed 0's",
        "archive/key-to-door.json",
        lambda d: [
            trials(d, model="ad", num_histories=500)[0]["score"],
            trials(d, model="ad", num_histories=500)[0]["success_rate"],
            trials(d, model="ngram_ad", num_histories=500)[0]["score"],
            trials(d, model="ngram_ad", num_histories=500)[0]["success_rate"],
            d["trials"][0]["source_final_return"],
            d["trials"][0]["source_success_rate"],
            trials(load(K2D), seed=0)[0]["random_score"],
        ],
    ),
)


@pytest.mark.parametrize("claim", CLAIMS, ids=str)
def test_quoted_number_matches_its_file(claim: Claim):
    check(claim)


claims(
    Claim(
        "results",
        "| 2500 | N-Gram AD | 100 | 500 | 5 | {} ± {} | {} ± {} | previous section |",
        K2D,
        lambda d: [*scores("ngram_ad", num_histories=500)(d), *success("ngram_ad", num_histories=500)(d)],
    ),
)

# --- Headless-AD: ablations, contextual bandits, Darkroom-125 ---------------------------------------------------

ABLATIONS = "archive/headless-ablations-reward-use.json"
for _name in ("preset", "separate action/reward/state tokens (paper)", "separate tokens with 3 layers", "4000 steps"):
    for _fraction in ("1.0", "0.35"):
        claims(
            Claim(
                "results",
                f"| {_name} | {_fraction} | {{}} ± {{}} | {{}} ± {{}} | {{}} ± {{}} | {{}} | {{}} |",
                ABLATIONS,
                lambda d, n=_name, f=_fraction: [
                    *(v for arms in ("4-20", "20", "50") for v in stats("ablations", n, "scores", f, arms)(d)),
                    at("ablations", n, "scores", f, "50", "mean")(d)
                    - at("ablations", n, "scores", f, "4-20", "mean")(d),
                    at("ablations", n, "reward_use", "gap")(d),
                ],
            ),
        )
claims(
    Claim(
        "results",
        "teacher-forced loss is nonetheless lower than that of every joint-token variant trained as long "
        "({} and {} against {}-{}, the preset {}; only the preset trained 4000 steps is lower, {})",
        ABLATIONS,
        lambda d: [
            at("ablations", "separate action/reward/state tokens (paper)", "reward_use", "loss")(d),
            at("ablations", "separate tokens with 3 layers", "reward_use", "loss")(d),
            min(
                e["reward_use"]["loss"] for n, e in d["ablations"].items() if "separate" not in n and n != "4000 steps"
            ),
            max(
                e["reward_use"]["loss"] for n, e in d["ablations"].items() if "separate" not in n and n != "4000 steps"
            ),
            at("ablations", "preset", "reward_use", "loss")(d),
            at("ablations", "4000 steps", "reward_use", "loss")(d),
        ],
    ),
    Claim(
        "results",
        "scores 0.03-0.12 on 50 arms when it samples at its training tau, and {}-{} at its best colder temperature",
        "archive/headless-ablations.json",
        lambda d: ranged(
            lambda d: [
                max(e["scores"][f]["50"]["mean"] for f in ("0.5", "0.25"))
                for n, e in d["ablations"].items()
                if "separate" not in n
            ]
        )(d),
    ),
    *(
        Claim(
            "results",
            "| 4-20 arms (training counts) | {} | {} |",
            name,
            occurrence=index,
            values=lambda d: [
                at("models", m, "scores", "4-20 arms", "normalized_score")(d) for m in ("headless_ad", "ad")
            ],
        )
        for index, name in enumerate(("headless-contextual.json", "archive/headless-contextual-6000-steps.json"))
    ),
    Claim(
        "results",
        "| 25 / 30 / 40 / 50 arms | {} / {} / {} / {} | n/a |",
        "archive/headless-contextual-6000-steps.json",
        lambda d: [at("models", "headless_ad", "scores", f"{n} arms", "normalized_score")(d) for n in (25, 30, 40, 50)],
    ),
    Claim(
        "results",
        "| reward use (shuffled - true loss, nats) | {} ({} - {}) | {} ({} - {}) |",
        "archive/headless-contextual-6000-steps.json",
        lambda d: [
            at("models", m, "reward_use", k)(d) for m in ("headless_ad", "ad") for k in ("gap", "shuffled_loss", "loss")
        ],
    ),
    *(
        Claim(
            "results",
            f"| {label} | {{}} | {{}} | {{}} |",
            name,
            occurrence=index if label != "train" else None,
            values=lambda d, s=set_name: [
                at("models", "headless_ad", "scores", s, "final_return")(d),
                at("models", "ad", "scores", s, "final_return")(d),
                at("models", "headless_ad", "scores", s, "random_final_return")(d),
            ],
        )
        for index, name in enumerate(("headless-darkroom.json", "headless-darkroom-12000-steps.json"))
        for label, set_name in (
            ("train (the training action sets)" if index == 0 else "train", "train"),
            ("permuted train", "permuted train"),
            ("sliced test", "sliced test"),
        )
    ),
)

# --- Markov heads -------------------------------------------------------------------------------------------

for _label, _horizon, _task in (
    ("Dark Room, goal visible", "short", "dark_room_visible"),
    ("Key-to-Door", "long", "key_to_door"),
    ("Dark Room, goal hidden", "long", "dark_room"),
):
    claims(
        Claim(
            "results",
            f"| {_label} | {_horizon} | {{}} ({{}}) | {{}} | {{}} +- {{}} | {{}} +- {{}} |",
            "cpu-markov.json",
            lambda d, t=_task: [
                at("summary", t, "10", "return_model", "mean")(d),
                at("summary", t, "10", "return_optimal", "mean")(d),
                at("summary", t, "10", "g_markov_at_init", "mean")(d),
                *stats("summary", t, "10", "g_markov")(d),
                *stats("summary", t, "10", "g_markov_state_tokens")(d),
            ],
        ),
    )

MEMORY = "markov-memory.json"


def memory_pair(corridor: int, k: int = 10, metric: str = "g_markov_state_tokens") -> Callable:
    """Visible minus hidden, paired by seed: mean, sd and the seeds with the paper's sign (visible above)."""

    def read(data):
        (pair,) = [p for p in data["memory_pairs"] if p["corridor_length"] == corridor and p["k"] == k]
        return [pair[metric]["mean"], pair[metric]["std"], sum(v > 0 for v in pair[metric]["values"])]

    return read


for _corridor in (2, 4, 8):
    claims(
        Claim(
            "results",
            f"| cue_visible, C = {_corridor} | 0 | {{}} ± {{}} | {{}} ± {{}} | |",
            MEMORY,
            lambda d, c=_corridor: [
                *stats("summary", f"cue_visible_C{c}", "10", "g_markov")(d),
                *stats("summary", f"cue_visible_C{c}", "10", "g_markov_state_tokens")(d),
            ],
        ),
        Claim(
            "results",
            f"| cue_hidden, C = {_corridor} | {_corridor} | {{}} ± {{}} | {{}} ± {{}} | {{}} ± {{}} ({{}}/5) |",
            MEMORY,
            lambda d, c=_corridor: [
                *stats("summary", f"cue_hidden_C{c}", "10", "g_markov")(d),
                *stats("summary", f"cue_hidden_C{c}", "10", "g_markov_state_tokens")(d),
                *memory_pair(c)(d),
            ],
        ),
    )

# --- Looped transformers (the 5000-step cpu preset) ------------------------------------------------------------

claims(
    Claim(
        "results",
        "| looped (b = 15), 52k parameters | {} | [{}, {}] |",
        "cpu-looped.json",
        lambda d: [at("evaluation", "error_at_k", "looped")(d), *at("evaluation", "error_at_k_90ci", "looped")(d)],
    ),
    Claim(
        "results",
        "| unlooped (4 layers), 202k parameters | {} | [{}, {}] |",
        "cpu-looped.json",
        lambda d: [at("evaluation", "error_at_k", "unlooped")(d), *at("evaluation", "error_at_k_90ci", "unlooped")(d)],
    ),
)


# --- every results file a README names exists, and parses ---------------------------------------------------

#: The families of files in benchmarks/results (a name in a README that starts with one of these is a results file).
PREFIXES = (
    "cpu-", "gpu-", "gym-", "headless-", "key-to-door", "markov-memory", "ngram-ad-goals", "main-job", "archive/",
)  # fmt: skip
#: Named as where a future run will write (the GPU runner's paper-goals stage), not yet made.
NOT_YET = {"ngram-ad-goals-paper.json", "ngram-ad-goals-paper.*"}
_NAME = re.compile(r"[\w./*-]+?\.(?:json|md|png|\*|\{[a-z,]+\})(?:/\.(?:json|md|png))*")


def named_results_files() -> set[str]:
    """Results file names (globs and ``{json,md}`` lists expanded later) in code spans and image links."""
    names = set()
    for text in (DOCS["README"].read_text(), DOCS["results"].read_text()):
        spans = re.findall(r"`([^`\n]+)`", text) + re.findall(r"\]\(([^)\s]+)\)", text)
        for span in spans:
            for name in _NAME.findall(span):
                name = name.removeprefix("benchmarks/results/")
                if name.startswith(PREFIXES) and name not in NOT_YET:
                    names.add(name)
    return names


def expand(name: str) -> list[str]:
    """``a.{json,md}`` and ``a.json/.md`` -> ``[a.json, a.md]``."""
    if "/." in name:
        first, *others = name.split("/.")
        return [first, *(f"{first.rpartition('.')[0]}.{extension}" for extension in others)]
    stem, _, suffix = name.rpartition(".")
    if suffix.startswith("{"):
        return [f"{stem}.{extension}" for extension in suffix.strip("{}").split(",")]
    return [name]


def test_every_named_results_file_exists_and_parses():
    names = named_results_files()
    assert len(names) > 40  # the READMEs name dozens; far fewer means the pattern broke
    missing, unreadable = [], []
    for name in sorted(names):
        for path_name in expand(name):
            found = [p for folder in (RESULTS, RESULTS / "archive") for p in folder.glob(path_name)]
            if not found:
                missing.append(path_name)
            for path in found:
                if path.suffix == ".json":
                    try:
                        json.loads(path.read_text())
                    except ValueError as error:
                        unreadable.append(f"{path.name}: {error}")
    assert not missing, f"named in a README but not in benchmarks/results (or archive/): {missing}"
    assert not unreadable, unreadable


def test_every_claimed_file_is_named_in_its_readme():
    """A claim's numbers come from a file its README names, so a reader can find them."""
    for claim in CLAIMS:
        stem = claim.file.removeprefix("archive/").removesuffix(".json")
        assert stem in DOCS[claim.doc].read_text(), f"{claim}: {claim.file} is not named in the {claim.doc} README"


# --- Headless-AD, held-out temperature selection -----------------------------------------------------------

BERNOULLI = "headless-bernoulli.json"
for _set in ("train means, 4-20 arms", "mirrored, 4-20 arms", "uniform, 4-20 arms", "uniform, 20 arms"):
    claims(
        Claim(
            "results",
            f"| {_set} | seen | {{}} ± {{}} | {{}} ± {{}} |",
            BERNOULLI,
            lambda d, s=_set: [*stats("models", "headless_ad", "scores", s)(d), *stats("models", "ad", "scores", s)(d)],
        ),
    )
for _set in ("uniform, 25 arms", "uniform, 30 arms", "uniform, 40 arms", "uniform, 50 arms"):
    claims(
        Claim(
            "results",
            f"| {_set} | unseen | {{}} ± {{}} | n/a",
            BERNOULLI,
            lambda d, s=_set: stats("models", "headless_ad", "scores", s)(d),
        ),
    )
claims(
    Claim(
        "results",
        "| reward use (nats) | | {} ± {} | {} ± {} | |",
        BERNOULLI,
        lambda d: [*stats("models", "headless_ad", "reward_use")(d), *stats("models", "ad", "reward_use")(d)],
    ),
    Claim(
        "results",
        "| Headless-AD ({} x tau) | AD ({} x its softmax) |",
        BERNOULLI,
        lambda d: [at("models", "headless_ad", "temperature")(d), at("models", "ad", "temperature")(d)],
    ),
    Claim(
        "results",
        "Headless-AD {} / {} / {} / {} ({} chosen), AD {} / {} / {} / {} ({} chosen",
        BERNOULLI,
        lambda d: [
            *(d["models"]["headless_ad"]["selection"][str(f)] for f in d["temperature_grid"]),
            d["models"]["headless_ad"]["temperature"],
            *(d["models"]["ad"]["selection"][str(f)] for f in d["temperature_grid"]),
            d["models"]["ad"]["temperature"],
        ],
    ),
    Claim("results", "the resuming process took {} s of CPU", BERNOULLI, at("cpu_seconds"), tolerance=0.5),
    Claim(
        "results",
        "Headless-AD scores {}-{} on 4-20 arms ({}-{} at 0.35)",
        BERNOULLI,
        lambda d: [
            *ranged(lambda d: [d["models"]["headless_ad"]["scores"][s]["mean"] for s in d["selection_sets"]])(d),
            *ranged(
                lambda _: [
                    load("archive/headless-bernoulli-3-seeds.json")["models"]["headless_ad"]["scores"][s]["mean"]
                    for s in d["selection_sets"]
                ]
            )(d),
        ],
    ),
    Claim(
        "results",
        "{} / {} / {} / {} on 25 / 30 / 40 / 50 arms ({}-{} at 0.35)",
        BERNOULLI,
        lambda d: [
            *(d["models"]["headless_ad"]["scores"][f"uniform, {n} arms"]["mean"] for n in (25, 30, 40, 50)),
            *ranged(
                lambda _: [
                    load("archive/headless-bernoulli-3-seeds.json")["models"]["headless_ad"]["scores"][
                        f"uniform, {n} arms"
                    ]["mean"]
                    for n in (25, 30, 40, 50)
                ]
            )(d),
        ],
    ),
)

# --- Induction heads --------------------------------------------------------------------------------------

INDUCTION = "cpu-induction-phase-change.json"
for _label, _variant in (
    ("1 layer", "1L"),
    ("1 layer, smeared keys", "1L-smear"),
    ("2 layers", "2L"),
    ("2 layers, smeared keys", "2L-smear"),
):
    claims(
        Claim(
            "results",
            f"| {_label} | {{}} ± {{}} | {{}} ± {{}} |",
            INDUCTION,
            lambda d, v=_variant: [
                *stats("summary", v, "final_best_induction")(d),
                *stats("summary", v, "final_repeat_loss")(d),
            ],
        ),
    )
claims(
    Claim(
        "results",
        "| 2 layers | {} ± {} | {} ± {} | {} / {} / {} |",
        INDUCTION,
        lambda d: [
            *stats("summary", "2L", "final_best_induction")(d),
            *stats("summary", "2L", "final_repeat_loss")(d),
            *at("summary", "2L", "induction_step")(d),
        ],
    ),
    Claim(
        "results",
        "(best score {}-{} over the seeds)",
        INDUCTION,
        lambda d: ranged(at("summary", "1L", "final_best_induction", "values"))(d),
    ),
    Claim("results", "{} s of CPU time (user + sys) for the 12 trainings", INDUCTION, at("cpu_seconds"), tolerance=0.5),
)


# --- the top-level README's results table ---------------------------------------------------------------------

claims(
    Claim(
        "README",
        "is above the random policy there and AD barely: {} and {} of Q-learning's return (random {};",
        DEFAULTS,
        lambda d: [
            scores("ngram_ad", num_train_tasks=10)(d)[0],
            scores("ad", num_train_tasks=10)(d)[0],
            setting(d, num_train_tasks=10)["source"]["random_score"]["mean"],
        ],
    ),
    Claim(
        "README",
        "Key-to-Door's AD does not fail on small data at the paper's 10k steps ({} ± {} on 500 histories",
        K2D_10K,
        scores("ad"),
    ),
    Claim(
        "README",
        "at 2500 steps N-Gram AD leads ({} against {},",
        K2D,
        lambda d: [scores("ngram_ad", num_histories=500)(d)[0], scores("ad", num_histories=500)(d)[0]],
    ),
    Claim(
        "README",
        "at the training temperature it scores {} on 50 arms",
        ABLATIONS,
        at("ablations", "preset", "scores", "1.0", "50", "mean"),
    ),
    Claim(
        "README",
        "with the seen arm counts only it samples at {} x tau (AD, given the same search, keeps its own), and then "
        "falls from {} on 25 arms to {} on 50",
        BERNOULLI,
        lambda d: [
            d["models"]["headless_ad"]["temperature"],
            *(d["models"]["headless_ad"]["scores"][f"uniform, {n} arms"]["mean"] for n in (25, 50)),
        ],
    ),
    Claim("README", "one seed, {} s of CPU) reaches", "main-job.json", at("cpu_seconds"), tolerance=0.5),
    Claim(
        "README",
        "s of CPU) reaches {} of Q-learning's return on the {} held-out goals",
        "main-job.json",
        lambda d: [d["summary"]["fraction_of_source"], d["summary"]["num_tasks"]],
    ),
)


# --- a gymnasium environment: FrozenLake-v1, and Taxi-v4 (gym-frozen-lake) ---------------------------------

GYM = "gym-frozen-lake.json"


def block_mean(run: str, first: int, last: int) -> Callable:
    """The model's mean return over in-context episodes ``first``-``last`` (1-based) of a run of the gym file."""
    return lambda data: float(np.mean(data[run]["evaluation"]["model_returns"][first - 1 : last]))


claims(
    Claim(
        "results",
        "rises from {} in its first 5 in-context episodes to {} in its last 5, {} of Q-learning's final return",
        GYM,
        lambda d: [
            block_mean("frozen_lake", 1, 5)(d),
            block_mean("frozen_lake", 36, 40)(d),
            d["frozen_lake"]["summary"]["fraction_of_source"],
        ],
    ),
    Claim(
        "results",
        "(random {}, optimum {}); {} s of CPU in all",
        GYM,
        lambda d: [
            d["frozen_lake"]["summary"]["random_final_return"],
            d["frozen_lake"]["evaluation"]["optimal_return"],
            d["frozen_lake"]["cpu_seconds"]["total"],
        ],
    ),
    Claim(
        "results",
        "normalised score {} on the {} held-out rain probabilities (0 random, 1 the source); {} s of CPU",
        GYM,
        lambda d: [
            d["taxi"]["summary"]["normalized_score"],
            d["taxi"]["summary"]["num_tasks"],
            d["taxi"]["cpu_seconds"]["total"],
        ],
    ),
)


# --- the looped transformer over seeds 0-2 (cpu-looped-20k) -------------------------------------------------

LOOPED_20K = "cpu-looped-20k.json"


def seed_row(*path) -> Callable:
    """``[mean, std, value per seed...]`` of a seed_stats dict at ``path``."""
    return lambda data: [*stats(*path)(data), *at(*path, "values")(data)]


claims(
    Claim(
        "results",
        "| looped (b = 15), 52k parameters | {} ± {} | {} | {} | {} |",
        LOOPED_20K,
        seed_row("summary", "error_at_k", "looped"),
    ),
    Claim(
        "results",
        "| unlooped (4 layers), 202k parameters | {} ± {} | {} | {} | {} |",
        LOOPED_20K,
        seed_row("summary", "error_at_k", "unlooped"),
    ),
    Claim(
        "results",
        "| looped - unlooped (paired by seed) | {} ± {} | {} | {} | {} |",
        LOOPED_20K,
        seed_row("summary", "looped_minus_unlooped"),
    ),
    Claim(
        "results",
        "| looped at 75 loops (5x b) | {} ± {} | {} | {} | {} |",
        LOOPED_20K,
        seed_row("summary", "error_at_max_loops"),
    ),
)


# --- the Cue Corridor over seeds 0-9 (markov-memory-10-seeds) --------------------------------------------------

MEMORY_10 = "markov-memory-10-seeds.json"


def hidden_g_markov(corridor: int, *ks: int, task: str = "cue_hidden") -> Callable:
    return lambda d: [at("summary", f"{task}_C{corridor}", str(k), "g_markov", "mean")(d) for k in ks]


def pair_row(corridor: int, k: int) -> Callable:
    """A row of the results table: hidden-cue success (mean ± sd), then both visible - hidden differences."""

    def read(data):
        success = at("summary", f"cue_hidden_C{corridor}", str(k), "success_rate")(data)
        return [success["mean"], success["std"], *memory_pair(corridor, k, "g_markov")(data),
                *memory_pair(corridor, k)(data)]  # fmt: skip

    return read


claims(
    Claim(
        "README",
        "G_Markov rises with k at C = 16 ({} -> {} from k = 10 to 20, 10 seeds,",
        MEMORY_10,
        hidden_g_markov(16, 10, 20),
    ),
    Claim("results", "| 8 | 10 | {} ± {} | {} ± {} ({}/10) | {} ± {} ({}/10) |", MEMORY_10, pair_row(8, 10)),
    Claim(
        "results",
        "| 16 | 10 | {} ± {} (chance: the cue is out of reach) | {} ± {} ({}/10) | {} ± {} ({}/10) |",
        MEMORY_10,
        pair_row(16, 10),
    ),
    Claim("results", "| 16 | 20 | {} ± {} | {} ± {} ({}/10) | {} ± {} ({}/10) |", MEMORY_10, pair_row(16, 20)),
    Claim(
        "results",
        "all tokens): {} -> {} on the hidden task and {} -> {} on the visible control",
        MEMORY_10,
        lambda d: [*hidden_g_markov(16, 10, 20)(d), *hidden_g_markov(16, 10, 20, task="cue_visible")(d)],
    ),
)


# --- G_Markov against k at C = 4 over seeds 0-9 (markov-k-sweep-c4) ------------------------------------------

K_SWEEP_C4 = "markov-k-sweep-c4.json"


def fall_with_k(data) -> list[float]:
    """G_Markov (all tokens) at k = 5 minus at k = 10 per seed: mean, sd, and on how many seeds it falls."""
    at_5, at_10 = (at("summary", "cue_hidden_C4", str(k), "g_markov", "values")(data) for k in (5, 10))
    falls = [a - b for a, b in zip(at_5, at_10, strict=True)]
    return [np.mean(falls), np.std(falls, ddof=1), sum(f > 0 for f in falls)]


def k_row(k: int) -> Callable:
    def read(data):
        entry = at("summary", "cue_hidden_C4", str(k))(data)
        return [entry[name][stat] for name in ("success_rate", "g_markov", "g_markov_state_tokens")
                for stat in ("mean", "std")]  # fmt: skip

    return read


claims(
    Claim("results", "| 5 | {} ± {} | {} ± {} | {} ± {} |", K_SWEEP_C4, k_row(5)),
    Claim("results", "| 10 | {} ± {} | {} ± {} | {} ± {} |", K_SWEEP_C4, k_row(10)),
    Claim(
        "results",
        "the fall k = 5 minus k = 10 is {} ± {} over 10 seeds, 95% CI [-0.128, +0.013], falling on {} of 10 seeds",
        K_SWEEP_C4,
        fall_with_k,
    ),
)
claims(
    Claim(
        "README",
        "at C = 4 either ({} -> {} from k = 5 to 10;",
        K_SWEEP_C4,
        lambda d: [at("summary", "cue_hidden_C4", str(k), "g_markov", "mean")(d) for k in (5, 10)],
    ),
)


# --- the looped transformer, seeds 3-4 and the five-seed verdicts (cpu-looped-20k-seeds-3-4) -------------------

LOOPED_34 = "cpu-looped-20k-seeds-3-4.json"


def five_seeds(*path) -> Callable:
    """Mean, sd and the 95% t-interval of a per-seed value over seeds 0-2 (cpu-looped-20k) and 3-4."""

    def read(data):
        values = [*at(*path, "values")(load(LOOPED_20K)), *at(*path, "values")(data)]
        mean, sd = np.mean(values), np.std(values, ddof=1)
        half = 2.776 * sd / np.sqrt(len(values))
        return [mean, sd, mean - half, mean + half]

    return read


def flat_five_seeds(data) -> list[float]:
    runs = [*load(LOOPED_20K)["per_seed"].values(), *data["per_seed"].values()]
    values = [r["extrapolation"]["error_at_max_loops"] - r["extrapolation"]["error_at_trained_loops"] for r in runs]
    mean, sd = np.mean(values), np.std(values, ddof=1)
    half = 2.776 * sd / np.sqrt(len(values))
    return [mean, sd, mean - half, mean + half]


claims(
    Claim("results", "| looped (b = 15) | {} ± {} | {} | {} |", LOOPED_34, seed_row("summary", "error_at_k", "looped")),
    Claim(
        "results",
        "| unlooped (4 layers) | {} ± {} | {} | {} |",
        LOOPED_34,
        seed_row("summary", "error_at_k", "unlooped"),
    ),
    Claim(
        "results",
        "| looped - unlooped (paired by seed) | {} ± {} | {} | {} |",
        LOOPED_34,
        seed_row("summary", "looped_minus_unlooped"),
        occurrence=1,  # the seeds 0-2 table has the same row first
    ),
    Claim(
        "results",
        "| looped at 75 loops (5x b) | {} ± {} | {} | {} |",
        LOOPED_34,
        seed_row("summary", "error_at_max_loops"),
        occurrence=1,  # the seeds 0-2 table has the same row first
    ),
    Claim(
        "results",
        "looped minus unlooped is {} ± {} (n = 5), 95% CI [{}, {}]",
        LOOPED_34,
        five_seeds("summary", "looped_minus_unlooped"),
    ),
    Claim("results", "75 loops minus 15 loops is {} ± {} (n = 5), 95% CI [{}, {}]", LOOPED_34, flat_five_seeds),
)
