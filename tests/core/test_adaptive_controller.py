"""The adaptive-speculation controller, driven with synthetic costs and acceptances (no clock)."""

from __future__ import annotations

import msgspec
import pytest

from sgl_longgen.config import AdaptiveConfig, GenerateConfig, load_generate_config
from sgl_longgen.core.adaptive import (PLAIN, SPECULATE, AdaptiveController, CostTable, StepCosts, WorkloadPrior,
                                       context_bucket, decide_batch)
from sgl_longgen.errors import LonggenError

PLAIN_COST = 1.0


def run(ctrl: AdaptiveController, steps: int, committed, spec_cost: float) -> list[str]:
    """``steps`` steps; ``committed(i)`` is what a speculative step at step ``i`` commits."""
    kinds = []
    for i in range(steps):
        kind = ctrl.decide()
        if kind == SPECULATE:
            ctrl.record_spec(committed(i), spec_cost)
        else:
            ctrl.record_plain(PLAIN_COST)
        kinds.append(kind)
    return kinds


def test_starts_optimistic_then_measures_a_plain_step():
    ctrl = AdaptiveController(AdaptiveConfig(warmup=2))
    assert run(ctrl, 3, lambda i: 1, 2.0) == [SPECULATE, SPECULATE, PLAIN]


def test_plain_when_drafts_commit_one_token_at_twice_the_cost():
    ctrl = AdaptiveController(AdaptiveConfig())
    kinds = run(ctrl, 1000, lambda i: 1, 2.0)
    assert kinds[:2] == [SPECULATE, PLAIN]
    assert kinds.count(PLAIN) > 0.97 * len(kinds)
    assert 0 < ctrl.probes == kinds.count(SPECULATE) - 1  # every later speculative step was a probe


def test_keeps_speculating_when_four_tokens_cost_twice_a_plain_step():
    cfg = AdaptiveConfig()
    ctrl = AdaptiveController(cfg)
    kinds = run(ctrl, 1000, lambda i: 4, 2.0)
    assert ctrl.probes == 0
    # Only the plain-cost measurement and its refreshes are plain.
    assert kinds.count(PLAIN) == 1 + (1000 - 2) // (cfg.refresh_every + 1)
    no_refresh = AdaptiveController(AdaptiveConfig(refresh_every=0))
    assert run(no_refresh, 1000, lambda i: 4, 2.0).count(PLAIN) == 1


def test_a_tie_keeps_speculating_and_just_below_it_plain_wins():
    # 2 tokens at twice the cost is a tie: speculating is kept; just below it, plain wins.
    assert run(AdaptiveController(AdaptiveConfig()), 200, lambda i: 2, 2.0).count(SPECULATE) > 190
    assert run(AdaptiveController(AdaptiveConfig()), 200, lambda i: 2, 2.1).count(PLAIN) > 150


def test_probes_grow_geometrically_and_in_units_of_the_speculative_cost():
    cfg = AdaptiveConfig(probe_every=4, probe_growth=2.0, probe_max=32, refresh_every=0)
    ctrl = AdaptiveController(cfg)
    kinds = run(ctrl, 600, lambda i: 1, 2.0)
    probes = [i for i, k in enumerate(kinds) if k == SPECULATE][1:]  # step 0 is the warm-up
    gaps = [b - a - 1 for a, b in zip([0] + probes, probes)]
    # The first probe after 4 speculative steps' worth of plain time (8 plain steps, the first of
    # them the measurement), then 16, 32, 64 plain steps, then the cap (32 * 2 = 64) for good.
    assert gaps[:5] == [8, 16, 32, 64, 64] and set(gaps[4:]) == {64}
    # A dearer speculative step spaces the probes out in plain steps: the time spent on probes stays bounded.
    dear = run(AdaptiveController(cfg), 600, lambda i: 1, 8.0)
    assert dear.count(SPECULATE) < kinds.count(SPECULATE) / 2


def test_adapts_when_acceptance_rises_mid_run():
    ctrl = AdaptiveController(AdaptiveConfig())
    kinds = run(ctrl, 2000, lambda i: 1 if i < 1000 else 4, 2.0)
    first, second = kinds[:1000], kinds[1000:]
    assert first.count(PLAIN) > 0.97 * 1000
    # The first probe after the change resumes speculating (the long plain stretch decayed the
    # old evidence), well within the probe interval reached by then.
    resumed = second.index(SPECULATE)
    assert resumed <= ctrl.config.probe_max * 2
    assert second[resumed:].count(SPECULATE) > 0.95 * len(second[resumed:])
    assert ctrl.interval == ctrl.config.probe_every  # the probe paid: the interval was reset


def test_adapts_when_acceptance_falls_mid_run():
    ctrl = AdaptiveController(AdaptiveConfig())
    kinds = run(ctrl, 2000, lambda i: 4 if i < 1000 else 1, 2.0)
    assert kinds[:1000].count(SPECULATE) > 0.95 * 1000
    second = kinds[1000:]
    switched = second.index(PLAIN)
    assert switched < 20  # a few steps of evidence move the decayed mean below the break-even
    assert second[switched:].count(PLAIN) > 0.95 * len(second[switched:])


def test_noisy_acceptance_follows_its_mean():
    # Alternating 1 and 5 tokens (mean 3) at 2x the cost: speculate; at 4x: plain.
    assert run(AdaptiveController(AdaptiveConfig()), 500, lambda i: 1 + 4 * (i % 2), 2.0).count(SPECULATE) > 450
    assert run(AdaptiveController(AdaptiveConfig()), 500, lambda i: 1 + 4 * (i % 2), 4.0).count(PLAIN) > 450


def test_deterministic_and_per_source_statistics():
    def trace():
        ctrl = AdaptiveController(AdaptiveConfig())
        out = []
        for i in range(300):
            kind = ctrl.decide()
            if kind == SPECULATE:
                ctrl.record_spec(1 + i % 3, 1.5 + 0.1 * (i % 5), "tree" if i % 2 else "linear")
            else:
                ctrl.record_plain(0.9 + 0.05 * (i % 7))
            out.append(kind)
        return out, ctrl

    (a, ca), (b, _) = trace(), trace()
    assert a == b
    assert set(ca.by_source) <= {"tree", "linear"} and ca.by_source
    assert all(1 <= m.value <= 3 for m in ca.by_source.values())


def test_settings_are_checked_and_errors_name_the_field():
    cfg = load_generate_config(None, {"adaptive": {"enabled": False, "probe_every": 4}})
    assert cfg.adaptive == AdaptiveConfig(enabled=False, probe_every=4)
    assert not GenerateConfig().adaptive.enabled  # opt-in: the mix of steps follows wall times
    for bad, field in [({"typo": 1}, "typo"), ({"decay": 1.0}, "$.adaptive.decay"),
                       ({"probe_every": 0}, "$.adaptive.probe_every"),
                       ({"probe_growth": 0.5}, "$.adaptive.probe_growth"),
                       ({"enabled": "yes"}, "$.adaptive.enabled"),
                       ({"probe_every": 64, "probe_max": 32}, "$.adaptive")]:
        with pytest.raises(LonggenError, match=field.replace("$", r"\$")):
            load_generate_config(None, {"adaptive": bad})
    with pytest.raises(msgspec.ValidationError, match="probe_max"):
        msgspec.convert({"probe_every": 64, "probe_max": 32}, AdaptiveConfig)


# -- batches: one kind of step, shared costs -------------------------------------------------------


def batch_controllers(n: int, committed: list[float], spec: float, plain: float):
    """``n`` controllers past warm-up with the given acceptance, and costs of one batch shape."""
    costs = StepCosts(0.9)
    costs.spec.add(spec)
    costs.plain.add(plain)
    ctrls = [AdaptiveController(AdaptiveConfig(), costs) for _ in range(n)]
    for c, k in zip(ctrls, committed):
        c.record_spec(k)
        c.record_plain()
    return ctrls, costs


def test_a_batch_speculates_when_the_requests_together_pay_for_it():
    # One request accepts a lot, three nothing: 5 + 3 = 8 tokens per 2.0 s beat 4 per 1.0 s.
    ctrls, costs = batch_controllers(4, [5, 1, 1, 1], spec=2.0, plain=1.0)
    assert decide_batch(ctrls, costs)[0] == SPECULATE
    # ... not when the speculative step costs more than the tokens it brings.
    ctrls, costs = batch_controllers(4, [5, 1, 1, 1], spec=2.1, plain=1.0)
    assert decide_batch(ctrls, costs)[0] == PLAIN
    # Agreement needs no arithmetic.
    ctrls, costs = batch_controllers(2, [1, 1], spec=2.0, plain=1.0)
    assert decide_batch(ctrls, costs)[0] == PLAIN


def test_a_shared_cost_table_is_recorded_by_the_engine_not_the_requests():
    ctrls, costs = batch_controllers(2, [3, 3], spec=2.0, plain=1.0)
    ctrls[0].record_spec(3)  # no seconds: the engine records the batch's
    assert costs.spec.value == 2.0 and ctrls[0].spec_cost is costs.spec
    table = CostTable(0.9)
    assert table.get(1, 3000) is table.get(1, 4096)  # one bucket per power of two
    assert table.get(1, 5000) is not table.get(1, 4096)
    assert table.get(12, 4096) is table.get(16, 4096) is not table.get(8, 4096)
    assert context_bucket(10) == 1024 and context_bucket(98_304) == 131_072


def test_a_probe_decided_before_the_last_step_is_recorded_counts_as_a_probe():
    """The engine decides step k+1 before recording step k: the probe flag travels explicitly."""
    cfg = AdaptiveConfig(probe_every=2, probe_growth=4.0)
    ctrl = AdaptiveController(cfg)
    ctrl.record_spec(1, 3.0)
    for _ in range(6):
        ctrl.record_plain(1.0)
    assert ctrl.decide() == SPECULATE and ctrl.probing
    ctrl.record_spec(1, 3.0, probe=True)  # the probe did not pay: the interval grows
    assert ctrl.probes == 1 and ctrl.interval == 8


def runs_of_plain_steps(ctrl: AdaptiveController, calls: int, committed, spec_cost: float, cap: bool) -> list[str]:
    """An engine's calls: a plain call queues a run of plain steps that doubles with each
    consecutive plain call (up to 32), capped by ``plain_steps_allowed`` when ``cap``."""
    kinds, plain_calls = [], 0
    for i in range(calls):
        kind = ctrl.decide()
        if kind == SPECULATE:
            ctrl.record_spec(committed(i), spec_cost)
            kinds.append(kind)
            plain_calls = 0
            continue
        run = min(32, 1 << min(plain_calls, 5))
        if cap:
            run = min(run, ctrl.plain_steps_allowed())
        plain_calls += 1
        for _ in range(run):
            ctrl.record_plain(PLAIN_COST)
        kinds += [PLAIN] * run
    return kinds


def test_plain_runs_stop_where_a_probe_falls_due():
    """Runs of plain steps never pass a due probe: drafts that start paying (from the third
    speculative step on) are found as soon as the rule says, not a run of 32 later."""
    cfg = AdaptiveConfig(probe_every=4, refresh_every=0)
    committed = lambda i: 1 if i < 3 else 8

    def first_probe(cap: bool) -> int:
        kinds = runs_of_plain_steps(AdaptiveController(cfg), 40, committed, 2.0, cap)
        return [i for i, k in enumerate(kinds) if k == SPECULATE][1]  # the warm-up's step is the first

    # The rule: a probe once the plain steps since the last speculative one cost probe_every
    # speculative steps (4 * 2.0 / 1.0 = 8 plain steps).
    ctrl = AdaptiveController(cfg)
    ctrl.record_spec(1, 2.0)
    ctrl.record_plain(PLAIN_COST)
    assert ctrl.plain_steps_allowed() == 7
    for _ in range(7):
        ctrl.record_plain(PLAIN_COST)
    assert ctrl.decide() == SPECULATE and ctrl.probing
    assert first_probe(cap=True) == 1 + 8  # warm-up step, 8 plain steps, the probe
    assert first_probe(cap=False) > 1 + 8  # doubling runs overshoot it (1 + 2 + 4 + 8 = 15)


def test_plain_steps_allowed_is_one_while_speculating_pays_or_nothing_is_measured():
    ctrl = AdaptiveController(AdaptiveConfig())
    assert ctrl.plain_steps_allowed() == 1  # warm-up
    ctrl.record_spec(6, 2.0)
    assert ctrl.plain_steps_allowed() == 1  # no plain cost yet
    ctrl.record_plain(PLAIN_COST)
    assert ctrl.worth() and ctrl.plain_steps_allowed() == 1  # a refresh is one step


# -- method hints -------------------------------------------------------------------------------


def losing_controller() -> AdaptiveController:
    """Past warm-up, one token per speculative step at twice a plain step's cost: plain wins."""
    ctrl = AdaptiveController(AdaptiveConfig(probe_every=64))
    run(ctrl, 4, lambda i: 1, 2.0)
    assert ctrl.decide() == PLAIN
    return ctrl


def test_a_hint_that_pays_makes_the_step_speculative_and_one_that_does_not_leaves_it_plain():
    ctrl = losing_controller()
    assert ctrl.decide(hint=0.9) == PLAIN and not ctrl.hinted  # 1.9 tokens do not pay for 2.0 s
    assert ctrl.decide(hint=None) == PLAIN
    assert ctrl.decide(hint=1.0) == SPECULATE and ctrl.hinted and not ctrl.probing  # 2 tokens: a tie pays
    ctrl.record_spec(6, 2.0, hint=1.0)  # the hint undersold: 5 drafts accepted for 1 hinted
    assert ctrl.hinted_steps == 1 and ctrl.hint_scale(1.0) == pytest.approx((5 + 1) / (1 + 1))
    assert ctrl.decide() == SPECULATE  # the statistics now pay without a hint


def test_hints_that_overpromise_are_discounted():
    ctrl = losing_controller()
    assert ctrl.decide(hint=4.0) == SPECULATE
    ctrl.record_spec(1, 2.0, hint=4.0)  # nothing accepted
    assert ctrl.hint_scale(4.0) == pytest.approx(1 / 5)
    assert ctrl.decide(hint=4.0) == PLAIN  # 1 + 0.8 tokens do not pay for 2.0 s
    assert ctrl.decide(hint=40.0) == SPECULATE  # a loop's score still does
    ctrl.record_spec(1, 2.0, hint=40.0)  # and disappoints too
    assert ctrl.decide(hint=40.0) == PLAIN  # not believed any more
    # A step that had a hint calibrates whatever the reason it speculated (here a probe).
    while ctrl.decide(hint=0.5) != SPECULATE:  # 1.5 tokens never pay for 2.0 s
        ctrl.record_plain(PLAIN_COST)
    assert ctrl.probing and not ctrl.hinted
    before = ctrl.hint_scale(0.5)
    ctrl.record_spec(3, 2.0, hint=0.5)
    assert before < ctrl.hint_scale(0.5)



def test_hints_are_calibrated_per_size_so_failed_chance_matches_do_not_silence_a_loop():
    """A workload's noisy requests gave many short hints that nothing followed; a new request whose
    history loops gives a long one. Its size has no failures yet, so it is believed and the step
    speculates; a short hint stays discounted. One scale for all sizes would have read the short
    hints' ~1/16 into the long one: 1 + 60 / 16 < 5 tokens, not enough at five plain steps' cost."""
    from sgl_longgen.core.adaptive import hint_bucket

    assert [hint_bucket(h) for h in (0.01, 1.0, 1.5, 2.0, 3.0, 60.0, 1e6)] == [0, 0, 1, 1, 2, 6, 6]
    cfg = AdaptiveConfig(probe_every=4, probe_growth=4.0, probe_max=256, refresh_every=0)
    costs = StepCosts()
    costs.spec.add(5 * PLAIN_COST)
    costs.plain.add(PLAIN_COST)
    prior = WorkloadPrior(cfg.decay)
    for _ in range(3):  # noisy requests: each short hint's step accepts nothing
        noisy = AdaptiveController(cfg, costs, prior)
        for _ in range(20):
            noisy.decide(costs, hint=1.5)
            noisy.record_spec(1, probe=False, costs=costs, hint=1.5)
    pooled = 1 + 60.0 * (0 + 1) / (prior.hints.given_total() + 1)
    assert pooled < 5  # what one scale for every size would have expected of the loop's hint
    looping = AdaptiveController(cfg, costs, prior)
    assert looping.decide(costs, hint=1.5) == PLAIN  # a short hint: that size keeps failing
    assert looping.decide(costs, hint=60.0) == SPECULATE and looping.hinted
    looping.record_spec(40, probe=False, costs=costs, hint=60.0)
    assert looping.hint_scale(60.0) > 0.5 and looping.hint_scale(1.5) < 0.1


def test_a_hint_is_asked_for_only_where_it_can_change_the_step_and_at_a_bounded_cost():
    from sgl_longgen.core.adaptive import HINT_SHARE

    ctrl = AdaptiveController(AdaptiveConfig())
    assert not ctrl.hint_due()  # warming up: the step speculates anyway
    paying = AdaptiveController(AdaptiveConfig())
    run(paying, 5, lambda i: 8, 2.0)
    assert not paying.hint_due()  # speculating pays without one
    ctrl = losing_controller()
    assert ctrl.hint_due()  # no hint's cost measured yet
    ctrl.record_hint(50.0)  # the first hint indexes the prompt: no hint's price
    assert ctrl.hint_due() and ctrl.hint_cost.value is None
    ctrl.record_hint(0.1)
    steps = 0
    while not ctrl.hint_due():
        ctrl.record_plain(PLAIN_COST)
        steps += 1
    assert steps == round(0.1 / (HINT_SHARE * PLAIN_COST))  # hints take HINT_SHARE of the plain time


def test_a_batch_counts_its_requests_hints():
    ctrls, costs = batch_controllers(2, [1, 1], spec=2.0, plain=1.0)
    assert decide_batch(ctrls, costs)[0] == PLAIN
    # One request's history promises 3 more tokens: 1 + 4 tokens per 2.0 s beat 2 per 1.0 s.
    ctrls, costs = batch_controllers(2, [1, 1], spec=2.0, plain=1.0)
    kind, probes = decide_batch(ctrls, costs, [None, 3.0])
    assert kind == SPECULATE and ctrls[1].hinted and probes == [False, False]


def test_a_workload_prior_replaces_the_warm_up_and_carries_what_earlier_requests_learned():
    cfg = AdaptiveConfig(probe_every=4, probe_growth=2.0, probe_max=64, refresh_every=0)
    costs = StepCosts()
    costs.spec.add(2.0)
    costs.plain.add(PLAIN_COST)
    prior = WorkloadPrior(cfg.decay)
    first = AdaptiveController(cfg, costs, prior)
    assert first.warmup == cfg.warmup and first.decide(costs) == SPECULATE  # nothing seen yet: warm up
    first.record_spec(1, hint=3.0)  # a hinted step that accepted nothing
    for _ in range(100):  # drafts never pay: plain, probes that fail, the interval grows
        if first.decide(costs) == SPECULATE:
            first.record_spec(1, probe=True, costs=costs)
        else:
            first.record_plain()
    assert first.interval > cfg.probe_every and prior.interval == first.interval

    second = AdaptiveController(cfg, costs, prior)
    assert second.warmup == 0 and second.expected() == pytest.approx(1.0)
    assert second.interval == first.interval and second.hint_scale(3.0) < 1.0  # the hint overpromised for `first`
    kinds = [second.decide(costs) for _ in range(1)]
    assert kinds == [PLAIN]  # no blind warm-up where the workload's drafts do not pay
    for _ in range(3):
        second.record_spec(5, probe=False, costs=costs)  # this request's drafts do pay
    assert second.decide(costs) == SPECULATE  # its own steps outweigh the prior at once
    assert prior.committed.value > 1.0  # and feed it for the next request


def test_a_controller_without_a_prior_is_unchanged_by_other_requests():
    cfg = AdaptiveConfig()
    prior = WorkloadPrior(cfg.decay)
    busy = AdaptiveController(cfg, prior=prior)
    run(busy, 50, lambda i: 1, 2.0)
    alone = AdaptiveController(cfg)
    assert alone.warmup == cfg.warmup and alone.expected() is None and alone.decide() == SPECULATE


def test_a_new_shape_is_priced_at_the_nearest_measured_shapes_ratio():
    table = CostTable(0.9)
    measured = table.get(1, 4096)
    measured.spec.add(3.0)
    measured.plain.add(1.0)
    far = table.get(1, 65536)
    far.spec.add(8.0)
    far.plain.add(2.0)
    fresh = table.get(4, 4096)
    assert fresh.spec.value is None  # nothing to scale before its own plain cost is known
    fresh.plain.add(2.0)
    fresh = table.get(4, 4096)
    assert fresh.estimated and fresh.spec.value == pytest.approx(6.0)  # the same context's ratio, 3x
    fresh.spec.add(9.0)
    fresh.spec.add(9.0)
    assert fresh.spec.value == pytest.approx(9.0)  # its own steps outvote the provisional price
