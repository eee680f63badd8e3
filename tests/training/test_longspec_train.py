"""``sgl-longgen train longspec``: the target K/V the trainer reads are the runtime cache's (at
vanilla and at anchor-offset positions), a training row with lag 1 is exactly the runtime drafter's
root step, anchor-offset positions are drawn for short samples only, the loss falls on a fixed
batch, and a trained checkpoint is what ``generate --method longspec`` loads. With ``--draft-vocab``
the loss is the cross-entropy over the mapped tokens only, and the map written is the most frequent
tokens of the generated data, a valid checkpoint whose greedy output is plain decoding's."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from sgl_longgen.cli import build_parser, main
from sgl_longgen.commands.generate import resolve_config
from sgl_longgen.core.longspec import LongSpecDrafter
from sgl_longgen.core.longspec_beam import WindowCache, expand
from sgl_longgen.core.longspec_checkpoint import load_drafter, target_settings
from sgl_longgen.core.longspec_rope import rope_tables
from sgl_longgen.runtime import load_model, resolve_model
from sgl_longgen.runtime.model import ForwardSpec
from sgl_longgen.training.draft_vocab import frequent_tokens, map_coverage
from sgl_longgen.training.longspec import (
    AnchorOffsetConfig,
    last_layer_kv,
    longspec_loss,
    positions_for,
    window_mask,
)


@pytest.fixture(scope="module")
def target():
    return load_model(resolve_model("tiny-random"), "float64")


def test_last_layer_kv_is_the_runtime_cache_at_any_positions(target):
    m = target.model
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 256, (2, 14), generator=g)
    offsets = [torch.arange(14), torch.cat([torch.arange(4), torch.arange(4, 14) + 9000])]  # vanilla, anchor-offset
    pos = torch.stack(offsets)
    cos, sin = rope_tables(m.inv_freq, pos, torch.float64)
    k, v = last_layer_kv(m, ids, cos, sin)
    for b in range(2):
        cache = m.new_cache(14)
        m(ids[b], pos[b], cache, ForwardSpec(start=0))
        assert torch.allclose(k[b], cache.k[-1], atol=1e-10) and torch.allclose(v[b], cache.v[-1], atol=1e-10)


@pytest.mark.parametrize("window", [512, 5])
def test_a_training_row_at_lag_1_is_the_runtime_root_step(target, window):
    """Row t of the training forward (window-causal self-attention, target K/V up to t - 1) gives the
    same next-token distribution as the runtime drafter drafting from a root at position t."""
    m = target.model
    d = LongSpecDrafter.for_target(target.config, window=window)
    d.reset_parameters(torch.Generator().manual_seed(1), final_norm=m.model.norm.weight, std=0.3)
    d = d.double().eval()
    ids = torch.randint(0, 256, (1, 16), generator=torch.Generator().manual_seed(2))
    pos = torch.arange(16)[None]
    cos, sin = rope_tables(m.inv_freq, pos, torch.float64)
    k, v = last_layer_kv(m, ids, cos, sin)
    mask = window_mask(16, window, "cpu")
    h, _, _ = d(m.model.embed_tokens(ids), cos, sin, None, None, mask, k, v, lag=1, causal=mask is None)
    train_logp = torch.log_softmax(m.lm_head(h[0]), dim=-1)
    for t in (3, 9, 15):
        cache = m.new_cache(16)
        m(ids[0, :t], torch.arange(t), cache, ForwardSpec(start=0))
        ring = WindowCache(d.num_kv_heads, window, d.head_dim, torch.float64, "cpu")
        beam = expand(d, m.model.embed_tokens, m.lm_head, m.inv_freq, ring, cache.k[-1], cache.v[-1],
                      ids[0, : t + 1].tolist(), 0, [4], 4)
        best = train_logp[t].topk(4)
        assert beam.tokens[0].tolist() == best.indices.tolist()
        assert torch.allclose(beam.scores[0], best.values, atol=1e-9)


def test_anchor_offset_positions_for_short_samples_only():
    g = torch.Generator().manual_seed(0)
    cfg = AnchorOffsetConfig(anchors=4, max_offset=30000, max_length=100)
    pos = positions_for(cfg, 3, 50, 16384, g)
    assert pos.shape == (3, 50)
    for row in pos:
        assert row[:4].tolist() == [0, 1, 2, 3]
        assert torch.equal(row[4:] - row[4], torch.arange(46))  # one offset per row
        assert int(row[-1]) < 16384
    assert len({int(r[4]) for r in pos}) == 3  # drawn per row
    assert torch.equal(positions_for(cfg, 2, 101, 16384, g), torch.arange(101).expand(2, 101))  # too long
    off = AnchorOffsetConfig(enabled=False)
    assert torch.equal(positions_for(off, 2, 50, 16384, g), torch.arange(50).expand(2, 50))


def test_loss_decreases_on_a_fixed_batch():
    model = load_model(resolve_model("tiny-random"), "float32").model
    d = LongSpecDrafter.for_target(model.config)
    d.reset_parameters(torch.Generator().manual_seed(0), final_norm=model.model.norm.weight)
    ids = torch.randint(0, 256, (4, 32), generator=torch.Generator().manual_seed(3))
    pos = positions_for(AnchorOffsetConfig(), 4, 32, 16384, torch.Generator().manual_seed(4))
    opt = torch.optim.Adam(d.parameters(), lr=3e-3)
    losses = []
    for step in range(25):
        loss, metrics = longspec_loss(model, d, ids, pos, lag=1 + step % 3)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
        assert set(metrics) == {"loss", "acc"}
    assert losses[-1] < 0.7 * losses[0]
    assert all(p.grad is None for p in model.parameters())  # the target stays frozen


def _cli(capsys, *argv):
    capsys.readouterr()
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def _train(capsys, tmp_path, corpus_dir, out, *extra: str):
    """``sgl-longgen train longspec`` on tiny-random with a few seconds' settings, plus ``extra``."""
    return _cli(capsys, "train", "longspec", "--model", "tiny-random", "--data", str(corpus_dir), "--seq-len", "24",
                "--prompt-len", "16", "--sequences", "8", "--val-sequences", "2", "--gen-batch-size", "8",
                "--batch-size", "4", "--max-lag", "3", "--window", "64", "--threads", "1", "--cache-dir",
                str(tmp_path / "cache"), *extra, "--out", str(out))


def test_train_longspec_cli_writes_a_checkpoint_generate_loads(capsys, tmp_path, corpus_dir):
    out = tmp_path / "longspec"
    code, stdout, err = _train(capsys, tmp_path, corpus_dir, out, "--log-every", "2", "--steps", "3")
    assert code == 0, err
    summary = json.loads(stdout.strip().splitlines()[-1])
    assert summary["steps"] == 3 and summary["tokens"] == 3 * 4 * 24
    assert set(summary["train"]) >= {"loss", "acc"}
    assert set(summary["val"]) == {"val_loss_lag1", "val_acc_lag1", "val_loss_lag3", "val_acc_lag3"}
    target = load_model(resolve_model("tiny-random"), "float32")
    d = load_drafter(out, target_settings(target.config))
    assert d.window == 64 and d.intermediate_size == target.config.intermediate_size
    info = json.loads((out / "longspec.json").read_text())["training"]
    assert "--steps 3" in info["command"] and info["config"]["anchor_offset"]["anchors"] == 4
    assert "widths = [4, 16, 16]" in (out / "longgen.toml").read_text()  # no deeper than the lags trained

    gen_out = tmp_path / "gen.jsonl"
    code, _, err = _cli(capsys, "generate", "--model", "tiny-random", "--method", "longspec", "--longspec-drafter",
                        str(out), "--max-new-tokens", "24", "--temperature", "0", "--out", str(gen_out))
    assert code == 0, err
    record = json.loads(gen_out.read_text())
    assert record["num_new_tokens"] == 24 and record["method"] == "longspec"
    code, _, err = _cli(capsys, "generate", "--model", "tiny-random", "--method", "ar", "--max-new-tokens", "24",
                        "--temperature", "0", "--out", str(tmp_path / "ar.jsonl"))
    assert code == 0, err
    assert json.loads((tmp_path / "ar.jsonl").read_text())["output_ids"] == record["output_ids"]

    args = build_parser().parse_args(["generate", "--model", "tiny-random", "--method", "longspec",
                                      "--longspec-drafter", str(out)])
    config, _ = resolve_config(args, resolve_model("tiny-random"))
    assert config.longspec.widths == [4, 16, 16]  # the drafter's longgen.toml
    (tmp_path / "c.toml").write_text("[longspec]\nwidths = [2, 2]\n")
    args = build_parser().parse_args(["generate", "--model", "tiny-random", "--method", "longspec",
                                      "--longspec-drafter", str(out), "--config", str(tmp_path / "c.toml")])
    assert resolve_config(args, resolve_model("tiny-random"))[0].longspec.widths == [2, 2]  # --config wins

    code, _, err = _cli(capsys, "generate", "--model", "tiny-qwen2", "--method", "longspec", "--longspec-drafter",
                        str(out), "--max-new-tokens", "4")
    assert code != 0 and "longspec.json" in err  # built for another target: refused at startup


def test_the_reduced_loss_is_the_cross_entropy_over_the_mapped_tokens(target):
    """A reduced drafter trains on what its beam ranks by: the softmax over the mapped rows of the
    frozen head (the full softmax with every other token at -inf), targets outside the map left out."""
    m = target.model
    d = LongSpecDrafter.for_target(target.config, window=8)
    d.reset_parameters(torch.Generator().manual_seed(1), final_norm=m.model.norm.weight, std=0.3)
    token_map = torch.arange(0, 258, 2)  # the even ids
    r = d.with_token_map(token_map).double()
    d = d.double()
    ids = torch.randint(0, 258, (2, 20), generator=torch.Generator().manual_seed(5))
    pos = torch.arange(20).expand(2, 20)
    loss, metrics = longspec_loss(m, r, ids, pos, lag=2)
    cos, sin = rope_tables(m.inv_freq, pos, torch.float64)
    k, v = last_layer_kv(m, ids, cos, sin)
    h, _, _ = d(m.model.embed_tokens(ids), cos, sin, None, None, window_mask(20, 8, "cpu"), k, v, lag=2)
    logp = torch.log_softmax(m.lm_head(h[:, :-1]).masked_fill(torch.arange(258) % 2 == 1, float("-inf")), dim=-1)
    target_ids = ids[:, 1:]
    inside = target_ids % 2 == 0
    assert 0 < int(inside.sum()) < inside.numel()
    want = -logp.gather(-1, target_ids[..., None])[..., 0][inside].mean()
    assert torch.allclose(loss, want, atol=1e-10)
    assert float(metrics["acc"]) == float((logp.argmax(-1) == target_ids).double().mean())
    loss.backward()
    assert all(p.grad is None for p in m.parameters()) and r.mlp.up_proj.weight.grad is not None


def test_train_longspec_draft_vocab_writes_a_valid_map(capsys, tmp_path, corpus_dir):
    out = tmp_path / "reduced"
    code, stdout, err = _train(capsys, tmp_path, corpus_dir, out, "--draft-vocab", "40", "--steps", "2")
    assert code == 0, err
    assert "draft vocabulary 40 of 258" in err
    summary = json.loads(stdout.strip().splitlines()[-1])
    assert summary["draft_vocab"] == 40 and 0 < summary["draft_vocab_coverage"] <= 1
    target = load_model(resolve_model("tiny-random"), "float32")
    d = load_drafter(out, target_settings(target.config))
    assert d.reduced and d.draft_vocab_size == 40
    (data,) = (tmp_path / "cache").glob("owl-data-*.safetensors")  # the generated training sequences
    train = load_file(data)["train"]
    assert torch.equal(d.token_map, frequent_tokens(train, 258, 40))  # sorted by id
    assert summary["draft_vocab_coverage"] == pytest.approx(map_coverage(train, d.token_map, 258), abs=1e-6)
    info = json.loads((out / "longspec.json").read_text())
    assert info["draft_vocab_size"] == 40 and info["training"]["config"]["drafter"]["draft_vocab"] == 40

    gen = tmp_path / "gen.jsonl"
    code, _, err = _cli(capsys, "generate", "--model", "tiny-random", "--method", "longspec", "--longspec-drafter",
                        str(out), "--max-new-tokens", "24", "--temperature", "0", "--out", str(gen))
    assert code == 0, err
    code, _, err = _cli(capsys, "generate", "--model", "tiny-random", "--method", "ar", "--max-new-tokens", "24",
                        "--temperature", "0", "--out", str(tmp_path / "ar.jsonl"))
    assert code == 0, err
    assert json.loads((tmp_path / "ar.jsonl").read_text())["output_ids"] == json.loads(gen.read_text())["output_ids"]

    code, _, err = _cli(capsys, "train", "longspec", "--model", "tiny-random", "--data", str(corpus_dir),
                        "--draft-vocab", "259", "--out", str(tmp_path / "big"))
    assert code != 0 and "--draft-vocab 259 exceeds the target's vocabulary (258)" in err
