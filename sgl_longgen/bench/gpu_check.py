"""GPU check of our speculative algorithms inside SGLang (a host with SGLang installed; no network needed).

A Llama-3.1-8B-shaped model with SGLang's dummy weights and random TokenSwift heads (OWL and
HOWL: a random OWL drafter; LONGSPEC: a random LongSpec drafter block; NGRAM: SGLang's own method,
the peer), ``--algorithms`` in turn:

1. greedy equality: the same prompts through SGLang without speculation and with the algorithm,
   ``--tokens`` new tokens each. Where outputs differ, the plain run's top-2 log-probability gap
   at the first differing position is reported (dummy weights give flat distributions; a
   difference at a bf16-level near-tie is kernel rounding, not the method);
2. step-time breakdown at each ``--contexts`` length: the end-to-end time per generated token
   (an untimed request of ``2T`` tokens less its prefill, ``T = --timed-tokens``; greedy, or with
   ``--timed-sampling sampled`` at temperature 1 with our methods' speculation forced on, where
   dummy weights accept almost nothing and ms/token is ms per step) and its speedup over plain
   decoding, then timed requests of ``--step-detail`` tokens, one in each ``--detail-modes``
   mode (``custom_params={"longgen_timing": MODE}``: our workers time only the steps of requests
   that ask, and report them in ``meta_info``; see :mod:`sgl_longgen.sglang.timing`). ``host``:
   undisturbed host times plus the forwards' GPU spans, whence draft / verify / overhead ms per
   step next to one plain decode step, the step wall, the part of it outside the two forwards
   (median and mean step), the device gaps between the forwards, the share of chained drafts and
   ms / token = step wall / tau; ``sync``: each section synchronised, so its figure includes the
   device work it queued. Both modes give every section of a step (setup, draft_shadow,
   draft_wait, draft_tree, verify_launch, accept_queue, walk, observe) on its own;
3. OWL's drafting cost per step: the LSTM tree expansion (``--owl-width``, ``--owl-draft-vocab``,
   depth 8, top-k 10, 30 nodes) for one request, next to the plain decode step at the first
   context length, for each ``--drafter-weights`` setting (``bf16``; ``fp8``: the projections and
   head as e4m3 with row scales, :mod:`sgl_longgen.core.fp8`, multiplied through
   :mod:`sgl_longgen.kernels.fp8_linear`), side by side;
4. LongSpec's drafting cost per step (``--phase longspec``): one full beam expansion (widths
   ``[4, 16, 16, 16, 16]`` cut to 63 nodes, window 512) of an 8B-shaped drafter block for
   ``--longspec-batch`` requests at each ``--contexts`` length, its cross-attention through the
   Triton prefix kernel (what the worker runs on a GPU) and through its PyTorch twin, next to the
   plain decode step at that context; with the full head and with a reduced draft vocabulary
   (``--longspec-draft-vocab`` N rows of the head at a random map, default 32768; 0: full only);
   with ``--drafter-weights bf16 fp8`` also with the block and head in fp8 (keys prefixed ``fp8_``;
   ``fp8-bf16``: fp8 with the GEMM's product in bf16; ``fp8-addr``: fp8 with the matrices' tiles read
   by addresses, not through tensor descriptors; ``fp8-sums``: fp8 with a split GEMM's sums added by
   its own kernel in the compiled step too; :func:`~sgl_longgen.kernels.fp8_gemm.table_choice`).

    python -m sgl_longgen.bench.gpu_check --phase plain --out results.json
    python -m sgl_longgen.bench.gpu_check --phase spec --out results.json --algorithms NGRAM TOKENSWIFT OWL HOWL
    python -m sgl_longgen.bench.gpu_check --out results.json --algorithms NGRAM TOKENSWIFT OWL HOWL  # all of it
    python -m sgl_longgen.bench.gpu_check --phase spec --out results.json --step-detail 128 --detail-modes host
    python -m sgl_longgen.bench.gpu_check --phase owl --out results.json --owl-width 4096 2048 1024
    python -m sgl_longgen.bench.gpu_check --phase spec --out results.json --algorithms LONGSPEC
    python -m sgl_longgen.bench.gpu_check --phase longspec --out results.json --longspec-draft-vocab 32768
    python -m sgl_longgen.bench.gpu_check --phase owl --out results.json --drafter-weights bf16 fp8
    python -m sgl_longgen.bench.gpu_check --phase longspec --out results.json --drafter-weights bf16 fp8 fp8-bf16 fp8-addr
    python -m sgl_longgen.bench.gpu_check --phase longspec --out results.json --longspec-compile
    python -m sgl_longgen.bench.gpu_check --phase spec --out results.json --algorithms OWL --draft-tokens 32 \
        --drafter-tree-size 15 --spec-drafter-weights fp8  # a narrower OWL tree (32 verify rows), fp8 drafter
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import statistics
import tempfile
import time
from pathlib import Path

from ..config import SPECULATIVE_ALGORITHMS
from ..sglang.engine import open_engine
from .engine_bench import first_difference, top2_gap
from ..sglang.host_profile import PROFILE_ENV, PROFILE_PARAM
from .kernel_trace import profile
from ..sglang.timing import STEPS_PARAM, TIMING_PARAM

LLAMA_8B = dict(
    architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=128256, hidden_size=4096,
    intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
    max_position_embeddings=131072, rms_norm_eps=1e-5, rope_theta=500000.0, torch_dtype="bfloat16",
    rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 8192},
    bos_token_id=128000, eos_token_id=128001, tie_word_embeddings=False, hidden_act="silu",
)

# Qwen2.5-7B's shape: the other 8B-class architecture the runtimes serve (Qwen2: q/k/v biases, 28
# query heads on 4 KV heads, a 152K vocabulary); no sliding window, so every layer verifies alike.
QWEN_7B = {
    "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "vocab_size": 152064, "hidden_size": 3584,
    "intermediate_size": 18944, "num_hidden_layers": 28, "num_attention_heads": 28, "num_key_value_heads": 4,
    "max_position_embeddings": 131072, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "torch_dtype": "bfloat16",
    "use_sliding_window": False, "sliding_window": 131072, "max_window_layers": 28,
    "bos_token_id": 151643, "eos_token_id": 151645, "tie_word_embeddings": False, "hidden_act": "silu",
}

SHAPES = {"llama8b": LLAMA_8B, "qwen7b": QWEN_7B}


ALGORITHMS = ("TOKENSWIFT", "OWL", "HOWL", "LONGSPEC", "NGRAM")


def make_checkpoints(root: Path, budget: int, policy: str = "tokenswift", config: dict = LLAMA_8B,
                     name: str = "llama8b") -> tuple[Path, Path]:
    """A dummy-weights model directory of ``config``'s shape (``root/name``: SGLang loads it with
    ``load_format="dummy"``) and random TokenSwift heads for it (``root/name-heads``)."""
    import torch

    from ..core.heads import TokenSwiftHeads

    model = root / name
    model.mkdir(parents=True, exist_ok=True)
    (model / "config.json").write_text(json.dumps(config))
    heads_dir = root / ("heads" if name == "llama8b" else f"{name}-heads")
    heads = TokenSwiftHeads(config["hidden_size"], 3, config["rms_norm_eps"])
    heads.reset_parameters(torch.Generator().manual_seed(0))
    heads.save(heads_dir)
    (heads_dir / "longgen.toml").write_text(f"[tokenswift.partial_kv]\nbudget = {budget}\nsinks = 16\n"
                                            f"policy = \"{policy}\"\n")
    return model, heads_dir


def make_owl_drafter(root: Path, width: int, draft_vocab: int, config: dict = LLAMA_8B) -> Path:
    """A random OWL drafter for a target shape, the 8B one by default (dummy weights: only its cost
    and losslessness count)."""
    import torch

    from ..core.owl import OwlDrafter

    vocab = config["vocab_size"]
    n = draft_vocab if 0 < draft_vocab < vocab else None
    drafter = OwlDrafter(config["hidden_size"], vocab, width, n_steps=8, spec=True, draft_vocab_size=n)
    gen = torch.Generator().manual_seed(0)
    drafter.reset_parameters(gen)
    if n is not None:
        drafter.set_token_map(torch.randperm(vocab, generator=gen)[:n].sort().values)
    out = root / (f"owl-{width}x{draft_vocab}" if config is LLAMA_8B else f"owl-{width}x{draft_vocab}-{vocab}v")
    drafter.save(out)
    return out


def set_drafter_defaults(draft: Path, algorithm: str, tree_size: int | None, weights: str,
                         beam: str | None = None) -> None:
    """The spec phase's drafter settings in the drafter directory's ``longgen.toml`` (OWL and HOWL:
    ``[owl]``, LONGSPEC: ``[longspec]``): the tree size (verify rows: see the method's config), the
    drafter's weights and how the worker runs its beam (``None``: the method's default)."""
    section = "longspec" if algorithm == "LONGSPEC" else "owl"
    lines = [f"[{section}]", f'weights = "{weights}"']
    if tree_size is not None:
        lines.append(f"tree_size = {tree_size}")
    if beam is not None:
        lines.append(f'beam = "{beam}"')
    (draft / "longgen.toml").write_text("\n".join(lines) + "\n")


def make_longspec_drafter(root: Path, config: dict = LLAMA_8B, window: int = 512, name: str = "longspec",
                          draft_vocab: int = 0) -> Path:
    """A random LongSpec drafter block for a target config (dummy weights: only its cost and
    losslessness count); for the 8B shape it holds about 250M parameters (1 GB in fp32).
    ``draft_vocab``: a reduced draft vocabulary of that many ids (a random token map; 0 or the
    whole vocabulary: none)."""
    import msgspec
    import torch

    from ..core.longspec import LongSpecDrafter
    from ..runtime.model import ModelConfig

    drafter = LongSpecDrafter.for_target(msgspec.convert(config, ModelConfig), window=window)
    gen = torch.Generator().manual_seed(0)
    drafter.reset_parameters(gen)
    vocab = config["vocab_size"]
    if 0 < draft_vocab < vocab:
        drafter = drafter.with_token_map(torch.randperm(vocab, generator=gen)[:draft_vocab].sort().values)
        name = f"{name}-v{draft_vocab}"
    return drafter.save(root / f"{name}-w{window}")


def engine(model: Path, draft: Path | None, args, spec: bool = True) -> object:
    """Plain decoding (``spec=False``) runs on SGLang's own choice of backend unless
    ``--plain-attention-backend`` names one: on Hopper that is FA3, the path to beat."""
    backend = args.attention_backend if spec else args.plain_attention_backend
    kw = dict(model_path=str(model), load_format="dummy", skip_tokenizer_init=True, attention_backend=backend,
              mem_fraction_static=args.mem_fraction,
              context_length=131072, log_level="warning", random_seed=0, chunked_prefill_size=16384,
              disable_radix_cache=True, max_running_requests=4, cuda_graph_max_bs_decode=2,
              cuda_graph_backend_prefill="disabled")  # prefill graphs: a minute per start, no decode step
    if spec:
        kw.update(speculative_algorithm=args.algorithm, speculative_num_draft_tokens=args.draft_tokens,
                  disable_overlap_schedule=True)
        if draft is not None:
            kw.update(speculative_draft_model_path=str(draft))
        if args.no_cuda_graph:
            kw.update(disable_cuda_graph=True)
    return open_engine(**kw)


# --drafter-weights: setting -> (matrices in fp8, the fp8 GEMM's product in fp16, its tiles read through tensor
# descriptors where they can be, a split GEMM's sums inside the next kernel when compiled); True: the table's own
DRAFTER_WEIGHTS = {"bf16": (False, True, True, True), "fp8": (True, True, True, True),
                   "fp8-bf16": (True, False, True, True), "fp8-addr": (True, True, False, True),
                   "fp8-sums": (True, True, True, False)}
NGRAM_DRAFT_TOKENS = 16  # SGLang NGRAM's verify width unless --ngram-draft-tokens says otherwise
OURS = frozenset(SPECULATIVE_ALGORITHMS.values())  # the algorithms our plugin registers


@contextlib.contextmanager
def gemm_table(setting: str):
    """The fp8 GEMM's table as a ``--drafter-weights`` setting has it, while graphs are captured."""
    from ..kernels.fp8_gemm import table_choice

    _, f16, tma, inline = DRAFTER_WEIGHTS[setting]
    with table_choice(f16_dot=f16, tma=tma, inline_sums=inline):
        yield


def greedy(n: int, **extra) -> dict:
    return {"max_new_tokens": n, "temperature": 0, "ignore_eos": True, **extra}


def timed_request(n: int, args, spec: bool = False) -> dict:
    """A request of the end-to-end timing. ``--timed-sampling greedy``: greedy, the product's own
    steps (dummy weights loop, so drafts are often accepted); ``sampled``: temperature 1, our
    methods' speculation forced on every step. Dummy weights' flat distributions then accept
    (almost) no draft, so every token costs one whole speculative step: ms/token is ms/step, the
    figure a verify path is judged by (tau is reported beside it)."""
    if args.timed_sampling == "greedy":
        return greedy(n)
    forced = {"custom_params": {"longgen_speculation": "on"}} if spec and args.algorithm in OURS else {}
    return {"max_new_tokens": n, "temperature": 1.0, "ignore_eos": True, "sampling_seed": 1234, **forced}


def timed(n: int, mode: str) -> dict:
    """Greedy sampling for a request whose steps our workers time (``mode``: host or sync)."""
    # Every step commits a token at least: n steps bound the series of an n-token request.
    return greedy(n, custom_params={TIMING_PARAM: mode, STEPS_PARAM: max(n, 1)})


# -- a timed request's meta_info -> per-step figures (pure Python) ---------------------------------
#
# A timed step's values sit on the first token it committed (None on its other tokens), every
# value of one step at the same position; each timed step has the three phases.

WALL_PARTS = ("draft_ms", "verify_ms", "overhead_ms", "between_steps_ms")  # a step, wall to wall
GPU_SPANS = ("draft_gpu_ms", "verify_gpu_ms")  # the two forwards on the device (host mode)
GAPS = ("gap_draft_verify", "gap_verify_draft")  # device time between the forwards (host mode)
SHARES = ("draft_queued_ahead", "draft_chained")  # 1.0 / 0.0 per step


def timed_steps(meta: dict, warmup: int = 1) -> list[dict[str, float]]:
    """The timed steps of one request, in order, each ``{name: value}`` with the ``longgen_``
    prefix stripped (``draft_ms``, ``walk_ms``, ``draft_chained``, ...), without the first
    ``warmup`` steps (the first step's between-steps time and gaps span the prefill)."""
    series = {k[len("longgen_"):]: v for k, v in meta.items() if k.startswith("longgen_") and isinstance(v, list)}
    anchor = series.get("draft_ms", [])
    steps = [{name: values[i] for name, values in series.items() if i < len(values) and values[i] is not None}
             for i, value in enumerate(anchor) if value is not None]
    return steps[warmup:]


def _values(steps: list[dict], key: str) -> list[float]:
    return [s[key] for s in steps if s.get(key) is not None]


def step_mean(steps: list[dict], key: str) -> float:
    values = _values(steps, key)
    return statistics.fmean(values) if values else float("nan")


def step_median(steps: list[dict], key: str) -> float:
    values = _values(steps, key)
    return statistics.median(values) if values else float("nan")


def section_means(steps: list[dict]) -> dict[str, float]:
    """Mean ms per step of every timed figure: phases, sections, GPU spans, gaps, scheduler, GC."""
    keys = sorted({k for s in steps for k in s if k.endswith("_ms")})
    return {k[:-len("_ms")]: round(step_mean(steps, k), 3) for k in keys}


def phase_means(steps: list[dict]) -> dict[str, float]:
    """Mean ms per step of the three phases and of SGLang's scheduler between two steps."""
    return {k: round(step_mean(steps, k), 3) for k in WALL_PARTS}


def host_figures(steps: list[dict], tau: float | None) -> dict[str, float]:
    """What a host-mode request says about a step, from the steps that have every part.

    ``host_step_wall_*``: draft + verify + overhead + the scheduler's time before the step;
    ``host_outside_forwards_*``: that wall less the two forwards' GPU spans; mean and median
    step (a host hiccup, a GC pause or a busy core, moves one step's figure a lot and the mean
    with it; the median shows the typical step). ``host_ms_per_token*``: step wall / ``tau``.
    """
    out: dict[str, float] = {}
    walls = [sum(s[k] for k in WALL_PARTS) for s in steps if all(s.get(k) is not None for k in WALL_PARTS)]
    if walls:
        wall, wall_median = statistics.fmean(walls), statistics.median(walls)
        out["host_step_wall_ms"] = round(wall, 3)
        out["host_step_wall_median_ms"] = round(wall_median, 3)
        if tau:  # per token from the step wall: free of per-request setup noise
            out["host_ms_per_token"] = round(wall / tau, 3)
            out["host_ms_per_token_median"] = round(wall_median / tau, 3)
    parts = WALL_PARTS + GPU_SPANS
    outside = [sum(s[k] for k in WALL_PARTS) - sum(s[k] for k in GPU_SPANS)
               for s in steps if all(s.get(k) is not None for k in parts)]
    if outside:
        out["host_outside_forwards_ms"] = round(statistics.fmean(outside), 3)
        out["host_outside_forwards_median_ms"] = round(statistics.median(outside), 3)
    for gap in GAPS:  # where the outside time lies
        if _values(steps, f"{gap}_ms"):
            out[f"{gap}_median_ms"] = round(step_median(steps, f"{gap}_ms"), 3)
    for share in SHARES:
        if _values(steps, share):
            out[f"{share}_share"] = round(step_mean(steps, share), 3)
    return out


def owl_drafter_ms(width: int, draft_vocab: int = 0, compiled: bool = False, profile_dir: Path | None = None,
                   weights: str = "bf16") -> dict:
    """Median time (CUDA events, L2 flushed) of one OWL tree expansion for an 8B-shaped target, batch 1:
    the PyTorch beam eagerly and replayed as a CUDA graph, and the fused-kernel beam's graph (what the
    OWL worker replays by default). ``draft_vocab`` N > 0: the head covers a random map of N target
    tokens (its cost does not depend on which). ``compiled``: also the graph of the
    ``torch.compile``d beam. Other beams round differently from the eager one: ``*_token_agreement``
    is the share of draft nodes holding the same token. ``profile_dir``: each graph's per-kernel
    totals there (:func:`.kernel_trace.profile`). ``weights``: ``"fp8"`` times every beam with the
    projections and head quantized (:func:`~sgl_longgen.core.owl.quantize_fp8`, as the worker
    does for ``[owl] weights = "fp8"``), the agreement then against the eager fp8 beam."""
    import torch

    from ..core.owl import GraphedExpand, OwlDrafter, expand, quantize_fp8
    from .kernels import time_us
    from ..kernels.owl_beam import fused_expand

    torch.manual_seed(0)
    d0, vocab = LLAMA_8B["hidden_size"], LLAMA_8B["vocab_size"]
    n = draft_vocab if 0 < draft_vocab < vocab else None
    drafter = OwlDrafter(d0, vocab, width, n_steps=8, spec=True, draft_vocab_size=n)
    if n is not None:
        drafter.set_token_map(torch.randperm(vocab)[:n].sort().values)
    drafter = drafter.to("cuda", torch.bfloat16).eval()
    if DRAFTER_WEIGHTS[weights][0]:
        quantize_fp8(drafter)
    h = torch.randn(1, d0, device="cuda", dtype=torch.bfloat16)
    root = torch.tensor([1234], device="cuda")
    has = torch.tensor([True], device="cuda")
    shape = dict(top_k=10, depth=8, tree_size=30)
    out: dict = {"weights": weights}
    tag = f"owl-{width}x{draft_vocab}" + ("" if weights == "bf16" else f"-{weights}")
    with torch.no_grad():
        eager_beam = expand(drafter, h, root, h, has, **shape)
        out["eager_ms"] = round(time_us(lambda: expand(drafter, h, root, h, has, **shape)) / 1e3, 3)
        variants = {"graph": {}, "fused_graph": {"fast": fused_expand}}
        if compiled:
            variants["compiled_graph"] = {"compile": True}
        for name, kwargs in variants.items():
            try:
                if "fast" in kwargs:  # eagerly first: the graph would fall back quietly on an error
                    kwargs["fast"](drafter, h, root, h, has, **shape)
                graphed = GraphedExpand(drafter, **shape, **kwargs)
                beam = graphed(h, root, h, has)
                out[f"{name}_ms"] = round(time_us(lambda: graphed(h, root, h, has)) / 1e3, 3)
                if profile_dir is not None:
                    profile(lambda: graphed(h, root, h, has), profile_dir / f"{tag}-{name}")
                out[f"{name}_token_agreement"] = round(float((beam.tokens == eager_beam.tokens).float().mean()), 3)
            except Exception as exc:  # report, do not lose the other numbers
                out[f"{name}_error"] = f"{type(exc).__name__}: {exc}"[:300]
    return out


def longspec_drafter_ms(contexts: list[int], batch: int = 1, window: int = 512, config: dict = LLAMA_8B,
                        device: str = "cuda", draft_vocab: int = 0, profile_dir: Path | None = None,
                        weights: tuple[str, ...] = ("bf16",), compiled: bool = False) -> dict:
    """Median time (CUDA events, L2 flushed) of one full LongSpec beam expansion for an 8B-shaped
    target, ``batch`` requests at each context length: a steady step (the ring already holds the
    window; the last committed token and the root are fed), its cross-attention reading the
    context's K/V from a paged pool through the Triton prefix kernel, eagerly and replayed as the
    worker's CUDA graph (``beam_graph_ms``: the step's input packed on the host and copied over,
    then one replay of the ring feed and the beam), and through
    the gather + SDPA twin. Random weights: the tree's shape, not its tokens, sets the cost.
    ``draft_vocab`` N (0 < N < vocabulary): the same block again with a reduced draft vocabulary,
    its head the target's rows at a random map of N tokens (the cost does not depend on which),
    gathered once as the worker does: the same figures prefixed ``reduced_``. ``profile_dir``: the
    graphed step's per-kernel totals there (:func:`.kernel_trace.profile`). ``weights``: the
    settings timed; ``"fp8"`` again with the block quantized and an fp8 copy of the head (full or
    reduced), as the worker builds them for ``[longspec] weights = "fp8"``, the same figures
    prefixed ``fp8_`` (``fp8_reduced_``). ``compiled``: also the worker's step ``torch.compile``d
    before its capture (``beam_compiled_graph_ms``): whether inductor's fusion of the levels' small
    kernels (norms, RoPE, masks, residuals, the beam's bookkeeping) shortens the step."""
    import copy

    import msgspec
    import torch

    from ..core.longspec import LongSpecDrafter
    from ..core.longspec_beam import DEFAULT_WIDTHS
    from ..core.longspec_rope import rope_tables
    from ..core.longspec_weights import draft_head, quantize_fp8
    from ..runtime.model import ModelConfig, rope_inv_freq

    dev, dt = torch.device(device), torch.bfloat16
    cfg = msgspec.convert(config, ModelConfig)
    gen = torch.Generator().manual_seed(0)
    drafter = LongSpecDrafter.for_target(cfg, window=window)
    drafter.reset_parameters(gen)
    drafter = drafter.to(dev, dt).eval().requires_grad_(False)
    vocab, hidden = cfg.vocab_size, cfg.hidden_size
    embed = torch.nn.Embedding(vocab, hidden).to(dev, dt).requires_grad_(False)
    head_weight = torch.randn(vocab, hidden, device=dev, dtype=dt) * hidden ** -0.5
    inv_freq = rope_inv_freq(cfg).to(dev)
    kv_heads, head_dim = cfg.n_kv_heads, cfg.dim_head
    slots = max(contexts) * batch + 64
    k_buffer = torch.randn(slots, kv_heads, head_dim, device=dev, dtype=dt)
    v_buffer = torch.randn(slots, kv_heads, head_dim, device=dev, dtype=dt)
    reduced = 0 < draft_vocab < vocab
    out: dict = {"batch": batch, "window": window, "widths": list(DEFAULT_WIDTHS), "tree_size": 63,
                 "vocab": vocab, "draft_vocab": draft_vocab if reduced else vocab, "weights": list(weights)}

    def rope(positions):
        return rope_tables(inv_freq, positions, torch.float32)

    def full_head(h):
        return torch.nn.functional.linear(h, head_weight)

    token_map = torch.randperm(vocab, generator=gen)[:draft_vocab].sort().values if reduced else None
    variants = {}  # key prefix -> (drafter, its head, its --drafter-weights setting)
    for setting in weights:
        fp8 = DRAFTER_WEIGHTS[setting][0]
        prefix = f"{setting}_" if fp8 else ""
        block = quantize_fp8(copy.deepcopy(drafter)) if fp8 else drafter
        variants[prefix] = (block, draft_head(block, head_weight, full_head, fp8), setting)
        if reduced:
            small = drafter.with_token_map(token_map.to(dev))
            if fp8:
                quantize_fp8(small)
            variants[f"{prefix}reduced_"] = (small, draft_head(small, head_weight, full_head, fp8), setting)
    for L in contexts:
        rows = [torch.randperm(slots, device=dev)[:L].to(torch.int32) for _ in range(batch)]
        tokens = torch.randint(0, vocab, (L + 1,), generator=gen).tolist()
        row: dict = {}
        for prefix, (drafter, head, setting) in variants.items():
            with gemm_table(setting):  # every graph of the variant captured with its GEMM table
                _time_beams(row, prefix, drafter, embed, head, rope, rows, tokens, L, batch, window,
                            (k_buffer, v_buffer), max(contexts), dev,
                            None if profile_dir is None else profile_dir / f"longspec-{prefix or 'full_'}{L}", compiled)
        out[str(L)] = row
        del rows
    return out


def _time_beams(row: dict, prefix: str, drafter, embed, head, rope, rows, tokens: list[int], L: int,
                batch: int, window: int, buffers, max_context: int, dev, profile_to: Path | None = None,
                compiled: bool = False) -> None:
    """One drafter's (and head's) figures at one context into ``row``, keys prefixed ``prefix``.

    The drafter as the worker runs it: projections fused, the batch's rings rows of one pool,
    each step's input packed on the host and copied over once (``beam_graph_ms``: that, and one
    replay of the step: the steady two-token feed and the beam; ``beam_graph_torch_topk_ms``: the
    same with PyTorch's selections, each row's ``torch.topk`` and the level's stable sort, where the
    worker runs the Triton kernels)."""
    import torch

    from ..core.longspec_beam import DEFAULT_WIDTHS
    from ..core.longspec_weights import fuse_projections
    from ..kernels.longspec_step import DEFAULT_FEED, BeamPlan, RingPool, expand_batch, expand_rings
    from ..sglang.longspec import (
        GraphedBeam,
        committed_attention,
        kernel_attention,
        slot_lists,
        to_device,
    )
    from .kernels import time_us

    k_buffer, v_buffer = buffers
    fuse_projections(drafter)
    pool = RingPool(drafter.num_kv_heads, window, drafter.head_dim, k_buffer.dtype, dev, capacity=batch)
    rings = [pool.take() for _ in range(batch)]
    plan = BeamPlan.for_drafter(drafter, DEFAULT_WIDTHS, 63, DEFAULT_FEED, k_buffer.dtype, dev)
    steady = ([tokens[-2:]] * batch, [L - 1] * batch)  # the last committed token and the root
    with torch.no_grad():
        # The first step of a request feeds the window; the timed ones, two tokens each.
        first = tokens[-min(window, L + 1):]
        expand_batch(drafter, embed, head, rope, pool, rings,
                     committed_attention(k_buffer, v_buffer, rows, drafter.cross_attn.scale, False),
                     [first] * batch, [L + 1 - len(first)] * batch, plan=plan)
        for name, kernel in (("triton", True), ("torch", False)):
            def step(kernel=kernel):
                attend = committed_attention(k_buffer, v_buffer, rows, drafter.cross_attn.scale, kernel)
                return expand_batch(drafter, embed, head, rope, pool, rings, attend, *steady, plan=plan)
            try:
                step()
                row[f"{prefix}beam_{name}_ms"] = round(time_us(step) / 1e3, 3)
            except Exception as exc:  # noqa: BLE001 - report, do not lose the other numbers
                row[f"{prefix}beam_{name}_error"] = f"{type(exc).__name__}: {exc}"[:300]
        if dev.type == "cuda":  # the Triton kernel and the graph need a GPU
            kv_indptr, kv_indices = slot_lists(rows, dev, capacity=batch * max_context)
            # the worker's step, and the same with torch's top-k (what the Triton top-k saves)
            plans = {"graph": plan, "graph_torch_topk": BeamPlan.for_drafter(
                drafter, DEFAULT_WIDTHS, 63, DEFAULT_FEED, k_buffer.dtype, dev, fused_topk=False)}
            if compiled:  # and the same with a level's rows written into the window buffers by torch ops
                plans["compiled_graph"] = plan
                plans["compiled_graph_split_window"] = BeamPlan.for_drafter(
                    drafter, DEFAULT_WIDTHS, 63, DEFAULT_FEED, k_buffer.dtype, dev, fused_window=False)
            for name, step_plan in plans.items():
                def body(packed, indptr, step_plan=step_plan):
                    attend = kernel_attention(k_buffer, v_buffer, indptr, kv_indices, drafter.cross_attn.scale)
                    return expand_rings(drafter, embed, head, rope, (pool.k, pool.v, pool.pos), packed, attend,
                                        step_plan)

                # compiled during the capture's warm-up runs; its first replay is checked against
                # the compiled function run eagerly, as the worker checks its graph. Dynamo's caches
                # are cleared first: every variant's step is a trace of its own, and the variants of
                # one process would pass its recompile limit (8), past which it runs them eagerly
                if name.startswith("compiled"):
                    torch._dynamo.reset()
                graphed = GraphedBeam(torch.compile(body, dynamic=False) if name.startswith("compiled") else body)

                def graph_step(graphed=graphed):
                    _, packed = plan.pack(*steady, rings, pool.scratch)
                    return graphed(to_device(packed, dev), kv_indptr)

                try:
                    graph_step()
                    row[f"{prefix}beam_{name}_ms"] = round(time_us(graph_step) / 1e3, 3)
                    row[f"{prefix}beam_{name}_used"] = graphed.enabled
                    if profile_to is not None and name in ("graph", "compiled_graph"):
                        profile(graph_step, profile_to.with_name(f"{profile_to.name}-{name}"))
                except Exception as exc:  # noqa: BLE001 - report, do not lose the other numbers
                    row[f"{prefix}beam_{name}_error"] = f"{type(exc).__name__}: {exc}"[:300]


def host_profile_summary(path: Path, top: int = 30) -> dict:
    """The profiled steps' heaviest functions, as ms per step, by own time and by cumulative time."""
    import pstats

    stats = pstats.Stats(str(path)).stats
    steps = int(Path(f"{path}.steps").read_text())
    rows = [{"function": f"{Path(k[0]).name}:{k[1]}:{k[2]}", "calls_per_step": round(v[1] / steps, 1),
             "own_ms": round(v[2] / steps * 1e3, 3), "cum_ms": round(v[3] / steps * 1e3, 3)}
            for k, v in stats.items()]
    return {"steps": steps,
            "tottime": sorted(rows, key=lambda r: -r["own_ms"])[:top],
            "cumtime": sorted(rows, key=lambda r: -r["cum_ms"])[:top]}


def load_report(path: Path) -> dict:
    return json.loads(path.read_text()) if path.exists() else {}


def save_report(path: Path, report: dict) -> None:
    """Written after every phase: a later phase that kills the process keeps the earlier ones."""
    path.write_text(json.dumps(report, indent=2))


def attention_backend_of(engine) -> str:
    try:
        return engine.get_server_info().get("attention_backend")
    except Exception as exc:  # a report without it is still worth having
        return f"unknown ({exc})"


def phase_plain(args, model: Path, prompts, long_prompts, report: dict) -> None:
    t = time.time()
    plain = engine(model, None, args, spec=False)
    report["plain_engine_start_s"] = round(time.time() - t, 1)
    report["plain_attention_backend"] = attention_backend_of(plain)
    print(f"plain decoding on the {report['plain_attention_backend']} backend", flush=True)
    want = plain.generate(input_ids=prompts, sampling_params=greedy(args.tokens),
                          return_logprob=True, top_logprobs_num=2)
    report["plain_outputs"] = [
        {"output_ids": w["output_ids"], "top2_gaps": [top2_gap(w["meta_info"], i) for i in range(len(w["output_ids"]))]}
        for w in want
    ]
    ar = {}
    for L, prompt in long_prompts.items():
        times = {}
        plain.generate(input_ids=prompt, sampling_params=greedy(1))  # warm-up: first prefill of this length
        for n in (1, args.timed_tokens + 1):
            t = time.time()
            plain.generate(input_ids=prompt, sampling_params=timed_request(n, args))
            times[n] = time.time() - t
        ar[str(L)] = (times[args.timed_tokens + 1] - times[1]) / args.timed_tokens * 1e3
        print(f"plain decode at {L}: {ar[str(L)]:.2f} ms/token", flush=True)
    plain.shutdown()
    report["ar_step_ms"] = ar


def phase_spec(args, model: Path, draft: Path, prompts, long_prompts, report: dict) -> None:
    if "plain_outputs" not in report:
        raise SystemExit("run --phase plain first (same --out)")
    tag = f"{args.algorithm.lower()}_{args.attention_backend or 'default'}" + ("_eager" if args.no_cuda_graph else "")
    if args.algorithm == "NGRAM" and args.draft_tokens != NGRAM_DRAFT_TOKENS:  # SGLang's NGRAM at another width
        tag += f"_d{args.draft_tokens}"
    result: dict = {"algorithm": args.algorithm, "attention_backend": args.attention_backend,
                    "cuda_graph": not args.no_cuda_graph}
    if args.algorithm in ("OWL", "HOWL", "LONGSPEC"):
        tag += (f"_t{args.drafter_tree_size}" if args.drafter_tree_size else "") + (
            f"_{args.spec_drafter_weights}" if args.spec_drafter_weights != "bf16" else "") + (
            f"_{args.spec_drafter_beam}" if args.spec_drafter_beam else "")
        if args.algorithm == "LONGSPEC" and 0 < args.longspec_draft_vocab < LLAMA_8B["vocab_size"]:
            tag += f"_v{args.longspec_draft_vocab}"
        set_drafter_defaults(draft, args.algorithm, args.drafter_tree_size, args.spec_drafter_weights,
                             args.spec_drafter_beam)
        result.update(drafter=draft.name, drafter_tree_size=args.drafter_tree_size,
                      drafter_weights=args.spec_drafter_weights, drafter_beam=args.spec_drafter_beam)
    profile_path = None
    if args.host_profile:
        profile_path = Path(tempfile.mkdtemp(prefix="longgen_host_profile_")) / "steps.prof"
        os.environ[PROFILE_ENV] = str(profile_path)  # read by the engine's scheduler process
    t = time.time()
    spec = engine(model, draft, args)
    os.environ.pop(PROFILE_ENV, None)
    result["engine_start_s"] = round(time.time() - t, 1)
    result["attention_backend_used"] = attention_backend_of(spec)
    print(f"[{tag}] attention backend: {result['attention_backend_used']}", flush=True)
    got = spec.generate(input_ids=prompts, sampling_params=greedy(args.tokens))
    equality = []
    for w, g in zip(report["plain_outputs"], got):
        diff = first_difference(w["output_ids"], g["output_ids"])
        gap = w["top2_gaps"][diff] if diff is not None and diff < len(w["top2_gaps"]) else None
        equality.append({"identical": diff is None, "first_difference": diff,
                         "lengths": [len(w["output_ids"]), len(g["output_ids"])],
                         "plain_top2_logprob_gap_there": gap, "tau": g["meta_info"].get("spec_accept_length")})
        print(f"[{tag}] greedy equality over {args.tokens} tokens: {equality[-1]}", flush=True)
    result["equality"] = equality
    rows = []
    for L, prompt in long_prompts.items():
        spec.generate(input_ids=prompt, sampling_params=greedy(1))  # warm-up: first prefill of this length
        t = time.time()
        spec.generate(input_ids=prompt, sampling_params=greedy(1))
        prefill_s = time.time() - t
        t = time.time()
        out = spec.generate(input_ids=prompt, sampling_params=timed_request(args.timed_tokens + 1, args, True))
        first_s = time.time() - t
        t = time.time()
        out = spec.generate(input_ids=prompt, sampling_params=timed_request(2 * args.timed_tokens + 1, args, True))
        second_s = time.time() - t
        # Untimed requests (timing is per request and off by default): the product's steps. The
        # headline rate is the whole request less its prefill, per token: request setup (indexing
        # the prompt's n-grams, the first partial-KV selection) included. The difference of two
        # lengths cancels that setup, but on a workload whose acceptance changes along the
        # output (dummy weights loop) it is not a rate: reported beside it, never instead.
        per_token_ms = (second_s - prefill_s) / (2 * args.timed_tokens) * 1e3
        steady_ms = (second_s - first_s) / args.timed_tokens * 1e3
        ar_ms = report["ar_step_ms"].get(str(L), float("nan"))
        row = {"context": L, "ar_step_ms": round(ar_ms, 2), "tau": out["meta_info"].get("spec_accept_length")}
        row["ms_per_token"] = round(per_token_ms, 3)
        row["speedup"] = round(ar_ms / per_token_ms, 2)
        row["ms_per_token_difference"] = round(steady_ms, 3)
        print(f"[{tag}] {L}: {per_token_ms:.2f} ms/token over {2 * args.timed_tokens} tokens, request setup included"
              f" (difference of two lengths: {steady_ms:.2f}), {row['speedup']}x plain decoding", flush=True)
        # Timed requests, one per mode: every step's phases and sections in meta_info.
        timed_steps_of: dict[str, list] = {}
        for mode in (args.detail_modes if args.step_detail else ()):
            meta = spec.generate(input_ids=prompt, sampling_params=timed(args.step_detail, mode))["meta_info"]
            steps = timed_steps(meta)
            timed_steps_of[mode] = steps
            row[f"detail_{mode}_ms"] = section_means(steps)
            row[f"detail_{mode}_steps"] = len(steps)
            if mode == "host":
                row.update(host_figures(steps, meta.get("spec_accept_length")))
                if "host_ms_per_token_median" in row:
                    row["host_speedup"] = round(ar_ms / row["host_ms_per_token_median"], 2)
                print(f"[{tag}] {L}: step wall {row.get('host_step_wall_ms', float('nan')):.2f} ms (median step"
                      f" {row.get('host_step_wall_median_ms', float('nan')):.2f}), outside the two forwards' GPU"
                      f" spans {row.get('host_outside_forwards_ms', float('nan')):.2f} ms (mean; median step:"
                      f" {row.get('host_outside_forwards_median_ms', float('nan')):.2f}; device between draft and"
                      f" verify {row.get('gap_draft_verify_median_ms', float('nan')):.2f}, between verify and draft"
                      f" {row.get('gap_verify_draft_median_ms', float('nan')):.2f}); chained drafts"
                      f" {row.get('draft_chained_share', float('nan')):.2f}; ms/token (median step wall / tau)"
                      f" {row.get('host_ms_per_token_median', float('nan')):.3f},"
                      f" {row.get('host_speedup', float('nan'))}x plain decoding", flush=True)
            print(f"[{tag}] {L}: step sections (ms, {mode} mode): {row[f'detail_{mode}_ms']}", flush=True)
        # The coarse phases from the undisturbed mode where there is one (sync inflates them).
        source = "host" if "host" in timed_steps_of else next(iter(timed_steps_of), None)
        phases = phase_means(timed_steps_of.get(source, []))
        row["phases_from"] = source
        row["draft_ms"], row["verify_ms"] = round(phases["draft_ms"], 2), round(phases["verify_ms"], 2)
        row["overhead_ms"] = round(phases["overhead_ms"], 2)
        row["between_steps_ms"] = round(phases["between_steps_ms"], 2)  # SGLang's scheduler, measured
        row["draft_vs_ar"] = round(row["draft_ms"] / ar_ms, 2)
        row["verify_vs_ar"] = round(row["verify_ms"] / ar_ms, 2)
        # Wall time per step outside our worker's three phases (end to end): SGLang's scheduler.
        tau = row["tau"] or float("nan")
        row["scheduler_ms"] = round(per_token_ms * tau - row["draft_ms"] - row["verify_ms"] - row["overhead_ms"], 2)
        rows.append(row)
        if profile_path is not None and L == max(long_prompts):
            spec.generate(input_ids=prompt, sampling_params=greedy(args.host_profile, custom_params={PROFILE_PARAM: True}))
            spec.generate(input_ids=prompts[0], sampling_params=greedy(4))  # an unprofiled step writes the profile
    spec.shutdown()
    if profile_path is not None and profile_path.exists():
        result["host_profile"] = host_profile_summary(profile_path)
        print(f"[{tag}] host profile at {max(long_prompts)} (ms per step, cProfile on):", flush=True)
        for kind in ("tottime", "cumtime"):
            for row in result["host_profile"][kind]:
                print(f"  {kind} {row}", flush=True)
    result["steps"] = rows
    report[tag] = result
    print(f"[{tag}]")
    print(f"{'context':>8} {'AR ms':>7} {'draft':>7} {'verify':>7} {'overhead':>9} {'draft/AR':>9} {'verify/AR':>10}"
          f" {'ms/token':>9} {'speedup':>8} | {'wall':>7} {'outside':>8} {'wall/tau':>9} {'speedup':>8}")
    for r in rows:  # after the bar: host-mode median step (wall, outside the forwards, wall / tau, vs plain)
        host = [r.get(k, float("nan")) for k in ("host_step_wall_median_ms", "host_outside_forwards_median_ms",
                                                  "host_ms_per_token_median", "host_speedup")]
        print(f"{r['context']:>8} {r['ar_step_ms']:>7} {r['draft_ms']:>7} {r['verify_ms']:>7} {r['overhead_ms']:>9}"
              f" {r['draft_vs_ar']:>9} {r['verify_vs_ar']:>10} {r['ms_per_token']:>9} {r['speedup']:>8} |"
              f" {host[0]:>7} {host[1]:>8} {host[2]:>9} {host[3]:>8}", flush=True)


def summary(report: dict) -> str:
    """One markdown table of every speculative run in the report, next to plain decoding."""
    plain = report.get("ar_step_ms", {})
    lines = [f"plain decoding: {report.get('plain_attention_backend', '?')} backend, "
             + ", ".join(f"{float(v):.2f} ms/token at {k}" for k, v in plain.items()), "",
             "| run | backend | greedy equal | context | tau | ms/token | speedup | draft ms | verify ms"
             " | step wall (median) | outside forwards (median) |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for tag, run in report.items():
        if not isinstance(run, dict) or "steps" not in run:
            continue
        equal = sum(e["identical"] for e in run.get("equality", []))
        for r in run["steps"]:
            cells = [tag, run.get("attention_backend_used"), f"{equal}/{len(run.get('equality', []))}", r["context"],
                     r.get("tau"), r.get("ms_per_token"), r.get("speedup"), r.get("draft_ms"), r.get("verify_ms"),
                     r.get("host_step_wall_median_ms"), r.get("host_outside_forwards_median_ms")]
            lines.append("| " + " | ".join("-" if c is None else str(c) for c in cells) + " |")
    return "\n".join(lines) + "\n"


OWL_BEAMS = ("eager", "graph", "fused_graph", "compiled_graph")


def phase_owl(args, report: dict) -> None:
    """Each width's beams at each ``--drafter-weights`` setting; the report's key is
    ``WIDTHxVOCAB`` for bf16 (as ever) and ``WIDTHxVOCAB-fp8`` for fp8."""
    first = str(args.contexts[0])
    ar_ms = report.get("ar_step_ms", {}).get(first, float("nan"))
    vocab = LLAMA_8B["vocab_size"]
    draft_vocab = args.owl_draft_vocab if 0 < args.owl_draft_vocab < vocab else vocab
    rows = []
    for width in args.owl_width:
        for weights in args.drafter_weights:
            with gemm_table(weights):
                r = owl_drafter_ms(width, draft_vocab, args.owl_compile, args.profile, weights)
            r.update(width=width, draft_vocab=draft_vocab, ar_context=int(first))
            for name in OWL_BEAMS[1:]:
                if f"{name}_ms" in r:
                    r[f"{name}_vs_ar"] = round(r[f"{name}_ms"] / ar_ms, 3)
            key = f"{width}x{draft_vocab}" + ("" if weights == "bf16" else f"-{weights}")
            report.setdefault("owl_drafter", {})[key] = r
            rows.append(r)
            print(f"OWL drafter (width {width}, draft vocabulary {draft_vocab}, {weights} weights, depth 8, top-k 10, "
                  f"30 nodes; x = share of an AR step at {first}): {r}", flush=True)
    print(f"OWL drafter, ms per tree (AR step at {first}: {ar_ms:.3f} ms)")
    print(f"{'width':>6} {'vocab':>7} {'weights':>7} " + " ".join(f"{b:>14}" for b in OWL_BEAMS))
    for r in rows:
        cells = [f"{r[f'{b}_ms']:>14}" if f"{b}_ms" in r else f"{'-':>14}" for b in OWL_BEAMS]
        print(f"{r['width']:>6} {r['draft_vocab']:>7} {r['weights']:>7} " + " ".join(cells), flush=True)


def phase_longspec(args, report: dict) -> None:
    r = longspec_drafter_ms(args.contexts, args.longspec_batch, draft_vocab=args.longspec_draft_vocab,
                            profile_dir=args.profile, weights=tuple(args.drafter_weights),
                            compiled=args.longspec_compile)
    plain = report.get("ar_step_ms", {})
    missing = [L for L in args.contexts if str(L) not in plain]
    if missing:  # the ratios need plain decoding's step from the same --out
        print(f"No plain decode step in {args.out} at {missing}: the drafter's times stand alone; "
              f"`--phase plain --out {args.out}` first gives their ratio to a plain step.", flush=True)
    for L in args.contexts:
        ar_ms = plain.get(str(L))
        row = r[str(L)]
        row["ar_step_ms"] = None if ar_ms is None else round(ar_ms, 3)
        if ar_ms is not None:
            for key in [k for k in row if k.endswith("_ms") and k != "ar_step_ms"]:
                row[f"{key[:-3]}_vs_ar"] = round(row[key] / ar_ms, 3)
        head = (f"full head {r['vocab']} and reduced_ {r['draft_vocab']} rows" if r["draft_vocab"] < r["vocab"]
                else f"full head {r['vocab']}")
        print(f"LongSpec drafter ({args.longspec_batch} request(s), beam [4,16,16,16,16] cut to 63, window 512, "
              f"{head}) at {L}: {row}", flush=True)
    heads = ("", "reduced_") if r["draft_vocab"] < r["vocab"] else ("",)
    print(f"LongSpec drafter, graphed step ms (x AR step), {args.longspec_batch} request(s): "
          f"full head {r['vocab']}" + (f" | reduced {r['draft_vocab']}" if len(heads) > 1 else ""))
    print(f"{'context':>8} {'weights':>7} " + " ".join(f"{'full' if h == '' else 'reduced':>18}" for h in heads))
    for L in args.contexts:
        row = r[str(L)]
        for weights in args.drafter_weights:
            prefix = "" if weights == "bf16" else f"{weights}_"
            beams = (("graph", weights), ("compiled_graph", f"{weights}+c"),
                     ("compiled_graph_split_window", f"{weights}+c-w"))[: 1 + 2 * args.longspec_compile]
            for beam, label in beams:
                cells = []
                for h in heads:
                    ms, x = row.get(f"{prefix}{h}beam_{beam}_ms"), row.get(f"{prefix}{h}beam_{beam}_vs_ar")
                    cells.append(f"{'-' if ms is None else f'{ms}' if x is None else f'{ms} ({x}x)':>18}")
                print(f"{L:>8} {label:>7} " + " ".join(cells), flush=True)
    report["longspec_drafter"] = r


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=Path("tokenswift_gpu_check.json"))
    p.add_argument("--phase", choices=("all", "plain", "spec", "owl", "longspec"), default="all",
                   help="run one part; results accumulate in --out (spec needs plain's)")
    p.add_argument("--tokens", type=int, default=2048, help="greedy tokens per prompt for the equality check")
    p.add_argument("--prompts", type=int, default=2)
    p.add_argument("--contexts", type=int, nargs="+", default=[4096, 98304])
    p.add_argument("--timed-tokens", type=int, default=256)
    p.add_argument("--timed-sampling", choices=("greedy", "sampled"), default="greedy",
                   help="end-to-end timing: greedy, or temperature 1 with speculation on every step (ms/token = "
                        "ms/step on dummy weights)")
    p.add_argument("--budget", type=int, default=4096, help="partial KV budget B")
    p.add_argument("--partial-kv-policy", choices=("tokenswift", "verify"), default="tokenswift",
                   help="TOKENSWIFT's partial-KV selection ([tokenswift.partial_kv] policy of the heads' longgen.toml)")
    p.add_argument("--draft-tokens", type=int, default=64, help="speculative_num_draft_tokens")
    p.add_argument("--attention-backend", default=None,
                   help="backend of the speculative engine (default: SGLang's choice with our plugin loaded)")
    p.add_argument("--plain-attention-backend", default=None,
                   help="backend of plain decoding (default: SGLang's choice, fa3 on Hopper)")
    p.add_argument("--mem-fraction", type=float, default=0.8)
    p.add_argument("--algorithms", "--algorithm", dest="algorithms", nargs="+", choices=ALGORITHMS,
                   default=["TOKENSWIFT"],
                   help="speculative algorithms of the spec phase, one engine each, in order, on the same prompts "
                        "(OWL/HOWL: a random drafter of --owl-width[0] and --owl-draft-vocab; LONGSPEC: a random "
                        "drafter block, window 512, --longspec-draft-vocab; NGRAM: SGLang's own, the peer; its "
                        "--draft-tokens is --ngram-draft-tokens)")
    p.add_argument("--drafter-tree-size", type=int, default=None, metavar="N",
                   help="spec phase, OWL/HOWL/LONGSPEC: draft nodes per tree (the drafter directory's [owl] / "
                        "[longspec] tree_size; OWL verifies 2N + 2 rows with [SPEC], so --draft-tokens must hold "
                        "them; default: the method's)")
    p.add_argument("--spec-drafter-beam", choices=("torch", "compiled", "fused"), default=None,
                   help="spec phase, OWL/HOWL/LONGSPEC: the drafter directory's [owl] / [longspec] beam (LONGSPEC: "
                        "torch or compiled; default: the method's)")
    p.add_argument("--spec-drafter-weights", choices=("bf16", "fp8"), default="bf16",
                   help="spec phase, OWL/HOWL/LONGSPEC: the drafter's weights ([owl] / [longspec] weights)")
    p.add_argument("--ngram-draft-tokens", type=int, default=NGRAM_DRAFT_TOKENS, help="speculative_num_draft_tokens of NGRAM")
    p.add_argument("--no-cuda-graph", action="store_true", help="speculative engine without CUDA graphs")
    p.add_argument("--step-detail", type=int, default=128, metavar="TOKENS",
                   help="after the untimed runs at each context, a request of this many tokens per --detail-modes "
                        "mode whose steps are timed (custom_params longgen_timing); the draft / verify / overhead "
                        "columns come from it (0: no timed requests, those columns stay empty)")
    p.add_argument("--detail-modes", "--timing-modes", dest="detail_modes", nargs="+", choices=("host", "sync"),
                   default=["host", "sync"],
                   help="timing modes of the timed requests: host times undisturbed (plus the forwards' GPU "
                        "spans, the step wall and what of it lies outside the forwards), sync each section")
    p.add_argument("--host-profile", type=int, default=0, metavar="TOKENS",
                   help="after the last context's runs, this many tokens with the worker's decode steps under "
                        "cProfile; the heaviest functions go into the report (0: skip)")
    p.add_argument("--owl-width", type=int, nargs="+", default=[4096], help="OWL drafter widths for the drafting-cost check")
    p.add_argument("--owl-compile", action="store_true", help="also time the torch.compile'd beam")
    p.add_argument("--owl-draft-vocab", type=int, default=32768, help="OWL drafter head rows (random token map; 0: full vocabulary)")
    p.add_argument("--longspec-batch", type=int, default=1, help="requests of the LongSpec beam timing (--phase longspec)")
    p.add_argument("--longspec-compile", action="store_true",
                   help="--phase longspec: also time the worker's step torch.compile'd before its capture, also "
                        "with a level's rows written into the window buffers by torch ops (+c-w)")
    p.add_argument("--longspec-draft-vocab", type=int, default=32768, metavar="N",
                   help="the LongSpec beam timing also with a reduced draft vocabulary: N rows of the head at a random "
                        "token map (0: the full head only); the spec phase's LONGSPEC drafter has it (0: the full head)")
    p.add_argument("--drafter-weights", nargs="+", choices=tuple(DRAFTER_WEIGHTS), default=["bf16"],
                   help="--phase owl / longspec: time the drafter with these weight settings, side by side (fp8: "
                        "its matrices as e4m3 with row scales, the drafters' weights = \"fp8\"; fp8-bf16: the same, "
                        "the fp8 GEMM's product in bf16, not the table's fp16; fp8-addr: the matrices' tiles read "
                        "by addresses, not through the table's tensor descriptors; fp8-sums: a split GEMM's sums "
                        "added by a kernel of its own in the compiled step, not inside the next kernel)")
    p.add_argument("--profile", type=Path, metavar="DIR",
                   help="--phase owl / longspec: the graphed drafters' per-kernel totals into DIR")
    return p


def main(argv: list[str] | None = None) -> int:
    p = parser()
    args = p.parse_args(argv)
    if args.longspec_draft_vocab < 0:
        p.error(f"--longspec-draft-vocab must be 0 or more, got {args.longspec_draft_vocab}")
    if len(set(args.drafter_weights)) != len(args.drafter_weights):
        p.error(f"--drafter-weights lists a setting twice: {args.drafter_weights}")

    rng = random.Random(0)
    root = Path(tempfile.mkdtemp(prefix="longgen_gpu_check_"))
    model, heads = make_checkpoints(root, args.budget, args.partial_kv_policy)
    prompts = [[rng.randrange(1000, 120000) for _ in range(512)] for _ in range(args.prompts)]
    long_prompts = {L: [rng.randrange(1000, 120000) for _ in range(L)] for L in args.contexts}
    report = load_report(args.out)
    report.setdefault("config", {}).update({k: str(v) for k, v in vars(args).items()})
    if args.phase in ("all", "plain"):
        phase_plain(args, model, prompts, long_prompts, report)
        save_report(args.out, report)
    if args.phase in ("all", "spec"):
        for algorithm in args.algorithms:
            run_args = argparse.Namespace(**vars(args), algorithm=algorithm)
            if algorithm == "NGRAM":
                run_args.draft_tokens, run_args.step_detail = args.ngram_draft_tokens, 0  # SGLang's worker: untimed
            draft = {"TOKENSWIFT": lambda: heads, "NGRAM": lambda: None,
                     "LONGSPEC": lambda: make_longspec_drafter(root, draft_vocab=args.longspec_draft_vocab)}.get(
                algorithm, lambda: make_owl_drafter(root, args.owl_width[0], args.owl_draft_vocab))()
            try:
                phase_spec(run_args, model, draft, prompts, long_prompts, report)
            except Exception as exc:  # one method's failure must not lose the others' numbers
                report[f"{algorithm.lower()}_error"] = f"{type(exc).__name__}: {exc}"[:500]
                print(f"[{algorithm}] failed: {exc}", flush=True)
            save_report(args.out, report)
            args.out.with_suffix(".md").write_text(summary(report))
        print(summary(report), flush=True)
    if args.phase in ("all", "owl"):
        phase_owl(args, report)
        save_report(args.out, report)
    if args.phase in ("all", "longspec"):
        phase_longspec(args, report)
        save_report(args.out, report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
