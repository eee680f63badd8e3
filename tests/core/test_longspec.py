"""LongSpec's drafter: anchor-offset indices, the checkpoint format and its refusals, the lagged
cross-attention of flash noisy training, and the beam tree (checked against a slow reference that
runs the drafter over every node's whole sequence, with the window ring wrapping around and with
a window shallower than the tree), which reads only the target's committed K/V. The reduced draft
vocabulary: its checkpoint round trip, the refusal of bad token maps, and its beam being the
full head's beam with every unmapped token masked out (so it only ever proposes mapped ids)."""

from __future__ import annotations

import json

import msgspec
import pytest
import torch
from helpers import path_nodes
from safetensors.torch import load_file, save_file

from sgl_longgen.core.longspec import CONFIG_FILE, WEIGHTS_FILE, CrossAttention, LongSpecDrafter
from sgl_longgen.core.longspec_beam import (
    WindowCache,
    beam_of_rows,
    beam_rows,
    beam_tree,
    expand,
    select_nodes,
    select_nodes_batched,
)
from sgl_longgen.core.longspec_checkpoint import check_drafter, load_drafter, target_settings
from sgl_longgen.core.longspec_rope import anchor_offset_positions, rope_tables, sample_anchor_offset
from sgl_longgen.core.longspec_weights import draft_head
from sgl_longgen.core.owl import DraftBeam
from sgl_longgen.core.tree import Source
from sgl_longgen.errors import LonggenError
from sgl_longgen.runtime.embedded import random_state
from sgl_longgen.runtime.model import ForwardSpec, ModelConfig, Transformer

torch.set_num_threads(1)

TARGET = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 40, "hidden_size": 32,
    "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
    "head_dim": 8, "max_position_embeddings": 4096, "rope_theta": 10000.0,
    "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 256},
}


def target() -> Transformer:
    cfg = msgspec.convert(TARGET, ModelConfig)
    net = Transformer(cfg)
    net.load_state_dict(random_state(TARGET, torch.Generator().manual_seed(3)), strict=False)
    return net.double().eval().requires_grad_(False)


def drafter(window: int = 512, seed: int = 0) -> LongSpecDrafter:
    net = target()
    d = LongSpecDrafter.for_target(net.config, window=window)
    d.reset_parameters(torch.Generator().manual_seed(seed), std=0.5)  # peaked drafts: a beam with a shape
    return d.double().eval().requires_grad_(False)


# ------------------------------------------------------------------------------------------------
# anchor-offset indices


@pytest.mark.parametrize("length,anchors,offset", [(10, 4, 100), (10, 0, 7), (3, 4, 50), (1, 1, 9), (12, 4, 0)])
def test_anchor_offset_keeps_the_anchors_and_shifts_the_rest_by_one_offset(length, anchors, offset):
    pos = anchor_offset_positions(length, anchors, offset).tolist()
    a = min(anchors, length)
    assert pos[:a] == list(range(a))  # the sinks stay
    assert pos[a:] == [i + offset for i in range(a, length)]  # one offset for every later position
    assert len(pos) == length


def test_sampled_offsets_stay_inside_the_context_and_vary():
    g = torch.Generator().manual_seed(0)
    seen = set()
    for _ in range(200):
        pos = sample_anchor_offset(100, 1000, 4, 30000, g)
        assert pos[:4].tolist() == [0, 1, 2, 3]
        offset = int(pos[4]) - 4
        assert torch.equal(pos[4:], torch.arange(4, 100) + offset)  # consecutive after the anchors
        assert 0 <= offset and int(pos[-1]) < 1000 + 4  # offset <= max_position - length
        seen.add(offset)
    assert len(seen) > 100  # uniform over [0, 900], not a constant
    small = [int(sample_anchor_offset(100, 1000, 4, 10, g)[4]) - 4 for _ in range(50)]
    assert max(small) <= 10 and min(small) >= 0
    assert sample_anchor_offset(100, 50, 4, 30000, g).tolist() == list(range(100))  # no room: no offset


# ------------------------------------------------------------------------------------------------
# checkpoint


def test_checkpoint_round_trip(tmp_path):
    d = drafter(window=64)
    d.save(tmp_path / "ls", base_model="micro")
    cfg = json.loads((tmp_path / "ls" / CONFIG_FILE).read_text())
    assert cfg["format"] == "sgl-longgen.longspec-drafter" and cfg["window"] == 64 and cfg["base_model"] == "micro"
    loaded = load_drafter(tmp_path / "ls", target_settings(target().config), dtype=torch.float64)
    for key, value in d.state_dict().items():
        assert torch.equal(loaded.state_dict()[key], value), key
    # no embedding or head of its own: those are the target's
    assert not any("embed" in k or "lm_head" in k for k in load_file(tmp_path / "ls" / WEIGHTS_FILE))
    # a full-vocabulary drafter: no map, no field (the files of drafters that predate them)
    assert "draft_vocab_size" not in cfg and "token_map" not in load_file(tmp_path / "ls" / WEIGHTS_FILE)
    assert loaded.token_map is None and not loaded.reduced


MAP = [0, 3, 4, 7, 9, 10, 11, 15, 16, 20, 21, 22, 25, 30, 33, 34, 35, 37, 38, 39]  # 20 of the 40 ids


def test_reduced_checkpoint_round_trip(tmp_path):
    d = drafter(window=64)
    r = d.with_token_map(torch.tensor(MAP))
    assert r.reduced and r.draft_vocab_size == 20 and not d.reduced
    r.save(tmp_path / "ls")
    cfg = json.loads((tmp_path / "ls" / CONFIG_FILE).read_text())
    assert cfg["draft_vocab_size"] == 20 and cfg["vocab_size"] == 40
    stored = load_file(tmp_path / "ls" / WEIGHTS_FILE)
    assert stored["token_map"].dtype == torch.int64 and stored["token_map"].tolist() == MAP
    loaded = load_drafter(tmp_path / "ls", target_settings(target().config), dtype=torch.float64)
    assert loaded.token_map.tolist() == MAP and loaded.token_map.dtype == torch.int64
    for key, value in d.state_dict().items():  # the block is the full drafter's: no weights of its own
        assert torch.equal(loaded.state_dict()[key], value), key


def test_bad_token_maps_are_refused_naming_the_file(tmp_path):
    good = drafter(window=64).with_token_map(torch.tensor(MAP)).save(tmp_path / "good")

    def variant(name: str, token_map=None, size=None) -> str:
        d = tmp_path / name
        d.mkdir()
        cfg = json.loads((good / CONFIG_FILE).read_text())
        if size is not None:
            cfg["draft_vocab_size"] = size
        (d / CONFIG_FILE).write_text(json.dumps(cfg))
        state = load_file(good / WEIGHTS_FILE)
        if token_map is not None:
            state["token_map"] = token_map
        save_file(state, d / WEIGHTS_FILE)
        return _error(d), d

    msg, d = variant("range", torch.tensor(MAP[:-1] + [40]))
    assert f"{d / WEIGHTS_FILE}: tensor token_map has ids out of range [0, 40): [40]" in msg
    msg, d = variant("negative", torch.tensor([-1] + MAP[1:]))
    assert str(d / WEIGHTS_FILE) in msg and "out of range" in msg
    msg, d = variant("dupes", torch.tensor(MAP[:-1] + [3]))
    assert f"{d / WEIGHTS_FILE}: tensor token_map lists target ids more than once: [3]" in msg
    msg, d = variant("short", torch.tensor(MAP[:-2]))
    assert f"{d / WEIGHTS_FILE}: tensor token_map has shape (18,), longspec.json implies (20,)" in msg
    msg, d = variant("float", torch.tensor(MAP, dtype=torch.float32))
    assert str(d / WEIGHTS_FILE) in msg and "integer token ids" in msg
    msg, d = variant("big", size=41)
    assert f"{d / CONFIG_FILE}: 'draft_vocab_size' must be an integer in [1, vocab_size = 40], got 41" in msg
    msg, d = variant("zero", size=0)
    assert str(d / CONFIG_FILE) in msg and "draft_vocab_size" in msg
    msg, d = variant("full", size=40)  # the whole vocabulary has no map: a stored one is refused
    assert "unexpected tensors ['token_map']" in msg and str(d / WEIGHTS_FILE) in msg
    with pytest.raises(ValueError, match="more than once"):
        drafter().with_token_map([1, 1, 2])
    with pytest.raises(ValueError, match="draft_vocab_size must be in"):
        drafter().with_token_map(list(range(41)))


@pytest.mark.parametrize("window,widths,tree_size", [(512, [4, 16, 16, 16, 16], 63), (3, [3, 5, 4], 9)])
def test_the_reduced_beam_is_the_full_beam_with_unmapped_tokens_masked(window, widths, tree_size):
    """The reduced head's beam (N logits, picks mapped back to target ids) is the full head's beam
    with every unmapped token's logit at -inf: the same tokens, parents and scores, all mapped."""
    net, d = target(), drafter(window)
    r = d.with_token_map(torch.tensor(MAP))
    head = draft_head(r, net.lm_head.weight, net.lm_head)
    assert head is not net.lm_head and head.weight.shape == (20, 32)
    assert draft_head(d, net.lm_head.weight, net.lm_head) is net.lm_head  # full: the target's own, as before
    outside = torch.ones(40, dtype=torch.bool)
    outside[MAP] = False

    def masked(h):
        return net.lm_head(h).masked_fill(outside, float("-inf"))

    last = net.config.num_hidden_layers - 1
    g = torch.Generator().manual_seed(11)
    history = torch.randint(0, 40, (15,), generator=g).tolist()
    cache = prefill(net, history[:-1])

    def ring():
        return WindowCache(d.num_kv_heads, window, d.head_dim, torch.float64, "cpu")

    got = expand(r, net.model.embed_tokens, head, net.inv_freq, ring(), cache.k[last], cache.v[last], history, 0,
                 widths, tree_size)
    want = expand(d, net.model.embed_tokens, masked, net.inv_freq, ring(), cache.k[last], cache.v[last], history, 0,
                  widths, tree_size)
    assert got.tokens.tolist() == want.tokens.tolist() and got.parents.tolist() == want.parents.tolist()
    assert torch.allclose(got.scores, want.scores, atol=1e-9)
    assert set(got.tokens[0].tolist()) <= set(MAP)
    unrestricted = expand(d, net.model.embed_tokens, net.lm_head, net.inv_freq, ring(), cache.k[last], cache.v[last],
                          history, 0, widths, tree_size)
    assert not set(unrestricted.tokens[0].tolist()) <= set(MAP)  # the map really restricts this beam
    with pytest.raises(ValueError, match="pass draft_head"):  # a reduced drafter handed the full head
        expand(r, net.model.embed_tokens, net.lm_head, net.inv_freq, ring(), cache.k[last], cache.v[last], history,
               0, widths, tree_size)


def _error(path, target_cfg=None) -> str:
    with pytest.raises(LonggenError) as info:
        load_drafter(path, target_cfg)
    return str(info.value)


def test_every_refusal_names_the_file(tmp_path):
    good = drafter(window=64).save(tmp_path / "good")
    settings = target_settings(target().config)
    assert "not found" in _error(tmp_path / "missing")

    (tmp_path / "empty").mkdir()
    assert f"missing {tmp_path / 'empty' / CONFIG_FILE}" in _error(tmp_path / "empty")

    def variant(name: str, edit=None, weights=True):
        d = tmp_path / name
        d.mkdir()
        cfg = json.loads((good / CONFIG_FILE).read_text())
        if edit:
            edit(cfg)
        (d / CONFIG_FILE).write_text(json.dumps(cfg) if cfg is not None else "{not json")
        if weights:
            (d / WEIGHTS_FILE).write_bytes((good / WEIGHTS_FILE).read_bytes())
        return d

    bad_json = tmp_path / "badjson"
    bad_json.mkdir()
    (bad_json / CONFIG_FILE).write_text("{not json")
    assert "not valid JSON" in _error(bad_json)
    assert "not a LongSpec drafter config" in _error(variant("fmt", lambda c: c.update(format="sgl-longgen.owl-drafter")))
    assert "unsupported version 7" in _error(variant("ver", lambda c: c.update(version=7)))
    assert "'window' must be a positive integer" in _error(variant("win", lambda c: c.update(window=0)))
    assert "'head_dim' must be a positive integer" in _error(variant("hd", lambda c: c.pop("head_dim")))
    assert "multiple of 'num_kv_heads'" in _error(variant("gqa", lambda c: c.update(num_kv_heads=3)))
    assert "'rope_theta' must be a positive number" in _error(variant("theta", lambda c: c.update(rope_theta=-1)))
    nofile = variant("noweights", weights=False)
    assert f"missing {nofile / WEIGHTS_FILE}" in _error(nofile)

    # a config that does not match its weights
    wide = variant("wide", lambda c: c.update(intermediate_size=128))
    msg = _error(wide)
    assert str(wide / WEIGHTS_FILE) in msg and "mlp.gate_proj.weight" in msg
    extra = variant("extra")
    state = load_file(extra / WEIGHTS_FILE)
    save_file({**state, "lm_head.weight": torch.zeros(40, 32)}, extra / WEIGHTS_FILE)
    assert "unexpected tensors ['lm_head.weight']" in _error(extra)

    # a drafter built for another target: each setting it must share is checked
    for key, value in [("hidden_size", 64), ("vocab_size", 41), ("num_heads", 8), ("num_kv_heads", 4),
                       ("head_dim", 16), ("rope_theta", 500000.0), ("rope_scaling", None)]:
        msg = _error(good, {**settings, key: value})
        assert f"built for {key}" in msg and str(good / CONFIG_FILE) in msg, key
    assert isinstance(check_drafter(good, settings), dict)


# ------------------------------------------------------------------------------------------------
# flash noisy training


def test_lagged_cross_attention_is_the_masked_attention_it_stands_for():
    g = torch.Generator().manual_seed(1)
    ca = CrossAttention(32, 4, 8).double()
    with torch.no_grad():
        for p in ca.parameters():
            p.normal_(0, 0.3, generator=g)
    B, T = 2, 9
    x = torch.randn(B, T, 32, generator=g, dtype=torch.float64)
    k = torch.randn(B, 2, T, 8, generator=g, dtype=torch.float64)
    v = torch.randn(B, 2, T, 8, generator=g, dtype=torch.float64)
    cos, sin = rope_tables(torch.rand(4, dtype=torch.float64), torch.arange(T).expand(B, T), torch.float64)
    for lag in (1, 3, 5):
        got = ca(x, cos, sin, k, v, lag=lag)
        t = torch.arange(T)
        mask = (t[None, :] <= t[:, None] - lag).expand(B, T, T).clone()  # row t sees target positions <= t - lag
        mask[:, :lag] = True  # (rows with nothing to see: computed, then replaced by zero below)
        want = ca(x, cos, sin, k, v, mask=mask)
        assert torch.allclose(got[:, lag:], want[:, lag:], atol=1e-12), lag
        assert torch.equal(got[:, :lag], torch.zeros_like(got[:, :lag]))  # nothing visible: no contribution


# ------------------------------------------------------------------------------------------------
# the beam tree


def prefill(net: Transformer, tokens: list[int]):
    cache = net.new_cache(len(tokens) + 80)
    net(torch.tensor(tokens), torch.arange(len(tokens)), cache, ForwardSpec(start=0))
    return cache


def reference_logp(d: LongSpecDrafter, net: Transformer, seq: list[int], L: int, cache) -> torch.Tensor:
    """The drafter's next-token log-probabilities after ``seq``: a causal pass over the whole sequence
    with the window mask, every row cross-attending to the target's K/V ``[0, L)``."""
    S = len(seq)
    pos = torch.arange(S)
    cos, sin = rope_tables(net.inv_freq, pos, torch.float64)
    dist = pos[:, None] - pos[None, :]
    mask = (dist >= 0) & (dist < d.window)
    last = net.config.num_hidden_layers - 1
    h, _, _ = d(net.model.embed_tokens(torch.tensor(seq)), cos, sin, None, None, mask,
                cache.k[last][:, :L], cache.v[last][:, :L])
    return torch.log_softmax(net.lm_head(h[-1]), dim=-1)


def reference_beam(d, net, history, cache, widths, tree_size):
    """Level by level as LongSpec's beam, every node's scores from :func:`reference_logp`."""
    L = len(history) - 1
    nodes = []  # (score, token, parent, depth, path)
    score, tok = reference_logp(d, net, history, L, cache).topk(min(widths[0], 40))
    front = []
    for s, t in zip(score.tolist(), tok.tolist()):
        front.append(len(nodes))
        nodes.append((s, t, -1, 1, [t]))
    for level, w in enumerate(widths[1:], 2):
        cand = []
        for i in front:
            logp = reference_logp(d, net, history + nodes[i][4], L, cache)
            cand.append(nodes[i][0] + logp)
        flat = torch.stack(cand).reshape(-1)
        s, idx = flat.topk(min(w, flat.numel()))
        new = []
        for sc, j in zip(s.tolist(), idx.tolist()):
            parent = front[j // 40]
            new.append(len(nodes))
            nodes.append((sc, j % 40, parent, level, nodes[parent][4] + [j % 40]))
        front = new
    scores = torch.tensor([n[0] for n in nodes], dtype=torch.float64)
    keep = sorted(torch.sort(scores, descending=True, stable=True).indices[:tree_size].tolist())
    index = {p: i for i, p in enumerate(keep)}
    return ([nodes[p][1] for p in keep], [index[nodes[p][2]] if nodes[p][2] >= 0 else -1 for p in keep],
            [nodes[p][0] for p in keep])


def run_expand(d, net, ring, cache, history, fed, widths, tree_size):
    last = net.config.num_hidden_layers - 1
    start = max(fed, len(history) - d.window)
    return expand(d, net.model.embed_tokens, net.lm_head, net.inv_freq, ring, cache.k[last], cache.v[last],
                  history[start:], start, widths, tree_size)


@pytest.mark.parametrize("window,widths,tree_size", [(512, [4, 16, 16, 16, 16], 63), (6, [3, 5, 4], 9),
                                                     (3, [2, 3, 3, 3, 3], 100)])
def test_expand_matches_the_whole_sequence_reference_as_the_ring_wraps(window, widths, tree_size):
    net, d = target(), drafter(window)
    g = torch.Generator().manual_seed(7)
    history = torch.randint(0, 40, (12,), generator=g).tolist()
    ring = WindowCache(d.num_kv_heads, window, d.head_dim, torch.float64, "cpu")
    fed = 0
    for grow in (0, 1, 4, 9):  # each call feeds what was committed since the last one (wrapping a small ring)
        history = history + torch.randint(0, 40, (grow,), generator=g).tolist()
        cache = prefill(net, history[:-1])
        beam = run_expand(d, net, ring, cache, history, fed, widths, tree_size)
        fed = len(history)
        tokens, parents, scores = reference_beam(d, net, history, cache, widths, tree_size)
        assert beam.tokens[0].tolist() == tokens
        assert beam.parents[0].tolist() == parents
        assert torch.allclose(beam.scores[0], torch.tensor(scores, dtype=torch.float64), atol=1e-9)
        assert beam.size == min(tree_size, sum(widths))
        depth = beam.depths[0].tolist()
        assert all(depth[i] == 1 if p < 0 else depth[i] == depth[p] + 1 for i, p in enumerate(parents))


def test_the_drafter_reads_only_the_committed_target_kv():
    """Slots past the committed length (a previous verify's rejected nodes) never change the draft."""
    net, d = target(), drafter(16)
    history = torch.randint(0, 40, (20,), generator=torch.Generator().manual_seed(2)).tolist()
    cache = prefill(net, history[:-1])
    ring = WindowCache(d.num_kv_heads, 16, d.head_dim, torch.float64, "cpu")
    clean = run_expand(d, net, ring, cache, history, 0, [4, 8, 8], 20)
    L = len(history) - 1
    cache.k[:, :, L:] = torch.randn_like(cache.k[:, :, L:]) * 100
    cache.v[:, :, L:] = torch.randn_like(cache.v[:, :, L:]) * 100
    ring.reset()
    noisy = run_expand(d, net, ring, cache, history, 0, [4, 8, 8], 20)
    assert torch.equal(clean.tokens, noisy.tokens) and torch.allclose(clean.scores, noisy.scores, atol=0)
    cache.k[:, :, L - 1] += 1.0  # ... while a committed one does
    ring.reset()
    moved = run_expand(d, net, ring, cache, history, 0, [4, 8, 8], 20)
    assert not torch.allclose(clean.scores, moved.scores)


def test_the_cut_tree_is_the_best_nodes_closed_under_ancestors():
    net, d = target(), drafter()
    history = [5, 7, 9, 11, 2]
    cache = prefill(net, history[:-1])
    full = run_expand(d, net, WindowCache(2, 512, 8, torch.float64, "cpu"), cache, history, 0, [4, 16, 16], 999)
    cut = run_expand(d, net, WindowCache(2, 512, 8, torch.float64, "cpu"), cache, history, 0, [4, 16, 16], 10)
    assert full.size == 36 and cut.size == 10
    best = torch.sort(full.scores[0], descending=True, stable=True).values[:10]
    assert torch.equal(cut.scores[0].sort(descending=True).values, best)
    tree = beam_tree(cut, history[-1])
    assert len(tree) == 11 and tree.num_walkable == 11
    for node in range(1, len(tree)):
        assert tree.sources[node] == Source.LONGSPEC
        assert path_nodes(tree, node)[0] == 0  # every node hangs from the root through kept nodes
    for i, p in enumerate(cut.parents[0].tolist()):
        assert p < i and (p < 0 or cut.scores[0, p] >= cut.scores[0, i])


def test_the_batched_cut_is_the_per_request_cut_ties_included():
    """The engine's beam cuts every request's pool at once, on the device, without the per-row
    host check: the same nodes, parents and scores as :func:`select_nodes` per row, pools with
    tied scores included; a pool whose cut would orphan a node is flagged, not hidden."""
    g = torch.Generator().manual_seed(0)
    B, widths = 5, [3, 6, 6]
    depths = torch.cat([torch.full((w,), i + 1) for i, w in enumerate(widths)])
    parents, scores = [], []
    for _ in range(B):
        par, sc, start, prev = [], [], 0, None
        for w in widths:
            if prev is None:
                par += [-1] * w
                sc += (-torch.rand(w, generator=g)).tolist()
            else:
                chosen = torch.randint(prev[0], prev[1], (w,), generator=g).tolist()
                par += chosen
                sc += [sc[c] - float(torch.randint(0, 3, (), generator=g)) * 0.5 for c in chosen]  # ties
            prev = (start, start + w)
            start += w
        parents.append(par)
        scores.append(sc)
    parents, scores = torch.tensor(parents), torch.tensor(scores, dtype=torch.float64)
    tokens = torch.randint(0, 50, scores.shape, generator=g)
    for n in (1, 7, 15, 99):
        beam, broken = select_nodes_batched(scores, tokens, parents, depths, n)
        assert not broken.any()
        for b in range(B):
            want = select_nodes(scores[b], tokens[b], parents[b], depths, n)
            for field in ("tokens", "parents", "depths", "scores"):
                assert torch.equal(getattr(beam, field)[b], getattr(want, field)[0]), (n, b, field)
    orphan = parents.clone()
    orphan[:, -1] = orphan.shape[1] - 2  # a last node whose parent is the (lower-scored) node before it
    low = scores.clone()
    low[:, -2] = -100.0
    assert select_nodes_batched(low, tokens, orphan, depths, 5)[1].tolist() == [
        bool(low[b, -1] >= torch.sort(low[b], descending=True, stable=True).values[4]) for b in range(B)]


def test_the_beams_two_host_rows_give_back_every_field_and_flag():
    """The engine reads a batch's beam back as two tensors (one int64, one of scores): each field,
    int32 ids included, and each row's flag come back exactly, whatever their values."""
    g = torch.Generator().manual_seed(1)
    B, N = 3, 7
    beam = DraftBeam(torch.randint(0, 2**31 - 1, (B, N), generator=g, dtype=torch.int32),
                     torch.randint(-1, N, (B, N), generator=g), torch.randint(1, 6, (B, N), generator=g),
                     -torch.rand(B, N, generator=g))
    broken = torch.tensor([False, True, False])
    ints, scores = beam_rows(beam, broken)
    assert ints.dtype == torch.int64 and ints.shape == (B, 3 * N + 1)
    back, flags = beam_of_rows(ints.clone(), scores.clone())
    for field in ("tokens", "parents", "depths", "scores"):
        assert torch.equal(getattr(back, field), getattr(beam, field).to(getattr(back, field).dtype)), field
    assert flags.tolist() == [False, True, False]


def test_widths_wider_than_the_vocabulary_are_clamped():
    net, d = target(), drafter()
    beam = run_expand(d, net, WindowCache(2, 512, 8, torch.float64, "cpu"), prefill(net, [1, 2]), [1, 2, 3], 0,
                      [64, 2000], 5000)
    assert beam.size == 40 + 40 * 40  # 40 tokens at level 1, then all 40 x 40 children (not 2000)


def test_the_ring_holds_the_last_window_positions_whatever_was_fed():
    ring = WindowCache(2, 5, 4, torch.float64, "cpu")
    nbytes = ring.nbytes
    for lo, hi in ((0, 3), (3, 4), (4, 17), (17, 18)):
        pos = torch.arange(lo, hi)
        k = pos.double()[None, :, None].expand(2, -1, 4)
        ring.write(pos, k, -k)
        assert sorted(ring.pos.tolist()) == [-1] * max(0, 5 - hi) + [p for p in range(hi - 5, hi) if p >= 0]
        kept = ring.pos >= 0
        assert torch.equal(ring.k[0, kept, 0], ring.pos[kept].double())  # each slot's K/V is its position's
        assert ring.nbytes == nbytes
    vis = ring.visible(torch.tensor([17, 19]))
    assert ring.pos[vis[0]].sort().values.tolist() == [13, 14, 15, 16, 17]
    assert ring.pos[vis[1]].sort().values.tolist() == [15, 16, 17]  # (19 - 5, 19]


# ------------------------------------------------------------------------------------------------
# the engine's batched step: a ring pool, the packed feed, the plan's static tensors


def cross_attention_over(d: LongSpecDrafter, net: Transformer, caches, lengths):
    """An engine's ``attend``: request b's queries ``[T, H, D]`` over its committed target K/V ``[0, L_b)``."""
    last = net.config.num_hidden_layers - 1

    def attend(q):
        return torch.stack([torch.nn.functional.scaled_dot_product_attention(
            q[b].transpose(0, 1), cache.k[last][:, :L], cache.v[last][:, :L], scale=d.cross_attn.scale,
            enable_gqa=True).transpose(0, 1) for b, (cache, L) in enumerate(zip(caches, lengths))])

    return attend


@pytest.mark.parametrize("window,widths,tree_size,feed,fused,fp8", [
    (512, [4, 16, 16, 16, 16], 63, 8, True, False),  # the paper's beam; first drafts feed most tokens eagerly
    (16, [4, 8, 8], 14, 3, False, False),  # long feeds split between the eager part and the step, the ring wrapping
    (6, [3, 5, 4], 9, 2, True, False),
    (3, [2, 3, 3, 3, 3], 100, 8, False, False),  # a window shallower than the tree (and narrower than the feed)
    (16, [4, 8, 8], 14, 3, True, True),  # fp8 matrices, fused and not, and an fp8 head
    (6, [3, 5, 4], 9, 2, False, True),
])
def test_the_batched_step_is_each_requests_beam_step_after_step(window, widths, tree_size, feed, fused, fp8):
    """Requests of several lengths drafting side by side over several steps, each step feeding
    what each one committed since its last (1 to 9 tokens): every row of the batched step is what
    :func:`expand` builds for that request alone, and every ring holds what that request's own
    ring holds. The pool starts too small and grows under the rings."""
    from sgl_longgen.core.longspec_weights import fuse_projections, quantize_fp8
    from sgl_longgen.kernels.longspec_step import RingPool, expand_batch

    net, d = target(), drafter(window)
    if fp8:
        quantize_fp8(d)
    if fused:
        fuse_projections(d)
    head = draft_head(d, net.lm_head.weight, net.lm_head, fp8)
    g = torch.Generator().manual_seed(5)
    histories = [torch.randint(0, 40, (n,), generator=g).tolist() for n in (12, 5, 30)]
    pool = RingPool(d.num_kv_heads, window, d.head_dim, torch.float64, "cpu", capacity=1)
    refs = [WindowCache(d.num_kv_heads, window, d.head_dim, torch.float64, "cpu") for _ in histories]
    fed = [0] * len(histories)
    rings: list[int] = []
    last = net.config.num_hidden_layers - 1
    for grow in ((0, 0, 0), (1, 3, 9), (4, 1, 2), (9, 6, 1)):
        histories = [h + torch.randint(0, 40, (k,), generator=g).tolist() for h, k in zip(histories, grow)]
        caches = [prefill(net, h[:-1]) for h in histories]
        lengths = [len(h) - 1 for h in histories]
        while len(rings) < len(histories):
            rings.append(pool.take())
        rope = lambda p: rope_tables(net.inv_freq, p, torch.float64)  # noqa: E731
        beam = expand_batch(d, net.model.embed_tokens, head, rope, pool, rings,
                            cross_attention_over(d, net, caches, lengths), [h[f:] for h, f in zip(histories, fed)],
                            fed, widths, tree_size, feed)
        for b, (h, cache, ref) in enumerate(zip(histories, caches, refs)):
            start = max(fed[b], len(h) - window)
            want = expand(d, net.model.embed_tokens, head, net.inv_freq, ref, cache.k[last], cache.v[last],
                          h[start:], start, widths, tree_size)
            assert beam.tokens[b].tolist() == want.tokens[0].tolist()
            assert beam.parents[b].tolist() == want.parents[0].tolist()
            assert beam.depths[b].tolist() == want.depths[0].tolist()
            assert torch.allclose(beam.scores[b], want.scores[0], atol=1e-9)
            assert torch.equal(pool.pos[rings[b]], ref.pos)
            assert torch.allclose(pool.k[rings[b]], ref.k, atol=1e-12)
            assert torch.allclose(pool.v[rings[b]], ref.v, atol=1e-12)
        fed = [len(h) for h in histories]
    assert pool.capacity == 4 and pool.version == 2 and pool.scratch not in rings


def test_a_step_feeds_its_last_tokens_and_the_rest_goes_first():
    """The packed rows: a feed longer than the step's width leaves its earlier tokens to the eager
    part; padding repeats the root and is written to the scratch ring (recording no position)."""
    from sgl_longgen.kernels.longspec_step import BeamPlan

    plan = BeamPlan([2, 3, 3], 5, vocab=40, window=8, feed=3, kv_heads=2, head_dim=8, dtype=torch.float64,
                    device="cpu")
    pre, step = plan.pack([[7, 8, 9, 10, 11], [4]], [20, 9], [0, 1], scratch=5)
    assert step.shape == (2, plan.columns) == (2, 5 * 3 + 3)
    tok, ring, slot, recorded, rope_at, rest = step.split([3, 3, 3, 3, 3, 3], dim=1)
    assert tok.tolist() == [[9, 10, 11], [4, 4, 4]]
    assert ring.tolist() == [[0, 0, 0], [5, 5, 1]]
    assert slot.tolist() == [[22 % 8, 23 % 8, 24 % 8], [0, 0, 9 % 8]]
    assert recorded.tolist() == [[22, 23, 24], [-1, -1, 9]]
    assert rope_at.tolist() == [[22, 23, 24], [9, 9, 9]]
    assert rest.tolist() == [[25, 26, 0], [10, 11, 1]]  # levels 2 and 3 at L + 1, L + 2; the ring row
    assert pre.tolist() == [[7, 8, 0, 0, 20 % 8, 21 % 8, 20, 21, 20, 21],
                            [0, 0, 5, 5, 0, 0, -1, -1, 0, 0]]  # request 1 has nothing to feed early
    pre, _ = plan.pack([[1, 2], [3]], [0, 0], [0, 1], scratch=5)
    assert pre is None
    long = list(range(100))
    pre, step = plan.pack([long], [0], [0], scratch=5)  # only the last window of it can matter
    assert pre[0, :5].tolist() == long[-8:-3] and step[0, :3].tolist() == long[-3:]
    with pytest.raises(ValueError, match="at least the root"):
        plan.pack([[]], [0], [0], scratch=5)


def test_the_ring_pool_grows_keeping_its_rings_and_hands_out_empty_ones():
    from sgl_longgen.kernels.longspec_step import RingPool

    pool = RingPool(2, 4, 3, torch.float32, "cpu", capacity=2)
    a, b = pool.take(), pool.take()
    pool.k[a], pool.pos[a] = 1.0, torch.tensor([0, 1, 2, 3])
    pool.k[b], pool.pos[b] = 2.0, torch.tensor([4, 5, -1, -1])
    assert pool.version == 0 and pool.scratch == 2
    c = pool.take()  # full: the pool doubles
    assert pool.capacity == 4 and pool.version == 1 and pool.scratch == 4 and c not in (a, b, pool.scratch)
    assert (pool.k[a] == 1.0).all() and (pool.k[b] == 2.0).all() and pool.pos[b].tolist() == [4, 5, -1, -1]
    assert pool.held(a) == 4 and pool.held(b) == 2 and pool.held(c) == 0
    pool.give(a)
    again = pool.take()
    assert again == a and pool.held(again) == 0  # a ring handed out again is empty
    assert pool.ring_nbytes == 2 * 2 * 4 * 3 * 4 + 4 * 8  # K and V float32, the positions int64
    pool.clear()
    assert sorted(pool.take() for _ in range(4)) == [0, 1, 2, 3] and (pool.pos == -1).all()


def test_best_children_are_the_best_of_all_children():
    """Each row's top first, then the best of those: the flattened level's top ``width`` (the same
    pairs without ties; with ties the same scores, from pairs that really score them)."""
    from sgl_longgen.core.longspec_beam import best_children

    g = torch.Generator().manual_seed(0)
    for B, n, V, width in ((3, 4, 50, 16), (2, 16, 40, 16), (1, 3, 5, 15), (2, 1, 30, 4)):
        parents = -torch.rand(B, n, generator=g, dtype=torch.float64) * 3
        logp = torch.log_softmax(torch.randn(B, n, V, generator=g, dtype=torch.float64), -1)
        score, pick, row = best_children(parents, logp, width)
        flat = (parents[:, :, None] + logp).reshape(B, -1)
        want_score, want_flat = flat.topk(width)
        assert torch.equal(score, want_score)
        assert torch.equal(row * V + pick, want_flat)
    # ties everywhere: the same best scores, each from a distinct (row, token) that scores it
    logp = torch.log_softmax(torch.randint(0, 3, (2, 4, 20), generator=g).double(), -1)
    parents = torch.tensor([[0.0, 0.0, -1.0, 0.0], [-0.5, 0.0, 0.0, 0.0]], dtype=torch.float64)
    score, pick, row = best_children(parents, logp, 16)
    flat = (parents[:, :, None] + logp).reshape(2, -1)
    assert torch.equal(score, flat.topk(16).values)
    assert torch.equal(score, parents.gather(1, row) + logp[torch.arange(2)[:, None], row, pick])
    assert all(len(set((row[b] * 20 + pick[b]).tolist())) == 16 for b in range(2))
    again = best_children(parents, logp, 16)
    assert all(torch.equal(x, y) for x, y in zip((score, pick, row), again))  # ties broken alike every time


def test_the_steps_rope_is_apply_rope_bit_for_bit():
    from sgl_longgen.core.longspec_rope import apply_rope
    from sgl_longgen.kernels.longspec_step import _rope

    g = torch.Generator().manual_seed(1)
    cos, sin = rope_tables(torch.rand(8, dtype=torch.float64), torch.arange(5), torch.float32)  # [5, 16]
    sign = torch.cat([-torch.ones(8), torch.ones(8)])
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(5, 3, 16, generator=g).to(dtype)  # [T, heads, D], token-major
        want = apply_rope(x.transpose(0, 1), cos, sin).transpose(0, 1)  # [heads, T, D] as the block has it
        got = _rope(x, cos.to(dtype)[:, None], (sin * sign).to(dtype)[:, None])
        assert torch.equal(got, want)


def test_fused_projections_are_the_blocks_weights():
    """Fusing makes the q/k/v (gate/up) weights views of one matrix: the state is unchanged, a
    load writes through to the fused matrix, and a drafter moved afterwards runs unfused."""
    from sgl_longgen.core.longspec_weights import fuse_projections, fused_matrices

    d = drafter()
    before = {k: v.clone() for k, v in d.state_dict().items()}
    fuse_projections(d)
    qkv, gate_up = fused_matrices(d)
    assert all(torch.equal(before[k], v) for k, v in d.state_dict().items())
    a = d.self_attn
    assert torch.equal(qkv, torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight]))
    assert gate_up.shape == (2 * d.intermediate_size, d.hidden_size)
    d.load_state_dict({**before, "self_attn.v_proj.weight": before["self_attn.v_proj.weight"] + 1})
    assert torch.equal(qkv[-a.v_proj.weight.shape[0]:], before["self_attn.v_proj.weight"] + 1)
    d.float()
    assert fused_matrices(d) is None
    fuse_projections(d)
    assert fused_matrices(d)[0].dtype == torch.float32


def test_fp8_weights_keep_one_copy_and_fuse_with_their_scales():
    """Quantizing a fused block drops its full-precision fused matrices, quantizes every layer and
    fuses the fp8 layers again, rows and scales (a per-row scale makes the fused matrix the
    quantization of the concatenation); a later dtype change leaves them fused."""
    from sgl_longgen.core.fp8 import Fp8Linear, quantize
    from sgl_longgen.core.longspec_weights import FP8_LAYERS, fuse_projections, fused_matrices, quantize_fp8

    d = drafter()
    a = d.self_attn
    want = quantize(torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight]))
    fuse_projections(d)
    quantize_fp8(d)
    assert all(isinstance(d.get_submodule(name), Fp8Linear) for name in FP8_LAYERS)
    assert not [p for p in d.parameters() if p.dim() == 2]  # no full-precision matrix is left
    qkv, gate_up = fused_matrices(d)
    assert isinstance(qkv, Fp8Linear) and gate_up.out_features == 2 * d.intermediate_size
    assert torch.equal(qkv.weight.float(), want[0].float()) and torch.equal(qkv.scale, want[1])
    assert torch.equal(a.v_proj.scale, qkv.scale[-a.v_proj.out_features:])
    d.float()
    assert fused_matrices(d)[0] is qkv and a.q_proj.weight.dtype == torch.float8_e4m3fn
    net = target()
    head = draft_head(d, net.lm_head.weight, net.lm_head, fp8=True)
    assert isinstance(head, Fp8Linear) and head.out_features == d.vocab_size
