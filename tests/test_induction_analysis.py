"""Induction-head analysis: metrics on hand-built attention patterns with known scores, pattern capture
against the fused forwards, head ablation, and smoke runs of the experiment and the AD report.

Kernels are not the point here: models pin ``backend="eager"``.
"""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch

from icrl_kernels.modules.smeared_attention import SmearedKeyAttention
from icrl_kernels.ngram.reference import ngram_match_matrix
from icrl_models.analysis import (
    ablate_heads,
    attention_sites,
    capture_attention,
    detection_patterns,
    detection_score,
    head_ablation_importance,
    head_ov_weights,
    in_context_learning_score,
    offset_score,
    ov_copying_score,
    repeat_scores,
    repeated_random_tokens,
    uniform_causal_pattern,
)
from icrl_models.analysis.induction import causal_self_attention_pattern
from icrl_models.config import config_from_args
from icrl_models.experiments.induction_heads import (
    UNIFORM_BASELINE,
    AttentionOnlyTransformer,
    InductionConfig,
    ad_report,
    build_parser,
    format_ad_report,
    main,
    repeated_segments,
    run_experiment,
)
from icrl_models.models import ADConfig, ADModel
from icrl_models.train import TrainConfig, train

# --- hand-built patterns ---------------------------------------------------------------------------


def uniform_causal(length: int) -> torch.Tensor:
    """Every query spreads its attention evenly over itself and all earlier keys."""
    return uniform_causal_pattern(1, length)[0, 0].clone()


def stripe(length: int, offset: int, first_query: int | None = None) -> torch.Tensor:
    """Queries ``i >= first_query`` (default ``offset``) attend only to ``i - offset``; earlier ones uniformly."""
    pattern = uniform_causal(length)
    for i in range(offset if first_query is None else first_query, length):
        pattern[i] = 0
        pattern[i, i - offset] = 1
    return pattern


def heads_pattern(seq_len: int, batch: int = 2) -> torch.Tensor:
    """``[B, 4, 2T, 2T]``: a previous-token, a duplicate-token, an induction and a uniform head.

    The induction head has a target from the second repeat on (query ``T - 1`` ends the first copy).
    """
    length = 2 * seq_len
    induction = stripe(length, seq_len - 1, first_query=seq_len)
    heads = [stripe(length, 1), stripe(length, seq_len), induction, uniform_causal(length)]
    return torch.stack(heads).expand(batch, -1, -1, -1)


def test_repeat_scores_second_repeat_convention():
    seq_len = 7
    scores = repeat_scores(heads_pattern(seq_len), seq_len)
    uniform = sum(1 / (i + 1) for i in range(seq_len, 2 * seq_len)) / seq_len  # mass 1/(i+1) on any one key
    torch.testing.assert_close(scores["previous_token"], torch.tensor([1.0, 0.0, 0.0, uniform]))
    torch.testing.assert_close(scores["duplicate_token"], torch.tensor([0.0, 1.0, 0.0, uniform]))
    torch.testing.assert_close(scores["induction"], torch.tensor([0.0, 0.0, 1.0, uniform]))


def test_repeat_scores_diagonal_convention_is_transformer_lens_stripe_mean():
    """``convention="diagonal"``: the mean of ``pattern.diagonal(-offset)``, first-repeat queries included."""
    seq_len = 6
    pattern = heads_pattern(seq_len)
    scores = repeat_scores(pattern, seq_len, convention="diagonal")
    for name, offset in (("previous_token", 1), ("duplicate_token", seq_len), ("induction", seq_len - 1)):
        expected = pattern.diagonal(offset=-offset, dim1=-2, dim2=-1).mean(dim=(0, 2))
        torch.testing.assert_close(scores[name], expected)
    # The induction head's stripe gains query T - 1, which spreads 1/T over the first repeat.
    assert scores["induction"][2].item() == pytest.approx((seq_len + 1 / seq_len) / (seq_len + 1))
    # The duplicate stripe only has second-repeat queries: both conventions agree.
    torch.testing.assert_close(scores["duplicate_token"], repeat_scores(pattern, seq_len)["duplicate_token"])


def test_offset_score_first_query_and_errors():
    pattern = stripe(9, 2).expand(1, 1, 9, 9)
    assert offset_score(pattern, 2).item() == pytest.approx(1.0)
    assert offset_score(pattern, 0, first_query=1).item() == pytest.approx(1 / 2 / 8)  # only query 1 keeps mass
    with pytest.raises(ValueError, match="no query"):
        offset_score(pattern, 9)
    with pytest.raises(ValueError, match=r"\[B, H, L, L\]"):
        offset_score(pattern[0], 1)
    with pytest.raises(ValueError, match="convention"):
        repeat_scores(pattern, 3, convention="tl")
    with pytest.raises(ValueError, match="L >= 2 \\* seq_len"):
        repeat_scores(pattern, 5)


def test_detection_patterns_by_hand():
    ids = torch.tensor([[3, 1, 3, 1, -1, 3]])
    patterns = {name: p[0].nonzero().tolist() for name, p in detection_patterns(ids).items()}
    assert patterns["previous_token"] == [[i, i - 1] for i in range(1, 6)]
    assert patterns["duplicate_token"] == [[2, 0], [3, 1], [5, 0], [5, 2]]  # padding (-1) matches nothing
    # Keys whose previous token is the query's token: query 5 (token 3) -> keys 1 and 3 (after the 3s).
    assert patterns["induction"] == [[2, 1], [3, 2], [5, 1], [5, 3]]


def test_detection_score_on_repeated_tokens():
    """TransformerLens' "mul" score: a perfect induction head on two repeats scores 1/2 (first-repeat
    queries have no target but count in the denominator); the n-gram n = 1 pattern is the induction
    detection pattern itself, so it scores 1."""
    seq_len = 8
    ids = repeated_random_tokens(3, seq_len, 20, generator=torch.Generator().manual_seed(0))
    perfect = stripe(2 * seq_len, seq_len - 1, first_query=seq_len).expand(3, 1, -1, -1)
    induction = detection_patterns(ids)["induction"]
    assert detection_score(perfect, induction).item() == pytest.approx(0.5)
    # Only the uniform first-repeat queries 1..T-1 put mass (1 / (i + 1)) on their previous key.
    previous = sum(1 / (i + 1) for i in range(1, seq_len)) / (2 * seq_len)
    assert detection_score(perfect, detection_patterns(ids)["previous_token"]).item() == pytest.approx(previous)
    match = ngram_match_matrix(ids, 1).float()
    ngram = (match / match.sum(-1, keepdim=True).clamp(min=1)).unsqueeze(1)
    # Rows without a match are zero, so the score is the fraction of matched rows' mass: all of it.
    assert detection_score(ngram, induction).item() == pytest.approx(1.0)


def test_repeated_random_tokens():
    gen = torch.Generator().manual_seed(1)
    tokens = repeated_random_tokens(4, 9, 11, repeats=3, generator=gen)
    assert tokens.shape == (4, 27)
    assert torch.equal(tokens[:, :9], tokens[:, 9:18]) and torch.equal(tokens[:, :9], tokens[:, 18:])
    assert all(len(set(row[:9].tolist())) == 9 for row in tokens)  # distinct within a copy
    assert int(tokens.max()) < 11 and int(tokens.min()) >= 0
    with pytest.raises(ValueError, match="vocab_size >= seq_len"):
        repeated_random_tokens(1, 12, 11)
    loose = repeated_random_tokens(2, 30, 3, distinct=False, generator=gen)
    assert loose.shape == (2, 60) and set(loose.unique().tolist()) <= {0, 1, 2}


def test_in_context_learning_score():
    losses = torch.tensor([[4.0, 3.0, 1.0, 0.5], [4.2, 2.0, 1.0, 0.1]])
    assert in_context_learning_score(losses, early=0, late=3) == pytest.approx(0.3 - 4.1)
    with pytest.raises(ValueError, match="positions"):
        in_context_learning_score(losses, early=0, late=4)


def test_ov_copying_score_known_circuits():
    """Identity circuit: +1 (copies); negated: -1 (suppresses); a 90 degree rotation: eigenvalues +-i, 0."""
    eye = torch.eye(4)
    assert ov_copying_score(eye, eye, eye, eye) == pytest.approx(1.0)
    assert ov_copying_score(eye, eye, -eye, eye) == pytest.approx(-1.0)
    rotation = torch.tensor([[0.0, -1.0], [1.0, 0.0]])
    assert ov_copying_score(torch.eye(2), rotation, torch.eye(2), torch.eye(2)) == pytest.approx(0.0, abs=1e-12)


def test_ov_copying_score_matches_full_circuit_eigenvalues():
    """The small [Dh, Dh] decomposition gives the score of the full [V, V] circuit."""
    gen = torch.Generator().manual_seed(2)
    d_model, head_dim, vocab = 12, 3, 17
    embed, unembed = torch.randn(d_model, vocab, generator=gen), torch.randn(vocab, d_model, generator=gen)
    value, output = torch.randn(head_dim, d_model, generator=gen), torch.randn(d_model, head_dim, generator=gen)
    full = unembed.double() @ output.double() @ value.double() @ embed.double()
    eigenvalues = torch.linalg.eigvals(full)
    expected = (eigenvalues.sum().real / eigenvalues.abs().sum()).item()  # V - Dh eigenvalues are ~0
    assert ov_copying_score(embed, value, output, unembed) == pytest.approx(expected, abs=1e-9)
    with pytest.raises(ValueError, match="square"):
        ov_copying_score(embed, value, output, unembed[:-1])


# --- capture, ablation ----------------------------------------------------------------------------


def test_capture_reproduces_the_fused_forward_of_ad_attention():
    """The recomputed AD pattern (RoPE, causal or banded) applied to the values equals the SDPA forward."""
    torch.manual_seed(3)
    model = ADModel(ADConfig(num_states=9, seq_len=16, d_model=24, num_heads=3, num_layers=1, backend="eager")).eval()
    attention = model.blocks[0].mixer
    x = torch.randn(2, 13, 24)
    positions = torch.arange(13).expand(2, 13)
    for window in (None, 5):
        pattern = causal_self_attention_pattern(attention, x, positions, window)
        _, _, v = attention._project(x, positions)
        merged = (pattern @ v).transpose(1, 2).reshape(2, 13, 24)
        torch.testing.assert_close(attention.out(merged), attention(x, positions, window), rtol=1e-5, atol=1e-6)
        if window is not None:
            assert not pattern.tril(-window).any(), "keys beyond the window get no attention"


def test_capture_attention_on_ngram_ad():
    torch.manual_seed(4)
    config = ADConfig(num_states=5, seq_len=20, d_model=16, num_heads=2, num_layers=1, ngram_sizes=(1, 2),
                      backend="eager")  # fmt: skip
    model = ADModel(config).eval()
    gen = torch.Generator().manual_seed(5)
    states = torch.randint(0, 5, (3, 20), generator=gen)
    actions = torch.randint(-1, 5, (3, 20), generator=gen)
    rewards = torch.randint(0, 2, (3, 20), generator=gen).float()
    with torch.no_grad():
        plain = model(states, actions, rewards)
        with capture_attention(model) as patterns:
            captured = model(states, actions, rewards)
    torch.testing.assert_close(captured, plain)  # hooks do not change the forward
    assert list(patterns) == ["blocks.0.mixer", "blocks.1.mixer", "blocks.2.mixer"]
    assert patterns["blocks.2.mixer"].shape == (3, 2, 20, 20)
    for name, n in (("blocks.0.mixer", 1), ("blocks.1.mixer", 2)):
        match = ngram_match_matrix(states, n)
        assert patterns[name].shape == (3, 1, 20, 20)
        assert torch.equal(patterns[name][:, 0] > 0, match)
    with torch.no_grad():
        model(states, actions, rewards)
    assert all(not module._forward_hooks for module in model.modules()), "hooks removed on exit"


def test_ablate_heads_removes_exactly_one_head():
    torch.manual_seed(6)
    layer = SmearedKeyAttention(12, 3, smear=True, bias=True, backend="eager")
    model = torch.nn.Sequential(layer)
    x = torch.randn(2, 7, 12)
    with torch.no_grad():
        pattern = layer.attention_pattern(x)
        _, _, v = layer.project(x)
        heads = pattern @ v
        heads[:, 1] = 0
        expected = layer.merge_heads(heads)
        with ablate_heads(model, {"0": [1]}):
            ablated = model(x)
        intact = model(x)
    torch.testing.assert_close(ablated, expected, rtol=1e-5, atol=1e-6)
    assert not torch.allclose(intact, ablated)
    torch.testing.assert_close(intact, layer(x))
    with pytest.raises(ValueError, match="no attention site"):
        with ablate_heads(model, {"1": [0]}):
            pass
    with pytest.raises(ValueError, match="out of range"):
        with ablate_heads(model, {"0": [3]}):
            pass


def test_head_ablation_importance():
    """Importance of a head = metric with the head zeroed minus the intact metric, per site and head."""
    torch.manual_seed(7)
    model = AttentionOnlyTransformer(10, 12, 8, 2, 2, smear=False, backend="eager")
    tokens = torch.randint(0, 10, (2, 12), generator=torch.Generator().manual_seed(8))

    def metric() -> float:
        with torch.no_grad():
            return model(tokens).square().mean().item()

    importance = head_ablation_importance(model, metric)
    assert list(importance) == ["layers.0", "layers.1"] and all(len(v) == 2 for v in importance.values())
    with ablate_heads(model, {"layers.1": [0]}):
        expected = metric()
    assert importance["layers.1"][0] == pytest.approx(expected - metric())
    assert any(abs(value) > 0 for values in importance.values() for value in values)


def test_head_ov_weights_and_copying_scores():
    torch.manual_seed(9)
    model = AttentionOnlyTransformer(10, 8, 8, 2, 1, smear=True, backend="eager")
    (site,) = attention_sites(model)
    weights = head_ov_weights(site.module)
    assert len(weights) == 2 and weights[0][0].shape == (4, 8) and weights[0][1].shape == (8, 4)
    # Head 1's value rows and output columns, read straight from the fused projections.
    torch.testing.assert_close(weights[1][0], site.module.qkv.weight[16 + 4 : 16 + 8])
    torch.testing.assert_close(weights[1][1], site.module.out.weight[:, 4:8])
    scores = model.copying_scores()["layers.0"]
    assert len(scores) == 2 and all(-1 <= s <= 1 for s in scores)
    with pytest.raises(TypeError, match="SmearedKeyAttention or CausalSelfAttention"):
        head_ov_weights(torch.nn.Linear(2, 2))


# --- experiment and AD report ----------------------------------------------------------------------


def _tiny_experiment(tmp_path, **overrides) -> InductionConfig:
    settings = dict(
        variants="1L,2L-smear", vocab_size=16, context_len=16, min_period=3, max_period=6, d_model=16, num_heads=2,
        steps=4, batch_size=4, warmup_steps=2, eval_every=2, eval_batch=4, eval_seq_len=6, backend="eager",
        out_dir=str(tmp_path / "induction"), progress=False,
    )  # fmt: skip
    settings.update(overrides)
    return InductionConfig(**settings)


def test_repeated_segments_are_periodic():
    tokens = repeated_segments(5, 40, 30, 3, 9, generator=torch.Generator().manual_seed(10))
    for row in tokens.tolist():
        period = next(p for p in range(3, 10) if all(row[i] == row[i % p] for i in range(40)))
        assert len(set(row[:period])) == period  # distinct inside one period


def test_experiment_smoke(tmp_path):
    report = run_experiment(_tiny_experiment(tmp_path))
    written = json.loads((tmp_path / "induction" / "induction.json").read_text())
    assert (tmp_path / "induction" / "induction.png").stat().st_size > 0
    assert set(written["summary"]) == {"1L", "2L-smear"}
    result = report["results"]["2L-smear"]
    assert result["curves"]["step"] == [0, 2, 4]
    assert set(result["final"]["scores"]) == {"layers.0", "layers.1"}
    assert len(result["final"]["scores"]["layers.1"]["induction"]) == 2
    assert set(result["final"]["smear_weight"]) == {"layers.0", "layers.1"}
    assert report["results"]["1L"]["final"]["smear_weight"] == {}
    assert math.isfinite(result["final"]["icl_score"])


def test_rerun_reuses_each_variants_result(tmp_path, monkeypatch):
    """Each variant's result is kept in ``runs/``: a rerun (or a resumed sweep) trains nothing, and a
    changed setting trains again."""
    import icrl_models.experiments.induction_heads as induction

    first = run_experiment(_tiny_experiment(tmp_path))
    runs = tmp_path / "induction" / "runs"
    assert sorted(path.name for path in runs.glob("*.json")) == ["1L.json", "2L-smear.json"]
    assert sorted(path.name for path in runs.iterdir() if path.is_dir()) == ["1L", "2L-smear"]  # run folders

    def no_training(*args, **kwargs):
        raise AssertionError("a finished variant was trained again")

    monkeypatch.setattr(induction, "train_variant", no_training)
    again = run_experiment(_tiny_experiment(tmp_path))
    assert json.loads(json.dumps(again["summary"])) == json.loads(json.dumps(first["summary"]))
    with pytest.raises(AssertionError, match="trained again"):
        run_experiment(_tiny_experiment(tmp_path, steps=6))


def test_seeds_run_each_seed_and_summarise(tmp_path, monkeypatch):
    """``seeds``: one single-seed experiment per seed in ``seed<N>/`` (an earlier ``--seed N`` run there is
    reused), then ``induction.json`` / ``.md`` over all seeds with every seed's report and mean ± sd."""
    import icrl_models.experiments.induction_heads as induction

    out = tmp_path / "induction"
    single = run_experiment(_tiny_experiment(tmp_path, seed=1, out_dir=str(out / "seed1")))
    calls = []
    original = induction.train_variant
    monkeypatch.setattr(induction, "train_variant", lambda name, *a, **k: calls.append(name) or original(name, *a, **k))
    report = run_experiment(_tiny_experiment(tmp_path, seeds=(0, 1)))
    assert calls == ["1L", "2L-smear"]  # seed 0 only: seed 1's folder holds its results
    written = json.loads((out / "induction.json").read_text())
    assert written["seeds"] == [0, 1] and set(written["per_seed"]) == {"0", "1"}
    assert written["per_seed"]["1"]["summary"] == json.loads(json.dumps(single["summary"]))
    scores = [written["per_seed"][s]["summary"]["2L-smear"]["final_best_induction"]["score"] for s in ("0", "1")]
    stats = report["summary"]["2L-smear"]["final_best_induction"]
    assert stats["values"] == scores and stats["n"] == 2 and stats["mean"] == pytest.approx(sum(scores) / 2)
    assert written["per_seed"]["0"]["config"]["seed"] == 0 and written["cpu_seconds"] > 0
    table = (out / "induction.md").read_text()
    assert f"| 2L-smear | {stats['mean']:.2f} ± {stats['std']:.2f} (n=2) |" in table
    assert (out / "induction.png").stat().st_size > 0 and (out / "seed0" / "induction.json").exists()
    with pytest.raises(ValueError, match="seeds"):
        _tiny_experiment(tmp_path, seeds=(-1,))


def test_experiment_cli_and_config_errors(tmp_path, capsys):
    out = tmp_path / "cli"
    assert main(["--variants", "1L-smear", "--steps", "2", "--eval-every", "1", "--vocab-size", "12",
                 "--context-len", "12", "--min-period", "3", "--max-period", "5", "--eval-seq-len", "5",
                 "--d-model", "8", "--num-heads", "2", "--eval-batch", "2", "--batch-size", "2",
                 "--backend", "eager", "--out-dir", str(out), "--no-progress"]) == 0  # fmt: skip
    assert "1L-smear" in capsys.readouterr().out and (out / "induction.json").exists()
    assert main(["--variants", "1L", "--steps", "2", "--eval-every", "1", "--vocab-size", "12", "--context-len", "12",
                 "--min-period", "3", "--max-period", "5", "--eval-seq-len", "5", "--d-model", "8", "--num-heads", "2",
                 "--eval-batch", "2", "--batch-size", "2", "--backend", "eager", "--out-dir", str(tmp_path / "seeds"),
                 "--no-progress", "--seeds", "0", "1"]) == 0  # fmt: skip
    assert "| 1L |" in capsys.readouterr().out
    # The command as the user typed it (the default subcommand is not added), also atop induction.md.
    written = json.loads((out / "induction.json").read_text())
    assert written["command"].startswith("icrl-induction --variants 1L-smear --steps 2 ") and written["machine"]
    assert (out / "induction.md").read_text().startswith(f"Command: `{written['command']}`")
    assert main(["--variants", "3X", "--out-dir", str(out)]) == 2
    assert "icrl-induction: error: variants: each variant must look like 1L" in capsys.readouterr().err
    assert main(["--variants", "1L", "2X", "--out-dir", str(out)]) == 2
    assert "got '2X'" in capsys.readouterr().err
    with pytest.raises(ValueError, match="eval_seq_len"):
        _tiny_experiment(tmp_path, eval_seq_len=9)


def test_variants_list_flag_and_older_comma_strings(tmp_path):
    parser = build_parser()
    listed = parser.parse_args(["phase-change", "--variants", "1L", "2L-smear"])
    comma = parser.parse_args(["phase-change", "--variants", "1L,2L-smear"])
    assert config_from_args(InductionConfig, listed) == config_from_args(InductionConfig, comma)
    # Python callers and induction.json files of older runs hold the comma string, newer ones a list.
    old, new = _tiny_experiment(tmp_path), _tiny_experiment(tmp_path, variants=["1L", "2L-smear"])
    assert old == new and old.variants == ("1L", "2L-smear")
    assert InductionConfig(**json.loads(json.dumps(dataclasses.asdict(old)))) == old
    assert old.variant_specs() == [("1L", 1, False), ("2L-smear", 2, True)]
    assert InductionConfig().variants == ("1L", "1L-smear", "2L", "2L-smear")
    with pytest.raises(ValueError, match="variants must name at least one model"):
        _tiny_experiment(tmp_path, variants="")


def test_ad_report_smoke(tmp_path):
    """A two-step N-Gram AD run, then its report: the n = 1 block's pattern *is* the induction detection
    pattern of state ids, so its natural induction detection score is exactly 1."""
    config = TrainConfig(
        num_histories=12, source_episodes=12, seq_len=40, d_model=16, num_heads=2, num_layers=1, ngram_sizes="1",
        episode_subsample=2, steps=2, batch_size=4, warmup_steps=1, log_every=1, eval_episodes=1,
        eval_envs_per_task=1, eval_tasks=2, backend="eager", out_dir=str(tmp_path / "run"), progress=False,
    )  # fmt: skip
    train(config)
    report = ad_report(tmp_path / "run", repeat_episodes=1, num_windows=3)
    assert report["episode_length"] == 20 and report["repeat_len"] == 20 and report["num_windows"] == 3
    assert set(report["repeated_episodes"]) == {"blocks.0.mixer", "blocks.1.mixer", UNIFORM_BASELINE}
    # Uniform causal attention over 2T = 40 tokens puts 1 / (i + 1) on any one key of query i.
    uniform = sum(1 / (i + 1) for i in range(20, 40)) / 20
    assert report["repeated_random"][UNIFORM_BASELINE]["induction"] == [pytest.approx(uniform)]
    assert len(report["repeated_random"]["blocks.1.mixer"]["induction"]) == 2
    assert report["natural"]["detection_scores"]["blocks.0.mixer"]["induction"] == [pytest.approx(1.0)]
    assert len(report["natural"]["head_importance_action_loss"]["blocks.1.mixer"]) == 2
    assert "blocks.1.mixer" in format_ad_report(report)
