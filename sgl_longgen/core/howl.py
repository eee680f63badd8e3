"""HOWL's per-request routing between a linear suffix draft and an OWL tree (OWL Algorithm 1).

Every round each request has a SuffixDecoding draft with a score (the expected number of accepted
tokens). If the score exceeds the threshold c, the round verifies that draft as a chain and appends
no [SPEC] token: the whole verify budget goes to the draft, whose best case beats any OWL tree.
Otherwise the round drafts an OWL tree with [SPEC] leaves. A round right after a linear one has no
[SPEC] state, so its drafter is conditioned on the learned null vector instead (the paper's
D_nospec). The policy is a pure function of per-request state, so an engine can route a batch
whose requests take different branches.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..config import HowlConfig


@dataclass(frozen=True)
class Route:
    """One request's plan for one round."""

    linear: bool  # verify the suffix draft as a chain, without [SPEC]
    use_spec: bool  # (tree rounds) condition the drafter on the last [SPEC] state, else the null vector
    attach_spec: bool  # append [SPEC] leaves to the verify tree (always on tree rounds when [SPEC] is on)


@dataclass
class HowlState:
    """What the policy remembers about one request: whether a [SPEC] state is available."""

    has_spec: bool = False


class HowlPolicy:
    """``route(score, state)`` for one request; ``update`` after verifying.

    ``spec``: whether [SPEC] is in use at all (a drafter trained without it, or ``owl.spec =
    false``, runs every tree round without [SPEC] leaves and on the null state).
    """

    def __init__(self, config: HowlConfig, spec: bool = True):
        self.threshold = config.threshold
        self.spec = spec

    def route(self, score: float, state: HowlState) -> Route:
        if score > self.threshold:
            return Route(linear=True, use_spec=False, attach_spec=False)
        return Route(linear=False, use_spec=self.spec and state.has_spec, attach_spec=self.spec)

    @staticmethod
    def update(state: HowlState, route: Route) -> None:
        """After verification: a tree round with [SPEC] leaves leaves a [SPEC] state behind, a linear one none."""
        state.has_spec = route.attach_spec and not route.linear
