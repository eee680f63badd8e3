"""Adaptive speculation: per request, take a speculative step only while it pays.

A speculative step (draft forward plus the verify forward of a whole tree) costs more than a plain
decode step. When drafts are accepted it commits several tokens and wins; when they stop being
accepted (random heads, a high temperature, text unlike anything seen) it commits about one token
at several times the price, and speculative decoding runs slower than plain decoding. The
:class:`AdaptiveController` compares the two kinds of step by expected tokens per second::

    speculate  iff  E[tokens committed per speculative step] / spec_cost  >=  1 / plain_cost

with both costs measured by the runtime (wall seconds of each kind of step, exponentially
averaged) and the expectation an exponentially decayed mean of what past speculative steps
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

Engine-agnostic and deterministic: no clock is read here. The runtime passes the seconds it
measured, so tests drive it with synthetic costs and acceptances.
"""

from __future__ import annotations

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


class Ema:
    """Exponential moving average of samples (the first sample initialises it)."""

    __slots__ = ("decay", "value")

    def __init__(self, decay: float):
        self.decay = decay
        self.value: float | None = None

    def add(self, x: float) -> None:
        self.value = x if self.value is None else self.decay * self.value + (1.0 - self.decay) * x


class AdaptiveController:
    """One request's choice between a speculative and a plain step.

    Per step: :meth:`decide`, then the runtime takes that step, measures its wall time and
    reports it with :meth:`record_spec` (tokens it committed, seconds, optionally the draft's
    source: per-source means are kept in :attr:`by_source` for diagnostics) or :meth:`record_plain`.
    """

    def __init__(self, config: AdaptiveConfig):
        self.config = config
        self.committed = DecayedMean(config.decay)  # tokens per speculative step (the bonus included)
        self.by_source: dict[str, DecayedMean] = {}
        self.spec_cost = Ema(config.decay)
        self.plain_cost = Ema(config.decay)
        self.spec_steps = 0
        self.plain_steps = 0
        self.probes = 0
        self.interval = config.probe_every  # speculative steps' worth of plain time before the next probe
        self.since_spec = 0  # plain steps since the last speculative step
        self.since_plain = 0  # speculative steps since the last plain step
        self._probing = False

    # -- the decision --------------------------------------------------------------------------

    def worth(self) -> bool:
        """Speculating is expected to give at least as many tokens per second as plain steps
        (True while either side has no data: optimistic)."""
        mean, spec, plain = self.committed.value, self.spec_cost.value, self.plain_cost.value
        if mean is None or spec is None or plain is None:
            return True
        return mean * plain >= spec  # mean / spec >= 1 / plain, without dividing by a zero cost

    def decide(self) -> str:
        """``"speculate"`` or ``"plain"`` for the next step (call once per step)."""
        cfg = self.config
        self._probing = False
        if self.spec_steps < cfg.warmup:
            return SPECULATE
        if self.plain_cost.value is None:
            return PLAIN  # measure what a plain step costs
        if self.worth():
            if cfg.refresh_every and self.since_plain >= cfg.refresh_every:
                return PLAIN  # keep the plain cost current while speculating
            return SPECULATE
        if self.since_spec * self.plain_cost.value >= self.interval * self.spec_cost.value:
            self._probing = True
            return SPECULATE
        return PLAIN

    # -- what the step did ---------------------------------------------------------------------

    def record_spec(self, committed: int, seconds: float, source: str | None = None) -> None:
        """A speculative step committed ``committed`` tokens in ``seconds``."""
        self._tick()
        self.committed.add(committed)
        if source is not None:
            mean = self.by_source.get(source)
            if mean is None:
                mean = self.by_source[source] = DecayedMean(self.config.decay)
            mean.add(committed)
        self.spec_cost.add(seconds)
        self.spec_steps += 1
        self.since_spec = 0
        self.since_plain += 1
        if self._probing:
            self.probes += 1
            cfg = self.config
            if self.worth():  # the probe paid: speculate again, probe eagerly next time
                self.interval = cfg.probe_every
            else:
                self.interval = min(cfg.probe_max, max(self.interval, round(self.interval * cfg.probe_growth)))
            self._probing = False

    def _tick(self) -> None:
        """One more step (of either kind): older acceptance evidence weighs less."""
        self.committed.tick()
        for mean in self.by_source.values():
            mean.tick()

    def record_plain(self, seconds: float) -> None:
        """A plain step (one token) took ``seconds``."""
        self._tick()
        self.plain_cost.add(seconds)
        self.plain_steps += 1
        self.since_spec += 1
        self.since_plain = 0
        self._probing = False
