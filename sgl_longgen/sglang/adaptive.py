"""Adaptive speculation in the SGLang worker: each decode step is speculative or plain, per batch.

The rule is the reference runtime's (:mod:`sgl_longgen.core.adaptive`, why it is lossless there);
what differs in a serving engine:

* **Costs are the batch's.** Every request of a step pays the same wall time, so the seconds
  are kept per (batch size, context length) bucket (:class:`~sgl_longgen.core.adaptive.CostTable`)
  and measured as the step's whole cycle: from one decode call to the next, so the scheduler's
  own time between steps counts for both kinds alike. A prefill in between drops the sample, and
  so does a speculative step in which a request takes one of its first ``SETTLE`` (its first
  drafts set up its method: TOKENSWIFT scores the whole context to select its partial KV, a cost
  paid once per request and selection, not the price of a step). The
  cycle of a step in which a request drafts for the first time is kept apart instead
  (``StepCosts.first``): the price of a new request's first probe.
* **One kind per step.** :func:`~sgl_longgen.core.adaptive.decide_batch` combines the requests'
  controllers, each with its method's hint (the drafter's ``hint``: HOWL's suffix chain score,
  TOKENSWIFT's continuation score, from the committed tokens alone).
* **Decided a step ahead.** Drafters queue the next draft behind this step's commit; if the next
  step is plain that draft would be wasted, so the next step's kind is decided before the queueing
  (from the steps before this one: lossless all the same, the choice never sees a token it
  governs) and kept if the batch is unchanged at the next step. Except after a request's warm-up:
  the step after it is decided when it begins, from what the warm-up committed.
* **Requests start from the workload.** A new request's controller is seeded from what the
  engine's earlier requests of its kind (greedy, or sampled) learned
  (:class:`~sgl_longgen.core.adaptive.WorkloadPrior`), instead of warming up blind: on a workload
  whose drafts do not pay, its first steps are plain ones.
* **One width per step.** With ``[adaptive] widths`` (trie nodes, the root included) a
  speculative step may draft a narrower trie (its method's ``max_nodes``) and verify fewer rows,
  each such width through CUDA graphs of its own (:mod:`.width_graphs`). The batch takes the width
  :func:`~sgl_longgen.core.adaptive.batch_width` finds fastest from the requests' per-width
  acceptance (each step's accepted node positions tell what every narrower cut would have
  committed) and the shape's cost at that width. Lossless as the kind is: only past steps decide,
  and any cut of a trie is a trie.
* **A plain step** is a verify of the root alone (a width-1 TARGET_VERIFY: on a GPU its own CUDA
  graph, see :mod:`.width_graphs`), the draws and commit of every other step, no draft forward;
  the worker may queue a run of them in one call (one token each), priced per token.

Per request, ``custom_params`` (parsed at admission, :mod:`.request_settings`):

* ``longgen_speculation``: ``"auto"`` (the controller decides), ``"on"`` (always speculate, as
  without adaptive speculation), ``"off"`` (never: one exact token per step). The server's
  default is ``"auto"`` when the draft directory's ``[adaptive] enabled`` is true or
  ``SGLANG_LONGGEN_ADAPTIVE=1``, else ``"on"``.
* ``longgen_width``: a fixed draft width (trie nodes, the root included) for the request's
  speculative steps; best one of the server's ``[adaptive] widths``, whose verify graphs are
  captured (another width verifies without a graph). A batch takes its widest request's width.
* ``longgen_report``: true to get, on the first token of each step in ``meta_info``, the request's
  running ``longgen_spec_steps``, ``longgen_plain_steps``, ``longgen_hinted_steps`` (speculative
  steps taken on the method's hint alone), ``longgen_tau`` (tokens per speculative step),
  ``longgen_expected_tokens`` (the controller's estimate), the shape's measured
  ``longgen_spec_ms`` / ``longgen_plain_ms``, where widths vary ``longgen_width_steps``
  (speculative steps per width, ``"full"`` for the whole draft), and where the call before queued
  a step's draft and verify ``longgen_ahead_steps`` (how many, :mod:`.spec_ahead`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import msgspec

from .. import env
from ..config import AdaptiveConfig
from ..core.adaptive import (
    PLAIN,
    SPECULATE,
    AdaptiveController,
    CostTable,
    StepCosts,
    WorkloadPrior,
    batch_width,
    decide_batch,
)
from .request_settings import AUTO, OFF, ON

SPECULATION_OFF = "speculation off (longgen_speculation)"
# A cycle this many times the shape's known cost is not a step's price (the server idled).
OUTLIER = 20.0
SETTLE = 2  # a request's first speculative steps set its method up: they do not price a step


def server_config(defaults: AdaptiveConfig) -> AdaptiveConfig:
    """The draft directory's ``[adaptive]``, with ``SGLANG_LONGGEN_ADAPTIVE`` (0/1) overriding ``enabled``."""
    value = env.get("ADAPTIVE")
    if value is None:
        return defaults
    if value not in ("0", "1"):
        raise ValueError(f"{env.name('ADAPTIVE')} must be 0 or 1, got {value!r}")
    return msgspec.structs.replace(defaults, enabled=value == "1")


def widest(widths) -> int | None:
    """The width that covers all of ``widths`` (None, the full draft, covers every width)."""
    widths = list(widths)
    return None if not widths or None in widths else max(widths)


@dataclass
class RequestAdaptive:
    """One request's adaptive state (kept in its :class:`~.requests.RequestState`)."""

    mode: str
    controller: AdaptiveController | None
    report: bool
    width: int | None = None  # longgen_width: a fixed draft width (None: the controller's, or the full draft)
    spec_steps: int = 0
    plain_steps: int = 0
    spec_tokens: int = 0
    hinted_steps: int = 0
    width_steps: dict[str, int] = field(default_factory=dict)  # speculative steps per width ("full")
    ahead_steps: int = 0  # speculative steps the call before queued (.spec_ahead)


@dataclass
class _Step:
    kind: str
    probes: dict[str, bool] = field(default_factory=dict)
    hints: dict[str, tuple[float | None, bool]] = field(default_factory=dict)  # rid: (hint, taken on it)
    costs: StepCosts | None = None
    started: float = 0.0
    priced: bool = True  # its cycle is a sample of its shape's cost
    first: bool = False  # a request drafted for the first time in it (its cycle prices a first draft)
    tokens: int = 1  # plain steps it ran (a plain run's cycle is priced per step)
    width: int | None = None  # a speculative step's draft width (None: the full draft)


class AdaptiveSteps:
    """The worker's choice of each step's kind, its cost table and the per-request reports."""

    def __init__(self, config: AdaptiveConfig, hint: Callable[[object], float | None] | None = None,
                 cut: Callable[[int], int | None] | None = None):
        self.config = config
        # A wanted width as the drafter drafts it (None: that is its whole draft).
        self.cut = cut or (lambda width: width)
        self.default = AUTO if config.enabled else ON
        self.costs = CostTable(config.decay)
        self.priors = {greedy: WorkloadPrior(config.decay, config.widths) for greedy in (True, False)}
        self.hint = hint  # a step request's method hint (None: the drafter has none)
        self._current: _Step | None = None  # the step in progress, then the last one (its cycle)
        self._planned: tuple[frozenset, str, dict[str, bool], dict, int | None] | None = None

    # -- per request -------------------------------------------------------------------------

    def state(self, step) -> RequestAdaptive:
        rs = step.state
        if rs.adaptive is None:
            settings = step.settings
            mode = settings.speculation or self.default
            prior = self.priors[step.sampling.greedy]
            rs.adaptive = RequestAdaptive(mode, AdaptiveController(self.config, prior=prior) if mode == AUTO else None,
                                          settings.report, settings.width)
        return rs.adaptive

    # -- the step's kind ---------------------------------------------------------------------

    def begin(self, steps) -> str:
        """The kind of the step about to run; records the last step's cycle time."""
        now = time.perf_counter()
        last = self._current
        if last is not None and last.costs is not None and (last.priced or last.first):
            ema = ((last.costs.first if last.first else last.costs.at(last.width)) if last.kind == SPECULATE
                   else last.costs.plain)
            seconds = (now - last.started) / (1 if last.kind == SPECULATE else last.tokens)
            if ema.value is None or seconds <= OUTLIER * ema.value:
                ema.add(seconds)
        states = [self.state(s) for s in steps]
        for s, st in zip(steps, states):
            if st.mode == OFF and s.blocker is None:
                s.blocker = SPECULATION_OFF
        planned, self._planned = self._planned, None
        rids = frozenset(s.rid for s in steps)
        costs = self._costs(steps, 0)
        if planned is not None and planned[0] == rids:
            kind, probes, hints, width = planned[1:]
        else:
            kind, probes, hints, width = self._decide(steps, states, costs)
        self._current = _Step(kind, probes, hints, costs, now, width=None if width is None else self.cut(width))
        return kind

    @property
    def width(self) -> int | None:
        """The draft width of the step in progress (trie nodes; None: the full draft)."""
        cur = self._current
        return cur.width if cur is not None and cur.kind == SPECULATE else None

    def plan(self, steps, width: int) -> str:
        """Decide the next step's kind now (before a drafter queues its draft).

        The controllers have not seen this step's outcome yet. If it is a probe for every request
        that decides, they would still find a probe due and probe twice in a row: the step after
        a probe is plain, and the one after that knows whether the probe paid. If it ends some
        request's warm-up, its outcome is the first evidence that request has: nothing is planned
        (PLAIN here: no draft queued) and the next step is decided when it begins, from it, instead
        of speculating a second time blind (a draft forward and a wide verify for about one token
        where drafts do not pay; where they do, one draft is queued a little later).
        """
        states = [self.state(s) for s in steps]
        cur = self._current
        if cur is not None and cur.kind == SPECULATE and any(
                st.controller is not None and s.blocker is None and st.controller.spec_steps + 1 == st.controller.warmup
                for s, st in zip(steps, states)):
            self._planned = None
            return PLAIN
        kind, probes, hints, drafted = self._decide(steps, states, self._costs(steps, width))
        if kind == SPECULATE and cur is not None and cur.kind == SPECULATE and cur.probes:
            deciding = [s.rid for s, st in zip(steps, states) if st.mode == AUTO and s.blocker is None]
            if deciding and all(cur.probes.get(rid, False) for rid in deciding) and all(
                    st.mode != ON for st in states):
                kind, probes, hints, drafted = PLAIN, {}, {}, None
        self._planned = (frozenset(s.rid for s in steps), kind, probes, hints, drafted)
        return kind

    def planned_width(self) -> int | None:
        """The draft width of the step :meth:`plan` planned (trie nodes; None: the full draft or
        nothing planned): what :attr:`width` will be once that step begins as planned."""
        planned = self._planned
        width = planned[4] if planned is not None else None
        return None if width is None else self.cut(width)

    def probing(self) -> bool:
        """The step in progress is speculative only as a probe of every request that decides."""
        cur = self._current
        return cur is not None and cur.kind == SPECULATE and bool(cur.probes) and all(cur.probes.values())

    def plain_run_limit(self, steps) -> int:
        """Plain steps the current (plain) call may queue before some request's controller wants a
        speculative step: the least :meth:`~sgl_longgen.core.adaptive.AdaptiveController.plain_steps_allowed`
        over the deciding requests (no limit where none decides)."""
        costs = self._current.costs if self._current is not None else None
        limits = [st.controller.plain_steps_allowed(costs) for s, st in zip(steps, map(self.state, steps))
                  if st.controller is not None and s.blocker is None]
        return min(limits, default=1 << 30)

    def broke(self) -> None:
        """Something other than a decode step ran (a prefill): no cycle to time, no plan."""
        self._current = None
        self._planned = None

    def _costs(self, steps, ahead: int) -> StepCosts:
        return self.costs.get(len(steps), max(s.seq_len for s in steps) + ahead)

    def _decide(self, steps, states: list[RequestAdaptive],
                costs: StepCosts) -> tuple[str, dict, dict, int | None]:
        """The step's kind, which requests take it as a probe, each deciding request's (hint,
        whether the step is taken on it), and a speculative step's draft width: the widest the
        batch's requests want (a fixed ``longgen_width``, the full draft for ``on`` without one,
        the deciding requests' :func:`~sgl_longgen.core.adaptive.batch_width`)."""
        modes = [st.mode for st in states]
        if ON in modes and all(st.mode != AUTO for st in states):
            return SPECULATE, {}, {}, widest(st.width for st in states if st.mode == ON)
        if all(m == OFF for m in modes):
            return PLAIN, {}, {}, None
        auto = [(s, st) for s, st in zip(steps, states) if st.mode == AUTO and s.blocker is None]
        hints = [None if self.hint is None
                 else st.controller.hint_if_due(lambda s=s: self.hint(s), time.perf_counter, costs)
                 for s, st in auto]
        if ON in modes:
            kind = SPECULATE
            probes = {}
            for (s, st), h in zip(auto, hints):
                st.controller.decide(costs, h)
                probes[s.rid] = st.controller.probing
            wants = [st.width for st in states if st.mode == ON]
            if auto:
                wants.append(self._auto_width(auto, costs))
            width = widest(wants)
            return kind, probes, {s.rid: (h, False) for (s, _), h in zip(auto, hints)}, width
        if not auto:  # every request blocked or off: nothing to draft
            return PLAIN, {}, {}, None
        kind, flags = decide_batch([st.controller for _, st in auto], costs, hints)
        width = self._auto_width(auto, costs) if kind == SPECULATE else None
        return kind, {s.rid: p for (s, _), p in zip(auto, flags)}, {
            s.rid: (h, kind == SPECULATE and st.controller.hinted) for (s, st), h in zip(auto, hints)}, width

    @staticmethod
    def _auto_width(auto, costs: StepCosts) -> int | None:
        """The deciding requests' width: their controllers' choice, or a fixed one where a request set it."""
        fixed = [st.width for _, st in auto if st.width is not None]
        chosen = [st for _, st in auto if st.width is None]
        if not chosen:
            return widest(fixed)
        return widest([*fixed, batch_width([st.controller for st in chosen], costs)])

    # -- what the step did -------------------------------------------------------------------

    def record(self, steps, counts: list[int], kind: str, nodes: list | None = None, ahead: bool = False) -> list[dict]:
        """Each request's outcome (``counts``: tokens committed; a plain call that ran several
        plain steps committed one per step; ``nodes``: each request's accepted node positions in
        a speculative step's trie, the root first; ``ahead``: the step's draft and verify were
        queued by the call before); returns the report values of the requests that asked."""
        probes = self._current.probes if self._current is not None else {}
        hints = self._current.hints if self._current is not None else {}
        costs = self._current.costs if self._current is not None else None
        width = self.width
        reports = []
        if kind == SPECULATE and self._current is not None:
            self._current.priced = all(self.state(s).spec_steps >= SETTLE or s.blocker is not None for s in steps)
            self._current.first = any(self.state(s).spec_steps == 0 and s.blocker is None for s in steps)
        if kind != SPECULATE and self._current is not None:
            self._current.tokens = max(counts, default=1)
        for i, (s, n) in enumerate(zip(steps, counts)):
            st = self.state(s)
            hint, hinted = hints.get(s.rid, (None, False))
            if kind == SPECULATE:
                st.spec_steps += 1
                st.spec_tokens += n
                st.hinted_steps += hinted
                key = "full" if width is None else str(width)
                st.width_steps[key] = st.width_steps.get(key, 0) + 1
                st.ahead_steps += ahead
            else:
                st.plain_steps += n
            c = st.controller
            if c is not None and s.blocker is None:
                if kind == SPECULATE:
                    c.record_spec(n, probe=probes.get(s.rid, False), costs=costs, hint=hint, hinted=hinted,
                                  width=width, nodes=None if nodes is None else nodes[i])
                else:
                    for _ in range(n):
                        c.record_plain()
            if st.report:
                reports.append(self._report(st, costs))
            else:
                reports.append(None)
        return reports

    @staticmethod
    def _report(st: RequestAdaptive, costs: StepCosts | None) -> dict:
        def ms(ema):
            return None if ema is None or ema.value is None else round(ema.value * 1e3, 3)

        expected = st.controller.expected() if st.controller is not None else None
        extra = {"longgen_width_steps": dict(st.width_steps)} if set(st.width_steps) - {"full"} else {}
        if st.ahead_steps:
            extra["longgen_ahead_steps"] = st.ahead_steps
        return {
            "longgen_spec_steps": st.spec_steps,
            "longgen_plain_steps": st.plain_steps,
            "longgen_hinted_steps": st.hinted_steps,
            "longgen_tau": round(st.spec_tokens / st.spec_steps, 3) if st.spec_steps else None,
            "longgen_expected_tokens": None if expected is None else round(expected, 3),
            "longgen_spec_ms": ms(costs.spec if costs else None),
            "longgen_plain_ms": ms(costs.plain if costs else None),
            **extra,
        }
