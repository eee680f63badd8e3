"""Greedy requests share one argmax; sampled requests that share a generator and settings draw in
one call (a batch's plain step: one launch instead of one per request), with each row's own law: on a CPU generator, which hands
out its numbers in order, the grouped draw is token for token the per-request draws in batch order."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from sgl_longgen.config import SamplingConfig
from sgl_longgen.core.sampling import LogitsProcessor
from sgl_longgen.sglang.verify import draw_groups

VOCAB = 300


def step(sampling: SamplingConfig, generator: torch.Generator, blocker: str | None = None, grammar=None):
    return SimpleNamespace(sampling=sampling, state=SimpleNamespace(generator=generator), blocker=blocker,
                           grammar=grammar)


def test_only_requests_whose_rows_alone_decide_share_a_draw():
    shared, seeded = torch.Generator().manual_seed(0), torch.Generator().manual_seed(1)
    t1, t07 = SamplingConfig(temperature=1.0, top_p=0.9), SamplingConfig(temperature=0.7)
    steps = [
        step(t1, shared),  # 0
        step(t1, seeded),  # 1: its own seed, its own draw
        step(t1, shared),  # 2
        step(SamplingConfig(temperature=1.0, top_p=0.9, penalty=1.2), shared),  # 3: its window is its own path
        step(t1, shared, blocker="grammar"),  # 4: SGLang processes its root row
        step(t07, shared),  # 5: other settings
        step(t07, shared),  # 6
        step(SamplingConfig(temperature=0.0), shared),  # 7: greedy
        step(t1, shared),  # 8
        step(t1, shared, grammar=object()),  # 9: each node under its path's mask
    ]
    groups = draw_groups(steps, no_bias=True)
    # The greedy rows first (one argmax, no generator), then the sampled groups of two or more.
    assert [g[0] for g in groups] == [[7], [0, 2, 8], [5, 6]]
    assert groups[0][2] is None and groups[0][1].greedy
    assert groups[1][2] is shared and groups[1][1] == t1
    assert draw_groups(steps[:7], no_bias=True)[0][0] == [0, 2]  # no greedy row: no greedy group
    assert draw_groups(steps, no_bias=False) == []  # a logit bias is SGLang's, per row
    penalized_greedy = step(SamplingConfig(temperature=0.0, penalty=1.2), shared)
    assert [g[0] for g in draw_groups([penalized_greedy, steps[7]], no_bias=True)] == [[1]]


def test_a_grouped_draw_is_the_per_request_draws_on_a_cpu_generator():
    torch.manual_seed(0)
    logits = torch.randn(4, 1, VOCAB) * 3  # a batch's plain step: one row per request
    sampling = SamplingConfig(temperature=0.8, top_p=0.95, min_p=0.01)
    proc = LogitsProcessor(sampling, VOCAB)
    one_by_one = torch.Generator().manual_seed(7)
    want = torch.stack([proc.sample(logits[b], None, one_by_one) for b in range(4)])
    together = torch.Generator().manual_seed(7)
    steps = [step(sampling, together) for _ in range(4)]
    [(members, config, generator)] = draw_groups(steps, True)
    got = LogitsProcessor(config, VOCAB).sample(logits[members].flatten(0, 1), None, generator).view(4, 1)
    assert torch.equal(got, want)


def test_batch_rows_index_the_members_without_a_list():
    """Contiguous members index as a slice, others through one cached index tensor: the rows read
    and written are the members', in order."""
    from sgl_longgen.sglang.verify import batch_rows

    cache: dict = {}
    draws = torch.full((9, 2), -2)
    values = torch.arange(18).view(9, 2)
    assert batch_rows([5, 6], cache, "cpu") == slice(5, 7) and not cache
    rows = batch_rows([0, 2, 8], cache, "cpu")
    assert batch_rows([0, 2, 8], cache, "cpu") is rows  # made once per set of rows
    draws[rows] = values[rows]
    draws[batch_rows([5, 6], cache, "cpu")] = values[5:7]
    assert torch.equal(draws[[0, 2, 5, 6, 8]], values[[0, 2, 5, 6, 8]])
    assert (draws[[1, 3, 4, 7]] == -2).all()
