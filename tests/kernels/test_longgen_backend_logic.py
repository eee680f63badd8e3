"""The ``longgen`` backend's TARGET_VERIFY logic on CPU (interpreted kernels, stand-in KV pool).

Building a real ``FlashInferAttnBackend`` needs CUDA and a model runner, so the backend object is
created without ``__init__`` and given only the state its verify path reads: the requests'
``req_to_token`` rows, a KV pool, and the CUDA-graph buffers. Eager planning, CUDA-graph capture
with a padded batch and a replay with new lengths and trees are checked against the fp32 reference.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from kernel_cases import DEVICE, TOL, max_err
from sgl_longgen.kernels.reference import random_tree_mask, tree_attention_reference

pytestmark = pytest.mark.skipif(DEVICE.type != "cpu", reason="the GPU runs the real backend in engine_check")

HQ, HKV, D, N = 8, 2, 32, 6  # heads, kv heads, head dim, draft tokens per request
DTYPE = torch.float16


class StandInPool:
    """The two methods of SGLang's MHA pool that the verify path calls."""

    def __init__(self, num_slots, g):
        self.k = torch.randn(num_slots, HKV, D, generator=g).to(DTYPE)
        self.v = torch.randn(num_slots, HKV, D, generator=g).to(DTYPE)

    def set_kv_buffer(self, layer, loc, k, v, k_scale=None, v_scale=None):
        self.k[loc.loc] = k.view(-1, HKV, D)
        self.v[loc.loc] = v.view(-1, HKV, D)

    def get_kv_buffer(self, layer_id):
        return self.k, self.v


def make_backend(max_bs=4, num_slots=9000, context=1024, seed=0):
    from sgl_longgen.sglang.backends.hybrid import LongGenAttnBackend

    g = torch.Generator().manual_seed(seed)
    be = LongGenAttnBackend.__new__(LongGenAttnBackend)
    be._disabled = None
    be._num_qo_heads, be._num_kv_heads, be._head_dim = HQ, HKV, D
    be._dtype, be._device, be._check = DTYPE, torch.device("cpu"), False
    be._eager_attn = None
    be._graph_max_bs, be._graph_attn = max_bs, {}
    be._graph_kv_indptr = be._graph_tree_mask = be._graph_fold_workspace = None
    be._graph_page_table = be._graph_seq_lens = None
    be._max_context = context
    be._cascade_min_shared = 2048
    be.kv_cache_quant_method = SimpleNamespace(needs_global_scale=lambda: True)
    # every request row holds distinct random slots; slot 0 is the padding slot, as in SGLang
    perm = 1 + torch.randperm(num_slots - 1, generator=g)[: 8 * context].to(torch.int32)
    be.req_to_token_pool = SimpleNamespace(req_to_token=perm.view(8, context).clone())
    be.token_to_kv_pool = StandInPool(num_slots, g)
    be.cuda_graph_kv_indices = [torch.zeros(max_bs * context, dtype=torch.int32)]
    be.forward_metadata = None
    return be, g


def verify_batch(be, g, seq_lens, req_pool_indices, pad_to=None):
    """A TARGET_VERIFY ForwardBatch as SGLang's NGRAM worker builds it (full-layout mask)."""
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    bs = len(seq_lens)
    trees = random_tree_mask(bs, N, generator=g)
    flat = torch.cat([torch.cat([torch.ones(N, L, dtype=torch.bool), trees[b]], 1).flatten()
                      for b, L in enumerate(seq_lens)])
    rt = be.req_to_token_pool.req_to_token
    out_loc = torch.cat([rt[r, L : L + N] for r, L in zip(req_pool_indices, seq_lens)]).long()
    lens, rps = list(seq_lens), list(req_pool_indices)
    if pad_to is not None:  # CUDA-graph padding: fill length 1, request row 0, KV to slot 0
        lens += [1] * (pad_to - bs)
        rps += [0] * (pad_to - bs)
        out_loc = torch.cat([out_loc, torch.zeros((pad_to - bs) * N, dtype=torch.long)])
    fb = SimpleNamespace(
        batch_size=len(lens), forward_mode=ForwardMode.TARGET_VERIFY,
        spec_info=SimpleNamespace(custom_mask=flat, draft_token_num=N, ragged_verify_layout=None),
        seq_lens=torch.tensor(lens), seq_lens_cpu=torch.tensor(lens), seq_lens_sum=sum(lens),
        req_pool_indices=torch.tensor(rps), out_cache_loc=out_loc,
    )
    return fb, trees


def layer_inputs(g, num_tokens):
    q = torch.randn(num_tokens, HQ * D, generator=g).to(DTYPE)
    k = torch.randn(num_tokens, HKV, D, generator=g).to(DTYPE)
    v = torch.randn(num_tokens, HKV, D, generator=g).to(DTYPE)
    layer = SimpleNamespace(tp_q_head_num=HQ, tp_k_head_num=HKV, tp_v_head_num=HKV, head_dim=D, qk_head_dim=D,
                            v_head_dim=D, scaling=2.0 / D**0.5, logit_cap=0.0, layer_id=0, k_scale=None, v_scale=None)
    return q, k, v, layer


def reference(be, fb, trees, q, k, v, layer, real_bs):
    rt = be.req_to_token_pool.req_to_token
    lens = fb.seq_lens_cpu[:real_bs].tolist()
    indptr = torch.tensor([0] + list(torch.cumsum(torch.tensor(lens), 0).tolist()), dtype=torch.int32)
    idx = torch.cat([rt[r, :L] for r, L in zip(fb.req_pool_indices[:real_bs].tolist(), lens)])
    n = real_bs * N
    o, _ = tree_attention_reference(q[:n].view(n, HQ, D), be.token_to_kv_pool.k, be.token_to_kv_pool.v, indptr, idx,
                                    k[:n], v[:n], trees, layer.scaling)
    return o


def test_eager_verify_matches_reference():
    be, g = make_backend()
    fb, trees = verify_batch(be, g, [700, 1, 33], [5, 2, 7])
    be.init_forward_metadata(fb)
    q, k, v, layer = layer_inputs(g, 3 * N)
    o = be.forward_extend(q, k, v, layer, fb)
    assert o.shape == (3 * N, HQ * D)
    # the draft tokens' K/V were written to the pool at out_cache_loc
    assert torch.equal(be.token_to_kv_pool.k[fb.out_cache_loc], k)
    ref = reference(be, fb, trees, q, k, v, layer, 3)
    assert max_err(o.view(-1, HQ, D), ref) <= TOL[DTYPE]


def test_cuda_graph_capture_then_replay_with_new_batch():
    be, g = make_backend(max_bs=4)
    fb, trees = verify_batch(be, g, [300, 12], [1, 3], pad_to=4)  # capture at padded bs 4
    be.init_forward_metadata_out_graph(fb, in_capture=True)
    captured = be.forward_metadata.attn
    q, k, v, layer = layer_inputs(g, 4 * N)
    o = be.forward_extend(q, k, v, layer, fb)
    assert max_err(o.view(-1, HQ, D)[: 2 * N], reference(be, fb, trees, q, k, v, layer, 2)) <= TOL[DTYPE]
    assert not torch.isnan(o).any()

    # replay: other requests, other lengths and trees; same buffers and launch shapes
    fb2, trees2 = verify_batch(be, g, [900, 2, 64], [6, 0, 4], pad_to=4)
    config = captured.prefix_config
    be.init_forward_metadata_out_graph(fb2, in_capture=False)
    assert be.forward_metadata.attn is captured and captured.prefix_config == config
    q, k, v, layer = layer_inputs(g, 4 * N)
    o = be.forward_extend(q, k, v, layer, fb2)
    assert max_err(o.view(-1, HQ, D)[: 3 * N], reference(be, fb2, trees2, q, k, v, layer, 3)) <= TOL[DTYPE]


def test_tree_blocks_from_spec_info_take_precedence():
    """Verify inputs that carry ``tree_mask [bs, N, N]`` (this project's) need no custom mask."""
    be, g = make_backend()
    fb, trees = verify_batch(be, g, [200, 50], [0, 1])
    fb.spec_info = SimpleNamespace(custom_mask=None, tree_mask=trees, draft_token_num=N, ragged_verify_layout=None)
    be.init_forward_metadata(fb)
    q, k, v, layer = layer_inputs(g, 2 * N)
    o = be.forward_extend(q, k, v, layer, fb)
    assert max_err(o.view(-1, HQ, D), reference(be, fb, trees, q, k, v, layer, 2)) <= TOL[DTYPE]


def test_replay_without_capture_is_an_error():
    be, g = make_backend(max_bs=4)
    fb, _ = verify_batch(be, g, [10], [0], pad_to=2)
    with pytest.raises(RuntimeError):
        be.init_forward_metadata_out_graph(fb, in_capture=False)


def test_a_width_one_verify_is_one_prefix_pass_over_prefix_and_own_slot(monkeypatch):
    """A plain step of adaptive speculation (one token per request): planned with the token's own
    slot as the last prefix slot, no tree part; eager, then captured and replayed, both equal the
    reference, which would miss the own key if the slot were not there."""
    import sys

    monkeypatch.setattr(sys.modules[__name__], "N", 1)
    be, g = make_backend(max_bs=4)
    fb, trees = verify_batch(be, g, [700, 1, 33], [5, 2, 7])
    be.init_forward_metadata(fb)
    attn = be.forward_metadata.attn
    assert attn.own_kv_in_prefix and attn.kv_indices.numel() == 700 + 1 + 33 + 3
    q, k, v, layer = layer_inputs(g, 3)
    o = be.forward_extend(q, k, v, layer, fb)
    assert max_err(o.view(-1, HQ, D), reference(be, fb, trees, q, k, v, layer, 3)) <= TOL[DTYPE]

    fb, trees = verify_batch(be, g, [300, 12], [1, 3], pad_to=4)
    be.init_forward_metadata_out_graph(fb, in_capture=True)
    captured = be.forward_metadata.attn
    fb2, trees2 = verify_batch(be, g, [900, 2, 64], [6, 0, 4], pad_to=4)
    be.init_forward_metadata_out_graph(fb2, in_capture=False)
    assert be.forward_metadata.attn is captured and captured.own_kv_in_prefix
    q, k, v, layer = layer_inputs(g, 4)
    o = be.forward_extend(q, k, v, layer, fb2)
    assert max_err(o.view(-1, HQ, D)[:3], reference(be, fb2, trees2, q, k, v, layer, 3)) <= TOL[DTYPE]


def share_rows(be, rows, shared_len, diverge_at=None):
    """Give ``rows`` of ``req_to_token`` row ``rows[0]``'s first ``shared_len`` slots, as the radix
    cache does for requests with a common prompt; ``diverge_at``: the last row holds another slot there."""
    rt = be.req_to_token_pool.req_to_token
    for r in rows[1:]:
        rt[r, :shared_len] = rt[rows[0], :shared_len]
    if diverge_at is not None:
        other = next(r for r in range(rt.shape[0]) if r not in rows)
        rt[rows[-1], diverge_at] = rt[other, -1]  # a pool slot none of the rows holds


def test_shared_prefix_length_of_slot_rows():
    from sgl_longgen.kernels.verify_metadata import shared_prefix_length

    be, _ = make_backend()
    rt = be.req_to_token_pool.req_to_token
    share_rows(be, [5, 2, 7], 600)
    rpi, lens = torch.tensor([5, 2, 7]), torch.tensor([700, 650, 900])
    assert shared_prefix_length(rt, rpi, lens, 650).item() == 600
    assert shared_prefix_length(rt, rpi, lens, 400).item() == 400  # never past the width compared
    assert shared_prefix_length(rt, rpi, torch.tensor([700, 350, 900]), 650).item() == 350  # nor the shortest
    assert shared_prefix_length(rt, rpi, lens, 650, min_shared=601).item() == 0  # too short to count
    share_rows(be, [5, 2, 7], 600, diverge_at=123)  # the last row diverges at slot 123
    assert shared_prefix_length(rt, rpi, lens, 650).item() == 123
    assert shared_prefix_length(rt, torch.tensor([1, 3]), lens[:2], 650).item() == 0  # distinct rows
    assert shared_prefix_length(rt, torch.tensor([3]), lens[:1], 650).item() == 650  # one request: its own


@pytest.mark.parametrize("rows,lens,diverge_at,shared", [
    ([5, 2, 7], [700, 450, 420], None, 400),  # a common prompt of 400 slots
    ([5, 2, 7], [700, 450, 400], None, 400),  # the shortest request's whole prefix is shared
    ([5, 2, 7], [700, 450, 420], 100, 0),  # rows diverge at slot 100 < the threshold: nothing shared
    ([1, 3, 4], [700, 450, 420], 300, 300),  # they diverge at slot 300
])
def test_eager_verify_cascades_over_a_shared_prompt(rows, lens, diverge_at, shared):
    be, g = make_backend()
    be._cascade_min_shared = 256
    share_rows(be, rows, 400, diverge_at)
    fb, trees = verify_batch(be, g, lens, rows)
    be.init_forward_metadata(fb)
    attn = be.forward_metadata.attn
    assert attn.cascade and attn._cascade_meta[2].item() == shared
    q, k, v, layer = layer_inputs(g, 3 * N)
    o = be.forward_extend(q, k, v, layer, fb)
    assert max_err(o.view(-1, HQ, D), reference(be, fb, trees, q, k, v, layer, 3)) <= TOL[DTYPE]


def test_no_cascade_for_one_request_short_prefixes_or_when_off():
    be, g = make_backend()
    share_rows(be, [5, 2], 600)
    for threshold, lens, rows in ((256, [700], [5]), (1024, [700, 650], [5, 2]), (0, [700, 650], [5, 2])):
        be._cascade_min_shared = threshold
        fb, trees = verify_batch(be, g, lens, rows)
        be.init_forward_metadata(fb)
        assert not be.forward_metadata.attn.cascade
        q, k, v, layer = layer_inputs(g, len(lens) * N)
        o = be.forward_extend(q, k, v, layer, fb)
        assert max_err(o.view(-1, HQ, D), reference(be, fb, trees, q, k, v, layer, len(lens))) <= TOL[DTYPE]


def test_a_bad_cascade_threshold_is_refused_naming_the_variable(monkeypatch):
    from sgl_longgen.sglang.backends import hybrid

    monkeypatch.setenv("SGLANG_LONGGEN_CASCADE_MIN_SHARED", "lots")
    with pytest.raises(ValueError, match="SGLANG_LONGGEN_CASCADE_MIN_SHARED"):
        hybrid._cascade_min_shared()
    monkeypatch.setenv("SGLANG_LONGGEN_CASCADE_MIN_SHARED", "2048")
    assert hybrid._cascade_min_shared() == 2048
    monkeypatch.delenv("SGLANG_LONGGEN_CASCADE_MIN_SHARED")
    assert hybrid._cascade_min_shared() == 0  # opt-in


def test_prefills_stay_with_flashinfer_off_hopper_and_a_bad_choice_is_named(monkeypatch):
    """FA3 serves the backend's plain prefills only where it serves the model (a Hopper GPU): on
    this machine the choice is FlashInfer's, and a bad SGLANG_LONGGEN_PREFILL_BACKEND is refused
    with its name before any engine state is built."""
    from sgl_longgen.sglang.backends.hybrid import fa3_prefill_backend

    runner = SimpleNamespace(model_config=SimpleNamespace(head_dim=128), dtype=torch.bfloat16, device="cpu",
                             page_size=1)
    assert fa3_prefill_backend(runner, None) is None
    monkeypatch.setenv("SGLANG_LONGGEN_PREFILL_BACKEND", "fa4")
    with pytest.raises(ValueError, match="SGLANG_LONGGEN_PREFILL_BACKEND"):
        fa3_prefill_backend(runner, None)


def test_only_a_plain_prefill_goes_to_the_prefill_backend():
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    from sgl_longgen.sglang.backends.hybrid import _plain_prefill

    def batch(mode, spec_info=None):
        return SimpleNamespace(forward_mode=mode, spec_info=spec_info)

    assert _plain_prefill(batch(ForwardMode.EXTEND))
    assert not _plain_prefill(batch(ForwardMode.EXTEND, spec_info=object()))
    for mode in (ForwardMode.TARGET_VERIFY, ForwardMode.DECODE, ForwardMode.MIXED):
        assert not _plain_prefill(batch(mode))


@pytest.mark.parametrize("width", [1, N])
def test_captured_graphs_cascade_with_each_replays_shared_length(monkeypatch, width):
    """Opt-in cascade under CUDA graphs: captured with the shared part, replayed with the shared
    prefix of each batch, none for a batch that shares nothing or is padded (a padding row's prefix
    is one slot); every replay equals the reference. Plain steps (width 1) and small trees alike."""
    import sys

    monkeypatch.setattr(sys.modules[__name__], "N", width)
    be, g = make_backend(max_bs=4)
    be._cascade_min_shared = 256
    rows = [5, 2, 7, 1]
    share_rows(be, rows, 400)
    fb, _ = verify_batch(be, g, [700, 450, 420, 430], rows)
    be.init_forward_metadata_out_graph(fb, in_capture=True)
    captured = be.forward_metadata.attn
    assert captured.cascade and captured._cascade_meta[2].item() == 0  # captured over no slots
    for lens, req_rows, pad_to, shared in (
        ([800, 500, 410, 600], rows, None, 400),  # a common prompt of 400 slots
        ([800, 500, 410, 600], [3, 4, 6, 0], None, 0),  # rows that share nothing
        ([800, 500, 410], rows[:3], 4, 0),  # three requests in the graph of four
    ):
        fb2, trees2 = verify_batch(be, g, lens, req_rows, pad_to=pad_to)
        be.init_forward_metadata_out_graph(fb2, in_capture=False)
        attn = be.forward_metadata.attn
        assert attn is captured and attn.cascade and attn._cascade_meta[2].item() == shared
        q, k, v, layer = layer_inputs(g, 4 * width)
        o = be.forward_extend(q, k, v, layer, fb2)
        real = len(lens)
        assert max_err(o.view(-1, HQ, D)[: real * width], reference(be, fb2, trees2, q, k, v, layer, real)) <= TOL[DTYPE]


def test_graphs_of_wide_verifies_or_one_request_do_not_cascade(monkeypatch):
    from sgl_longgen.sglang.backends import hybrid

    be, g = make_backend(max_bs=4)
    be._cascade_min_shared = 256
    share_rows(be, [5, 2], 400)
    monkeypatch.setattr(hybrid, "GRAPH_CASCADE_MAX_TREE", N - 1)
    fb, _ = verify_batch(be, g, [700, 450], [5, 2])
    be.init_forward_metadata_out_graph(fb, in_capture=True)
    assert not be.forward_metadata.attn.cascade
    monkeypatch.setattr(hybrid, "GRAPH_CASCADE_MAX_TREE", N)
    fb, _ = verify_batch(be, g, [700], [5])
    be.init_forward_metadata_out_graph(fb, in_capture=True)
    assert not be.forward_metadata.attn.cascade
