"""GPU check of adaptive speculation (a host with SGLang; dummy 8B-shaped weights; no network).

Per engine (plain decoding on SGLang's default backend, then each ``--algorithms`` with
``SGLANG_LONGGEN_ADAPTIVE=1``), after a short warm-up generation (kernels compiled, drafter graphs
captured), ms per generated token, measured as the wall time of an ``N + 1``-token request less a
1-token one (the prefill), radix cache off:

* ``sampled``: temperature 1 at each ``--contexts`` length. Dummy weights' distributions are
  flat, so drafts are almost never accepted: the controller should fall back to plain steps
  (goal: within 1.05x of plain decoding). Two figures: the whole request of ``2N`` tokens
  (``sampled_ms``: the method's per-request set-up included, e.g. TOKENSWIFT's indexing of the
  prompt and its first partial-KV selection, about a second at 98K) and the steady rate, the
  ``2N``-token request less an ``N``-token one, per token (``sampled_steady_ms``: what each token
  of a long generation costs once the request is set up);
* ``greedy``: dummy weights' greedy text loops, the repetitive upper bound for drafting, with the
  controller (``auto``) and with each fixed setting: speculation on every step (``on``) and
  never (``off``: the method's engine decoding by plain steps, which ``auto`` must match where
  drafts do not pay);
  ``--repeats K`` runs each K times, interleaved, each repeat starting with another setting, and
  reports the medians (``*_runs``: each run, in the order of the repeats);
* ``*_decode_ms`` beside each single-request figure: the same request (streamed) timed from its
  first token to its last, per token after the first. The prefill measured on another request
  varies by tens of ms at 98K, a few tenths of a ms per token over 128 tokens, as much as the
  differences these checks look for; this figure leaves it out and keeps the method's set-up in.
  (Streamed, plain decoding sends each token to the client as it is drawn, a run of plain steps
  once per run: a few tens of microseconds per token in favour of runs.)
* ``batch``: ``--batch`` concurrent sampled requests at ``--batch-context``: aggregate tokens/s,
  whole requests and steady (the same two figures).

Each speculative request asks for the adaptive report; the last step's running figures
(speculative/plain steps, steps taken on the method's hint, tau, the shape's measured step costs)
go in the JSON beside the times. ``--timeline``: one more sampled and one more greedy ``2N``-token
request at the first context with the step timing on (``longgen_timing = "host"``): per step, the
token it started at, its kind and its sections (``timeline`` in the JSON), to see where a whole
request's time beyond the steady rate goes; and the batch once more, each request streamed, with
the seconds to its first and last token (``batch.timeline``, every engine: whether the requests
decoded together or in turns). ``--profile DIR``: per engine, SGLang's torch profiler
over ``--profile-steps`` decode steps of one more sampled request at the first context (or
``--profile-context``), folded into per-kernel totals per CUDA-graph launch (:mod:`.kernel_trace`;
``profile`` in the JSON, ``DIR/<engine>.md``), to compare a plain step of each method with plain
decoding kernel by kernel; for a method, also of a greedy request with speculation on (its verify
steps: ``profile_verify``, ``DIR/<engine>-verify.md``). ``--profile-batch``: the batch check's
requests instead (sampled, sent together): where a batch's decode time goes beside plain decoding's
(busy against span: the device's idle time between forwards).

    python -m sgl_longgen.bench.adaptive_check --out adaptive.json --algorithms TOKENSWIFT
    python -m sgl_longgen.bench.adaptive_check --out adaptive.json --algorithms OWL HOWL --skip-plain

``--resume``: the engines already in ``--out`` are not run again, so a run longer than one sitting
(a device call's time limit, say) is the same command repeated until it says that nothing is left
(each engine's figures are written as soon as it is measured).

``--plain-run-ahead on|off|both``: each method's engine with ``SGLANG_LONGGEN_PLAIN_RUN_AHEAD`` set
(:mod:`sgl_longgen.sglang.run_ahead`); ``both`` runs it twice, the second as ``<METHOD>+ahead``.
Every engine also generates ``2N`` tokens at the first context by plain steps only (a method's
with speculation off), greedy and sampled with a seed: ``plain_step_outputs`` in the JSON gives
the first index where its greedy output differs from plain decoding's and, for ``+ahead``, where
its sampled output differs from the same method's without it (None: identical).
``--spec-run-ahead on|off|both`` likewise sets ``SGLANG_LONGGEN_SPEC_RUN_AHEAD``
(:mod:`sgl_longgen.sglang.spec_ahead`: the next speculative step queued before a step returns);
``both`` runs the method's engine without and with it, the second as ``<METHOD>+spec``.

``--sections``: at every context, one more ``2N``-token request of each greedy setting (auto, on,
off, each width) with the step timing on, summarized as the median of each section per kind of
step (``sections``: where a setting's step time goes, e.g. a narrow width's draft against its verify).

``--widths W ...``: the methods' draft directories get ``[adaptive] widths`` (each width's verify
graphs captured at startup), so ``greedy`` (auto) may take them, and each width is also timed
fixed (``greedy_w<W>``: speculation on, ``longgen_width`` W), next to ``greedy_on`` (the whole
draft): the fixed settings adaptive widths must at least match.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from .. import env
from ..sglang.engine import open_engine, stop_engine
from .gpu_check import make_checkpoints, make_owl_drafter
from .kernel_trace import markdown, summarize

# --plain-run-ahead / --spec-run-ahead: the worker setting's values to run (None: its default).
SETTING_VALUES = {"default": [None], "on": [True], "off": [False], "both": [False, True]}
REPORT_KEYS = ("longgen_spec_steps", "longgen_plain_steps", "longgen_hinted_steps", "longgen_tau", "longgen_spec_ms",
               "longgen_plain_ms", "longgen_width_steps", "longgen_ahead_steps")


def engine(model: Path, algorithm: str | None, draft: Path | None, args):
    kw = dict(model_path=str(model), load_format="dummy", skip_tokenizer_init=True, mem_fraction_static=0.8,
              context_length=131072, log_level="warning", random_seed=0, chunked_prefill_size=16384,
              disable_radix_cache=True, max_running_requests=max(4, args.batch),
              cuda_graph_max_bs_decode=max(4, args.batch), cuda_graph_backend_prefill="disabled")
    if algorithm is not None:
        kw.update(speculative_algorithm=algorithm, speculative_num_draft_tokens=args.draft_tokens,
                  disable_overlap_schedule=True)
        if draft is not None:
            kw.update(speculative_draft_model_path=str(draft))
    return open_engine(**kw)


def with_widths(draft: Path, widths: list[int]) -> None:
    """``[adaptive] widths`` added to the draft directory's ``longgen.toml`` (kept as it was otherwise)."""
    toml = draft / "longgen.toml"
    text = toml.read_text() if toml.exists() else ""
    table = f"[adaptive]\nwidths = {list(widths)}\n"
    if table in text:  # a directory shared by two engines of a run
        return
    if "[adaptive]" in text:
        raise ValueError(f"{toml} already has an [adaptive] table")
    toml.write_text(text + ("\n" if text and not text.endswith("\n") else "") + table)


def final_report(meta: dict) -> dict:
    out = {}
    for key in REPORT_KEYS:
        values = [v for v in meta.get(key, []) if v is not None]
        if values:
            out[key[len("longgen_"):]] = values[-1]
    return out


def timeline(meta: dict) -> list[dict]:
    """Per step (its values sit on the first token it committed): the token index and the
    step's ``longgen_*`` values, rounded."""
    series = {k[len("longgen_"):]: v for k, v in meta.items() if k.startswith("longgen_") and isinstance(v, list)}
    n = max((len(v) for v in series.values()), default=0)
    rows = []
    for i in range(n):
        row = {k: v[i] for k, v in series.items() if i < len(v) and v[i] is not None}
        if row:
            rows.append({"token": i, **{k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()}})
    return rows


def timed_steps(eng, prompt: list[int], params: dict, n: int) -> tuple[float, list[dict]]:
    """One ``n``-token request of ``params`` with the step timing on (``longgen_timing = "host"``,
    the request's own custom params kept): its wall seconds and its :func:`timeline`."""
    custom = {**params.get("custom_params", {}), "longgen_report": True, "longgen_timing": "host"}
    t = time.time()
    out = eng.generate(input_ids=prompt, sampling_params={**params, "max_new_tokens": n, "custom_params": custom})
    return time.time() - t, timeline(out["meta_info"])


def section_medians(steps: list[dict], skip: int = 2) -> dict:
    """Per kind of step (``plain``, ``spec``), the median of each ``*_ms`` section and note over
    the steps of a :func:`timeline` after its first ``skip`` (a request's set-up), and the count."""
    out: dict = {}
    for kind in ("plain", "spec"):
        rows = [r for r in steps[skip:] if (r.get("plain_step", 0.0) == 1.0) == (kind == "plain")]
        if not rows:
            continue
        keys = sorted({k for r in rows for k, v in r.items() if k != "token" and isinstance(v, (int, float))})
        out[kind] = {"steps": len(rows), **{k: round(statistics.median(r[k] for r in rows if k in r), 3)
                                            for k in keys if k != "plain_step"}}
    return out


@dataclass
class Timed:
    wall: float  # seconds, the whole request(s), prefill included
    decode_ms: float | None  # ms per token from the first streamed token to the last (one prompt only)
    reports: list[dict]


def timed_generate(eng, prompts: list[list[int]], params: dict, n: int) -> Timed:
    """``prompts`` run together, ``n + 1`` new tokens each: the wall time and their reports. One
    prompt is streamed, so its decoding is also timed on its own, from the first token (the
    prefill's) to the last: the prefill's run-to-run noise (tens of ms at 98K: tenths of a ms per
    token over 128 tokens) stays out of that figure, the method's per-request set-up in it."""
    sampling = {**params, "max_new_tokens": n + 1}
    t = time.time()
    if len(prompts) == 1:
        first = first_tokens = None
        for chunk in eng.generate(input_ids=prompts[0], sampling_params=sampling, stream=True):
            if first is None:
                first, first_tokens = time.time(), chunk["meta_info"]["completion_tokens"]
            last = chunk
        end = time.time()
        tokens = last["meta_info"]["completion_tokens"] - first_tokens
        return Timed(end - t, (end - first) / tokens * 1e3 if tokens else None, [final_report(last["meta_info"])])
    out = eng.generate(input_ids=prompts, sampling_params=[sampling] * len(prompts))
    wall = time.time() - t
    out = out if isinstance(out, list) else [out]
    return Timed(wall, None, [final_report(o["meta_info"]) for o in out])


def ms_per_token(eng, prompts: list[list[int]], params: dict, n: int, prefill_s: float) -> tuple[float, float | None, list[dict]]:
    """Wall ms per generated token over ``prompts`` run together (``n`` new tokens each, after the
    first), the decode-timed figure of one prompt (:func:`timed_generate`) and the reports."""
    run = timed_generate(eng, prompts, params, n)
    return (run.wall - prefill_s) / n * 1e3, run.decode_ms, run.reports


def steady_ms_per_token(eng, prompts: list[list[int]], params: dict, n: int,
                        prefill_s: float) -> tuple[float, float, float | None, list[dict]]:
    """Whole-request ms per token of a ``2n``-token run, the steady ms per token (that run less an
    ``n``-token one, per token: prefill and per-request set-up cancel out), the ``2n``-token run's
    decode-timed figure (one prompt) and its reports."""
    short = timed_generate(eng, prompts, params, n)
    long = timed_generate(eng, prompts, params, 2 * n)
    return (long.wall - prefill_s) / (2 * n) * 1e3, (long.wall - short.wall) / n * 1e3, long.decode_ms, long.reports


def batch_timeline(eng, prompts: list[list[int]], params: dict, n: int) -> list[dict]:
    """``prompts`` submitted together, each streamed on its own: per request, the seconds from the
    submission to its first and its last token, its tokens and the chunks they came in. Shows
    whether the requests decoded together (the same span) or in turns (staggered spans, a tail
    decoded at a smaller batch)."""
    import asyncio

    async def one(prompt: list[int], t0: float) -> dict:
        first = last = None
        chunks = tokens = 0
        stream = await eng.async_generate(input_ids=prompt, sampling_params={**params, "max_new_tokens": n + 1},
                                          stream=True)
        async for chunk in stream:
            last = time.time() - t0
            first = last if first is None else first
            chunks += 1
            tokens = chunk["meta_info"]["completion_tokens"]
        return {"first_s": round(first, 4), "last_s": round(last, 4), "tokens": tokens, "chunks": chunks}

    async def all_of() -> list[dict]:
        t0 = time.time()
        return list(await asyncio.gather(*(one(p, t0) for p in prompts)))

    return eng.loop.run_until_complete(all_of())


def warm_up(eng, params: list[dict]) -> None:
    """A short generation per kind of request: first-use compilation and graph capture (the
    drafters' too) stay out of the measured requests."""
    prompt = list(range(1000, 1512))
    for p in params:
        eng.generate(input_ids=prompt, sampling_params={**p, "max_new_tokens": 64})


def plain_step_outputs(eng, spec: bool, prompt: list[int], n: int) -> dict[str, list[int]]:
    """Outputs of plain steps only (a method's with speculation off): greedy, which every engine
    must agree on, and sampled with a seed, which a method's engines must agree on whatever their
    settings (the draws of plain steps do not depend on how the worker queues them)."""
    off = {"custom_params": {"longgen_speculation": "off"}} if spec else {}
    out = {}
    for kind, params in (("greedy", {"temperature": 0.0}), ("sampled", {"temperature": 1.0, "sampling_seed": 1234})):
        got = eng.generate(input_ids=prompt, sampling_params={**params, **off, "ignore_eos": True, "max_new_tokens": n})
        out[kind] = got["output_ids"]
    return out


def compare_outputs(outputs: dict[str, dict[str, list[int]]]) -> dict:
    """Each engine's plain-step outputs against the reference: greedy against plain decoding's,
    sampled against the same method's engine without ``+ahead``; the first differing index or None."""
    def first_difference(a: list[int], b: list[int]) -> int | None:
        return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None if len(a) == len(b) else min(len(a), len(b)))

    result = {}
    for name, got in outputs.items():
        row = {}
        if "plain" in outputs and name != "plain":
            row["greedy_vs_plain"] = first_difference(got["greedy"], outputs["plain"]["greedy"])
        base = name.removesuffix("+ahead")
        if base != name and base in outputs:
            row["sampled_vs_" + base] = first_difference(got["sampled"], outputs[base]["sampled"])
        if row:
            result[name] = row
    return result


def rotated(names: list[str], r: int) -> list[str]:
    """``names`` starting at the ``r``-th (cyclically)."""
    r %= max(1, len(names))
    return names[r:] + names[:r]


def engine_runs(args, report: dict) -> list[tuple[str, str | None, bool | None, bool | None]]:
    """The engines to run, in order: (name in the report, algorithm (None: plain decoding), plain
    run-ahead, spec run-ahead settings (None: the worker's default)); with ``--resume`` those
    already in ``report`` left out."""
    aheads, specs = SETTING_VALUES[args.plain_run_ahead], SETTING_VALUES[args.spec_run_ahead]
    runs = ([] if args.skip_plain else [(None, None, None)]) + [
        (a, ahead, spec) for a in args.algorithms for ahead in aheads for spec in specs]
    named = [((algorithm or "plain") + ("+ahead" if ahead and args.plain_run_ahead == "both" else "")
              + ("+spec" if spec and args.spec_run_ahead == "both" else ""), algorithm, ahead, spec)
             for algorithm, ahead, spec in runs]
    return [run for run in named if not (args.resume and run[0] in report)]


def measure(eng, spec: bool, args, prompts: dict[int, list[int]], batch_prompts: list[list[int]]) -> dict:
    custom = {"custom_params": {"longgen_report": True}} if spec else {}
    sampled = {"temperature": 1.0, "ignore_eos": True, **custom}
    greedy = {"temperature": 0.0, "ignore_eos": True, **custom}
    result: dict = {}
    warm_up(eng, [sampled, greedy])
    for L, prompt in prompts.items():
        eng.generate(input_ids=prompt, sampling_params={"max_new_tokens": 1})  # warm-up
        # Kernels first used at this context (a method's draft over a context longer than its
        # partial-KV budget, say) compile here, not in a timed request. Speculation forced on:
        # such a request has no controller, so it leaves the workload's priors as they were.
        forced = {"custom_params": {"longgen_speculation": "on"}} if spec else {}
        eng.generate(input_ids=prompt, sampling_params={"temperature": 0.0, "max_new_tokens": 16, **forced})
        t = time.time()
        eng.generate(input_ids=prompt, sampling_params={"max_new_tokens": 1})
        prefill = time.time() - t
        row: dict = {"prefill_s": round(prefill, 3)}
        row["sampled_ms"], row["sampled_steady_ms"], row["sampled_decode_ms"], rep = steady_ms_per_token(
            eng, [prompt], sampled, args.tokens, prefill)
        row["sampled_report"] = rep[0]
        kinds = {"greedy": greedy}
        if spec:
            kinds["greedy_on"] = {**greedy, "custom_params": {"longgen_report": True, "longgen_speculation": "on"}}
            kinds["greedy_off"] = {**greedy, "custom_params": {"longgen_report": True, "longgen_speculation": "off"}}
            for w in args.widths:
                kinds[f"greedy_w{w}"] = {**greedy, "custom_params": {"longgen_report": True, "longgen_speculation": "on",
                                                                     "longgen_width": w}}
        runs: dict[str, list] = {name: [] for name in kinds}
        for r in range(args.repeats):
            # The kinds interleaved (a drift of the host's speed hits all alike) and rotated: each
            # repeat starts with another, so whatever the first request after the set-up pays
            # (a workload's first probes, say) is not one setting's alone.
            for name in rotated(list(kinds), r):
                runs[name].append(ms_per_token(eng, [prompt], kinds[name], args.tokens, prefill))
        for name, got in runs.items():
            row[f"{name}_ms"] = statistics.median(r[0] for r in got)
            row[f"{name}_decode_ms"] = statistics.median(r[1] for r in got)
            row[f"{name}_report"] = got[-1][2][0]
            if args.repeats > 1:
                row[f"{name}_runs"] = [[round(r[0], 3), round(r[1], 3)] for r in got]
        if spec and args.timeline and L == args.contexts[0]:
            row["timeline"] = {}
            for name, params in (("sampled", sampled), ("greedy", greedy)):
                wall, steps = timed_steps(eng, prompt, params, 2 * args.tokens + 1)
                row["timeline"][name] = {"wall_s": round(wall, 4), "steps": steps}
        if spec and args.sections:
            row["sections"] = {}
            for name, params in kinds.items():
                row["sections"][name] = section_medians(timed_steps(eng, prompt, params, 2 * args.tokens + 1)[1])
                print(f"  {L} {name} sections: {row['sections'][name]}", flush=True)
        print(f"  {L}: " + ", ".join(f"{k} {v:.2f}" for k, v in row.items() if k.endswith("_ms")), flush=True)
        result[str(L)] = row
    if args.batch:
        t = time.time()
        eng.generate(input_ids=batch_prompts, sampling_params=[{"max_new_tokens": 1}] * len(batch_prompts))
        prefill = time.time() - t
        ms, steady, _, reps = steady_ms_per_token(eng, batch_prompts, sampled, args.tokens, prefill)
        result["batch"] = {"context": args.batch_context, "requests": len(batch_prompts), "prefill_s": round(prefill, 3),
                           "tokens_per_s": round(len(batch_prompts) * 1e3 / ms, 1),
                           "steady_tokens_per_s": round(len(batch_prompts) * 1e3 / steady, 1), "reports": reps}
        print(f"  {len(batch_prompts)} x {args.batch_context}: {result['batch']['tokens_per_s']} tokens/s "
              f"(steady {result['batch']['steady_tokens_per_s']})", flush=True)
        if args.timeline:
            spans = batch_timeline(eng, batch_prompts, sampled, 2 * args.tokens)
            result["batch"]["timeline"] = spans
            print("  batch spans (first-last token s): " + ", ".join(f"{r['first_s']:.2f}-{r['last_s']:.2f}"
                                                                     for r in spans), flush=True)
    return result


def profile(eng, name: str, prompts: list[list[int]], args, params: dict | None = None) -> list[dict]:
    """Per-kernel totals of ``--profile-steps`` decode steps of ``prompts``' requests, sent
    together (see :mod:`.kernel_trace`; SGLang writes the prefill's trace too, summarized beside):
    sampled ones by default (a speculative engine's plain steps where drafts do not pay), or ``params``."""
    out_dir = args.profile / name
    out_dir.mkdir(parents=True, exist_ok=True)
    eng.start_profile(output_dir=str(out_dir), num_steps=args.profile_steps, activities=["CPU", "GPU"],
                      profile_by_stage=True, profile_prefix=name, with_stack=False, record_shapes=False)
    params = params or {"temperature": 1.0, "ignore_eos": True}
    eng.generate(input_ids=prompts, sampling_params=[{**params, "max_new_tokens": 2 * args.tokens + 1}] * len(prompts))
    try:
        eng.stop_profile()
    except Exception:  # noqa: BLE001 - stopped by itself after num_steps
        pass
    summaries = [summarize(path) for path in sorted(out_dir.glob("*.trace.json*"))]
    (args.profile / f"{name}.md").write_text("".join(markdown(s) + "\n" for s in summaries))
    for s in summaries:
        s["kernels"], s["runtime_calls"] = s["kernels"][:40], s["runtime_calls"][:12]
    return summaries


# A speculative engine's verify steps: greedy with speculation forced on every step.
VERIFY_PARAMS = {"temperature": 0.0, "ignore_eos": True, "custom_params": {"longgen_speculation": "on"}}


def plain_greedy(spec: bool) -> dict:
    """``--profile-greedy``'s request: greedy plain steps (a method's with speculation off)."""
    off = {"custom_params": {"longgen_speculation": "off"}} if spec else {}
    return {"temperature": 0.0, "ignore_eos": True, **off}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=Path("adaptive_check.json"))
    p.add_argument("--algorithms", nargs="*", default=["TOKENSWIFT", "OWL", "HOWL"],
                   choices=("TOKENSWIFT", "OWL", "HOWL"))
    p.add_argument("--skip-plain", action="store_true", help="keep the plain engine's figures already in --out")
    p.add_argument("--resume", action="store_true", help="skip the engines already in --out")
    p.add_argument("--contexts", type=int, nargs="+", default=[4096, 98304])
    p.add_argument("--tokens", type=int, default=256, help="timed tokens per request")
    p.add_argument("--batch", type=int, default=4, help="concurrent requests of the batch check (0: none)")
    p.add_argument("--batch-context", type=int, default=32768)
    p.add_argument("--draft-tokens", type=int, default=64)
    p.add_argument("--budget", type=int, default=4096)
    p.add_argument("--owl-width", type=int, default=1024)
    p.add_argument("--owl-draft-vocab", type=int, default=32768)
    p.add_argument("--repeats", type=int, default=1,
                   help="greedy requests (auto and on) per context, interleaved; the figures are their medians "
                        "(a 98K request's set-up varies by tens of ms run to run: tenths of a ms per token)")
    p.add_argument("--widths", type=int, nargs="*", default=[],
                   help="[adaptive] widths of the methods' draft directories, each also timed fixed (greedy_w<W>)")
    p.add_argument("--plain-run-ahead", choices=("default", "on", "off", "both"), default="default",
                   help="queue a plain run's next forward before the call returns (default: the worker's default)")
    p.add_argument("--spec-run-ahead", choices=("default", "on", "off", "both"), default="default",
                   help="queue the next speculative step's draft and verify before a step returns (default: the "
                        "worker's default)")
    p.add_argument("--timeline", action="store_true", help="per-step timing of a sampled and a greedy request")
    p.add_argument("--sections", action="store_true",
                   help="at each context, one more request of each greedy setting with the step timing on: the "
                        "median of each section per kind of step (``sections`` in the JSON)")
    p.add_argument("--profile", type=Path, help="profile each engine's decode steps into this directory")
    p.add_argument("--profile-greedy", action="store_true",
                   help="profile greedy plain steps (speculation off) instead of sampled ones and verify steps")
    p.add_argument("--profile-steps", type=int, default=48, help="decode steps (scheduler steps) profiled")
    p.add_argument("--profile-batch", action="store_true",
                   help="profile the batch check's sampled requests (--batch at --batch-context) instead")
    p.add_argument("--profile-context", type=int, default=None,
                   help="the --contexts length whose prompt the profiled requests take (default: the first)")
    args = p.parse_args(argv)
    if args.repeats < 1:
        p.error(f"--repeats must be 1 or more, got {args.repeats}")
    if args.profile_batch and not args.batch:
        p.error("--profile-batch needs --batch")
    if args.profile_context is not None and args.profile_context not in args.contexts:
        p.error(f"--profile-context {args.profile_context} is not one of --contexts {args.contexts}")

    report = json.loads(args.out.read_text()) if args.out.exists() else {}
    root = Path(tempfile.mkdtemp(prefix="longgen_adaptive_"))
    model, heads = make_checkpoints(root, args.budget)
    rng = random.Random(0)
    vocab = 128256
    prompts = {L: [rng.randrange(1000, vocab - 1000) for _ in range(L)] for L in args.contexts}
    batch_prompts = [[rng.randrange(1000, vocab - 1000) for _ in range(args.batch_context)] for _ in range(args.batch)]
    outputs: dict[str, dict[str, list[int]]] = {}  # plain-step outputs per engine (compare_outputs)
    runs = engine_runs(args, report)
    if not runs:
        print(f"every engine asked for is in {args.out} already", flush=True)

    def save() -> None:
        args.out.write_text(json.dumps(report, indent=1))

    for name, algorithm, ahead, spec in runs:
        draft = None
        if algorithm == "TOKENSWIFT":
            draft = heads
        elif algorithm in ("OWL", "HOWL"):
            draft = make_owl_drafter(root, args.owl_width, args.owl_draft_vocab)
        if draft is not None and args.widths:
            with_widths(draft, args.widths)
        print(f"{name}:", flush=True)
        settings = {"ADAPTIVE": True if algorithm is not None else None, "PLAIN_RUN_AHEAD": ahead,
                    "SPEC_RUN_AHEAD": spec}  # the worker reads them at startup
        for key, value in settings.items():
            if value is not None:
                os.environ[env.name(key)] = str(int(value))
        t = time.time()
        try:
            eng = engine(model, algorithm, draft, args)
        finally:
            for key in settings:
                os.environ.pop(env.name(key), None)
        start = round(time.time() - t, 1)
        try:
            report[name] = {"engine_start_s": start, **measure(eng, algorithm is not None, args, prompts, batch_prompts)}
            outputs[name] = plain_step_outputs(eng, algorithm is not None, prompts[args.contexts[0]], 2 * args.tokens)
            report["plain_step_outputs"] = compare_outputs(outputs)
            # Written before the engine stops (and again after each profile): a process that dies in
            # the profiler or at the engine's shutdown keeps what was measured.
            save()
            if args.profile is not None:
                at = batch_prompts if args.profile_batch else [prompts[args.profile_context or args.contexts[0]]]
                try:
                    report[name]["profile"] = profile(eng, name, at, args,
                                                      plain_greedy(algorithm is not None) if args.profile_greedy else None)
                    save()
                    if algorithm is not None and not args.profile_greedy and not args.profile_batch:
                        report[name]["profile_verify"] = profile(eng, f"{name}-verify", at, args, VERIFY_PARAMS)
                except Exception as exc:  # noqa: BLE001 - the measurements above stand without it
                    report[name]["profile_error"] = f"{type(exc).__name__}: {exc}"
        finally:
            stop_engine(eng)
        save()
    print(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
