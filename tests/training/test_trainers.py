"""The LM and heads trainers learn, keep the base frozen, and write checkpoints that load."""

import json

import pytest
import torch

from sgl_longgen.core.heads import TokenSwiftHeads
from sgl_longgen.runtime import load_model, resolve_model
from sgl_longgen.runtime.model import ForwardSpec
from sgl_longgen.training.config import ModelShape, TokenizerConfig
from sgl_longgen.training.export import hf_config, save_hf_model
from sgl_longgen.training.forward import causal_hidden
from sgl_longgen.training.heads import heads_loss
from sgl_longgen.training.lm import build_model, lm_loss
from sgl_longgen.training.tokenizer import train_tokenizer

SHAPE = ModelShape(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                   head_dim=16, intermediate_size=128, max_position_embeddings=512)


def fit(module, loss_fn, batch, steps=50, lr=3e-3):
    opt = torch.optim.AdamW([p for p in module.parameters() if p.requires_grad], lr=lr, weight_decay=0.0)
    losses = []
    for _ in range(steps):
        loss, metrics = loss_fn(batch)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    return losses, metrics


def test_lm_loss_decreases_on_a_fixed_batch():
    model = build_model(hf_config(SHAPE, 300, 0, 1), torch.device("cpu"), seed=0, std=0.02)
    batch = torch.randint(2, 300, (4, 33), generator=torch.Generator().manual_seed(1))
    losses, metrics = fit(model, lambda b: lm_loss(model, b), batch)
    assert losses[0] == pytest.approx(torch.log(torch.tensor(300.0)).item(), abs=0.3)  # starts near uniform
    assert losses[-1] < 0.5 * losses[0]
    assert float(metrics["acc"]) > 0.5  # it memorised the batch


def test_heads_loss_decreases_and_the_base_stays_frozen():
    lm = load_model(resolve_model("tiny-random"), "float32")
    before = {k: v.clone() for k, v in lm.model.state_dict().items()}
    heads = TokenSwiftHeads(lm.config.hidden_size, 3, lm.config.rms_norm_eps)
    heads.reset_parameters(torch.Generator().manual_seed(0))
    batch = torch.randint(0, lm.config.vocab_size, (4, 40), generator=torch.Generator().manual_seed(2))
    losses, metrics = fit(heads, lambda b: heads_loss(lm.model, heads, b), batch, lr=5e-3)
    assert losses[-1] < 0.7 * losses[0]
    assert all(float(metrics[f"acc{i}"]) > 0.2 for i in (1, 2, 3))
    after = lm.model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_heads_loss_uses_shifts_two_three_four():
    """Head i at position t is scored on token t + 1 + i (computed here position by position)."""
    lm = load_model(resolve_model("tiny-random"), "float64")
    heads = TokenSwiftHeads(lm.config.hidden_size, 3, lm.config.rms_norm_eps).double()
    heads.reset_parameters(torch.Generator().manual_seed(0), std=0.2)
    ids = torch.randint(0, lm.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(3))
    _, metrics = heads_loss(lm.model, heads, ids)
    with torch.no_grad():
        states = heads(causal_hidden(lm.model, ids))
    for i in (1, 2, 3):
        terms = [
            -torch.log_softmax(lm.model.lm_head(states[i - 1][b, t]), -1)[ids[b, t + 1 + i]]
            for b in range(2) for t in range(12 - 1 - i)
        ]
        assert float(metrics[f"loss{i}"]) == pytest.approx(float(torch.stack(terms).mean()), rel=1e-9)


def test_exported_checkpoint_loads_in_the_runtime_and_transformers(tmp_path, sample_text):
    tok_dir = train_tokenizer([sample_text] * 5, TokenizerConfig(vocab_size=300), tmp_path / "tok", 512,
                              show_progress=False)
    model = build_model(hf_config(SHAPE, 300, 0, 1), torch.device("cpu"), seed=0, std=0.1)
    config = hf_config(SHAPE, 300, 0, 1, "float32")
    save_hf_model(model, config, tmp_path / "lm", "float32", tok_dir)
    loaded = load_model(tmp_path / "lm", "float64")
    ids = loaded.tokenizer.encode("def walk(root):\n    return root\n")
    x = torch.tensor(ids)
    ours = loaded.model.logits(loaded.model(x, torch.arange(len(ids)), loaded.model.new_cache(len(ids)),
                                            ForwardSpec(start=0)))
    with torch.no_grad():
        trained = model.double().logits(causal_hidden(model.double(), x[None]))[0]
    assert torch.allclose(ours, trained, atol=1e-9)
    transformers = pytest.importorskip("transformers")
    ref = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "lm", dtype=torch.float64).eval()
    hf_tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "lm")
    assert hf_tok("def walk(root):\n    return root\n")["input_ids"] == ids
    with torch.no_grad():
        want = ref(input_ids=x[None]).logits[0]
    assert (ours - want).abs().max() < 1e-5


def test_bf16_export_halves_the_file_and_drops_the_tied_head(tmp_path):
    from safetensors import safe_open

    model = build_model(hf_config(SHAPE, 300, 0, 1), torch.device("cpu"), seed=0, std=0.02)
    config = hf_config(SHAPE, 300, 0, 1)
    save_hf_model(model, config, tmp_path / "f32", "float32")
    save_hf_model(model, config, tmp_path / "bf16", "bfloat16")
    with safe_open(str(tmp_path / "bf16" / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
        assert f.get_tensor("model.embed_tokens.weight").dtype == torch.bfloat16
    assert "lm_head.weight" not in keys and "model.embed_tokens.weight" in keys
    sizes = [(tmp_path / d / "model.safetensors").stat().st_size for d in ("f32", "bf16")]
    assert sizes[1] < 0.55 * sizes[0]
    assert json.loads((tmp_path / "bf16" / "config.json").read_text())["torch_dtype"] == "bfloat16"
