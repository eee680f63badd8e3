"""The reference model against Hugging Face transformers, and its forward modes against each other."""

import pytest
import torch

from sgl_longgen.runtime import load_model, resolve_model
from sgl_longgen.runtime.model import ForwardSpec

MODELS = ["tiny-random", "tiny-qwen2"]


@pytest.fixture(scope="module", params=MODELS)
def loaded(request):
    return load_model(resolve_model(request.param), "float64")


def full_logits(lm, ids: list[int]) -> torch.Tensor:
    cache = lm.model.new_cache(len(ids))
    h = lm.model(torch.tensor(ids), torch.arange(len(ids)), cache, ForwardSpec(start=0))
    return lm.model.logits(h)


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("start", [0, 3000])
def test_matches_transformers(name, start):
    """Same logits as HF's implementation. HF computes RoPE angles in float32 (we use float64),
    so the tolerance grows with the position; a structural mistake would be off by O(1)."""
    transformers = pytest.importorskip("transformers")
    path = resolve_model(name)
    ref = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64).eval()
    ours = load_model(path, "float64")
    ids = torch.randint(0, ours.config.vocab_size, (40,), generator=torch.Generator().manual_seed(0))
    # 3000 is past the llama3 scaling's original context of 2048.
    pos = torch.arange(start, start + 40)
    with torch.no_grad():
        want = ref(input_ids=ids[None], position_ids=pos[None]).logits[0]
    cache = ours.model.new_cache(start + 40)
    got = ours.model.logits(ours.model(ids, pos, cache, ForwardSpec(start=0)))
    assert (got - want).abs().max() < (1e-5 if start == 0 else 1e-3)


def test_chunked_prefill_equals_one_pass(loaded):
    ids = list(range(5, 70))
    cache = loaded.model.new_cache(len(ids))
    outs = []
    for lo in range(0, len(ids), 16):
        hi = min(len(ids), lo + 16)
        outs.append(loaded.model(torch.tensor(ids[lo:hi]), torch.arange(lo, hi), cache, ForwardSpec(start=lo)))
    assert torch.allclose(loaded.model.logits(torch.cat(outs)), full_logits(loaded, ids), atol=1e-10)


def test_tree_rows_equal_plain_decoding_of_each_path(loaded):
    from sgl_longgen.core.tree import DraftTree

    prefix = [7, 3, 9, 4, 4, 1]
    tree = DraftTree(root_token=11)
    for path in ([5, 6, 7], [5, 8], [2]):
        tree.add_path(path)
    cache = loaded.model.new_cache(64)
    L = len(prefix)
    loaded.model(torch.tensor(prefix), torch.arange(L), cache, ForwardSpec(start=0))
    h = loaded.model(tree.token_tensor(), tree.positions(L), cache, ForwardSpec(start=L, mask=tree.ancestor_mask()))
    got = loaded.model.logits(h)
    for node in range(len(tree)):
        seq = prefix + [11] + tree.path_tokens(node)
        assert torch.allclose(got[node], full_logits(loaded, seq)[-1], atol=1e-10)


def test_partial_forward_with_everything_visible_equals_the_full_forward(loaded):
    ids = list(range(20, 50))
    L = len(ids) - 1
    cache = loaded.model.new_cache(64)
    loaded.model(torch.tensor(ids[:L]), torch.arange(L), cache, ForwardSpec(start=0))
    groups = loaded.config.num_hidden_layers * loaded.config.n_kv_heads
    vis = torch.arange(L).expand(groups, -1)
    h = loaded.model(torch.tensor(ids[L:]), torch.tensor([L]), cache, ForwardSpec(start=L, visible=vis))
    assert torch.allclose(loaded.model.logits(h)[0], full_logits(loaded, ids)[-1], atol=1e-10)
    # ...and it did not write the cache.
    assert cache.k[:, :, L].abs().sum() == 0


def test_partial_forward_respects_per_head_selection(loaded):
    """Hiding a position from one KV head changes the result; hiding it from none does not."""
    ids = list(range(30, 60))
    L = len(ids) - 1
    cache = loaded.model.new_cache(64)
    loaded.model(torch.tensor(ids[:L]), torch.arange(L), cache, ForwardSpec(start=0))
    groups = loaded.config.num_hidden_layers * loaded.config.n_kv_heads
    full = torch.arange(L).expand(groups, -1).clone()
    drop = full.clone()
    drop[0, 5] = 6  # KV head 0 of layer 0 sees position 6 twice instead of position 5
    run = lambda vis: loaded.model(torch.tensor(ids[L:]), torch.tensor([L]), cache, ForwardSpec(start=L, visible=vis))
    assert not torch.allclose(run(full), run(drop))


def test_score_request_returns_gqa_scores_per_layer(loaded):
    ids = list(range(10, 40))
    cache = loaded.model.new_cache(64)
    spec = ForwardSpec(start=0, score=(len(ids) - 1, 4, len(ids)))
    loaded.model(torch.tensor(ids), torch.arange(len(ids)), cache, spec)
    assert len(spec.scores) == loaded.config.num_hidden_layers
    assert spec.scores[0].shape == (loaded.config.n_kv_heads, len(ids) - 4)


def test_cache_keep_compacts_accepted_rows():
    from sgl_longgen.runtime.kv_cache import KVCache

    c = KVCache(1, 1, 2, 10, torch.float64, "cpu")
    c.k[0, 0, :, 0] = torch.arange(10, dtype=torch.float64)
    c.keep(3, [0, 2, 5])
    assert c.k[0, 0, 3:6, 0].tolist() == [3.0, 5.0, 8.0]
    c.ensure(25)
    assert c.capacity >= 25 and c.k[0, 0, 3:6, 0].tolist() == [3.0, 5.0, 8.0]
