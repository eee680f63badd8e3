"""``batch run``: one job from its file to its records, resuming whatever a previous run left.

Order of work, chosen so that a crash at any point leaves a directory the next run can continue:
read the prompts (bad lines reported, skipped), lock the output directory, check that it holds
this job (or nothing), repair and read ``records.jsonl``, turn every unfinished prompt into a
request (with its checkpoint's tokens, if any), and only then connect to Ray and start engines.
A job with nothing left to do never starts Ray.
"""

from __future__ import annotations

import json
import signal
import sys
import threading
import time
import uuid
from typing import Any, TextIO

from .. import env
from ..errors import LonggenError
from .checkpoint import SUMMARY, CheckpointStore, OutputLock, RecordLog, atomic_write, check_manifest, prompt_key
from .engine_common import NAMESPACE
from .progress import BatchProgress, format_summary
from .prompts import read_prompts
from .scheduler import Request, Scheduler
from .spec import Job


def connect(address: str | None = None, num_cpus: int | None = None) -> bool:
    """Join the current Ray cluster (``RAY_ADDRESS``, ``ray start``, a Ray job) or start a local one.

    Returns True when this call connected (and so should disconnect at the end).
    """
    import ray

    if ray.is_initialized():
        return False
    kwargs: dict[str, Any] = {"namespace": NAMESPACE, "include_dashboard": False, "log_to_driver": True}
    if num_cpus is not None:
        kwargs["num_cpus"] = num_cpus
    # Ray installs its own SIGTERM handler; keep the caller's (``batch run`` turns SIGTERM, which
    # ``ray job stop`` sends, into a clean exit that checkpoints what was received).
    handler = signal.getsignal(signal.SIGTERM) if threading.current_thread() is threading.main_thread() else None
    try:
        ray.init(address=address, **kwargs)
    except (ConnectionError, ValueError) as exc:
        raise LonggenError(f"cannot join the Ray cluster{f' at {address}' if address else ''}: {exc}") from None
    if callable(handler):
        signal.signal(signal.SIGTERM, handler)
    return True


def _runtime_env() -> dict | None:
    """Settings engines on other nodes need from the driver's environment.

    Engines get the home under its current name, even when the driver still has it under the old
    one (``env.get`` warns about that once, here), so they build embedded models where it does.
    """
    home = env.get("HOME")
    return {"env_vars": {env.name("HOME"): home}} if home is not None else None


def run_job(job: Job, *, address: str | None = None, num_cpus: int | None = None, retry_errors: bool = False,
            live: bool | None = None, stream: TextIO | None = None, out: TextIO | None = None) -> dict[str, Any]:
    """Run (or resume) a job; returns the summary also written to ``summary.json``."""
    stream = stream or sys.stderr
    out = out or sys.stdout
    t_start = time.perf_counter()
    prompts, bad = read_prompts(job.input_path)
    for b in bad:
        print(f"sgl-longgen: warning: {job.input_path}:{b.line}: {b.reason}; skipped", file=stream, flush=True)

    output_dir = job.output_dir
    lock = OutputLock(output_dir)
    records = store = progress = scheduler = groups = None
    owns_ray = interrupted = False
    t_loop = None
    try:
        check_manifest(output_dir, job.name, job.settings())
        records = RecordLog(output_dir)
        store = CheckpointStore(output_dir)
        store.remove_temporaries()  # under the lock: no other driver is writing them
        if records.repaired:
            print(f"sgl-longgen: warning: {records.path}: dropped an unfinished last line ({records.repaired} bytes) "
                  "left by an interrupted run", file=stream)
        ids = {p.id for p in prompts}
        if retry_errors:
            records.drop({rid for rid, h in records.heads.items() if h.finish_reason == "error" and rid in ids})

        requests: list[Request] = []
        for p in prompts:
            if p.id in records:
                continue
            req = Request(prompt=p, key=prompt_key(p.prompt, p.input_ids))
            ckpt = store.load(p.id)
            if ckpt is not None and ckpt.prompt_key == req.key and len(ckpt.tokens) <= job.spec.max_new_tokens:
                req.tokens, req.segments, req.attempts = list(ckpt.tokens), list(ckpt.segments), ckpt.attempts
                req.timeline = list(ckpt.timeline)
                req.resumed = req.checkpointed = len(ckpt.tokens)
            elif ckpt is not None:
                store.remove(p.id)  # another prompt under this id: start over
            requests.append(req)
        requests.sort(key=lambda r: not r.resumed)  # half-done generations first: their prefixes are paid for
        for rid in store.ids():  # a driver killed between writing a record and removing its checkpoint
            head = records.heads.get(rid)
            if head is not None and head.finish_reason != "error":
                store.remove(rid)

        progress = BatchProgress(job.name, total=len(prompts), done=len(prompts) - len(requests), live=live,
                                 stream=stream)
        resumed = sum(r.resumed for r in requests)
        if resumed:
            progress.note(f"resuming {sum(1 for r in requests if r.resumed)} request(s) from checkpoints "
                          f"({resumed} tokens not generated again)")
        if requests:
            from .placement import release, reserve

            owns_ray = connect(address, num_cpus)
            run_name = f"{job.name}/{uuid.uuid4().hex[:8]}"
            groups = reserve(job.spec, run_name, job.spec.engines.startup_timeout_s)
            scheduler = Scheduler(job, run_name, groups, store, records, progress, runtime_env=_runtime_env(),
                                  done_before=len(prompts) - len(requests))
            scheduler.start()
            progress.start()
            t_loop = time.perf_counter()
            try:
                scheduler.run(requests)
            except KeyboardInterrupt:
                interrupted = True
                progress.note("interrupted: every token received is checkpointed; rerun the job to continue")
    finally:
        if scheduler is not None:
            scheduler.stop()
        if groups is not None:
            release(groups)
        if progress is not None:
            progress.close()
        if records is not None:
            records.close()
        lock.release()
        if owns_ray:
            import ray

            ray.shutdown()

    t_end = time.perf_counter()
    loop_seconds = (t_end - t_loop) if t_loop is not None else 0.0
    mine = [records.heads[p.id] for p in prompts if p.id in records.heads]
    this_run = scheduler.written if scheduler is not None else []
    taus = [h.accept_length for h in this_run
            if h.finish_reason != "error" and h.num_new_tokens > 1 and h.accept_length is not None]
    generated = scheduler.generated if scheduler is not None else 0
    summary = {
        "job": job.name,
        "input": str(job.input_path),
        "output_dir": str(output_dir),
        "records_file": str(records.path),
        "prompts": len(prompts),
        "records": len(mine),
        "errors": sum(1 for h in mine if h.finish_reason == "error"),
        "unfinished": len(prompts) - len(mine),
        "bad_lines": [{"line": b.line, "reason": b.reason} for b in bad],
        "accept_length": sum(taus) / len(taus) if taus else None,
        "run": {
            "interrupted": interrupted,
            "requests_finished": len(this_run),
            "tokens_generated": generated,
            "tokens_resumed": sum(r.resumed for r in requests),
            "seconds": t_end - t_start,
            "generate_seconds": loop_seconds,
            "tokens_per_second": generated / loop_seconds if loop_seconds > 0 else 0.0,
            "engines": scheduler.engine_report() if scheduler is not None else [],
        },
    }
    atomic_write(output_dir / SUMMARY, (json.dumps(summary, indent=2) + "\n").encode())
    print(format_summary(summary), file=out, flush=True)
    if interrupted:
        raise KeyboardInterrupt
    return summary
