"""Our algorithms get the ``longgen`` attention backend wherever SGLang would pick FlashInfer."""

from __future__ import annotations

import types


def _default_backend(monkeypatch, algorithm, flashinfer=True):
    import sglang.srt.server_args as server_args
    from sglang.srt.plugins import load_plugins

    load_plugins()  # as every SGLang process does: our hooks are applied
    monkeypatch.setattr(server_args, "is_flashinfer_available", lambda: flashinfer)
    args = types.SimpleNamespace(speculative_algorithm=algorithm, speculative_eagle_topk=4)
    model_config = types.SimpleNamespace(hf_config=types.SimpleNamespace(architectures=["LlamaForCausalLM"]),
                                         has_attention_sinks=False)
    return server_args.ServerArgs._get_default_attn_backend(args, False, model_config)


def test_tree_methods_get_the_hybrid_verify_backend(monkeypatch):
    for algorithm in ("TOKENSWIFT", "tokenswift", "OWL", "HOWL", "LONGSPEC", "SUFFIX"):
        assert _default_backend(monkeypatch, algorithm) == "longgen", algorithm


def test_other_choices_are_left_alone(monkeypatch):
    assert _default_backend(monkeypatch, "NGRAM") == "flashinfer"
    assert _default_backend(monkeypatch, None) == "flashinfer"
    assert _default_backend(monkeypatch, "TOKENSWIFT", flashinfer=False) == "triton"
