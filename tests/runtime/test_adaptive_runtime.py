"""Adaptive speculation in the reference runtime: lossless whatever mix of steps, plain decoding's
speed when drafts never match, speculation where they do.

The mix of the real controller depends on measured wall times; the lossless tests also force
fixed mixes (a scripted controller), so every transition (speculative after plain, plain after
speculative, runs of each) is exercised deterministically. With ``[adaptive] widths`` the mixes
also hold speculative steps over tries cut to a few nodes (every method), greedy and sampled.
"""

from __future__ import annotations

import itertools

import msgspec
import numpy as np
import pytest
import torch
from scipy.stats import chisquare

import sgl_longgen.runtime.decoder as decoder_module
from sgl_longgen.core.adaptive import PLAIN, SPECULATE
from sgl_longgen.runtime import OwlDecoder, TokenSwiftDecoder, build_decoder

from runtime_oracle import PROMPT, ar_output, config, model

torch.set_num_threads(1)

NEW_TOKENS = 200


class Scripted:
    """A controller that follows a fixed pattern (``"S"``: speculate, ``"P"``: plain, a digit:
    speculate with the draft cut to that many nodes), cyclically. ``paths``: (width, accepted
    node positions) of the speculative steps the runtime reported them for."""

    def __init__(self, pattern: str, widths=()):
        self.steps = itertools.cycle(pattern)
        self.widths = list(widths)  # the configured widths, as the real controller keeps them
        self.width: int | None = None
        self.paths: list[tuple[int | None, list[int]]] = []
        self.hinted = False  # a fixed mix takes no step on a hint

    def hint_if_due(self, hint, clock, costs=None):
        return None  # a fixed mix asks for no hint

    def decide(self, hint=None) -> str:
        c = next(self.steps)
        self.width = int(c) if c.isdigit() else None
        return PLAIN if c == "P" else SPECULATE

    def record_spec(self, committed, seconds, source=None, width=None, nodes=None, hint=None) -> None:
        if nodes is not None:
            assert width == self.width and committed == len(nodes)
            self.paths.append((width, list(nodes)))

    def record_plain(self, seconds) -> None:
        pass


@pytest.fixture
def scripted(monkeypatch):
    """``scripted(pattern)``: every generation from now on gets that fixed mix of steps."""
    def use(pattern: str) -> None:
        monkeypatch.setattr(decoder_module, "AdaptiveController", lambda cfg: Scripted(pattern, cfg.widths))
    return use


def adaptive(method: str, **kw):
    return config(method, adaptive__enabled=True, **kw)


def owl_drafter(name: str):
    from test_owl_lossless import fitted_drafter  # the drafter fitted to this prompt's continuations

    return fitted_drafter(name)


MIXES = ["SP", "PPS", "SSSPPP", "PSSPPPPS"]
CASES = [
    # method, model, penalty, window, extra
    ("tokenswift", "tiny-random", 1.0, 1024, {}),
    ("tokenswift", "tiny-random", 1.2, 64, {"tokenswift__partial_kv__budget": 40, "tokenswift__partial_kv__sinks": 4}),
    ("tokenswift", "tiny-qwen2", 1.0, 1024, {"tokenswift__partial_kv__budget": 32, "tokenswift__partial_kv__sinks": 2}),
    ("owl", "tiny-random", 1.0, 1024, {}),
    ("owl", "tiny-random", 1.2, 64, {"owl__prefill_spec": False}),
    ("howl", "tiny-qwen2", 1.0, 1024, {}),
    ("suffix", "tiny-random", 1.2, 64, {}),
]


@pytest.mark.parametrize("method,name,penalty,window,extra", CASES)
def test_greedy_output_is_plain_decoding_whatever_the_mix_of_steps(scripted, method, name, penalty, window, extra):
    cfg = adaptive(method, sampling__penalty=penalty, sampling__penalty_window=window, **extra)
    drafter = owl_drafter(name) if method in ("owl", "howl") else None
    expected = ar_output(name, penalty, window, NEW_TOKENS)
    accepted = 0
    for mix in MIXES:
        scripted(mix)
        result = build_decoder(model(name), cfg, drafter_dir=drafter).generate(PROMPT, NEW_TOKENS)
        assert result.finish_reason == "length" and result.error is None
        assert tuple(result.output_ids) == expected, mix
        s = result.stats
        assert 0 < s.plain_steps < s.steps
        assert s.plain_steps == pytest.approx(s.steps * mix.count("P") / len(mix), abs=len(mix))
        accepted += s.accepted
    assert accepted > 0  # speculative steps after plain ones still get drafts accepted


WIDTH_MIXES = ["2S4", "S8P2", "4P3S8"]
WIDTH_CASES = [CASES[0], CASES[1], CASES[3], CASES[5], CASES[6]]


@pytest.mark.parametrize("method,name,penalty,window,extra", WIDTH_CASES)
def test_greedy_output_is_plain_decoding_at_every_draft_width(monkeypatch, method, name, penalty, window, extra):
    """Steps whose tries are cut to 2 to 8 nodes, mixed with full drafts and plain steps: the
    output is plain decoding's, each step's width is counted, and the accepted paths the runtime
    reports lie inside the cut."""
    cfg = adaptive(method, sampling__penalty=penalty, sampling__penalty_window=window, adaptive__widths=[2, 3, 4, 8],
                   **extra)
    drafter = owl_drafter(name) if method in ("owl", "howl") else None
    expected = ar_output(name, penalty, window, NEW_TOKENS)
    narrow_accepted = 0
    for mix in WIDTH_MIXES:
        ctrl = Scripted(mix, cfg.adaptive.widths)
        monkeypatch.setattr(decoder_module, "AdaptiveController", lambda c, ctrl=ctrl: ctrl)
        result = build_decoder(model(name), cfg, drafter_dir=drafter).generate(PROMPT, NEW_TOKENS)
        assert result.error is None and tuple(result.output_ids) == expected, mix
        s = result.stats
        assert sum(s.width_steps.values()) == s.steps - s.plain_steps
        for c in set(mix) - {"P"}:
            key = "full" if c == "S" else c
            assert s.width_steps[key] == pytest.approx(s.steps * mix.count(c) / len(mix), abs=len(mix)), (mix, c)
        assert result.record()["stats"]["width_steps"] == s.width_steps
        assert len(ctrl.paths) == s.steps - s.plain_steps
        for width, nodes in ctrl.paths:
            assert nodes[0] == 0 and nodes == sorted(nodes) and (width is None or nodes[-1] < width)
            if width is not None:
                narrow_accepted += len(nodes) - 1
    assert narrow_accepted > 0  # the cut tries still got drafts accepted


def test_longspec_beams_cut_to_a_width_stay_lossless(monkeypatch):
    # The drafter fitted to this prompt's continuation.
    from test_longspec_lossless import fitted

    ctrl = Scripted("2S4P8", [2, 4, 8])
    monkeypatch.setattr(decoder_module, "AdaptiveController", lambda c: ctrl)
    cfg = adaptive("longspec", adaptive__widths=[2, 4, 8])
    result = build_decoder(model("tiny-random"), cfg, longspec_dir=fitted("tiny-random")).generate(PROMPT, NEW_TOKENS)
    assert tuple(result.output_ids) == ar_output("tiny-random", 1.0, 1024, NEW_TOKENS)
    assert set(result.stats.width_steps) == {"2", "4", "8", "full"}
    assert all(width is None or nodes[-1] < width for width, nodes in ctrl.paths)
    assert sum(len(nodes) - 1 for width, nodes in ctrl.paths if width is not None) > 0


@pytest.mark.parametrize("method", ["tokenswift", "owl", "howl", "suffix"])
def test_greedy_output_with_the_real_controller_choosing_widths(method):
    name = "tiny-random"
    drafter = owl_drafter(name) if method in ("owl", "howl") else None
    dec = build_decoder(model(name), adaptive(method, adaptive__widths=[2, 4, 8]), drafter_dir=drafter)
    result = dec.generate(PROMPT, NEW_TOKENS)
    assert tuple(result.output_ids) == ar_output(name, 1.0, 1024, NEW_TOKENS)
    s = result.stats
    assert sum(s.width_steps.values()) == s.steps - s.plain_steps
    assert {"2", "4", "8"} <= set(s.width_steps)  # every width measured (each one's first try at least)
    assert {k: v for k, v in dec.controller.width_steps.items()} == {
        (None if k == "full" else int(k)): v for k, v in s.width_steps.items()}
    # Widths at or above the method's largest trie are its full draft: not candidates.
    wide = build_decoder(model(name), adaptive(method, adaptive__widths=[2, 10_000]), drafter_dir=drafter)
    assert wide.generate(PROMPT, 20).error is None and wide.controller.widths == [2]


@pytest.mark.parametrize("method", ["tokenswift", "owl", "howl", "suffix"])
def test_greedy_output_with_the_real_controller(method):
    name = "tiny-random"
    drafter = owl_drafter(name) if method in ("owl", "howl") else None
    result = build_decoder(model(name), adaptive(method), drafter_dir=drafter).generate(PROMPT, NEW_TOKENS)
    assert tuple(result.output_ids) == ar_output(name, 1.0, 1024, NEW_TOKENS)
    assert result.record()["stats"]["plain_steps"] == result.stats.plain_steps


def test_plain_method_and_disabled_setting_take_no_plain_steps():
    lm = model("tiny-random")
    for cfg in (adaptive("ar"), config("tokenswift")):
        dec = build_decoder(lm, cfg)
        result = dec.generate(PROMPT, 50)
        assert dec.controller is None and result.stats.plain_steps == 0


# ------------------------------------------------------------------------------------------------
# speed: drafts that never match cost (almost) nothing


SLOW_TOKENS = 500


@pytest.mark.parametrize("method", ["tokenswift", "owl"])
def test_drafts_that_never_match_run_at_plain_decoding_speed(method):
    """Random heads / a random drafter at temperature 1: nothing is accepted, so the controller
    decodes plainly (probing now and then) and the run costs about what ``--method ar``'s does.

    Costs are modelled (:class:`StepCostClock`: a speculative step at 3 plain ones), so the
    controller's choices, and the bound, hold on a loaded machine too; wall times are a
    benchmark's business, not a test's."""
    lm = model("tiny-random")
    spec = build_decoder(lm, adaptive(method, sampling__temperature=1.0))
    clock = StepCostClock(spec, spec=3.0)
    result = spec.generate(PROMPT, SLOW_TOKENS)
    assert result.num_new_tokens == SLOW_TOKENS
    s = result.stats
    assert s.plain_steps > 0.9 * s.steps, s
    ratio = clock.now / (SLOW_TOKENS - 1)  # plain decoding: one plain step a token after the prefill's
    print(f"\n{method}: modelled cost {clock.now:.0f} against plain decoding's {SLOW_TOKENS - 1} "
          f"(ratio {ratio:.3f}), plain steps {s.plain_steps}/{s.steps}, probes {spec.controller.probes}")
    assert ratio < 1.15, (clock.now, s)


class StepCostClock:
    """A model of step costs as the decoder's clock: a plain step costs 1, a speculative one
    ``spec``, a hint ``hint``. The controller's choices then follow from the drafts alone and
    repeat on any machine (wall times of a tiny model move its choices from run to run)."""

    def __init__(self, dec, spec: float, hint: float = 0.0):
        self.now = 0.0
        dec.step = self.costing(dec.step, spec)
        dec.plain_step = self.costing(dec.plain_step, 1.0)
        dec.hint = self.costing(dec.hint, hint)
        dec.clock = lambda: self.now

    def costing(self, fn, cost: float):
        def run():
            out = fn()
            self.now += cost
            return out
        return run


@pytest.mark.parametrize("method", ["tokenswift", "howl", "suffix"])
def test_a_loop_starting_mid_run_is_taken_up_on_the_methods_hint(method):
    """Greedy ``tiny-random`` text wanders, then loops. Random heads (a drafter fitted elsewhere)
    accept little at first, so the controller goes plain; once the output loops, the method's hint
    (the score of its suffix draft of the history) turns the next step speculative instead of
    waiting for a probe. Same output as plain decoding, far fewer steps than without hints.

    Costs are modelled (:class:`StepCostClock`): a speculative step at 5 plain ones, about what
    both methods' steps cost on this tiny model on a CPU, a hint at a twentieth of a plain step."""
    name, n = "tiny-random", 300
    drafter = owl_drafter(name) if method == "howl" else None
    expected = ar_output(name, 1.0, 1024, n)
    steps = {}
    for hints in (True, False):
        dec = build_decoder(model(name), adaptive(method), drafter_dir=drafter)
        if not hints:
            dec.hint = lambda: None
        StepCostClock(dec, spec=5.0, hint=0.05)
        result = dec.generate(PROMPT, n)
        assert tuple(result.output_ids) == expected
        steps[hints] = result.stats.steps
        if hints:
            assert result.stats.hinted_steps >= 1
    print(f"\n{method}: {steps[True]} steps with hints, {steps[False]} without")
    assert steps[True] < 0.85 * steps[False], steps


def test_repetitive_text_keeps_drafting():
    """Where the output repeats itself, suffix drafts commit dozens of tokens per step: once a
    probe shows it, the controller keeps speculating and speculative steps commit most of the output."""
    lm = model("tiny")
    prompt = lm.tokenizer.encode("import os\n" * 20)  # the proxy answers "\n#" over and over
    expected = build_decoder(lm, config("ar")).generate(prompt, 400).output_ids
    dec = build_decoder(lm, adaptive("tokenswift"))
    result = dec.generate(prompt, 400)
    assert result.output_ids == expected
    s = result.stats
    spec_steps = s.steps - s.plain_steps
    spec_tokens = result.num_new_tokens - 1 - s.plain_steps  # the first token comes from the prefill
    print(f"\nrepetitive: {spec_steps} speculative steps committed {spec_tokens} tokens, {s.plain_steps} plain steps")
    assert spec_tokens > 0.75 * result.num_new_tokens
    assert spec_tokens / spec_steps > 10
    assert dec.controller.worth() and dec.controller.interval == dec.controller.config.probe_every  # still drafting


# ------------------------------------------------------------------------------------------------
# sampled: the plain law whatever the mix


def pair_counts(cls, lm, draft, cfg, runs: int) -> tuple[np.ndarray, int]:
    counts = np.zeros((8, 8))
    accepted = 0
    for seed in range(runs):
        r = cls(lm, msgspec.structs.replace(cfg, seed=seed), draft).generate([1, 2, 3, 1, 2, 3, 1, 2], 3)
        counts[r.output_ids[1], r.output_ids[2]] += 1
        accepted += r.stats.accepted
    return counts, accepted


@pytest.mark.slow
@pytest.mark.parametrize("method", ["tokenswift", "owl"])
def test_sampled_mixes_follow_the_exact_distribution(monkeypatch, method):
    """The micro models of the sampled lossless tests; each run takes one of the four mixes of its
    two steps (the mix fixed before the run, so it cannot depend on the draws)."""
    if method == "tokenswift":
        import test_lossless as base

        cls = TokenSwiftDecoder
        cfg = adaptive("tokenswift", tokenswift__partial_kv__budget=6, tokenswift__partial_kv__sinks=2,
                       tokenswift__ngram__n=3, tokenswift__ngram__exclude_penalty_window=False)
    else:
        import test_owl_lossless as base

        cls = OwlDecoder
        cfg = adaptive("owl", owl__top_k=3, owl__depth=3, owl__tree_size=6)
    lm, draft = base.micro()
    cfg = msgspec.structs.replace(cfg, sampling=base.SAMPLING,
                                  adaptive=msgspec.structs.replace(cfg.adaptive, widths=[2, 3]))
    # Speculative steps over the full draft ("S") and over its first 2 or 3 nodes.
    controllers = []
    mixes = itertools.cycle(["SS", "SP", "PS", "PP", "2S", "S3", "3P", "23"])

    def scripted(c):
        controllers.append(Scripted(next(mixes), c.widths))
        return controllers[-1]

    monkeypatch.setattr(decoder_module, "AdaptiveController", scripted)
    runs = 2000
    counts, accepted = pair_counts(cls, lm, draft, cfg, runs)
    assert accepted > runs // 8  # the speculative steps among the mixes had drafts accepted
    narrow = [len(nodes) - 1 for c in controllers for width, nodes in c.paths if width is not None]
    assert len(narrow) >= runs // 4 and sum(narrow) > 0  # the cut tries were verified and accepted drafts
    expected = base.exact_pair_distribution(lm).ravel() * runs
    keep = expected > 0
    assert counts.ravel()[~keep].sum() == 0
    assert chisquare(counts.ravel()[keep], expected[keep]).pvalue > 1e-3
