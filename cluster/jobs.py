"""Batch jobs through the Ray Jobs API: submit, status, logs, stop.

A submitted batch is a Ray job whose entrypoint is ``sgl-longgen batch run JOB``, the same
command ``ray job submit -- sgl-longgen batch run JOB`` would start; the driver then joins the
cluster it runs on. ``submit`` validates the job file here first, so a typo fails in the terminal
rather than in the cluster's logs, and uploads the job file's folder as the job's ``working_dir``
(where the prompts usually sit).

Outputs are written by the driver on the head node (or wherever the entrypoint runs): on a
multi-node cluster give an absolute ``output_dir`` on storage that outlives the job.
"""

from __future__ import annotations

import asyncio
import os
import shlex
import sys
import time
from pathlib import Path
from typing import Any, TextIO

from ..errors import LonggenError
from .spec import load_job

DEFAULT_ADDRESS = "http://127.0.0.1:8265"
TERMINAL = ("SUCCEEDED", "FAILED", "STOPPED")


def resolve_address(address: str | None) -> str:
    """``--address``, else ``RAY_API_SERVER_ADDRESS`` / ``RAY_ADDRESS`` (as ``ray job`` reads them)."""
    if address:
        return address
    for var in ("RAY_API_SERVER_ADDRESS", "RAY_ADDRESS"):
        value = os.environ.get(var)
        if value and value.startswith(("http://", "https://")):
            return value
    return DEFAULT_ADDRESS


def client(address: str | None):
    from ray.job_submission import JobSubmissionClient

    addr = resolve_address(address)
    try:
        return JobSubmissionClient(addr)
    except (ConnectionError, RuntimeError, ValueError) as exc:
        raise LonggenError(f"cannot reach the Ray Jobs API at {addr}: {_first_line(exc)}") from None


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def _call(fn, *args, what: str, **kwargs):
    try:
        return fn(*args, **kwargs)
    except (ConnectionError, RuntimeError, ValueError) as exc:
        raise LonggenError(f"{what}: {_first_line(exc)}") from None


def _inside(path: Path, root: Path) -> bool:
    try:
        path.resolve().relative_to(root)
        return True
    except ValueError:
        return False


def build_submission(job_file: str | Path, *, working_dir: str | Path | None = None, upload: bool = True,
                     output_dir: str | None = None, extra_args: list[str] | None = None,
                     warn: TextIO | None = None) -> tuple[str, dict[str, Any]]:
    """The entrypoint and runtime_env for a job file, after validating it locally."""
    job_file = Path(job_file)
    overrides = {"output_dir": str(Path(output_dir).expanduser().resolve())} if output_dir else None
    job = load_job(job_file, overrides)
    args = ["sgl-longgen", "batch", "run"]
    runtime_env: dict[str, Any] = {}
    if upload:
        root = Path(working_dir or job_file.parent).resolve()
        if not _inside(job_file, root):
            raise LonggenError(f"the job file {job_file} is not inside the working directory {root}")
        if not Path(job.spec.input).is_absolute() and not _inside(job.input_path, root):
            raise LonggenError(
                f"input {job.spec.input!r} resolves to {job.input_path}, outside the uploaded working directory "
                f"{root}: give --working-dir a folder that holds both, or an absolute path on the cluster"
            )
        runtime_env["working_dir"] = str(root)
        args.append(str(job_file.resolve().relative_to(root)))
        if not Path(job.spec.output_dir).is_absolute() and warn is not None:
            print(f"sgl-longgen: warning: output_dir {job.spec.output_dir!r} is relative: on the cluster it lands in "
                  "the job's temporary working directory; pass --output-dir with a path on shared storage",
                  file=warn)
    else:
        args.append(str(job_file.resolve()))
    if output_dir:
        args += ["--output-dir", overrides["output_dir"]]
    args += extra_args or []
    return shlex.join(args), runtime_env


def submit(job_file: str | Path, address: str | None, *, submission_id: str | None = None,
           runtime_env: dict[str, Any] | None = None, entrypoint_num_cpus: float | None = None,
           entrypoint_num_gpus: float | None = None, warn: TextIO | None = None, **build) -> str:
    entrypoint, env = build_submission(job_file, warn=warn, **build)
    env = {**env, **(runtime_env or {})}
    c = client(address)
    kwargs: dict[str, Any] = {"entrypoint": entrypoint, "runtime_env": env or None, "submission_id": submission_id,
                              "metadata": {"sgl_longgen_job": Path(job_file).name}}
    if entrypoint_num_cpus is not None:
        kwargs["entrypoint_num_cpus"] = entrypoint_num_cpus
    if entrypoint_num_gpus is not None:
        kwargs["entrypoint_num_gpus"] = entrypoint_num_gpus
    return _call(c.submit_job, what="job submission failed", **kwargs)


def status(job_id: str, address: str | None) -> dict[str, Any]:
    info = _call(client(address).get_job_info, job_id, what=f"cannot read job {job_id}")
    return {
        "job_id": job_id,
        "status": str(getattr(info.status, "value", info.status)),
        "message": info.message,
        "entrypoint": info.entrypoint,
        "start_time": info.start_time,
        "end_time": info.end_time,
        "driver_exit_code": getattr(info, "driver_exit_code", None),
    }


def logs(job_id: str, address: str | None) -> str:
    return _call(client(address).get_job_logs, job_id, what=f"cannot read the logs of job {job_id}")


def follow(job_id: str, address: str | None, out: TextIO = sys.stdout) -> str:
    """Stream the job's logs until it ends; returns its final status."""
    c = client(address)

    async def tail() -> None:
        async for chunk in c.tail_job_logs(job_id):
            out.write(chunk)
            out.flush()

    try:
        asyncio.run(tail())
    except (ConnectionError, RuntimeError) as exc:
        raise LonggenError(f"cannot follow the logs of job {job_id}: {_first_line(exc)}") from None
    return wait(job_id, address, timeout=60)


def wait(job_id: str, address: str | None, timeout: float | None = None, poll: float = 1.0) -> str:
    c = client(address)
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        st = str(_call(c.get_job_status, job_id, what=f"cannot read job {job_id}").value)
        if st in TERMINAL or (deadline is not None and time.monotonic() > deadline):
            return st
        time.sleep(poll)


def stop(job_id: str, address: str | None) -> bool:
    return bool(_call(client(address).stop_job, job_id, what=f"cannot stop job {job_id}"))
