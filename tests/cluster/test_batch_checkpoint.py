"""What a job keeps on disk survives a kill at any instant, and records are written once."""

from __future__ import annotations

import io
import json

import pytest

from batch_helpers import PROMPTS, write_job
from sgl_longgen.cluster.checkpoint import (
    Checkpoint, CheckpointStore, OutputLock, RecordLog, atomic_write, check_manifest,
)
from sgl_longgen.cluster.messages import Segment
from sgl_longgen.cluster.runner import run_job
from sgl_longgen.cluster.spec import load_job
from sgl_longgen.errors import LonggenError


def test_atomic_write_replaces_and_leaves_no_temporary_files(tmp_path):
    path = tmp_path / "f.json"
    atomic_write(path, b"one")
    atomic_write(path, b"two")
    assert path.read_bytes() == b"two"
    assert [p.name for p in tmp_path.iterdir()] == ["f.json"]


def test_checkpoints_round_trip_per_id(tmp_path):
    store = CheckpointStore(tmp_path)
    odd = "a/b c:ü" * 20  # any string is an id
    ck = Checkpoint(id=odd, prompt_key="k", tokens=[1, 2, 3], segments=[Segment(engine=1, tokens=3, steps=2)],
                    attempts=2)
    store.save(ck)
    store.save(Checkpoint(id="other", prompt_key="k", tokens=[9]))
    assert store.load(odd) == ck
    assert sorted(store.ids()) == sorted([odd, "other"])
    store.remove(odd)
    assert store.load(odd) is None and store.ids() == ["other"]


def test_records_are_written_once(tmp_path):
    log = RecordLog(tmp_path)
    assert log.append({"id": "a", "n": 1})
    assert not log.append({"id": "a", "n": 2})
    log.close()
    log = RecordLog(tmp_path)  # a rerun reads what is there
    assert not log.append({"id": "a", "n": 3})
    assert log.append({"id": "b", "n": 1})
    log.close()
    lines = [json.loads(x) for x in (tmp_path / "records.jsonl").read_text().splitlines()]
    assert [(r["id"], r["n"]) for r in lines] == [("a", 1), ("b", 1)]


def test_an_unterminated_last_record_is_cut_off(tmp_path):
    # What a driver killed in the middle of a write leaves behind.
    (tmp_path / "records.jsonl").write_text('{"id": "a"}\n{"id": "b", "output_ids": [1, 2')
    log = RecordLog(tmp_path)
    assert "a" in log and "b" not in log and log.repaired > 0
    assert log.append({"id": "b"})
    log.close()
    assert [json.loads(x)["id"] for x in (tmp_path / "records.jsonl").read_text().splitlines()] == ["a", "b"]


def test_dropping_records_rewrites_the_file(tmp_path):
    log = RecordLog(tmp_path)
    for rid in "abc":
        log.append({"id": rid})
    log.drop({"b"})
    log.append({"id": "b", "again": True})
    log.close()
    ids = [json.loads(x)["id"] for x in (tmp_path / "records.jsonl").read_text().splitlines()]
    assert ids == ["a", "c", "b"]


def test_manifest_refuses_other_settings_naming_them(tmp_path):
    settings = {"model": "tiny", "generation": {"max_new_tokens": 64, "sampling": {"temperature": 0.0}}}
    assert check_manifest(tmp_path, "j", settings) is False
    assert check_manifest(tmp_path, "j", settings) is True
    other = {"model": "tiny", "generation": {"max_new_tokens": 64, "sampling": {"temperature": 0.7}}}
    with pytest.raises(LonggenError, match=r"generation\.sampling\.temperature: 0\.0 -> 0\.7"):
        check_manifest(tmp_path, "j", other)


def test_one_driver_per_output_directory(tmp_path):
    lock = OutputLock(tmp_path)
    with pytest.raises(LonggenError, match="in use by another batch run"):
        OutputLock(tmp_path)
    lock.release()
    OutputLock(tmp_path).release()


def test_the_next_run_removes_temporary_checkpoints_a_killed_driver_left(tmp_path):
    job = load_job(write_job(tmp_path, "stale", prompts=PROMPTS[:1]))
    out = job.output_dir
    store = CheckpointStore(out)
    # A failed request: its record says so and its checkpoint is kept for --retry-errors, so the
    # run has nothing to generate and starts no Ray.
    kept = Checkpoint(id="fib", prompt_key="k", tokens=[1, 2, 3], attempts=1, error="engine lost")
    store.save(kept)
    log = RecordLog(out)
    log.append({"id": "fib", "finish_reason": "error", "error": "engine lost", "num_new_tokens": 3})
    log.close()
    # What a driver killed between atomic_write's mkstemp and its rename leaves behind.
    stale = store.dir / f".{store.path('fib').name}.k3j_x9q1.tmp"
    stale.write_bytes(b'{"id": "fib", "prompt_key": "k", "tok')
    foreign = store.dir / ".notes.tmp"  # not a name atomic_write gives: not ours to delete
    foreign.write_text("someone else's")

    holder = OutputLock(out)  # another driver runs: its temporary files are about to be renamed
    with pytest.raises(LonggenError, match="in use by another batch run"):
        run_job(job, live=False, stream=io.StringIO(), out=io.StringIO())
    assert stale.exists()
    holder.release()

    summary = run_job(job, live=False, stream=io.StringIO(), out=io.StringIO())
    assert not stale.exists()
    assert store.load("fib") == kept and store.ids() == ["fib"]
    assert foreign.read_text() == "someone else's"
    assert summary["errors"] == 1 and summary["run"]["engines"] == []
