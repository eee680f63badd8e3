"""The proxy script end to end (tiny shapes), ``tiny`` resolution, and the shipped proxy itself."""

import json
import shlex
import subprocess
import sys

import pytest

from sgl_longgen.cli import main
from sgl_longgen.training import proxy
from sgl_longgen.runtime import embedded, load_model, resolve_model
from sgl_longgen.core.heads import load_heads

TINY_SHAPES = """
partial_kv_budget = 64
[lm]
save_dtype = "float32"
[lm.data]
sources = ["{data}"]
cache_dir = "{cache}"
[lm.tokenizer]
vocab_size = 300
[lm.model]
hidden_size = 32
num_hidden_layers = 1
num_attention_heads = 2
num_key_value_heads = 1
head_dim = 16
intermediate_size = 64
max_position_embeddings = 512
[lm.loop]
steps = 3
batch_size = 2
seq_len = 32
threads = 1
[heads.loop]
steps = 3
batch_size = 2
seq_len = 32
threads = 1
"""


def test_proxy_trains_and_assembles_a_shippable_model(tmp_path, corpus_dir, capsys):
    cfg = tmp_path / "proxy.toml"
    cfg.write_text(TINY_SHAPES.format(data=corpus_dir, cache=tmp_path / "cache"))
    out = tmp_path / "models" / "tiny"
    assert main(["train", "proxy", "--out", str(out), "--work", str(tmp_path / "work"), "--config", str(cfg),
                 "--device", "cpu", "--check-tokens", "24"]) == 0
    report = capsys.readouterr().out
    assert "proxy model written to" in report and "reproduce:" in report
    shipped = sorted(p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file())
    assert shipped == sorted([
        "config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
        "training.json", "tokenswift-heads/heads.json", "tokenswift-heads/heads.safetensors",
        "tokenswift-heads/longgen.toml",
    ])
    record = json.loads((out / "training.json").read_text())
    assert record["command"].startswith("sgl-longgen train proxy --out")
    assert "--lm-steps 3 --heads-steps 3" in record["reproduce"]
    assert record["lm"]["steps"] == 3 and record["heads"]["steps"] == 3
    assert record["check"]["identical"] is True and record["check"]["new_tokens"] == 24
    if "max_abs_logit_diff" in record["transformers"]:
        assert record["transformers"]["max_abs_logit_diff"] < 1e-4
        assert record["transformers"]["same_token_ids"] is True
    loaded = load_model(out, "float32")
    load_heads(out / "tokenswift-heads", hidden_size=loaded.config.hidden_size, num_heads=3)
    assert "ignore_eos = true" in (out / "tokenswift-heads" / "longgen.toml").read_text()


def test_the_script_runs_what_train_proxy_runs(monkeypatch, tmp_path):
    calls = []
    monkeypatch.setattr(proxy, "run", lambda args, command: calls.append((vars(args), command)) or 0)
    argv = ["--out", str(tmp_path / "m"), "--lm-minutes", "0", "--compile", "--check-tokens", "0"]
    assert proxy.main(argv) == 0
    assert main(["train", "proxy", *argv]) == 0
    (script_args, script_command), (cli_args, cli_command) = calls
    assert script_command == cli_command == shlex.join(
        ["sgl-longgen", "train", "proxy", "--out", str(tmp_path / "m"), "--lm-minutes", "0.0", "--compile",
         "--check-tokens", "0"])
    assert script_args == {k: v for k, v in cli_args.items() if k not in ("command", "trainer", "run")}


def test_the_script_stands_alone(tmp_path):
    """``python -m sgl_longgen.training.proxy`` neither goes through nor loads the command line."""
    res = subprocess.run([sys.executable, "-m", "sgl_longgen.training.proxy", "--help"], capture_output=True,
                         text=True, timeout=300)
    assert res.returncode == 0 and res.stdout.startswith("usage: python -m sgl_longgen.training.proxy")
    assert "--lm-minutes" in res.stdout and "$SGLANG_LONGGEN_HOME/proxy-work" in res.stdout
    code = ("import runpy, sys\n"
            "try:\n"
            "    runpy.run_module('sgl_longgen.training.proxy', run_name='__main__')\n"
            "except SystemExit as exc:\n"
            "    print(exc.code, sorted(m for m in sys.modules if m.startswith(('sgl_longgen.cli', 'sgl_longgen.commands'))))\n")
    res = subprocess.run([sys.executable, "-c", code, "--out", str(tmp_path / "m"), "--config", str(tmp_path / "no.toml")],
                         capture_output=True, text=True, timeout=300)
    assert res.stdout.strip() == "2 []", res.stderr
    assert res.stderr.strip().splitlines() == [f"sgl-longgen: error: config file not found: {tmp_path / 'no.toml'}"]


def test_tiny_is_the_shipped_proxy_when_present(tmp_path, monkeypatch):
    monkeypatch.setattr(embedded, "SHIPPED_ROOT", tmp_path)
    assert resolve_model("tiny").name.startswith("tiny-random")  # absent: the random-init fallback
    (tmp_path / "tiny").mkdir()
    (tmp_path / "tiny" / "config.json").write_text("{}")
    assert resolve_model("tiny").name.startswith("tiny-random")  # incomplete: still the fallback
    (tmp_path / "tiny" / "model.safetensors").write_bytes(b"")
    assert resolve_model("tiny") == tmp_path / "tiny"
    assert resolve_model("tiny-random").name.startswith("tiny-random")
    assert "tiny" in embedded.names()


SHIPPED = embedded.shipped_model("tiny")


@pytest.mark.slow
@pytest.mark.skipif(SHIPPED is None, reason="no trained proxy shipped in sgl_longgen/models/tiny")
def test_shipped_proxy_demo(capsys):
    """The issue's acceptance: readable code, identical greedy outputs, tau > 1.5 at 2048 tokens."""
    code = main(["demo", "--max-new-tokens", "2048"])
    out = capsys.readouterr().out
    assert code == 0, out
    row = next(line.split() for line in out.splitlines() if line.startswith("tokenswift"))
    assert row[-1] == "yes" and float(row[4]) > 1.5
    text = out.split("--- text", 1)[1]
    assert "def " in text or "import " in text or "return" in text
    # The proxy and its heads (the OWL drafter beside them is a separate model).
    weights = [SHIPPED / "model.safetensors", *(SHIPPED / "tokenswift-heads").glob("*.safetensors")]
    assert sum(p.stat().st_size for p in weights) <= 20e6
