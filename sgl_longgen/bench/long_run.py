"""A 100K-token generation as a batch job on a GPU host, and its report.

``prepare`` writes what ``sgl-longgen batch run`` needs for a dummy-weights 8B-class model (the
model directory, random TokenSwift heads, one prompt of token ids) and two job files over the same
prompt: ``plain.toml`` (plain decoding, the first ``--reference-tokens`` tokens: the greedy oracle)
and ``tokenswift.toml`` (the whole ``--new-tokens`` generation, checkpointing every
``--checkpoint-every`` tokens). Both are ordinary job files: a device call's time limit stops the
driver, and the next ``batch run`` of the same file resumes from the checkpoint.

``report`` reads both jobs' records and writes ``long_run.json``, ``long_run.md`` and
``long_run.png``: tokens, wall time, tau, resumed tokens, greedy identity with the plain job over
its length, and ms/token against position (from the records' ``timeline``) next to plain
decoding's measured ms/token at fixed contexts (``--plain-costs``: the ``bench.json`` of
``sgl-longgen bench --engine sglang --step-costs``, or ``CONTEXT=MS`` pairs).

    python -m sgl_longgen.bench.long_run prepare --dir /tmp/long
    sgl-longgen batch run /tmp/long/plain.toml && sgl-longgen batch run /tmp/long/tokenswift.toml
    python -m sgl_longgen.bench.long_run report --dir /tmp/long --plain-costs bench/bench.json

Dummy weights loop under greedy decoding, so the method's acceptance here is an upper bound, not
evidence of speed on real text; the step costs are real.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
from pathlib import Path
from typing import Any

from ..errors import LonggenError
from .engine_bench import first_difference

JOBS = ("plain", "tokenswift")


def job_text(name: str, method: str, new_tokens: int, checkpoint_every: int, context: int, heads: str) -> str:
    kwargs = {"load_format": "dummy", "context_length": context, "mem_fraction_static": 0.85,
              "chunked_prefill_size": 16384, "cuda_graph_bs_decode": [1], "cuda_graph_backend_prefill": "disabled",
              "log_level": "warning"}
    lines = [f'name = "{name}"', 'model = "model"', f'heads = "{heads}"', 'runtime = "sglang"',
             'input = "prompts.jsonl"', f'output_dir = "out-{name}"', f'method = "{method}"',
             f"max_new_tokens = {new_tokens}", "seed = 0", "ignore_eos = true",
             f"checkpoint_every = {checkpoint_every}", "", "[engines]", "count = 1", "cpus = 4",
             "max_concurrent_requests = 1", "", "[sampling]", "temperature = 0.0", "", "[sglang.engine_kwargs]"]
    lines += [f"{k} = {json.dumps(v)}" for k, v in kwargs.items()]
    return "\n".join(lines) + "\n"


def prepare(args: argparse.Namespace) -> None:
    from .gpu_check import SHAPES, make_checkpoints

    root = Path(args.dir)
    root.mkdir(parents=True, exist_ok=True)
    if args.shape not in SHAPES:
        raise LonggenError(f"--shape: unknown shape {args.shape!r} (known: {', '.join(SHAPES)})")
    config = SHAPES[args.shape]
    model, heads = make_checkpoints(root, args.partial_kv_budget, config=config, name="model")
    rng = random.Random(args.seed)
    prompt = [rng.randrange(1000, config["vocab_size"] - 1000) for _ in range(args.prompt_tokens)]
    (root / "prompts.jsonl").write_text(json.dumps({"id": "long-0", "input_ids": prompt}) + "\n")
    context = args.prompt_tokens + args.new_tokens + 1024
    for name, method, n in (("plain", "ar", args.reference_tokens), ("tokenswift", "tokenswift", args.new_tokens)):
        (root / f"{name}.toml").write_text(job_text(name, method, n, args.checkpoint_every, context,
                                                    str(heads.relative_to(root))))
    print(f"wrote {model}, {heads}, prompts.jsonl, plain.toml, tokenswift.toml under {root}")


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


def report(args: argparse.Namespace) -> dict:
    root = Path(args.dir)
    out = Path(args.out) if args.out else root
    out.mkdir(parents=True, exist_ok=True)
    recs = {name: read_record(root / f"out-{name}") for name in JOBS}
    if recs["tokenswift"] is None:
        raise LonggenError(f"no record in {root / 'out-tokenswift'}: the job has not finished (rerun it to resume)")
    ts, plain = recs["tokenswift"], recs["plain"]
    result: dict[str, Any] = {"tokenswift": summary(ts), "plain": summary(plain) if plain else None}
    if plain:
        n = len(plain["output_ids"])
        a, b = ts["output_ids"][:n], plain["output_ids"]
        result["greedy_identity"] = {"tokens": n, "identical": a == b, "first_difference": first_difference(a, b)}
    result["ms_per_token_by_position"] = rates(ts.get("timeline", []), args.bin_tokens)
    if plain and args.plain_identity_only:  # its times are another machine's: not drawn next to this one's
        result["plain"].update(decode_seconds=None, tokens_per_second=None, timed_elsewhere=True)
    elif plain:
        result["plain_ms_per_token_by_position"] = rates(plain.get("timeline", []), args.bin_tokens)
    result["plain_ms_per_token_at_context"] = plain_costs(args.plain_costs or [], args.shape)
    (out / "long_run.json").write_text(json.dumps(result, indent=1))
    (out / "long_run.md").write_text(markdown(result))
    plot(result, out / "long_run.png")
    print(markdown(result))
    return result


def markdown(r: dict) -> str:
    t = r["tokenswift"]
    lines = ["| job | new tokens | finish | decode s | tokens/s | tau | resumed tokens | stretches |",
             "|---|---|---|---|---|---|---|---|"]
    for name in JOBS:
        s = r.get(name)
        if s:
            elsewhere = "another host's" if s.get("timed_elsewhere") else None
            lines.append(f"| {name} | {s['num_new_tokens']} | {s['finish_reason']} | "
                         f"{elsewhere or s['decode_seconds']} | {elsewhere or s['tokens_per_second']} | "
                         f"{s['accept_length']} | {s['resumed_tokens']} | {s['stretches']} (starts {s['stretch_starts']}) |")
    g = r.get("greedy_identity")
    if g:
        lines += ["", f"Greedy identity with plain decoding over the first {g['tokens']} tokens: "
                      f"{'identical' if g['identical'] else 'differs at ' + str(g['first_difference'])}."]
    rows = r["ms_per_token_by_position"]
    if rows:
        lines += ["", "| position | tokenswift ms/token | tau |", "|---|---|---|"]
        step = max(1, len(rows) // 12)
        for row in rows[::step]:
            tau = f"{row['tau']:.2f}" if row["tau"] else "-"
            lines.append(f"| {row['position']:.0f} | {row['ms_per_token']:.3f} | {tau} |")
        lines.append(f"\nMean over all positions: {statistics.fmean(x['ms_per_token'] for x in rows):.3f} ms/token "
                     f"({t['tokens_per_second']} tokens/s over the record's decode time).")
    if r["plain_ms_per_token_at_context"]:
        lines += ["", "| context | plain decoding ms/token (measured) |", "|---|---|"]
        lines += [f"| {c} | {ms:.3f} |" for c, ms in r["plain_ms_per_token_at_context"].items()]
    return "\n".join(lines) + "\n"


def plot(r: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    rows = r["ms_per_token_by_position"]
    if rows:
        ax.plot([x["position"] for x in rows], [x["ms_per_token"] for x in rows], label="TOKENSWIFT (batch job)")
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
    a = sub.add_parser("prepare", help="model, heads, prompt and the two job files")
    a.add_argument("--dir", required=True)
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
