import json

import pytest
import torch

from sgl_longgen.config import PartialKVConfig
from sgl_longgen.core.heads import TokenSwiftHeads, load_heads
from sgl_longgen.core.partial_kv import PartialKVPolicy, gqa_importance
from sgl_longgen.errors import LonggenError


def test_gqa_importance_sums_q_dot_k_over_the_group():
    torch.manual_seed(0)
    q = torch.randn(8, 16, dtype=torch.float64)  # 8 query heads
    k = torch.randn(2, 30, 16, dtype=torch.float64)  # 2 KV heads
    got = gqa_importance(q, k)
    want = torch.stack([sum(k[j] @ q[h] for h in range(4 * j, 4 * j + 4)) for j in range(2)])
    assert torch.allclose(got, want)


def scores_for(policy: PartialKVPolicy, layers: int, heads: int, gen) -> torch.Tensor:
    lo, hi = policy.score_range()
    return torch.randn(layers, heads, hi - lo, generator=gen)


def test_first_selection_keeps_sinks_and_the_top_scored_positions():
    policy = PartialKVPolicy(PartialKVConfig(budget=8, granularity="head", sinks=2), num_layers=1, num_kv_heads=2)
    policy.reset(20)
    assert policy.score_range() == (2, 20)
    scores = torch.zeros(1, 2, 18)
    scores[0, 0, [3, 7, 1, 9, 12, 15]] = torch.tensor([6.0, 5, 4, 3, 2, 1])
    scores[0, 1, [0, 1, 2, 3, 4, 5]] = 1.0
    policy.select(scores)
    vis = policy.visible()
    assert vis.shape == (2, 8)
    assert vis[0].tolist() == sorted([0, 1] + [p + 2 for p in [3, 7, 1, 9, 12, 15]])
    assert vis[1].tolist() == list(range(8))


def test_new_tokens_displace_the_least_important_then_trigger_reselection():
    policy = PartialKVPolicy(PartialKVConfig(budget=8, granularity="head", sinks=2), num_layers=1, num_kv_heads=1)
    policy.reset(20)
    scores = torch.arange(18, dtype=torch.float64)[None, None]  # later = more important
    policy.select(scores)
    ranked = [19, 18, 17, 16, 15, 14]
    policy.commit(22)  # two new positions: 20, 21 replace the two least important (15, 14)
    assert policy.visible()[0].tolist() == sorted([0, 1] + ranked[:4] + [20, 21])
    policy.commit(26)  # six new: exactly fills budget - sinks
    assert policy.score_range() is None
    assert policy.visible()[0].tolist() == [0, 1] + list(range(20, 26))
    policy.commit(27)  # overflow: re-selection due, meanwhile sinks + most recent
    assert policy.score_range() == (2, 27)
    assert policy.visible()[0].tolist() == [0, 1] + list(range(21, 27))
    policy.select(torch.zeros(1, 1, 25))
    assert policy.score_range() is None and policy.visible().shape == (1, 8)


def test_everything_is_visible_while_the_context_fits_the_budget():
    policy = PartialKVPolicy(PartialKVConfig(budget=64, granularity="head", sinks=4), num_layers=2, num_kv_heads=2)
    policy.reset(10)
    policy.select(torch.randn(2, 2, 6))
    for length in (10, 30, 64):
        policy.commit(length)
        assert policy.visible().tolist() == [list(range(length))] * 4


def test_shared_granularity_uses_one_set_for_all_layers_and_heads():
    gen = torch.Generator().manual_seed(1)
    policy = PartialKVPolicy(PartialKVConfig(budget=6, sinks=1, granularity="shared"), num_layers=3, num_kv_heads=2)
    policy.reset(40)
    policy.select(scores_for(policy, 3, 2, gen))
    assert policy.visible().shape == (1, 6)


def test_visible_never_exceeds_the_budget_over_a_long_run():
    gen = torch.Generator().manual_seed(0)
    policy = PartialKVPolicy(PartialKVConfig(budget=16, granularity="head", sinks=3), num_layers=2, num_kv_heads=1)
    policy.reset(30)
    policy.select(scores_for(policy, 2, 1, gen))
    length = 30
    for step in range(200):
        length += 1 + step % 5
        policy.commit(length)
        vis = policy.visible()
        assert vis.shape[1] <= 16
        assert (vis < length).all() and (vis[:, :3] == torch.arange(3)).all()
        assert all(len(set(r.tolist())) == len(r) for r in vis)
        if policy.score_range() is not None:
            policy.select(scores_for(policy, 2, 1, gen))


def test_heads_checkpoint_round_trip(tmp_path):
    heads = TokenSwiftHeads(32, 3)
    heads.reset_parameters(torch.Generator().manual_seed(0))
    heads.save(tmp_path / "h")
    again = load_heads(tmp_path / "h", hidden_size=32, num_heads=3)
    x = torch.randn(2, 32)
    for a, b in zip(heads(x), again(x)):
        assert torch.allclose(a, b)


def test_heads_are_chained_residual_blocks():
    heads = TokenSwiftHeads(8, 2)
    with torch.no_grad():
        for block in heads.heads:
            block.proj.weight.zero_()
    x = torch.randn(1, 8)
    out = heads(x)
    # zero projections: every head sees h0 unchanged, then its own output norm
    for o, block in zip(out, heads.heads):
        assert torch.allclose(o, block.norm_out(x))


def test_heads_errors_name_the_file(tmp_path):
    TokenSwiftHeads(32, 3).save(tmp_path / "h")
    with pytest.raises(LonggenError, match="hidden size 32 but the model's is 64"):
        load_heads(tmp_path / "h", hidden_size=64)
    (tmp_path / "h" / "heads.safetensors").unlink()
    with pytest.raises(LonggenError, match="heads.safetensors"):
        load_heads(tmp_path / "h", hidden_size=32)
    with pytest.raises(LonggenError, match="not found"):
        load_heads(tmp_path / "nope")
    (tmp_path / "h" / "heads.json").write_text(json.dumps({"format": "other"}))
    with pytest.raises(LonggenError, match="heads.json"):
        load_heads(tmp_path / "h")


def test_positions_are_never_visible_twice_when_the_prompt_is_shorter_than_the_sinks():
    policy = PartialKVPolicy(PartialKVConfig(budget=32, sinks=16, granularity="shared"), num_layers=1, num_kv_heads=1)
    policy.reset(10)
    start, end = policy.score_range()
    policy.select(torch.randn(1, 1, end - start))
    for length in (12, 20, 30):
        policy.commit(length)
        vis = policy.visible()[0].tolist()
        assert vis == sorted(set(vis)) == list(range(length))
