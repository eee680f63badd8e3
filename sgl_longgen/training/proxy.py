"""The embedded proxy model, end to end: tokenizer, LM from scratch, TokenSwift heads.

    python -m sgl_longgen.training.proxy --out sgl_longgen/models/tiny
    sgl-longgen train proxy --out sgl_longgen/models/tiny          (the same)

trains on the running interpreter's standard library (offline), then assembles a shippable
model directory: HF checkpoint (bf16 weights, tokenizer), ``tokenswift-heads/`` (heads and the
model's ``longgen.toml`` defaults) and ``training.json`` (the exact command, the resolved step
counts, final losses and accuracies, the logs). Bulky state (optimizer, token cache) stays in the
work directory. A short greedy check (plain decoding vs TokenSwift on the reference runtime)
and, where transformers is installed, a logits comparison with HF's Llama close the run.
Wall time is bounded per stage (``--lm-minutes``, ``--heads-minutes``): the step counts shrink
to fit, and the schedule is laid out over the steps that fit.
"""

from __future__ import annotations

import argparse
import json
import shlex
import shutil
import sys
import time
from pathlib import Path

import msgspec
import torch

from ..config import Strict, convert, load_toml, merge
from ..errors import LonggenError
from ..runtime.embedded import DEFAULTS_FILE, HEADS_SUBDIR, cache_root
from .command import command_line
from .config import HeadsTrainConfig, LMTrainConfig, NonNegInt, PosInt
from .tokenizer import TOKENIZER_FILES

MODEL_FILES = ("config.json", "generation_config.json", "model.safetensors", *TOKENIZER_FILES)
HEADS_FILES = ("heads.json", "heads.safetensors")
SIZE_LIMIT_MB = 20.0
CHECK_PROMPT = "import os\nimport sys\n\n\ndef main(argv):\n    "

DEFAULTS_TEMPLATE = """\
# Defaults for the proxy model's TokenSwift runs; any --config file or flag overrides them.
# The proxy writes whole source files and ends each with EOS; long-generation runs go on past it.
ignore_eos = true

[tokenswift.partial_kv]
budget = {budget}
sinks = {sinks}
"""


class ProxyConfig(Strict):
    """The two trainers' configs (``[lm]``, ``[heads]`` tables) and the shipped defaults."""

    lm: LMTrainConfig = msgspec.field(default_factory=LMTrainConfig)
    heads: HeadsTrainConfig = msgspec.field(default_factory=HeadsTrainConfig)
    partial_kv_budget: PosInt = 1024
    partial_kv_sinks: NonNegInt = 16

    def __post_init__(self) -> None:
        if self.partial_kv_sinks >= self.partial_kv_budget:
            raise ValueError("partial_kv_sinks must be smaller than partial_kv_budget")
        if self.partial_kv_budget > self.lm.model.max_position_embeddings:
            raise ValueError(f"partial_kv_budget ({self.partial_kv_budget}) exceeds the model's context "
                             f"({self.lm.model.max_position_embeddings})")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", required=True, type=Path, help="the model directory to ship (e.g. sgl_longgen/models/tiny)")
    p.add_argument("--work", type=Path, help="training state and caches (default $SGLANG_LONGGEN_HOME/proxy-work)")
    p.add_argument("--config", type=Path, help="TOML with [lm] and [heads] tables (trainer settings)")
    p.add_argument("--lm-steps", type=int, help="LM optimizer steps (default 1000; fewer if --lm-minutes is reached)")
    p.add_argument("--heads-steps", type=int, help="heads optimizer steps (default 300)")
    p.add_argument("--lm-minutes", type=float, help="LM wall-time budget (default 4; 0 = none)")
    p.add_argument("--heads-minutes", type=float, help="heads wall-time budget (default 1.5; 0 = none)")
    p.add_argument("--device", help="auto (default), cpu, cuda")
    p.add_argument("--compile", action="store_true", default=None, help="torch.compile both trainers' forwards")
    p.add_argument("--check-tokens", type=int, help="greedy AR vs TokenSwift check length (default 512; 0: skip)")


def load_proxy_config(args: argparse.Namespace) -> ProxyConfig:
    """Proxy defaults < ``--config`` < flags; the stage budgets default to 4 and 1.5 minutes."""
    data = load_toml(args.config) if args.config else {}
    budget = {"lm": 4.0 if args.lm_minutes is None else args.lm_minutes,
              "heads": 1.5 if args.heads_minutes is None else args.heads_minutes}
    over: dict = {"lm": {"loop": {}}, "heads": {"loop": {}}}
    for part in ("lm", "heads"):
        given = getattr(args, f"{part}_minutes")
        if given is not None or "max_minutes" not in data.get(part, {}).get("loop", {}):
            over[part]["loop"]["max_minutes"] = budget[part]
        if getattr(args, f"{part}_steps") is not None:
            over[part]["loop"]["steps"] = getattr(args, f"{part}_steps")
        if args.device is not None:
            over[part]["loop"]["device"] = args.device
        if args.compile is not None:
            over[part]["loop"]["compile"] = args.compile
    return convert(merge(data, over), ProxyConfig, str(args.config) if args.config else "the proxy defaults")


def run(args: argparse.Namespace, command: str) -> int:
    from .heads import train_heads
    from .lm import train_lm

    cfg = load_proxy_config(args)
    out: Path = args.out
    work: Path = args.work or cache_root() / "proxy-work"
    if out.exists() and not out.is_dir():
        raise LonggenError(f"--out {out} exists and is not a directory")
    lm_dir, heads_dir = work / "lm", work / "heads"
    for scratch in (lm_dir, heads_dir):  # the proxy's own scratch: each run starts clean
        shutil.rmtree(scratch, ignore_errors=True)
    t0 = time.perf_counter()

    lm = train_lm(msgspec.structs.replace(cfg.lm, out=str(lm_dir)), command=command)
    t_lm = time.perf_counter()
    heads_cfg = msgspec.structs.replace(cfg.heads, model=str(lm_dir), out=str(heads_dir), data=cfg.lm.data)
    heads = train_heads(heads_cfg, command=command)
    t_heads = time.perf_counter()

    record = {
        "command": command,
        "reproduce": _reproduce(command, lm["steps"], heads["steps"]),
        "lm": _strip(lm), "heads": _strip(heads),
        "wall_seconds": {"lm": round(t_lm - t0, 1), "heads": round(t_heads - t_lm, 1)},
    }
    assemble(out, lm_dir, heads_dir, cfg, record)
    size_mb = sum(f.stat().st_size for f in out.rglob("*") if f.is_file()) / 1e6
    check_tokens = 512 if args.check_tokens is None else args.check_tokens
    check = check_generation(out, check_tokens) if check_tokens else {}
    hf = check_transformers(out)
    record.update(size_mb=round(size_mb, 2), check=check, transformers=hf,
                  wall_seconds={**record["wall_seconds"], "total": round(time.perf_counter() - t0, 1)})
    (out / "training.json").write_text(json.dumps(record, indent=2) + "\n")
    print_report(out, record)
    if size_mb > SIZE_LIMIT_MB:
        print(f"warning: {out} holds {size_mb:.1f} MB, more than the {SIZE_LIMIT_MB:g} MB the repository allows",
              file=sys.stderr)
    return 0


def _strip(summary: dict) -> dict:
    keep = ("command", "parameters", "device", "torch", "python", "corpus", "steps", "tokens", "seconds",
            "tokens_per_second", "train", "val", "config", "log")
    return {k: summary[k] for k in keep if k in summary}


def _reproduce(command: str, lm_steps: int, heads_steps: int) -> str:
    """The same run with the step counts the time budgets settled on, and no budgets."""
    replaced = {"--lm-steps", "--heads-steps", "--lm-minutes", "--heads-minutes"}
    words, kept = shlex.split(command), []
    i = 0
    while i < len(words):
        if words[i] in replaced:
            i += 2
            continue
        kept.append(words[i])
        i += 1
    kept += ["--lm-steps", str(lm_steps), "--heads-steps", str(heads_steps), "--lm-minutes", "0", "--heads-minutes", "0"]
    return " ".join(shlex.quote(w) for w in kept)


def assemble(out: Path, lm_dir: Path, heads_dir: Path, cfg: ProxyConfig, record: dict) -> None:
    """Copy exactly the files to ship into ``out`` (replacing an older proxy there)."""
    staging = out.parent / f".{out.name}-staging"
    shutil.rmtree(staging, ignore_errors=True)
    (staging / HEADS_SUBDIR).mkdir(parents=True)
    for name in MODEL_FILES:
        shutil.copyfile(lm_dir / name, staging / name)
    for name in HEADS_FILES:
        shutil.copyfile(heads_dir / name, staging / HEADS_SUBDIR / name)
    (staging / HEADS_SUBDIR / DEFAULTS_FILE).write_text(
        DEFAULTS_TEMPLATE.format(budget=cfg.partial_kv_budget, sinks=cfg.partial_kv_sinks))
    (staging / "training.json").write_text(json.dumps(record, indent=2) + "\n")
    if out.exists():
        shutil.rmtree(out)
    staging.rename(out)


def check_generation(model_dir: Path, tokens: int) -> dict:
    """Greedy plain decoding vs TokenSwift on the reference runtime (float32, CPU)."""
    from ..config import load_generate_config
    from ..runtime import build_decoder, default_heads_dir, heads_defaults_file, load_model

    loaded = load_model(model_dir, "float32", "cpu")
    prompt = loaded.tokenizer.encode(CHECK_PROMPT)
    defaults = heads_defaults_file(default_heads_dir(model_dir))
    base = load_toml(defaults) if defaults is not None else {}
    results = {}
    for method in ("ar", "tokenswift"):
        # Every step speculates: tau and alpha measure the heads, not a mix with plain steps.
        config = load_generate_config(None, merge(base, {"method": method, "runtime": {"dtype": "float32"},
                                                         "adaptive": {"enabled": False}}))
        results[method] = build_decoder(loaded, config).generate(prompt, tokens)
    ar, ts = results["ar"], results["tokenswift"]
    return {
        "new_tokens": tokens, "identical": ar.output_ids == ts.output_ids,
        "tau": round(ts.accept_length, 3), "alpha": round(ts.acceptance_rate, 3),
        "ar_tokens_per_second": round(ar.tokens_per_second, 1),
        "tokenswift_tokens_per_second": round(ts.tokens_per_second, 1),
        "text": loaded.tokenizer.decode(ts.output_ids)[:600],
    }


def check_transformers(model_dir: Path) -> dict:
    """Max |logit difference| between HF transformers' Llama and the reference runtime, if installed."""
    try:
        import transformers
    except ImportError:
        return {"skipped": "transformers is not installed"}
    from ..runtime import load_model
    from ..runtime.model import ForwardSpec

    try:
        ref = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    except Exception as exc:  # report, do not fail the run: the weights are already written
        return {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"}
    ours = load_model(model_dir, "float32")
    ids = ours.tokenizer.encode(CHECK_PROMPT)
    x = torch.tensor(ids)
    with torch.no_grad():
        want = ref(input_ids=x[None]).logits[0]
        got = ours.model.logits(ours.model(x, torch.arange(len(ids)), ours.model.new_cache(len(ids)), ForwardSpec(start=0)))
    return {"transformers": transformers.__version__, "max_abs_logit_diff": float((got - want).abs().max()),
            "same_token_ids": tok(CHECK_PROMPT)["input_ids"] == ids}


def print_report(out: Path, record: dict) -> None:
    """The block to paste into the issue note."""
    lm, heads = record["lm"], record["heads"]
    lines = [
        "=" * 72,
        f"proxy model written to {out} ({record['size_mb']} MB)",
        f"command:   {record['command']}",
        f"reproduce: {record['reproduce']}",
        f"device:    {lm.get('device')}; torch {lm.get('torch')}; python {lm.get('python')}",
        f"corpus:    {lm.get('corpus')}",
        f"lm:    {lm['parameters'] / 1e6:.2f}M params, {lm['steps']} steps, {lm['tokens'] / 1e6:.1f}M tokens, "
        f"{lm['seconds']:.0f}s | train {json.dumps(lm['train'])} | val {json.dumps(lm['val'])}",
        f"heads: {heads['parameters'] / 1e6:.2f}M params, {heads['steps']} steps, {heads['tokens'] / 1e6:.1f}M tokens, "
        f"{heads['seconds']:.0f}s | train {json.dumps(heads['train'])} | val {json.dumps(heads['val'])}",
        f"wall:  {json.dumps(record['wall_seconds'])}",
    ]
    check = record.get("check") or {}
    if check:
        lines.append(f"check: greedy {check['new_tokens']} tokens, identical={check['identical']}, "
                     f"tau={check['tau']}, alpha={check['alpha']}, ar {check['ar_tokens_per_second']} tok/s, "
                     f"tokenswift {check['tokenswift_tokens_per_second']} tok/s (reference runtime, CPU)")
    lines.append(f"transformers: {json.dumps(record.get('transformers'))}")
    if check:
        lines += ["--- sample (TokenSwift, greedy) ---", check["text"], "-" * 72]
    print("\n".join(lines))


def main(argv: list[str] | None = None) -> int:
    """``python -m sgl_longgen.training.proxy``: the same as ``sgl-longgen train proxy``.

    It builds only its own parser: going through ``sgl_longgen.cli`` would import every command,
    among them ``train``, which imports this module back.
    """
    parser = argparse.ArgumentParser(prog="python -m sgl_longgen.training.proxy",
                                     description="Train the embedded proxy model (= sgl-longgen train proxy).")
    add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        return run(args, command=command_line(args, ("train", "proxy")))
    except LonggenError as exc:  # one line, as the command line reports it
        print(f"sgl-longgen: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
