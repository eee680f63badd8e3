"""What a job keeps on disk, written so that a kill at any instant leaves it usable.

``output_dir/``
  ``records.jsonl``   one line per finished id, appended once (the driver is the only writer)
  ``checkpoints/``    one file per unfinished id: the tokens generated so far, replaced atomically
  ``job.json``        the settings that decide the tokens; a rerun with other settings is refused
  ``summary.json``    the last run's summary
  ``.lock``           held by the running driver, so two drivers never write the same directory

A checkpoint is written to a temporary file, fsynced and renamed over the old one, so a reader
sees the old or the new checkpoint, never half of one. A record is one ``write`` of one line to a
file opened for appending, then fsynced; a driver killed in the middle of that write leaves an
unterminated last line, which the next run cuts off before it appends anything. A driver killed
between creating a checkpoint's temporary file and renaming it leaves that file behind; the next
run, once it holds the lock, deletes it.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import re
import tempfile
from pathlib import Path
from typing import Any

import msgspec

from ..errors import LonggenError
from .messages import Mark, Segment

RECORDS = "records.jsonl"
CHECKPOINTS = "checkpoints"
MANIFEST = "job.json"
SUMMARY = "summary.json"
LOCK = ".lock"


def atomic_write(path: Path, data: bytes) -> None:
    """Replace ``path`` with ``data``: readers see the old or the new content, never a mix."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    _fsync_dir(path.parent)


def _fsync_dir(directory: Path) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def prompt_key(prompt: str | None, input_ids: Any) -> str:
    """A digest of a prompt's content: a checkpoint of another prompt under the same id is stale."""
    blob = json.dumps({"prompt": prompt, "input_ids": list(input_ids) if input_ids is not None else None})
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


class Checkpoint(msgspec.Struct, kw_only=True):
    """A half-done generation: resume by prefilling prompt + ``tokens``."""

    id: str
    prompt_key: str
    tokens: list[int] = msgspec.field(default_factory=list)
    segments: list[Segment] = msgspec.field(default_factory=list)
    timeline: list[Mark] = msgspec.field(default_factory=list)  # the engines' reports, every run
    attempts: int = 0
    error: str | None = None  # set when the generation failed; the tokens are what it produced


_SAFE = re.compile(r"[^A-Za-z0-9._-]+")
# What ``atomic_write`` leaves of a checkpoint when killed before its rename: ``.NAME.json.XXXX.tmp``.
_TEMPORARY = re.compile(r"\..+\.[0-9a-f]{16}\.json\.[^.]+\.tmp")


class CheckpointStore:
    """One file per request id under ``output_dir/checkpoints``."""

    def __init__(self, output_dir: Path):
        self.dir = output_dir / CHECKPOINTS
        self.dir.mkdir(parents=True, exist_ok=True)
        self._encoder = msgspec.json.Encoder()

    def path(self, rid: str) -> Path:
        # Ids are arbitrary strings: a readable prefix plus a digest keeps names unique and safe.
        digest = hashlib.sha256(rid.encode()).hexdigest()[:16]
        return self.dir / f"{_SAFE.sub('_', rid)[:40]}.{digest}.json"

    def load(self, rid: str) -> Checkpoint | None:
        path = self.path(rid)
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            return None
        try:
            ckpt = msgspec.json.decode(data, type=Checkpoint)
        except (msgspec.ValidationError, msgspec.DecodeError) as exc:
            raise LonggenError(f"checkpoint {path} is unreadable ({exc}); delete it to restart that request") from None
        return ckpt if ckpt.id == rid else None

    def save(self, ckpt: Checkpoint) -> None:
        atomic_write(self.path(ckpt.id), self._encoder.encode(ckpt))

    def remove(self, rid: str) -> None:
        try:
            self.path(rid).unlink()
        except FileNotFoundError:
            pass

    def remove_temporaries(self) -> list[Path]:
        """Delete half-written checkpoints left by a killed driver; returns what was deleted.

        Only the driver holding the output directory's lock may call this: another driver's
        temporary files are checkpoints about to be renamed into place. Files of other programs
        (anything not named as ``atomic_write`` names a checkpoint's temporary) are left alone.
        """
        removed = []
        for p in self.dir.glob(".*.tmp"):
            if _TEMPORARY.fullmatch(p.name):
                try:
                    p.unlink()
                except FileNotFoundError:
                    continue
                removed.append(p)
        return removed

    def ids(self) -> list[str]:
        out = []
        for p in self.dir.glob("*.json"):
            try:
                out.append(msgspec.json.decode(p.read_bytes(), type=Checkpoint).id)
            except (msgspec.ValidationError, msgspec.DecodeError):
                continue
        return out


class RecordHead(msgspec.Struct):
    """What the driver keeps of a written record: not its tokens (thousands of 100K-token
    records would not fit in the driver's memory)."""

    id: str | int
    finish_reason: str | None = None
    num_new_tokens: int = 0
    accept_length: float | None = None


_head_decoder = msgspec.json.Decoder(RecordHead)


class RecordLog:
    """``records.jsonl``: each id at most once, whatever was killed when."""

    def __init__(self, output_dir: Path):
        self.path = output_dir / RECORDS
        self.heads: dict[str, RecordHead] = {}  # id -> its record's head, as on disk
        self.repaired = 0  # bytes of an unterminated last line cut off at open
        self.duplicates: list[str] = []  # ids found more than once (kept: the first)
        self._repair_tail()
        self._load()
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def _repair_tail(self) -> None:
        """Cut an unterminated last line: the previous driver died inside a write."""
        if not self.path.exists():
            return
        with open(self.path, "r+b") as f:
            size = f.seek(0, os.SEEK_END)
            end = size
            while end > 0:
                start = max(0, end - 65536)
                f.seek(start)
                chunk = f.read(end - start)
                nl = chunk.rfind(b"\n")
                if nl >= 0:
                    end = start + nl + 1
                    break
                end = start
            if end < size:
                self.repaired = size - end
                f.truncate(end)
                f.flush()
                os.fsync(f.fileno())

    def _load(self) -> None:
        if not self.path.exists():
            return
        with open(self.path, "rb") as f:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    head = _head_decoder.decode(line)
                except (msgspec.ValidationError, msgspec.DecodeError):
                    raise LonggenError(f"{self.path}:{lineno} is not a record; fix or remove that line") from None
                rid = str(head.id)
                if rid in self.heads:
                    self.duplicates.append(rid)
                    continue
                self.heads[rid] = head

    def __contains__(self, rid: str) -> bool:
        return rid in self.heads

    def __len__(self) -> int:
        return len(self.heads)

    def append(self, record: dict) -> bool:
        """Write ``record`` unless its id is already there; True if written."""
        rid = str(record["id"])
        if rid in self.heads:
            return False
        line = (json.dumps(record, ensure_ascii=False) + "\n").encode()
        view = memoryview(line)
        while view:
            n = os.write(self._fd, view)
            view = view[n:]
        os.fsync(self._fd)
        self.heads[rid] = RecordHead(id=rid, finish_reason=record.get("finish_reason"),
                                     num_new_tokens=record.get("num_new_tokens", 0),
                                     accept_length=record.get("accept_length"))
        return True

    def drop(self, ids: set[str]) -> None:
        """Rewrite the file without ``ids`` (to run failed requests again)."""
        if not ids & self.heads.keys():
            return
        fd, tmp = tempfile.mkstemp(prefix=f".{self.path.name}.", suffix=".tmp", dir=self.path.parent)
        with os.fdopen(fd, "wb") as out, open(self.path, "rb") as src:
            for line in src:
                if line.strip() and str(_head_decoder.decode(line).id) in ids:
                    continue
                out.write(line)
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp, self.path)
        _fsync_dir(self.path.parent)
        os.close(self._fd)
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        for rid in ids:
            self.heads.pop(rid, None)

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


class OutputLock:
    """An exclusive ``flock`` on the output directory; the kernel drops it when the holder dies."""

    def __init__(self, output_dir: Path):
        output_dir.mkdir(parents=True, exist_ok=True)
        self.path = output_dir / LOCK
        self._f = open(self.path, "a+")
        try:
            fcntl.flock(self._f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._f.seek(0)
            holder = self._f.read().strip() or "unknown"
            self._f.close()
            raise LonggenError(f"output directory {output_dir} is in use by another batch run ({holder})") from None
        self._f.seek(0)
        self._f.truncate()
        self._f.write(f"pid {os.getpid()} on {os.uname().nodename}\n")
        self._f.flush()

    def release(self) -> None:
        if not self._f.closed:
            fcntl.flock(self._f.fileno(), fcntl.LOCK_UN)
            self._f.close()


def _flatten(d: Any, prefix: str = "") -> dict[str, Any]:
    if not isinstance(d, dict):
        return {prefix: d}
    out: dict[str, Any] = {}
    for k, v in d.items():
        out.update(_flatten(v, f"{prefix}.{k}" if prefix else str(k)))
    return out


def check_manifest(output_dir: Path, name: str, settings: dict[str, Any]) -> bool:
    """Record the job's settings, or refuse a directory written with other ones.

    Returns True when the directory already held this job (a resume).
    """
    path = output_dir / MANIFEST
    settings = json.loads(json.dumps(settings, default=str))  # as it reads back
    if path.is_file():
        try:
            old = json.loads(path.read_text())["settings"]
        except (json.JSONDecodeError, KeyError, TypeError):
            raise LonggenError(f"{path} is not a job manifest; use another output_dir") from None
        a, b = _flatten(old), _flatten(settings)
        changed = sorted(k for k in a.keys() | b.keys() if a.get(k) != b.get(k))
        if changed:
            diffs = ", ".join(f"{k}: {a.get(k)!r} -> {b.get(k)!r}" for k in changed[:5])
            raise LonggenError(
                f"output directory {output_dir} holds a job with other generation settings ({diffs}); "
                "resuming would mix outputs: use another output_dir"
            )
        return True
    atomic_write(path, (json.dumps({"name": name, "settings": settings}, indent=2) + "\n").encode())
    return False
