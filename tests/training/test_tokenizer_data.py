"""Tokenizer training, corpus collection, splitting, the token cache and batch windows."""

import json
from pathlib import Path

import pytest
import torch

from sgl_longgen.errors import LonggenError
from sgl_longgen.runtime.embedded import BOS, EOS
from sgl_longgen.runtime.tokenizer import Tokenizer
from sgl_longgen.training.config import DataConfig, TokenizerConfig
from sgl_longgen.training.data import (
    Document, collect_documents, fixed_windows, sample_windows, split_documents, stdlib_root, tokenize_corpus,
)
from sgl_longgen.training.tokenizer import train_tokenizer


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory, sample_text) -> Path:
    out = tmp_path_factory.mktemp("tok")
    return train_tokenizer([sample_text] * 20, TokenizerConfig(vocab_size=400), out, 4096, show_progress=False)


@pytest.mark.parametrize("text", [
    "def f(a, b):\n    return a + b\n",
    "x = 1\n\n\n\tif  y :   pass  # trailing   \n",
    "naïve café — 日本語 🐍 \x00\x7f",
    "",
])
def test_tokenizer_round_trips_text(tok_dir, text):
    tok = Tokenizer.from_dir(tok_dir)
    ids = tok.encode(text)
    assert ids[0] == tok.bos_id == 0
    assert tok.decode(ids) == text


def test_tokenizer_learns_merges_and_special_tokens(tok_dir, sample_text):
    tok = Tokenizer.from_dir(tok_dir)
    assert (tok.bos_id, tok.eos_id) == (0, 1)
    assert 258 < tok.vocab_size <= 400
    assert tok.decode(tok.encode(sample_text)) == sample_text
    assert len(tok.encode(sample_text)) < len(sample_text.encode()) / 2  # it compresses what it was trained on
    cfg = json.loads((tok_dir / "tokenizer_config.json").read_text())
    assert (cfg["bos_token"], cfg["eos_token"]) == (BOS, EOS)


def test_documents_from_directories_in_a_fixed_order(corpus_dir):
    docs = collect_documents(DataConfig(sources=[str(corpus_dir)], glob="*.py"))
    assert len(docs) == 12
    assert [d.name for d in docs] == sorted(d.name for d in docs)
    assert all(d.name.endswith(".py") for d in docs)


def test_jsonl_and_plain_files(tmp_path):
    (tmp_path / "a.jsonl").write_text('{"text": "one"}\n\n{"text": "two"}\n')
    (tmp_path / "b.txt").write_text("three")
    docs = collect_documents(DataConfig(sources=[str(tmp_path / "a.jsonl"), str(tmp_path / "b.txt")]))
    assert [d.text for d in docs] == ["one", "two", "three"]


@pytest.mark.parametrize("setup, message", [
    (lambda p: None, "data source not found"),
    (lambda p: (p / "x.jsonl").write_text('{"txt": 1}\n'), "'text' field"),
    (lambda p: (p / "x.jsonl").write_bytes(b"\xff\xfe"), "not UTF-8"),
])
def test_bad_data_sources_are_one_clear_error(tmp_path, setup, message):
    setup(tmp_path)
    with pytest.raises(LonggenError, match=message):
        collect_documents(DataConfig(sources=[str(tmp_path / "x.jsonl")]))


def test_directory_without_matching_files_is_an_error(tmp_path):
    (tmp_path / "a.txt").write_text("hello")
    with pytest.raises(LonggenError, match="no text documents"):
        collect_documents(DataConfig(sources=[str(tmp_path)], glob="*.py"))


def test_stdlib_corpus_is_the_interpreters_own_sources():
    docs = collect_documents(DataConfig(sources=["stdlib"]))
    names = [d.name for d in docs]
    assert len(docs) > 500 and names == sorted(names)
    assert "stdlib/os.py" in names and not any("site-packages" in n for n in names)
    assert next(d for d in docs if d.name == "stdlib/os.py").text == (stdlib_root() / "os.py").read_text()


def test_split_is_stable_and_per_document():
    docs = [Document(f"doc{i}", "x") for i in range(1000)]
    train, val = split_documents(docs, 0.1)
    assert 50 < len(val) < 150 and len(train) + len(val) == 1000
    train2, val2 = split_documents(list(reversed(docs)), 0.1)
    assert {d.name for d in val2} == {d.name for d in val}


def test_tokenized_corpus_is_cached_and_bracketed_by_bos_eos(tok_dir, tmp_path):
    train = [Document("a", "def f():\n    pass\n"), Document("b", "x = 1\n")]
    val = [Document("c", "y = 2\n")]
    first = tokenize_corpus(train, val, tok_dir, tmp_path)
    (cached,) = list(tmp_path.glob("tokens-*.safetensors"))
    tok = Tokenizer.from_dir(tok_dir)
    a = tok.encode("def f():\n    pass\n")[1:]
    assert first.train[: len(a) + 2].tolist() == [0, *a, 1]
    assert first.train.dtype == torch.int32 and first.val[0] == 0 and first.val[-1] == 1
    mtime = cached.stat().st_mtime_ns
    again = tokenize_corpus(train, val, tok_dir, tmp_path)
    assert cached.stat().st_mtime_ns == mtime and torch.equal(again.train, first.train)
    tokenize_corpus(train + [Document("d", "z")], val, tok_dir, tmp_path)
    assert len(list(tmp_path.glob("tokens-*.safetensors"))) == 2  # other documents, another key


def test_windows():
    tokens = torch.arange(100, dtype=torch.int32)
    gen = torch.Generator().manual_seed(0)
    w = sample_windows(tokens, 16, 10, gen)
    assert w.shape == (16, 10) and w.dtype == torch.long
    assert torch.equal(w[:, 1:] - w[:, :-1], torch.ones(16, 9, dtype=torch.long))  # contiguous slices
    assert int(w.max()) <= 99
    v = fixed_windows(tokens, 4, 10)
    assert v[:, 0].tolist() == [0, 30, 60, 90]
    with pytest.raises(LonggenError, match="fewer than one window"):
        sample_windows(tokens, 1, 101, gen)
