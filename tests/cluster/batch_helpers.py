"""Helpers of the Ray batch tests: the shared prompts, job files, drivers as subprocesses."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

# Prompts of more than 16 tokens each (the tiny model's TokenSwift partial-KV sink count).
PROMPTS = [
    {"id": "fib", "prompt": "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n"},
    {"id": "story", "prompt": "Once upon a time, in a city built on the back of a sleeping whale,"},
    {"id": "essay", "prompt": "The history of the printing press begins in the workshops of"},
    {"id": "ids", "input_ids": list(b"Hello, world. This is a prompt given as token ids.")},
    {"id": "recipe", "prompt": "Ingredients: flour, water, salt and yeast. Method: first,"},
    {"id": "poem", "prompt": "Sing, O Muse, of the long road home across the wine-dark sea"},
]


@dataclass
class Cluster:
    gcs: str  # for drivers: RAY_ADDRESS
    dashboard: str | None  # for the Jobs API: http://host:port
    no_dashboard: str | None = None  # why there is none

    def env(self) -> dict[str, str]:
        return {**os.environ, "RAY_ADDRESS": self.gcs}


def write_job(tmp_path: Path, name: str, prompts: list[dict] | None = None, extra_lines: dict[int, str] | None = None,
              **fields) -> Path:
    """A JSON job file plus its prompt file; ``extra_lines`` inserts raw lines (line number -> text)."""
    lines = [json.dumps(p) for p in (PROMPTS if prompts is None else prompts)]
    for lineno, text in sorted((extra_lines or {}).items()):
        lines.insert(lineno - 1, text)
    (tmp_path / f"{name}.jsonl").write_text("\n".join(lines) + "\n")
    job = {"name": name, "model": "tiny", "runtime": "reference", "input": f"{name}.jsonl",
           "output_dir": f"out-{name}", "method": "tokenswift", "max_new_tokens": 64, "ignore_eos": True,
           "checkpoint_every": 8, "sampling": {"temperature": 0.0}, "engines": {"count": 2, "cpus": 1}}
    for key, value in fields.items():
        if isinstance(value, dict) and isinstance(job.get(key), dict):
            job[key] = {**job[key], **value}
        else:
            job[key] = value
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps(job, indent=2))
    return path


def start_driver(cluster: Cluster, job_file: Path, *args: str) -> subprocess.Popen:
    """``sgl-longgen batch run`` as a user starts it, joined to the test cluster."""
    return subprocess.Popen([sys.executable, "-m", "sgl_longgen", "batch", "run", str(job_file), "--no-progress", *args],
                            env=cluster.env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def read_records(out: Path) -> list[dict]:
    path = out / "records.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
