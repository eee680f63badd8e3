"""``sgl-longgen train`` and ``sgl-longgen eval`` through the command line's entry point.

The commands run in-process (``cli.main``: the same parser, the same error handling as the
installed script) to spare a torch import per call.
"""

import json

import pytest

from sgl_longgen.cli import main
from sgl_longgen.commands.eval import distinct_n, method_names
from sgl_longgen.core.heads import load_heads




def test_train_heads_writes_a_checkpoint_that_generate_loads(cli, tmp_path, corpus_dir):
    out = tmp_path / "heads"
    res = cli("train", "heads", "--model", "tiny-random", "--data", str(corpus_dir), "--seq-len", "64",
              "--batch-size", "2", "--steps", "4", "--save-every", "2", "--log-every", "2", "--threads", "1",
              "--cache-dir", str(tmp_path / "cache"), "--out", str(out))
    assert res.returncode == 0, res.stderr
    summary = json.loads(res.stdout.strip().splitlines()[-1])
    assert summary["steps"] == 4 and summary["tokens"] == 4 * 2 * 64
    heads = load_heads(out, hidden_size=128, num_heads=3)
    assert heads.num_heads == 3
    info = json.loads((out / "heads.json").read_text())["training"]
    assert info["command"].startswith("sgl-longgen ") and "--steps 4" in info["command"]
    assert set(info["train"]) >= {"loss", "acc1", "acc2", "acc3"}

    gen = tmp_path / "gen.jsonl"
    res = cli("generate", "--model", "tiny-random", "--heads", str(out), "--method", "tokenswift",
              "--max-new-tokens", "32", "--temperature", "0", "--out", str(gen))
    assert res.returncode == 0, res.stderr
    record = json.loads(gen.read_text())
    assert record["num_new_tokens"] == 32 and record["method"] == "tokenswift"


def one_error_line(argv, capsys) -> str:
    assert main(argv) == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(lines) == 1, lines
    assert lines[0].startswith("sgl-longgen: error:")
    return lines[0]


def test_missing_data_is_one_error_line(tmp_path, capsys):
    line = one_error_line(["train", "heads", "--model", "tiny-random", "--data", str(tmp_path / "nope.txt"),
                           "--out", str(tmp_path / "h"), "--device", "cpu"], capsys)
    assert "data source not found" in line and "nope.txt" in line
    assert not (tmp_path / "h").exists()


def test_missing_model_is_one_error_line(tmp_path, capsys):
    line = one_error_line(["train", "heads", "--model", str(tmp_path / "nomodel"), "--out", str(tmp_path / "h")], capsys)
    assert "model directory not found" in line


def test_bad_config_key_is_one_error_line(tmp_path, capsys):
    cfg = tmp_path / "t.toml"
    cfg.write_text("[loop]\nstepz = 3\n")
    line = one_error_line(["train", "lm", "--config", str(cfg), "--out", str(tmp_path / "lm")], capsys)
    assert "stepz" in line


def test_bad_shape_is_one_error_line(tmp_path, capsys):
    line = one_error_line(["train", "lm", "--heads", "6", "--kv-heads", "4", "--out", str(tmp_path / "lm")], capsys)
    assert "num_key_value_heads" in line


def test_train_lm_cli_end_to_end_and_resume(cli, tmp_path, corpus_dir):
    out = tmp_path / "lm"
    common = ["train", "lm", "--data", str(corpus_dir), "--out", str(out), "--vocab-size", "320",
              "--hidden-size", "32", "--layers", "1", "--heads", "2", "--kv-heads", "1", "--head-dim", "16",
              "--intermediate-size", "64", "--max-position-embeddings", "256", "--seq-len", "32",
              "--batch-size", "2", "--log-every", "1", "--threads", "1", "--cache-dir", str(tmp_path / "cache")]
    res = cli(*common, "--steps", "3")
    assert res.returncode == 0, res.stderr
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
                 "generation_config.json", "training.json", "trainer_state.pt"):
        assert (out / name).is_file(), name
    res = cli(*common, "--steps", "5")
    assert res.returncode == 2 and "already holds a training run" in res.stderr  # not overwritten by accident
    res = cli(*common, "--steps", "5", "--resume")
    assert res.returncode == 0, res.stderr
    assert json.loads((out / "training.json").read_text())["steps"] == 5
    res = cli("generate", "--model", str(out), "--method", "ar", "--max-new-tokens", "8", "--prompt", "def f():")
    assert res.returncode == 0, res.stderr


def test_distinct_n():
    assert distinct_n([1, 2, 3, 4], 1) == 1.0
    assert distinct_n([1, 1, 1, 1], 1) == 0.25
    assert distinct_n([1, 2, 1, 2, 1], 2) == 2 / 4
    assert distinct_n([1, 2], 3) == 0.0
    assert "tokenswift" in method_names() and "ar" in method_names()


def test_eval_prints_the_table_and_writes_json(cli, tmp_path):
    out = tmp_path / "eval.json"
    res = cli("eval", "--model", "tiny-random", "--method", "tokenswift", "--max-new-tokens", "48",
              "--penalties", "1.0", "1.2", "--penalty-window", "16", "--out", str(out))
    assert res.returncode == 0, res.stderr
    rows = [line.split() for line in res.stdout.splitlines() if line.split() and line.split()[0] in ("1.00", "1.20")]
    assert [(r[0], r[1]) for r in rows] == [("1.00", "ar"), ("1.00", "tokenswift"), ("1.20", "ar"), ("1.20", "tokenswift")]
    assert all(r[-1] == "yes" for r in rows if r[1] == "tokenswift")
    report = json.loads(out.read_text())
    ar, ts = report["rows"][0], report["rows"][1]
    assert ar["tau"] == 1.0 and ar["alpha"] is None and ar["tokens"] == 48
    assert ts["tau"] >= 1.0 and 0.0 <= ts["alpha"] <= 1.0 and 0.0 <= ts["ngram_share"] <= 1.0
    assert ts["tau"] == pytest.approx(ts["committed"] / ts["steps"])
    assert all(0.0 < r["distinct_1"] <= 1.0 for r in report["rows"])
    assert len(report["records"]) == 4 and all(len(r["output_ids"]) == 48 for r in report["records"])
    # The same outputs in the JSON as in the table: greedy tokenswift == greedy ar per setting.
    by = {(r["penalty"], r["method"]): r["output_ids"] for r in report["records"]}
    assert by[(1.0, "ar")] == by[(1.0, "tokenswift")] and by[(1.2, "ar")] == by[(1.2, "tokenswift")]
