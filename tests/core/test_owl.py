"""OWL's drafter: the step equations, alpha, the null [SPEC] state, the checkpoint format, and the
batched tree expansion (checked against a slow per-request reference), with the full head and with
a reduced draft vocabulary (checked against the full head restricted to the map)."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F

from safetensors.torch import load_file, save_file
from torch import nn

from sgl_longgen.core.owl import (
    CONFIG_FILE, WEIGHTS_FILE, GraphedExpand, OwlDrafter, attach_spec_leaves, beam_trees, embedding_scale, expand,
    load_drafter, pool_size, propose, rms_scale, verify_width,
)
from sgl_longgen.runtime import resolve_model
from sgl_longgen.core.tree import Source
from sgl_longgen.errors import LonggenError
from helpers import children, path_nodes

torch.set_num_threads(1)

D0, V, D = 12, 23, 10


N_DRAFT = 9
# A map in no particular order: only uniqueness is required of it.
TOKEN_MAP = torch.randperm(V, generator=torch.Generator().manual_seed(42))[:N_DRAFT]


def drafter(spec: bool = True, seed: int = 0, n_steps: int = 4, draft_vocab: int | None = None) -> OwlDrafter:
    d = OwlDrafter(D0, V, D, n_steps, spec, draft_vocab_size=draft_vocab).double()
    d.reset_parameters(torch.Generator().manual_seed(seed))
    if d.reduced:
        d.set_token_map(TOKEN_MAP[:draft_vocab])
    with torch.no_grad():  # non-trivial norm parameters, so a swapped norm would show
        for norm in (d.cell_norm, d.state_norm):
            norm.weight.uniform_(0.5, 1.5, generator=torch.Generator().manual_seed(seed + 1))
            norm.bias.uniform_(-0.3, 0.3, generator=torch.Generator().manual_seed(seed + 2))
    return d


def test_alpha_follows_the_reference_code_formula():
    # the OWL paper: n=8, d=12288 -> ~23.58; Arctic's n=3, d=4096 -> ~23.07
    assert embedding_scale(8, 12288) == pytest.approx(23.58, abs=0.01)
    assert embedding_scale(3, 4096) == pytest.approx(23.07, abs=0.01)
    a0 = 0.5 ** (0.5 / 5)
    assert embedding_scale(5, 64) == pytest.approx(math.sqrt((1 - a0 * a0) * 64 / 2) / a0)
    assert drafter(n_steps=4).alpha == pytest.approx(embedding_scale(4, D))


def _norm(x, w, b, eps=1e-6):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w + b


def test_step_matches_the_sum_lstm_equations_with_gate_order_f_i_o_c():
    d = drafter()
    g = torch.Generator().manual_seed(3)
    x0 = torch.randn(5, 2 * D0, generator=g, dtype=torch.float64)
    tokens = torch.randint(0, V, (5,), generator=g)
    nxt = torch.randint(0, V, (5,), generator=g)
    state, cell = d.step(x0, tokens, first=True)
    state2, cell2 = d.step(state, nxt, cell)

    def reference(x, tok, z, proj):
        pre = x @ proj.T + d.alpha * d.embedding.weight[tok].repeat(1, 4)
        f, i, o, c = pre.split(D, dim=-1)
        cand = F.gelu(_norm(c, d.cell_norm.weight, d.cell_norm.bias)) * torch.sigmoid(i)
        z = cand if z is None else z * torch.sigmoid(f) + cand
        return F.gelu(_norm(z, d.state_norm.weight, d.state_norm.bias)) * torch.sigmoid(o), z

    ref_state, ref_cell = reference(x0, tokens, None, d.proj0.weight)
    ref_state2, ref_cell2 = reference(ref_state, nxt, ref_cell, d.proj1.weight)
    assert torch.allclose(state, ref_state) and torch.allclose(cell, ref_cell)
    assert torch.allclose(state2, ref_state2) and torch.allclose(cell2, ref_cell2)
    assert state.shape == (5, D) and d.head(state).shape == (5, V)


def test_first_input_scales_both_states_and_uses_the_null_vector_without_spec():
    d = drafter()
    g = torch.Generator().manual_seed(4)
    h = torch.randn(3, D0, generator=g, dtype=torch.float64) * 7
    hs = torch.randn(3, D0, generator=g, dtype=torch.float64) * 0.1
    x = d.first_input(h, hs, torch.tensor([True, False, True]))
    assert x.shape == (3, 2 * D0)
    assert torch.allclose(x[:, :D0].pow(2).mean(-1), torch.full((3,), 0.5, dtype=torch.float64), atol=1e-6)
    assert torch.allclose(x[0, D0:], rms_scale(hs[0])) and torch.allclose(x[2, D0:], rms_scale(hs[2]))
    assert torch.equal(x[1, D0:], d.null_spec.detach())
    assert torch.equal(d.first_input(h)[:, D0:], d.null_spec.detach().expand(3, D0))
    nospec = drafter(spec=False)
    assert nospec.first_input(h, hs).shape == (3, D0)
    assert nospec.proj0.weight.shape == (4 * D, D0) and not hasattr(nospec, "spec_embedding")


def test_unroll_feeds_each_step_its_own_state_and_cell():
    d = drafter()
    g = torch.Generator().manual_seed(5)
    h, hs = torch.randn(2, D0, generator=g, dtype=torch.float64), torch.randn(2, D0, generator=g, dtype=torch.float64)
    toks = torch.randint(0, V, (2, 4), generator=g)
    states = d.unroll(h, toks, hs)
    s, c = d.step(d.first_input(h, hs), toks[:, 0], first=True)
    assert torch.allclose(states[0], s)
    for j in range(1, 4):
        s, c = d.step(s, toks[:, j], c)
        assert torch.allclose(states[j], s)


# ------------------------------------------------------------------------------------------------
# checkpoint


def test_checkpoint_round_trip(tmp_path):
    d = drafter().float()
    d.save(tmp_path / "ck", base_model="x")
    cfg = json.loads((tmp_path / "ck" / CONFIG_FILE).read_text())
    assert cfg["spec"] is True and cfg["width"] == D and cfg["base_model"] == "x"
    back = load_drafter(tmp_path / "ck", hidden_size=D0, vocab_size=V)
    for (k, a), (k2, b) in zip(d.state_dict().items(), back.state_dict().items()):
        assert k == k2 and torch.equal(a, b)
    assert back.alpha == d.alpha and back.spec and not back.training


def _error(path, **kw) -> str:
    with pytest.raises(LonggenError) as exc:
        load_drafter(path, **kw)
    return str(exc.value)


def test_loader_errors_name_the_file(tmp_path):
    assert "not found" in _error(tmp_path / "nope")
    ck = tmp_path / "ck"
    drafter().float().save(ck)
    cfg_path, weights = ck / CONFIG_FILE, ck / WEIGHTS_FILE
    assert str(cfg_path) in _error(ck, hidden_size=D0 + 1)
    assert str(cfg_path) in _error(ck, vocab_size=V + 1)

    cfg = json.loads(cfg_path.read_text())
    cfg_path.write_text(json.dumps({**cfg, "width": D + 2}))
    msg = _error(ck)
    assert str(weights) in msg and "shape" in msg
    cfg_path.write_text(json.dumps({**cfg, "spec": False}))
    assert "unexpected tensors" in _error(ck)
    cfg_path.write_text(json.dumps({**cfg, "format": "something-else"}))
    assert "not an OWL drafter config" in _error(ck)
    cfg_path.write_text(json.dumps({**cfg, "n_steps": 0}))
    assert "n_steps" in _error(ck)
    cfg_path.write_text("{not json")
    assert str(cfg_path) in _error(ck)
    cfg_path.write_text(json.dumps(cfg))
    weights.write_bytes(b"garbage")
    assert str(weights) in _error(ck)
    weights.unlink()
    assert str(weights) in _error(ck)
    cfg_path.unlink()
    assert str(cfg_path) in _error(ck)


def test_full_vocabulary_checkpoints_keep_their_format(tmp_path):
    d = drafter().float()
    assert not d.reduced and d.token_map is None and d.draft_vocab_size == V
    assert "draft_vocab_size" not in d.config()
    assert d.save(tmp_path / "ck") and "token_map" not in load_file(tmp_path / "ck" / WEIGHTS_FILE)
    assert not OwlDrafter(D0, V, D, draft_vocab_size=V).reduced  # the whole vocabulary needs no map
    shipped = load_drafter(resolve_model("tiny") / "owl-drafter")  # written before the field existed
    assert not shipped.reduced and shipped.head.weight.shape[0] == shipped.vocab_size


def test_reduced_checkpoint_round_trip(tmp_path):
    d = drafter(draft_vocab=N_DRAFT).float()
    assert d.head.weight.shape == (N_DRAFT, D) and d.embedding.weight.shape == (V, D)  # inputs: any token
    d.save(tmp_path / "ck")
    cfg = json.loads((tmp_path / "ck" / CONFIG_FILE).read_text())
    assert cfg["draft_vocab_size"] == N_DRAFT and cfg["vocab_size"] == V and cfg["version"] == 1
    stored = load_file(tmp_path / "ck" / WEIGHTS_FILE)["token_map"]
    assert stored.dtype == torch.int64 and torch.equal(stored, TOKEN_MAP)
    back = load_drafter(tmp_path / "ck", hidden_size=D0, vocab_size=V, dtype=torch.bfloat16)
    assert back.reduced and back.draft_vocab_size == N_DRAFT
    assert back.token_map.dtype == torch.int64 and torch.equal(back.token_map, TOKEN_MAP)
    for (k, a), (k2, b) in zip(d.state_dict().items(), back.state_dict().items()):
        assert k == k2 and torch.equal(a.to(b.dtype), b)


def _rewrite_map(weights, token_map) -> None:
    state = load_file(weights)
    state["token_map"] = token_map
    save_file(state, str(weights))


def test_bad_token_maps_are_rejected_naming_the_file(tmp_path):
    ck = tmp_path / "ck"
    drafter(draft_vocab=N_DRAFT).float().save(ck)
    cfg_path, weights = ck / CONFIG_FILE, ck / WEIGHTS_FILE
    good = TOKEN_MAP.clone()
    for bad, words in [
        (torch.cat([good[:-1], good[:1]]), "more than once"),
        (torch.cat([good[:-1], torch.tensor([V])]), "out of range"),
        (torch.cat([good[:-1], torch.tensor([-1])]), "out of range"),
        (good.double(), "integer"),
        (good[:-1], "shape"),
    ]:
        _rewrite_map(weights, bad)
        msg = _error(ck)
        assert str(weights) in msg and "token_map" in msg and words in msg, msg
    _rewrite_map(weights, good.to(torch.int32))  # any integer dtype: the buffer is int64 either way
    assert torch.equal(load_drafter(ck).token_map, good)

    state = load_file(weights)
    del state["token_map"]
    save_file(state, str(weights))
    assert "lacks tensors ['token_map']" in _error(ck)  # owl.json promises a map the file lacks
    cfg = json.loads(cfg_path.read_text())
    for n in (0, V + 1, True, 3.5):
        cfg_path.write_text(json.dumps({**cfg, "draft_vocab_size": n}))
        msg = _error(ck)
        assert str(cfg_path) in msg and "draft_vocab_size" in msg
    _rewrite_map(weights, good)
    del cfg["draft_vocab_size"]
    cfg_path.write_text(json.dumps(cfg))
    assert str(weights) in _error(ck)  # a full-vocabulary owl.json over a reduced head


def test_set_token_map_validates():
    d = OwlDrafter(D0, V, D, draft_vocab_size=3)
    for bad in ([1, 1, 2], [0, 1, V], [0, 1], [0.0, 1.0, 2.0]):
        with pytest.raises(ValueError, match="token map"):
            d.set_token_map(bad)
    d.set_token_map([5, 0, 22])
    assert d.token_map.tolist() == [5, 0, 22]
    assert d.to_target(torch.tensor([[2, 0], [1, 1]])).tolist() == [[22, 5], [0, 0]]
    with pytest.raises(ValueError, match="full-vocabulary"):
        OwlDrafter(D0, V, D).set_token_map([0])
    with pytest.raises(ValueError, match="draft_vocab_size"):
        OwlDrafter(D0, V, D, draft_vocab_size=V + 1)


# ------------------------------------------------------------------------------------------------
# tree expansion


def reference_tree(d: OwlDrafter, h, hs, root, K, depth, N):
    """The EAGLE-2 beam written per node with plain Python lists (slow, obvious)."""
    x = d.first_input(h[None], None if hs is None else hs[None])
    state, cell = d.step(x, torch.tensor([root]), first=True)
    lp = torch.log_softmax(d.head(state)[0], -1)
    pool = []  # (score, token, parent pool index, depth)
    frontier = []  # (pool index, score, token, state, cell)
    top = lp.topk(K)
    for s, t in zip(top.values.tolist(), top.indices.tolist()):
        pool.append((s, t, -1, 1))
        frontier.append((len(pool) - 1, s, t, state, cell))
    for level in range(2, depth + 1):
        cands = []
        for idx, s, t, st, ce in frontier:
            st2, ce2 = d.step(st, torch.tensor([t]), ce)
            lp = torch.log_softmax(d.head(st2)[0], -1)
            top = lp.topk(K)
            for cs, ct in zip(top.values.tolist(), top.indices.tolist()):
                pool.append((s + cs, ct, idx, level))
                cands.append((len(pool) - 1, s + cs, ct, st2, ce2))
        cands.sort(key=lambda c: -c[1])  # stable: ties keep creation order
        frontier = cands[:K]
    order = sorted(range(len(pool)), key=lambda i: -pool[i][0])[:N]
    return sorted(order), pool


def assert_matches_reference(beam, reference, h, hs, has, roots, K, depth, N):
    """Every row of ``beam`` is the per-node reference tree of ``reference`` (a drafter)."""
    for b in range(len(roots)):
        sel, pool = reference_tree(reference, h[b], hs[b] if has[b] else None, roots[b], K, depth, N)
        pos = {p: i for i, p in enumerate(sel)}
        assert beam.tokens[b].tolist() == [pool[p][1] for p in sel]
        assert beam.depths[b].tolist() == [pool[p][3] for p in sel]
        assert beam.parents[b].tolist() == [pos[pool[p][2]] if pool[p][2] >= 0 else -1 for p in sel]
        assert torch.allclose(beam.scores[b], torch.tensor([pool[p][0] for p in sel], dtype=beam.scores.dtype))


@pytest.mark.parametrize("K,depth,N", [(3, 4, 10), (4, 3, 100), (2, 5, 1), (5, 1, 3)])
def test_expand_matches_the_per_node_reference(K, depth, N):
    d = drafter(seed=K)
    g = torch.Generator().manual_seed(10 + K)
    B = 3
    h = torch.randn(B, D0, generator=g, dtype=torch.float64)
    hs = torch.randn(B, D0, generator=g, dtype=torch.float64)
    has = torch.tensor([True, False, True])
    roots = [1, 7, 22]
    beam = expand(d, h, roots, hs, has, top_k=K, depth=depth, tree_size=N)
    assert beam.size == min(N, pool_size(K, depth))
    assert_matches_reference(beam, d, h, hs, has, roots, K, depth, N)


def test_expanded_trees_are_closed_under_ancestors_and_bounded():
    d = drafter(seed=9)
    g = torch.Generator().manual_seed(2)
    B, K, depth, N = 6, 4, 5, 17
    h = torch.randn(B, D0, generator=g, dtype=torch.float64)
    roots = torch.randint(0, V, (B,), generator=g)
    beam = expand(d, h, roots, top_k=K, depth=depth, tree_size=N)
    for b in range(B):
        parents, depths, scores = beam.parents[b].tolist(), beam.depths[b].tolist(), beam.scores[b].tolist()
        for i, p in enumerate(parents):
            assert p < i  # parents before children (and selected: closed under ancestors)
            assert depths[i] == (1 if p < 0 else depths[p] + 1) <= depth
            if p >= 0:
                assert scores[p] >= scores[i]
    trees = beam_trees(beam, roots)
    for b, tree in enumerate(trees):
        assert len(tree) == N + 1 and tree.tokens[0] == int(roots[b])
        assert all(src == Source.LSTM for src in tree.sources[1:])
        assert tree.tokens[1:] == beam.tokens[b].tolist()
        assert [p - 1 for p in tree.parents[1:]] == beam.parents[b].tolist()
    again = propose(d, h, None, roots, top_k=K, depth=depth, tree_size=N)
    assert [t.tokens for t in again] == [t.tokens for t in trees]


def test_expand_is_batch_independent():
    d = drafter(seed=4)
    g = torch.Generator().manual_seed(8)
    h = torch.randn(4, D0, generator=g, dtype=torch.float64)
    hs = torch.randn(4, D0, generator=g, dtype=torch.float64)
    has = torch.tensor([True, False, False, True])
    roots = [3, 3, 9, 0]
    both = expand(d, h, roots, hs, has, top_k=3, depth=3, tree_size=8)
    for b in range(4):
        one = expand(d, h[b : b + 1], roots[b : b + 1], hs[b : b + 1], has[b : b + 1], top_k=3, depth=3, tree_size=8)
        assert torch.equal(one.tokens[0], both.tokens[b]) and torch.equal(one.parents[0], both.parents[b])


def test_spec_leaves_follow_every_node_and_are_never_children():
    d = drafter(seed=1)
    (tree,) = propose(d, torch.randn(1, D0, dtype=torch.float64), None, [4], top_k=3, depth=3, tree_size=7)
    n = len(tree)
    spec_token = int(tree.tokens[1])  # collides with a real draft token on purpose
    leaves = attach_spec_leaves(tree, spec_token)
    assert leaves == list(range(n, 2 * n)) and len(tree) == 2 * n == verify_width(7, True)
    mask = tree.ancestor_mask()
    positions = tree.positions(100).tolist()
    for node, leaf in enumerate(leaves):
        assert tree.parents[leaf] == node and tree.sources[leaf] == Source.SPEC
        assert leaf not in children(tree, node).values()
        assert positions[leaf] == positions[node] + 1
        assert mask[leaf].nonzero().flatten().tolist() == sorted(path_nodes(tree, node) + [leaf])
        assert mask[:, leaf].nonzero().flatten().tolist() == [leaf]  # nothing else attends to a leaf
    assert tree.child(0, spec_token) == 1  # the walk still finds the real node with that token
    with pytest.raises(ValueError):
        attach_spec_leaves(tree, spec_token)


def restricted_full_head(reduced: OwlDrafter) -> OwlDrafter:
    """The same drafter with a full-vocabulary head whose logits are -inf outside the map: what the
    reduced head must draft, in target ids, with the plain (unmapped) code path."""
    full = OwlDrafter(D0, V, D, reduced.n_steps, reduced.spec).double()
    full.load_state_dict({k: v for k, v in reduced.state_dict().items() if k not in ("head.weight", "token_map")},
                         strict=False)
    head = nn.Linear(D, V, bias=True).double()
    with torch.no_grad():
        head.weight.zero_()
        head.weight[reduced.token_map] = reduced.head.weight
        head.bias.fill_(float("-inf"))
        head.bias[reduced.token_map] = 0.0
    full.head = head
    return full


@pytest.mark.parametrize("K,depth,N", [(3, 4, 10), (4, 3, 100), (2, 5, 1), (9, 2, 40)])
def test_reduced_expand_equals_the_full_head_restricted_to_the_map(K, depth, N):
    d = drafter(seed=K, draft_vocab=N_DRAFT)
    full = restricted_full_head(d)
    g = torch.Generator().manual_seed(20 + K)
    B = 3
    h = torch.randn(B, D0, generator=g, dtype=torch.float64)
    hs = torch.randn(B, D0, generator=g, dtype=torch.float64)
    has = torch.tensor([True, False, True])
    outside = sorted(set(range(V)) - set(TOKEN_MAP.tolist()))
    roots = [outside[0], int(TOKEN_MAP[0]), outside[-1]]  # roots (inputs) may be any target token
    beam = expand(d, h, roots, hs, has, top_k=K, depth=depth, tree_size=N)
    assert beam.size == min(N, pool_size(K, depth))
    assert set(beam.tokens.flatten().tolist()) <= set(TOKEN_MAP.tolist())
    assert_matches_reference(beam, full, h, hs, has, roots, K, depth, N)
    graphed = GraphedExpand(d, top_k=K, depth=depth, tree_size=N)  # plain calls on CPU tensors
    again = graphed(h, roots, hs, has)
    for a, b in zip((beam.tokens, beam.parents, beam.depths, beam.scores),
                    (again.tokens, again.parents, again.depths, again.scores)):
        assert torch.equal(a, b)
    trees = propose(d, h, hs, roots, has_spec=has, top_k=K, depth=depth, tree_size=N)
    assert [t.tokens[1:] for t in trees] == beam.tokens.tolist()


def test_top_k_wider_than_the_draft_vocabulary_is_clamped():
    d = drafter(seed=3, draft_vocab=2)
    beam = expand(d, torch.randn(1, D0, dtype=torch.float64), [0], top_k=5, depth=3, tree_size=50)
    assert beam.size == pool_size(2, 3)
    assert set(beam.tokens.flatten().tolist()) <= set(TOKEN_MAP[:2].tolist())


def test_the_compiled_beam_proposes_the_same_tree_as_the_eager_one():
    d = drafter(seed=5, draft_vocab=N_DRAFT)
    g = torch.Generator().manual_seed(50)
    h = torch.randn(2, D0, generator=g, dtype=torch.float64)
    hs = torch.randn(2, D0, generator=g, dtype=torch.float64)
    has = torch.tensor([True, False])
    eager = expand(d, h, [1, 2], hs, has, top_k=3, depth=3, tree_size=8)
    compiled = GraphedExpand(d, top_k=3, depth=3, tree_size=8, compile=True)(h, [1, 2], hs, has)
    assert torch.equal(eager.tokens, compiled.tokens) and torch.equal(eager.parents, compiled.parents)
    assert torch.allclose(eager.scores, compiled.scores)


def test_a_beam_that_fails_to_compile_falls_back_to_the_plain_one(monkeypatch):
    def broken(fn, **kwargs):
        def run(*args):
            raise RuntimeError("no compiler here")
        return run

    monkeypatch.setattr(torch, "compile", broken)
    d = drafter(seed=6)
    h = torch.randn(1, D0, dtype=torch.float64)
    beam = GraphedExpand(d, top_k=2, depth=2, tree_size=4, compile=True)(h, [1])
    assert torch.equal(beam.tokens, expand(d, h, [1], top_k=2, depth=2, tree_size=4).tokens)


def test_graphed_expand_reads_missing_spec_flags_as_expand_does():
    d = drafter(seed=8)
    g = torch.Generator().manual_seed(80)
    h = torch.randn(2, D0, generator=g, dtype=torch.float64)
    hs = torch.randn(2, D0, generator=g, dtype=torch.float64)
    graphed = GraphedExpand(d, top_k=2, depth=2, tree_size=4)
    for spec in ((hs, None), (None, None)):
        assert torch.equal(graphed(h, [1, 2], *spec).tokens, expand(d, h, [1, 2], *spec, top_k=2, depth=2, tree_size=4).tokens)
    # Without the flags every row reads its [SPEC] state: not the null vector's tree.
    assert not torch.equal(expand(d, h, [1, 2], hs, top_k=2, depth=2, tree_size=4).scores,
                           expand(d, h, [1, 2], None, top_k=2, depth=2, tree_size=4).scores)


def test_a_fast_beam_serves_only_cuda_tensors():
    def fast(*args, **kwargs):
        raise AssertionError("the fast beam ran on CPU tensors")

    d = drafter(seed=9)
    h = torch.randn(1, D0, dtype=torch.float64)
    beam = GraphedExpand(d, top_k=2, depth=2, tree_size=4, fast=fast)(h, [1])
    assert torch.equal(beam.tokens, expand(d, h, [1], top_k=2, depth=2, tree_size=4).tokens)
