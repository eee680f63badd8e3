"""The command line, as a user runs it (a subprocess per command)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import one_error_line
from sgl_longgen.core.heads import TokenSwiftHeads


def cli(*args: str, cwd: Path | None = None, timeout: int = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "sgl_longgen", *args], capture_output=True, text=True,
                          cwd=cwd, timeout=timeout)


def generate(tmp_path: Path, method: str, *extra: str, n: int = 2048) -> dict:
    out = tmp_path / f"{method}-{abs(hash(extra))}.jsonl"
    res = cli("generate", "--method", method, "--max-new-tokens", str(n), "--temperature", "0",
              "--out", str(out), *extra)
    assert res.returncode == 0, res.stderr
    (record,) = [json.loads(line) for line in out.read_text().splitlines()]
    return record


@pytest.mark.parametrize(
    "extra",
    [
        ("--model", "tiny-random"),
        ("--model", "tiny-random", "--penalty", "1.2", "--penalty-window", "64"),
        ("--model", "tiny-qwen2"),  # Qwen2, GQA ratio 2 instead of 4
    ],
    ids=["tiny-random", "tiny-random-penalty", "tiny-qwen2"],
)
def test_generate_tokenswift_is_token_identical_to_ar(tmp_path, extra):
    ar = generate(tmp_path, "ar", *extra)
    ts = generate(tmp_path, "tokenswift", "--no-adaptive", *extra)  # every step speculates
    assert ar["num_new_tokens"] == ts["num_new_tokens"] == 2048 or ar["finish_reason"] == "stop"
    assert ts["output_ids"] == ar["output_ids"]
    for key in ("output_ids", "text", "num_new_tokens", "accept_length", "decode_seconds"):
        assert key in ts
    assert ar["accept_length"] == 1.0 and ts["accept_length"] > 1.5


def test_demo_reports_identical_outputs():
    res = cli("demo", "--model", "tiny-random", "--max-new-tokens", "1024")
    assert res.returncode == 0, res.stderr
    lines = res.stdout.splitlines()
    row = next(line for line in lines if line.startswith("tokenswift"))
    assert row.split()[-1] == "yes"
    assert any(line.startswith("ar ") for line in lines)



def test_missing_model_directory(tmp_path):
    line = one_error_line(cli("generate", "--model", str(tmp_path / "nope"), "--max-new-tokens", "4"))
    assert "model directory not found" in line


def test_prompt_longer_than_the_context(tmp_path):
    prompt = tmp_path / "long.txt"
    prompt.write_text("x" * 17000)  # byte-level tokenizer: one token per byte; context 16384
    line = one_error_line(cli("generate", "--model", "tiny-random", "--prompt-file", str(prompt),
                              "--max-new-tokens", "4"))
    assert "context" in line and "17001" in line


def test_negative_penalty_window():
    line = one_error_line(cli("generate", "--model", "tiny-random", "--penalty-window", "-1", "--max-new-tokens", "4"))
    assert "penalty_window" in line


def test_budget_larger_than_the_context():
    line = one_error_line(cli("generate", "--model", "tiny-random", "--method", "tokenswift", "--budget", "100000",
                              "--max-new-tokens", "4"))
    assert "budget" in line and "16384" in line


def test_heads_with_another_hidden_size(tmp_path):
    TokenSwiftHeads(64, 3).save(tmp_path / "heads")
    line = one_error_line(cli("generate", "--model", "tiny-random", "--method", "tokenswift",
                              "--heads", str(tmp_path / "heads"),
                              "--max-new-tokens", "4"))
    assert "hidden size 64" in line and "128" in line


def test_unknown_config_key_names_the_field(tmp_path):
    cfg = tmp_path / "bad.toml"
    cfg.write_text("[tokenswift.partial_kv]\nbudgett = 10\n")
    line = one_error_line(cli("generate", "--model", "tiny-random", "--config", str(cfg), "--max-new-tokens", "4"))
    assert "budgett" in line


def test_config_file_is_applied_and_flags_override_it(tmp_path):
    cfg = tmp_path / "c.toml"
    cfg.write_text("max_new_tokens = 7\n[sampling]\ntemperature = 0.0\n")
    out = tmp_path / "o.jsonl"
    res = cli("generate", "--model", "tiny-random", "--config", str(cfg), "--method", "ar", "--out", str(out))
    assert res.returncode == 0, res.stderr
    assert json.loads(out.read_text())["num_new_tokens"] == 7
    res = cli("generate", "--model", "tiny-random", "--config", str(cfg), "--method", "ar", "--max-new-tokens", "3",
              "--out", str(out))
    assert json.loads(out.read_text())["num_new_tokens"] == 3


def test_adaptive_speculation_from_the_config_file_and_the_flag(tmp_path):
    """``[adaptive]`` in the TOML, ``--adaptive/--no-adaptive`` over it; the record counts plain steps."""
    from sgl_longgen.cli import build_parser
    from sgl_longgen.commands.generate import resolve_config
    from sgl_longgen.runtime import resolve_model

    cfg = tmp_path / "a.toml"
    cfg.write_text("[adaptive]\nenabled = true\nprobe_every = 4\n")
    parser = build_parser()
    model_dir = resolve_model("tiny-random")
    base = ["generate", "--model", "tiny-random", "--config", str(cfg)]
    for flags, enabled in (([], True), (["--adaptive"], True), (["--no-adaptive"], False)):
        config, _ = resolve_config(parser.parse_args(base + flags), model_dir)
        assert config.adaptive.enabled is enabled and config.adaptive.probe_every == 4
    config, _ = resolve_config(parser.parse_args(["generate", "--model", "tiny-random"]), model_dir)
    assert not config.adaptive.enabled  # off by default
    cfg.write_text("[adaptive]\nprobe_evry = 4\n")
    line = one_error_line(cli("generate", "--model", "tiny-random", "--config", str(cfg), "--max-new-tokens", "4"))
    assert "probe_evry" in line
    out = tmp_path / "o.jsonl"
    res = cli("generate", "--model", "tiny-random", "--method", "tokenswift", "--adaptive", "--max-new-tokens", "40",
              "--out", str(out))
    assert res.returncode == 0, res.stderr
    stats = json.loads(out.read_text())["stats"]
    assert 0 < stats["plain_steps"] < stats["steps"]  # the warm-up speculated, then a plain step measured


def test_jsonl_prompt_file_gives_one_record_per_prompt(tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"id": "a", "prompt": "hello"}\n{"id": "b", "input_ids": [1, 2, 3]}\n')
    out = tmp_path / "o.jsonl"
    res = cli("generate", "--model", "tiny-random", "--prompt-file", str(prompts), "--max-new-tokens", "5",
              "--method", "ar", "--out", str(out))
    assert res.returncode == 0, res.stderr
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["id"] for r in records] == ["a", "b"]
    assert all(r["num_new_tokens"] == 5 for r in records)
