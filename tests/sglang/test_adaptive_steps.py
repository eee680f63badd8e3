"""The worker's step planner: one kind per batch, decided a step ahead, per-request overrides."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from sgl_longgen.config import AdaptiveConfig
from sgl_longgen.core.adaptive import PLAIN, SPECULATE
from sgl_longgen.sglang.adaptive import SPECULATION_OFF, AdaptiveSteps
from sgl_longgen.sglang.request_settings import parse_custom_params


class Request:
    def __init__(self, rid: str, greedy: bool = False, **custom):
        self.req = SimpleNamespace(rid=rid, sampling_params=SimpleNamespace(custom_params=custom or None))
        self.state = SimpleNamespace(adaptive=None)
        self.rid = rid
        self.sampling = SimpleNamespace(greedy=greedy)
        self.settings = parse_custom_params(custom)  # as admission parses them

    def step(self, seq_len: int = 100):
        return SimpleNamespace(rid=self.rid, req=self.req, state=self.state, seq_len=seq_len, blocker=None,
                               sampling=self.sampling, settings=self.settings)


def run(planner: AdaptiveSteps, reqs, kinds_committed, clock):
    """Steps as the worker takes them; ``clock`` advances by each step's synthetic cost."""
    kinds = []
    for _ in range(kinds_committed["steps"]):
        steps = [r.step() for r in reqs]
        kind = planner.begin(steps)
        kinds.append(kind)
        planner.plan(steps, 64)
        n = kinds_committed[kind]
        planner.record(steps, [n] * len(steps), kind)
        clock.now += kinds_committed["cost"][kind]
    return kinds


@pytest.fixture
def clock(monkeypatch):
    clock = SimpleNamespace(now=0.0)
    monkeypatch.setattr("sgl_longgen.sglang.adaptive.time.perf_counter", lambda: clock.now)
    return clock


def test_off_by_default_every_step_speculates(clock):
    planner = AdaptiveSteps(AdaptiveConfig())
    kinds = run(planner, [Request("a")], {"steps": 20, SPECULATE: 1, PLAIN: 1,
                                          "cost": {SPECULATE: 3.0, PLAIN: 1.0}}, clock)
    assert set(kinds) == {SPECULATE}


def test_auto_goes_plain_when_drafts_do_not_pay_and_stays_when_they_do(clock):
    losing = run(AdaptiveSteps(AdaptiveConfig(enabled=True)), [Request("a")],
                 {"steps": 200, SPECULATE: 1, PLAIN: 1, "cost": {SPECULATE: 3.0, PLAIN: 1.0}}, clock)
    assert losing.count(PLAIN) > 150
    paying = run(AdaptiveSteps(AdaptiveConfig(enabled=True)), [Request("b")],
                 {"steps": 200, SPECULATE: 5, PLAIN: 1, "cost": {SPECULATE: 3.0, PLAIN: 1.0}}, clock)
    assert paying.count(SPECULATE) > 180


def test_probes_that_do_not_pay_grow_further_apart(clock):
    """A probe is judged against the batch shape's measured costs: one that loses makes the next
    interval four times longer (8, 32, 128, 256 speculative steps' worth of plain time), so over
    1000 plain-priced steps only a handful speculate. Judged against a controller's own (empty)
    costs every probe would look paying and the interval would stay at 8: dozens of probes."""
    kinds = run(AdaptiveSteps(AdaptiveConfig(enabled=True)), [Request("a")],
                {"steps": 1000, SPECULATE: 1, PLAIN: 1, "cost": {SPECULATE: 3.0, PLAIN: 1.0}}, clock)
    spec = [i for i, k in enumerate(kinds) if k == SPECULATE]
    assert 3 <= len(spec) <= 8, spec
    gaps = [b - a for a, b in zip(spec, spec[1:])][-3:]  # between the last probes
    assert all(later >= 3 * earlier for earlier, later in zip(gaps, gaps[1:])), spec


def test_the_cycle_is_measured_from_decode_to_decode_and_a_prefill_drops_it(clock):
    planner = AdaptiveSteps(AdaptiveConfig(enabled=True))
    r = Request("a")
    planner.begin([r.step()])  # speculate (warm-up)
    clock.now += 2.5
    planner.broke()  # a prefill ran in between: not this step's price
    planner.begin([r.step()])
    assert planner.costs.get(1, 100).spec.value is None
    clock.now += 2.0
    planner.begin([r.step()])
    assert planner.costs.get(1, 100).spec.value == pytest.approx(2.0)


def test_overrides_per_request(clock):
    planner = AdaptiveSteps(AdaptiveConfig(enabled=True))
    off, on, auto = Request("off", longgen_speculation="off"), Request("on", longgen_speculation="on"), Request("x")
    steps = [off.step(), auto.step()]
    assert planner.begin(steps) == SPECULATE  # auto's warm-up; off drafts nothing
    assert steps[0].blocker == SPECULATION_OFF and steps[1].blocker is None
    assert AdaptiveSteps(AdaptiveConfig()).begin([Request("o", longgen_speculation="off").step()]) == PLAIN
    # "on" wins over any estimate: with a request that always speculates the batch speculates.
    kinds = run(planner, [on, auto], {"steps": 50, SPECULATE: 1, PLAIN: 1, "cost": {SPECULATE: 3.0, PLAIN: 1.0}},
                clock)
    assert set(kinds) == {SPECULATE}


def test_a_plan_holds_only_for_the_batch_it_was_made_for(clock):
    planner = AdaptiveSteps(AdaptiveConfig(enabled=True))
    a, b = Request("a"), Request("b")
    planner._planned = (frozenset({"a"}), PLAIN, {}, {}, None)
    assert planner.begin([a.step()]) == PLAIN  # planned for this batch: kept
    planner._planned = (frozenset({"a"}), PLAIN, {}, {}, None)
    assert planner.begin([a.step(), b.step()]) == SPECULATE  # b joined: decided afresh (b warms up)


@pytest.mark.parametrize("committed,second", [(1, PLAIN), (6, SPECULATE)])
def test_the_step_after_a_warm_up_is_decided_from_it(clock, committed, second):
    """Planned during the warm-up, the second step would speculate blind; decided when it begins
    it follows what the warm-up committed (costs known from an earlier request of the shape; a
    greedy one, so the sampled request has no workload prior and warms up)."""
    planner = AdaptiveSteps(AdaptiveConfig(enabled=True))
    # Two tokens a step: speculated (and priced) until they lose to plain steps at 3x the cost.
    run(planner, [Request("a", greedy=True)], {"steps": 30, SPECULATE: 2, PLAIN: 1,
                                               "cost": {SPECULATE: 3.0, PLAIN: 1.0}}, clock)
    assert planner.costs.get(1, 100).plain.value is not None and planner.costs.get(1, 100).spec.value is not None
    b = Request("b")
    steps = [b.step()]
    assert planner.begin(steps) == SPECULATE  # the warm-up
    assert planner.plan(steps, 64) == PLAIN and planner._planned is None  # nothing queued, nothing planned
    planner.record(steps, [committed], SPECULATE)
    clock.now += 3.0
    assert planner.begin([b.step()]) == second


def test_a_new_request_starts_from_its_workloads_prior(clock):
    """Where an earlier sampled request's drafts did not pay, the next sampled request starts with
    plain steps (no warm-up) and probes no sooner than the workload's grown interval; a greedy
    request, of another workload, still warms up; where drafts paid, the next request speculates
    from its first step."""
    planner = AdaptiveSteps(AdaptiveConfig(enabled=True))
    losing = {"steps": 200, SPECULATE: 1, PLAIN: 1, "cost": {SPECULATE: 3.0, PLAIN: 1.0}}
    first = run(planner, [Request("a")], losing, clock)
    later = run(planner, [Request("b")], {**losing, "steps": 40}, clock)
    assert first[0] == SPECULATE and later[0] == PLAIN
    assert first[:40].count(SPECULATE) > later.count(SPECULATE)
    assert later.count(SPECULATE) == 0  # the workload's interval (grown by a's probes) is longer than 40 steps
    assert run(planner, [Request("c", greedy=True)], {**losing, "steps": 1}, clock) == [SPECULATE]

    paying = {"steps": 30, SPECULATE: 5, PLAIN: 1, "cost": {SPECULATE: 3.0, PLAIN: 1.0}}
    fresh = AdaptiveSteps(AdaptiveConfig(enabled=True))
    run(fresh, [Request("d")], paying, clock)
    assert run(fresh, [Request("e")], {**paying, "steps": 5}, clock) == [SPECULATE] * 5


def test_a_new_batch_shape_is_not_priced_by_blind_speculation_where_drafts_commit_one_token(clock):
    """A batch of four new sampled requests, a shape never run: its plain cost is measured by a
    plain step, and its speculative cost is never measured by speculating blind: drafts that
    commit one token cannot pay whatever it is (a speculative step costs more than a plain one),
    and the shape is priced provisionally at the single request's speculative-to-plain ratio.
    No speculative step in the batch's first steps, where it used to speculate to price the
    shape; and a hint that would pay against the ratio's price is taken."""
    planner = AdaptiveSteps(AdaptiveConfig(enabled=True))
    run(planner, [Request("a")], {"steps": 100, SPECULATE: 1, PLAIN: 1, "cost": {SPECULATE: 3.0, PLAIN: 1.0}}, clock)
    one = planner.costs.get(1, 100)
    assert one.spec.value == pytest.approx(3.0) and one.plain.value == pytest.approx(1.0)
    batch = [Request(r) for r in "bcde"]
    kinds = run(planner, batch, {"steps": 20, SPECULATE: 1, PLAIN: 1, "cost": {SPECULATE: 6.0, PLAIN: 2.0}}, clock)
    assert kinds == [PLAIN] * 20
    four = planner.costs.get(4, 100)
    assert four.estimated and four.plain.value == pytest.approx(2.0) and four.spec.value == pytest.approx(6.0)


def first_probe_of_a_new_request(clock, first_cost: float) -> tuple[int, AdaptiveSteps]:
    """A losing sampled workload whose first draft per request costs ``first_cost`` (its method's
    set-up) where its later speculative steps cost 3 and plain ones 1; returns the step at which
    the next request, seeded from the workload, first speculates (its first probe)."""
    planner = AdaptiveSteps(AdaptiveConfig(enabled=True))
    cost = {SPECULATE: 3.0, PLAIN: 1.0}

    def go(req: Request, n: int) -> list[str]:
        kinds = []
        for _ in range(n):
            steps = [req.step()]
            kind = planner.begin(steps)
            first = kind == SPECULATE and planner.state(steps[0]).spec_steps == 0
            planner.plan(steps, 64)
            planner.record(steps, [1], kind)
            clock.now += first_cost if first else cost[kind]
            kinds.append(kind)
        return kinds

    go(Request("a"), 300)
    later = go(Request("b"), 8000)
    return (later.index(SPECULATE) if SPECULATE in later else len(later)), planner


def test_a_new_requests_first_probe_is_priced_with_its_methods_set_up(clock):
    """A request's first draft sets its method up (TokenSwift scores the whole context): that
    step's cycle is kept apart from the speculative steps' price, and a new request's first probe
    is priced at it, so where the set-up costs 8x a speculative step the first probe comes about
    8x later (probing keeps to its share of the time) instead of setting up every new request of a
    workload whose drafts do not pay."""
    cheap, planner = first_probe_of_a_new_request(clock, 3.0)
    dear, planner = first_probe_of_a_new_request(clock, 24.0)
    costs = planner.costs.get(1, 100)
    assert costs.first.value == pytest.approx(24.0) and costs.spec.value == pytest.approx(3.0)
    assert 0 < cheap < 8000 and dear >= 6 * cheap


def test_bad_overrides_are_refused_before_the_scheduler():
    assert parse_custom_params({"longgen_speculation": "auto"}).speculation == "auto"
    with pytest.raises(ValueError, match="longgen_speculation"):
        parse_custom_params({"longgen_speculation": "sometimes"})


def test_a_methods_hint_turns_plain_steps_speculative_and_is_reported(clock):
    """Drafts commit one token at three times a plain step's cost, so the batch goes plain; once
    the drafter's hint (its history's draft score) promises enough, the planned step speculates on
    it, the request's report counts it, and the hint is only asked for while plain steps win."""
    asked = []
    promise = {"a": 0.0}

    def hint(step):
        asked.append(step.rid)
        return promise[step.rid]

    planner = AdaptiveSteps(AdaptiveConfig(enabled=True, probe_every=64), hint)
    a = Request("a", longgen_report=True)
    cost = {"steps": 30, SPECULATE: 1, PLAIN: 1, "cost": {SPECULATE: 3.0, PLAIN: 1.0}}
    kinds = run(planner, [a], cost, clock)
    assert set(kinds[-10:]) == {PLAIN} and asked  # asked while plain wins
    promise["a"] = 5.0  # 6 tokens for 3.0 s beat 3 plain ones
    steps = [a.step()]
    assert planner.begin(steps) == PLAIN  # planned before the hint changed
    assert planner.plan(steps, 64) == SPECULATE
    report = planner.record(steps, [1], PLAIN)[0]
    assert planner.begin([a.step()]) == SPECULATE
    report = planner.record([a.step()], [6], SPECULATE)[0]
    assert report["longgen_hinted_steps"] == 1 and report["longgen_spec_steps"] == kinds.count(SPECULATE) + 1
    asked.clear()
    promise["a"] = 0.0
    steps = [a.step()]
    assert planner.plan(steps, 64) == SPECULATE and not asked  # 6 tokens per step pay: no hint needed


def test_a_probe_is_told_apart_from_a_step_that_speculates_because_it_pays(clock):
    """The worker keeps its plain runs' length across a probe (a stretch where nothing pays goes
    on), and restarts them after a step that speculates because it pays."""
    planner = AdaptiveSteps(AdaptiveConfig(enabled=True, probe_every=2))
    a = Request("a")
    seen = []
    for _ in range(60):
        steps = [a.step()]
        kind = planner.begin(steps)
        seen.append((kind, planner.probing()))
        planner.plan(steps, 64)
        planner.record(steps, [1], kind)
        clock.now += 3.0 if kind == SPECULATE else 1.0
    probes = [p for k, p in seen if k == SPECULATE]
    assert probes[0] is False and sum(probes) >= 2  # the warm-up is no probe; later ones are
    assert all(not p for k, p in seen if k == PLAIN)


def run_widths(planner: AdaptiveSteps, reqs, steps: int, nodes: list[int], cost: dict, clock) -> list:
    """Steps whose accepted path is always ``nodes`` (trie positions, the root first); a step
    costs ``cost[width]`` (None: the full draft) or ``cost[PLAIN]``. Returns each step's width
    (PLAIN for a plain step)."""
    taken = []
    for _ in range(steps):
        batch = [r.step() for r in reqs]
        kind = planner.begin(batch)
        width = planner.width if kind == SPECULATE else PLAIN
        taken.append(width)
        planner.plan(batch, 64)
        if kind == SPECULATE:
            cut = [n for n in nodes if width is None or n < width]
            planner.record(batch, [len(cut)] * len(batch), kind, [cut] * len(batch))
        else:
            planner.record(batch, [1] * len(batch), kind)
        clock.now += cost[width]
    return taken


def test_a_narrow_width_that_commits_as_much_for_less_is_taken(clock):
    """Drafts accept their first two nodes only: a 4-node cut commits what the whole draft does
    at half its cost, so the steps take it, and the whole draft still comes back now and then
    (``full_every``) to keep the wider estimate current."""
    planner = AdaptiveSteps(AdaptiveConfig(enabled=True, widths=[4], full_every=16))
    taken = run_widths(planner, [Request("a")], 300, [0, 1, 2], {None: 3.0, 4: 1.5, PLAIN: 1.0}, clock)
    late = taken[100:]
    assert late.count(4) > 0.8 * len(late)
    assert 0 < late.count(None) < 0.15 * len(late)
    costs = planner.costs.get(1, 100)
    assert costs.cost(4) == pytest.approx(1.5) and costs.spec.value == pytest.approx(3.0)
    # Where the deep nodes are accepted too, the whole draft wins.
    planner = AdaptiveSteps(AdaptiveConfig(enabled=True, widths=[4], full_every=16))
    taken = run_widths(planner, [Request("b")], 300, list(range(12)), {None: 3.0, 4: 1.5, PLAIN: 1.0}, clock)
    assert taken[100:].count(None) > 0.8 * len(taken[100:])


def test_a_fixed_width_per_request_and_the_batch_takes_its_widest(clock):
    planner = AdaptiveSteps(AdaptiveConfig(enabled=True, widths=[4, 8]))
    narrow = Request("a", longgen_speculation="on", longgen_width=4)
    wider = Request("b", longgen_speculation="on", longgen_width=8)
    full = Request("c", longgen_speculation="on")
    costs = {None: 3.0, 4: 1.5, 8: 2.0, PLAIN: 1.0}
    assert set(run_widths(planner, [narrow], 5, [0, 1], costs, clock)) == {4}
    assert set(run_widths(planner, [narrow, wider], 5, [0, 1], costs, clock)) == {8}
    assert set(run_widths(planner, [narrow, full], 5, [0, 1], costs, clock)) == {None}
    meta = planner._report(narrow.state.adaptive, None)
    assert meta["longgen_width_steps"] == {"4": 5, "8": 5, "full": 5}
    # Requests that do not decide (speculation off, or an auto one whose sampling blocks drafting)
    # leave the width to the others.
    off = Request("d", longgen_speculation="off")
    assert set(run_widths(planner, [narrow, off], 5, [0, 1], costs, clock)) == {4}
    blocked = Request("f")
    blocked.step = lambda seq_len=100: SimpleNamespace(**{**vars(Request.step(blocked, seq_len)), "blocker": "grammar"})
    assert set(run_widths(planner, [narrow, blocked], 5, [0, 1], costs, clock)) == {4}
    auto = Request("e")
    assert None in run_widths(planner, [narrow, auto], 5, [0, 1], costs, clock)  # its warm-up: the whole draft


def test_a_width_the_drafter_drafts_whole_is_the_full_draft(clock):
    planner = AdaptiveSteps(AdaptiveConfig(enabled=True), cut=lambda width: width if width < 10 else None)
    assert set(run_widths(planner, [Request("a", longgen_speculation="on", longgen_width=16)], 3, [0], {None: 1.0},
                          clock)) == {None}


def test_bad_widths_are_refused_before_the_scheduler():
    assert parse_custom_params({"longgen_width": 4}).width == 4
    for bad in (1, 0, "4", 2.0, True):
        with pytest.raises(ValueError, match="longgen_width"):
            parse_custom_params({"longgen_width": bad})
