"""Training text: collect documents, split them, tokenize once, and cut random windows.

The offline corpus is the running interpreter's standard library (``stdlib``): real code, read
in a fixed order, so two machines with the same Python build the same corpus. Each document
becomes ``BOS + tokens + EOS`` in one flat token array per split; the array is cached on disk
under a key of the tokenizer and the documents' content, so a second run (or the heads trainer
after the LM trainer) skips tokenization.
"""

from __future__ import annotations

import hashlib
import json
import os
import sysconfig
import tempfile
import zlib
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from tqdm import tqdm

from ..errors import LonggenError
from .config import DataConfig

STDLIB = "stdlib"
_SKIP_STDLIB_DIRS = {"site-packages", "dist-packages", "__pycache__"}


@dataclass(frozen=True)
class Document:
    name: str  # stable across machines: decides the split
    text: str


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def _stdlib_documents() -> list[Document]:
    root = stdlib_root()
    docs = []
    for path in sorted(root.rglob("*.py"), key=lambda p: p.relative_to(root).as_posix()):
        rel = path.relative_to(root)
        if _SKIP_STDLIB_DIRS & set(rel.parts[:-1]):
            continue
        text = _read_text(path, strict=False)
        if text:
            docs.append(Document(f"{STDLIB}/{rel.as_posix()}", text))
    return docs


def _read_text(path: Path, strict: bool) -> str | None:
    """A file's text; files that are not UTF-8 are skipped in directory scans, errors when named."""
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        if strict:
            raise LonggenError(f"data file {path} is not UTF-8 text") from None
        return None
    except OSError as exc:
        raise LonggenError(f"cannot read data file {path}: {exc.strerror}") from None


def _jsonl_documents(path: Path) -> list[Document]:
    docs = []
    for lineno, line in enumerate(_read_text(path, strict=True).splitlines(), 1):
        if not line.strip():
            continue
        try:
            text = json.loads(line)["text"]
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise LonggenError(f"{path}:{lineno}: expected a JSON object with a 'text' field ({exc})") from None
        if not isinstance(text, str):
            raise LonggenError(f"{path}:{lineno}: 'text' must be a string")
        docs.append(Document(f"{path.name}:{lineno}", text))
    return docs


def collect_documents(cfg: DataConfig) -> list[Document]:
    """Every document named by ``cfg.sources``, in order; bad sources are errors."""
    if not cfg.sources:
        raise LonggenError("no training data given (--data FILE|DIR|stdlib ...)")
    docs: list[Document] = []
    for source in cfg.sources:
        if source == STDLIB:
            found = _stdlib_documents()
        else:
            path = Path(source)
            if path.is_dir():
                files = sorted((p for p in path.rglob(cfg.glob) if p.is_file()), key=lambda p: p.relative_to(path).as_posix())
                found = []
                for f in files:
                    text = _read_text(f, strict=False)
                    if text:
                        found.append(Document(f"{path.name}/{f.relative_to(path).as_posix()}", text))
            elif path.is_file():
                if path.suffix == ".jsonl":
                    found = _jsonl_documents(path)
                else:
                    text = _read_text(path, strict=True)
                    found = [Document(path.name, text)] if text else []
            else:
                raise LonggenError(f"data source not found: {source} (a file, a directory or '{STDLIB}')")
        if not found:
            raise LonggenError(f"data source {source} holds no text documents (glob {cfg.glob!r})")
        docs.extend(found)
    return docs


def split_documents(docs: list[Document], val_fraction: float) -> tuple[list[Document], list[Document]]:
    """A stable split by document name (crc32), independent of order and of the other documents."""
    if val_fraction <= 0:
        return list(docs), []
    cut = int(val_fraction * 10_000)
    train, val = [], []
    for doc in docs:
        (val if zlib.crc32(doc.name.encode()) % 10_000 < cut else train).append(doc)
    if not train:  # tiny corpora: keep something to train on
        return list(docs), []
    return train, val


# ----------------------------------------------------------------------------------------------
# tokenization


@dataclass
class TokenizedCorpus:
    train: torch.Tensor  # int32 [N]
    val: torch.Tensor  # int32 [M] (may be empty)
    train_documents: int
    val_documents: int
    key: str

    def describe(self) -> str:
        return (f"{self.train.numel():,} train tokens ({self.train_documents} documents), "
                f"{self.val.numel():,} validation tokens ({self.val_documents} documents)")


def _corpus_key(tokenizer_json: str, bos: int | None, eos: int | None, train: list[Document], val: list[Document]) -> str:
    h = hashlib.sha256()
    h.update(tokenizer_json.encode())
    h.update(f"|{bos}|{eos}|".encode())
    for split, docs in (("train", train), ("val", val)):
        h.update(split.encode())
        for doc in docs:
            h.update(doc.name.encode() + b"\0")
            h.update(hashlib.sha256(doc.text.encode()).digest())
    return h.hexdigest()[:20]


def _encode(docs: list[Document], tokenizer, bos: int | None, eos: int | None, desc: str, batch: int = 256) -> torch.Tensor:
    pieces: list[torch.Tensor] = []
    with tqdm(total=len(docs), desc=desc, unit="doc", dynamic_ncols=True, leave=False) as bar:
        for lo in range(0, len(docs), batch):
            chunk = docs[lo : lo + batch]
            for enc in tokenizer.encode_batch([d.text for d in chunk], add_special_tokens=False):
                ids = ([bos] if bos is not None else []) + enc.ids + ([eos] if eos is not None else [])
                pieces.append(torch.tensor(ids, dtype=torch.int32))
            bar.update(len(chunk))
    return torch.cat(pieces) if pieces else torch.zeros(0, dtype=torch.int32)


def tokenize_corpus(
    train: list[Document],
    val: list[Document],
    tokenizer_dir: Path,
    cache_dir: Path,
) -> TokenizedCorpus:
    """Flat int32 token arrays for both splits, from the on-disk cache when it has them."""
    from tokenizers import Tokenizer as HFTokenizer

    from ..runtime.tokenizer import Tokenizer

    wrapped = Tokenizer.from_dir(tokenizer_dir)
    raw = HFTokenizer.from_file(str(Path(tokenizer_dir) / "tokenizer.json"))
    bos, eos = wrapped.bos_id, wrapped.eos_id
    key = _corpus_key(raw.to_str(), bos, eos, train, val)
    path = Path(cache_dir) / f"tokens-{key}.safetensors"
    if path.is_file():
        try:
            t = load_file(str(path))
            return TokenizedCorpus(t["train"], t["val"], len(train), len(val), key)
        except (SafetensorError, OSError, KeyError):
            pass  # a damaged cache file is rebuilt below
    corpus = TokenizedCorpus(
        _encode(train, raw, bos, eos, "tokenize train"), _encode(val, raw, bos, eos, "tokenize val"),
        len(train), len(val), key,
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".tokens-", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        save_file({"train": corpus.train, "val": corpus.val}, tmp)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return corpus


# ----------------------------------------------------------------------------------------------
# batches


def check_length(tokens: torch.Tensor, length: int, split: str) -> None:
    if tokens.numel() < length:
        raise LonggenError(
            f"the {split} data has {tokens.numel()} tokens, fewer than one window of {length} "
            "(give more data or a smaller --seq-len)"
        )


def sample_windows(tokens: torch.Tensor, batch: int, length: int, generator: torch.Generator) -> torch.Tensor:
    """``[batch, length]`` int64 windows at uniformly random offsets (documents may be crossed)."""
    check_length(tokens, length, "training")
    starts = torch.randint(0, tokens.numel() - length + 1, (batch,), generator=generator)
    index = starts[:, None] + torch.arange(length)
    return tokens[index.to(tokens.device)].long()


def fixed_windows(tokens: torch.Tensor, count: int, length: int) -> torch.Tensor:
    """``[n, length]`` evenly spaced windows (n <= count): the same validation set every time."""
    n = min(count, tokens.numel() // length)
    if n == 0:
        return torch.zeros(0, length, dtype=torch.long, device=tokens.device)
    stride = (tokens.numel() - length) // max(1, n - 1) if n > 1 else 0
    index = (torch.arange(n) * stride)[:, None] + torch.arange(length)
    return tokens[index.to(tokens.device)].long()
