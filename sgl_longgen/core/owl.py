"""OWL's LSTM drafter, its checkpoint format and its batched tree expansion.

The drafter (a "sum-LSTM", as in the Arctic LSTM speculator OWL builds on) is conditioned only on
the target's last *post-final-norm* hidden state and the last sampled token, never on the context
window, so its quality does not degrade with context length. One step:

    pre_g = W_step x + alpha * E[t]               for the gates g = f, i, o, c (one 4d projection)
    f, i, o = sigmoid(pre_f), sigmoid(pre_i), sigmoid(pre_o)
    z = z_prev * f + GELU(Norm_cell(pre_c)) * i   (z_0 = 0 at every draft round)
    h = GELU(Norm_state(z)) * o ;  logits = Head(h)

Step 1 reads ``x = [scale(h_last); scale(h_S)]`` through its own projection ``proj0``; steps >= 2
read the drafter's own state through ``proj1``. ``h_S`` is the hidden state of the [SPEC] token
that followed the accepted path in the last verify forward: the target's own look-ahead. When no
[SPEC] state exists (right after a linear HOWL step, or the first round without a prefill [SPEC])
a learned null vector takes its place, so one checkpoint serves as both of the paper's D_spec and
D_nospec (it is trained with [SPEC] dropout). ``alpha`` follows the reference code, not the
paper's garbled Eq. 4: ``alpha = sqrt((1 - a0^2) d / 2) / a0`` with ``a0 = 0.5 ** (0.5 / n)``, so
the token embedding carries a fixed share of the state's variance by the last step.

The trained [SPEC] *input* embedding of the frozen target (a ``[hidden_size]`` vector) lives in the
same checkpoint: a directory with ``owl.json`` (shape, provenance, spec settings) and
``owl.safetensors``, optionally ``longgen.toml`` with the checkpoint's defaults.

**Reduced draft vocabulary.** The head may cover only ``draft_vocab_size`` N < V target tokens,
listed by the ``token_map`` buffer (draft id -> target id; EAGLE-3's token map). For an 8B target
the full head (128K rows, 1 GB in bf16 at width 4096) is read at each of the 8 steps of a round
and dominates the drafter's cost. The N most frequent tokens of the target's own outputs cover
most of what it emits, so an N-row head costs N/V of that traffic and gives up only drafts of
rarer tokens: those are never proposed, and verification stays exact whatever the drafter drafts.
The token *embedding* stays over the full vocabulary, because the root and every accepted token
that feeds the next round can be any target token. Checkpoints without ``draft_vocab_size`` in
``owl.json`` are full-vocabulary drafters.

**FP8 weights** (:func:`quantize_fp8`, ``[owl] weights = "fp8"``): the two projections and the
head, the matrices every beam level reads, stored as e4m3 with one scale per row
(:mod:`.fp8`), for half the memory traffic of a weight-bound beam. The embedding stays as it is
(a level reads only its rows' entries). Only the drafts change, never what verification commits.

The tree (:func:`expand`) is EAGLE-2's dynamic beam over the drafter: ``top_k`` children per
frontier node, ``top_k`` frontier nodes per level, ``depth`` levels, then the ``tree_size`` best
nodes of the whole pool by cumulative log-probability. Everything is batched over requests and
returned as fixed-shape tensors, so an engine can build its verify inputs without host syncs;
:func:`beam_trees` turns them into :class:`DraftTree` tries for the reference runtime.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import nn

from ..errors import LonggenError
from .draft_vocab import DraftVocabulary, check_token_map_file
from .fp8 import quantize_linears
from .tree import DraftTree, Source, add_beam
from .weights import check_shapes, expected_shapes, header_shapes, read_config, read_weights

logger = logging.getLogger(__name__)

FORMAT = "sgl-longgen.owl-drafter"
VERSION = 1
CONFIG_FILE = "owl.json"
WEIGHTS_FILE = "owl.safetensors"
SQRT2 = math.sqrt(2.0)
FP8_LAYERS = ("proj0", "proj1", "head")  # what ``weights = "fp8"`` quantizes


def embedding_scale(n_steps: int, width: int) -> float:
    """alpha, the token embedding's weight relative to the projected state (reference-code formula).

    ``state_weight = 0.5 ** (0.5 / n)`` and ``emb_weight = sqrt((1 - state_weight^2) * d / 2)``:
    with N(0, 1/d) embeddings the base state then keeps about half of the state's magnitude by the
    n-th step. Only the ratio matters, because a norm follows the sum.
    """
    state_weight = 0.5 ** (0.5 / n_steps)
    emb_weight = math.sqrt((1.0 - state_weight**2) * width / 2.0)
    return emb_weight / state_weight


def rms_scale(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """``scale(v)``: RMS normalisation without parameters, divided by sqrt(2) (two inputs are summed
    in the first projection, each at half the variance)."""
    dtype = x.dtype
    h = x.float() if dtype in (torch.float16, torch.bfloat16) else x
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return (h / SQRT2).to(dtype)


class BiasRMSNorm(nn.Module):
    """The drafter's "layer norm": RMS normalisation (no mean centring) with a learned scale and bias."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))
        self.bias = nn.Parameter(torch.zeros(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.float() if dtype in (torch.float16, torch.bfloat16) else x
        h = (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)).to(dtype)
        return h * self.weight + self.bias


class OwlDrafter(DraftVocabulary, nn.Module):
    """The sum-LSTM drafter plus, when ``spec``, the null [SPEC] state and the [SPEC] embedding.

    ``hidden_size``: the target's hidden size d0. ``width``: the LSTM width d (the paper uses
    12288 for Llama-3.1-8B; the Arctic release uses d0). ``n_steps``: the unroll length it is
    trained for (it sets alpha). ``spec``: the first projection reads ``[h_last; h_S]`` (2 d0)
    instead of ``h_last`` (d0) and the checkpoint carries the [SPEC] vectors. ``draft_vocab_size``:
    rows of the head (default: the whole vocabulary); below ``vocab_size`` the head scores only the
    target ids listed in the ``token_map`` buffer.
    """

    def __init__(self, hidden_size: int, vocab_size: int, width: int, n_steps: int = 8, spec: bool = True,
                 norm_eps: float = 1e-6, draft_vocab_size: int | None = None):
        super().__init__()
        if min(hidden_size, vocab_size, width, n_steps) < 1:
            raise ValueError("hidden_size, vocab_size, width and n_steps must be positive")
        if draft_vocab_size is not None and not 1 <= draft_vocab_size <= vocab_size:
            raise ValueError(f"draft_vocab_size must be in [1, {vocab_size}], got {draft_vocab_size}")
        self.hidden_size, self.vocab_size, self.width = hidden_size, vocab_size, width
        # The whole vocabulary needs no map: a full head keeps the checkpoint format of before.
        self.draft_vocab_size = vocab_size if draft_vocab_size is None else draft_vocab_size
        self.n_steps, self.spec, self.norm_eps = n_steps, spec, norm_eps
        self.alpha = embedding_scale(n_steps, width)
        self.proj0 = nn.Linear(hidden_size * (2 if spec else 1), 4 * width, bias=False)
        self.proj1 = nn.Linear(width, 4 * width, bias=False)
        self.embedding = nn.Embedding(vocab_size, width)  # one table for all four gates and all steps
        self.cell_norm = BiasRMSNorm(width, norm_eps)
        self.state_norm = BiasRMSNorm(width, norm_eps)
        self.head = nn.Linear(width, self.draft_vocab_size, bias=False)  # shared by every step
        self.token_map: torch.Tensor | None
        if self.reduced:
            # Draft id -> target id; a placeholder until set_token_map (or a checkpoint) fills it.
            self.register_buffer("token_map", torch.arange(self.draft_vocab_size, dtype=torch.long))
        else:
            self.token_map = None
        if spec:
            # Stands in for scale(h_S) when no [SPEC] state exists (D_nospec).
            self.null_spec = nn.Parameter(torch.zeros(hidden_size))
            # The [SPEC] token's input embedding for the frozen target.
            self.spec_embedding = nn.Parameter(torch.zeros(hidden_size))

    # -- init ----------------------------------------------------------------------------------

    def reset_parameters(self, generator: torch.Generator | None = None,
                         target_embeddings: torch.Tensor | None = None) -> None:
        """Reference init: matrices ~ N(0, 1/min(shape)), norms at (1, 0).

        The null state starts like a scaled hidden state (N(0, 1/2) per coordinate). The [SPEC]
        embedding starts as a typical row of ``target_embeddings`` (their mean plus noise of their
        spread) so the frozen target first sees an ordinary-looking token.
        """
        with torch.no_grad():
            for w in (self.proj0.weight, self.proj1.weight, self.embedding.weight, self.head.weight):
                w.normal_(0.0, 1.0 / math.sqrt(min(w.shape)), generator=generator)
            for norm in (self.cell_norm, self.state_norm):
                norm.weight.fill_(1.0)
                norm.bias.zero_()
            if self.spec:
                self.null_spec.normal_(0.0, 1.0 / SQRT2, generator=generator)
                if target_embeddings is not None:
                    table = target_embeddings.detach().to(torch.float32).cpu()
                    noise = torch.randn(self.hidden_size, generator=generator) * table.std()
                    self.spec_embedding.copy_(table.mean(0) + noise)
                else:
                    self.spec_embedding.normal_(0.0, 1.0, generator=generator)

    # -- the recurrence ------------------------------------------------------------------------

    def first_input(self, h_last: torch.Tensor, h_spec: torch.Tensor | None = None,
                    has_spec: torch.Tensor | None = None) -> torch.Tensor:
        """Step 1's input ``[scale(h_last); scale(h_S) or null]`` (``[..., 2 d0]``; ``[..., d0]`` without spec).

        ``has_spec`` (bool, one per row) selects the null vector for rows without a [SPEC] state;
        ``h_spec=None`` means none has one.
        """
        x = rms_scale(h_last, self.norm_eps)
        if not self.spec:
            return x
        null = self.null_spec.to(x.dtype).expand_as(x)
        if h_spec is None:
            s = null
        else:
            s = rms_scale(h_spec.to(x.dtype), self.norm_eps)
            if has_spec is not None:
                s = torch.where(has_spec.to(torch.bool)[..., None], s, null)
        return torch.cat([x, s], dim=-1)

    def step(self, x: torch.Tensor, tokens: torch.Tensor, cell: torch.Tensor | None = None,
             first: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """One LSTM step: ``(state, cell)`` after consuming ``tokens`` (``[...]``) with input ``x``.

        ``first``: ``x`` is :meth:`first_input`'s output and the cell starts at zero.
        """
        proj = self.proj0 if first else self.proj1
        pre = proj(x)
        lead = pre.shape[:-1]
        pre = pre.view(*lead, 4, self.width) + (self.alpha * self.embedding(tokens)).to(pre.dtype)[..., None, :]
        f = torch.sigmoid(pre[..., 0, :])
        i = torch.sigmoid(pre[..., 1, :])
        o = torch.sigmoid(pre[..., 2, :])
        candidate = F.gelu(self.cell_norm(pre[..., 3, :])) * i
        cell = candidate if (first or cell is None) else cell * f + candidate
        state = F.gelu(self.state_norm(cell)) * o
        return state, cell

    def unroll(self, h_last: torch.Tensor, tokens: torch.Tensor, h_spec: torch.Tensor | None = None,
               has_spec: torch.Tensor | None = None) -> list[torch.Tensor]:
        """Teacher-forced states for training: ``tokens[..., j]`` is consumed at step j + 1.

        ``tokens[..., 0]`` is the token sampled from ``h_last``; step j's state predicts the token
        after ``tokens[..., j]``. Returns one ``[..., d]`` state per step.
        """
        x = self.first_input(h_last, h_spec, has_spec)
        state, cell = self.step(x, tokens[..., 0], None, first=True)
        states = [state]
        for j in range(1, tokens.shape[-1]):
            state, cell = self.step(state, tokens[..., j], cell)
            states.append(state)
        return states

    # -- checkpoint ----------------------------------------------------------------------------

    def config(self) -> dict:
        cfg = {
            "format": FORMAT,
            "version": VERSION,
            "hidden_size": self.hidden_size,
            "vocab_size": self.vocab_size,
            "width": self.width,
            "n_steps": self.n_steps,
            "spec": self.spec,
            "norm_eps": self.norm_eps,
        }
        if self.reduced:  # absent: the full vocabulary, as in checkpoints that predate the field
            cfg["draft_vocab_size"] = self.draft_vocab_size
        return cfg

    def save(self, directory: str | Path, **extra) -> Path:
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        state = {k: (v.detach().to(torch.float32) if v.is_floating_point() else v.detach()).contiguous().cpu()
                 for k, v in self.state_dict().items()}
        save_file(state, str(directory / WEIGHTS_FILE))
        (directory / CONFIG_FILE).write_text(json.dumps({**self.config(), **extra}, indent=2) + "\n")
        return directory


def read_drafter_config(directory: str | Path) -> dict:
    cfg = read_config(directory, CONFIG_FILE, FORMAT, VERSION, "OWL drafter")
    cfg_path = Path(directory) / CONFIG_FILE
    for key in ("hidden_size", "vocab_size", "width", "n_steps"):
        if not isinstance(cfg.get(key), int) or isinstance(cfg.get(key), bool) or cfg[key] < 1:
            raise LonggenError(f"{cfg_path}: '{key}' must be a positive integer")
    if not isinstance(cfg.get("spec"), bool):
        raise LonggenError(f"{cfg_path}: 'spec' must be true or false")
    if "draft_vocab_size" in cfg:
        n = cfg["draft_vocab_size"]
        if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= cfg["vocab_size"]:
            raise LonggenError(f"{cfg_path}: 'draft_vocab_size' must be an integer in [1, vocab_size = "
                               f"{cfg['vocab_size']}], got {n!r}")
    eps = cfg.get("norm_eps", 1e-6)
    if not isinstance(eps, (int, float)) or isinstance(eps, bool) or not eps > 0:
        raise LonggenError(f"{cfg_path}: 'norm_eps' must be a positive number")
    return cfg


def check_drafter(directory: str | Path, hidden_size: int | None = None, vocab_size: int | None = None) -> dict:
    """Validate a drafter checkpoint against its target, reading only file headers."""
    directory = Path(directory)
    cfg = read_drafter_config(directory)
    cfg_path = directory / CONFIG_FILE
    if hidden_size is not None and cfg["hidden_size"] != hidden_size:
        raise LonggenError(f"OWL drafter in {directory} was built for hidden size {cfg['hidden_size']} but the "
                           f"model's is {hidden_size} ({cfg_path})")
    if vocab_size is not None and cfg["vocab_size"] != vocab_size:
        raise LonggenError(f"OWL drafter in {directory} has vocabulary {cfg['vocab_size']} but the model's is "
                           f"{vocab_size} ({cfg_path})")
    weights = directory / WEIGHTS_FILE
    check_shapes(header_shapes(weights), expected_shapes(lambda: _build(cfg)), weights, cfg_path, exact=True)
    check_token_map_file(weights, cfg, cfg_path)
    return cfg


def _build(cfg: dict) -> OwlDrafter:
    return OwlDrafter(cfg["hidden_size"], cfg["vocab_size"], cfg["width"], cfg["n_steps"], cfg["spec"],
                      float(cfg.get("norm_eps", 1e-6)), cfg.get("draft_vocab_size"))


def load_drafter(
    directory: str | Path,
    hidden_size: int | None = None,
    vocab_size: int | None = None,
    dtype: torch.dtype = torch.float32,
) -> OwlDrafter:
    """Load a drafter checkpoint after :func:`check_drafter`."""
    directory = Path(directory)
    cfg = check_drafter(directory, hidden_size, vocab_size)
    weights = directory / WEIGHTS_FILE
    state = read_weights(weights)
    drafter = _build(cfg)
    drafter.load_state_dict(state)
    return drafter.to(dtype).eval().requires_grad_(False)


def quantize_fp8(drafter: OwlDrafter) -> OwlDrafter:
    """The drafter with its projections and head as :class:`~.fp8.Fp8Linear` (in place, once its
    device and dtype are set; a later ``.to`` moves them without recasting). The bf16 matrices go:
    the drafter keeps only the fp8 copies."""
    quantize_linears(drafter, FP8_LAYERS)
    return drafter


# ----------------------------------------------------------------------------------------------
# tree expansion


@dataclass
class DraftBeam:
    """The selected draft nodes of a batch of requests, as tensors (``[B, N]`` each).

    Each row lists its ``N`` nodes in creation order, so every parent precedes its children.
    ``parents[b, i]``: index of node i's parent among row b's nodes, -1 for the root (the request's
    last sampled token). ``depths``: 1 for the root's children. ``scores``: cumulative drafter
    log-probability of the node's path (a parent's score is >= its child's).
    """

    tokens: torch.Tensor
    parents: torch.Tensor
    depths: torch.Tensor
    scores: torch.Tensor

    @property
    def size(self) -> int:
        return self.tokens.shape[1]


def pool_size(top_k: int, depth: int) -> int:
    """Candidates the beam scores before selection: K at depth 1, then K * K per level."""
    return top_k + (depth - 1) * top_k * top_k


def verify_width(tree_size: int, spec: bool) -> int:
    """Rows of one request's verify forward: the root, the draft nodes and, with [SPEC], one leaf each."""
    return 2 * tree_size + 2 if spec else tree_size + 1


@torch.no_grad()
def expand(
    drafter: OwlDrafter,
    h_last: torch.Tensor,
    roots: torch.Tensor | Sequence[int],
    h_spec: torch.Tensor | None = None,
    has_spec: torch.Tensor | None = None,
    *,
    top_k: int = 10,
    depth: int = 8,
    tree_size: int = 30,
) -> DraftBeam:
    """EAGLE-2's dynamic tree over the drafter, for ``B`` requests at once.

    ``h_last``: ``[B, d0]`` post-final-norm target states of the last committed token; ``roots``:
    ``[B]`` the tokens sampled from them; ``h_spec``/``has_spec``: the [SPEC] states (see
    :meth:`OwlDrafter.first_input`). Runs ``depth`` drafter steps (``B`` rows, then ``B * top_k``)
    and keeps the ``min(tree_size, pool_size)`` best-scoring nodes of the pool. Ties go to the
    earlier-created node, so a parent always ranks before its child and the selection is closed
    under ancestors. With a reduced head the top-k runs over the draft vocabulary and the picks
    are mapped to target ids at once, so the beam (and the next step's input) holds target ids.
    """
    dev = drafter.embedding.weight.device  # the drafter's device and dtype, whatever its head's storage
    dt = drafter.embedding.weight.dtype
    score_dt = torch.float64 if dt == torch.float64 else torch.float32
    h_last = h_last.to(device=dev, dtype=dt)
    B = h_last.shape[0]
    roots = torch.as_tensor(roots, dtype=torch.long, device=dev).reshape(B)
    K = min(top_k, drafter.draft_vocab_size)
    d = drafter.width
    if h_spec is not None:
        h_spec = h_spec.to(device=dev, dtype=dt)
    if has_spec is not None:
        has_spec = torch.as_tensor(has_spec, dtype=torch.bool, device=dev).reshape(B)

    x = drafter.first_input(h_last, h_spec, has_spec)
    state, cell = drafter.step(x, roots, None, first=True)  # [B, d]
    logp = torch.log_softmax(drafter.head(state).to(score_dt), dim=-1)
    score, token = logp.topk(K, dim=-1)  # [B, K]
    token = drafter.to_target(token)
    pool_s, pool_t = [score], [token]
    pool_p = [torch.full((B, K), -1, dtype=torch.long, device=dev)]
    pool_d = [torch.ones(B, K, dtype=torch.long, device=dev)]
    front_idx = torch.arange(K, device=dev).expand(B, K)
    front_s, front_t = score, token
    state = state[:, None].expand(B, K, d)
    cell = cell[:, None].expand(B, K, d)
    size = K
    for level in range(2, depth + 1):
        st, ce = drafter.step(state.reshape(B * K, d), front_t.reshape(B * K), cell.reshape(B * K, d))
        logp = torch.log_softmax(drafter.head(st).to(score_dt), dim=-1).view(B, K, -1)
        child_s, child_t = logp.topk(K, dim=-1)  # [B, K, K]
        child_t = drafter.to_target(child_t)
        cand_s = (front_s[..., None] + child_s).reshape(B, K * K)
        cand_t = child_t.reshape(B, K * K)
        pool_s.append(cand_s)
        pool_t.append(cand_t)
        pool_p.append(front_idx[..., None].expand(B, K, K).reshape(B, K * K))
        pool_d.append(torch.full((B, K * K), level, dtype=torch.long, device=dev))
        if level == depth:
            break
        front_s, pick = cand_s.topk(K, dim=-1)  # [B, K] among the K*K candidates
        front_t = cand_t.gather(1, pick)
        front_idx = size + pick
        size += K * K
        rows = (pick // K)[..., None].expand(B, K, d)  # the frontier row each pick hangs from
        state = st.view(B, K, d).gather(1, rows)
        cell = ce.view(B, K, d).gather(1, rows)

    scores = torch.cat(pool_s, dim=1)
    tokens = torch.cat(pool_t, dim=1)
    parents = torch.cat(pool_p, dim=1)
    depths = torch.cat(pool_d, dim=1)
    P = scores.shape[1]
    N = min(tree_size, P)
    best = torch.sort(scores, dim=1, descending=True, stable=True).indices[:, :N]
    sel = best.sort(dim=1).values  # creation order: parents first
    slot = torch.full((B, P), -1, dtype=torch.long, device=dev)  # pool index -> selected index
    slot.scatter_(1, sel, torch.arange(N, device=dev).expand(B, N))
    parent_pool = parents.gather(1, sel)
    new_parents = torch.where(parent_pool >= 0, slot.gather(1, parent_pool.clamp(min=0)), parent_pool)
    return DraftBeam(tokens.gather(1, sel), new_parents, depths.gather(1, sel), scores.gather(1, sel))


class GraphedExpand:
    """:func:`expand` for one drafter and tree shape; on CUDA tensors it replays a CUDA graph.

    The beam has fixed shapes for a given batch size and never reads values back to the host, so
    one graph per batch size turns its several hundred kernel launches into one replay. ``fast``:
    a drop-in for :func:`expand` on CUDA tensors (the fused kernels of
    ``sgl_longgen.kernels.owl_beam``; CPU tensors take the plain beam). ``compile``:
    ``torch.compile`` the beam before capturing it. Where the faster beam fails (no compiler on
    the host, say) the plain one takes over.
    """

    def __init__(self, drafter: OwlDrafter, *, top_k: int, depth: int, tree_size: int,
                 fast: Callable[..., DraftBeam] | None = None, compile: bool = False):
        from .cuda_graph import GraphedFunction

        self.drafter = drafter

        def runner(beam_fn):
            def run(h_last, roots, h_spec, has_spec):
                beam = beam_fn(drafter, h_last, roots, h_spec, has_spec, top_k=top_k, depth=depth, tree_size=tree_size)
                return beam.tokens, beam.parents, beam.depths, beam.scores
            return run

        self._plain = GraphedFunction(runner(expand))
        run = runner(fast or expand)
        if compile:  # compiled during the graph's warm-up runs
            run = torch.compile(run, dynamic=False)
        self._run = GraphedFunction(run) if (fast is not None or compile) else self._plain
        self._cuda_only = fast is not None  # fused kernels; a compiled eager beam runs anywhere

    def ready(self, batch_size: int) -> bool:
        """Whether a beam of ``batch_size`` rows replays without a capture first (a CUDA graph of
        that size exists): a runtime queuing the beam on a stream of its own captures nothing there."""
        return self._run.captured(batch_size)

    def __call__(self, h_last: torch.Tensor, roots, h_spec: torch.Tensor | None = None,
                 has_spec=None) -> DraftBeam:
        w = self.drafter.embedding.weight
        h_last = h_last.to(device=w.device, dtype=w.dtype)
        B = h_last.shape[0]
        roots = torch.as_tensor(roots, dtype=torch.long, device=w.device).reshape(B)
        # Fixed inputs for the graph, with :func:`expand`'s meaning of the missing ones.
        if has_spec is None:
            has_spec = torch.full((B,), h_spec is not None, dtype=torch.bool, device=w.device)
        else:
            has_spec = torch.as_tensor(has_spec, dtype=torch.bool, device=w.device).reshape(B)
        h_spec = torch.zeros_like(h_last) if h_spec is None else h_spec.to(device=w.device, dtype=w.dtype)
        run = self._plain if (self._cuda_only and not h_last.is_cuda) else self._run
        try:
            out = run(h_last, roots, h_spec, has_spec)
        except Exception as exc:
            if run is self._plain:
                raise
            logger.warning("fast OWL beam unavailable, using the plain one: %s", exc)
            self._run = self._plain
            out = self._run(h_last, roots, h_spec, has_spec)
        return DraftBeam(*(t.clone() for t in out))


def beam_trees(beam: DraftBeam, roots: Sequence[int] | torch.Tensor, max_nodes: int | None = None) -> list[DraftTree]:
    """One trie per request; draft node i of row b becomes tree node i + 1, tagged ``Source.LSTM``.

    ``max_nodes``: each trie cut to its first that many nodes (the root included), in creation
    order: the beam's shallow levels, every kept node's ancestors with it.
    """
    roots = torch.as_tensor(roots).reshape(-1).tolist()
    tokens, parents = beam.tokens.tolist(), beam.parents.tolist()
    return [add_beam(DraftTree(root), tokens[b], parents[b], Source.LSTM, max_nodes, b) for b, root in enumerate(roots)]


def propose(
    drafter: OwlDrafter,
    h_last: torch.Tensor,
    h_spec: torch.Tensor | None,
    roots: torch.Tensor | Sequence[int],
    *,
    has_spec: torch.Tensor | None = None,
    top_k: int = 10,
    depth: int = 8,
    tree_size: int = 30,
) -> list[DraftTree]:
    """:func:`expand` then :func:`beam_trees`: one OWL draft trie per request."""
    beam = expand(drafter, h_last, roots, h_spec, has_spec, top_k=top_k, depth=depth, tree_size=tree_size)
    return beam_trees(beam, roots)


def attach_spec_leaves(tree: DraftTree, spec_token: int) -> list[int]:
    """Give the root and every draft node one [SPEC] leaf; returns ``leaf[node]``.

    A leaf is never registered as a child, so the verification walk can never enter it, even when
    ``spec_token`` is also a real vocabulary id that the target may sample. It sits at its node's
    position + 1 and attends to the node's path and itself (the tree's ancestor mask), which is
    exactly the context of the token the target will sample after that path: its hidden state is
    the target's look-ahead for the next round. Leaves come after every draft node, so the trie
    stays in parents-before-children order.
    """
    n = len(tree)
    spec = int(Source.SPEC)  # plain ints: IntFlag arithmetic costs microseconds per node
    if any(src & spec for src in tree.sources):
        raise ValueError("the tree already has [SPEC] leaves")
    return tree.add_leaves(range(n), spec_token, spec)
