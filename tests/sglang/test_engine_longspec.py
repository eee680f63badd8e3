"""LONGSPEC behind ``sgl.Engine``: lossless against the same engine without speculation, with a
drafter memory that does not grow with the context.

Two drafters: the random-init one ``tiny-random`` ships (``longspec-drafter/``), and one fitted in
a few seconds to the target's own greedy continuations of the test prompts, whose drafts are
really accepted (deep into the beam), so the commit of multi-token paths is exercised. Below
the engines, the pieces that meet SGLang are checked against the reference runtime's: the
batched beam against the per-request one, the cross-attention reading the target's K/V through
a slot row of a paged pool (and the Triton kernel against its PyTorch twin), the queries' RoPE
taken from SGLang's rotary module against the runtime's (Llama-3.1 scaling). A third engine runs
the fitted drafter with a reduced draft vocabulary (the most frequent half of the tokens the target
emits here), still token-identical; bad token maps are refused at startup naming the file.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch
from helpers import fit_longspec
from sglang_harness import PROMPTS, check_budgets, engine_args, greedy, model_path, stop, worker_settings

from sgl_longgen.core.longspec import CONFIG_FILE, WEIGHTS_FILE, LongSpecDrafter
from sgl_longgen.core.longspec_beam import WindowCache, expand
from sgl_longgen.core.longspec_checkpoint import load_drafter
from sgl_longgen.core.longspec_rope import rope_tables
from sgl_longgen.core.longspec_weights import draft_head
from sgl_longgen.kernels.longspec_step import RingPool, expand_batch
from sgl_longgen.runtime import load_model, resolve_model
from sgl_longgen.runtime.model import ForwardSpec
from sgl_longgen.sglang.penalty import ContextualPenaltyProcessor
from sgl_longgen.training.draft_vocab import frequent_tokens

NEW_TOKENS = 128
PENALTY = {"penalty": 1.3, "penalty_window": 32}
FIT_STEPS = 12
# More requests than the harness's prompts, of several lengths, decoding side by side.
CONCURRENT = PROMPTS + [[256] + list(b"import os\nimport sys\n\n"), [256, 42] * 20, [256] + list(range(60, 140))]


def random_drafter_dir():
    return model_path() / "longspec-drafter"


def start(drafter_dir, **extra):
    import sglang as sgl

    path = None if drafter_dir is None else str(drafter_dir)
    args = engine_args(speculative_algorithm="LONGSPEC", speculative_draft_model_path=path, **extra)
    args.pop("disable_overlap_schedule")  # the plugin turns it off for its synchronous worker
    return sgl.Engine(**args)


@pytest.fixture(scope="module")
def sequences(plain_engine) -> torch.Tensor:
    outs = plain_engine.generate(input_ids=PROMPTS, sampling_params=greedy(NEW_TOKENS))
    penalized = plain_engine.generate(input_ids=PROMPTS, sampling_params=greedy(NEW_TOKENS, custom_params=PENALTY),
                                      custom_logit_processor=[ContextualPenaltyProcessor.to_str()] * len(PROMPTS))
    seqs = [p + o["output_ids"] for p, o in zip(PROMPTS + PROMPTS, outs + penalized)]
    length = min(len(s) for s in seqs)
    return torch.tensor([s[:length] for s in seqs])


@pytest.fixture(scope="module")
def fitted_dir(sequences, tmp_path_factory):
    target = load_model(model_path(), "float64").model
    return fit_longspec(target, sequences, FIT_STEPS).save(tmp_path_factory.mktemp("longspec") / "fitted")


@pytest.fixture(scope="module")
def reduced_dir(fitted_dir, sequences, tmp_path_factory):
    """The fitted drafter over the most frequent half of the distinct tokens of the test sequences."""
    token_map = frequent_tokens(sequences, 258, sequences.unique().numel() // 2)
    return load_drafter(fitted_dir).with_token_map(token_map).save(tmp_path_factory.mktemp("longspec") / "reduced")


@pytest.fixture(scope="module")
def random_engine():
    engine = start(random_drafter_dir())
    yield engine
    stop(engine)


@pytest.fixture(scope="module")
def fitted_engine(fitted_dir):
    engine = start(fitted_dir)
    yield engine
    stop(engine)


def identical(plain_engine, engine, prompts, n: int, **extra) -> list[dict]:
    kwargs = {}
    if "custom_params" in extra:
        kwargs["custom_logit_processor"] = [ContextualPenaltyProcessor.to_str()] * len(prompts)
    want = plain_engine.generate(input_ids=prompts, sampling_params=greedy(n, **extra), **kwargs)
    got = engine.generate(input_ids=prompts, sampling_params=greedy(n, **extra))
    for w, g in zip(want, got):
        assert g["output_ids"] == w["output_ids"]
        assert len(g["output_ids"]) == n
    return [g["meta_info"] for g in got]


# -- the engines ----------------------------------------------------------------------------------


def test_random_drafter_token_budget_is_exact(plain_engine, random_engine):
    check_budgets(plain_engine, random_engine)


def test_random_drafter_concurrent_requests(plain_engine, random_engine):
    metas = identical(plain_engine, random_engine, CONCURRENT, 256)
    assert all(m["spec_accept_length"] >= 1.0 for m in metas)


def test_fitted_drafter_is_accepted_and_identical(plain_engine, fitted_engine):
    metas = identical(plain_engine, fitted_engine, PROMPTS, NEW_TOKENS)
    taus = [m["spec_accept_length"] for m in metas]
    assert min(taus) > 1.5, taus  # it speculates, or the comparison proves little


def test_steps_queued_by_the_call_before_are_identical(plain_engine, fitted_dir):
    """With the next step's draft and verify queued before a step returns (``.spec_ahead``,
    opt-in): the draft cross-attends to the KV the step before committed. Plain decoding's
    output, concurrent requests included, and drafts still accepted."""
    with worker_settings(SPEC_RUN_AHEAD="1"):
        engine = start(fitted_dir)
    try:
        metas = identical(plain_engine, engine, PROMPTS, NEW_TOKENS)
        assert min(m["spec_accept_length"] for m in metas) > 1.5
        identical(plain_engine, engine, CONCURRENT, 96)
    finally:
        stop(engine)


def test_fitted_drafter_with_the_contextual_penalty(plain_engine, fitted_engine):
    metas = identical(plain_engine, fitted_engine, PROMPTS, NEW_TOKENS, custom_params=PENALTY)
    taus = [m["spec_accept_length"] for m in metas]
    assert min(taus) > 1.5, taus


def test_fitted_drafter_token_budget_is_exact(plain_engine, fitted_engine):
    check_budgets(plain_engine, fitted_engine)


def test_fitted_drafter_concurrent_requests(plain_engine, fitted_engine):
    metas = identical(plain_engine, fitted_engine, CONCURRENT, 256)
    assert max(m["spec_accept_length"] for m in metas) > 1.5


def test_a_reduced_draft_vocabulary_is_identical(plain_engine, reduced_dir):
    """The worker drafts over the mapped rows of the target's head (eager beam here; the graphed
    beam reads the same gathered tensor): plain decoding's output, tokens outside the map
    included, and drafts still accepted."""
    engine = start(reduced_dir)
    try:
        metas = identical(plain_engine, engine, PROMPTS, NEW_TOKENS)
        assert min(m["spec_accept_length"] for m in metas) > 1.2, metas
        identical(plain_engine, engine, PROMPTS, NEW_TOKENS, custom_params=PENALTY)
        identical(plain_engine, engine, CONCURRENT, 64)
        outs = plain_engine.generate(input_ids=PROMPTS, sampling_params=greedy(NEW_TOKENS))
        mapped = set(load_drafter(reduced_dir).token_map.tolist())
        assert any(set(o["output_ids"]) - mapped for o in outs)  # tokens it can never draft
    finally:
        stop(engine)


def test_fp8_drafter_weights_are_identical(plain_engine, reduced_dir, tmp_path):
    """The drafter directory asks for fp8 matrices; the worker quantizes the block and an fp8 copy
    of the head's mapped rows once (the fp8 twin on a CPU): plain decoding's output, drafts accepted."""
    fp8_dir = tmp_path / "fp8"
    shutil.copytree(reduced_dir, fp8_dir)
    (fp8_dir / "longgen.toml").write_text('[longspec]\nweights = "fp8"\n')
    engine = start(fp8_dir)
    try:
        metas = identical(plain_engine, engine, PROMPTS, NEW_TOKENS)
        assert min(m["spec_accept_length"] for m in metas) > 1.2, metas
        identical(plain_engine, engine, CONCURRENT, 64)
    finally:
        stop(engine)


def test_sampled_longspec_completes(random_engine):
    params = [{"max_new_tokens": 64, "temperature": 0.9, "top_p": 0.95, "ignore_eos": True, "sampling_seed": s}
              for s in range(len(PROMPTS))]
    out = random_engine.generate(input_ids=PROMPTS, sampling_params=params)
    assert all(len(o["output_ids"]) == 64 and o["meta_info"]["spec_accept_length"] >= 1.0 for o in out)


def test_drafter_memory_does_not_grow_with_the_context(plain_engine, random_engine):
    """The drafter's per-request memory is its window ring: the same bytes at a 40- and a
    1500-token context, while its cross-attention reads the whole committed context."""
    window, kv_heads, head_dim = 512, 2, 16  # the drafter's and tiny-random's
    seen = {}
    for length in (40, 1500):
        prompt = ([256] + list(range(250))) * (length // 251 + 1)
        meta, = identical(plain_engine, random_engine, [prompt[:length]], 16, custom_params={"longgen_timing": "host"})
        notes = {k: [x for x in meta[f"longgen_longspec_{k}"] if x is not None] for k in ("ring_bytes", "ring_tokens",
                                                                                         "cross_tokens")}
        seen[length] = notes
        assert notes["cross_tokens"][0] == length  # the first draft reads the whole prompt's K/V
        if length < window:  # the ring holds the whole history (the root included) ...
            assert [t - 1 for t in notes["ring_tokens"]] == notes["cross_tokens"]
        else:  # ... or its last window positions, no more
            assert set(notes["ring_tokens"]) == {window}
    assert set(seen[40]["ring_bytes"]) == set(seen[1500]["ring_bytes"]) == {2 * kv_heads * window * head_dim * 4
                                                                            + window * 8}  # K, V fp32; positions


# -- startup refusals -----------------------------------------------------------------------------


def test_missing_files_are_named(tmp_path):
    shutil.copytree(random_drafter_dir(), tmp_path / "no-config")
    (tmp_path / "no-config" / CONFIG_FILE).unlink()
    with pytest.raises(ValueError, match=r"LONGSPEC: LongSpec drafter checkpoint is missing .*no-config/longspec.json"):
        start(tmp_path / "no-config")
    shutil.copytree(random_drafter_dir(), tmp_path / "no-weights")
    (tmp_path / "no-weights" / WEIGHTS_FILE).unlink()
    with pytest.raises(ValueError, match=r"LONGSPEC: .*no-weights/longspec\.safetensors"):
        start(tmp_path / "no-weights")
    with pytest.raises(ValueError, match=r"LONGSPEC: LongSpec drafter directory not found"):
        start(tmp_path / "nope")
    with pytest.raises(ValueError, match=r"LONGSPEC needs --speculative-draft-model-path"):
        start(None)


def test_bad_token_maps_are_refused_naming_the_file(tmp_path, reduced_dir):
    from safetensors.torch import load_file, save_file

    state = load_file(reduced_dir / WEIGHTS_FILE)
    good = state["token_map"].tolist()
    cfg = json.loads((reduced_dir / CONFIG_FILE).read_text())
    for name, token_map, size, message in [
        ("range", good[:-1] + [258], None, r"tensor token_map has ids out of range \[0, 258\): \[258\]"),
        ("dupes", [good[1]] + good[1:], None, r"tensor token_map lists target ids more than once"),
        ("short", good[:-1], None, rf"tensor token_map has shape \({len(good) - 1},\), longspec\.json implies"),
        ("big", good, 259, r"'draft_vocab_size' must be an integer in \[1, vocab_size = 258\], got 259"),
    ]:
        bad = tmp_path / name
        bad.mkdir()
        (bad / CONFIG_FILE).write_text(json.dumps({**cfg, **({"draft_vocab_size": size} if size else {})}))
        save_file({**state, "token_map": torch.tensor(token_map)}, bad / WEIGHTS_FILE)
        where = bad / (CONFIG_FILE if size else WEIGHTS_FILE)
        with pytest.raises(ValueError, match=rf"LONGSPEC: {where}: {message}"):
            start(bad)


def test_a_drafter_for_another_target_is_refused(tmp_path):
    other = resolve_model("tiny-qwen2") / "longspec-drafter"
    with pytest.raises(ValueError, match=r"LONGSPEC: LongSpec drafter in .* was built for hidden_size = \d+ but the "
                                         r"model's is 128 \(.*longspec\.json\)"):
        start(other)


@pytest.mark.parametrize("key,value", [("rope_theta", 500000.0), ("rope_scaling", None), ("num_kv_heads", 4)])
def test_a_drafter_with_another_rope_or_shape_is_refused(tmp_path, key, value):
    drafter = shutil.copytree(random_drafter_dir(), tmp_path / "drafter")
    cfg = json.loads((drafter / CONFIG_FILE).read_text())
    cfg[key] = value
    (drafter / CONFIG_FILE).write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=rf"LONGSPEC: LongSpec drafter in .* was built for {key} = "):
        start(drafter)


def test_tensor_parallelism_and_a_quantized_kv_cache_are_refused():
    with pytest.raises(ValueError, match=r"LONGSPEC: runs with --tp-size 1 and --pp-size 1 for now"):
        start(random_drafter_dir(), tp_size=2)
    with pytest.raises(ValueError, match=r"LONGSPEC: .* --kv-cache-dtype auto, not fp8_e4m3"):
        start(random_drafter_dir(), kv_cache_dtype="fp8_e4m3")


def test_the_defaults_are_the_drafter_directory_s(tmp_path):
    """``longgen.toml`` sets the beam; the verify width follows it (root + tree_size nodes)."""
    from types import SimpleNamespace

    from sgl_longgen.sglang.plugin import prepare_server_args

    drafter = shutil.copytree(random_drafter_dir(), tmp_path / "drafter")
    (drafter / "longgen.toml").write_text("[longspec]\nwidths = [3, 6, 6]\ntree_size = 10\n")
    args = SimpleNamespace(**engine_args(
        speculative_algorithm="LONGSPEC", speculative_draft_model_path=str(drafter), speculative_num_draft_tokens=None,
        speculative_num_steps=None, speculative_eagle_topk=None, page_size=None, tp_size=1, pp_size=1,
        kv_cache_dtype="auto", decode_attention_backend=None, prefill_attention_backend=None,
        return_hidden_states_mode=None))
    prepare_server_args(args)
    assert (args.speculative_num_draft_tokens, args.speculative_num_steps, args.page_size) == (11, 3, 1)
    assert args.return_hidden_states_mode is None  # it reads the KV cache, not hidden states
    (drafter / "longgen.toml").write_text("[longspec]\nwidths = []\n")
    args.speculative_num_draft_tokens = None
    with pytest.raises(ValueError, match=r"longgen\.toml.*widths"):
        prepare_server_args(args)


def test_longspec_gets_the_hybrid_verify_backend_where_sglang_picks_flashinfer():
    from types import SimpleNamespace

    from sgl_longgen.sglang.plugin import prefer_longgen_backend

    assert prefer_longgen_backend("flashinfer", SimpleNamespace(speculative_algorithm="LONGSPEC")) == "longgen"
    assert prefer_longgen_backend("triton", SimpleNamespace(speculative_algorithm="LONGSPEC")) is None


# -- the pieces that meet SGLang ------------------------------------------------------------------


def _history(n: int, seed: int) -> list[int]:
    return torch.randint(0, 258, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("draft_vocab", [None, 100])
def test_the_batched_beam_over_a_paged_pool_is_the_reference_beam(draft_vocab):
    """Requests of different lengths, their target K/V at scattered pool slots (rejected verify
    nodes' garbage next to them): the SGLang path's beam is the reference runtime's, per request;
    with a reduced draft vocabulary too (each through its head of gathered rows, mapped ids only)."""
    from sgl_longgen.sglang.longspec import committed_attention

    lm = load_model(model_path(), "float64")
    net = lm.model
    d = LongSpecDrafter.for_target(lm.config, window=8)
    d.reset_parameters(torch.Generator().manual_seed(1), final_norm=net.model.norm.weight, std=0.5)
    d = d.double().eval().requires_grad_(False)
    if draft_vocab:
        d = d.with_token_map(torch.randperm(258, generator=torch.Generator().manual_seed(9))[:draft_vocab])
    # each runtime gathers its own rows (SGLang's from its possibly padded head: the first vocab_size rows)
    sglang_head = draft_head(d, net.lm_head.weight[:258], net.lm_head)
    runtime_head = draft_head(d, net.lm_head.weight, net.lm_head)
    last = lm.config.num_hidden_layers - 1
    histories = [_history(n, seed) for n, seed in ((30, 0), (9, 1), (17, 2))]
    g = torch.Generator().manual_seed(3)
    slots = torch.randperm(200, generator=g)
    k_pool = torch.randn(200, 2, 16, generator=g, dtype=torch.float64) * 50  # garbage everywhere ...
    v_pool = torch.randn(200, 2, 16, generator=g, dtype=torch.float64) * 50
    rows, caches, offset = [], [], 0
    for h in histories:
        cache = net.new_cache(len(h) + 8)
        net(torch.tensor(h[:-1]), torch.arange(len(h) - 1), cache, ForwardSpec(start=0))
        row = slots[offset : offset + len(h) - 1]
        k_pool[row] = cache.k[last, :, : len(h) - 1].transpose(0, 1)  # ... but at the committed slots
        v_pool[row] = cache.v[last, :, : len(h) - 1].transpose(0, 1)
        rows.append(row.to(torch.int32))
        caches.append(cache)
        offset += len(h) + 6  # room for a verify window between requests
    rope = lambda p: rope_tables(net.inv_freq, p, torch.float64)
    widths, tree_size = [4, 8, 8], 14
    pool = RingPool(2, 8, 16, torch.float64, "cpu", capacity=2)  # grows to hold the third request
    rings = [pool.take() for _ in histories]
    attend = committed_attention(k_pool, v_pool, rows, d.cross_attn.scale, kernel=False)
    beam = expand_batch(d, net.model.embed_tokens, sglang_head, rope, pool, rings, attend, histories, [0, 0, 0],
                        widths, tree_size)
    if draft_vocab:
        assert set(beam.tokens.reshape(-1).tolist()) <= set(d.token_map.tolist())
    for b, (h, cache) in enumerate(zip(histories, caches)):
        ring = WindowCache(2, 8, 16, torch.float64, "cpu")
        want = expand(d, net.model.embed_tokens, runtime_head, net.inv_freq, ring, cache.k[last], cache.v[last], h, 0,
                      widths, tree_size)
        assert beam.tokens[b].tolist() == want.tokens[0].tolist()
        assert beam.parents[b].tolist() == want.parents[0].tolist()
        assert torch.allclose(beam.scores[b], want.scores[0], atol=1e-9)
        r = rings[b]
        assert torch.equal(pool.pos[r], ring.pos) and torch.allclose(pool.k[r], ring.k, atol=1e-12)
        assert torch.allclose(pool.v[r], ring.v, atol=1e-12)
    # A committed slot moved is seen (the rows, not the pool's order, decide what is read).
    k_pool[rows[0][3]] += 5.0
    for r in rings:  # the same requests drafting from scratch
        pool.give(r)
    rings = [pool.take() for _ in histories]
    moved = expand_batch(d, net.model.embed_tokens, sglang_head, rope, pool, rings,
                         committed_attention(k_pool, v_pool, rows, d.cross_attn.scale, kernel=False), histories,
                         [0, 0, 0], widths, tree_size)
    assert not torch.allclose(moved.scores[0], beam.scores[0]) and torch.equal(moved.scores[1], beam.scores[1])


def test_the_queries_rope_is_sglangs_and_the_runtimes(monkeypatch):
    """cos/sin from SGLang's rotary module of the target (Llama-3.1 scaling) rotate a query as
    SGLang rotates it, and as the reference runtime (where drafters are trained) does."""
    from types import SimpleNamespace

    import sglang.srt.layers.rotary_embedding.base as rope_base
    from sglang.srt.layers.rotary_embedding import get_rope

    # Outside a server no execution settings are published; the module only asks whether it
    # runs in a deterministic on-policy mode (it does not).
    monkeypatch.setattr(rope_base, "get_exec", lambda: SimpleNamespace(deterministic=SimpleNamespace(
        rl_on_policy_target=None)))
    from sgl_longgen.core.longspec_rope import apply_rope
    from sgl_longgen.sglang.longspec import TargetRope, target_rotary

    cfg = json.loads((model_path() / "config.json").read_text())
    assert cfg["rope_scaling"]["rope_type"] == "llama3"
    head_dim = cfg["head_dim"]
    rotary = get_rope(head_dim, head_dim, cfg["max_position_embeddings"], cfg["rope_theta"], True,
                      dict(cfg["rope_scaling"]), torch.float32)
    assert target_rotary(torch.nn.ModuleList([rotary]), head_dim) is rotary
    rope = TargetRope(rotary)
    positions = torch.tensor([[0, 1, 7, 2047], [2048, 4095, 9000, 16383]])
    cos, sin = rope(positions)
    runtime = load_model(model_path(), "float64").model
    # The same frequencies (Llama-3.1's piecewise scaling); SGLang takes float32 angles, the
    # runtime float64 ones, hence a tolerance growing with the position (a missing scaling would
    # be off by O(1) at these positions).
    assert torch.allclose(rotary._compute_inv_freq(rotary.base).double(), runtime.inv_freq, rtol=1e-6)
    want_cos, want_sin = rope_tables(runtime.inv_freq, positions, torch.float32)
    assert torch.allclose(cos, want_cos, atol=2e-3) and torch.allclose(sin, want_sin, atol=2e-3)
    assert torch.allclose(cos[0, :3], want_cos[0, :3], atol=1e-6)
    q = torch.randn(2, 3, 4, head_dim, generator=torch.Generator().manual_seed(0))  # [B, H, T, D]
    mine = apply_rope(q, cos, sin)
    flat = q.permute(0, 2, 1, 3).reshape(8, 3 * head_dim)  # SGLang's [tokens, H * D]
    theirs, _ = rotary.forward_native(positions.reshape(-1), flat.clone(), flat.clone())
    assert torch.allclose(mine.permute(0, 2, 1, 3).reshape(8, -1), theirs, atol=1e-5)
    with pytest.raises(Exception, match="NeoX-style"):
        target_rotary(torch.nn.ModuleList([get_rope(head_dim, head_dim // 2, 64, 10000.0, True)]), head_dim)


def test_the_prefix_kernel_path_is_its_torch_twin():
    """The GPU path's cross-attention (the Triton prefix kernel over kv_indptr / kv_indices, in the
    CPU interpreter here) against the gather + SDPA path, on scattered slots of several requests."""
    code = textwrap.dedent("""
        import os
        os.environ["TRITON_INTERPRET"] = "1"
        from sgl_longgen.sglang.cpu import install_stand_in
        install_stand_in()
        import torch
        from sgl_longgen.sglang.longspec import committed_attention
        g = torch.Generator().manual_seed(0)
        k = torch.randn(300, 2, 16, generator=g).half()
        v = torch.randn(300, 2, 16, generator=g).half()
        perm = torch.randperm(300, generator=g)
        rows = [perm[:150].int(), perm[150:153].int(), perm[160:260].int()]
        q = torch.randn(3, 5, 8, 16, generator=g).half()  # [B, T, Hq, D]: GQA 4
        kernel = committed_attention(k, v, rows, 0.25, kernel=True)(q).float()
        twin = committed_attention(k.float(), v.float(), rows, 0.25, kernel=False)(q.float())
        err = (kernel - twin).abs().max().item()
        assert kernel.shape == twin.shape == (3, 5, 8, 16) and err < 5e-3, err
        # the twin is plain attention: request 1's queries over its three slots
        keys, values = k[rows[1].long()].float(), v[rows[1].long()].float()  # [3, Hkv, D]
        w = torch.einsum("thd,shd->ths", q[1].float(), keys.repeat_interleave(4, dim=1)) * 0.25
        want = torch.einsum("ths,shd->thd", w.softmax(-1), values.repeat_interleave(4, dim=1))
        assert torch.allclose(twin[1], want, atol=1e-5)
        print("OK", err)
    """)
    env = dict(os.environ, OPENBLAS_NUM_THREADS="1")  # the interpreter's products go through numpy
    res = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=600,
                         env=env)
    assert res.returncode == 0 and "OK" in res.stdout, res.stdout[-2000:] + res.stderr[-3000:]


def test_gpu_check_makes_a_drafter_the_startup_check_accepts(tmp_path):
    """``bench.gpu_check``'s random drafter for a target config passes LONGSPEC's startup inspection
    (here for a small config: the 8B one writes 1 GB)."""
    from sgl_longgen.bench.gpu_check import make_longspec_drafter
    from sgl_longgen.sglang.draft_dir import inspect_longspec_draft_dir

    cfg = json.loads((model_path() / "config.json").read_text())
    target = tmp_path / "model"
    target.mkdir()
    (target / "config.json").write_text(json.dumps(cfg))
    drafter = make_longspec_drafter(tmp_path, cfg)
    draft = inspect_longspec_draft_dir(drafter, target)
    assert draft.checkpoint["hidden_size"] == cfg["hidden_size"] and draft.checkpoint["window"] == 512
    # the spec phase's reduced draft vocabulary: a valid token map of that many ids
    reduced = inspect_longspec_draft_dir(make_longspec_drafter(tmp_path, cfg, draft_vocab=100), target)
    assert reduced.path != draft.path and reduced.checkpoint["draft_vocab_size"] == 100
    assert make_longspec_drafter(tmp_path, cfg, draft_vocab=cfg["vocab_size"]) == drafter  # the whole vocabulary: none



def test_gpu_check_times_the_beam(monkeypatch):
    """The beam timing of ``gpu_check --phase longspec`` runs end to end (here on the CPU, a small
    config, a wall-clock timer; its Triton path needs a GPU and is reported as an error)."""
    import time

    import sgl_longgen.bench.kernels as bench_kernels
    from sgl_longgen.bench.gpu_check import longspec_drafter_ms

    def wall_us(fn):
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e6

    monkeypatch.setattr(bench_kernels, "time_us", wall_us)
    cfg = json.loads((model_path() / "config.json").read_text())
    out = longspec_drafter_ms([100, 700], batch=2, config=cfg, device="cpu", draft_vocab=100)
    assert all(out[str(L)]["beam_torch_ms"] > 0 for L in (100, 700))
    # next to the full head, the same beam over a reduced draft vocabulary of 100 rows
    assert (out["vocab"], out["draft_vocab"]) == (258, 100)
    assert all(out[str(L)]["reduced_beam_torch_ms"] > 0 for L in (100, 700))
    assert "reduced_beam_torch_ms" not in longspec_drafter_ms([100], config=cfg, device="cpu")["100"]


def test_gpu_check_parses_the_longspec_draft_vocabulary():
    from sgl_longgen.bench.gpu_check import main, parser

    assert parser().parse_args(["--phase", "longspec"]).longspec_draft_vocab == 32768
    args = parser().parse_args(["--phase", "longspec", "--longspec-draft-vocab", "0", "--longspec-batch", "2"])
    assert (args.longspec_draft_vocab, args.longspec_batch) == (0, 2)
    with pytest.raises(SystemExit):
        main(["--phase", "longspec", "--longspec-draft-vocab", "-1"])
