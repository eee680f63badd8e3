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

A batch takes one kind of step (:func:`decide_batch`): the controllers of its requests share
the costs of the batch's shape (:class:`CostTable`: measured per batch size and context length,
which is what a step's price depends on) and the batch speculates when the requests' expected
tokens together pay for it, or when one of them is warming up or due for a probe and the rest
would not lose much by it. The same argument keeps this lossless: the choice depends only on
past steps of the batch's requests.

Engine-agnostic and deterministic: no clock is read here. The runtime passes the seconds it
measured, so tests drive it with synthetic costs and acceptances.
"""

from __future__ import annotations

import math

from ..config import AdaptiveConfig

SPECULATE, PLAIN = "speculate", "plain"


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
    """Measured seconds of a speculative and of a plain step of one shape (recent medians)."""

    __slots__ = ("spec", "plain")

    def __init__(self, decay: float | None = None):
        self.spec = RecentMedian()
        self.plain = RecentMedian()


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
    there: each bucket's table fills itself from the steps the engine runs anyway.
    """

    def __init__(self, decay: float):
        self.decay = decay
        self._costs: dict[tuple[int, int], StepCosts] = {}

    def get(self, batch_size: int, context: int) -> StepCosts:
        key = (batch_bucket(batch_size), context_bucket(context))
        costs = self._costs.get(key)
        if costs is None:
            costs = self._costs[key] = StepCosts(self.decay)
        return costs

    def items(self):
        """((batch bucket, context bucket), costs) for reports."""
        return sorted(self._costs.items())


class AdaptiveController:
    """One request's choice between a speculative and a plain step.

    Per step: :meth:`decide`, then the runtime takes that step, measures its wall time and
    reports it with :meth:`record_spec` (tokens it committed, seconds, optionally the draft's
    source: per-source means are kept in :attr:`by_source` for diagnostics) or :meth:`record_plain`.
    An engine running batches passes each step's shared :class:`StepCosts` to :meth:`decide` and
    records the step's seconds there itself (``seconds=None`` here).
    """

    def __init__(self, config: AdaptiveConfig, costs: StepCosts | None = None):
        self.config = config
        self.committed = DecayedMean(config.decay)  # tokens per speculative step (the bonus included)
        self.by_source: dict[str, DecayedMean] = {}
        self.costs = costs if costs is not None else StepCosts(config.decay)
        self.spec_steps = 0
        self.plain_steps = 0
        self.probes = 0
        self.interval = config.probe_every  # speculative steps' worth of plain time before the next probe
        self.since_spec = 0  # plain steps since the last speculative step
        self.since_plain = 0  # speculative steps since the last plain step
        self._probing = False

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

    def expected(self) -> float | None:
        """Tokens a speculative step is expected to commit (None: no evidence yet)."""
        return self.committed.value

    def worth(self, costs: StepCosts | None = None) -> bool:
        """Speculating is expected to give at least as many tokens per second as plain steps
        (True while either side has no data: optimistic)."""
        costs = costs or self.costs
        mean, spec, plain = self.committed.value, costs.spec.value, costs.plain.value
        if mean is None or spec is None or plain is None:
            return True
        return mean * plain >= spec  # mean / spec >= 1 / plain, without dividing by a zero cost

    def decide(self, costs: StepCosts | None = None) -> str:
        """``"speculate"`` or ``"plain"`` for the next step (call once per step; ``costs``: the
        shape's shared costs in an engine)."""
        cfg = self.config
        costs = costs or self.costs
        self._probing = False
        if self.spec_steps < cfg.warmup:
            return SPECULATE
        if costs.plain.value is None:
            return PLAIN  # measure what a plain step costs
        if self.worth(costs):
            if cfg.refresh_every and self.since_plain >= cfg.refresh_every:
                return PLAIN  # keep the plain cost current while speculating
            return SPECULATE
        spec = costs.spec.value if costs.spec.value is not None else costs.plain.value
        if self.since_spec * costs.plain.value >= self.interval * spec:
            self._probing = True
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
        if self.spec_steps < self.config.warmup or plain is None or plain <= 0 or self.worth(costs):
            return 1
        spec = costs.spec.value if costs.spec.value is not None else plain
        due = self.interval * spec / plain - self.since_spec  # decide() probes once this is <= 0
        return max(1, math.ceil(due))

    # -- what the step did ---------------------------------------------------------------------

    def record_spec(self, committed: int, seconds: float | None = None, source: str | None = None,
                    probe: bool | None = None, costs: StepCosts | None = None) -> None:
        """A speculative step committed ``committed`` tokens in ``seconds`` (None: the engine
        records the batch's seconds in the shared costs). ``probe``: whether the step was taken as
        a probe (default: what the last :meth:`decide` said; an engine that decides the next step
        before recording this one passes it). ``costs``: the shape's shared costs in an engine,
        which judge whether a probe paid (a controller's own are empty there)."""
        if probe is not None:
            self._probing = probe
        self._tick()
        self.committed.add(committed)
        if source is not None:
            mean = self.by_source.get(source)
            if mean is None:
                mean = self.by_source[source] = DecayedMean(self.config.decay)
            mean.add(committed)
        if seconds is not None:
            self.costs.spec.add(seconds)
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
            self._probing = False

    def _tick(self) -> None:
        """One more step (of either kind): older acceptance evidence weighs less."""
        self.committed.tick()
        for mean in self.by_source.values():
            mean.tick()

    def record_plain(self, seconds: float | None = None) -> None:
        """A plain step (one token) took ``seconds`` (None: recorded by the engine)."""
        self._tick()
        if seconds is not None:
            self.costs.plain.add(seconds)
        self.plain_steps += 1
        self.since_spec += 1
        self.since_plain = 0
        self._probing = False


def decide_batch(controllers: list[AdaptiveController], costs: StepCosts) -> tuple[str, list[bool]]:
    """One kind of step for a batch, and which requests take it as a probe.

    Each request's controller decides against the batch shape's ``costs``. If they agree, that
    is the step. If they differ, the requests' expected tokens decide together: a speculative
    step of the batch commits the sum of their expectations (an unknown one counts as paying
    for itself) where a plain step commits one token each, so the batch speculates iff
    ``sum(E_i) / spec_cost >= n / plain_cost``; a request's due probe or warm-up is served when
    that holds and deferred otherwise.
    """
    kinds = [c.decide(costs) for c in controllers]
    if all(k == kinds[0] for k in kinds):
        kind = kinds[0]
    else:
        spec, plain = costs.spec.value, costs.plain.value
        if spec is None or plain is None:
            kind = SPECULATE if plain is not None else PLAIN
        else:
            expected = 0.0
            for c in controllers:
                e = c.expected()
                expected += e if e is not None else spec / plain
            kind = SPECULATE if expected * plain >= len(controllers) * spec else PLAIN
    probes = [kind == SPECULATE and c.probing for c in controllers]
    return kind, probes
