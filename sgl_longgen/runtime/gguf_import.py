"""A llama.cpp GGUF file of a Llama model as a Hugging Face checkpoint directory.

The ``gguf`` package reads the file and dequantizes every tensor to float32 with its own
dequantizers (any quantization it knows: Q4_1, Q8_0, K-quants, F16...); the weights are then
stored in bfloat16 under HF's names. Two things differ from HF's layout and are undone here:

* tensors are stored with their dimensions reversed (GGUF lists the fastest one first);
* the Q and K projections are permuted for llama.cpp's RoPE, which rotates adjacent pairs
  instead of HF's two halves: rows ``(head, pair, 2)`` become ``(head, 2, pair)`` again (the
  inverse of llama.cpp's ``convert_hf_to_gguf`` permutation, as transformers' GGUF loader does).

The tokenizer is rebuilt from the file's vocabulary and merges as a byte-level BPE
``tokenizer.json`` with the pre-tokenizer llama.cpp names in ``tokenizer.ggml.pre``, its control
tokens added as special tokens, and BOS / EOS / pad / chat template taken from the metadata
(``tokenizer.ggml.eos_token_id`` is the end of a turn: it goes into ``config.json``,
``generation_config.json`` and ``tokenizer_config.json`` alike). Anything the conversion cannot
carry over faithfully (another architecture, RoPE scaling, an unknown tensor or pre-tokenizer)
is refused with a :class:`~sgl_longgen.errors.LonggenError` naming it.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file

from ..errors import LonggenError

# tokenizer.ggml.pre -> whether digits are split one by one before GPT-2's byte-level regex
# (llama.cpp's pre-tokenizer table: "smollm", "starcoder", "refact", "codeshell" add the split).
PRE_TOKENIZERS = {"gpt2": False, "smollm": True, "starcoder": True, "refact": True, "codeshell": True}
CONTROL, USER_DEFINED = 3, 4  # tokenizer.ggml.token_type values of added tokens

_LAYER_TENSORS = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAME = re.compile(r"blk\.(\d+)\.(.+)")


class GGUFModel:
    """A GGUF file opened for conversion: its metadata as plain Python values and its tensors."""

    def __init__(self, path: str | Path):
        import gguf

        self.path = Path(path)
        try:
            self.reader = gguf.GGUFReader(str(self.path))
        except (OSError, ValueError) as exc:
            raise LonggenError(f"cannot read GGUF file {self.path}: {exc}") from None
        self.tensors = {t.name: t for t in self.reader.tensors}

    def get(self, key: str, default=None):
        field = self.reader.fields.get(key)
        return default if field is None else field.contents()

    def need(self, key: str):
        value = self.get(key)
        if value is None:
            raise LonggenError(f"{self.path}: GGUF metadata lacks {key}")
        return value


def _number(x: float) -> float:
    """A float32 metadata value as the decimal it was written from (1e-05, not 9.99999974e-06)."""
    return float(str(np.float32(x)))


def hf_config(model: GGUFModel) -> dict:
    """``config.json`` of the checkpoint (a ``LlamaForCausalLM``), from the GGUF metadata."""
    arch = model.need("general.architecture")
    if arch != "llama":
        raise LonggenError(f"{model.path}: general.architecture = {arch!r}; only 'llama' GGUF files convert")
    p = "llama."
    hidden, heads = int(model.need(p + "embedding_length")), int(model.need(p + "attention.head_count"))
    head_dim = int(model.get(p + "attention.key_length", hidden // heads))
    rotary = int(model.get(p + "rope.dimension_count", head_dim))
    if rotary != head_dim:
        raise LonggenError(f"{model.path}: {p}rope.dimension_count = {rotary} rotates part of each head "
                           f"(head size {head_dim}); not supported")
    scaling = model.get(p + "rope.scaling.type")
    if scaling not in (None, "none") or "rope_freqs.weight" in model.tensors:
        raise LonggenError(f"{model.path}: RoPE scaling ({p}rope.scaling.type = {scaling!r}"
                           f"{', rope_freqs.weight' if 'rope_freqs.weight' in model.tensors else ''}) is not supported")
    tokens = model.need("tokenizer.ggml.tokens")
    ids = {key: model.get(f"tokenizer.ggml.{key}_token_id") for key in ("bos", "eos", "padding")}
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": int(model.get(p + "vocab_size", len(tokens))),
        "hidden_size": hidden,
        "intermediate_size": int(model.need(p + "feed_forward_length")),
        "num_hidden_layers": int(model.need(p + "block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(model.get(p + "attention.head_count_kv", heads)),
        "head_dim": head_dim,
        "max_position_embeddings": int(model.need(p + "context_length")),
        "rms_norm_eps": _number(model.need(p + "attention.layer_norm_rms_epsilon")),
        "rope_theta": _number(model.get(p + "rope.freq_base", 10000.0)),
        "rope_scaling": None,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": "output.weight" not in model.tensors,
        "bos_token_id": None if ids["bos"] is None else int(ids["bos"]),
        "eos_token_id": None if ids["eos"] is None else int(ids["eos"]),
        "pad_token_id": None if ids["padding"] is None else int(ids["padding"]),
        "use_cache": True,
        "torch_dtype": "bfloat16",
    }


def unpermute_rope(weight: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation (``heads``: the projection's heads, KV heads for K)."""
    pairs = weight.shape[0] // heads // 2
    return weight.reshape(heads, pairs, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def hf_name(gguf_name: str) -> str:
    if gguf_name in _GLOBAL_TENSORS:
        return _GLOBAL_TENSORS[gguf_name]
    m = _LAYER_NAME.fullmatch(gguf_name)
    if m and m.group(2) in _LAYER_TENSORS:
        return f"model.layers.{m.group(1)}.{_LAYER_TENSORS[m.group(2)]}"
    raise LonggenError(f"GGUF tensor {gguf_name!r} has no counterpart in a Llama checkpoint")


def hf_state(model: GGUFModel, config: dict, dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:
    """Every tensor dequantized to float32, put in HF's layout, then cast to ``dtype``."""
    from gguf.quants import dequantize

    state = {}
    for name, tensor in model.tensors.items():
        key = hf_name(name)
        shape = tuple(int(n) for n in reversed(tensor.shape))
        try:
            values = dequantize(tensor.data, tensor.tensor_type).reshape(shape)
        except NotImplementedError:
            raise LonggenError(f"{model.path}: tensor {name} is stored as {tensor.tensor_type.name}, "
                               "which the gguf package cannot dequantize") from None
        if name.endswith("attn_q.weight"):
            values = unpermute_rope(values, config["num_attention_heads"])
        elif name.endswith("attn_k.weight"):
            values = unpermute_rope(values, config["num_key_value_heads"])
        state[key] = torch.from_numpy(np.array(values, dtype=np.float32)).to(dtype)  # a copy: F32 tensors are memory-mapped
    return state


def tokenizer_files(model: GGUFModel, directory: Path, config: dict) -> None:
    """``tokenizer.json`` (byte-level BPE) and ``tokenizer_config.json`` from the GGUF vocabulary."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

    kind, pre = model.need("tokenizer.ggml.model"), model.get("tokenizer.ggml.pre", "gpt2")
    if kind != "gpt2":
        raise LonggenError(f"{model.path}: tokenizer.ggml.model = {kind!r}; only byte-level BPE ('gpt2') converts")
    if pre not in PRE_TOKENIZERS:
        raise LonggenError(f"{model.path}: tokenizer.ggml.pre = {pre!r} is not a known pre-tokenizer "
                           f"(known: {', '.join(PRE_TOKENIZERS)})")
    tokens = list(model.need("tokenizer.ggml.tokens"))
    types = list(model.get("tokenizer.ggml.token_type", [1] * len(tokens)))
    merges = [tuple(m.split(" ")) for m in model.need("tokenizer.ggml.merges")]
    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges, fuse_unk=False))
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=bool(model.get("tokenizer.ggml.add_space_prefix", False)),
                                          use_regex=True)
    if PRE_TOKENIZERS[pre]:
        tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    else:
        tok.pre_tokenizer = byte_level
    tok.decoder = decoders.ByteLevel()
    name = {key: tokens[config[f"{key}_token_id"]] if config.get(f"{key}_token_id") is not None else None
            for key in ("bos", "eos", "pad")}
    unk_id = model.get("tokenizer.ggml.unknown_token_id")
    add_bos = bool(model.get("tokenizer.ggml.add_bos_token", False)) and name["bos"] is not None
    if add_bos:
        tok.post_processor = processors.TemplateProcessing(
            single=f"{name['bos']}:0 $A:0", pair=f"{name['bos']}:0 $A:0 $B:1",
            special_tokens=[(name["bos"], config["bos_token_id"])])
    else:
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t, ty in zip(tokens, types) if ty == CONTROL])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t, ty in zip(tokens, types) if ty == USER_DEFINED])
    if tok.get_vocab_size(with_added_tokens=True) != len(tokens):
        raise LonggenError(f"{model.path}: the rebuilt tokenizer has {tok.get_vocab_size(with_added_tokens=True)} "
                           f"tokens, the file {len(tokens)}")
    tok.save(str(directory / "tokenizer.json"))
    settings = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": name["bos"], "eos_token": name["eos"], "pad_token": name["pad"],
        "unk_token": tokens[int(unk_id)] if unk_id is not None else None,
        "add_bos_token": add_bos, "add_eos_token": False,
        "model_max_length": config["max_position_embeddings"],
        "clean_up_tokenization_spaces": False,
    }
    template = model.get("tokenizer.chat_template")
    if template:
        settings["chat_template"] = template
    (directory / "tokenizer_config.json").write_text(json.dumps(settings, indent=2, ensure_ascii=False) + "\n")


def convert(gguf_path: str | Path, directory: str | Path) -> dict:
    """Write the HF checkpoint of ``gguf_path`` into ``directory`` (``config.json``,
    ``generation_config.json``, ``model.safetensors`` in bf16, the tokenizer files); returns the
    config."""
    model = GGUFModel(gguf_path)
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    config = hf_config(model)
    tokenizer_files(model, directory, config)
    state = hf_state(model, config)
    if config["tie_word_embeddings"]:
        state.pop("lm_head.weight", None)
    save_file(state, str(directory / "model.safetensors"), metadata={"format": "pt"})
    (directory / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    generation = {key: config[key] for key in ("bos_token_id", "eos_token_id", "pad_token_id") if config[key] is not None}
    (directory / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    return config
