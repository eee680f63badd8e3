"""Small helpers several test folders share."""

from __future__ import annotations

import gc
import random
import types

import torch

from sgl_longgen.core.longspec import LongSpecDrafter
from sgl_longgen.core.owl import OwlDrafter
from sgl_longgen.core.tree import DraftTree
from sgl_longgen.runtime.model import Transformer
from sgl_longgen.training.longspec import longspec_loss
from sgl_longgen.training.owl import new_drafter, owl_loss


def children(tree: DraftTree, node: int) -> dict[int, int]:
    """``{token: child}`` of a trie node's walkable children."""
    return {tree.tokens[c]: c for c in range(1, tree.num_walkable) if tree.parents[c] == node}


def path_nodes(tree: DraftTree, node: int) -> list[int]:
    """Node ids from the root down to ``node``."""
    out = []
    while node >= 0:
        out.append(node)
        node = tree.parents[node]
    return out[::-1]


def fit_drafter(model: Transformer, sequences: torch.Tensor, steps: int, *, width: int | None = None,
                n_steps: int = 8, spec: bool = True, lr: float = 1e-2, spec_dropout: float = 0.3,
                seed: int = 0, draft_vocab: int = 0) -> OwlDrafter:
    """A drafter fitted to given token sequences of the (frozen) target in a few full-batch steps.

    For tests that need a drafter whose drafts are accepted: the same loss as ``train owl``, on
    sequences the test already has (e.g. the target's own greedy continuations), without the data
    pipeline. ``draft_vocab`` as in ``train owl``.
    """
    cfg = model.config
    gen = torch.Generator().manual_seed(seed)
    drafter = new_drafter(cfg.hidden_size, cfg.vocab_size, width or cfg.hidden_size, n_steps, spec, draft_vocab,
                          sequences)
    drafter.reset_parameters(gen, model.model.embed_tokens.weight)
    drafter = drafter.to(dtype=model.dtype, device=sequences.device).train()
    opt = torch.optim.Adam(drafter.parameters(), lr=lr)
    for _ in range(steps):
        loss, _ = owl_loss(model, drafter, sequences, spec_dropout=spec_dropout, spec_weight=1.0,
                           spec_target="next", generator=gen)
        loss.backward()
        opt.step()
        opt.zero_grad()
    return drafter.eval().requires_grad_(False)


def fit_longspec(model: Transformer, sequences: torch.Tensor, steps: int, *, window: int = 512, max_lag: int = 5,
                 lr: float = 1e-2, seed: int = 0) -> LongSpecDrafter:
    """A LongSpec drafter fitted to given token sequences of the (frozen) target in a few full-batch
    steps: the loss of ``train longspec`` (vanilla positions, a random lag per step), no data pipeline."""
    gen = torch.Generator().manual_seed(seed)
    drafter = LongSpecDrafter.for_target(model.config, window=window)
    drafter.reset_parameters(gen, final_norm=model.model.norm.weight)
    drafter = drafter.to(dtype=model.dtype, device=sequences.device).train()
    opt = torch.optim.Adam(drafter.parameters(), lr=lr)
    positions = torch.arange(sequences.shape[1]).expand(sequences.shape[0], -1)
    for _ in range(steps):
        lag = int(torch.randint(1, max_lag + 1, (), generator=gen)) if max_lag else 0
        loss, _ = longspec_loss(model, drafter, sequences, positions, lag)
        loss.backward()
        opt.step()
        opt.zero_grad()
    return drafter.eval().requires_grad_(False)


def one_error_line(res) -> str:
    """The one ``sgl-longgen: error:`` line of a CLI run refused with exit status 2."""
    assert res.returncode == 2, (res.returncode, res.stdout, res.stderr)
    lines = [line for line in res.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, res.stderr
    assert lines[0].startswith("sgl-longgen: error:")
    return lines[0]


def gc_tracked_reachable(root) -> int:
    """Objects reachable from ``root`` that Python's garbage collector tracks, once its young
    generations have looked at them (as they do within a few hundred allocations: tuples of ints
    are untracked then; dicts stay tracked until a full collection).

    Every such object survives into the oldest generation and is traversed again by each full
    collection of the process, so a structure that grows by one per indexed token makes a serving
    process's full collections both more frequent and longer. Classes, modules and functions are
    not followed (they lead to the whole heap).
    """
    gc.collect(1)
    seen, stack, tracked = {id(root)}, [root], 0
    while stack:
        obj = stack.pop()
        tracked += gc.is_tracked(obj)
        for ref in gc.get_referents(obj):
            if isinstance(ref, (type, types.ModuleType, types.FunctionType)):
                continue
            if id(ref) not in seen:
                seen.add(id(ref))
                stack.append(ref)
    return tracked


def loop_sequence(rng: random.Random, length: int, vocab: int) -> list[int]:
    """Random text that falls into loops of short periods (a greedy model's repetition)."""
    out: list[int] = []
    while len(out) < length:
        period = [rng.randrange(vocab) for _ in range(rng.randint(1, 6))]
        out.extend(period * rng.randint(2, 200))
        out.extend(rng.randrange(vocab) for _ in range(rng.randint(0, 20)))
    return out[:length]
