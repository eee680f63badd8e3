"""100K-token generations as batch jobs on a GPU host, and their report.

``prepare`` writes what ``sgl-longgen batch run`` needs for a dummy-weights 8B-class model (the
model directory, random draft checkpoints, one prompt of token ids) and one job file per method
over the same prompt: ``plain.toml`` (plain decoding, the first ``--reference-tokens`` tokens: the
greedy oracle) and ``<method>.toml`` for each of ``--methods`` (the whole ``--new-tokens``
generation, checkpointing every ``--checkpoint-every`` tokens). They are ordinary job files: a
device call's time limit stops the driver, and the next ``batch run`` of the same file resumes
from the checkpoint.

``report`` reads every job's record and writes ``long_run.json``, ``long_run.md`` and
``long_run.png``: tokens, wall time, tau, resumed tokens, each method's greedy identity with the
plain job over its length, and ms/token against position (from the records' ``timeline``) next
to plain decoding's measured ms/token at fixed contexts (``--plain-costs``: the ``bench.json`` of
``sgl-longgen bench --engine sglang --step-costs``, or ``CONTEXT=MS`` pairs).

    python -m sgl_longgen.bench.long_run prepare --dir /tmp/long --methods tokenswift howl
    sgl-longgen batch run /tmp/long/plain.toml && sgl-longgen batch run /tmp/long/howl.toml  # ...
    python -m sgl_longgen.bench.long_run report --dir /tmp/long --plain-costs bench/bench.json

Dummy weights loop under greedy decoding, so a method's acceptance here is an upper bound, not
evidence of speed on real text; the step costs are real.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
from pathlib import Path
from typing import Any

from ..config import SPECULATIVE_ALGORITHMS
from ..errors import LonggenError
from .engine_bench import first_difference

PLAIN = "plain"


def job_text(name: str, method: str, new_tokens: int, checkpoint_every: int, context: int,
             drafts: dict[str, str]) -> str:
    """A job file; ``drafts``: job field (``heads``, ``drafter``, ``longspec_drafter``) -> directory."""
    kwargs = {"load_format": "dummy", "context_length": context, "mem_fraction_static": 0.85,
              "chunked_prefill_size": 16384, "cuda_graph_bs_decode": [1], "cuda_graph_backend_prefill": "disabled",
              "log_level": "warning"}
    lines = [f'name = "{name}"', 'model = "model"', *(f'{k} = "{v}"' for k, v in drafts.items()),
             'runtime = "sglang"', 'input = "prompts.jsonl"', f'output_dir = "out-{name}"', f'method = "{method}"',
             f"max_new_tokens = {new_tokens}", "seed = 0", "ignore_eos = true",
             f"checkpoint_every = {checkpoint_every}", "", "[engines]", "count = 1", "cpus = 4",
             "max_concurrent_requests = 1", "", "[sampling]", "temperature = 0.0", "", "[sglang.engine_kwargs]"]
    lines += [f"{k} = {json.dumps(v)}" for k, v in kwargs.items()]
    return "\n".join(lines) + "\n"


def make_drafts(root: Path, methods: list[str], config: dict, partial_kv_budget: int) -> tuple[Path, dict[str, Path]]:
    """The dummy model and the random draft checkpoints ``methods`` need, by job field."""
    from .gpu_check import make_checkpoints, make_longspec_drafter, make_owl_drafter

    model, heads = make_checkpoints(root, partial_kv_budget, config=config, name="model")
    drafts = {"heads": heads}
    if {"owl", "howl"} & set(methods):
        drafts["drafter"] = make_owl_drafter(root, 1024, 32768, config=config)
    if "longspec" in methods:
        drafts["longspec_drafter"] = make_longspec_drafter(root, config)
    return model, drafts


def prepare(args: argparse.Namespace) -> None:
    from ..runtime import DRAFT_FIELD
    from .gpu_check import SHAPES

    root = Path(args.dir)
    root.mkdir(parents=True, exist_ok=True)
    if args.shape not in SHAPES:
        raise LonggenError(f"--shape: unknown shape {args.shape!r} (known: {', '.join(SHAPES)})")
    config = SHAPES[args.shape]
    model, drafts = make_drafts(root, args.methods, config, args.partial_kv_budget)
    rng = random.Random(args.seed)
    prompt = [rng.randrange(1000, config["vocab_size"] - 1000) for _ in range(args.prompt_tokens)]
    (root / "prompts.jsonl").write_text(json.dumps({"id": "long-0", "input_ids": prompt}) + "\n")
    context = args.prompt_tokens + args.new_tokens + 1024
    jobs = [(PLAIN, "ar", args.reference_tokens, {})]
    jobs += [(m, m, args.new_tokens, {DRAFT_FIELD[m]: str(drafts[DRAFT_FIELD[m]].relative_to(root))})
             for m in args.methods]
    for name, method, n, job_drafts in jobs:
        (root / f"{name}.toml").write_text(job_text(name, method, n, args.checkpoint_every, context, job_drafts))
    print(f"wrote {model}, {', '.join(str(d) for d in drafts.values())}, prompts.jsonl, "
          f"{', '.join(name + '.toml' for name, *_ in jobs)} under {root}")


# -- report ------------------------------------------------------------------------------------------


def read_record(out_dir: Path) -> dict | None:
    path = out_dir / "records.jsonl"
    if not path.is_file():
        return None
    lines = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return lines[0] if lines else None


def rates(timeline: list[list[float]], bin_tokens: int) -> list[dict]:
    """ms/token per ``bin_tokens`` of position, from the marks ``[start, tokens, seconds, steps]``:
    within one stretch of decoding, the seconds and tokens between consecutive marks; the first
    mark of a stretch starts it (its prefill is not decode time). tau only where both marks know
    their steps (a speculative stretch's are known at its end only)."""
    bins: dict[int, list[float]] = {}
    prev: list[float] | None = None
    for mark in timeline:
        start, tokens, seconds, steps = mark
        if prev is not None and prev[0] == start and tokens > prev[1]:
            dt, dn, ds = seconds - prev[2], tokens - prev[1], steps - prev[3]
            b = int((start + (tokens + prev[1]) / 2) // bin_tokens)  # the interval's middle
            acc = bins.setdefault(b, [0.0, 0.0, 0.0, 0.0])
            acc[0] += dt
            acc[1] += dn
            if steps > 0 and prev[3] > 0:  # steps known at both ends (see Segment.steps)
                acc[2] += ds
                acc[3] += dn
        prev = mark
    return [{"position": (b + 0.5) * bin_tokens, "ms_per_token": 1e3 * t / n, "tau": k / s if s else None}
            for b, (t, n, s, k) in sorted(bins.items()) if n]


def plain_costs(values: list[str], shape: str) -> dict[int, float]:
    """Plain decoding's measured ms/token by context: a bench.json (its plain step-cost rows of
    ``shape`` at batch 1) or ``CONTEXT=MS`` pairs."""
    out: dict[int, float] = {}
    for v in values:
        if "=" in v:
            c, ms = v.split("=", 1)
            out[int(c)] = float(ms)
            continue
        path = Path(v)
        if not path.is_file():
            raise LonggenError(f"--plain-costs: {v} is neither CONTEXT=MS nor a bench.json file")
        for row in (json.loads(path.read_text()).get("step_costs") or {}).get("measured", []):
            if row.get("method") == "ar" and row.get("shape") == shape and row.get("batch") == 1 \
                    and row.get("greedy_ms_per_token"):
                out[int(row["context"])] = float(row["greedy_ms_per_token"])
    return dict(sorted(out.items()))


def summary(rec: dict) -> dict[str, Any]:
    segs = rec.get("segments", [])
    return {"num_new_tokens": rec["num_new_tokens"], "finish_reason": rec["finish_reason"],
            "decode_seconds": round(rec["decode_seconds"], 1), "prefill_seconds": round(rec["prefill_seconds"], 1),
            "tokens_per_second": round(rec["tokens_per_second"], 1), "accept_length": round(rec["accept_length"], 3),
            "resumed_tokens": rec["resumed_tokens"], "attempts": rec["attempts"], "stretches": len(segs),
            "stretch_starts": [s["start"] for s in segs]}


def job_names(root: Path) -> list[str]:
    """The method jobs with a record in ``root`` (``out-<method>/records.jsonl``), in a fixed order."""
    return [m for m in SPECULATIVE_ALGORITHMS if (root / f"out-{m}" / "records.jsonl").is_file()]


def report(args: argparse.Namespace) -> dict:
    root = Path(args.dir)
    out = Path(args.out) if args.out else root
    out.mkdir(parents=True, exist_ok=True)
    methods = args.methods or job_names(root)
    recs = {name: read_record(root / f"out-{name}") for name in methods}
    missing = [name for name, rec in recs.items() if rec is None]
    if missing or not methods:
        where = ", ".join(str(root / f"out-{m}") for m in missing) or f"{root}/out-<method>"
        raise LonggenError(f"no record in {where}: the job has not finished (rerun it to resume)")
    plain = read_record(root / f"out-{PLAIN}")
    result: dict[str, Any] = {"jobs": {name: summary(rec) for name, rec in recs.items()},
                              PLAIN: summary(plain) if plain else None,
                              "greedy_identity": {}, "ms_per_token_by_position": {}}
    for name, rec in recs.items():
        if plain:
            n = len(plain["output_ids"])
            a, b = rec["output_ids"][:n], plain["output_ids"]
            result["greedy_identity"][name] = {"tokens": n, "identical": a == b, "first_difference": first_difference(a, b)}
        result["ms_per_token_by_position"][name] = rates(rec.get("timeline", []), args.bin_tokens)
    if plain and args.plain_identity_only:  # its times are another machine's: not drawn next to this one's
        result[PLAIN].update(decode_seconds=None, tokens_per_second=None, timed_elsewhere=True)
    elif plain:
        result["plain_ms_per_token_by_position"] = rates(plain.get("timeline", []), args.bin_tokens)
    result["plain_ms_per_token_at_context"] = plain_costs(args.plain_costs or [], args.shape)
    (out / "long_run.json").write_text(json.dumps(result, indent=1))
    (out / "long_run.md").write_text(markdown(result))
    plot(result, out / "long_run.png")
    print(markdown(result))
    return result


def markdown(r: dict) -> str:
    lines = ["| job | new tokens | finish | decode s | tokens/s | tau | resumed tokens | stretches |",
             "|---|---|---|---|---|---|---|---|"]
    for name, s in [*r["jobs"].items(), (PLAIN, r.get(PLAIN))]:
        if s:
            elsewhere = "another host's" if s.get("timed_elsewhere") else None
            lines.append(f"| {name} | {s['num_new_tokens']} | {s['finish_reason']} | "
                         f"{elsewhere or s['decode_seconds']} | {elsewhere or s['tokens_per_second']} | "
                         f"{s['accept_length']} | {s['resumed_tokens']} | {s['stretches']} (starts {s['stretch_starts']}) |")
    for name, g in r["greedy_identity"].items():
        lines += ["", f"{name}: greedy identity with plain decoding over the first {g['tokens']} tokens: "
                      f"{'identical' if g['identical'] else 'differs at ' + str(g['first_difference'])}."]
    by_position = {name: rows for name, rows in r["ms_per_token_by_position"].items() if rows}
    if by_position:
        bins = sorted({row["position"] for rows in by_position.values() for row in rows})
        cells = {name: {row["position"]: row for row in rows} for name, rows in by_position.items()}
        lines += ["", "| position | " + " | ".join(f"{n} ms/token | {n} tau" for n in by_position) + " |",
                  "|---|" + "---|---|" * len(by_position)]
        for pos in bins[::max(1, len(bins) // 12)]:
            row = []
            for name in by_position:
                c = cells[name].get(pos)
                row += [f"{c['ms_per_token']:.3f}" if c else "-", f"{c['tau']:.2f}" if c and c["tau"] else "-"]
            lines.append(f"| {pos:.0f} | " + " | ".join(row) + " |")
        lines.append("")
        for name, rows in by_position.items():
            lines.append(f"{name}: mean over all positions {statistics.fmean(x['ms_per_token'] for x in rows):.3f} "
                         f"ms/token ({r['jobs'][name]['tokens_per_second']} tokens/s over the record's decode time).")
    if r["plain_ms_per_token_at_context"]:
        lines += ["", "| context | plain decoding ms/token (measured) |", "|---|---|"]
        lines += [f"| {c} | {ms:.3f} |" for c, ms in r["plain_ms_per_token_at_context"].items()]
    return "\n".join(lines) + "\n"


def plot(r: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for name, rows in r["ms_per_token_by_position"].items():
        if rows:
            ax.plot([x["position"] for x in rows], [x["ms_per_token"] for x in rows],
                    label=f"{SPECULATIVE_ALGORITHMS[name]} (batch job)")
    if r.get("plain_ms_per_token_by_position"):
        rows = r["plain_ms_per_token_by_position"]
        ax.plot([x["position"] for x in rows], [x["ms_per_token"] for x in rows], label="plain decoding (batch job)")
    costs = r["plain_ms_per_token_at_context"]
    if costs:
        ax.plot(list(costs), list(costs.values()), "o--", label="plain decoding, measured at fixed contexts")
    ax.set_xlabel("position (tokens generated)")
    ax.set_ylabel("ms per token")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend()
    ax.set_title("Long generation, dummy weights (greedy output loops: acceptance is an upper bound)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m sgl_longgen.bench.long_run", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    methods = list(SPECULATIVE_ALGORITHMS)
    a = sub.add_parser("prepare", help="model, draft checkpoints, prompt and the job files")
    a.add_argument("--dir", required=True)
    a.add_argument("--methods", nargs="+", default=["tokenswift", "howl"], choices=methods,
                   help="one 100K-token job per method, beside plain.toml")
    a.add_argument("--shape", default="llama8b")
    a.add_argument("--prompt-tokens", type=int, default=512)
    a.add_argument("--new-tokens", type=int, default=100_000)
    a.add_argument("--reference-tokens", type=int, default=8192)
    a.add_argument("--checkpoint-every", type=int, default=2048)
    a.add_argument("--partial-kv-budget", type=int, default=4096)
    a.add_argument("--seed", type=int, default=0)
    b = sub.add_parser("report", help="summary, greedy identity and ms/token by position")
    b.add_argument("--dir", required=True)
    b.add_argument("--out", help="default: --dir")
    b.add_argument("--methods", nargs="+", choices=methods, help="default: every job with a record")
    b.add_argument("--shape", default="llama8b")
    b.add_argument("--plain-costs", nargs="*", help="bench.json files or CONTEXT=MS pairs")
    b.add_argument("--bin-tokens", type=int, default=2048)
    b.add_argument("--plain-identity-only", action="store_true",
                   help="the plain job's record was made on another host (copied in for the identity check): "
                        "leave its times out of the table and the plot")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        prepare(args) if args.command == "prepare" else report(args)
    except LonggenError as exc:
        print(f"long_run: error: {exc}")
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
