"""``config.json`` as transformers 5 writes it: RoPE in ``rope_parameters`` read as the top-level
fields were, and every field whose math the runtime does not compute refused by name."""

from __future__ import annotations

import json

import msgspec
import pytest
import torch

from sgl_longgen.errors import LonggenError
from sgl_longgen.runtime import load_model
from sgl_longgen.runtime.checkpoint import read_config
from sgl_longgen.runtime.model import ForwardSpec, ModelConfig, rope_inv_freq

SHAPE = dict(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=4096)
# Large enough weights that attention is peaked and positions matter (HF's 0.02 makes it near-uniform).
INIT_STD = 0.3

CASES = {
    "llama-theta-1e5": ("LlamaForCausalLM", dict(rope_theta=100000.0)),
    # Llama-3.1 scaling in rope_parameters; attention_bias covers q/k/v/o, mlp_bias the MLP.
    "llama3-scaling-biases": ("LlamaForCausalLM", dict(
        rope_theta=500000.0, attention_bias=True, mlp_bias=True,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 512})),
    "qwen2-theta-1e6": ("Qwen2ForCausalLM", dict(rope_theta=1000000.0, tie_word_embeddings=True)),
}


def save_transformers5(tmp_path, arch: str, fields: dict):
    """A random model saved by transformers' own ``save_pretrained``."""
    transformers = pytest.importorskip("transformers")
    config_cls = {"LlamaForCausalLM": transformers.LlamaConfig, "Qwen2ForCausalLM": transformers.Qwen2Config}[arch]
    torch.manual_seed(0)
    config = config_cls(**SHAPE, initializer_range=INIT_STD, **fields)
    model = getattr(transformers, arch)(config).eval()
    with torch.no_grad():  # transformers starts biases at zero, where a dropped bias would go unseen
        for name, param in model.named_parameters():
            if name.endswith(".bias"):
                param.normal_(0.0, INIT_STD)
    model.save_pretrained(tmp_path)
    return model


def logits(lm, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    cache = lm.model.new_cache(int(positions[-1]) + 1)
    return lm.model.logits(lm.model(ids, positions, cache, ForwardSpec(start=0)))


@pytest.mark.parametrize("case", CASES)
def test_transformers5_checkpoint_matches_transformers(tmp_path, case):
    arch, fields = CASES[case]
    ref = save_transformers5(tmp_path, arch, fields)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["rope_parameters"]["rope_theta"] == fields["rope_theta"]
    assert "rope_theta" not in saved and "rope_scaling" not in saved  # the transformers 5 spelling only

    ours = load_model(tmp_path, "float32")
    assert ours.config.rope_theta == fields["rope_theta"]
    ids = torch.randint(0, SHAPE["vocab_size"], (48,), generator=torch.Generator().manual_seed(1))
    # Past the llama3 case's original context (512), where its scaling changes the frequencies.
    positions = torch.arange(600, 648)
    with torch.no_grad():
        want = ref(input_ids=ids[None], position_ids=positions[None]).logits[0]
    got = logits(ours, ids, positions)
    tolerance = 1e-4 * want.abs().max().item()
    assert (got - want).abs().max().item() < tolerance

    # The same weights at the RoPE base of 10000 that the top-level default would give: far off.
    ours.model.inv_freq = rope_inv_freq(msgspec.structs.replace(ours.config, rope_theta=10000.0))
    assert (logits(ours, ids, positions) - want).abs().max().item() > 100 * tolerance


def test_both_spellings_read_the_same():
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 2048}
    old = msgspec.convert({**SHAPE, "rope_theta": 500000.0, "rope_scaling": scaling}, ModelConfig)
    new = msgspec.convert({**SHAPE, "rope_parameters": {**scaling, "rope_theta": 500000.0}}, ModelConfig)
    assert (old.rope_theta, old.rope_scaling) == (new.rope_theta, new.rope_scaling) == (500000.0, {
        **{k: float(v) for k, v in scaling.items() if k != "rope_type"}, "rope_type": "llama3"})
    assert torch.equal(rope_inv_freq(old), rope_inv_freq(new))


REFUSED = {
    "rope_parameters.rope_type": ({"rope_parameters": {"rope_theta": 1e6, "rope_type": "yarn", "factor": 4.0}}, "'yarn'"),
    "rope_scaling.rope_type": ({"rope_scaling": {"type": "dynamic", "factor": 2.0}}, "'dynamic'"),
    "rope_parameters.partial_rotary_factor": (
        {"rope_parameters": {"rope_theta": 1e4, "rope_type": "default", "partial_rotary_factor": 0.5}}, "0.5"),
    "layer_types[1]": ({"layer_types": ["full_attention", "sliding_attention"], "sliding_window": 64},
                       "'sliding_attention'"),
    "use_sliding_window": ({"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], "use_sliding_window": True,
                            "sliding_window": 64, "max_window_layers": 1}, "True"),
    "final_logit_softcapping": ({"final_logit_softcapping": 30.0}, "30.0"),
    "quantization_config.quant_method": ({"quantization_config": {"quant_method": "fp8"}}, "'fp8'"),
}


@pytest.mark.parametrize("field", REFUSED)
def test_math_changing_field_is_refused_by_name(tmp_path, field):
    extra, shown = REFUSED[field]
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "model_type": "llama",
                                                      **SHAPE, **extra}))
    with pytest.raises(LonggenError) as info:
        read_config(tmp_path)
    assert f"{field} = {shown}" in str(info.value)


def test_fields_that_change_nothing_are_accepted(tmp_path):
    """What transformers 5 writes for a plain Qwen2 (every layer full attention, no window) loads."""
    (tmp_path / "config.json").write_text(json.dumps({
        "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", **SHAPE, "use_sliding_window": False,
        "sliding_window": None, "max_window_layers": 1, "layer_types": ["full_attention"] * 2,
        "rope_parameters": {"rope_theta": 1e6, "rope_type": "default"}, "attention_dropout": 0.0}))
    assert read_config(tmp_path).rope_theta == 1e6
