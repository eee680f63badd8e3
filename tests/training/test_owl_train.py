"""``sgl-longgen train owl``: the packed [SPEC] states equal the runtime's, the batched generator
equals plain decoding, the loss falls on a fixed batch, and a trained checkpoint is what
``generate --method owl|howl`` loads; with ``--draft-vocab`` the map is the most frequent generated
tokens and targets outside it add nothing to the loss."""

from __future__ import annotations

import json

import msgspec
import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from sgl_longgen.cli import build_parser, main
from sgl_longgen.commands.generate import resolve_config
from sgl_longgen.config import GenerateConfig
from sgl_longgen.core.owl import OwlDrafter, load_drafter
from sgl_longgen.runtime import build_decoder, load_model, resolve_model
from sgl_longgen.runtime.model import ForwardSpec
from sgl_longgen.training.owl import (
    draft_cross_entropy, frequent_tokens, generate, map_coverage, new_drafter, owl_loss, target_states,
)


@pytest.fixture(scope="module")
def target():
    return load_model(resolve_model("tiny-random"), "float64")


def test_packed_spec_states_equal_the_runtime_forward(target):
    """[SPEC]_j of the training layout is the runtime's [SPEC] after ids[:j+1], at position j + 1."""
    m = target.model
    V = target.config.vocab_size
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 256, (2, 12), generator=g)
    spec = torch.randn(target.config.hidden_size, generator=g, dtype=torch.float64)
    h_real, h_spec = target_states(m, ids, spec)
    for b in range(2):
        for j in (0, 5, 11):
            seq = torch.cat([ids[b, : j + 1], torch.tensor([V])])
            cache = m.new_cache(len(seq))
            h = m(seq, torch.arange(len(seq)), cache, ForwardSpec(start=0), spec[None])
            assert torch.allclose(h_spec[b, j], m.model.norm(h[-1]), atol=1e-10)
            assert torch.allclose(h_real[b, j], m.model.norm(h[-2]), atol=1e-10)


def test_batched_generation_equals_plain_decoding(target):
    prompts = torch.tensor([list(b"def f(x):\n    "), list(b"import os\nimpo")])
    out = generate(target.model, prompts, 20, temperature=0.0, top_k=0, generator=torch.Generator())
    cfg = msgspec.convert({"method": "ar", "sampling": {"temperature": 0.0}, "ignore_eos": True}, GenerateConfig)
    for b in range(2):
        ref = build_decoder(target, cfg).generate(prompts[b].tolist(), 20).output_ids
        assert out[b].tolist() == ref


@pytest.mark.parametrize("draft_vocab", [0, 24])
def test_loss_decreases_on_a_fixed_batch(target, draft_vocab):
    model = load_model(resolve_model("tiny-random"), "float32").model
    torch.manual_seed(0)
    prompts = torch.randint(0, 256, (4, 8))
    ids = generate(model, prompts, 40, temperature=1.0, top_k=10, generator=torch.Generator().manual_seed(1))
    d = new_drafter(128, target.config.vocab_size, 64, 4, True, draft_vocab, ids)
    assert d.reduced == bool(draft_vocab)
    d.reset_parameters(torch.Generator().manual_seed(2), model.model.embed_tokens.weight)
    spec_before = d.spec_embedding.detach().clone()
    opt = torch.optim.AdamW(d.parameters(), lr=3e-3)
    gen = torch.Generator().manual_seed(3)
    history = []
    for _ in range(50):
        loss, metrics = owl_loss(model, d, ids, 0.3, 1.0, "next", gen)
        loss.backward()
        opt.step()
        opt.zero_grad()
        history.append({k: float(v) for k, v in metrics.items()})
    first, last = history[0], history[-1]
    assert set(first) >= {"loss", "draft_loss", "spec_loss", "spec_acc", "acc1", "acc4"}
    assert last["draft_loss"] < 0.8 * first["draft_loss"]
    assert last["spec_loss"] < first["spec_loss"]
    assert not torch.equal(d.spec_embedding.detach(), spec_before)  # the [SPEC] embedding trains too
    assert all(p.grad is None for p in model.parameters())  # the target stays frozen


def test_frequent_tokens_break_ties_to_the_lower_id_and_fill_with_unseen_ids():
    seqs = torch.tensor([[5, 5, 5, 2, 2, 9], [9, 7, 7, 3, 1, 1]], dtype=torch.int32)  # 5:3; 1, 2, 7, 9: 2; 3: 1
    assert frequent_tokens(seqs, 12, 1).tolist() == [5]
    assert frequent_tokens(seqs, 12, 3).tolist() == [1, 2, 5]
    assert frequent_tokens(seqs, 12, 6).tolist() == [1, 2, 3, 5, 7, 9]
    assert frequent_tokens(seqs, 12, 8).tolist() == [0, 1, 2, 3, 4, 5, 7, 9]  # never seen: lowest ids first
    assert map_coverage(seqs, frequent_tokens(seqs, 12, 3), 12) == pytest.approx(7 / 12)


def test_targets_outside_the_map_contribute_nothing():
    V, N = 20, 6
    d = OwlDrafter(8, V, 8, draft_vocab_size=N)
    d.set_token_map([13, 2, 7, 0, 19, 4])
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 5, N, generator=g, dtype=torch.float64, requires_grad=True)
    target = torch.tensor([[13, 1, 7, 0, 5], [4, 4, 18, 19, 2], [3, 3, 3, 13, 6]])
    inside = torch.isin(target, d.token_map)
    loss, acc = draft_cross_entropy(d, logits, target)
    # Reference: the mean cross-entropy of the in-map rows, with targets written as draft ids.
    draft_ids = {int(t): i for i, t in enumerate(d.token_map)}
    rows = logits[inside]
    want = F.cross_entropy(rows, torch.tensor([draft_ids[int(t)] for t in target[inside]]))
    assert torch.allclose(loss, want)
    loss.backward()
    assert torch.all(logits.grad[~inside] == 0) and torch.all(logits.grad[inside].abs().sum(-1) > 0)
    picked = d.token_map[logits.detach().argmax(-1)]
    assert float(acc) == pytest.approx(2 / 15) == float((picked == target).float().mean())  # accuracy counts the unreachable targets as misses
    none, _ = draft_cross_entropy(d, logits.detach(), torch.full((3, 5), 1))
    assert none.item() == 0.0  # a batch with no reachable target: zero, not NaN


def _cli(capsys, *argv):
    capsys.readouterr()
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_train_owl_cli_writes_a_checkpoint_generate_loads(capsys, tmp_path, corpus_dir):
    out = tmp_path / "owl"
    common = ["--model", "tiny-random", "--data", str(corpus_dir), "--seq-len", "24", "--prompt-len", "16",
              "--sequences", "8", "--val-sequences", "2", "--gen-batch-size", "8", "--batch-size", "4",
              "--n-steps", "4", "--log-every", "2", "--threads", "1", "--cache-dir", str(tmp_path / "cache")]
    code, stdout, err = _cli(capsys, "train", "owl", *common, "--steps", "3", "--out", str(out))
    assert code == 0, err
    summary = json.loads(stdout.strip().splitlines()[-1])
    assert summary["steps"] == 3 and summary["tokens"] == 3 * 4 * 24
    assert set(summary["train"]) >= {"loss", "acc1", "acc4", "spec_loss"}
    d = load_drafter(out, hidden_size=128, vocab_size=258)
    assert d.spec and d.n_steps == 4
    info = json.loads((out / "owl.json").read_text())["training"]
    assert "--steps 3" in info["command"] and info["spec_target"] == "next"
    assert "depth = 4" in (out / "longgen.toml").read_text()

    gen_out = tmp_path / "gen.jsonl"
    code, _, err = _cli(capsys, "generate", "--model", "tiny-random", "--method", "howl", "--drafter", str(out),
                        "--max-new-tokens", "24", "--temperature", "0", "--out", str(gen_out))
    assert code == 0, err
    record = json.loads(gen_out.read_text())
    assert record["num_new_tokens"] == 24 and record["method"] == "howl"
    args = build_parser().parse_args(["generate", "--model", "tiny-random", "--method", "owl", "--drafter", str(out)])
    config, _ = resolve_config(args, resolve_model("tiny-random"))
    assert config.owl.depth == 4  # the drafter's longgen.toml
    (tmp_path / "c.toml").write_text("[owl]\ndepth = 6\n")
    args = build_parser().parse_args(["generate", "--model", "tiny-random", "--method", "howl", "--drafter", str(out),
                                      "--config", str(tmp_path / "c.toml")])
    assert resolve_config(args, resolve_model("tiny-random"))[0].owl.depth == 6  # --config wins over it

    nospec = tmp_path / "nospec"
    code, _, err = _cli(capsys, "train", "owl", *common, "--steps", "2", "--no-spec", "--out", str(nospec))
    assert code == 0, err
    assert not load_drafter(nospec).spec and "spec = false" in (nospec / "longgen.toml").read_text()
    code, _, err = _cli(capsys, "generate", "--model", "tiny-random", "--method", "owl", "--drafter", str(nospec),
                        "--max-new-tokens", "8", "--temperature", "0", "--out", str(tmp_path / "g2.jsonl"))
    assert code == 0, err  # its longgen.toml turns [SPEC] off

    reduced = tmp_path / "reduced"
    code, _, err = _cli(capsys, "train", "owl", *common, "--steps", "2", "--draft-vocab", "40", "--out", str(reduced))
    assert code == 0, err
    assert "draft vocabulary 40 of 258" in err
    d = load_drafter(reduced, hidden_size=128, vocab_size=258)
    assert d.reduced and d.draft_vocab_size == 40 and d.head.weight.shape[0] == 40
    (data,) = (tmp_path / "cache").glob("owl-data-*.safetensors")  # the generated training sequences
    assert torch.equal(d.token_map, frequent_tokens(load_file(data)["train"], 258, 40))
    info = json.loads((reduced / "owl.json").read_text())
    assert info["draft_vocab_size"] == 40 and info["training"]["draft_vocab"] == 40
    assert info["training"]["config"]["drafter"]["draft_vocab"] == 40 and 0 < info["training"]["draft_vocab_coverage"] <= 1
    code, _, err = _cli(capsys, "generate", "--model", "tiny-random", "--method", "owl", "--drafter", str(reduced),
                        "--max-new-tokens", "8", "--temperature", "0", "--out", str(tmp_path / "g3.jsonl"))
    assert code == 0, err


def test_bad_input_is_one_error_line(capsys, tmp_path):
    code, _, err = _cli(capsys, "train", "owl", "--model", "tiny-random", "--spec-dropout", "1.5",
                        "--out", str(tmp_path / "o"))
    assert code == 2 and "spec_dropout" in err and len(err.strip().splitlines()) == 1
    code, _, err = _cli(capsys, "train", "owl", "--model", "tiny-random", "--draft-vocab", "-1",
                        "--out", str(tmp_path / "o"))
    assert code == 2 and "draft_vocab" in err and len(err.strip().splitlines()) == 1
    code, _, err = _cli(capsys, "generate", "--model", "tiny-random", "--method", "owl",
                        "--drafter", str(tmp_path / "missing"), "--max-new-tokens", "4")
    assert code == 2 and "missing" in err and len(err.strip().splitlines()) == 1
