"""The verify policy's pieces inside the SGLang adapter, on one batch, against the reference.

A TARGET_VERIFY forward through the ``longgen_torch`` backend writes each layer's selection scores;
TOKENSWIFT's drafter ranks them on the device into per-layer selections, records them, and builds
the next draft's per-layer slot lists (the steady state's device path and the host's path); the
draft forward through the same backend attends, in layer ``l``, to layer ``l``'s list. Each stage
is checked against the engine-agnostic reference: :func:`sgl_longgen.core.verify_scores.mean_logits`
for the scores and :class:`sgl_longgen.core.partial_kv.PartialKVPolicy` (``select_verified``,
``visible``) for the positions. Ignoring the scores, or handing every layer the same list, fails.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from sglang.srt.model_executor.forward_batch_info import ForwardMode
from torch.nn.functional import scaled_dot_product_attention as sdpa

from sgl_longgen.config import PartialKVConfig, TokenSwiftConfig
from sgl_longgen.core.partial_kv import PartialKVPolicy
from sgl_longgen.core.verify import TreeWalks, Verdict
from sgl_longgen.core.verify_scores import mean_logits
from sgl_longgen.methods import TokenSwift
from sgl_longgen.sglang.backends.torch_tree import LonggenTorchBackend
from sgl_longgen.sglang.buffers import Staging
from sgl_longgen.sglang.capture import ImportanceScorer, VerifyScores
from sgl_longgen.sglang.pipeline import batch_key
from sgl_longgen.sglang.requests import StepRequest, TokenHistory
from sgl_longgen.sglang.tokenswift import TokenSwiftDrafter

LAYERS, HQ, HKV, D, N = 3, 4, 2, 16, 5  # layers, heads, KV heads, head dim, verify width
BUDGET, SINKS = 14, 2
CONTEXT, SLOTS = 96, 1024
CPU = torch.device("cpu")


class Pool:
    """The three methods of SGLang's MHA pool the torch backend calls, one K/V buffer per layer."""

    def __init__(self, g):
        self.k = torch.randn(LAYERS, SLOTS, HKV, D, generator=g)
        self.v = torch.randn(LAYERS, SLOTS, HKV, D, generator=g)

    def set_kv_buffer(self, layer, loc, k, v):
        self.k[layer.layer_id, loc.loc] = k.view(-1, HKV, D)
        self.v[layer.layer_id, loc.loc] = v.view(-1, HKV, D)

    def get_key_buffer(self, layer_id):
        return self.k[layer_id]

    def get_value_buffer(self, layer_id):
        return self.v[layer_id]


def layer(i):
    return SimpleNamespace(layer_id=i, tp_q_head_num=HQ, tp_k_head_num=HKV, tp_v_head_num=HKV, qk_head_dim=D,
                           v_head_dim=D, scaling=1 / math.sqrt(D))


def setup(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    table = (1 + torch.randperm(SLOTS - 1, generator=g)[: 8 * CONTEXT]).view(8, CONTEXT).to(torch.int32)
    rows = [5, 2, 7][: len(lengths)]
    backend = LonggenTorchBackend.__new__(LonggenTorchBackend)
    backend.req_to_token_pool = SimpleNamespace(req_to_token=table)
    backend.token_to_kv_pool = Pool(g)
    backend.use_sliding_window_kv_pool = False
    backend.verify_scores = VerifyScores(LAYERS, HKV, CONTEXT, CPU)
    batch = SimpleNamespace(req_to_token_pool=backend.req_to_token_pool, req_pool_indices=torch.tensor(rows),
                            seq_lens=torch.tensor(lengths))
    ts = TokenSwiftConfig(partial_kv=PartialKVConfig(budget=BUDGET, sinks=SINKS, policy="verify"))
    drafter = TokenSwiftDrafter.__new__(TokenSwiftDrafter)
    drafter.env = SimpleNamespace(device=CPU, staging=Staging(CPU), runner=SimpleNamespace(attn_backend=backend))
    drafter.method = TokenSwift(ts, num_layers=LAYERS)
    drafter.per_layer, drafter.num_layers = True, LAYERS
    drafter.verify_scores, drafter._backend_scores, drafter._fresh = backend.verify_scores, False, None
    drafter.defaults_file = "longgen.toml"
    drafter._steady_fixed, drafter._fused_steady = {}, None
    drafter.scorer = ImportanceScorer.__new__(ImportanceScorer)
    drafter.scorer.group = None  # one rank
    steps = [StepRequest(req=SimpleNamespace(rid=f"r{b}", req_pool_idx=r), state=SimpleNamespace(method=None),
                         history=TokenHistory([7] * L, [11 + b]), seq_len=L, sampling=None, blocker=None)
             for b, (r, L) in enumerate(zip(rows, lengths))]
    for step in steps:
        step.state.method = drafter.method.start(step.seq_len)
    return g, backend, batch, drafter, steps


def verify(g, backend, batch, steps):
    """A verify forward through the backend, layer by layer; returns each layer's queries."""
    bs = len(steps)
    table = batch.req_to_token_pool.req_to_token
    out_loc = torch.cat([table[s.req.req_pool_idx, s.seq_len : s.seq_len + N] for s in steps]).long()
    trees = torch.ones(bs, N, N, dtype=torch.bool).tril()
    fb = SimpleNamespace(batch_size=bs, forward_mode=ForwardMode.TARGET_VERIFY, seq_lens=batch.seq_lens,
                         req_pool_indices=batch.req_pool_indices, out_cache_loc=out_loc,
                         spec_info=SimpleNamespace(tree_mask=trees, draft_token_num=N, custom_mask=None))
    backend.init_forward_metadata(fb)
    queries = []
    for i in range(LAYERS):
        q = torch.randn(bs * N, HQ * D, generator=g)
        k, v = torch.randn(bs * N, HKV, D, generator=g), torch.randn(bs * N, HKV, D, generator=g)
        backend.forward_extend(q, k, v, layer(i), fb)
        queries.append(q.view(bs * N, HQ, D))
    return queries


def reference_policies(backend, batch, steps, queries):
    """Each request's reference policy after the verify's selection, and the scores it ranked."""
    table = batch.req_to_token_pool.req_to_token
    policies, scores = [], []
    for b, step in enumerate(steps):
        L = step.seq_len
        slots = table[step.req.req_pool_idx, :L].long()
        per_layer = torch.stack([
            mean_logits(queries[i][b * N : b * N + 2], backend.token_to_kv_pool.k[i, slots].transpose(0, 1),
                        1 / math.sqrt(D)) for i in range(LAYERS)])  # [layers, kv_heads, L]
        policy = PartialKVPolicy(PartialKVConfig(budget=BUDGET, sinks=SINKS, policy="verify"), LAYERS, HKV)
        policy.reset(L)
        policy.select_verified(per_layer[:, :, policy.verify_range()[0] :])
        policies.append(policy)
        scores.append(per_layer)
    return policies, scores


def commit(drafter, batch, steps, policies, counts):
    """The step's commit: the drafter observes it (recording its verify selections), as does the reference."""
    drafts = [None] * len(steps)
    drafter.observe(steps, drafts, [Verdict(tokens=[3] * c, nodes=list(range(c))) for c in counts])
    for policy, step, c in zip(policies, steps, counts):
        policy.commit(step.seq_len + c)
    return TreeWalks(count=torch.tensor(counts), last=torch.tensor([40 + b for b in range(len(steps))]),
                     order=torch.arange(N).expand(len(steps), N))


def slot_lists(spec, b):
    """Request b's slot list per layer in a draft input, as sorted lists."""
    lo, hi = spec.kv_indptr[b].item(), spec.kv_indptr[b + 1].item()
    return [sorted(spec.layer_kv_indices[i, lo:hi].tolist()) for i in range(LAYERS)]


def expected_lists(batch, step, policy, length):
    row = batch.req_to_token_pool.req_to_token[step.req.req_pool_idx]
    return [sorted(row[policy.visible()[i]].tolist() + [row[length].item()]) for i in range(LAYERS)]


@pytest.mark.parametrize("lengths,counts", [([60, 45], [3, 1]), ([60, 9], [2, 4])])
def test_verify_scores_selections_and_draft_slots_equal_the_reference(lengths, counts):
    g, backend, batch, drafter, steps = setup(lengths)
    queries = verify(g, backend, batch, steps)
    policies, ref_scores = reference_policies(backend, batch, steps, queries)

    # The scores the backend wrote for the verify are the reference's, per layer.
    written = backend.verify_scores.current
    for b, step in enumerate(steps):
        assert torch.allclose(written[b, :, :, : step.seq_len], ref_scores[b], atol=1e-5)

    # Ranked on the device: each layer's selection is the reference policy's, best first.
    fresh = drafter._select_verified(batch, steps)
    table = batch.req_to_token_pool.req_to_token
    for b, (step, policy) in enumerate(zip(steps, policies)):
        m = policy.selected.shape[1]
        assert fresh.counts[b] == m and fresh.lengths[b] == step.seq_len
        assert torch.equal(fresh.slots[:, b, :m], table[step.req.req_pool_idx][policy.selected])
    full = [c == BUDGET - SINKS for c in fresh.counts]
    assert full[0]  # a real choice: the layers chose differently
    assert len({tuple(r) for r in fresh.slots[:, 0].tolist()}) > 1
    drafter._fresh = (batch_key(steps), fresh)
    walks = commit(drafter, batch, steps, policies, counts)

    # The host's policy agrees with the reference on what the next draft sees.
    nxt = [StepRequest(s.req, s.state, s.history, s.seq_len + c, s.sampling, None) for s, c in zip(steps, counts)]
    for step, policy in zip(nxt, policies):
        mine = step.state.method.policy
        assert (mine.sel_len, mine.length, mine.pending) == (policy.sel_len, policy.length, policy.pending)
        assert mine.selected.shape == policy.selected.shape

    # The host's path: per-layer slot lists from the recorded selections.
    inputs = drafter._draft_inputs(batch, nxt)
    spec = inputs.spec_info
    assert spec.layer_kv_indices.shape == (LAYERS, spec.kv_indices.numel())
    for b, (step, policy) in enumerate(zip(nxt, policies)):
        assert slot_lists(spec, b) == expected_lists(batch, step, policy, step.seq_len)

    # The steady state's device path, where every request selected a full partial KV: the same lists.
    if all(full):
        steady = drafter._steady_layer_inputs(batch, steps, walks, fresh).spec_info
        for b, (step, policy) in enumerate(zip(nxt, policies)):
            assert slot_lists(steady, b) == expected_lists(batch, step, policy, step.seq_len)
        assert torch.equal(inputs.out_cache_loc, drafter._steady_layer_inputs(batch, steps, walks, fresh).out_cache_loc)


def test_the_draft_forward_attends_to_each_layers_own_slots():
    g, backend, batch, drafter, steps = setup([60, 45], seed=1)
    queries = verify(g, backend, batch, steps)
    policies, _ = reference_policies(backend, batch, steps, queries)
    drafter._fresh = (batch_key(steps), drafter._select_verified(batch, steps))
    commit(drafter, batch, steps, policies, [2, 2])
    nxt = [StepRequest(s.req, s.state, s.history, s.seq_len + 2, s.sampling, None) for s in steps]
    inputs = drafter._draft_inputs(batch, nxt)
    spec = inputs.spec_info
    fb = SimpleNamespace(batch_size=2, forward_mode=ForwardMode.DECODE, spec_info=spec,
                         out_cache_loc=inputs.out_cache_loc)
    pool = backend.token_to_kv_pool
    q = torch.randn(2, HQ * D, generator=g)
    k, v = torch.randn(2, HKV, D, generator=g), torch.randn(2, HKV, D, generator=g)
    for i in range(LAYERS):
        out = backend.forward_decode(q, k, v, layer(i), fb).view(2, HQ, D)
        for b in range(2):
            lo, hi = spec.kv_indptr[b].item(), spec.kv_indptr[b + 1].item()
            for j, same in ((i, True), ((i + 1) % LAYERS, False)):
                slots = spec.layer_kv_indices[j, lo:hi].long()
                want = sdpa(q.view(2, HQ, D)[b : b + 1].transpose(0, 1)[None], pool.k[i, slots].transpose(0, 1)[None],
                            pool.v[i, slots].transpose(0, 1)[None], scale=1 / math.sqrt(D), enable_gqa=True)
                assert torch.allclose(out[b], want[0].transpose(0, 1)[0], atol=1e-5) == same
