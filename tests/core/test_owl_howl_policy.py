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


def test_a_loop_seen_twice_routes_a_chain_as_wide_as_the_verify():
    """HOWL's route scores the chain at the width it will be verified with: a loop seen twice is
    a linear round whose chain fills the verify width, whatever ``max_spec_tokens`` allows past it."""
    import random

    import torch

    from sgl_longgen.config import OwlConfig, SuffixConfig
    from sgl_longgen.methods import Howl

    rng = random.Random(0)
    loop = [rng.randrange(100) for _ in range(5)]
    history = [rng.randrange(100, 10_000) for _ in range(500)] + loop * 2
    howl = Howl(OwlConfig(), None, 0, SuffixConfig(max_spec_tokens=128), HowlConfig())
    state = howl.start("r", history, torch.zeros(4))
    for width, chain in ((65, 64), (33, 32)):
        route = howl.route(state, "r", history, width - 1)
        assert route.linear and not route.attach_spec
        assert howl.linear("r") == (loop * 30)[:chain]
    route = howl.route(state, "r", history)  # no width: the suffix settings decide
    assert route.linear and howl.linear("r") == (loop * 30)[:128]


def test_the_hint_is_the_chain_score_when_the_step_would_verify_the_chain():
    """Adaptive speculation's hint: the suffix chain's score where the route would be linear (a
    loop), None where the step drafts an OWL tree (random text); the route of the same step
    takes the very chain the hint scored."""
    import random

    import torch

    from sgl_longgen.config import OwlConfig, SuffixConfig
    from sgl_longgen.methods import Howl, Owl

    rng = random.Random(1)
    text = [rng.randrange(100, 10_000) for _ in range(400)]
    howl = Howl(OwlConfig(), None, 0, SuffixConfig(), HowlConfig(threshold=9.0))
    state = howl.start("r", text, torch.zeros(4))
    assert howl.history_hint(state, "r", text, 63) is None
    loop = [rng.randrange(100) for _ in range(7)]
    history = text + loop * 3
    state = howl.start("s", history, torch.zeros(4))
    hint = howl.history_hint(state, "s", history, 63)
    assert hint is not None and hint > 9.0
    route = howl.route(state, "s", history, 63)
    assert route.linear and howl.linear("s") == (loop * 20)[:63]
    assert howl.history_hint(state, "s", history, 15) <= 15  # scored at the width it would verify
    assert Owl(OwlConfig(), None, 0).history_hint(state, "s", history) is None  # OWL's tree needs its drafter
