"""The ``longgen`` backend under TOKENSWIFT's verify policy, on CPU (interpreted kernels).

Its TARGET_VERIFY also writes each layer's selection scores, eager and in the CUDA-graph path
(one persistent buffer, replayed with new requests), equal to the fp32 reference and leaving the
attention output as it was; a draft decode with per-layer slot lists hands its decode wrapper, before
layer ``l`` runs, exactly layer ``l``'s list, whether the wrapper reads the input's own indices
(eager) or a graph's buffer filled from the draft graph's persistent per-layer buffer.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch
from kernel_cases import max_err
from test_longgen_backend_logic import D, HKV, HQ, N, layer_inputs, make_backend, verify_batch
from test_longgen_backend_logic import pytestmark  # noqa: F401  (CPU only: the GPU runs the real backend)

from sgl_longgen.kernels.reference import prefix_logit_scores_reference
from sgl_longgen.sglang.capture import VerifyScores
from sgl_longgen.sglang.draft_graph import DraftGraphRunner, _Graph
from sgl_longgen.sglang.inputs import PartialDraftInput

LAYERS = 2
TOL = 1e-3  # fp32 logits of fp16 inputs: accumulation order only


def scores_reference(be, fb, q, layer, real_bs):
    rt = be.req_to_token_pool.req_to_token
    lens = fb.seq_lens_cpu[:real_bs].tolist()
    indptr = torch.tensor([0] + torch.cumsum(torch.tensor(lens), 0).tolist(), dtype=torch.int32)
    idx = torch.cat([rt[r, :L] for r, L in zip(fb.req_pool_indices[:real_bs].tolist(), lens)])
    n = real_bs * N
    return prefix_logit_scores_reference(q[:n].view(n, HQ, D), be.token_to_kv_pool.k, indptr, idx, 2, layer.scaling)


def run_layers(be, fb, g, real_bs):
    """Every layer's verify attention; checks each layer's scores; returns the outputs."""
    outs = []
    for i in range(LAYERS):
        q, k, v, layer = layer_inputs(g, fb.batch_size * N)
        layer.layer_id = i
        outs.append((q, k, v, layer, be.forward_extend(q, k, v, layer, fb)))
        ref = scores_reference(be, fb, q, layer, real_bs)
        got = be.forward_metadata.scores[:, i]
        for b, L in enumerate(fb.seq_lens_cpu[:real_bs].tolist()):
            assert max_err(got[b, :, :L], ref[b, :, :L]) <= TOL
    return outs


def test_eager_verify_writes_each_layers_scores_and_the_same_output():
    be, g = make_backend()
    be.verify_scores = VerifyScores(LAYERS, HKV, 1024, "cpu")
    fb, _ = verify_batch(be, g, [700, 1, 33], [5, 2, 7])
    be.init_forward_metadata(fb)
    assert be.forward_metadata.score_rows == 2 and be.forward_metadata.attn.path == "triton"
    outs = run_layers(be, fb, g, 3)
    assert be.verify_scores.take(3).data_ptr() == be.forward_metadata.scores.data_ptr()  # what the drafter ranks
    # Without the scores, the same attention output.
    plain = make_backend()[0]
    plain.token_to_kv_pool = be.token_to_kv_pool
    plain.init_forward_metadata(fb)
    for q, k, v, layer, o in outs:
        assert torch.equal(plain.forward_extend(q, k, v, layer, fb), o)


def test_cuda_graph_path_scores_into_one_persistent_buffer():
    be, g = make_backend(max_bs=4)
    be.verify_scores = VerifyScores(LAYERS, HKV, 1024, "cpu")
    fb, _ = verify_batch(be, g, [300, 12], [1, 3], pad_to=4)
    be.init_forward_metadata_out_graph(fb, in_capture=True)
    captured = be.forward_metadata.scores
    assert captured.shape == (4, LAYERS, HKV, 1024)
    run_layers(be, fb, g, 2)
    fb2, _ = verify_batch(be, g, [900, 2, 64], [6, 0, 4], pad_to=4)
    be.init_forward_metadata_out_graph(fb2, in_capture=False)
    assert be.forward_metadata.scores.data_ptr() == captured.data_ptr()  # what a replay writes
    run_layers(be, fb2, g, 3)
    assert be.verify_scores.take(3).data_ptr() == captured.data_ptr()
    assert be.verify_scores.take(3) is None  # once


class DecodeWrapper:
    """A FlashInfer decode wrapper as far as running goes, on the CPU: each request's query over
    the slots in its indices buffer, read when it runs (as FlashInfer's kernel reads them)."""

    def __init__(self, kv_indptr, indices):
        self.indptr = kv_indptr.tolist()
        self._paged_kv_indices_buf = indices
        self._plan_info = object()

    def forward(self, q, kv_cache, sm_scale, **kwargs):
        k, v = kv_cache
        out = torch.empty_like(q)
        for b in range(len(self.indptr) - 1):
            slots = self._paged_kv_indices_buf[self.indptr[b] : self.indptr[b + 1]].long()
            out[b] = attention(q[b], k[slots], v[slots], sm_scale)
        return out


def attention(q, k, v, scale):
    """One query ``[Hq, D]`` over keys ``[n, Hkv, D]``, fp32."""
    group = HQ // HKV
    kk, vv = k.float().repeat_interleave(group, 1), v.float().repeat_interleave(group, 1)
    p = torch.softmax(torch.einsum("hd,nhd->hn", q.float(), kk) * scale, dim=-1)
    return torch.einsum("hn,nhd->hd", p, vv).to(q.dtype)


def per_layer_draft(be, g, bs, width):
    """Random per-layer slot lists of ``width`` slots per request (the root last)."""
    rt = be.req_to_token_pool.req_to_token
    rows = torch.stack([torch.cat([rt[b, torch.randperm(200, generator=g)[: width - 1]], rt[b, 300:301]])
                        for b in range(bs) for _ in range(LAYERS)]).view(bs, LAYERS, width)
    per_layer = rows.transpose(0, 1).reshape(LAYERS, bs * width).contiguous()
    indptr = torch.arange(bs + 1, dtype=torch.int32) * width
    return PartialDraftInput(positions=torch.full((bs,), 300), kv_indptr=indptr, kv_indices=per_layer[0].clone(),
                             layer_kv_indices=per_layer)


def decode_layers(be, g, spec, wrapper, bs, width):
    from sglang.srt.layers.attention.flashinfer_backend import DecodeMetadata
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    be.num_wrappers, be.decode_uses_dequant_workspace = 1, False
    be.forward_metadata = DecodeMetadata([wrapper])
    rt = be.req_to_token_pool.req_to_token
    fb = SimpleNamespace(batch_size=bs, forward_mode=ForwardMode.DECODE, spec_info=spec,
                         out_cache_loc=torch.stack([rt[b, 300] for b in range(bs)]).long())
    rows = spec.layer_kv_indices
    for i in range(LAYERS):
        q, k, v, layer = layer_inputs(g, bs)
        layer.layer_id, layer.is_cross_attention, layer.k_scale_float, layer.v_scale_float = i, False, None, None
        o = be.forward_decode(q, k, v, layer, fb).view(bs, HQ, D)
        pool = be.token_to_kv_pool
        for b in range(bs):
            for j, same in ((i, True), ((i + 1) % LAYERS, False)):
                slots = rows[j, b * width : (b + 1) * width].long()
                want = attention(q.view(bs, HQ, D)[b], pool.k[slots], pool.v[slots], layer.scaling)
                assert torch.equal(o[b], want) == same


def test_a_per_layer_draft_decode_reads_each_layers_slots_eagerly():
    be, g = make_backend()
    spec = per_layer_draft(be, g, 2, 17)
    decode_layers(be, g, spec, DecodeWrapper(spec.kv_indptr, spec.kv_indices), 2, 17)


def test_a_per_layer_draft_decode_reads_each_layers_slots_from_the_graph_buffers():
    """The draft graph's persistent per-layer buffer (as wide as any draft of its batch size),
    refilled for a later draft, feeds the wrapper's graph buffer."""
    be, g = make_backend()
    runner = DraftGraphRunner.__new__(DraftGraphRunner)
    runner.kv_width = 20
    graph_indices = torch.zeros(4096, dtype=torch.int32)
    runner.runner = SimpleNamespace(attn_backend=SimpleNamespace(
        kv_indptr=[torch.zeros(9, dtype=torch.int32)], cuda_graph_kv_indices=[graph_indices], num_wrappers=1))
    captured = per_layer_draft(be, g, 2, 17)
    buffer = runner._layer_buffer(captured, 2)
    assert buffer.shape == (LAYERS, 40) and captured.layer_kv_indices is buffer
    entry = _Graph(graph=None, batch=SimpleNamespace(batch_size=2), normed=None, outputs=(), layer_indices=buffer)
    wrapper = DecodeWrapper(captured.kv_indptr, graph_indices)
    decode_layers(be, g, captured, wrapper, 2, 17)
    later = per_layer_draft(be, g, 2, 17)
    runner._bind(entry, later)  # what a replay's load does
    assert torch.equal(buffer[:, :34], later.layer_kv_indices)
    later.layer_kv_indices = buffer  # the replay reads the captured buffer
    decode_layers(be, g, later, wrapper, 2, 17)
