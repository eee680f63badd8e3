"""Adaptive draft widths: the controller picks the verify width (or a plain step) per step from
synthetic costs and accepted paths (no clock), and the tries a width cuts."""

from __future__ import annotations

import random

import pytest

from sgl_longgen.config import AdaptiveConfig, load_generate_config
from sgl_longgen.core.adaptive import (
    PLAIN,
    SPECULATE,
    AdaptiveController,
    StepCosts,
    batch_width,
    decide_batch,
)
from sgl_longgen.core.ngram import NgramPool
from sgl_longgen.core.tokenswift import draft_trie
from sgl_longgen.core.tree import DraftTree, Source, add_beam
from sgl_longgen.errors import LonggenError

PLAIN_COST = 1.0
# A verify's cost grows with its width (the full draft: None).
COSTS = {4: 1.1, 16: 1.4, None: 1.7}


def run(ctrl: AdaptiveController, steps: int, path: list[int], costs=COSTS) -> list:
    """``steps`` steps over a trie whose walk always accepts the nodes of ``path`` (positions in
    the trie's node order, the root's 0 first) that the step's width keeps. Returns each step's
    kind: ``PLAIN`` or the width it verified."""
    out = []
    for _ in range(steps):
        if ctrl.decide() == PLAIN:
            ctrl.record_plain(PLAIN_COST)
            out.append(PLAIN)
            continue
        width = ctrl.width
        nodes = [n for n in path if width is None or n < width]
        ctrl.record_spec(len(nodes), costs[width], width=width, nodes=nodes)
        out.append(width)
    return out


def test_deep_nodes_never_accepted_and_cost_rising_with_width_the_narrow_width_wins():
    cfg = AdaptiveConfig(widths=[16, 4])
    ctrl = AdaptiveController(cfg)
    kinds = run(ctrl, 400, [0, 1, 2, 3])  # 4 tokens a step at every width: the cheapest wins
    spec = [k for k in kinds if k != PLAIN]
    assert spec.count(4) > 0.85 * len(spec)
    assert spec.count(16) == 1  # tried once, then priced out
    # The full draft: the warm-up, then one step in full_every keeps the wider estimates fresh.
    assert spec.count(None) == pytest.approx(len(spec) / cfg.full_every, abs=2)
    assert ctrl.best_width() == 4 and ctrl.width_steps[4] == spec.count(4)
    assert ctrl.expected_at(4) == ctrl.expected_at(16) == ctrl.expected_at(None) == pytest.approx(4)


def test_everything_accepted_the_full_width_wins():
    ctrl = AdaptiveController(AdaptiveConfig(widths=[4, 16]))
    # Deep nodes accepted: 3 tokens at width 4 (3.0 / 1.1), 5 at 16 (5 / 1.4), 7 in full (7 / 1.7).
    kinds = run(ctrl, 400, [0, 1, 3, 7, 15, 31, 40])
    spec = [k for k in kinds if k != PLAIN]
    # Width 16 might have won at any price down to a plain step's (5 / 1.0 > 7 / 1.7): measured
    # once. Width 4 could not have (3 / 1.0 < 7 / 1.7): never tried.
    assert spec.count(4) == 0 and spec.count(16) == 1
    assert spec.count(None) == len(spec) - 1 and len(spec) > 0.95 * len(kinds)
    assert ctrl.expected_at(4) == pytest.approx(3) and ctrl.expected_at(16) == pytest.approx(5)
    assert ctrl.best_width() is None


def test_a_cut_that_keeps_few_accepted_nodes_is_never_tried():
    # TokenSwift's shape: the head tree's first nodes, then an n-gram chain that gets accepted deep
    # in the trie's order. Cut to 16 nodes a step keeps 2 tokens of the full draft's 12.
    ctrl = AdaptiveController(AdaptiveConfig(widths=[16]))
    kinds = run(ctrl, 200, [0, 1, *range(20, 30)], {16: 1.6, None: 1.7})
    assert 16 not in kinds and kinds.count(None) > 0.9 * len(kinds)
    assert ctrl.expected_at(16) == pytest.approx(2)


def test_a_narrow_width_can_pay_where_the_full_draft_does_not():
    # 2 tokens a step: the full draft (2 / 1.7) loses to plain steps (1 / 1.0), width 4 (2 / 1.1) wins.
    ctrl = AdaptiveController(AdaptiveConfig(widths=[4]))
    kinds = run(ctrl, 300, [0, 2])
    assert kinds.count(4) > 0.85 * len(kinds) and kinds.count(PLAIN) < 0.05 * len(kinds)
    # Nothing accepted anywhere: plain steps, probing over the full draft only; width 4 is never
    # tried (one token a step cannot pay for a step dearer than a plain one, priced or not).
    ctrl = AdaptiveController(AdaptiveConfig(widths=[4]))
    kinds = run(ctrl, 300, [0])
    assert kinds.count(PLAIN) > 0.9 * len(kinds)
    assert kinds.count(4) == 0 and ctrl.probes > 0 and kinds.count(None) == 1 + ctrl.probes


def test_acceptance_deepening_mid_run_moves_to_the_full_draft():
    ctrl = AdaptiveController(AdaptiveConfig(widths=[4]))
    first = run(ctrl, 200, [0, 1, 2, 3])
    assert first[-50:].count(4) > 40
    second = run(ctrl, 200, [0, 1, 2, 3, 10, 20, 30, 40])  # 8 tokens in full, 4 at width 4
    # The next full-draft refresh shows it; from then on the full draft wins.
    switched = next(i for i, k in enumerate(second) if k is None)
    assert switched < ctrl.config.full_every
    assert second[switched + 10:].count(None) > 0.9 * len(second[switched + 10:])


def test_one_verified_step_samples_every_width_up_to_its_own():
    ctrl = AdaptiveController(AdaptiveConfig(widths=[4, 8, 32]))
    ctrl.record_spec(5, 1.0, width=None, nodes=[0, 2, 5, 20, 40])
    assert [ctrl.expected_at(w) for w in (4, 8, 32, None)] == [2, 3, 4, 5]
    ctrl = AdaptiveController(AdaptiveConfig(widths=[4, 8, 32]))
    ctrl.record_spec(3, 1.0, width=8, nodes=[0, 2, 5])  # wider widths learn nothing from a cut trie
    assert [ctrl.expected_at(w) for w in (4, 8, 32, None)] == [2, 3, None, None]
    assert ctrl.costs.cost(8) == 1.0 and ctrl.costs.cost(None) is None and ctrl.width_steps == {8: 1}


def test_deterministic_without_widths_nothing_changes():
    def trace(widths):
        ctrl = AdaptiveController(AdaptiveConfig(widths=widths))
        return run(ctrl, 300, [0, 1, 2, 9], {4: 1.1, 8: 1.2, None: 1.3}), ctrl

    assert trace([4, 8])[0] == trace([4, 8])[0]
    kinds, ctrl = trace([])
    assert set(kinds) <= {PLAIN, None} and not ctrl.at_width and not ctrl.width_steps


def test_a_batch_takes_one_width():
    costs = StepCosts()
    costs.plain.add(1.0)
    for width, cost in COSTS.items():
        costs.at(width).add(cost)
    ctrls = [AdaptiveController(AdaptiveConfig(widths=[4, 16]), costs) for _ in range(3)]
    shallow, deep = [0, 1, 2, 3], [0, 1, 3, 7, 15, 31, 40]
    for c, path in zip(ctrls, [shallow, shallow, deep]):
        c.record_spec(len(path), width=None, nodes=path)
    # 4 + 4 + 3 at width 4 (11 / 1.1) beat 4 + 4 + 5 at 16 (13 / 1.4) and 4 + 4 + 7 in full (15 / 1.7).
    for c in ctrls:
        assert c.decide(costs) == SPECULATE
    assert batch_width(ctrls, costs) == 4
    ctrls[2].record_spec(7, width=None, nodes=deep)  # two deep requests of three: 15 / 1.7 wins
    ctrls[1].record_spec(7, width=None, nodes=deep)
    ctrls[1].record_spec(7, width=None, nodes=deep)
    assert batch_width(ctrls, costs) is None
    # A request whose width is due (here: a probe) gets it for the batch.
    for c in ctrls:
        c.decide(costs)
    ctrls[0]._forced, ctrls[0].width = True, 16
    assert batch_width(ctrls, costs) == 16
    assert batch_width([AdaptiveController(AdaptiveConfig(), costs)], costs) is None  # no widths


def test_widths_are_checked_and_sorted():
    cfg = load_generate_config(None, {"adaptive": {"widths": [32, 8, 16]}})
    assert cfg.adaptive.widths == [8, 16, 32]
    assert load_generate_config(None, {}).adaptive.widths == []
    for bad, field in [({"widths": [8, 0]}, r"\$.adaptive.widths\[1\]"), ({"widths": [8, 8]}, "8 more than once"),
                       ({"widths": 8}, r"\$.adaptive.widths"), ({"full_every": 0}, r"\$.adaptive.full_every")]:
        with pytest.raises(LonggenError, match=field):
            load_generate_config(None, {"adaptive": bad})


# -- the cut a width stands for: a trie's first nodes ---------------------------------------------


def first_nodes(tree: DraftTree, n: int) -> list[tuple[int, int]]:
    """(parent, token) of the trie's first ``n`` nodes."""
    return list(zip(tree.parents, tree.tokens))[:n]


@pytest.mark.parametrize("seed", range(20))
def test_a_trie_drafted_with_max_nodes_is_the_full_tries_first_nodes(seed):
    """What makes one verified step a sample of every narrower width: the method's trie cut to W
    nodes is exactly the first W nodes of its full trie, so the walk's path inside it is the full
    path's nodes at positions < W (the same draws give it in greedy decoding)."""
    rng = random.Random(seed)
    vocab = 6
    pool = NgramPool(3, 4)
    pool.extend([rng.randrange(vocab) for _ in range(60)], 60)
    cands = [[rng.randrange(vocab) for _ in range(3)] for _ in range(4)]
    cands = [list(dict.fromkeys(row)) for row in cands]
    continuation = [rng.randrange(vocab) for _ in range(rng.randrange(6))]
    full = draft_trie(7, cands, [1, 3, 3, 3], pool, None, continuation)
    # A random beam (parents before children, duplicates merged by the trie).
    tokens, parents = [], []
    for i in range(30):
        parents.append(rng.randrange(-1, i) if i else -1)
        tokens.append(rng.randrange(3))
    beam_full = add_beam(DraftTree(7), tokens, parents, Source.LSTM)
    for w in range(1, max(len(full), len(beam_full)) + 2):
        cut = draft_trie(7, cands, [1, 3, 3, 3], pool, w, continuation)
        assert len(cut) == min(w, len(full)) and first_nodes(cut, w) == first_nodes(full, w)
        beam_cut = add_beam(DraftTree(7), tokens, parents, Source.LSTM, w)
        assert len(beam_cut) == min(w, len(beam_full)) and first_nodes(beam_cut, w) == first_nodes(beam_full, w)


def test_a_batch_speculates_when_some_width_pays_for_it():
    """Two requests accept their first nodes only, one nothing: at width 4, 4 + 4 + 1 tokens per
    1.1 s beat three plain tokens per second; over the full draft 9 per 1.7 s would too, but not
    at 6.0 s. Requests that want a plain step do not decide the width."""
    costs = StepCosts()
    costs.plain.add(1.0)
    costs.at(4).add(1.1)
    costs.spec.add(6.0)
    ctrls = [AdaptiveController(AdaptiveConfig(widths=[4]), costs) for _ in range(3)]
    for c, path in zip(ctrls, [[0, 1, 2, 3], [0, 1, 2, 3], [0]]):
        c.record_spec(len(path), width=None, nodes=path)
        c.record_plain()
    kinds = [c.decide(costs) for c in ctrls]
    assert kinds == [SPECULATE, SPECULATE, PLAIN]
    kind, probes = decide_batch(ctrls, costs)
    assert kind == SPECULATE and probes == [False] * 3 and batch_width(ctrls, costs) == 4
    costs.at(4).add(4.0)
    costs.at(4).add(4.0)  # the recent median: now no width pays (9 / 4.0 < 3 / 1.0)
    assert decide_batch(ctrls, costs)[0] == PLAIN


def test_a_hint_raises_a_batch_requests_estimate_over_the_whole_draft_only():
    """Two requests that accept nothing, one with a method hint of 5 draft tokens: over the whole
    draft 1 + 6 tokens per 1.7 s beat 2 plain tokens per second; the hint says nothing of the
    narrower widths, so without it the batch stays plain."""
    costs = StepCosts()
    costs.plain.add(1.0)
    costs.at(4).add(1.1)
    costs.spec.add(1.7)
    ctrls = [AdaptiveController(AdaptiveConfig(widths=[4]), costs) for _ in range(2)]
    for c in ctrls:
        c.record_spec(1, width=None, nodes=[0])
        c.record_plain()
    assert decide_batch(ctrls, costs)[0] == PLAIN
    kind, _ = decide_batch(ctrls, costs, [None, 5.0])
    assert kind == SPECULATE and ctrls[1].hinted and not ctrls[0].hinted
    assert batch_width(ctrls, costs) is None  # the hinted request's whole draft
