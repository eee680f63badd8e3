"""Adaptive speculation: per request, take a speculative step only while it pays.

A speculative step (draft forward plus the verify forward of a whole tree) costs more than a plain
decode step. When drafts are accepted it commits several tokens and wins; when they stop being
accepted (random heads, a high temperature, text unlike anything seen) it commits about one token
at several times the price, and speculative decoding runs slower than plain decoding. The
:class:`AdaptiveController` compares the two kinds of step by expected tokens per second::

    speculate  iff  E[tokens committed per speculative step] / spec_cost  >=  1 / plain_cost

with both costs measured by the runtime (wall seconds of each kind of step, the median of the
recent ones) and the expectation an exponentially decayed mean of what past speculative steps
committed. While plain steps win it still takes a speculative *probe* once the plain steps since
the last speculative step took ``interval`` times as long as a speculative step, so the statistics
follow the text while probing costs at most ``1 / (interval + 1)`` of the time: the interval starts
at ``probe_every``, grows by ``probe_growth`` (up to ``probe_max``) after each probe that does not
pay and goes back to ``probe_every`` once one does. (Counted in plain steps, an interval is
``interval * spec_cost / plain_cost`` of them: many where a speculative step is dear, as on a CPU,
few where it costs about a plain step, as on a GPU.) The acceptance mean decays per step, plain
steps included, so after a long plain stretch a probe's result weighs more than the old evidence
and one good probe is enough to resume speculating. It starts optimistic: the first ``warmup`` steps speculate, then
one plain step measures the plain cost (and during long speculative stretches one plain step in
``refresh_every`` keeps that cost current, as both costs grow with the context).

Why mixing the two kinds of step is lossless: whichever kind a step is, every token it commits is
drawn from the target's distribution given the committed prefix (a plain step draws one token from
it; a speculative step's per-node walk commits tokens with exactly that law, the rejection sampler's
guarantee). The choice of the step's kind depends only on past steps (what they committed and how
long they took), never on the token about to be drawn, so conditioned on the prefix the next
token's law is the target's either way and the joint law of the output is unchanged, exactly as
the choice of a draft tree leaves it unchanged. Greedy output is token-identical to plain
decoding; sampled output has the plain law, but the mix of steps depends on measured times and a
different mix consumes the random stream differently: with adaptive speculation on, one seed no
longer pins one sample (turn it off to reproduce a sampled run exactly).

Draft widths (``widths``): a verify's cost grows with its width, and when only a tree's first
nodes get accepted a narrower tree commits almost as many tokens for less. With candidate widths
configured, a speculative step may also verify the method's trie cut to its first ``W`` nodes
(the method's ``max_nodes``; the full draft is width ``None``). Per width the controller keeps
the decayed mean of what a step *at that width* commits, and the step takes the width (or a
plain step) with the most expected tokens per second, each width priced by its own measured
cost. A trie's nodes come parents first, so its cut to ``W`` nodes holds, of the path a verified
step accepted, exactly the nodes at positions ``< W``: one verified step gives every width up to
the verified one a sample, ``committed(W) = 1 + accepted nodes at positions < W``. That sample
is counterfactual: exact for greedy decoding (the walk would have drawn the same tokens), an
approximation when sampling (the draws past the cut would differ) and when a method routes by
its width (HOWL scores its chain as cut). It needs no more than that: the estimates only choose
the next step's width, and any choice made from past steps alone is lossless by the argument
above (a narrower trie is just another draft). A width whose cost is not measured yet counts
as paying and is tried once its acceptance is known, if at a plain step's price (no step costs
less) it would beat the best measured width: one step per width (per cost bucket in an engine),
after which it is priced like the others. While a narrower width wins, one speculative
step in ``full_every`` and every probe take the full draft, so every width's estimate keeps
getting samples (and a width's cost is re-measured whenever it is taken: one measured at a
shorter context looks cheap, gets taken, and is priced again).

Method hints (``hint``): a method whose draft draws on the committed history (HOWL's suffix
chain, TokenSwift's continuation of the history) can tell, before any draft forward, how many
tokens that part of its draft is expected to get accepted (its suffix draft's score). Statistics
of past steps see a loop that starts in the middle of a plain stretch only at the next probe,
which may be many plain steps away; a hint sees it at once. So :meth:`AdaptiveController.decide`
takes the hint as a second estimate: a step speculates when either its statistics or
``1 + scale * hint`` tokens pay for it. ``scale`` calibrates the method's scores: the ratio of
the draft tokens accepted to the hints given over the speculative steps that had a hint of about
the same size (one bucket per power of two, :func:`hint_bucket`), both decayed, each with one
token of prior (``(accepted + 1) / (hinted + 1)``: 1 until there are any), so a method whose
scores promise more than its steps deliver soon needs a far higher score to be believed, and one
bad hint (a score taken just before the text really loops) neither silences the later ones nor
outlives its decay. Per size, because a method's short scores (chance matches in fresh text) and
its long ones (a loop the history repeats) are not equally reliable: with one scale for all, the
many short hints that a noisy stretch disappoints would discount the first long one of a loop
until it could not pay. A hint costs host time (a walk of the suffix index), so it is
asked for only where it can change the step (plain steps win) and at most every so many plain
steps that hints take :data:`HINT_SHARE` of the plain time (:meth:`AdaptiveController.hint_due`,
with the runtime's measured seconds per hint). Lossless for the same reason: a hint is a
function of the committed tokens only.

Workload priors (:class:`WorkloadPrior`): a new request knows nothing of its own, so it warms up
by speculating, and then probes at ``probe_every``. Where the drafts of a workload do not pay
(a sampled workload whose drafter predicts nothing) every request pays those steps again, the
dearest of its life (a method's first draft also sets it up: TokenSwift scores the whole context
for its partial KV). An engine keeps what its recent requests of one kind learned (greedy and
sampled apart: their acceptance differs most): the decayed acceptance over their speculative
steps, the calibration of the method's hints and the probe interval. A request that starts with
such a prior takes it as one step's evidence instead of a warm-up, and starts probing at the
workload's interval; its own steps soon outweigh it. Its first probe is priced at what a
request's first draft costs (:meth:`AdaptiveController.probe_cost`: the method's set-up comes
with it), so the interval keeps that probe to its share of the time too. Lossless for the reason the rest is: the
other requests' steps are past steps, drawn with randomness of their own, so they carry nothing
of the token this request draws next.

A batch takes one kind of step (:func:`decide_batch`): the controllers of its requests share
the costs of the batch's shape (:class:`CostTable`: measured per batch size and context length,
which is what a step's price depends on) and the batch speculates when the requests' expected
tokens together pay for it, or when one of them is warming up or due for a probe and the rest
would not lose much by it. The same argument keeps this lossless: the choice depends only on
past steps of the batch's requests.

Engine-agnostic and deterministic: no clock is read here. The runtime passes the seconds it
measured (and the clock a hint is timed with), so tests drive it with synthetic costs and
acceptances.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

from ..config import AdaptiveConfig

SPECULATE, PLAIN = "speculate", "plain"
# Hints take at most this share of the time of the plain steps between them.
HINT_SHARE = 0.02
# Tokens of prior in a hint's calibration (accepted / hinted).
HINT_PRIOR = 1.0
# Calibration buckets of hints by size: (0, 1], (1, 2], (2, 4], ..., the last one open.
HINT_BUCKETS = 7


def hint_bucket(hint: float) -> int:
    """The calibration bucket of a hint: ``b`` holds ``(2^(b-1), 2^b]``, 0 holds everything up to
    1, the last bucket everything above."""
    return 0 if hint <= 1.0 else min(HINT_BUCKETS - 1, math.ceil(math.log2(hint)))


class HintCalibration:
    """Draft tokens accepted and tokens hinted over the steps that had a hint, per
    :func:`hint_bucket`, decayed by ``decay`` per :meth:`tick`.

    Decayed lazily: a tick runs at every step of every request (plain tokens included), so it
    only counts, and a bucket catches up on its decay when it is read or added to.
    """

    __slots__ = ("accepted", "decay", "given", "stamps", "steps")

    def __init__(self, decay: float):
        self.decay = decay
        self.steps = 0
        self.accepted = [0.0] * HINT_BUCKETS
        self.given = [0.0] * HINT_BUCKETS
        self.stamps = [0] * HINT_BUCKETS  # the tick each bucket's totals are decayed to

    def tick(self) -> None:
        self.steps += 1

    def _bucket(self, hint: float) -> int:
        """``hint``'s bucket, its totals decayed to now."""
        b = hint_bucket(hint)
        self._catch_up(b)
        return b

    def _catch_up(self, b: int) -> None:
        lag = self.steps - self.stamps[b]
        if lag:
            factor = self.decay**lag
            self.accepted[b] *= factor
            self.given[b] *= factor
            self.stamps[b] = self.steps

    def add(self, hint: float, accepted: int) -> None:
        b = self._bucket(hint)
        self.accepted[b] += accepted
        self.given[b] += hint

    def scale(self, hint: float) -> float:
        """Draft tokens accepted per hinted token over the steps whose hint was of ``hint``'s
        size, with :data:`HINT_PRIOR` tokens of prior on both sides (1: none yet)."""
        b = self._bucket(hint)
        return (self.accepted[b] + HINT_PRIOR) / (self.given[b] + HINT_PRIOR)

    def given_total(self) -> float:
        """Tokens hinted over every size together, decayed."""
        for b in range(HINT_BUCKETS):
            self._catch_up(b)
        return sum(self.given)


class DecayedMean:
    """A mean whose weights decay by ``decay`` per :meth:`tick`: recent samples count most."""

    __slots__ = ("decay", "total", "weight")

    def __init__(self, decay: float):
        self.decay = decay
        self.total = 0.0
        self.weight = 0.0

    def tick(self) -> None:
        self.total *= self.decay
        self.weight *= self.decay

    def add(self, x: float) -> None:
        self.total += x
        self.weight += 1.0

    @property
    def value(self) -> float | None:
        return self.total / self.weight if self.weight > 0 else None


class RecentMedian:
    """The lower median of the last ``size`` samples.

    Step costs carry one-off spikes (a kernel compiled at its first launch, a request's first
    draft scoring its whole context): an average keeps such a spike for tens of steps and can
    hold speculation off (or on) long after it passed; a median of recent samples drops it once
    a few ordinary steps followed, and still follows a cost that grows with the context.
    """

    __slots__ = ("size", "samples", "value")

    def __init__(self, size: int = 5):
        self.size = size
        self.samples: list[float] = []
        self.value: float | None = None

    def add(self, x: float) -> None:
        self.samples.append(x)
        del self.samples[: -self.size]
        ordered = sorted(self.samples)
        self.value = ordered[(len(ordered) - 1) // 2]


class StepCosts:
    """Measured seconds of a speculative and of a plain step of one shape (recent medians).

    ``spec`` prices a speculative step over the full draft; ``narrow[W]`` one over the draft cut
    to ``W`` nodes (adaptive widths). ``first`` prices a step in which a request drafts for the
    first time: its method sets itself up there (TokenSwift scores the whole context for its
    partial KV: several speculative steps' worth at 4K, dozens at 98K), so that step is not a
    sample of ``spec`` but the price of a new request's first probe (:meth:`AdaptiveController.probe_cost`).
    """

    __slots__ = ("estimated", "first", "narrow", "plain", "spec")

    def __init__(self, decay: float | None = None):
        self.spec = RecentMedian()
        self.plain = RecentMedian()
        self.first = RecentMedian()
        self.narrow: dict[int, RecentMedian] = {}
        self.estimated = False  # the speculative cost holds a provisional sample (CostTable.get)

    def at(self, width: int | None) -> RecentMedian:
        """The costs of speculative steps at ``width`` (None: the full draft), to record into."""
        if width is None:
            return self.spec
        median = self.narrow.get(width)
        if median is None:
            median = self.narrow[width] = RecentMedian()
        return median

    def cost(self, width: int | None) -> float | None:
        """The measured seconds of a speculative step at ``width`` (None: not measured yet)."""
        if width is None:
            return self.spec.value
        median = self.narrow.get(width)
        return None if median is None else median.value


def context_bucket(context: int) -> int:
    """Steps of contexts within a factor of two cost about the same: the power of two at or
    above ``context`` (at least 1024)."""
    return max(1024, 1 << max(0, int(context) - 1).bit_length())


def batch_bucket(batch_size: int) -> int:
    """Batch sizes up to 8 exactly, then powers of two (a step's cost grows slowly with them)."""
    return batch_size if batch_size <= 8 else 1 << (batch_size - 1).bit_length()


class CostTable:
    """:class:`StepCosts` per (batch size, context length) bucket, for an engine serving batches.

    A bucket not yet measured has no plain cost, so the controllers first take a plain step
    there: each bucket's table fills itself from the steps the engine runs anyway. Its
    speculative cost is measured only by speculating, which a workload whose drafts do not pay
    does rarely (probes); until then, once its plain cost is known, it is priced provisionally
    at the speculative-to-plain ratio of the nearest shape measured (the same context first),
    a sample that the bucket's own steps soon outvote. Without it a hint, or a batch whose
    requests disagree, would speculate blind to price every new shape.
    """

    def __init__(self, decay: float):
        self.decay = decay
        self._costs: dict[tuple[int, int], StepCosts] = {}

    def get(self, batch_size: int, context: int) -> StepCosts:
        key = (batch_bucket(batch_size), context_bucket(context))
        costs = self._costs.get(key)
        if costs is None:
            costs = self._costs[key] = StepCosts(self.decay)
        if costs.spec.value is None and costs.plain.value is not None and not costs.estimated:
            ratio = self._nearest_ratio(key)
            if ratio is not None:
                costs.spec.add(costs.plain.value * ratio)
                costs.estimated = True
        return costs

    def _nearest_ratio(self, key: tuple[int, int]) -> float | None:
        """Speculative over plain cost of the measured bucket nearest ``key`` (context first)."""
        batch, context = key
        best = None
        for (b, c), other in self._costs.items():
            spec, plain = other.spec.value, other.plain.value
            if (b, c) == key or other.estimated or spec is None or not plain:
                continue
            distance = (abs(c.bit_length() - context.bit_length()), abs(b - batch))
            if best is None or distance < best[0]:
                best = (distance, spec / plain)
        return None if best is None else best[1]

    def items(self):
        """((batch bucket, context bucket), costs) for reports."""
        return sorted(self._costs.items())


class Evidence:
    """What speculative steps committed, decayed: tokens per step (per draft width too, where
    widths are configured) and the method hints' calibration (draft tokens accepted and hinted
    over the steps that had a hint, per :func:`hint_bucket`). A request's controller keeps one,
    decayed per step of either kind; a :class:`WorkloadPrior` keeps one over its requests'
    speculative steps."""

    __slots__ = ("at_width", "committed", "hints")

    def __init__(self, decay: float, widths: Sequence[int] = ()):
        self.committed = DecayedMean(decay)  # tokens per speculative step (the bonus included)
        self.at_width: dict[int | None, DecayedMean] = (
            {w: DecayedMean(decay) for w in [*widths, None]} if widths else {})
        self.hints = HintCalibration(decay)

    def tick(self) -> None:
        for mean in (self.committed, self.hints, *self.at_width.values()):
            mean.tick()

    def record(self, committed: int, hint: float | None) -> None:
        """A speculative step committed ``committed`` tokens, decided with the method's ``hint``."""
        self.committed.add(committed)
        if hint is not None and hint > 0:
            self.hints.add(hint, max(0, committed - 1))

    def record_width(self, width: int | None, committed: int) -> None:
        """What a step at ``width`` committed (or would have: a wider step's counterfactual)."""
        mean = self.at_width.get(width)
        if mean is not None:
            mean.add(committed)


class WorkloadPrior(Evidence):
    """What the recent requests of one workload learned, for the next request to start from.

    Fed by every speculative step of the controllers made with it (decayed per such step, so it
    follows the workload's last tens of steps, whichever requests took them), plus the probe
    interval the last probe left. :meth:`AdaptiveController.__init__` seeds a new request from it
    once it holds any step.
    """

    __slots__ = ("interval",)

    def __init__(self, decay: float, widths: Sequence[int] = ()):
        super().__init__(decay, widths)
        self.interval: int | None = None

    @property
    def known(self) -> bool:
        """Some request's speculative step has been seen."""
        return self.committed.value is not None


class AdaptiveController:
    """One request's choice between a speculative and a plain step.

    Per step: :meth:`decide`, then the runtime takes that step, measures its wall time and
    reports it with :meth:`record_spec` (tokens it committed, seconds, optionally the draft's
    source: per-source means are kept in :attr:`by_source` for diagnostics) or :meth:`record_plain`.
    An engine running batches passes each step's shared :class:`StepCosts` to :meth:`decide` and
    records the step's seconds there itself (``seconds=None`` here).

    With ``config.widths``, a speculative :meth:`decide` also sets :attr:`width` (the ``max_nodes``
    to draft with, None: the full draft) and :meth:`record_spec` takes the width the step verified
    and the accepted path's node positions (``Verdict.nodes``, the root's 0 first).

    ``prior``: the workload's :class:`WorkloadPrior`, shared by the controllers of one engine's
    requests of a kind. One that has seen a step seeds this request (its acceptance as one step of
    evidence, the hints' calibration, the probe interval; no warm-up), and every speculative step
    of this request feeds it.
    """

    def __init__(self, config: AdaptiveConfig, costs: StepCosts | None = None, prior: WorkloadPrior | None = None):
        self.config = config
        self.prior = prior
        self.warmup = config.warmup  # speculative steps before the first decision (none with a prior)
        # Adaptive widths: the candidates narrower than the full draft (None), ascending.
        self.widths: list[int] = list(config.widths)
        self.own = Evidence(config.decay, self.widths)  # this request's, decayed per step of either kind
        self._fed = (self.own,) if prior is None else (self.own, prior)  # what a speculative step feeds
        self.committed, self.at_width = self.own.committed, self.own.at_width
        self.by_source: dict[str, DecayedMean] = {}
        self.costs = costs if costs is not None else StepCosts(config.decay)
        self.spec_steps = 0
        self.plain_steps = 0
        self.probes = 0
        self.interval = config.probe_every  # speculative steps' worth of plain time before the next probe
        self.since_spec = 0  # plain steps since the last speculative step
        self.since_plain = 0  # speculative steps since the last plain step
        self._probing = False
        self.width_steps: dict[int | None, int] = {}  # speculative steps taken at each width
        self.width: int | None = None  # the width the last decide() chose
        self.since_full = 0  # speculative steps since the last one over the full draft
        self._forced = False  # the last decide()'s width was not a free choice (warm-up, probe, ...)
        self.hinted_steps = 0  # speculative steps taken on a hint alone
        self.hint_cost = RecentMedian()  # seconds the runtime took for a hint
        self.hints = 0  # hints the runtime computed
        self.since_hint = 0  # plain steps since the last hint
        self._hinted = False
        if prior is not None and prior.known:
            self._seed(prior)

    def _seed(self, prior: WorkloadPrior) -> None:
        """Start from the workload's evidence: its acceptance as one step's worth and its probe
        interval (the hints' calibration is read from it live, :meth:`hint_scale`); the warm-up is
        what a prior replaces."""
        self.committed.add(prior.committed.value)
        for width, mean in self.at_width.items():
            seen = prior.at_width.get(width)
            if seen is not None and seen.value is not None:
                mean.add(seen.value)
        if prior.interval is not None:
            self.interval = prior.interval
        self.warmup = 0

    # -- the decision --------------------------------------------------------------------------

    @property
    def spec_cost(self) -> RecentMedian:
        return self.costs.spec

    @property
    def plain_cost(self) -> RecentMedian:
        return self.costs.plain

    @property
    def probing(self) -> bool:
        """The last :meth:`decide` asked for a probe (a speculative step although plain steps win)."""
        return self._probing

    @property
    def forced_width(self) -> bool:
        """The last :meth:`decide`'s width was due rather than the best one (warm-up, a probe, a
        full-draft refresh, a width's first measurement): a batch serves it (:func:`batch_width`)."""
        return self._forced

    @property
    def hinted(self) -> bool:
        """The last :meth:`decide` speculates on the method's hint alone."""
        return self._hinted

    def expected(self) -> float | None:
        """Tokens a speculative step is expected to commit (None: no evidence yet)."""
        return self.committed.value

    def hint_scale(self, hint: float) -> float:
        """The calibration of a hint of ``hint``'s size (:meth:`HintCalibration.scale`). With a
        workload prior, the workload's: its hinted steps decay per speculative step only, so what
        the workload's hints delivered is not forgotten over a request's plain stretch (where this
        request's own evidence fades within tens of steps and a score that keeps failing would be
        believed again): the workload's calibration, which holds this request's hinted steps too,
        is the one read."""
        return (self.prior if self.prior is not None else self.own).hints.scale(hint)

    def expected_from_hint(self, hint: float | None) -> float | None:
        """Tokens a speculative step is expected to commit by the method's ``hint`` (None: no hint)."""
        return None if hint is None else 1.0 + self.hint_scale(hint) * max(0.0, hint)

    def estimate(self, hint: float | None = None, width: int | None = None) -> float | None:
        """The larger of the two estimates of a speculative step's tokens at ``width``: its
        statistics and, for the whole draft (``width`` None), the method's hint."""
        from_hint = self.expected_from_hint(hint) if width is None else None
        values = [e for e in (self.expected_at(width), from_hint) if e is not None]
        return max(values) if values else None

    def expected_at(self, width: int | None) -> float | None:
        """Tokens a speculative step at ``width`` is expected to commit (None: no evidence yet;
        without configured widths, :meth:`expected`)."""
        if not self.widths:
            return self.committed.value
        mean = self.at_width.get(width)
        return None if mean is None else mean.value

    def worth(self, costs: StepCosts | None = None) -> bool:
        """Speculating is expected to give at least as many tokens per second as plain steps.
        Optimistic while the acceptance or the plain cost is unknown; while only the speculative
        step's cost is unknown, it pays iff it is expected to commit more than one token (it
        costs more than a plain step, which commits one, so one token never pays for it). With
        widths: at some width, a width whose cost is not measured yet counting as paying where its
        acceptance exceeds one token (it is tried, then priced)."""
        costs = costs or self.costs
        if self.widths:
            return self._worth_at_some_width(costs)
        return _pays(self.committed.value, costs.spec.value, costs.plain.value)

    def _worth_at_some_width(self, costs: StepCosts) -> bool:
        plain = costs.plain.value
        if self.at_width[None].value is None or plain is None:
            return True
        return any(_pays(mean.value, costs.cost(width), plain) for width, mean in self.at_width.items()
                   if mean.value is not None)

    def best_width(self, costs: StepCosts | None = None) -> int | None:
        """The width with the most expected tokens per second among those measured (None: the full
        draft; ties go to the wider one, whose step also samples the narrower widths)."""
        costs = costs or self.costs
        if self.at_width[None].value is None or costs.spec.value is None:
            return None
        return _fastest(_measured_widths(self, costs), lambda width, cost: self.at_width[width].value)

    def _choose_width(self, costs: StepCosts) -> tuple[int | None, bool]:
        """(width, forced) of a speculative step that is taken because speculating pays."""
        if not self.widths:
            return None, False
        if costs.spec.value is None:
            return None, True  # price the full draft first
        width = self.best_width(costs)
        best_e, best_cost, plain = self.at_width[width].value, costs.cost(width), costs.plain.value
        if best_e is None:
            return None, True  # the full draft's acceptance first: every width's sample comes with it
        for narrow in self.widths:  # a width whose acceptance is known but whose cost is not: try it
            e = self.at_width[narrow].value
            # ... where it can win: no step costs less than a plain one, so at a plain step's price
            # its expected tokens must beat the best measured width's rate (a cut that keeps few of
            # the accepted nodes, such as TokenSwift's n-gram chains behind its head tree, never is).
            if e is not None and costs.cost(narrow) is None and e * best_cost > best_e * plain:
                return narrow, True
        if width is not None and self.since_full + 1 >= self.config.full_every:
            return None, True  # keep the wider widths' estimates fresh
        return width, False

    def hint_due(self, costs: StepCosts | None = None) -> bool:
        """Whether the next :meth:`decide` wants the method's hint: only where one can change the
        step (past the warm-up, plain steps winning) and once the plain steps since the last hint
        took ``1 / HINT_SHARE`` times a hint's measured cost."""
        costs = costs or self.costs
        plain = costs.plain.value
        if self.spec_steps < self.warmup or plain is None or self.worth(costs):
            return False
        cost = self.hint_cost.value
        return cost is None or self.since_hint * plain * HINT_SHARE >= cost

    def record_hint(self, seconds: float) -> None:
        """The runtime took ``seconds`` to compute a hint. A request's first hint is not a
        hint's price: it indexes the whole prompt (a one-off), and counted as one it would space
        the next hints out by hundreds of plain steps."""
        if self.hints:
            self.hint_cost.add(seconds)
        self.hints += 1
        self.since_hint = 0

    def hint_if_due(self, hint: Callable[[], float | None], clock: Callable[[], float],
                    costs: StepCosts | None = None) -> float | None:
        """The method's ``hint()`` where :meth:`hint_due`, timed with the runtime's ``clock``
        (seconds) and recorded; None where no hint is due."""
        if not self.hint_due(costs):
            return None
        t = clock()
        value = hint()
        self.record_hint(clock() - t)
        return value

    def hint_pays(self, hint: float | None, costs: StepCosts | None = None) -> bool:
        """The method's ``hint`` alone makes a speculative step (over the full draft) pay (by the
        rule of :meth:`worth`, with the plain cost known)."""
        costs = costs or self.costs
        e, plain = self.expected_from_hint(hint), costs.plain.value
        if e is None or plain is None:
            return False
        return _pays(e, costs.spec.value, plain)

    def decide(self, costs: StepCosts | None = None, hint: float | None = None) -> str:
        """``"speculate"`` or ``"plain"`` for the next step (call once per step; ``costs``: the
        shape's shared costs in an engine; ``hint``: the method's estimate of the draft tokens its
        next draft gets accepted, from the committed history alone, None: none)."""
        cfg = self.config
        costs = costs or self.costs
        self._probing = self._hinted = False
        self.width, self._forced = None, False  # warm-up and probes: the full draft, due
        if self.spec_steps < self.warmup:
            self._forced = bool(self.widths)
            return SPECULATE
        if costs.plain.value is None:
            return PLAIN  # measure what a plain step costs
        if self.worth(costs):
            if cfg.refresh_every and self.since_plain >= cfg.refresh_every:
                return PLAIN  # keep the plain cost current while speculating
            self.width, self._forced = self._choose_width(costs)
            return SPECULATE
        if self.hint_pays(hint, costs):
            self._hinted = True
            self._forced = bool(self.widths)  # the hint is the whole draft's
            return SPECULATE
        if self.since_spec * costs.plain.value >= self.interval * self.probe_cost(costs):
            self._probing = True
            self._forced = bool(self.widths)
            return SPECULATE
        return PLAIN

    def plain_steps_allowed(self, costs: StepCosts | None = None) -> int:
        """Plain steps that may run back to back before this controller wants a speculative one
        (at least 1): the steps until its next probe falls due, by the same rule as :meth:`decide`.

        A runtime that queues several plain steps in one call (where the per-call host time is
        dear) must not run past a due probe: a probe that comes late keeps a paying draft idle, and
        with runs that double in length it can come many times too late. While speculating pays,
        or with nothing measured, a plain step is a one-off (a cost refresh): 1.
        """
        costs = costs or self.costs
        plain = costs.plain.value
        if self.spec_steps < self.warmup or plain is None or plain <= 0 or self.worth(costs):
            return 1
        due = self.interval * self.probe_cost(costs) / plain - self.since_spec  # decide() probes once <= 0
        return max(1, math.ceil(due))

    def probe_cost(self, costs: StepCosts | None = None) -> float:
        """What this request's next probe costs: a speculative step (a plain one while that is
        unmeasured), or, before this request's first draft, what a first draft's step costs where
        that is measured (its method's set-up comes with it). The interval is counted in these, so
        probing keeps to its share of the time where a first draft is dear, and a workload whose
        drafts do not pay does not set every new request's method up soon after it starts."""
        costs = costs or self.costs
        spec = costs.spec.value if costs.spec.value is not None else costs.plain.value
        if self.spec_steps == 0 and costs.first.value is not None:
            spec = max(spec or 0.0, costs.first.value)
        return spec

    # -- what the step did ---------------------------------------------------------------------

    def record_spec(self, committed: int, seconds: float | None = None, source: str | None = None,
                    probe: bool | None = None, costs: StepCosts | None = None, width: int | None = None,
                    nodes: Sequence[int] | None = None, hint: float | None = None,
                    hinted: bool | None = None) -> None:
        """A speculative step committed ``committed`` tokens in ``seconds`` (None: the engine
        records the batch's seconds in the shared costs). ``probe``: whether the step was taken as
        a probe (default: what the last :meth:`decide` said; an engine that decides the next step
        before recording this one passes it). ``costs``: the shape's shared costs in an engine,
        which judge whether a probe paid (a controller's own are empty there). ``width``: the
        ``max_nodes`` the step drafted with (None: the full draft); ``nodes``: the accepted path's
        node positions in the trie, the root first (then every width up to ``width`` gets its
        counterfactual sample; without them only ``width`` gets ``committed``). ``hint``: the
        method's hint the step was decided with (it calibrates later hints); ``hinted``: whether
        it was taken on that hint alone (default: what the last :meth:`decide` said)."""
        if probe is not None:
            self._probing = probe
        if hinted is None:
            hinted = self._hinted
        self._tick()
        if self.prior is not None:
            self.prior.tick()
        for evidence in self._fed:
            evidence.record(committed, hint)
        if hinted:
            self.hinted_steps += 1
            self._hinted = False
        if source is not None:
            mean = self.by_source.get(source)
            if mean is None:
                mean = self.by_source[source] = DecayedMean(self.config.decay)
            mean.add(committed)
        if self.widths:
            self._record_width(committed, width, nodes)
        if seconds is not None:
            self.costs.at(width if self.widths else None).add(seconds)
        self.spec_steps += 1
        self.since_spec = 0
        self.since_plain += 1
        if self._probing:
            self.probes += 1
            cfg = self.config
            if self.worth(costs):  # the probe paid: speculate again, probe eagerly next time
                self.interval = cfg.probe_every
            else:
                self.interval = min(cfg.probe_max, max(self.interval, round(self.interval * cfg.probe_growth)))
            if self.prior is not None:
                self.prior.interval = self.interval
            self._probing = False

    def _record_width(self, committed: int, width: int | None, nodes: Sequence[int] | None) -> None:
        """Per-width samples of one step verified at ``width``: the widths it covers get what their
        cut of the trie would have committed (the accepted nodes before the cut, the bonus)."""
        self.width_steps[width] = self.width_steps.get(width, 0) + 1
        self.since_full = 0 if width is None else self.since_full + 1
        samples = [(width, committed)] if nodes is None else (
            ([(None, committed)] if width is None else [])
            + [(w, sum(1 for n in nodes if n < w))  # the root (0) is the bonus's slot
               for w in self.widths if width is None or w <= width])
        for evidence in self._fed:
            for w, n in samples:
                evidence.record_width(w, n)

    def _tick(self) -> None:
        """One more step (of either kind): older acceptance evidence weighs less."""
        self.own.tick()
        for mean in self.by_source.values():
            mean.tick()

    def record_plain(self, seconds: float | None = None) -> None:
        """A plain step (one token) took ``seconds`` (None: recorded by the engine)."""
        self._tick()
        if seconds is not None:
            self.costs.plain.add(seconds)
        self.plain_steps += 1
        self.since_spec += 1
        self.since_hint += 1
        self.since_plain = 0
        self._probing = self._hinted = False


def _pays(expected: float | None, spec: float | None, plain: float | None) -> bool:
    """``expected`` tokens per speculative step of cost ``spec`` give at least a plain step's one
    token per ``plain`` (see :meth:`AdaptiveController.worth` for the unknowns)."""
    if expected is None or plain is None:
        return True
    if spec is None:
        return expected > 1.0
    return expected * plain >= spec  # expected / spec >= 1 / plain, without dividing by a zero cost


def decide_batch(controllers: list[AdaptiveController], costs: StepCosts,
                 hints: Sequence[float | None] | None = None) -> tuple[str, list[bool]]:
    """One kind of step for a batch, and which requests take it as a probe.

    Each request's controller decides against the batch shape's ``costs``. If they agree, that
    is the step. If they differ, the requests' expected tokens decide together: a speculative
    step of the batch commits the sum of their expectations (an unknown one counts as paying
    for itself) where a plain step commits one token each, so the batch speculates iff
    ``sum(E_i) / spec_cost >= n / plain_cost``; a request's due probe or warm-up is served when
    that holds and deferred otherwise. With widths, iff that holds at some measured width (each
    width's expectations over its own cost); :func:`batch_width` then picks the width.
    ``hints``: each request's method hint (see :meth:`AdaptiveController.decide`), which raises
    its expectation to :meth:`AdaptiveController.estimate`.
    """
    hints = list(hints) if hints is not None else [None] * len(controllers)
    kinds = [c.decide(costs, h) for c, h in zip(controllers, hints)]
    if all(k == kinds[0] for k in kinds):
        kind = kinds[0]
    else:
        spec, plain = costs.spec.value, costs.plain.value
        if spec is None or plain is None:
            kind = SPECULATE if plain is not None else PLAIN
        elif controllers[0].widths:
            n = len(controllers)
            pays = any(_batch_expected(controllers, w, cost, plain, hints) * plain >= n * cost
                       for w, cost in _measured_widths(controllers[0], costs))
            kind = SPECULATE if pays else PLAIN
        else:
            expected = _batch_expected(controllers, None, spec, plain, hints)
            kind = SPECULATE if expected * plain >= len(controllers) * spec else PLAIN
    probes = [kind == SPECULATE and c.probing for c in controllers]
    return kind, probes


def batch_width(controllers: list[AdaptiveController], costs: StepCosts) -> int | None:
    """One draft width for a batch that speculates (:func:`decide_batch`): None, the full draft,
    without configured widths.

    A request whose width is due (warm-up, a probe, a full-draft refresh, a width's first
    measurement) gets it, widened to the widest such request (a wider step also samples every
    narrower width, so no request's estimates go stale). Otherwise the width with the most
    expected tokens per second for the batch together: the sum of the requests' expectations at
    that width (an unknown one counting as paying for itself) over the width's cost for this
    batch shape (ties: the wider). Lossless for the reason a single request's choice is: only
    past steps decide.
    """
    if not controllers or not controllers[0].widths:
        return None
    due = [c.width for c in controllers if c.forced_width]
    if due:
        return None if None in due else max(due)
    plain = costs.plain.value
    return _fastest(_measured_widths(controllers[0], costs),
                    lambda width, cost: _batch_expected(controllers, width, cost, plain))


def _fastest(candidates: list[tuple[int | None, float]],
             expected: Callable[[int | None, float], float | None]) -> int | None:
    """Of ``(width, cost)`` candidates, widest first, the one with the most expected tokens per
    second (a strict comparison: ties keep the wider); widths without an expectation are skipped."""
    best, best_e, best_cost = None, None, None
    for width, cost in candidates:
        e = expected(width, cost)
        if e is not None and (best_e is None or e * best_cost > best_e * cost):
            best, best_e, best_cost = width, e, cost
    return best


def _measured_widths(controller: AdaptiveController, costs: StepCosts) -> list[tuple[int | None, float]]:
    """(width, cost) of the widths with a measured cost, the full draft first, then narrowing."""
    out = []
    for width in [None, *reversed(controller.widths)]:
        cost = costs.cost(width)
        if cost is not None:
            out.append((width, cost))
    return out


def _batch_expected(controllers: list[AdaptiveController], width: int | None, cost: float,
                    plain: float | None, hints: Sequence[float | None] | None = None) -> float:
    """The batch's expected tokens at ``width``; a request with no estimate there counts as paying
    for the step (``cost / plain``, or one token while the plain cost is unknown). A hint speaks
    for the whole draft (``width`` None), where it raises the request's estimate."""
    total = 0.0
    for i, c in enumerate(controllers):
        e = c.estimate(hints[i] if hints is not None else None, width)
        total += e if e is not None else (cost / plain if plain else 1.0)
    return total
