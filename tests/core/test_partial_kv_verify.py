"""The verification-guided partial-KV policy (SpecAttn): per-layer selections from verify scores.

Whatever the scores, every draft view must keep the rules of the paper's policy: the sinks, every
position committed since the scored verify (the recent window), and the best ranked positions up
to the budget, never a position twice and never one that is not committed.
"""

from __future__ import annotations

import pytest
import torch

from sgl_longgen.config import PartialKVConfig, TokenSwiftConfig
from sgl_longgen.core.partial_kv import PartialKVPolicy, gqa_importance
from sgl_longgen.core.verify_scores import mean_logits, score_rows
from sgl_longgen.methods import TokenSwift


def verify_policy(budget: int, sinks: int, granularity: str = "shared", layers: int = 3, kv_heads: int = 2):
    cfg = PartialKVConfig(budget=budget, sinks=sinks, granularity=granularity, policy="verify")
    return PartialKVPolicy(cfg, num_layers=layers, num_kv_heads=kv_heads)


def test_mean_logits_average_every_rows_logit_over_the_kv_heads_queries():
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, 8, 16, generator=gen, dtype=torch.float64)  # 2 rows, 8 query heads
    k = torch.randn(2, 30, 16, generator=gen, dtype=torch.float64)  # 2 KV heads
    got = mean_logits(q, k, 0.25)
    want = torch.stack([
        sum(k[j] @ q[r, h] for r in range(2) for h in range(4 * j, 4 * j + 4)) / 8 * 0.25 for j in range(2)
    ])
    assert torch.allclose(got, want)
    # One row: the Eq. 2 score (summed over the group) divided by the group size.
    assert torch.allclose(mean_logits(q[:1], k, 0.25) * 4, gqa_importance(q[0], k, 0.25))


def test_score_rows_are_the_root_and_the_first_draft_token():
    assert score_rows(1) == 1 and score_rows(2) == 2 and score_rows(40) == 2


def test_the_tokenswift_policy_asks_no_verify_scores():
    policy = PartialKVPolicy(PartialKVConfig(budget=8, sinks=2), num_layers=2, num_kv_heads=2)
    policy.reset(20)
    assert policy.verify_range() is None and policy.groups == 1
    with pytest.raises(RuntimeError):
        policy.select_verified(torch.zeros(2, 2, 18))


def test_the_first_draft_after_the_prompt_scores_as_tokenswift_does():
    policy = verify_policy(budget=8, sinks=2)
    policy.reset(20)
    assert policy.score_range() == (2, 20)  # the draft's root query scores the context
    assert policy.visible().tolist() == [[0, 1, *range(14, 20)]] * 3  # meanwhile sinks + recent
    scores = torch.zeros(3, 2, 18)
    scores[:, :, [3, 7, 1, 9, 12, 15]] = torch.tensor([6.0, 5, 4, 3, 2, 1])
    policy.select(scores)
    want = sorted([0, 1] + [p + 2 for p in [3, 7, 1, 9, 12, 15]])
    assert policy.visible().tolist() == [want] * 3  # one set, the same for every layer


def test_each_layer_takes_the_top_of_its_mean_over_kv_heads():
    policy = verify_policy(budget=6, sinks=2, layers=2, kv_heads=2)
    policy.reset(12)
    policy.select(torch.zeros(2, 2, 10))
    assert policy.verify_range() == (2, 12)
    scores = torch.zeros(2, 2, 10)  # positions 2..11
    scores[0, 0, [0, 1, 2, 3]] = 10.0  # layer 0: positions 2-5 (KV head 0 alone decides the mean)
    scores[1, 0] = 0.01 * torch.arange(10)  # layer 1: later is better, ...
    scores[1, 0, [6, 7]] = 10.0  # ... head 0 likes positions 8, 9 but head 1 outvotes it
    scores[1, 1, [6, 7]] = -30.0
    scores[1, 1, [8, 9]] = 10.0  # ... and head 1 likes 10, 11
    policy.select_verified(scores)
    assert policy.visible().tolist() == [[0, 1, 2, 3, 4, 5], [0, 1, 6, 7, 10, 11]]


def test_head_granularity_selects_per_layer_and_kv_head():
    policy = verify_policy(budget=4, sinks=1, granularity="head", layers=2, kv_heads=2)
    policy.reset(9)
    policy.select(torch.zeros(2, 2, 8))
    scores = torch.zeros(2, 2, 8)  # positions 1..8
    for row, pos in enumerate([(1, 2, 3), (4, 5, 6), (6, 7, 8), (2, 4, 8)]):
        scores.view(4, 8)[row, [p - 1 for p in pos]] = torch.tensor([3.0, 2.0, 1.0])
    policy.select_verified(scores)
    assert policy.visible().tolist() == [[0, 1, 2, 3], [0, 4, 5, 6], [0, 6, 7, 8], [0, 2, 4, 8]]


def test_what_a_step_commits_after_the_verify_is_always_visible():
    """Tail insertion: the verify scored [sinks, L); the L..L+a it commits displace the worst."""
    policy = verify_policy(budget=8, sinks=2, layers=1, kv_heads=1)
    policy.reset(30)
    policy.select(torch.zeros(1, 1, 28))
    ranked = [29, 28, 27, 26, 25, 24]
    scores = torch.zeros(1, 1, 28)
    scores[0, 0, [p - 2 for p in ranked]] = torch.arange(6, 0, -1, dtype=torch.float32)
    policy.select_verified(scores)
    policy.commit(33)  # the step committed 30, 31, 32
    assert policy.visible().tolist() == [sorted([0, 1, 29, 28, 27, 30, 31, 32])]
    assert policy.verify_range() == (2, 33)
    policy.commit(40)  # an accepted run longer than budget - sinks: the draft re-scores meanwhile
    assert policy.score_range() == (2, 40)
    assert policy.visible().tolist() == [[0, 1, *range(34, 40)]]
    policy.select_verified(torch.randn(1, 1, 38))  # the next verify's selection replaces that one
    assert policy.score_range() is None and policy.sel_len == 40


def test_wrong_scores_are_refused():
    policy = verify_policy(budget=8, sinks=2, layers=3, kv_heads=2)
    policy.reset(20)
    with pytest.raises(ValueError):
        policy.select_verified(torch.zeros(3, 2, 17))
    with pytest.raises(ValueError):
        policy.select_verified(torch.zeros(1, 2, 18))
    head = verify_policy(budget=8, sinks=2, granularity="head", layers=3, kv_heads=2)
    head.reset(20)
    with pytest.raises(ValueError):
        head.select_verified(torch.zeros(3, 1, 18))


def test_nothing_to_score_within_the_sinks():
    policy = verify_policy(budget=8, sinks=4)
    policy.reset(3)
    assert policy.verify_range() is None


@pytest.mark.parametrize("granularity", ["shared", "head"])
def test_every_view_keeps_budget_sinks_and_recent_window_over_a_long_run(granularity):
    gen = torch.Generator().manual_seed(0)
    layers, kv_heads, budget, sinks = 3, 2, 16, 3
    policy = verify_policy(budget, sinks, granularity, layers, kv_heads)
    policy.reset(25)
    start, end = policy.score_range()
    policy.select(torch.randn(layers, kv_heads, end - start, generator=gen))
    verified = None
    layer_sets_differ = False
    for step in range(300):
        length = policy.length
        if step % 7 == 3:  # an adaptive plain step: no verify scores
            pass
        else:
            lo, hi = policy.verify_range()
            assert (lo, hi) == (sinks, length)
            policy.select_verified(torch.randn(layers, kv_heads, hi - lo, generator=gen))
            verified = length
        accepted = 1 + int(torch.randint(0, 6 if step % 50 else 20, (), generator=gen))
        policy.commit(length + accepted)
        if policy.score_range() is not None:  # more committed than the budget holds: draft-scored
            lo, hi = policy.score_range()
            policy.select(torch.randn(layers, kv_heads, hi - lo, generator=gen))
            verified = None
        vis = policy.visible()
        assert vis.shape == (layers * (kv_heads if granularity == "head" else 1), min(budget, policy.length))
        for row in vis.tolist():
            assert row == sorted(set(row)) and row[-1] < policy.length
            assert row[:sinks] == list(range(sinks))
            if verified is not None:  # the recent window: all positions since the scored verify
                assert set(range(verified, policy.length)) <= set(row)
        layer_sets_differ |= len({tuple(r) for r in vis.tolist()}) > 1
    assert layer_sets_differ


def test_the_method_hands_verify_scores_to_the_policy():
    config = TokenSwiftConfig(partial_kv=PartialKVConfig(budget=8, sinks=2, policy="verify"))
    method = TokenSwift(config, num_layers=2, num_kv_heads=2)
    state = method.start(20)
    view = method.view(state)
    assert view.score == (2, 20) and method.verify_score_range(state) == (2, 20)
    method.select(state, torch.randn(2, 2, 18))
    scores = torch.zeros(2, 2, 18)
    scores[0, :, :6] = torch.arange(6, 0, -1)  # layer 0 ranks 2, 3, ..., 7
    scores[1, :, -6:] = torch.arange(1, 7)  # layer 1 ranks 19, 18, ..., 14
    method.select_verified(state, scores)
    method.observe(state, 21)  # the step committed position 20: it displaces each layer's worst
    view = method.view(state)
    assert view.score is None
    assert view.positions().tolist() == [[0, 1, 2, 3, 4, 5, 6, 20], [0, 1, 15, 16, 17, 18, 19, 20]]
