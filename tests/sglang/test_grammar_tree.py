"""Grammar masks along a draft tree (:mod:`sgl_longgen.sglang.grammar`) with SGLang's llguidance
backend and the tiny model's tokenizer: each node's mask is the one plain decoding would use after
that node's path, the grammar is left as found, and forbidden subtrees are never entered. (The
masks applied in SGLang's engine, output equal to plain decoding's: test_sglang_kits.py.)"""

from __future__ import annotations

import pytest
import torch
from transformers import PreTrainedTokenizerFast

from sgl_longgen.core.tree import DraftTree
from sgl_longgen.runtime import resolve_model
from sgl_longgen.sglang.grammar import _allowed, active_grammar, tree_masks

REGEX = r"(cat|car|dog)s? [0-9]+\."


@pytest.fixture(scope="module")
def backend():
    from sglang.srt.constrained.llguidance_backend import GuidanceBackend

    path = resolve_model("tiny")
    tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(path / "tokenizer.json"))
    return GuidanceBackend(tokenizer, n_vocab=tokenizer.vocab_size), tokenizer


def grammar_for(backend):
    grammar = backend[0].dispatch_regex(REGEX)
    assert active_grammar(type("Req", (), {"grammar": grammar})()) is grammar
    return grammar


def ids(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def linear_mask(backend, path: list[int], vocab: int) -> torch.Tensor:
    """The mask after ``path`` from a fresh grammar fed the path token by token, as plain decoding feeds it."""
    grammar = grammar_for(backend)
    for token in path:
        grammar.accept_token(token)
    mask = grammar.allocate_vocab_mask(vocab_size=vocab, batch_size=1, device="cpu")
    grammar.fill_vocab_mask(mask, 0)
    return mask[0]


def test_each_node_gets_its_paths_mask_and_forbidden_subtrees_are_skipped(backend):
    tokenizer = backend[1]
    vocab = tokenizer.vocab_size
    root = ids(tokenizer, "x")[0]  # the committed root: the grammar has not started yet
    tree = DraftTree(root)
    legal = [tree.add_path(ids(tokenizer, text))[-1] for text in ("cat", "cars ", "dog 1")]
    forbidden = tree.add_path(ids(tokenizer, "bird"))  # not in the language: its subtree is never walked
    grammar = grammar_for(backend)
    masks = tree_masks(grammar, tree, vocab)
    assert masks.shape[0] == tree.num_walkable

    for node in range(tree.num_walkable):
        path = tree.path_tokens(node)  # the draft tokens below the root
        if node in forbidden:
            assert (masks[node] == -1).all()  # never reached: left all-allowed
            continue
        assert torch.equal(masks[node], linear_mask(backend, path, vocab)), tokenizer.decode(path)
    assert legal and not _allowed(masks[0], tree.tokens[forbidden[0]])

    # The grammar is left as it was found: its mask is still the root's.
    again = grammar.allocate_vocab_mask(vocab_size=vocab, batch_size=1, device="cpu")
    grammar.fill_vocab_mask(again, 0)
    assert torch.equal(again[0], masks[0])
