"""HOWL's routing (OWL Algorithm 1): linear above the threshold, OWL trees otherwise, and the
null [SPEC] state right after a linear round."""

from sgl_longgen.config import HowlConfig
from sgl_longgen.core.howl import HowlPolicy, HowlState


def test_algorithm_1_sequence():
    policy = HowlPolicy(HowlConfig(threshold=9.0))
    state = HowlState(has_spec=True)  # the prefill appended a [SPEC]
    plan = []
    for score in (3.0, 9.0, 9.5, 12.0, 0.0, 4.0):
        route = policy.route(score, state)
        plan.append((route.linear, route.use_spec, route.attach_spec))
        policy.update(state, route)
    assert plan == [
        (False, True, True),  # tree with the prefill's [SPEC] state
        (False, True, True),  # 9.0 is not above c = 9
        (True, False, False),  # linear: no [SPEC] leaves
        (True, False, False),
        (False, False, True),  # first tree after a linear round: null state, but leaves again
        (False, True, True),
    ]


def test_without_spec_tree_rounds_never_use_or_attach_it():
    policy = HowlPolicy(HowlConfig(threshold=2.0), spec=False)
    state = HowlState(has_spec=False)
    routes = [policy.route(s, state) for s in (1.0, 5.0)]
    assert [(r.linear, r.use_spec, r.attach_spec) for r in routes] == [(False, False, False), (True, False, False)]
    policy = HowlPolicy(HowlConfig())
    routes = [policy.route(score, state) for score, state in zip([10.0, 1.0, 1.0], [HowlState(True), HowlState(False), HowlState(True)])]
    assert [(r.linear, r.use_spec) for r in routes] == [(True, False), (False, False), (False, True)]
