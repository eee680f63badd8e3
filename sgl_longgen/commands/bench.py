"""``sgl-longgen bench``: every method side by side, written as JSON, a Markdown table and a PNG plot.

Two parts:

* acceptance (anywhere, CPU included): each method on the embedded model (default: the trained
  proxy ``tiny`` with its own TokenSwift heads and OWL drafter) over a few held-out prompts, under
  greedy decoding and under sampling (temperature 1, min_p 0.1), at each contextual penalty
  (1.0 and 1.2): tau, alpha, Distinct-1..4, tokens/s on the reference runtime and, under greedy
  decoding, whether each method's output is token-identical to plain decoding's. This is
  ``sgl-longgen eval`` run once per decoding mode (its rows, its checks, its progress bars);
* projection (with ``--gpu-report``, a JSON report of ``python -m sgl_longgen.bench.gpu_check``):
  the GPU check times each algorithm's steps on an 8B-shaped model with dummy weights, whose
  repetitive greedy output makes tau an upper bound of what real text gets. Here each measured
  step wall (``host_step_wall_median_ms``, else ``draft_ms + verify_ms + overhead_ms``) is divided
  by the tau measured on the proxy in the acceptance part: the *projected* ms/token, and plain
  decoding's ms/token (``ar_step_ms``) over it, the *projected* speedup. The GPU check's own
  figures are kept beside them, labelled "measured, dummy weights: repetitive greedy (upper bound)".

With ``--engine sglang`` every method runs inside SGLang's ``sgl.Engine`` instead
(``sgl_longgen.bench.engine_bench``): plain decoding, SGLang's own NGRAM (the peer), TOKENSWIFT,
OWL, HOWL, LONGSPEC and SUFFIX, one engine at a time, on the same proxy, prompts and settings (SGLang's CPU
engine where there is no GPU). tau is SGLang's (completion tokens / ``spec_verify_ct``). With
``--step-costs`` (GPU only) each method's engine also runs 8B-class shapes with dummy weights
(``--shapes``: Llama-3.1-8B, Qwen2.5-7B) at each ``--contexts`` length and ``--batches`` size: the
measured ms per step (plain decoding: per token) and the *projected* ms/token = that step cost /
the proxy's tau, next to the dummy weights' own measured ms/token (greedy: repetitive text, an
upper bound; sampled at T=1: almost nothing accepted, a lower bound).

Outputs in ``--out DIR``: ``bench.json``, ``bench.md`` and ``bench.png``.
"""

from __future__ import annotations

import argparse
import json
import math
import shlex
import sys
import tempfile
from pathlib import Path
from typing import Any

from ..bench import engine_bench
from ..config import load_toml
from ..errors import LonggenError
from . import eval as eval_cmd
from .generate import add_model_args, args_draft_dirs, read_prompts, resolve_config

DECODINGS = ("greedy", "sampled")
ENGINES = ("runtime", "sglang")
DEFAULT_CONTEXTS = (4096, 32768, 98304)
DEFAULT_BATCHES = (1, 4)
PROJECTED = "projected: GPU step wall / proxy tau"
MEASURED_DUMMY = "measured, dummy weights: repetitive greedy (upper bound)"

# Held-out prompts: written for this benchmark, so in no training corpus (the proxy is trained on
# Python's standard library); openings of ordinary Python modules, the proxy's domain.
HELD_OUT_PROMPTS = (
    'import os\nimport sys\n\n\ndef walk_files(root, suffix=".py"):\n'
    '    """Yield the path of every file under root whose name ends with suffix."""\n    ',
    'class LRUCache:\n    """A bounded mapping that forgets the least recently used key first."""\n\n'
    "    def __init__(self, capacity):\n        ",
    '"""Parse simple INI-style configuration files into nested dictionaries."""\n\nimport re\n\n\n'
    "class ConfigError(Exception):\n    pass\n\n\ndef parse(text):\n    ",
    'def merge_sorted(a, b):\n    """Merge two sorted lists into one sorted list."""\n    result = []\n    ',
)


def add_parser(sub) -> None:
    p = sub.add_parser("bench", help="every method side by side: tau, alpha, Distinct-n, tokens/s, GPU projections; "
                                     "JSON, Markdown and PNG",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True, metavar="DIR", help="directory for bench.json, bench.md, bench.png")
    add_model_args(p)
    p.add_argument("--methods", nargs="+", metavar="METHOD",
                   help=f"methods to compare (default: all, {', '.join(eval_cmd.method_names())}); "
                        f"{eval_cmd.BASELINE} always runs")
    p.add_argument("--max-new-tokens", type=int, default=12,
                   help="new tokens per prompt and run (default 12: a quick look; thousands for real figures)")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--prompts", nargs="+", metavar="TEXT", help="prompt texts (default: built-in held-out prompts)")
    src.add_argument("--prompt-file", type=Path, help="a text file (one prompt) or JSONL ({'id', 'prompt'|'input_ids'})")
    p.add_argument("--num-prompts", type=int, default=2,
                   help=f"how many built-in held-out prompts (1-{len(HELD_OUT_PROMPTS)}, default 2)")
    g = p.add_argument_group("settings (each decoding mode at each penalty)")
    g.add_argument("--decodings", nargs="+", choices=DECODINGS, default=list(DECODINGS),
                   help="greedy (with the identity check) and/or sampled (default: both)")
    g.add_argument("--penalties", type=float, nargs="+", default=[1.0, 1.2], metavar="THETA",
                   help="contextual penalties theta (default: 1.0 1.2)")
    g.add_argument("--temperature", type=float, default=1.0, help="temperature of the sampled setting (default 1.0)")
    g.add_argument("--min-p", type=float, default=0.1, help="min_p of the sampled setting (default 0.1)")
    g.add_argument("--penalty-window", type=int, help="contextual penalty window W (tokens)")
    g.add_argument("--seed", type=int, help="sampling seed")
    p.add_argument("--tie-tolerance", type=float, default=0.0, metavar="NATS",
                   help="--engine sglang: a greedy output that first differs from plain decoding's where plain "
                        "decoding's top-2 log-probabilities were within NATS of each other is reported, not an "
                        "error (GPU kernels round differently in bfloat16; default 0: any difference is an error)")
    p.add_argument("--adaptive", action="store_true",
                   help="keep adaptive speculation on (default: off, so that tau counts speculative steps only, "
                        "what the GPU projection divides by; on, the CPU's costs decide which steps speculate)")
    p.add_argument("--gpu-report", type=Path, metavar="JSON",
                   help="a report of python -m sgl_longgen.bench.gpu_check: project its step times with the proxy's tau")
    p.add_argument("--engine", choices=ENGINES, default="runtime",
                   help="runtime: the reference runtime (default); sglang: every method inside sgl.Engine "
                        "(SGLang's CPU engine where there is no GPU), SGLang's NGRAM among them")
    s = p.add_argument_group("step costs (--engine sglang, GPU hosts)")
    s.add_argument("--step-costs", action="store_true",
                   help="also measure each method's ms/step on 8B-class shapes with dummy weights and project "
                        "ms/token with the proxy's tau (needs CUDA)")
    s.add_argument("--shapes", nargs="+", default=None, metavar="SHAPE",
                   help="model shapes of the step costs (default: llama8b qwen7b)")
    s.add_argument("--contexts", type=int, nargs="+", default=list(DEFAULT_CONTEXTS), metavar="TOKENS",
                   help="context lengths of the step costs (default: 4096 32768 98304)")
    s.add_argument("--batches", type=int, nargs="+", default=list(DEFAULT_BATCHES), metavar="N",
                   help="concurrent requests of the step costs (default: 1 4)")
    s.add_argument("--step-tokens", type=int, default=64, metavar="N",
                   help="steps between the two timed requests of the step costs (default 64): the shorter one has "
                        "1 + N/4 new tokens, the longer one 1 + N times what a step of the shorter one committed, "
                        "and the difference of their walls is what the steps cost (none under N/4 steps)")
    p.add_argument("--resume", action="store_true",
                   help="--engine sglang: continue a run that was stopped (a time limit, a lost host) from the "
                        "bench.json it left in --out, written by the same command: its acceptance rows, if "
                        "complete, and the step costs of every shape and method already measured are kept")
    p.set_defaults(run=run, bench_parser=p)


# -- input checks (before any work: a typo fails in the first second) ------------------------------


def check_methods(requested: list[str] | None, known: list[str] | None = None) -> list[str]:
    known = known or eval_cmd.method_names()
    methods = list(dict.fromkeys(requested or known))
    for m in methods:
        if m not in known:
            raise LonggenError(f"--methods: unknown method {m!r} (known: {', '.join(known)})")
    return [eval_cmd.BASELINE] + [m for m in methods if m != eval_cmd.BASELINE]


def load_gpu_report(path: Path) -> dict:
    """A gpu_check report, checked for what the projection needs (``ar_step_ms``)."""
    if not path.is_file():
        raise LonggenError(f"--gpu-report: file not found: {path}")
    try:
        report = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise LonggenError(f"--gpu-report: {path} is not a JSON report ({type(exc).__name__}: {exc})") from None
    if not isinstance(report, dict):
        raise LonggenError(f"--gpu-report: {path} is not a gpu_check report (a JSON object)")
    ar = report.get("ar_step_ms")
    if not isinstance(ar, dict) or not ar:
        raise LonggenError(f"--gpu-report: {path} has no ar_step_ms (plain decoding's ms/token per context: "
                           "run python -m sgl_longgen.bench.gpu_check --phase plain first)")
    return report


def _number(value: Any) -> float | None:
    """A finite float, or None (gpu_check writes NaN where a figure is missing)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    value = float(value)
    return value if math.isfinite(value) else None


def _clean(obj: Any) -> Any:
    """JSON without NaN / Infinity (strict parsers reject them)."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: _clean(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_clean(v) for v in obj]
    return obj


def setting_label(decoding: str, penalty: float, temperature: float, min_p: float) -> str:
    theta = f"{penalty:g}" if "." in f"{penalty:g}" else f"{penalty:.1f}"
    if decoding == "greedy":
        return f"greedy θ={theta}"
    return f"sampled T={temperature:g} min_p={min_p:g} θ={theta}"


# -- acceptance: sgl-longgen eval, once per decoding mode ------------------------------------------


def _eval_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="sgl-longgen")
    eval_cmd.add_parser(parser.add_subparsers())
    return parser


def eval_argv(args: argparse.Namespace, methods: list[str], decoding: str, prompt_file: Path | None,
              config: Path | None, out: Path) -> list[str]:
    """The ``sgl-longgen eval`` command line of one decoding mode (every penalty in one run)."""
    argv = ["eval", "--model", str(args.model), "--max-new-tokens", str(args.max_new_tokens), "--out", str(out),
            "--penalties", *(repr(float(t)) for t in args.penalties)]
    for m in methods:
        argv += ["--method", m]
    for flag, value in (("--heads", args.heads), ("--drafter", args.drafter),
                        ("--longspec-drafter", args.longspec_drafter), ("--config", config),
                        ("--dtype", args.dtype), ("--penalty-window", args.penalty_window), ("--seed", args.seed),
                        ("--prompt-file", prompt_file)):
        if value is not None:
            argv += [flag, str(value)]
    # Adaptive speculation would swap in plain steps by CPU costs, and tau would no longer say what
    # the drafts are worth: off unless asked for.
    argv.append("--adaptive" if args.adaptive else "--no-adaptive")
    if decoding == "greedy":
        argv += ["--temperature", "0"]
    else:
        argv += ["--temperature", repr(float(args.temperature)), "--min-p", repr(float(args.min_p))]
    return argv


def write_prompts(args: argparse.Namespace, directory: Path) -> tuple[Path, list[dict]]:
    """The prompts as a JSONL file for eval, and their ids and texts for the report."""
    if args.prompt_file is not None:
        return args.prompt_file, []  # eval reads it; the ids come back in its records
    if args.prompts:
        texts = list(args.prompts)
        ids = [f"prompt-{i}" for i in range(len(texts))]
    else:
        texts = list(HELD_OUT_PROMPTS[: args.num_prompts])
        ids = [f"held-out-{i}" for i in range(len(texts))]
    path = directory / "prompts.jsonl"
    items = [{"id": i, "prompt": t} for i, t in zip(ids, texts)]
    path.write_text("".join(json.dumps(item) + "\n" for item in items))
    return path, items


def run_acceptance(args: argparse.Namespace, methods: list[str]) -> tuple[list[dict], list[dict], list[dict], int]:
    """``sgl-longgen eval`` per decoding mode; returns (rows, records, prompts, worst exit code)."""
    rows: list[dict] = []
    records: list[dict] = []
    code = 0
    parser = _eval_parser()
    with tempfile.TemporaryDirectory(prefix="longgen_bench_") as tmp:
        tmpdir = Path(tmp)
        prompt_file, prompts = write_prompts(args, tmpdir)
        config = args.config
        for decoding in dict.fromkeys(args.decodings):
            out = tmpdir / f"eval-{decoding}.json"
            print(f"== {decoding} ==", flush=True)
            eval_args = parser.parse_args(eval_argv(args, methods, decoding, prompt_file, config, out))
            code = max(code, int(eval_args.run(eval_args) or 0))
            report = json.loads(out.read_text())
            temperature = float(report["temperature"])
            min_p = float(args.min_p) if decoding == "sampled" else 0.0
            for row in report["rows"]:
                label = setting_label(decoding, row["penalty"], temperature, min_p)
                rows.append({"setting": label, "decoding": decoding, "temperature": temperature, "min_p": min_p,
                             **row})
            for rec in report["records"]:
                rec = {k: v for k, v in rec.items() if k not in ("output_ids", "text")}
                records.append({"setting": setting_label(decoding, rec["penalty"], temperature, min_p),
                                "decoding": decoding, **rec})
    if not prompts:
        prompts = [{"id": i, "prompt": None, "prompt_file": str(prompt_file)}
                   for i in dict.fromkeys(r["id"] for r in records)]
    return rows, records, prompts, code


# -- projection: GPU step times over the proxy's tau ----------------------------------------------


def step_wall(step: dict) -> tuple[float | None, str | None]:
    """One gpu_check step row's measured step wall (ms) and where it came from."""
    wall = _number(step.get("host_step_wall_median_ms"))
    if wall is not None:
        return wall, "host_step_wall_median_ms"
    parts = [_number(step.get(k)) for k in ("draft_ms", "verify_ms", "overhead_ms")]
    if all(p is not None for p in parts):
        return sum(parts), "draft_ms+verify_ms+overhead_ms"
    return None, None


def gpu_runs(report: dict) -> list[tuple[str, dict]]:
    """The speculative runs of a gpu_check report (``{tag: {'algorithm', 'steps', ...}}``), in order."""
    return [(tag, run) for tag, run in report.items() if isinstance(run, dict) and isinstance(run.get("steps"), list)]


def project(report: dict, acceptance: list[dict]) -> dict:
    """Projected ms/token and speedup per run, context and setting, next to the measured figures."""
    plain = {str(k): _number(v) for k, v in report["ar_step_ms"].items()}
    tau_of = {(r["method"], r["setting"]): r["tau"] for r in acceptance}
    settings = list(dict.fromkeys(r["setting"] for r in acceptance))
    runs = gpu_runs(report)
    algorithms = [str(run.get("algorithm", tag)).lower() for tag, run in runs]
    projected: list[dict] = []
    measured: list[dict] = []
    for (tag, run), method in zip(runs, algorithms):
        label = method if algorithms.count(method) == 1 else tag
        for step in run["steps"]:
            context = step.get("context")
            plain_ms = plain.get(str(context), _number(step.get("ar_step_ms")))
            wall, source = step_wall(step)
            measured.append({"figure": MEASURED_DUMMY, "run": tag, "label": label, "method": method,
                             "context": context, "plain_ms_per_token": plain_ms,
                             "measured_dummy_tau": _number(step.get("tau")),
                             "measured_dummy_ms_per_token": _number(step.get("ms_per_token")),
                             "measured_dummy_speedup": _number(step.get("speedup")),
                             "measured_dummy_host_ms_per_token_median": _number(step.get("host_ms_per_token_median")),
                             "step_wall_ms": wall, "step_wall_source": source})
            for setting in settings:
                tau = tau_of.get((method, setting))
                if tau is None:  # not run on the proxy (e.g. SGLang's NGRAM, or left out by --methods)
                    continue
                ms = wall / tau if wall is not None and tau else None
                projected.append({"figure": PROJECTED, "run": tag, "label": label, "method": method,
                                  "context": context, "setting": setting, "proxy_tau": tau,
                                  "step_wall_ms": wall, "step_wall_source": source,
                                  "projected_ms_per_token": ms,
                                  "projected_speedup": plain_ms / ms if ms and plain_ms is not None else None,
                                  "plain_ms_per_token": plain_ms})
    return {
        "note": ("projected ms/token = measured GPU step wall (host_step_wall_median_ms, else draft_ms + verify_ms + "
                 "overhead_ms) / tau measured on the proxy in the acceptance part; projected speedup = plain "
                 "decoding's measured ms/token (ar_step_ms) / projected ms/token. The GPU check runs dummy weights, "
                 "whose repetitive greedy output makes its own tau and speedup an upper bound."),
        "plain": [{"context": int(k) if k.isdigit() else k, "plain_ms_per_token": v} for k, v in plain.items()],
        "plain_attention_backend": report.get("plain_attention_backend"),
        "projected": projected,
        "measured_dummy": measured,
        "errors": {k: v for k, v in report.items() if k.endswith("_error")},
    }


# -- outputs ---------------------------------------------------------------------------------------


def _f(value: Any, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def intro(result: dict) -> str:
    """What the acceptance figures are, by engine."""
    n = f"{len(result['prompts'])} prompt(s), {result['max_new_tokens']} new tokens each per run."
    adaptive = {False: " Adaptive speculation off: tau counts speculative steps only.",
                True: " Adaptive speculation on: plain steps chosen by measured costs count in tau."}.get(
                    result["adaptive"], "")
    if result.get("engine") == "sglang":
        where = "SGLang's CPU engine" if result.get("on_cpu") else "a GPU"
        return (f"Every method inside sgl.Engine ({where}), {n} tau = completion tokens / spec_verify_ct, as SGLang "
                f"reports it; alpha (accepted drafts / drafted depth) is the reference runtime's, not reported "
                f"here; SGLang's accept rate is its spec_accept_rate (accepted draft tokens / draft tokens "
                f"verified, every tree node counted). tok/s and speedup are this machine's.{adaptive}")
    return f"Reference runtime, {n} tok/s and speedup are the CPU reference runtime's, not a GPU's.{adaptive}"


def acceptance_table(rows: list[dict]) -> list[str]:
    rate = any(r.get("sglang_accept_rate") is not None for r in rows)
    lines = [("| setting | method | tokens | tau | alpha | " + ("SGLang accept rate | " if rate else "")
              + "Distinct-1 | Distinct-2 | Distinct-3 | Distinct-4 | tok/s | speedup | identical to plain |"),
             "|---|---|---|---|---|" + ("---|" if rate else "") + "---|---|---|---|---|---|---|"]
    notes = {}
    for r in rows:
        same = "-" if r["identical"] is None else ("yes" if r["identical"] else "**NO**")
        if r["identical"] is False and r.get("first_difference") is not None:
            gap = r.get("tie_gap")
            same += f" (from token {r['first_difference']}" + (f"; plain's top-2 gap there {gap:.4f}" if gap is not None
                                                                 else "") + ")"
        distinct = " | ".join(_f(r[f"distinct_{n}"], ".3f") for n in eval_cmd.DISTINCT_N)
        accept = f" | {_f(r.get('sglang_accept_rate'), '.3f')}" if rate else ""
        lines.append(f"| {r['setting']} | {r['method']} | {r['tokens']} | {_f(r['tau'], '.2f')} | {_f(r['alpha'], '.3f')}"
                     f"{accept} | {distinct} | {_f(r['tokens_per_second'], '.1f')} | {_f(r['speedup'], '.2f')} | {same} |")
        if r.get("error"):
            notes[r["method"]] = r["error"]
    lines += [f"\n{method}: {error}" for method, error in notes.items()]
    return lines


def step_cost_tables(result: dict) -> list[str]:
    costs = result.get("step_costs")
    if costs is None:
        return []
    lines = ["", "## Step costs in sgl.Engine (measured, dummy weights)", "",
             f"{costs['note']}", "",
             ("| shape | method | context | batch | greedy ms/step | greedy tau | greedy ms/token "
              f"({engine_bench.GREEDY_BOUND}) | sampled ms/step | sampled tau "
              f"| sampled ms/token ({engine_bench.SAMPLED_BOUND}) | request ms (sampled) |"),
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in costs["measured"]:
        if "error" in r:
            lines.append(f"| {r['shape']} | {r['method']} | failed: {r['error']} | | | | | | | | |")
            continue
        lines.append(f"| {r['shape']} | {r['method']} | {r['context']} | {r['batch']} "
                     f"| {_f(r.get('greedy_ms_per_step'), '.2f')} | {_f(r.get('greedy_tau'), '.2f')} "
                     f"| {_f(r.get('greedy_ms_per_token'), '.3f')} | {_f(r.get('sampled_ms_per_step'), '.2f')} "
                     f"| {_f(r.get('sampled_tau'), '.2f')} | {_f(r.get('sampled_ms_per_token'), '.3f')} "
                     f"| {_f(r.get('sampled_request_ms'), '.1f')} |")
    lines += ["", "## Projected ms/token (measured step cost / proxy tau)", "",
              f"*Projected*, not measured: {costs['projection_note']}", "",
              ("| shape | method | context | batch | setting | proxy tau | step ms (measured) | ms/token (projected) "
               "| speedup over plain (projected) |"),
              "|---|---|---|---|---|---|---|---|---|"]
    for r in costs["projected"]:
        lines.append(f"| {r['shape']} | {r['method']} | {r['context']} | {r['batch']} | {r['setting']} "
                     f"| {r['proxy_tau']:.2f} | {r['step_ms']:.2f} | {r['projected_ms_per_token']:.3f} "
                     f"| {_f(r['projected_speedup'], '.2f')} |")
    return lines


def markdown(result: dict) -> str:
    lines = [f"# sgl-longgen bench: {result['model']}", ""]
    if result.get("command"):
        lines += [f"`{result['command']}`", ""]
    lines += [intro(result), "", "## Acceptance (measured on the proxy)", "", *acceptance_table(result["acceptance"])]
    lines += step_cost_tables(result)
    proj = result.get("projection")
    if proj is None:
        if result.get("engine") == "sglang":
            if result.get("step_costs") is None:
                lines += ["", "No step costs: give --step-costs (a GPU host)."]
        else:
            lines += ["", "No GPU projection: give --gpu-report (a python -m sgl_longgen.bench.gpu_check JSON report)."]
        return "\n".join(lines) + "\n"
    plain = ", ".join(f"{_f(p['plain_ms_per_token'], '.2f')} ms/token at {p['context']}" for p in proj["plain"])
    lines += ["", "## GPU projection", "",
              f"From `{result['gpu_report']}`. Plain decoding (measured): {plain}.", "",
              f"*Projected* rows: {proj['note']}", "",
              "| run | context | figure | setting | tau | step wall ms | ms/token | speedup |",
              "|---|---|---|---|---|---|---|---|"]
    if not proj["measured_dummy"]:
        lines.append("| (the report holds no speculative runs: gpu_check --phase spec) | | | | | | | |")
    for m in proj["measured_dummy"]:
        for p in proj["projected"]:
            if p["run"] == m["run"] and p["context"] == m["context"]:
                lines.append(f"| {p['label']} | {p['context']} | projected | {p['setting']} | {p['proxy_tau']:.2f} "
                             f"| {_f(p['step_wall_ms'], '.2f')} | {_f(p['projected_ms_per_token'], '.3f')} "
                             f"| {_f(p['projected_speedup'], '.2f')} |")
        lines.append(f"| {m['label']} | {m['context']} | {MEASURED_DUMMY} | greedy | {_f(m['measured_dummy_tau'], '.2f')} "
                     f"| {_f(m['step_wall_ms'], '.2f')} | {_f(m['measured_dummy_ms_per_token'], '.3f')} "
                     f"| {_f(m['measured_dummy_speedup'], '.2f')} |")
    for tag, err in proj["errors"].items():
        lines.append(f"\n{tag}: {err}")
    return "\n".join(lines) + "\n"


def _bars(ax, groups: list[str], series: dict[str, list[float | None]], colors: dict[str, str],
          hatches: dict[str, str] | None = None, notes: dict[str, list[str | None]] | None = None) -> None:
    """Grouped bars: one group per x label, one bar per series (None: no bar), values written on top."""
    n = max(len(series), 1)
    width = 0.8 / n
    top = max((v for values in series.values() for v in values if v is not None), default=1.0)
    for i, (name, values) in enumerate(series.items()):
        at = [g for g, v in enumerate(values) if v is not None]
        if not at:
            continue
        bars = ax.bar([g + (i - (n - 1) / 2) * width for g in at], [values[g] for g in at], width, label=name,
                      color=colors[name], edgecolor="black", linewidth=0.4)
        for bar, g in zip(bars, at):
            if hatches:
                bar.set_hatch(hatches.get(groups[g], ""))
        extra = (notes or {}).get(name)
        labels = [f"{values[g]:.2f}" + (f"\n{extra[g]}" if extra and extra[g] else "") for g in at]
        ax.bar_label(bars, labels=labels, fontsize=7, padding=1)
    ax.set_ylim(0, top * 1.22)
    ax.set_xticks(range(len(groups)), groups, fontsize=8)


def step_cost_panels(axes, panels: list[tuple[str, int]], costs: list[dict], settings: list[str],
                     colors: dict[str, str]) -> None:
    """Projected ms/token against context, one panel per (shape, batch): a line per method and
    setting (solid: the first greedy setting, dashed: the first sampled one), plain decoding's
    measured ms/token in black."""
    firsts = (next((s for s in settings if s.startswith(kind)), None) for kind in ("greedy", "sampled"))
    shown = [s for s in firsts if s is not None]
    for ax, (shape, batch) in zip(axes, panels):
        cells = [c for c in costs if c["shape"] == shape and c["batch"] == batch]
        for method in dict.fromkeys(c["method"] for c in cells):
            for setting in dict.fromkeys(shown):
                pts = sorted((c["context"], c["projected_ms_per_token"]) for c in cells
                             if c["method"] == method and c["setting"] == setting)
                if not pts:
                    continue
                plain = method == eval_cmd.BASELINE
                ax.plot([x for x, _ in pts], [y for _, y in pts], marker="o",
                        color="black" if plain else colors[method],
                        linestyle="--" if setting.startswith("sampled") and not plain else "-",
                        label="plain decoding (measured)" if plain else f"{method}, {setting}")
                if plain:
                    break  # one line: plain decoding's ms/token does not depend on tau
        ax.set_xscale("log", base=2)
        ax.set_xlabel("context (tokens)")
        ax.set_ylabel("ms / token (lower is better)")
        ax.set_title(f"{shape}, batch {batch}: projected ms/token = measured ms/step (dummy weights) / proxy tau",
                     fontsize=9)
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["acceptance"]
    settings = list(dict.fromkeys(r["setting"] for r in rows))
    spec_methods = [m for m in dict.fromkeys(r["method"] for r in rows) if m != eval_cmd.BASELINE] or [eval_cmd.BASELINE]
    proj = result.get("projection")
    contexts = list(dict.fromkeys(m["context"] for m in proj["measured_dummy"])) if proj else []
    costs = (result.get("step_costs") or {}).get("projected") or []
    panels = list(dict.fromkeys((c["shape"], c["batch"]) for c in costs))
    size = (max(10.0, 2.2 * (len(settings) + 1) + 2.5), 4.2 * (1 + len(contexts) + len(panels)))
    fig, axes = plt.subplots(1 + len(contexts) + len(panels), 1, figsize=size, squeeze=False)
    names = list(dict.fromkeys(spec_methods + ([m["label"] for m in proj["measured_dummy"]] if proj else [])
                               + [c["method"] for c in costs]))
    colors = {name: f"C{i % 10}" for i, name in enumerate(names)}  # one colour per method in every panel
    legend = dict(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    ax = axes[0][0]
    tau = {(r["method"], r["setting"]): r["tau"] for r in rows}
    _bars(ax, [s.replace(" min_p", "\nmin_p") for s in settings],
          {m: [tau.get((m, s)) for s in settings] for m in spec_methods}, colors)
    ax.axhline(1.0, color="gray", linestyle="--", linewidth=1, label="plain decoding (tau = 1)")
    ax.set_ylabel("tau (tokens / target forward)")
    where = "sgl.Engine" if result.get("engine") == "sglang" else "reference runtime"
    ax.set_title(f"measured on the proxy ({result['model']}, {where}, "
                 f"{len(result['prompts'])} prompt(s) x {result['max_new_tokens']} tokens): tau per method and setting",
                 fontsize=9)
    ax.legend(**legend)
    if panels:
        step_cost_panels([a[0] for a in axes[1 + len(contexts):]], panels, costs, settings, colors)
    if proj:
        measured_group = "measured, dummy weights:\nrepetitive greedy\n(upper bound)"
        for ax, context in zip((a[0] for a in axes[1:]), contexts):
            runs = [m for m in proj["measured_dummy"] if m["context"] == context]
            groups = [f"projected\n{s.replace(' min_p', chr(10) + 'min_p')}" for s in settings] + [measured_group]
            series, notes = {}, {}
            for m in runs:
                cells = {p["setting"]: p for p in proj["projected"] if p["run"] == m["run"] and p["context"] == context}
                series[m["label"]] = ([cells[s]["projected_ms_per_token"] if s in cells else None for s in settings]
                                      + [m["measured_dummy_ms_per_token"]])
                speedups = [cells[s]["projected_speedup"] if s in cells else None for s in settings]
                notes[m["label"]] = [None if x is None else f"{x:.2f}x" for x in speedups + [m["measured_dummy_speedup"]]]
            _bars(ax, groups, series, colors, hatches={measured_group: "//"}, notes=notes)
            plain_ms = next((p["plain_ms_per_token"] for p in proj["plain"] if str(p["context"]) == str(context)), None)
            if plain_ms is not None:
                ax.axhline(plain_ms, color="black", linestyle="--", linewidth=1,
                           label=f"plain decoding, measured ({plain_ms:.2f} ms/token)")
                ax.set_ylim(0, max(ax.get_ylim()[1], plain_ms * 1.15))
            ax.set_ylabel("ms / token (lower is better)")
            ax.set_title(f"context {context}: projected ms/token = GPU step wall / proxy tau (speedup over plain "
                         "decoding below each value), next to the GPU check's measured dummy-weight figures", fontsize=9)
            ax.legend(**legend)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def command_line(args: argparse.Namespace) -> str:
    """The invocation, from the parsed arguments (flags left at their defaults omitted)."""
    parser = getattr(args, "bench_parser", None)
    words = ["sgl-longgen", "bench"]
    for action in (parser._actions if parser is not None else []):
        if not action.option_strings or action.dest in ("help", "resume"):
            continue
        value = getattr(args, action.dest, None)
        if value is None or value == action.default or value is False:
            continue
        words.append(action.option_strings[-1] if action.option_strings[-1].startswith("--") else action.option_strings[0])
        if value is not True:
            words += [str(v) for v in value] if isinstance(value, (list, tuple)) else [str(value)]
    return shlex.join(words)


def check_args(args: argparse.Namespace) -> list[str]:
    """Every input check, before any work (a typo fails in the first second); returns the methods."""
    sglang = args.engine == "sglang"
    methods = check_methods(args.methods, list(engine_bench.ALGORITHMS) if sglang else None)
    if args.max_new_tokens < 1:
        raise LonggenError(f"--max-new-tokens must be at least 1, got {args.max_new_tokens}")
    if args.decodings and "sampled" in args.decodings and args.temperature <= 0:
        raise LonggenError(f"--temperature of the sampled setting must be > 0, got {args.temperature}")
    if not (args.prompts or args.prompt_file) and not 1 <= args.num_prompts <= len(HELD_OUT_PROMPTS):
        raise LonggenError(f"--num-prompts: 1 to {len(HELD_OUT_PROMPTS)} built-in prompts, got {args.num_prompts}")
    if args.config is not None:
        load_toml(args.config)  # a missing or broken config file fails here, before any work
    if args.prompt_file is not None and not args.prompt_file.is_file():
        raise LonggenError(f"prompt file not found: {args.prompt_file}")
    bad = [t for t in args.penalties if t < 1.0]
    if bad:
        raise LonggenError(f"--penalties: theta must be >= 1.0 (1.0 = off), got {bad[0]}")
    if args.tie_tolerance < 0:
        raise LonggenError(f"--tie-tolerance must be >= 0 nats, got {args.tie_tolerance}")
    if not sglang:
        if args.tie_tolerance:
            raise LonggenError("--tie-tolerance is for --engine sglang (GPU kernels); the reference runtime verifies "
                               "with the arithmetic it decodes with, so its greedy outputs must match exactly")
        if args.resume:
            raise LonggenError("--resume continues an --engine sglang run (the reference runtime's bench is quick)")
        if args.step_costs:
            raise LonggenError("--step-costs measures each method inside sgl.Engine: add --engine sglang")
        return methods
    if args.config is not None:
        raise LonggenError(f"--config {args.config}: with --engine sglang each engine reads its draft directory's "
                           "longgen.toml (--heads, --drafter, --longspec-drafter); --config is the reference runtime's")
    if args.dtype == "float64":
        raise LonggenError("--dtype float64 is the reference runtime's; SGLang's engine runs float32 or bfloat16")
    if args.step_costs:
        if not engine_bench.cuda_available():
            raise LonggenError("--step-costs needs a CUDA GPU (8B-class shapes in sgl.Engine); this machine has "
                               "none: run it on a GPU host, or leave --step-costs out for the acceptance part")
        engine_bench.parse_shapes(args.shapes or ["llama8b", "qwen7b"])
        for flag, values, low in (("--contexts", args.contexts, 16), ("--batches", args.batches, 1),
                                  ("--step-tokens", [args.step_tokens], 4)):
            if any(v < low for v in values):
                raise LonggenError(f"{flag}: at least {low}, got {min(values)}")
        if args.step_tokens >= engine_bench.LONG_REQUEST_CAP:
            raise LonggenError(f"--step-tokens: below {engine_bench.LONG_REQUEST_CAP} (the engines' headroom for new "
                               f"tokens beyond the longest context), got {args.step_tokens}")
    return methods


def save(args: argparse.Namespace, result: dict, final: bool = False) -> str:
    """bench.json (after every method too: a later engine that kills the process keeps the
    earlier rows); at the end also bench.md and bench.png."""
    result = _clean(result)
    (args.out / "bench.json").write_text(json.dumps(result, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    if not final:
        return ""
    md = markdown(result)
    (args.out / "bench.md").write_text(md, encoding="utf-8")
    plot(result, args.out / "bench.png")
    return md


def engine_prompts(args: argparse.Namespace, model_dir: Path, directory: Path) -> tuple[list[dict], list[dict]]:
    """The prompts as token ids (the model's tokenizer), and their ids and texts for the report."""
    from ..runtime.tokenizer import Tokenizer

    path, items = write_prompts(args, directory)
    tokenizer = Tokenizer.from_dir(model_dir) if (model_dir / "tokenizer.json").is_file() else None
    prompts = read_prompts(argparse.Namespace(prompt=None, prompt_file=path), tokenizer)
    if not items:
        items = [{"id": p["id"], "prompt": p.get("prompt"), "prompt_file": str(path)} for p in prompts]
    return prompts, items


def engine_settings(args: argparse.Namespace, model_dir: Path) -> dict[str, Any]:
    """The runtime's effective settings for these flags (penalty window, ignore_eos, seed), so that
    both engines run the same requests."""
    ns = _eval_parser().parse_args(eval_argv(args, [eval_cmd.BASELINE], "greedy", None, None, Path("unused")))
    config, _ = resolve_config(ns, model_dir, method=eval_cmd.BASELINE)
    return {"penalty_window": config.sampling.penalty_window, "ignore_eos": config.ignore_eos, "seed": config.seed}


def engine_drafts(args: argparse.Namespace, model_dir: Path) -> dict[str, Path | None]:
    """Each speculative method's draft directory (``--heads``, ``--drafter``, ``--longspec-drafter``, else the model's)."""
    from ..runtime import DRAFT_FIELD

    dirs = args_draft_dirs(args, model_dir)
    return {method: dirs[field] for method, field in DRAFT_FIELD.items()}


def previous_run(args: argparse.Namespace, methods: list[str]) -> dict:
    """``--resume``: what the stopped run of the same command left in ``--out/bench.json``: its
    acceptance rows when every method has them, and its step-cost rows that measured something."""
    path = args.out / "bench.json"
    if not args.resume or not path.is_file():
        return {}
    try:
        old = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise LonggenError(f"--resume: {path} is not valid JSON ({exc}); remove it to start over") from None
    if old.get("command") != command_line(args):
        raise LonggenError(f"--resume: {path} was written by another command ({old.get('command')!r}); use the same "
                           "flags, or another --out")
    kept: dict[str, Any] = {}
    rows = old.get("acceptance") or []
    if rows and all(any(r["method"] == m and r["setting"] == s for r in rows)
                    for m in methods for s in old.get("settings", [])):
        kept.update(acceptance=rows, records=old.get("records", []))
    measured = [r for r in (old.get("step_costs") or {}).get("measured", []) if "context" in r]
    if measured:
        kept["measured"] = measured
    return kept


def is_tie(row: dict, tolerance: float) -> bool:
    """A greedy difference that starts where plain decoding nearly tied (within ``tolerance`` nats)."""
    gap = row.get("tie_gap")
    return tolerance > 0 and gap is not None and gap <= tolerance


def run_engine(args: argparse.Namespace, methods: list[str], gpu: dict | None) -> tuple[dict, int]:
    """``--engine sglang``: the acceptance part in sgl.Engine, then the step costs when asked."""
    from ..runtime import resolve_model

    previous = previous_run(args, methods)
    model_dir = resolve_model(args.model)
    on_cpu = engine_bench.prepare_engine()
    result: dict[str, Any] = {
        "engine": "sglang", "on_cpu": on_cpu, "command": command_line(args), "model": str(args.model),
        "methods": methods, "adaptive": bool(args.adaptive), "max_new_tokens": args.max_new_tokens,
        "gpu_report": str(args.gpu_report) if gpu is not None else None, "projection": None, "step_costs": None,
    }
    with tempfile.TemporaryDirectory(prefix="longgen_bench_") as tmp:
        prompts, result["prompts"] = engine_prompts(args, model_dir, Path(tmp))
    settings = engine_settings(args, model_dir)
    result["penalty_window"] = settings["penalty_window"]

    def save_rows(rows: list[dict], records: list[dict]) -> None:
        result.update(acceptance=rows, records=records, settings=list(dict.fromkeys(r["setting"] for r in rows)))
        save(args, result)

    if "acceptance" in previous:
        rows, records = previous["acceptance"], previous["records"]
        print(f"== acceptance: kept from the stopped run in {args.out / 'bench.json'}", flush=True)
    else:
        rows, records = engine_bench.run_acceptance(args, methods, prompts, model_dir, engine_drafts(args, model_dir),
                                                    settings, setting_label, eval_cmd.distinct_n,
                                                    eval_cmd.DISTINCT_N, on_cpu, save_rows)
    save_rows(rows, records)
    if gpu is not None:
        result["projection"] = project(gpu, [r for r in rows if r.get("tau")])
    if args.step_costs:
        shapes = engine_bench.parse_shapes(args.shapes or ["llama8b", "qwen7b"])
        costs: dict[str, Any] = {
            "note": (f"ms/step: the wall of a longer request less that of a {1 + args.step_tokens // 4}-token one "
                     "(the prompt already in the radix cache), over the difference of their steps (the batch's "
                     f"spec_verify_ct; plain decoding: per token); the longer one has 1 + {args.step_tokens} "
                     "times the tokens a step of the shorter one committed, so about "
                     f"{args.step_tokens} steps lie between them; under {max(1, args.step_tokens // 4)} no "
                     "figure. request ms: the shorter request's wall less its steps (prefill of the cached "
                     "prompt, per-request set-up). Batch b: b copies of one random prompt. "
                     f"{engine_bench.GREEDY_BOUND}; {engine_bench.SAMPLED_BOUND}."),
            "projection_note": engine_bench.PROJECTED + " (plain decoding: its measured ms/token, tau 1); "
                               "speedup = plain decoding's measured ms/token at that shape, context and batch / "
                               "the projected ms/token.",
            "shapes": list(shapes), "contexts": args.contexts, "batches": args.batches,
            "step_tokens": args.step_tokens, "measured": [], "projected": []}
        result["step_costs"] = costs

        def save_costs(measured: list[dict]) -> None:
            costs.update(measured=measured, projected=engine_bench.project(measured, rows))
            save(args, result)

        save_costs(engine_bench.run_step_costs(args, methods, shapes, save_costs, previous.get("measured", [])))
    mismatch = any(r["identical"] is False and not is_tie(r, args.tie_tolerance) for r in rows)
    failed = any(r.get("error") and not r["error"].startswith("not run:") for r in rows)
    if mismatch:
        print("sgl-longgen: error: a method's greedy output differs from plain decoding", file=sys.stderr)
    return result, 1 if mismatch or failed else 0


def run(args: argparse.Namespace) -> int:
    methods = check_args(args)
    gpu = load_gpu_report(args.gpu_report) if args.gpu_report is not None else None
    args.out.mkdir(parents=True, exist_ok=True)

    if args.engine == "sglang":
        result, code = run_engine(args, methods, gpu)
    else:
        acceptance, records, prompts, code = run_acceptance(args, methods)
        result = {
            "engine": "runtime", "command": command_line(args),
            "model": str(args.model), "methods": methods,
            "adaptive": bool(args.adaptive), "max_new_tokens": args.max_new_tokens,
            "prompts": prompts, "settings": list(dict.fromkeys(r["setting"] for r in acceptance)),
            "acceptance": acceptance, "records": records,
            "gpu_report": str(args.gpu_report) if gpu is not None else None,
            "projection": project(gpu, acceptance) if gpu is not None else None,
        }
    md = save(args, result, final=True)
    print()
    print(md)
    print(f"wrote {args.out / 'bench.json'}, {args.out / 'bench.md'}, {args.out / 'bench.png'}", file=sys.stderr)
    return code
