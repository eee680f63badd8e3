"""``sgl-longgen batch``: long-generation batches on a Ray cluster, resumable from checkpoints.

``run`` drives a job on the current Ray cluster (or a local one it starts); ``submit`` hands the
same ``run`` to a cluster through the Ray Jobs API; ``status``, ``logs`` and ``stop`` manage a
submitted job. ``ray job submit -- sgl-longgen batch run JOB.toml`` works as well.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
from pathlib import Path


def add_parser(sub) -> None:
    p = sub.add_parser("batch", help="batch jobs on Ray: run, submit, status, logs, stop")
    bsub = p.add_subparsers(dest="batch_command", required=True, metavar="ACTION")

    r = bsub.add_parser("run", help="run (or resume) a job on the current Ray cluster, or a local one")
    r.add_argument("job", type=Path, help="job file (TOML or JSON; see configs/tiny_batch.toml)")
    r.add_argument("--output-dir", help="override the job's output_dir")
    r.add_argument("--address", help="Ray cluster address (default: RAY_ADDRESS, a running `ray start` cluster, "
                                     "or a new local one)")
    r.add_argument("--num-cpus", type=int, help="CPUs of the local cluster, when one is started")
    r.add_argument("--retry-errors", action="store_true",
                   help="run failed requests again, continuing from their checkpoints")
    r.add_argument("--no-progress", action="store_true", help="log lines instead of a live bar")
    r.set_defaults(run=run_cmd)

    s = bsub.add_parser("submit", help="submit a job through the Ray Jobs API")
    s.add_argument("job", type=Path)
    s.add_argument("--address", help="Ray dashboard address, http://HEAD:8265 (default: RAY_API_SERVER_ADDRESS, "
                                     "RAY_ADDRESS or http://127.0.0.1:8265)")
    s.add_argument("--output-dir", help="override the job's output_dir (an absolute path on the cluster)")
    s.add_argument("--working-dir", type=Path, help="folder uploaded as the job's working_dir (default: the job "
                                                    "file's folder)")
    s.add_argument("--no-upload", action="store_true",
                   help="upload nothing: the job file path is used as is (a filesystem the cluster shares)")
    s.add_argument("--submission-id", help="the job id to use (default: one Ray makes up)")
    s.add_argument("--runtime-env-json", help="extra runtime_env as JSON (env_vars, pip, ...)")
    s.add_argument("--entrypoint-num-cpus", type=float)
    s.add_argument("--entrypoint-num-gpus", type=float)
    s.add_argument("--retry-errors", action="store_true", help="passed on to `batch run`")
    s.add_argument("--no-wait", action="store_true", help="return after submitting instead of following the logs")
    s.set_defaults(run=submit_cmd)

    for name, fn, text in (("status", status_cmd, "status of a submitted job"),
                           ("logs", logs_cmd, "logs of a submitted job"),
                           ("stop", stop_cmd, "stop a submitted job (checkpoints are kept; rerun to resume)")):
        q = bsub.add_parser(name, help=text)
        q.add_argument("job_id")
        q.add_argument("--address", help="Ray dashboard address, http://HEAD:8265")
        if name == "logs":
            q.add_argument("--follow", "-f", action="store_true", help="stream until the job ends")
        if name == "stop":
            q.add_argument("--wait", action="store_true", help="wait until the job has stopped")
        if name == "status":
            q.add_argument("--json", action="store_true", help="print the status as JSON")
        q.set_defaults(run=fn)


def run_cmd(args: argparse.Namespace) -> int:
    from ..cluster.runner import run_job
    from ..cluster.spec import load_job

    overrides = {"output_dir": str(Path(args.output_dir).expanduser().resolve())} if args.output_dir else None
    job = load_job(args.job, overrides)
    # `ray job stop` and schedulers send SIGTERM: checkpoint what was received, then leave. The
    # run sees SIGTERM as Ctrl-C (one clean way out), so which signal came is noted here: the
    # exit status is 128 + its number, as a shell reports a process that signal ended.
    received = [signal.SIGINT]

    def on_sigterm(signum, frame):
        received.append(signal.SIGTERM)
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, on_sigterm)
    try:
        summary = run_job(job, address=args.address, num_cpus=args.num_cpus, retry_errors=args.retry_errors,
                          live=False if args.no_progress else None)
    except KeyboardInterrupt:
        return 128 + received[-1]
    finally:
        signal.signal(signal.SIGTERM, previous)
    ok = summary["unfinished"] == 0 and summary["errors"] == 0 and not summary["bad_lines"]
    return 0 if ok else 1


def submit_cmd(args: argparse.Namespace) -> int:
    from ..cluster import jobs
    from ..errors import LonggenError

    runtime_env = None
    if args.runtime_env_json:
        try:
            runtime_env = json.loads(args.runtime_env_json)
        except json.JSONDecodeError as exc:
            raise LonggenError(f"--runtime-env-json is not valid JSON: {exc}") from None
    job_id = jobs.submit(
        args.job, args.address, submission_id=args.submission_id, runtime_env=runtime_env,
        entrypoint_num_cpus=args.entrypoint_num_cpus, entrypoint_num_gpus=args.entrypoint_num_gpus,
        working_dir=args.working_dir, upload=not args.no_upload, output_dir=args.output_dir,
        extra_args=["--retry-errors"] if args.retry_errors else None, warn=sys.stderr,
    )
    address = jobs.resolve_address(args.address)
    print(job_id, flush=True)
    print(f"follow it with: sgl-longgen batch logs {job_id} --follow --address {address}", file=sys.stderr)
    if args.no_wait:
        return 0
    final = jobs.follow(job_id, args.address)
    print(f"job {job_id}: {final}", file=sys.stderr)
    return 0 if final == "SUCCEEDED" else 1


def status_cmd(args: argparse.Namespace) -> int:
    from ..cluster import jobs

    st = jobs.status(args.job_id, args.address)
    if args.json:
        print(json.dumps(st))
    else:
        print(f"{st['job_id']}: {st['status']}" + (f" ({st['message']})" if st["message"] else ""))
    return 0


def logs_cmd(args: argparse.Namespace) -> int:
    from ..cluster import jobs

    if args.follow:
        final = jobs.follow(args.job_id, args.address)
        return 0 if final == "SUCCEEDED" else 1
    sys.stdout.write(jobs.logs(args.job_id, args.address))
    return 0


def stop_cmd(args: argparse.Namespace) -> int:
    from ..cluster import jobs

    stopped = jobs.stop(args.job_id, args.address)
    print(f"{args.job_id}: {'stop requested' if stopped else 'not running'}")
    if args.wait:
        print(f"{args.job_id}: {jobs.wait(args.job_id, args.address)}")
    return 0
