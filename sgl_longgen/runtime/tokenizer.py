"""A thin wrapper over a HF ``tokenizer.json`` (the ``tokenizers`` library, no transformers)."""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer as _HFTokenizer

from ..errors import LonggenError


class Tokenizer:
    def __init__(self, tok: _HFTokenizer, bos: str | None = None, eos: str | None = None, add_bos: bool = False):
        self._tok = tok
        self.bos_id = tok.token_to_id(bos) if bos else None
        self.eos_id = tok.token_to_id(eos) if eos else None
        self.add_bos = add_bos and self.bos_id is not None

    @classmethod
    def from_dir(cls, directory: str | Path) -> "Tokenizer":
        directory = Path(directory)
        path = directory / "tokenizer.json"
        try:
            tok = _HFTokenizer.from_file(str(path))
        except Exception as exc:  # the tokenizers library raises plain Exception subclasses
            raise LonggenError(f"cannot load {path}: {exc}") from None
        bos = eos = None
        add_bos = False
        cfg_path = directory / "tokenizer_config.json"
        if cfg_path.is_file():
            cfg = json.loads(cfg_path.read_text())
            bos, eos = _token_str(cfg.get("bos_token")), _token_str(cfg.get("eos_token"))
            add_bos = bool(cfg.get("add_bos_token", False))
        return cls(tok, bos, eos, add_bos)

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        ids = self._tok.encode(text, add_special_tokens=True).ids
        if self.add_bos and (not ids or ids[0] != self.bos_id):
            ids = [self.bos_id] + ids
        return ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=True)


def _token_str(value) -> str | None:
    if isinstance(value, dict):  # {"content": "<s>", ...}
        return value.get("content")
    return value
