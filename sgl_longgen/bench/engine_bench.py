"""``sgl-longgen bench --engine sglang``: every method inside SGLang's ``sgl.Engine``.

Two parts, one engine per method at a time (started, run, stopped with
:func:`sgl_longgen.sglang.engine.stop_engine`, so the process never holds two models):

* acceptance (:func:`run_acceptance`, CPU or GPU): each method on the embedded proxy with its
  shipped drafters over the held-out prompts, greedy and sampled at each contextual penalty. tau is
  what SGLang reports: completion tokens / ``spec_verify_ct`` (tokens per target forward; 1 for
  plain decoding). Greedy outputs are compared token for token with the plain engine's at the same
  penalty: the same engine code, the same kernels, so any difference is the method's. The
  contextual penalty reaches our algorithms as ``custom_params`` and the plain engine (and SGLang's
  NGRAM) through :func:`sgl_longgen.sglang.engine.penalty_processor`, the same rule as a logit
  processor, so every method samples from the same target distribution;
* step costs (:func:`run_step_costs`, GPU only): each method on 8B-class shapes with dummy weights
  and random drafters. A step's cost does not depend on the weights' values, only on the shapes
  and the tree, so it is measured where acceptance means nothing and combined with the proxy's
  tau: *projected* ms/token = measured ms/step / proxy tau.

SGLang's CPU engine needs ``SGLANG_USE_CPU_ENGINE=1`` and, where ``sgl_kernel``'s CUDA-only wheel
cannot load, the package's import stand-in (:mod:`sgl_longgen.sglang.cpu`); :func:`prepare_engine`
puts both in place before the first engine starts. The stand-in implements the ops our algorithms
call, not the ones SGLang's own NGRAM needs, so NGRAM is reported as not run there.
"""

from __future__ import annotations

import argparse
import math
import os
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .. import env
from ..config import SPECULATIVE_ALGORITHMS
from ..errors import LonggenError

# The bench's method names (the reference runtime's, plus SGLang's own NGRAM as the peer) and the
# engine's --speculative-algorithm for each; None: plain decoding.
ALGORITHMS: dict[str, str | None] = {"ar": None, "ngram": "NGRAM", **SPECULATIVE_ALGORITHMS}
BASELINE = "ar"
NGRAM_DRAFT_TOKENS = 16  # gpu_check's NGRAM width
MEASURED = "measured"
PROJECTED = "projected: measured ms/step (dummy weights, the larger of the two decodings' steady figures) / proxy tau"
GREEDY_BOUND = "measured, dummy weights, greedy: repetitive (upper bound)"
SAMPLED_BOUND = "measured, dummy weights, sampled T=1: nothing accepted (lower bound)"
# New tokens the step-cost engines may add to the longest context (its context_length's headroom),
# and the most a timed request takes of it: the rest is room for a verify tree's draft slots.
CONTEXT_HEADROOM = 4096
LONG_REQUEST_CAP = CONTEXT_HEADROOM - 512


# -- the engine and its kwargs ---------------------------------------------------------------------


def cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def prepare_engine() -> bool:
    """Select SGLang's CPU engine on a machine without CUDA (with the ``sgl_kernel`` stand-in where
    the real one cannot load); returns whether engines run on the CPU."""
    if cuda_available():
        return False
    from ..sglang.cpu import install_stand_in

    os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")
    install_stand_in()
    return True


def ngram_unavailable(on_cpu: bool) -> str | None:
    """Why SGLang's NGRAM cannot run here, or None."""
    if not on_cpu:
        return None
    from ..sglang.cpu import STAND_IN, kernels_load

    if str(STAND_IN) in sys.path or not kernels_load():
        return ("SGLang's NGRAM calls sgl_kernel ops (reconstruct_indices_from_tree_mask) that the CPU "
                "engine's sgl_kernel stand-in does not provide")
    return None


def proxy_engine_kwargs(model_dir: Path, on_cpu: bool, context: int, dtype: str | None, seed: int) -> dict[str, Any]:
    """``sgl.Engine`` arguments for the proxy, with no speculative algorithm yet. On the CPU, those
    of the SGLang engine tests (float32, the ``longgen_torch`` backend, no CUDA graphs); the static
    memory share is only a check there (the token budget caps the KV pool), kept well above what
    the weights take so that another process's allocations during the start cannot fail it."""
    kw: dict[str, Any] = {"model_path": str(model_dir), "skip_tokenizer_init": True,
                          "enable_custom_logit_processor": True, "random_seed": seed, "context_length": context,
                          "max_running_requests": 8, "log_level": "error"}
    if on_cpu:
        kw.update(device="cpu", dtype=dtype or "float32", attention_backend="longgen_torch", disable_cuda_graph=True,
                  disable_overlap_schedule=True, mem_fraction_static=0.2, max_total_tokens=max(16384, 2 * context))
    else:
        # Prefill CUDA graphs would capture ~45 token counts per engine (tens of seconds each start)
        # for prompts this short; decode graphs are what the timings need.
        kw.update(mem_fraction_static=0.5, cuda_graph_max_bs_decode=8, cuda_graph_backend_prefill="disabled")
        if dtype is not None:
            kw["dtype"] = dtype
    return kw


def with_method(kw: dict[str, Any], method: str, draft: Path | None) -> dict[str, Any]:
    """The kwargs of ``method``'s engine: its algorithm and draft directory (overlap scheduling off,
    as the plugin sets it for its synchronous workers)."""
    algorithm = ALGORITHMS[method]
    kw = dict(kw)
    if algorithm is None:
        return kw
    kw.update(speculative_algorithm=algorithm, disable_overlap_schedule=True)
    if algorithm == "NGRAM":
        kw["speculative_num_draft_tokens"] = NGRAM_DRAFT_TOKENS
    elif draft is not None:
        kw["speculative_draft_model_path"] = str(draft)
    return kw


def with_engine(kw: dict[str, Any], adaptive: bool, body: Callable[[Any], Any]) -> Any:
    """Start an engine, run ``body(engine)``, stop it (also when ``body`` raises)."""
    from ..sglang.engine import open_engine, stop_engine

    # Read by the engine's scheduler process at start; "0" also for a method whose own default is on (SUFFIX).
    os.environ[env.name("ADAPTIVE")] = "1" if adaptive else "0"
    try:
        engine = open_engine(**kw)
    finally:
        os.environ.pop(env.name("ADAPTIVE"), None)
    try:
        return body(engine)
    finally:
        stop_engine(engine)


def request(engine, prompts: list[list[int]], params: dict, penalty_processor: str | None,
            **kwargs: Any) -> tuple[list[dict], float]:
    """``prompts`` run together; their outputs and the wall seconds."""
    if penalty_processor:
        kwargs["custom_logit_processor"] = [penalty_processor] * len(prompts)
    t = time.perf_counter()
    out = engine.generate(input_ids=prompts, sampling_params=[params] * len(prompts), **kwargs)
    wall = time.perf_counter() - t
    return (out if isinstance(out, list) else [out]), wall


def first_difference(a: list[int], b: list[int]) -> int | None:
    """The first position where two outputs differ (a length mismatch counts); None if equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def top2_gap(meta: dict, position: int) -> float | None:
    """The log-probability gap between the best two tokens at ``position`` of an output requested
    with ``return_logprob=True, top_logprobs_num=2``: how close greedy decoding was to a tie there."""
    tops = meta.get("output_top_logprobs") or []
    if position >= len(tops) or not tops[position] or len(tops[position]) < 2:
        return None
    return float(tops[position][0][0] - tops[position][1][0])


def steps_of(meta: dict) -> int | None:
    """Target forwards of a request's decode steps (``spec_verify_ct``; None without speculation)."""
    value = meta.get("spec_verify_ct")
    return int(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


# -- acceptance ------------------------------------------------------------------------------------


def sampling_params(decoding: str, penalty: float, window: int, max_new_tokens: int, ignore_eos: bool,
                    temperature: float, min_p: float) -> dict:
    params: dict[str, Any] = {"max_new_tokens": max_new_tokens, "ignore_eos": ignore_eos, "no_stop_trim": True,
                              "custom_params": {"penalty": float(penalty), "penalty_window": int(window)}}
    if decoding == "greedy":
        params["temperature"] = 0.0
    else:
        params.update(temperature=float(temperature), min_p=float(min_p))
    return params


def acceptance_row(method: str, decoding: str, penalty: float, outputs: list[tuple[dict, list[int], float]],
                   baseline: dict[str, list[int]] | None, distinct: Callable[[list[int], int], float],
                   distinct_n: tuple[int, ...], gaps: dict[str, list[float | None]] | None = None
                   ) -> tuple[dict, list[dict]]:
    """One (setting, method) row from ``(prompt item, output ids and meta, wall s)`` per prompt,
    and its per-prompt records. tau = completion tokens / verify steps over all prompts.

    A greedy output that differs from plain decoding's records where (``first_difference``) and,
    from ``gaps`` (plain decoding's top-2 log-probability gap per position), how close plain
    decoding was to a tie there (``tie_gap``): on a GPU the verify and decode kernels round
    differently, and in bfloat16 a near-tie can flip either way."""
    tokens = steps = 0
    seconds = 0.0
    accept_rates: list[float] = []
    dist = [0.0] * len(distinct_n)
    identical: bool | None = None
    differences: list[tuple[int, float | None]] = []
    records = []
    for item, out, wall in outputs:
        ids, meta = out["output_ids"], out["meta_info"]
        n = int(meta.get("completion_tokens", len(ids)))
        s = steps_of(meta)
        tokens += n
        steps += s if s else n  # plain decoding: one forward per token
        seconds += wall
        if isinstance(meta.get("spec_accept_rate"), (int, float)):
            accept_rates.append(float(meta["spec_accept_rate"]))
        for i, k in enumerate(distinct_n):
            dist[i] += distinct(ids, k)
        same = diff = gap = None
        if baseline is not None and decoding == "greedy":
            same = ids == baseline.get(item["id"])
            identical = same and identical is not False
            if not same:
                diff = first_difference(ids, baseline.get(item["id"]) or [])
                plain_gaps = (gaps or {}).get(item["id"]) or []
                gap = plain_gaps[diff] if diff < len(plain_gaps) else None
                differences.append((diff, gap))
        records.append({"id": item["id"], "method": method, "decoding": decoding, "penalty": penalty,
                        "num_new_tokens": n, "verify_steps": s, "accept_length": n / s if s else 1.0,
                        "sglang_accept_length": meta.get("spec_accept_length"), "seconds": wall,
                        "identical": same, "first_difference": diff, "tie_gap": gap,
                        "finish_reason": meta.get("finish_reason"),
                        "distinct": [distinct(ids, k) for k in distinct_n]})
    count = max(len(outputs), 1)
    first = min(differences, key=lambda d: d[0]) if differences else None
    row = {"method": method, "penalty": penalty, "prompts": len(outputs), "tokens": tokens, "steps": steps,
           "committed": tokens, "decode_seconds": seconds, "tau": tokens / steps if steps else None,
           "alpha": None, "sglang_accept_rate": statistics.fmean(accept_rates) if accept_rates else None,
           "tokens_per_second": tokens / seconds if seconds else 0.0, "identical": identical,
           "first_difference": first[0] if first else None, "tie_gap": first[1] if first else None, "errors": 0,
           "error": None, **{f"distinct_{k}": d / count for k, d in zip(distinct_n, dist)}}
    return row, records


def missing_row(method: str, penalty: float, reason: str, distinct_n: tuple[int, ...]) -> dict:
    """The row of a method that did not run (its engine failed or cannot run here)."""
    return {"method": method, "penalty": penalty, "prompts": 0, "tokens": 0, "steps": 0, "committed": 0,
            "decode_seconds": 0.0, "tau": None, "alpha": None, "sglang_accept_rate": None, "tokens_per_second": None,
            "speedup": None,
            "identical": None, "errors": 1, "error": reason, **{f"distinct_{k}": None for k in distinct_n}}


def run_acceptance(args: argparse.Namespace, methods: list[str], prompts: list[dict], model_dir: Path,
                   drafts: dict[str, Path | None], settings: dict[str, Any], label: Callable[..., str],
                   distinct: Callable[[list[int], int], float], distinct_n: tuple[int, ...],
                   on_cpu: bool, save: Callable[[list[dict], list[dict]], None]) -> tuple[list[dict], list[dict]]:
    """Every method's engine in turn over the prompts, each decoding at each penalty.

    ``settings``: ``penalty_window``, ``ignore_eos``, ``seed`` (the runtime's effective settings,
    so both engines run the same requests). ``save(rows, records)`` after each method: an engine
    that takes the process down keeps the methods before it. Returns (rows, records)."""
    from ..sglang.engine import penalty_processor

    decodings = list(dict.fromkeys(args.decodings))
    penalties = list(dict.fromkeys(float(t) for t in args.penalties))
    longest = max(len(p["input_ids"]) for p in prompts)
    base_kw = proxy_engine_kwargs(model_dir, on_cpu, longest + args.max_new_tokens + 256, args.dtype,
                                  int(settings["seed"]))
    processor = penalty_processor()
    outputs: dict[tuple[str, str, float], list] = {}
    gaps: dict[float, dict[str, list[float | None]]] = {}  # plain greedy's top-2 gaps, per penalty and prompt
    failures: dict[str, str] = {}
    # NGRAM last: an engine that cannot start takes the process down with it (SGLang's watchdog),
    # and what ran before is saved by then.
    order = [m for m in methods if m != "ngram"] + [m for m in methods if m == "ngram"]
    rows: list[dict] = []
    records: list[dict] = []

    def collect() -> tuple[list[dict], list[dict]]:
        rows.clear()
        records.clear()
        for decoding in decodings:
            for penalty in penalties:
                setting = label(decoding, penalty, args.temperature if decoding == "sampled" else 0.0,
                                args.min_p if decoding == "sampled" else 0.0)
                head = {"setting": setting, "decoding": decoding,
                        "temperature": float(args.temperature) if decoding == "sampled" else 0.0,
                        "min_p": float(args.min_p) if decoding == "sampled" else 0.0}
                base = outputs.get((BASELINE, decoding, penalty))
                baseline = {item["id"]: out["output_ids"] for item, out, _ in base} if base else None
                plain_rate = None
                for method in methods:
                    if method in failures:
                        rows.append({**head, **missing_row(method, penalty, failures[method], distinct_n)})
                        continue
                    got = outputs.get((method, decoding, penalty))
                    if got is None:
                        continue
                    row, recs = acceptance_row(method, decoding, penalty, got,
                                               None if method == BASELINE else baseline, distinct, distinct_n,
                                               gaps.get(penalty))
                    if method == BASELINE:
                        plain_rate = row["tokens_per_second"]
                    row["speedup"] = row["tokens_per_second"] / plain_rate if plain_rate else None
                    rows.append({**head, **row})
                    records.extend({"setting": setting, **r} for r in recs)
        return rows, records

    ngram_reason = ngram_unavailable(on_cpu)
    for method in order:
        if method == "ngram" and ngram_reason:
            failures[method] = f"not run: {ngram_reason}"
            print(f"== {method}: {failures[method]}", flush=True)
            continue
        print(f"== {method} ({ALGORITHMS[method] or 'plain decoding'}) in sgl.Engine", flush=True)

        def body(engine, method=method):
            own = ALGORITHMS[method] not in (None, "NGRAM")  # our workers apply the penalty themselves

            def logits(penalty: float) -> str | None:
                return None if own or penalty <= 1.0 else processor

            for decoding in decodings:  # untimed: first-use compilation (JIT kernels, graphs) is no step's cost
                for penalty in penalties:
                    params = sampling_params(decoding, penalty, settings["penalty_window"], 16,
                                             settings["ignore_eos"], args.temperature, args.min_p)
                    request(engine, [prompts[0]["input_ids"]], params, logits(penalty))
            for decoding in decodings:
                for penalty in penalties:
                    params = sampling_params(decoding, penalty, settings["penalty_window"], args.max_new_tokens,
                                             settings["ignore_eos"], args.temperature, args.min_p)
                    if method == BASELINE and decoding == "greedy":  # untimed: how close to a tie each token was
                        outs, _ = request(engine, [item["input_ids"] for item in prompts], params, logits(penalty),
                                          return_logprob=True, top_logprobs_num=2)
                        gaps[penalty] = {item["id"]: [top2_gap(o["meta_info"], i) for i in range(len(o["output_ids"]))]
                                         for item, o in zip(prompts, outs)}
                    got = []
                    for item in prompts:  # one at a time: tokens/s per request, as the runtime measures it
                        outs, wall = request(engine, [item["input_ids"]], params, logits(penalty))
                        got.append((item, outs[0], wall))
                        meta = outs[0]["meta_info"]
                        steps = steps_of(meta)
                        print(f"  {decoding} θ={penalty:g} {item['id']}: {meta.get('completion_tokens')} tokens "
                              f"in {wall:.2f} s" + (f", tau {meta['completion_tokens'] / steps:.2f}" if steps else ""),
                              flush=True)
                    outputs[(method, decoding, penalty)] = got

        try:
            with_engine(with_method(base_kw, method, drafts.get(method)), bool(args.adaptive), body)
        except Exception as exc:  # noqa: BLE001 - one method's failure must not lose the others' rows
            failures[method] = f"{type(exc).__name__}: {exc}"[:500]
            print(f"== {method} failed: {failures[method]}", flush=True)
        save(*collect())
    return collect()


# -- step costs (GPU) -------------------------------------------------------------------------------


def dummy_engine_kwargs(model: Path, context: int, batches: list[int]) -> dict[str, Any]:
    """``sgl.Engine`` arguments for a dummy-weights 8B-class model, as gpu_check and
    adaptive_check start theirs; CUDA graphs only for the measured batch sizes (a start captures
    one graph per size, and each engine here starts once per method and shape)."""
    return {"model_path": str(model), "load_format": "dummy", "skip_tokenizer_init": True, "mem_fraction_static": 0.8,
            "context_length": max(context + CONTEXT_HEADROOM, 8192), "log_level": "warning", "random_seed": 0,
            "chunked_prefill_size": 16384, "max_running_requests": max(4, max(batches)),
            "cuda_graph_bs_decode": sorted(set(batches)), "cuda_graph_backend_prefill": "disabled"}


def dummy_drafts(root: Path, name: str, config: dict, methods: list[str]) -> tuple[Path, dict[str, Path | None]]:
    """The dummy model and random drafters of one shape (gpu_check's makers)."""
    from .gpu_check import make_checkpoints, make_longspec_drafter, make_owl_drafter

    model, heads = make_checkpoints(root, 4096, config=config, name=name)
    drafts: dict[str, Path | None] = {"tokenswift": heads}
    if {"owl", "howl"} & set(methods):
        owl = make_owl_drafter(root, 1024, 32768, config=config)
        drafts.update(owl=owl, howl=owl)
    if "longspec" in methods:
        drafts["longspec"] = make_longspec_drafter(root, config, name=f"{name}-longspec")
    return model, drafts


def timed(engine, prompt: list[int], batch: int, params: dict, new_tokens: int) -> tuple[float, int, list[dict]]:
    """``batch`` copies of ``prompt`` with ``new_tokens`` each: (wall s, the batch's steps, outputs).
    Steps: target forwards after the prefill, as the batch takes them together (its longest
    request's ``spec_verify_ct``; plain decoding: one per token after the prefill's)."""
    outs, wall = request(engine, [prompt] * batch, {**params, "max_new_tokens": new_tokens}, None)
    steps = [steps_of(o["meta_info"]) for o in outs]
    if all(s is not None for s in steps):
        return wall, max(steps), outs
    return wall, max(int(o["meta_info"]["completion_tokens"]) for o in outs) - 1, outs


def step_figures(short: tuple[float, int, int], long: tuple[float, int, int],
                 min_steps: int = 1) -> dict[str, float | int | None]:
    """ms per token and per step from two requests of one prompt and batch, ``(wall s, new tokens,
    steps)`` each: the difference of their walls over the difference of their tokens and steps.

    Whatever every request pays once (the prefill of its cached prompt, a method's per-request
    set-up, the first token) cancels out, so a step costs what it costs in a long generation;
    ``request_ms`` is that fixed part, the short request's wall less its steps. Dividing one
    request's wall by its steps, or subtracting a 1-token request's wall, lets a single noisy
    sample or a set-up of hundreds of milliseconds pass for step time. Fewer than ``min_steps``
    steps between the two requests give no figure: a few milliseconds of jitter over two or three
    steps once came out as a negative step cost."""
    (w0, n0, s0), (w1, n1, s1) = short, long
    dw = (w1 - w0) * 1e3
    timed_steps = s1 - s0
    enough = timed_steps >= max(1, min_steps)
    ms_token = dw / (n1 - n0) if enough and n1 > n0 else None
    ms_step = dw / timed_steps if enough else None
    return {"ms_per_token": None if ms_token is None else round(ms_token, 3),
            "ms_per_step": None if ms_step is None else round(ms_step, 3),
            "request_ms": None if ms_step is None else round(w0 * 1e3 - s0 * ms_step, 1),
            "timed_steps": timed_steps}


def long_request_tokens(n: int, short: int, short_steps: int, cap: int) -> int:
    """New tokens of the longer timed request: ``1 + n`` times the tokens a step committed in the
    shorter one, so that about ``n`` steps lie between the two whatever the acceptance (a repetitive
    greedy workload commits 13-16 tokens a step: ``1 + n`` tokens would be four steps). At most
    ``cap`` tokens (the context's headroom)."""
    return _tokens_for_steps(n, short - 1, short_steps, short, cap)


def retry_request_tokens(n: int, short: int, short_steps: int, long: int, long_steps: int, cap: int) -> int:
    """New tokens of a second, longer request when the first left too few steps between the two:
    priced by the tokens a step committed *between* the two requests. A repeating workload's
    first steps commit few tokens (its n-gram history is still filling), so the short request
    under-rates the steady state: on an H200, 17 tokens took 4 steps and 257 took 14."""
    return _tokens_for_steps(n, long - short, long_steps - short_steps, long, cap)


def _tokens_for_steps(n: int, tokens: int, steps: int, floor: int, cap: int) -> int:
    per_step = max(1, math.ceil(tokens / max(steps, 1)))
    return max(floor + 1, min(1 + n * per_step, cap))


def measure_engine(engine, method: str, contexts: list[int], batches: list[int], n: int, vocab: int,
                   log: Callable[[str], None], headroom: int = LONG_REQUEST_CAP) -> list[dict]:
    """Every (context, batch) of one engine: greedy and sampled (T=1) requests of ``1 + n // 4``
    new tokens and of :func:`long_request_tokens` (``1 + n`` when a step commits one token), once
    more at :func:`retry_request_tokens` when fewer than ``n // 4`` steps lay between the two, the
    short one again after it (the faster of the two kept), and :func:`step_figures` from the pair,
    over at least ``n // 4`` steps.

    The batch is ``batch`` copies of one prompt: each request still reads its whole context every
    step (its own slot table), and the prompt's one prefill, kept by the radix cache, serves every
    request of that context, so the long prefills are paid once per context and engine."""
    rng = random.Random(0)
    greedy = {"temperature": 0.0, "ignore_eos": True}
    sampled = {"temperature": 1.0, "ignore_eos": True}
    short = 1 + n // 4
    min_steps = max(1, n // 4)
    rows = []
    warm = [rng.randrange(1000, vocab - 1000) for _ in range(512)]
    # First-use costs (kernel compilation, drafter graphs per batch size, sampling kernels) off the
    # clock: twice, the second time with the prompt in the radix cache, as every timed request has it.
    for _ in range(2):
        for batch in batches:
            for params in (greedy, sampled):
                request(engine, [warm] * batch, {**params, "max_new_tokens": short}, None)
    for context in contexts:
        prompt = [rng.randrange(1000, vocab - 1000) for _ in range(context)]
        request(engine, [prompt], {**greedy, "max_new_tokens": 1}, None)  # the prefill, into the radix cache
        for batch in batches:
            row: dict[str, Any] = {"method": method, "context": context, "batch": batch}
            for name, params in (("greedy", greedy), ("sampled", sampled)):
                w0, s0, _ = timed(engine, prompt, batch, params, short)
                long = long_request_tokens(n, short, s0, headroom)
                w1, s1, outs = timed(engine, prompt, batch, params, long)
                if s1 - s0 < min_steps and long < headroom:
                    long = retry_request_tokens(n, short, s0, long, s1, headroom)
                    w1, s1, outs = timed(engine, prompt, batch, params, long)
                # The short request once more: a first-use cost (a kernel compiled for this context)
                # paid by the first one made a step look 2.3x cheaper in an H200 run.
                w_again, s_again, _ = timed(engine, prompt, batch, params, short)
                if w_again < w0:
                    w0, s0 = w_again, s_again
                row[f"{name}_new_tokens"] = [short, long]
                for key, value in step_figures((w0, short, s0), (w1, long, s1), min_steps=min_steps).items():
                    row[f"{name}_{key}"] = value
                if method != BASELINE:
                    row[f"{name}_steps"] = s1
                    row[f"{name}_tau"] = round(statistics.fmean(
                        int(o["meta_info"]["completion_tokens"]) / max(steps_of(o["meta_info"]) or 1, 1)
                        for o in outs), 3)
            if method == BASELINE:  # one token per step: its step is its token
                for name in ("greedy", "sampled"):
                    row.pop(f"{name}_ms_per_step")
            row["figure"] = MEASURED
            rows.append(row)
            log(f"  context {context} batch {batch}: " + ", ".join(
                f"{k} {v}" for k, v in row.items() if k.startswith(("greedy_", "sampled_"))))
    return rows


def run_step_costs(args: argparse.Namespace, methods: list[str], shapes: dict[str, dict],
                   save: Callable[[list[dict]], None], done: list[dict] | None = None) -> list[dict]:
    """Measured ms/step (ms/token for plain decoding) per shape, method, context and batch.

    ``done``: rows a stopped run measured; their (shape, method) engines are not started again."""
    rows: list[dict] = list(done or [])
    finished = {(r["shape"], r["method"]) for r in rows}
    root = Path(tempfile.mkdtemp(prefix="longgen_bench_costs_"))
    order = [m for m in methods if m != "ngram"] + [m for m in methods if m == "ngram"]  # see run_acceptance
    started = time.perf_counter()

    def log(line: str) -> None:
        print(f"[{time.perf_counter() - started:6.0f} s] {line}", flush=True)

    for name, config in shapes.items():
        todo = [m for m in order if (name, m) not in finished]
        if not todo:
            log(f"{name}: every method measured by the stopped run")
            continue
        log(f"{name}: dummy weights and random drafters")
        model, drafts = dummy_drafts(root / name, name, config, methods)
        kw = dummy_engine_kwargs(model, max(args.contexts), args.batches)
        for method in todo:
            log(f"{name} {method} ({ALGORITHMS[method] or 'plain decoding'}): starting the engine")
            try:
                got = with_engine(with_method(kw, method, drafts.get(method)), False,
                                  lambda engine, method=method, vocab=config["vocab_size"]: measure_engine(
                                      engine, method, args.contexts, args.batches, args.step_tokens, vocab, log))
                rows += [{"shape": name, **r} for r in got]
            except Exception as exc:  # noqa: BLE001 - one method's failure must not lose the others' rows
                rows.append({"shape": name, "method": method, "error": f"{type(exc).__name__}: {exc}"[:500]})
                log(f"{name} {method} failed: {rows[-1]['error']}")
            save(rows)
    return rows


def step_cost(row: dict) -> tuple[float, str] | None:
    """The step cost a projection divides by, and the decoding it was timed with: the larger of the
    figures timed over at least half the steps of the longest-timed one. A step's cost is that of
    its draft and verify forwards, whose shapes do not depend on what the step accepts, so either
    decoding prices it; a figure from a few steps is jitter (a repetitive greedy run once needed
    only 3, and came out at -206.8 ms), and of two steady figures the larger keeps the projection
    from being optimistic: a first-use cost paid by one short request once made a greedy step look
    2.3x cheaper than the sampled one. Plain decoding: its greedy ms/token. Rows without
    ``*_timed_steps`` (an older bench) count ``*_steps``, the longer request's steps."""
    if row["method"] == BASELINE:
        ms = row.get("greedy_ms_per_token")
        return (ms, "greedy") if ms else None
    figures = []
    for decoding in ("greedy", "sampled"):
        ms = row.get(f"{decoding}_ms_per_step")
        steps = row.get(f"{decoding}_timed_steps", row.get(f"{decoding}_steps")) or 0
        if ms is not None and ms > 0:
            figures.append((steps, ms, decoding))
    if not figures:
        return None
    most = max(steps for steps, _, _ in figures)
    _, ms, decoding = max((f for f in figures if 2 * f[0] >= most), key=lambda f: f[1])
    return ms, decoding


def project(costs: list[dict], acceptance: list[dict]) -> list[dict]:
    """Projected ms/token per (shape, method, context, batch, proxy setting): the measured step
    cost (:func:`step_cost`) over the proxy's tau."""
    tau_of = {(r["method"], r["setting"]): r["tau"] for r in acceptance if r.get("tau")}
    settings = list(dict.fromkeys(r["setting"] for r in acceptance))
    plain = {(r["shape"], r["context"], r["batch"]): r.get("greedy_ms_per_token")
             for r in costs if r.get("method") == BASELINE and "context" in r}
    out = []
    for r in costs:
        if "context" not in r or (cost := step_cost(r)) is None:
            continue
        step, decoding = cost
        plain_ms = plain.get((r["shape"], r["context"], r["batch"]))
        for setting in settings:
            tau = 1.0 if r["method"] == BASELINE else tau_of.get((r["method"], setting))
            if tau is None:
                continue
            ms = step / tau
            out.append({"figure": PROJECTED, "shape": r["shape"], "method": r["method"], "context": r["context"],
                        "batch": r["batch"], "setting": setting, "proxy_tau": tau, "step_ms": step,
                        "step_timed": decoding, "projected_ms_per_token": round(ms, 4),
                        "projected_speedup": round(plain_ms / ms, 3) if plain_ms and ms else None})
    return out


def parse_shapes(names: list[str]) -> dict[str, dict]:
    from .gpu_check import SHAPES

    bad = [n for n in names if n not in SHAPES]
    if bad:
        raise LonggenError(f"--shapes: unknown shape {bad[0]!r} (known: {', '.join(SHAPES)})")
    return {n: SHAPES[n] for n in dict.fromkeys(names)}
