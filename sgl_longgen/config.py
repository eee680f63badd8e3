"""Typed configuration, loadable from TOML.

Every knob of the algorithms lives in one of these structs. They are strict: an unknown key or a
value out of range is an error that names the offending field (``$.tokenswift.partial_kv.budget``),
because a typo in a 100K-token job should fail in the first second, not after an hour.
"""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

from .errors import LonggenError

NonNegInt = Annotated[int, Meta(ge=0)]
PosInt = Annotated[int, Meta(ge=1)]
Prob = Annotated[float, Meta(ge=0.0, le=1.0)]
# A drafter's matrices: "bf16" in the engine's dtype (bf16 on a GPU engine; the reference runtime's
# float64), "fp8" as e4m3 with one scale per row (sgl_longgen.core.fp8).
DrafterWeights = Literal["bf16", "fp8"]


class Strict(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """The base of every settings struct of the project (generation, batch jobs, trainers).

    One base, so every settings file a user writes follows the same rule: an unknown key (a typo)
    is an error that names it, never a setting silently left at its default. msgspec does not
    pass ``kw_only`` on to subclasses' own fields: a struct with a required field after optional
    ones says ``kw_only=True`` itself (as ``JobSpec`` does).
    """


class SamplingConfig(Strict):
    """The target distribution: what plain decoding would sample from.

    ``temperature == 0`` means greedy: the argmax of the penalized logits. ``penalty`` is
    TokenSwift's contextual penalty theta (1.0 disables it), applied to the distinct tokens among
    the last ``penalty_window`` tokens of the context.
    """

    temperature: Annotated[float, Meta(ge=0.0)] = 0.0
    top_p: Annotated[float, Meta(gt=0.0, le=1.0)] = 1.0
    top_k: NonNegInt = 0
    min_p: Prob = 0.0
    eta: Annotated[float, Meta(ge=0.0, lt=1.0)] = 0.0
    min_tokens_to_keep: PosInt = 1
    penalty: Annotated[float, Meta(ge=1.0)] = 1.0
    penalty_window: NonNegInt = 1024
    # "sequential": each filter sees the renormalised output of the previous one (HF / TokenSwift).
    # "joint": top-k, top-p and min-p all judge the same post-temperature distribution (SGLang).
    filter_order: Literal["sequential", "joint"] = "sequential"

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def penalty_active(self) -> bool:
        return self.penalty > 1.0 and self.penalty_window > 0


class NgramConfig(Strict):
    """Token reutilization: n-grams of the history proposed as extra draft paths."""

    enabled: bool = True
    n: Annotated[int, Meta(ge=2, le=16)] = 4
    top_k: NonNegInt = 20
    # Upstream TokenSwift never indexes n-grams inside the penalty window (their tokens are
    # penalized, so they rarely verify). Only has an effect while the penalty is active.
    exclude_penalty_window: bool = True


class PartialKVConfig(Strict):
    """Dynamic partial KV cache for the draft forward (TokenSwift Eq. 2)."""

    budget: PosInt = 4096
    sinks: NonNegInt = 16
    # "shared": one set of positions for every layer and KV head (softmax scores summed), what an
    # engine with one KV index list per request (SGLang's) can pass to its attention. "head": one
    # set per (layer, KV head), as in the paper; the reference runtime only.
    granularity: Literal["head", "shared"] = "shared"
    # Where the selection comes from. "tokenswift": the paper's rule, the draft root's query scores
    # the whole context once the positions committed since the last selection fill the budget
    # (every ``budget - sinks`` tokens). "verify" (SpecAttn's verification-guided selection): every
    # verify forward also yields the pre-softmax logits of two tree rows (the root and the first
    # draft token) against the committed keys, averaged over query heads, and their top positions
    # per layer ("shared": per layer; "head": per layer and KV head) become the next draft's partial
    # KV: refreshed every step from queries closer to what the draft predicts, at the cost of one
    # score row per key in the verify. The first draft after the prompt still uses the "tokenswift"
    # rule (no verify has run yet). Either way the selection only changes the draft, never the
    # verify, so the output is the same. SGLang: with the longgen and longgen_torch attention
    # backends (the verify writes the scores; the draft forward reads one slot list per layer).
    policy: Literal["tokenswift", "verify"] = "tokenswift"

    def __post_init__(self) -> None:
        if self.sinks >= self.budget:
            raise ValueError(f"sinks ({self.sinks}) must be smaller than budget ({self.budget})")


class TokenSwiftConfig(Strict):
    """Multi-head self-drafting with n-gram reuse and a dynamic partial KV cache."""

    tree: list[PosInt] = msgspec.field(default_factory=lambda: [1, 3, 3, 3])
    ngram: NgramConfig = msgspec.field(default_factory=NgramConfig)
    partial_kv: PartialKVConfig = msgspec.field(default_factory=PartialKVConfig)
    # The history's own longest continuation (SuffixDecoding's draft, with the [suffix] settings)
    # as one more path of the trie: a repeating stretch is drafted past the head tree's depth.
    suffix: bool = True

    def __post_init__(self) -> None:
        if not self.tree:
            raise ValueError("tree must list at least one depth")
        if self.tree[0] != 1:
            # Depth 1 comes from the base LM head; more than one candidate there would need the
            # n-gram key to be ambiguous. Keep the upstream shape.
            raise ValueError(f"tree[0] must be 1 (the base head's top-1), got {self.tree[0]}")

    @property
    def num_heads(self) -> int:
        """Extra heads needed: depth 1 is the model's own LM head."""
        return len(self.tree) - 1


class OwlConfig(Strict):
    """OWL: an LSTM drafter conditioned on the last accepted state expands an EAGLE-style tree.

    The tree is a beam over the drafter: ``top_k`` children per node and ``top_k`` frontier nodes
    per level, ``depth`` levels, then the ``tree_size`` most likely nodes (by cumulative drafter
    log-probability; the selection is closed under ancestors). ``tree_size`` counts *draft* nodes,
    the root excluded. With ``spec`` on, the root and every draft node also get one [SPEC] leaf, so
    the verify forward holds ``2 * tree_size + 2`` rows: the paper's "30 drafts + 30 [SPEC]" budget
    is ``tree_size = 30``; without [SPEC], ``tree_size = 60`` gives the same verify width.
    ``prefill_spec`` appends one [SPEC] after the prompt so the first round is conditioned on it
    (off: the first round uses the drafter's learned null vector instead). ``beam``: how the
    SGLang workers expand the tree on a GPU, always replayed as a CUDA graph: ``fused`` (Triton
    kernels, six launches per level), ``compiled`` (``torch.compile`` of the PyTorch beam: a
    slower start) or ``torch``. CPU runs and the reference runtime use the PyTorch beam. The
    variants round differently in their last bits, so their trees can differ slightly; each is
    verified exactly. ``weights``: ``"fp8"`` stores the drafter's LSTM projections and draft head
    as e4m3 with one scale per row, quantized once at load (:mod:`sgl_longgen.core.fp8`: half the
    bytes its weight-bound steps read; fp8 GEMMs on CUDA devices of compute capability 8.9 and up,
    a dequantizing twin elsewhere); ``"bf16"`` keeps them in the engine's dtype. Either way only
    the drafts change, never the output.
    """

    top_k: Annotated[int, Meta(ge=1, le=64)] = 10
    depth: Annotated[int, Meta(ge=1, le=64)] = 8
    tree_size: Annotated[int, Meta(ge=1, le=1024)] = 30
    spec: bool = True
    prefill_spec: bool = True
    beam: Literal["fused", "compiled", "torch"] = "fused"
    weights: DrafterWeights = "bf16"


class LongSpecConfig(Strict):
    """LongSpec: a one-block drafter (sliding-window self-attention over its own tokens,
    cross-attention into the target's committed last-layer KV) expands a beam tree.

    ``widths``: nodes kept per level (LongSpec's ``[4, 16, 16, 16, 16]``): level 1 is the root's
    ``widths[0]`` likeliest tokens, level i the ``widths[i-1]`` likeliest (parent, token) pairs
    below level i - 1 by cumulative drafter log-probability. ``tree_size``: draft nodes verified
    (the root excluded), the best of the pool by the same score, closed under ancestors; the
    default keeps 63 of the 68, a verify forward of 64 rows. The window size is the checkpoint's
    (``longspec.json``): it fixes the drafter's memory per request. ``weights``: ``"fp8"`` stores
    the block's projections, its MLP and its head as e4m3 with one scale per row, quantized once at
    load (see :class:`OwlConfig`); the head (the target's LM head, or its rows at the token map)
    becomes an fp8 copy the drafter owns, beside the target's own. ``"bf16"``: the engine's dtype.
    ``beam``: how the SGLang worker runs a draft step on a GPU, always replayed as a CUDA graph:
    ``torch`` (the PyTorch step) or ``compiled`` (``torch.compile`` of it, our kernels as opaque
    nodes of the trace: inductor fuses the levels' norms, RoPE, masks and bookkeeping; a slower
    first step of each batch size, which compiles it). CPU runs and the reference runtime run the PyTorch
    step. The two round differently in their last bits, so their trees can differ slightly; each
    is verified exactly.
    """

    widths: list[Annotated[int, Meta(ge=1, le=1024)]] = msgspec.field(default_factory=lambda: [4, 16, 16, 16, 16])
    tree_size: Annotated[int, Meta(ge=1, le=1024)] = 63
    weights: DrafterWeights = "bf16"
    beam: Literal["torch", "compiled"] = "torch"

    def __post_init__(self) -> None:
        if not 1 <= len(self.widths) <= 64:
            raise ValueError(f"widths must list 1 to 64 levels, got {len(self.widths)}")


class SuffixConfig(Strict):
    """SuffixDecoding's linear drafts: the most frequent continuation of the context's suffix.

    Indexed: the request's prompt and output (and, with ``global_requests > 0``, the outputs of
    the last ``global_requests`` finished requests; eviction is lazy, so up to twice that many
    may be matched between rebuilds). A match of length p (p < ``max_depth``) may draft up to
    ``min(max_spec_tokens, floor(max_spec_factor * p + max_spec_offset))`` tokens (read from the
    history, so ``max_depth`` bounds only the match);
    drafting stops when the estimated probability of the path falls below ``min_token_prob``. The
    score (sum of those probabilities) estimates the number of accepted tokens. A request's own
    history also reads its draft as history (a stretch seen once is drafted past the history's
    end), and a context ending in back-to-back copies of a period over at least
    ``loop_min_tokens`` tokens (a loop) drafts up to ``max_spec_tokens`` whatever its match length
    (0: no loop rule). Both apply to HOWL's chains and TokenSwift's suffix path. A query reads
    the latest ``max_occurrences`` occurrences of the context's last token (0: all), so its cost
    stays bounded on a loop. The past outputs are also bounded in tokens: at most
    ``global_tokens`` of the latest ones are kept (an output longer than that, its last
    ``global_tokens``).

    SUFFIX drafts a tree from the same settings (SuffixDecoding's tree mode): ``max_spec_tokens``
    and ``floor(max_spec_factor * p + max_spec_offset)`` count its nodes, the most frequent
    continuations first, and ``min_token_prob`` bounds each node's estimated probability.
    """

    max_depth: Annotated[int, Meta(ge=2, le=1024)] = 64
    max_spec_tokens: PosInt = 64
    max_spec_factor: Annotated[float, Meta(ge=0.0)] = 2.0
    max_spec_offset: float = 0.0
    min_token_prob: Prob = 0.1
    global_requests: NonNegInt = 0
    global_tokens: PosInt = 1 << 22
    loop_min_tokens: NonNegInt = 8
    # Occurrences of the context's last token a query reads, the latest first (0: all): bounds a
    # query's cost on a loop, whose copies grow without bound.
    max_occurrences: NonNegInt = 1024


class HowlConfig(Strict):
    """HOWL: a linear suffix draft when its score exceeds ``threshold`` (c), else an OWL tree.

    The default c = 9 is the longest acceptance an OWL tree of depth 8 can reach (8 drafts + the
    bonus token), so the suffix path is taken only when it is expected to beat OWL's best case.
    """

    threshold: Annotated[float, Meta(ge=0.0)] = 9.0


class AdaptiveConfig(Strict):
    """Adaptive speculation: per request, a plain decode step whenever speculating does not pay.

    Each step compares expected tokens per second: the decayed mean of tokens committed per
    speculative step over its measured cost, against one token over a plain step's cost (see
    :mod:`sgl_longgen.core.adaptive`). Lossless: every step, of either kind, commits tokens drawn
    from the target distribution, and the choice depends only on past steps. ``decay``: weight kept
    per step by the acceptance mean (and per sample by the cost averages). ``warmup``: speculative
    steps before the first decision. While plain steps win, a speculative probe once the plain steps
    since the last speculative one took ``probe_every`` times a speculative step's cost (probing
    costs at most ``1 / (probe_every + 1)`` of the time), that interval multiplied by
    ``probe_growth`` (up to ``probe_max``) after each probe that does not pay. ``refresh_every``:
    while speculating, one plain step in that many re-measures the plain cost (0: never). Where plain
    steps win, the method's hint (HOWL's and TOKENSWIFT's suffix draft score of the committed text)
    can still make a step speculative, calibrated by what hinted steps accepted. The mix
    of steps follows measured times, so a sampled run's seed no longer pins its output (greedy
    output is always plain decoding's), which is why it is off by default: runs, resumed batch jobs
    included, stay reproducible unless it is asked for. SUFFIX, which drafts for models nobody
    trained a drafter for, has it on by default (:data:`METHOD_DEFAULTS`). In SGLang (a draft directory's
    ``longgen.toml`` or ``SGLANG_LONGGEN_ADAPTIVE=1``) one kind of step per batch, from costs measured
    per batch size and context length; requests override it (see :mod:`sgl_longgen.sglang.adaptive`).

    ``widths``: narrower verify widths a speculative step may take besides the method's whole
    draft, in trie nodes *including the root*: the method's ``max_nodes``, which cuts its trie to
    its first nodes in creation order (parents before children, so the cut keeps a path's head:
    TokenSwift's shallow head levels, then its suffix and n-gram paths; OWL's and LongSpec's
    shallow beam levels; HOWL's chain to ``width - 1`` tokens). OWL's [SPEC] leaves come on top
    (a verify of ``2 * width`` rows). Each step then takes the width, or a plain step, expected to
    give the most tokens per second (see :mod:`sgl_longgen.core.adaptive`); a width at or above the
    method's largest trie is its whole draft. Positive, without duplicates, sorted on load. Empty
    (the default): the whole draft only. In SGLang one width per batch, each width's verify through
    CUDA graphs captured for it at startup (a width whose verify is not narrower than
    ``speculative_num_draft_tokens`` rows is the whole draft).
    ``full_every``: while a narrower width wins, one speculative step in that many takes the whole
    draft, so the acceptance estimates of the wider widths keep following the text.
    """

    enabled: bool = False
    decay: Annotated[float, Meta(gt=0.0, lt=1.0)] = 0.9
    warmup: PosInt = 1
    probe_every: PosInt = 8
    probe_growth: Annotated[float, Meta(ge=1.0, le=16.0)] = 4.0
    probe_max: PosInt = 256
    refresh_every: NonNegInt = 64
    widths: list[PosInt] = msgspec.field(default_factory=list)
    full_every: PosInt = 16

    def __post_init__(self) -> None:
        if self.probe_max < self.probe_every:
            raise ValueError(f"probe_max ({self.probe_max}) must be at least probe_every ({self.probe_every})")
        if len(set(self.widths)) != len(self.widths):
            dup = sorted({w for w in self.widths if self.widths.count(w) > 1})
            raise ValueError(f"widths lists {dup[0]} more than once")
        self.widths = sorted(self.widths)


class RuntimeConfig(Strict):
    """The pure-PyTorch reference runtime."""

    # float64 by default: the reference runtime is the losslessness oracle, and in float64 the
    # 1-token decode and the T-token verify forward agree far below any logit gap.
    dtype: Literal["float32", "float64", "bfloat16"] = "float64"
    device: str = "cpu"
    threads: NonNegInt = 0  # 0: leave torch's default


Method = Literal["ar", "tokenswift", "owl", "howl", "longspec", "suffix"]

# SGLang's ``--speculative-algorithm`` for each speculative method (this package's plugin registers
# them); plain decoding ("ar") has none.
SPECULATIVE_ALGORITHMS: dict[str, str] = {
    "tokenswift": "TOKENSWIFT", "owl": "OWL", "howl": "HOWL", "longspec": "LONGSPEC", "suffix": "SUFFIX",
}

# A method's own defaults: a layer between the built-in ones and every settings file or flag
# (:func:`with_method_defaults`). SUFFIX drafts for any model, trained for or not: adaptive
# speculation keeps it from ever costing more than plain decoding, and picks each step's verify
# width (its trie cut to 4 or 16 nodes, or whole) from what the text gets accepted.
METHOD_DEFAULTS: dict[str, dict[str, Any]] = {
    "suffix": {"adaptive": {"enabled": True, "widths": [4, 16]}},
}


class GenerateConfig(Strict):
    """Everything ``sgl-longgen generate`` needs besides the model and the prompt."""

    method: Method = "tokenswift"
    max_new_tokens: PosInt = 2048
    seed: int = 0
    ignore_eos: bool = False
    sampling: SamplingConfig = msgspec.field(default_factory=SamplingConfig)
    tokenswift: TokenSwiftConfig = msgspec.field(default_factory=TokenSwiftConfig)
    owl: OwlConfig = msgspec.field(default_factory=OwlConfig)
    longspec: LongSpecConfig = msgspec.field(default_factory=LongSpecConfig)
    suffix: SuffixConfig = msgspec.field(default_factory=SuffixConfig)
    howl: HowlConfig = msgspec.field(default_factory=HowlConfig)
    adaptive: AdaptiveConfig = msgspec.field(default_factory=AdaptiveConfig)
    runtime: RuntimeConfig = msgspec.field(default_factory=RuntimeConfig)


def _error_for(exc: msgspec.ValidationError, source: str) -> LonggenError:
    return LonggenError(f"invalid config {source}: {exc}")


def load_toml(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    if not path.is_file():
        raise LonggenError(f"config file not found: {path}")
    try:
        return tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as exc:
        raise LonggenError(f"config file {path} is not valid TOML: {exc}") from None


def convert(data: dict[str, Any], cls: type[msgspec.Struct], source: str = "") -> Any:
    """Build a struct from plain data; errors name the field and the source."""
    try:
        return msgspec.convert(data, cls)
    except msgspec.ValidationError as exc:
        raise _error_for(exc, source or cls.__name__) from None


def merge(base: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    """Recursive dict merge: ``override`` wins, nested tables merge key by key."""
    out = dict(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merge(out[key], value)
        else:
            out[key] = value
    return out


def to_dict(struct: msgspec.Struct) -> dict[str, Any]:
    return msgspec.to_builtins(struct)


def with_method_defaults(data: dict[str, Any]) -> dict[str, Any]:
    """Generation settings ``data`` over the defaults of the method they name
    (:data:`METHOD_DEFAULTS`): what ``data`` sets wins, key by key."""
    method = data.get("method", GenerateConfig().method)
    own = METHOD_DEFAULTS.get(method) if isinstance(method, str) else None
    return merge(own, data) if own else data


def load_generate_config(path: str | Path | None, overrides: dict[str, Any] | None = None) -> GenerateConfig:
    """TOML file (optional) plus command-line overrides over the method's own defaults, validated as one struct."""
    data: dict[str, Any] = load_toml(path) if path else {}
    if overrides:
        data = merge(data, overrides)
    return convert(with_method_defaults(data), GenerateConfig, str(path) if path else "from the command line")
