"""The target distribution: logits -> processed logits -> a token.

Draft and verify share this processor, and the verifier draws every accepted or bonus token from
it, so a speculative run samples from exactly what plain decoding with the same settings samples
from. Greedy decoding is the argmax of the *penalized* logits (filters never remove the argmax).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..config import SamplingConfig
from .penalty import apply_penalty, window_mask

NEG_INF = float("-inf")


def exponential_race(logits: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """One token per row of the distribution ``softmax(logits)``: ``argmax_i logits_i - log E_i``
    with independent ``E_i ~ Exp(1)``, in float64.

    Exact: ``E_i / p_i`` is an exponential clock of rate ``p_i``, and the first of independent
    clocks to ring is clock ``i`` with probability ``p_i / sum_j p_j`` (a token of logit -inf
    never rings first); in logs, the first to ring maximises ``log p_i - log E_i``, and the
    normaliser of ``p`` is one constant for the row. It is ``torch.multinomial``'s own algorithm
    for one draw (``argmax p_i / E_i``, the same random numbers), without what a GPU pays for
    there on the critical path of a plain step: the softmax, a single-block kernel over a
    vocabulary-wide row, and about ten small kernels of device-side validity checks (a failed one
    would kill the CUDA context instead of raising).
    """
    race = torch.empty_like(logits, dtype=torch.float64).exponential_(generator=generator)
    return torch.sub(logits.double(), race.log_(), out=race).argmax(dim=-1)


def _keep_at_least(remove: torch.Tensor, logits: torch.Tensor, m: int) -> torch.Tensor:
    """Never remove the ``m`` highest logits of a row."""
    if m <= 1:
        # The argmax always survives every filter below; nothing to protect beyond it.
        top = logits.argmax(dim=-1, keepdim=True)
        return remove.scatter(-1, top, False)
    m = min(m, logits.shape[-1])
    top = logits.topk(m, dim=-1).indices
    return remove.scatter(-1, top, False)


def _min_p(logits: torch.Tensor, probs: torch.Tensor, min_p: float, m: int) -> torch.Tensor:
    pmax = probs.max(dim=-1, keepdim=True).values
    remove = probs < min_p * pmax
    return logits.masked_fill(_keep_at_least(remove, logits, m), NEG_INF)


def _eta(logits: torch.Tensor, probs: torch.Tensor, eps: float, m: int) -> torch.Tensor:
    # eta-sampling (Hewitt et al. 2022): drop p < min(eps, sqrt(eps) * exp(-H(p))).
    logp = torch.log(probs.clamp_min(torch.finfo(probs.dtype).tiny))
    entropy = -(probs * logp).sum(dim=-1, keepdim=True)
    eta = torch.minimum(torch.full_like(entropy, eps), (eps ** 0.5) * torch.exp(-entropy))
    remove = probs < eta
    return logits.masked_fill(_keep_at_least(remove, logits, m), NEG_INF)


def _top_p(logits: torch.Tensor, probs: torch.Tensor, top_p: float, m: int) -> torch.Tensor:
    sorted_p, order = probs.sort(dim=-1, descending=True)
    before = sorted_p.cumsum(dim=-1) - sorted_p  # mass strictly above each token
    remove_sorted = before > top_p  # the token that crosses top_p stays
    remove_sorted[..., : max(m, 1)] = False
    remove = torch.zeros_like(remove_sorted).scatter(-1, order, remove_sorted)
    return logits.masked_fill(remove, NEG_INF)


def _top_k(logits: torch.Tensor, k: int) -> torch.Tensor:
    if k >= logits.shape[-1]:
        return logits
    kth = logits.topk(k, dim=-1).values[..., -1:]
    return logits.masked_fill(logits < kth, NEG_INF)


class LogitsProcessor:
    """Temperature, contextual penalty, then min-p / eta / top-p / top-k.

    ``windows`` gives, per row, the tokens of that row's penalty window (see
    :func:`sgl_longgen.core.penalty.window_tokens`), or directly a ``[rows, V]`` boolean mask of
    penalized tokens (see :func:`sgl_longgen.core.penalty.tree_window_mask`); ``None`` means no
    penalty for any row.
    ``banned`` token ids (e.g. a [SPEC] token) can never be produced.
    """

    def __init__(self, params: SamplingConfig, vocab_size: int, banned: Sequence[int] = ()):
        self.params = params
        self.vocab_size = vocab_size
        self.banned = torch.as_tensor(list(banned), dtype=torch.long)

    @property
    def greedy(self) -> bool:
        return self.params.greedy

    def penalized(self, logits: torch.Tensor, windows: Sequence[Sequence[int]] | None) -> torch.Tensor:
        """Raw logits with the contextual penalty and bans applied (no temperature, no filters)."""
        logits = logits[..., : self.vocab_size]
        if logits.dtype in (torch.float16, torch.bfloat16):
            logits = logits.float()
        p = self.params
        if windows is not None and p.penalty_active:
            mask = windows if isinstance(windows, torch.Tensor) else window_mask(windows, self.vocab_size, logits.device)
            logits = apply_penalty(logits, mask.to(logits.device), p.penalty)
        if self.banned.numel():
            logits = logits.index_fill(-1, self.banned.to(logits.device), NEG_INF)
        return logits

    def process(self, logits: torch.Tensor, windows: Sequence[Sequence[int]] | None = None) -> torch.Tensor:
        """Processed logits of the target distribution; filtered tokens are -inf.

        In greedy mode only the penalty is applied: argmax is all that is read from them.
        """
        logits = self.penalized(logits, windows)
        p = self.params
        if p.greedy:
            return logits
        if p.temperature != 1.0:
            logits = logits / p.temperature
        m = p.min_tokens_to_keep
        if p.filter_order == "joint":
            return self._joint_filters(logits)
        if p.min_p > 0:
            logits = _min_p(logits, torch.softmax(logits, -1), p.min_p, m)
        if p.eta > 0:
            logits = _eta(logits, torch.softmax(logits, -1), p.eta, m)
        if p.top_p < 1.0:
            logits = _top_p(logits, torch.softmax(logits, -1), p.top_p, m)
        if p.top_k > 0:
            logits = _top_k(logits, max(p.top_k, m))
        return logits

    def _joint_filters(self, logits: torch.Tensor) -> torch.Tensor:
        """SGLang's rule: top-k, top-p and min-p all judge one post-temperature distribution."""
        p = self.params
        if not (0 < p.top_k < logits.shape[-1]) and p.top_p >= 1.0 and p.min_p <= 0:
            return logits  # no filter set: skip the vocabulary-wide sort
        probs = torch.softmax(logits, -1)
        remove = torch.zeros_like(logits, dtype=torch.bool)
        sorted_p, order = probs.sort(dim=-1, descending=True)
        rank_remove = torch.zeros_like(sorted_p, dtype=torch.bool)
        if p.top_k > 0:
            rank_remove[..., p.top_k:] = True
        if p.top_p < 1.0:
            rank_remove |= (sorted_p.cumsum(-1) - sorted_p) > p.top_p
        if p.min_p > 0:
            rank_remove |= sorted_p < p.min_p * sorted_p[..., :1]
        rank_remove[..., :1] = False
        remove = remove.scatter(-1, order, rank_remove)
        return logits.masked_fill(remove, NEG_INF)

    def probs(self, logits: torch.Tensor, windows: Sequence[Sequence[int]] | None = None) -> torch.Tensor:
        """The target distribution (one-hot on the argmax in greedy mode)."""
        processed = self.process(logits, windows)
        if self.greedy:
            return torch.nn.functional.one_hot(processed.argmax(-1), processed.shape[-1]).to(processed.dtype)
        return torch.softmax(processed, dim=-1)

    def sample(
        self,
        logits: torch.Tensor,
        windows: Sequence[Sequence[int]] | None = None,
        generator: torch.Generator | None = None,
    ) -> torch.Tensor:
        """One token per row: argmax when greedy, else a draw from the processed distribution."""
        if self.greedy and not self.banned.numel() and (windows is None or not self.params.penalty_active):
            # Nothing to apply: the argmax of the raw logits (widening bf16 to fp32 is exact).
            return logits[..., : self.vocab_size].argmax(dim=-1)
        processed = self.process(logits, windows)
        if self.greedy:
            return processed.argmax(dim=-1)
        return exponential_race(processed, generator)
