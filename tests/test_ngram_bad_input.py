"""Bad input to the public n-gram API: every case raises ValueError/TypeError naming the argument, or
(where the input is merely unusual) gives the reference's result.

One table of ``(description, call, expected exception, substring of its message)``.
"""

from __future__ import annotations

import pytest
import torch

from icrl_kernels import (
    NGramAttention,
    NGramDecodeState,
    NGramPlan,
    ngram_attention,
    ngram_attention_reference,
    ngram_match_matrix,
    ngram_plan,
    transition_ids,
)
from icrl_kernels.testing import assert_close_rel

B, L, D = 2, 9, 4
IDS = torch.randint(0, 3, (B, L), generator=torch.Generator().manual_seed(0))
H = torch.randn(B, L, D, generator=torch.Generator().manual_seed(1))


def _plan(**changes):
    plan = ngram_plan(IDS, 2)
    fields = {"perm": plan.perm, "meta": plan.meta, "count": plan.count, "ids": plan.ids, "n": plan.n} | changes
    return lambda: NGramPlan(fields["perm"], fields["meta"], fields["count"], ids=fields["ids"], n=fields["n"])


def _state(**changes):
    args = {"batch_size": B, "dim": D, "n": 2, "max_len": L} | changes
    return lambda: NGramDecodeState(**args)


def _step(h_t, ids_t, **state_args):
    def call():
        state = NGramDecodeState(B, D, 2, L, **state_args)
        return state.step(h_t, ids_t)

    return call


def _reset(rows):
    return lambda: NGramDecodeState(B, D, 2, L).reset(rows)


def _transition(states=IDS, actions=IDS, rewards=IDS, **sizes):
    sizes = {"num_states": 3, "num_actions": 3, "num_rewards": 3} | sizes
    return lambda: transition_ids(states, actions, rewards, **sizes)


META = torch.device("meta")
BAD = [
    # ngram_attention: h
    ("h list", lambda: ngram_attention(H.tolist(), IDS, 2), TypeError, "h must be a torch.Tensor"),
    ("h 2-D", lambda: ngram_attention(H[0], IDS, 2), ValueError, "h must be 3-D"),
    ("h int", lambda: ngram_attention(H.long(), IDS, 2), TypeError, "h must have dtype"),
    ("h D=0", lambda: ngram_attention(H[:, :, :0], IDS, 2), ValueError, "h must have a non-empty feature"),
    ("h other L", lambda: ngram_attention(H[:, :5], IDS, 2), ValueError, "ids must have shape h.shape[:2]"),
    ("h other B", lambda: ngram_attention(H[:1], IDS, 2), ValueError, "ids must have shape h.shape[:2]"),
    ("h on meta", lambda: ngram_attention(H.to(META), IDS, 2), ValueError, "ids is on cpu but h is on meta"),
    # ngram_attention: ids
    ("ids float", lambda: ngram_attention(H, IDS.float(), 2), TypeError, "ids must have dtype"),
    ("ids bool", lambda: ngram_attention(H, IDS > 0, 2), TypeError, "ids must have dtype"),
    ("ids 1-D", lambda: ngram_attention(H, IDS[0], 2), ValueError, "ids must be 2-D"),
    ("ids 3-D", lambda: ngram_attention(H, IDS[None], 2), ValueError, "ids must be 2-D"),
    ("ids list", lambda: ngram_attention(H, IDS.tolist(), 2), TypeError, "ids must be a torch.Tensor"),
    ("ids B=0", lambda: ngram_attention(H[:0], IDS[:0], 2), ValueError, "ids must have a non-empty batch"),
    ("ids L=0", lambda: ngram_attention(H[:, :0], IDS[:, :0], 2), ValueError, "ids must have at least one"),
    # ngram_attention: n
    ("n zero", lambda: ngram_attention(H, IDS, 0), ValueError, "n must be >= 1"),
    ("n negative", lambda: ngram_attention(H, IDS, -3), ValueError, "n must be >= 1"),
    ("n float", lambda: ngram_attention(H, IDS, 2.0), TypeError, "n must be an int"),
    ("n bool", lambda: ngram_attention(H, IDS, True), TypeError, "n must be an int"),
    ("n str", lambda: ngram_attention(H, IDS, "2"), TypeError, "n must be an int"),
    ("n tensor", lambda: ngram_attention(H, IDS, torch.tensor(2)), TypeError, "n must be an int"),
    ("n None", lambda: ngram_attention(H, IDS, None), TypeError, "n must be an int"),
    # ngram_attention: keywords
    ("backend unknown", lambda: ngram_attention(H, IDS, 2, backend="cuda"), ValueError, "backend must be one of"),
    ("backend None", lambda: ngram_attention(H, IDS, 2, backend=None), ValueError, "backend must be one of"),
    ("algorithm unknown", lambda: ngram_attention(H, IDS, 2, algorithm="fast"), ValueError, "algorithm must be one of"),
    (
        "tiled on eager",
        lambda: ngram_attention(H, IDS, 2, backend="eager", algorithm="tiled"),
        ValueError,
        "algorithm='tiled' needs the Triton backend",
    ),
    ("plan tuple", lambda: ngram_attention(H, IDS, 2, plan=(1, 2, 3)), TypeError, "plan must be an NGramPlan"),
    ("plan other n", lambda: ngram_attention(H, IDS, 1, plan=ngram_plan(IDS, 2)), ValueError, "plan was built for n=2"),
    (
        "plan other ids",
        lambda: ngram_attention(H, IDS, 2, plan=ngram_plan((IDS + 1) % 3, 2)),
        ValueError,
        "plan was built from other ids",
    ),
    (
        "plan other shape",
        lambda: ngram_attention(H[:, :5], IDS[:, :5], 2, plan=ngram_plan(IDS, 2)),
        ValueError,
        "plan.perm must have shape",
    ),
    # ngram_attention_reference: the op's checks (the spec behind them computes whatever the op accepts)
    ("reference h int", lambda: ngram_attention_reference(H.long(), IDS, 2), TypeError, "h must have dtype"),
    ("reference ids float", lambda: ngram_attention_reference(H, IDS.float(), 2), TypeError, "ids must have dtype"),
    ("reference ids shape", lambda: ngram_attention_reference(H, IDS[:, :3], 2), ValueError, "ids must have shape"),
    ("reference n zero", lambda: ngram_attention_reference(H, IDS, 0), ValueError, "n must be >= 1"),
    # ngram_match_matrix
    ("match ids float", lambda: ngram_match_matrix(IDS.float(), 2), TypeError, "ids must have dtype"),
    ("match ids 1-D", lambda: ngram_match_matrix(IDS[0], 2), ValueError, "ids must be 2-D"),
    ("match n float", lambda: ngram_match_matrix(IDS, 1.5), TypeError, "n must be an int"),
    # ngram_plan
    ("plan ids float", lambda: ngram_plan(IDS.float(), 2), TypeError, "ids must have dtype"),
    ("plan ids 1-D", lambda: ngram_plan(IDS[0], 2), ValueError, "ids must be 2-D"),
    ("plan ids L=0", lambda: ngram_plan(IDS[:, :0], 2), ValueError, "ids must have at least one"),
    ("plan n zero", lambda: ngram_plan(IDS, 0), ValueError, "n must be >= 1"),
    ("plan n float", lambda: ngram_plan(IDS, 1.5), TypeError, "n must be an int"),
    ("plan n tensor", lambda: ngram_plan(IDS, torch.tensor(2)), TypeError, "n must be an int"),
    # NGramPlan
    ("NGramPlan perm int32", _plan(perm=IDS.int()), TypeError, "plan.perm must have dtype"),
    (
        "NGramPlan meta shape",
        _plan(meta=torch.zeros(B, L + 1, dtype=torch.uint8)),
        ValueError,
        "plan.meta must have shape",
    ),  # fmt: skip
    ("NGramPlan count list", _plan(count=[0] * L), TypeError, "plan.count must be a torch.Tensor"),
    ("NGramPlan ids float", _plan(ids=IDS.float()), TypeError, "ids must have dtype"),
    ("NGramPlan n zero", _plan(n=0), ValueError, "n must be >= 1"),
    ("NGramPlan n str", _plan(n="2"), TypeError, "n must be an int"),
    (
        "NGramPlan meta device",
        _plan(meta=torch.zeros(B, L, dtype=torch.uint8, device=META)),
        ValueError,
        "plan.meta is on meta",
    ),
    ("NGramPlan missing ids", lambda: NGramPlan(*ngram_plan(IDS, 2)), TypeError, "ids"),
    # NGramDecodeState constructor
    ("state batch 0", _state(batch_size=0), ValueError, "batch_size must be >= 1"),
    ("state dim float", _state(dim=4.0), TypeError, "dim must be an int"),
    ("state n 0", _state(n=0), ValueError, "n must be >= 1"),
    ("state n bool", _state(n=True), TypeError, "n must be an int"),
    ("state n tensor", _state(n=torch.tensor(2)), TypeError, "n must be an int"),
    ("state max_len 0", _state(max_len=0), ValueError, "max_len must be >= 1"),
    ("state dtype int", _state(dtype=torch.int64), TypeError, "dtype must be a floating dtype"),
    ("state device unknown", _state(device="gpu"), ValueError, "device must name a device such as 'cpu'"),
    ("state device float", _state(device=1.5), TypeError, "device must be a torch.device, str or int"),
    (
        "layer state device unknown",
        lambda: NGramAttention(D, 2).init_decode_state(B, L, device="gpu"),
        ValueError,
        "device must name a device",
    ),
    # NGramDecodeState.reset
    ("reset rows out of range", _reset([5]), ValueError, "rows must be row indices in [0, 2), got [5]"),
    ("reset rows tensor out of range", _reset(torch.tensor([1, 5])), ValueError, "rows must be row indices in [0, 2)"),
    ("reset rows negative", _reset(torch.tensor([-1])), ValueError, "rows must be row indices in [0, 2)"),
    ("reset rows float", _reset(torch.tensor([1.0])), TypeError, "rows must have dtype"),
    ("reset rows 2-D", _reset(torch.tensor([[1]])), ValueError, "rows must be 1-D"),
    ("reset rows mask length", _reset(torch.ones(3, dtype=torch.bool)), ValueError, "rows must have shape"),
    ("reset rows an int", _reset(1), TypeError, "rows must be a torch.Tensor, list or tuple"),
    ("reset rows mixed list", _reset([True, 1]), TypeError, "rows must hold ints"),
    # NGramDecodeState.step
    ("step h_t 1-D", _step(H[0, 0], IDS[:, 0]), ValueError, "h_t must be 2-D"),
    ("step h_t int", _step(H[:, 0].long(), IDS[:, 0]), TypeError, "h_t must have dtype"),
    ("step h_t shape", _step(H[:, 0, :3], IDS[:, 0]), ValueError, "h_t must have shape"),
    ("step ids_t float", _step(H[:, 0], IDS[:, 0].float()), TypeError, "ids_t must have dtype"),
    ("step ids_t 2-D", _step(H[:, 0], IDS[:, :2]), ValueError, "ids_t must be 1-D"),
    ("step ids_t shape", _step(H[:, 0], IDS[:1, 0]), ValueError, "ids_t must have shape"),
    ("step h_t list", _step(H[:, 0].tolist(), IDS[:, 0]), TypeError, "h_t must be a torch.Tensor"),
    ("step h_t on meta", _step(H[:, 0].to(META), IDS[:, 0].to(META)), ValueError, "h_t is on meta"),
    ("step ids_t on meta", _step(H[:, 0], IDS[:, 0].to(META)), ValueError, "ids_t is on meta"),
    # transition_ids
    ("transition mode", _transition(mode="pair"), ValueError, "mode must be one of"),
    ("transition states float", _transition(states=IDS.float()), TypeError, "states must have dtype"),
    ("transition actions shape", _transition(actions=IDS[:, :3]), ValueError, "actions must have the shape"),
    ("transition rewards missing", _transition(rewards=None), ValueError, "needs actions and rewards"),
    ("transition num_actions missing", _transition(num_actions=None), ValueError, "needs num_actions"),
    ("transition num_states 0", _transition(num_states=0), ValueError, "num_states must be >= 1"),
    ("transition num_rewards float", _transition(num_rewards=3.0), TypeError, "num_rewards must be an int"),
    ("transition action too big", _transition(num_actions=2), ValueError, "actions must be < 2"),
    (
        "transition overflow",
        _transition(num_states=2**40, num_actions=2**20, num_rewards=2**4),
        ValueError,
        "num_states=1099511627776, num_actions=1048576, num_rewards=16",
    ),
    ("transition rewards on meta", _transition(rewards=IDS.to(META)), ValueError, "rewards is on meta"),
]


@pytest.mark.parametrize("call,error,message", [pytest.param(c, e, m, id=d) for d, c, e, m in BAD])
def test_bad_input_raises_naming_the_argument(call, error, message):
    with pytest.raises(error, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
        call()


# Unusual but valid input: the result equals the reference.
def _ids_with_padding():
    ids = IDS.clone()
    ids[:, 3] = -5
    return ids


GOOD = [
    ("n above L", lambda: (H, IDS, L + 3)),
    ("n equal L", lambda: (H, IDS, L)),
    ("L = 1", lambda: (H[:, :1], IDS[:, :1], 1)),
    ("D = 1", lambda: (H[:, :, :1], IDS, 1)),
    ("int8 ids", lambda: (H, IDS.to(torch.int8), 2)),
    ("uint8 ids", lambda: (H, IDS.to(torch.uint8), 2)),
    ("huge ids", lambda: (H, IDS * 2**61, 2)),
    ("negative ids", lambda: (H, _ids_with_padding(), 1)),
    ("all padding", lambda: (H, torch.full((B, L), -1), 1)),
    ("non-contiguous h", lambda: (H.transpose(0, 1).contiguous().transpose(0, 1), IDS, 2)),
]


@pytest.mark.parametrize("backend", ["auto", "eager", "reference"])
@pytest.mark.parametrize("make", [pytest.param(m, id=d) for d, m in GOOD])
def test_unusual_input_matches_reference(make, backend):
    h, ids, n = make()
    out = ngram_attention(h, ids, n, backend=backend)
    assert_close_rel(out, ngram_attention_reference(h, ids.long(), n))
    if n > L:
        assert torch.equal(out, torch.zeros_like(out))


def test_reference_rejects_nothing_it_can_compute_but_matches_the_op():
    """``ngram_attention_reference`` is the spec: it computes whatever the op accepts (same results)."""
    for n in (1, 2, L + 5):
        assert_close_rel(ngram_attention(H, IDS, n, backend="eager"), ngram_attention_reference(H, IDS, n))


def test_empty_transition_ids_and_decode_rows():
    empty = torch.zeros(0, 5, dtype=torch.long)
    assert transition_ids(empty, empty, empty, num_states=2, num_actions=2, num_rewards=2).shape == (0, 5)
    state = NGramDecodeState(1, 3, 2, max_len=2)
    state.reset(torch.zeros(0, dtype=torch.long))  # resets no row
    state.reset([])  # an empty list too
    assert state.step(torch.ones(1, 3), torch.tensor([1])).abs().sum() == 0


@pytest.mark.parametrize(
    "rows",
    [[1], (1,), torch.tensor([1]), torch.tensor([1], dtype=torch.int32), torch.tensor([False, True]), [False, True]],
)
def test_decode_reset_forgets_exactly_the_selected_rows(rows):
    """Every accepted form of ``rows`` (indices as a list, tuple or integer tensor; a bool mask) resets row 1
    only: row 0 keeps its context and matches as before, row 1 starts afresh."""
    state, fresh = NGramDecodeState(B, D, 1, L), NGramDecodeState(B, D, 1, L)
    for t in range(3):
        state.step(H[:, t], IDS[:, t])
    kept = NGramDecodeState(B, D, 1, L)
    for t in range(3):
        kept.step(H[:, t], IDS[:, t])
    state.reset(rows)
    out, out_kept, out_fresh = (s.step(H[:, 3], IDS[:, 3]) for s in (state, kept, fresh))
    assert torch.equal(out[0], out_kept[0]) and torch.equal(out[1], out_fresh[1])


def test_decode_reset_rows_out_of_range_is_a_device_check():
    """On the GPU's code path (asynchronous value checks) an index out of range is a device assert, not a
    raw IndexError, and with value checks off it resets nothing instead of writing out of bounds."""
    from icrl_kernels import set_value_checks

    state = NGramDecodeState(B, D, 1, L)
    state.step(H[:, 0], IDS[:, 0])
    previous = set_value_checks("async")
    try:
        with pytest.raises(RuntimeError, match="rows must be row indices"):
            state.reset(torch.tensor([5]))
        set_value_checks("off")
        before = state.length.clone()
        state.reset(torch.tensor([5]))
        assert torch.equal(state.length, before)
    finally:
        set_value_checks(previous)
