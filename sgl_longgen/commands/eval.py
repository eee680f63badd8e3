"""``sgl-longgen eval``: methods side by side with plain decoding on the same prompts.

For every contextual-penalty setting and method it reports tau (tokens per target forward),
alpha (accepted drafts / drafted depth, TokenSwift Eq. 4), the share of steps won by an n-gram
path, HOWL's share of linear (suffix) steps, Distinct-1..4 of the output tokens, tokens/s and the
speedup over plain decoding; under greedy decoding it also checks that each method's output is
token-identical to plain decoding's.
Methods are the ones ``generate`` knows (``GenerateConfig.method``), so a new method shows up
here by name as soon as ``build_decoder`` can build it.
"""

from __future__ import annotations

import argparse
import json
import sys
import typing
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ..config import GenerateConfig
from ..errors import LonggenError
from ..runtime import build_decoder, load_model, resolve_model
from .generate import add_model_args, add_sampling_args, read_prompts, resolve_config
from .progress import TokenProgress

BASELINE = "ar"
DISTINCT_N = (1, 2, 3, 4)


def method_names() -> list[str]:
    """Every decoding method the config accepts (the ``method`` field's literal values)."""
    return list(typing.get_args(typing.get_type_hints(GenerateConfig)["method"]))


def distinct_n(tokens: list[int], n: int) -> float:
    """Unique n-grams / total n-grams of one output (0 when it is shorter than n)."""
    total = len(tokens) - n + 1
    if total <= 0:
        return 0.0
    return len({tuple(tokens[i : i + n]) for i in range(total)}) / total


@dataclass
class Row:
    """One (penalty, method) cell of the table, aggregated over the prompts."""

    penalty: float
    method: str
    prompts: int = 0
    tokens: int = 0
    steps: int = 0
    accepted: int = 0
    drafted: int = 0
    ngram_steps: int = 0
    linear_steps: int = 0  # HOWL: steps that verified a linear suffix draft
    committed: int = 0  # tokens committed by decode steps (tau's numerator)
    decode_seconds: float = 0.0
    distinct: list[float] = field(default_factory=lambda: [0.0] * len(DISTINCT_N))
    identical: bool | None = None  # vs plain decoding; None when not checked (sampling)
    errors: int = 0

    def add(self, result, same_as_baseline: bool | None) -> None:
        self.prompts += 1
        self.tokens += result.num_new_tokens
        s = result.stats
        self.steps += s.steps
        self.accepted += s.accepted
        self.drafted += s.drafted
        self.ngram_steps += s.ngram_steps
        self.linear_steps += s.linear_steps
        self.committed += round(result.accept_length * s.steps)
        self.decode_seconds += result.decode_seconds
        for i, n in enumerate(DISTINCT_N):
            self.distinct[i] += distinct_n(result.output_ids, n)
        if same_as_baseline is not None:
            self.identical = same_as_baseline and self.identical is not False
        self.errors += result.error is not None

    @property
    def tau(self) -> float:
        return self.committed / self.steps if self.steps else 1.0

    @property
    def alpha(self) -> float | None:
        return self.accepted / self.drafted if self.drafted else None

    @property
    def ngram_share(self) -> float | None:
        return self.ngram_steps / self.steps if self.method != BASELINE and self.steps else None

    @property
    def linear_share(self) -> float | None:
        return self.linear_steps / self.steps if self.method == "howl" and self.steps else None

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.decode_seconds if self.decode_seconds else 0.0

    def distinct_mean(self) -> list[float]:
        return [d / self.prompts if self.prompts else 0.0 for d in self.distinct]

    def report(self, baseline: "Row | None") -> dict:
        speedup = (self.tokens_per_second / baseline.tokens_per_second
                   if baseline is not None and baseline.tokens_per_second else None)
        out = {k: v for k, v in asdict(self).items() if k != "distinct"}
        out.update(tau=self.tau, alpha=self.alpha, ngram_share=self.ngram_share, linear_share=self.linear_share,
                   tokens_per_second=self.tokens_per_second, speedup=speedup,
                   **{f"distinct_{n}": d for n, d in zip(DISTINCT_N, self.distinct_mean())})
        return out


def add_parser(sub) -> None:
    p = sub.add_parser("eval", help="compare methods with plain decoding: tau, alpha, n-gram share, Distinct-n, tokens/s")
    add_model_args(p)
    p.add_argument("--method", action="append", choices=method_names(),
                   help=f"method to compare with {BASELINE} (repeatable; default: tokenswift); {BASELINE} always runs")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--prompt", help="prompt text")
    src.add_argument("--prompt-file", type=Path, help="a text file (one prompt) or JSONL ({'id', 'prompt'|'input_ids'})")
    p.add_argument("--max-new-tokens", type=int)
    add_sampling_args(p)
    p.add_argument("--penalties", type=float, nargs="+", metavar="THETA",
                   help="run everything once per contextual penalty theta (e.g. 1.0 1.2); overrides --penalty")
    p.add_argument("--out", type=Path, help="JSON report (rows and per-prompt records)")
    p.set_defaults(run=run)


def _settings(args: argparse.Namespace) -> list[float | None]:
    if args.penalties:
        bad = [t for t in args.penalties if t < 1.0]
        if bad:
            raise LonggenError(f"--penalties: theta must be >= 1.0 (1.0 = off), got {bad[0]}")
        return list(dict.fromkeys(args.penalties))
    return [args.penalty]


def run(args: argparse.Namespace) -> int:
    methods = [BASELINE] + [m for m in dict.fromkeys(args.method or ["tokenswift"]) if m != BASELINE]
    model_dir = resolve_model(args.model)
    loaded = None
    rows: list[Row] = []
    records: list[dict] = []
    failed = 0
    greedy = True
    for theta in _settings(args):
        setting = argparse.Namespace(**{**vars(args), "penalty": theta})
        baseline_outputs: dict[str, list[int]] = {}
        for method in methods:
            config, dirs = resolve_config(setting, model_dir, method=method)
            if loaded is None:
                loaded = load_model(model_dir, config.runtime.dtype, config.runtime.device)
                if config.runtime.threads:
                    import torch

                    torch.set_num_threads(config.runtime.threads)
                prompts = read_prompts(args, loaded.tokenizer)
            greedy = config.sampling.greedy
            decoder = build_decoder(loaded, config, dirs["heads"], dirs["drafter"], dirs["longspec_drafter"])
            row = Row(penalty=config.sampling.penalty, method=method)
            for item in prompts:
                with TokenProgress(config.max_new_tokens, desc=f"theta={row.penalty:g} {method} {item['id']}") as bar:
                    result = decoder.generate(item["input_ids"], config.max_new_tokens, bar.update)
                same = None
                if method == BASELINE:
                    baseline_outputs[item["id"]] = result.output_ids
                elif greedy:
                    same = result.output_ids == baseline_outputs.get(item["id"])
                row.add(result, same)
                if result.error:
                    failed += 1
                    print(f"sgl-longgen: error: {method} on {item['id']} stopped after {result.num_new_tokens} "
                          f"tokens ({result.error})", file=sys.stderr)
                records.append({"id": item["id"], "penalty": row.penalty, "method": method, **result.record(),
                                "distinct": [distinct_n(result.output_ids, n) for n in DISTINCT_N],
                                "text": loaded.tokenizer.decode(result.output_ids) if loaded.tokenizer else None})
            rows.append(row)

    reports = []
    for row in rows:
        baseline = next(r for r in rows if r.penalty == row.penalty and r.method == BASELINE)
        reports.append(row.report(baseline))
    print_table(args.model, config, len(prompts), reports, greedy)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({
            "model": str(args.model), "max_new_tokens": config.max_new_tokens, "temperature": config.sampling.temperature,
            "penalty_window": config.sampling.penalty_window, "rows": reports, "records": records,
        }, indent=2) + "\n")
    mismatch = any(r["identical"] is False for r in reports)
    if mismatch:
        print("sgl-longgen: error: a method's greedy output differs from plain decoding", file=sys.stderr)
    return 1 if failed or mismatch else 0


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def print_table(model: str, config, n_prompts: int, reports: list[dict], greedy: bool) -> None:
    s = config.sampling
    print(f"model: {model}  prompts: {n_prompts}  max new tokens: {config.max_new_tokens}  "
          f"temperature: {s.temperature:g}  penalty window: {s.penalty_window}")
    header = (f"{'theta':>6} {'method':<12}{'tokens':>8}{'tau':>7}{'alpha':>7}{'ngram':>7}{'linear':>7}"
              f"{'D-1':>7}{'D-2':>7}{'D-3':>7}{'D-4':>7}{'tok/s':>9}{'speedup':>9}  same-as-ar")
    print(header)
    for r in reports:
        same = "-"
        if greedy and r["method"] != BASELINE and r["identical"] is not None:
            same = "yes" if r["identical"] else "NO"
        speedup = "-" if r["speedup"] is None else f"{r['speedup']:.2f}x"
        distinct = "".join(f"{r[f'distinct_{n}']:>7.3f}" for n in DISTINCT_N)
        print(f"{r['penalty']:>6.2f} {r['method']:<12}{r['tokens']:>8}{r['tau']:>7.2f}{_fmt(r['alpha'], '.3f'):>7}"
              f"{_fmt(r['ngram_share'], '.3f'):>7}{_fmt(r['linear_share'], '.3f'):>7}{distinct}{r['tokens_per_second']:>9.1f}{speedup:>9}  {same}")
