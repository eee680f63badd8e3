"""Reading the job's prompt file: one JSON object per line, each with a stable id.

Ids are what make a batch resumable (finished ids are skipped, half-done ones continue from their
checkpoint), so every line needs one, and an id may appear once. A line that cannot be used is
reported with its line number and skipped; the other lines still run.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from ..errors import LonggenError


@dataclass(frozen=True)
class Prompt:
    id: str
    line: int
    prompt: str | None = None  # text, tokenized by the engine
    input_ids: tuple[int, ...] | None = None  # or token ids as they are


@dataclass(frozen=True)
class BadLine:
    line: int
    reason: str

    def __str__(self) -> str:
        return f"line {self.line}: {self.reason}"


def _where(exc: json.JSONDecodeError) -> str:
    """The decoder's message with the column: some of its messages already end in "at"
    ("Unterminated string starting at"), and the column completes them."""
    at = "" if exc.msg.endswith(" at") else " at"
    return f"{exc.msg}{at} column {exc.colno}"


def _parse(text: str, lineno: int) -> Prompt:
    try:
        rec = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"not valid JSON ({_where(exc)})") from None
    if not isinstance(rec, dict):
        raise ValueError(f"expected a JSON object, got {type(rec).__name__}")
    if "id" not in rec:
        raise ValueError("missing field `id`")
    rid = rec["id"]
    if isinstance(rid, bool) or not isinstance(rid, (str, int)) or rid == "":
        raise ValueError(f"field `id` must be a non-empty string or an integer, got {rid!r}")
    has_text, has_ids = "prompt" in rec, "input_ids" in rec
    if has_text == has_ids:
        raise ValueError("needs exactly one of the fields `prompt` (text) and `input_ids` (token ids)")
    if has_text:
        if not isinstance(rec["prompt"], str) or not rec["prompt"]:
            raise ValueError("field `prompt` must be a non-empty string")
        return Prompt(id=str(rid), line=lineno, prompt=rec["prompt"])
    ids = rec["input_ids"]
    if not isinstance(ids, list) or not ids or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids):
        raise ValueError("field `input_ids` must be a non-empty list of non-negative integers")
    return Prompt(id=str(rid), line=lineno, input_ids=tuple(ids))


def read_prompts(path: Path) -> tuple[list[Prompt], list[BadLine]]:
    """All usable prompts in file order, and the lines that were not usable."""
    if not path.is_file():
        raise LonggenError(f"prompt file not found: {path}")
    prompts: list[Prompt] = []
    bad: list[BadLine] = []
    first_line: dict[str, int] = {}
    with open(path, encoding="utf-8", errors="replace") as f:
        for lineno, text in enumerate(f, 1):
            if not text.strip():
                continue
            try:
                p = _parse(text, lineno)
            except ValueError as exc:
                bad.append(BadLine(lineno, str(exc)))
                continue
            if p.id in first_line:
                bad.append(BadLine(lineno, f"duplicate id {p.id!r} (first on line {first_line[p.id]})"))
                continue
            first_line[p.id] = lineno
            prompts.append(p)
    return prompts, bad
