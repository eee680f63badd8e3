"""SGLang's HTTP server of the trained ``tiny`` model, plain or with one of our algorithms, set up
for SGLang's own test kits (``sglang.test.kits``), and what those kits expect of their test case.

The kits are mixins of ``unittest`` test cases that talk to ``self.base_url`` (and read
``self.model``, ``self.process``, ``self.tokenizer`` and the request helpers of SGLang's spec-server
fixture); :func:`kit_case` builds such a case around one of our servers, so a kit's test method
runs as SGLang wrote it. The server serves a chat template (the tiny model has none), so the kits'
OpenAI chat routes work, and uses the llguidance grammar backend: xgrammar, SGLang's default,
allocates pinned memory, which SGLang's CPU engine cannot do.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import psutil
import requests

from sgl_longgen.runtime import resolve_model

PLAIN = "plain"
DRAFT_DIRS = {  # each algorithm's drafter, shipped beside the tiny model
    "TOKENSWIFT": "tokenswift-heads",
    "OWL": "owl-drafter",
    "HOWL": "owl-drafter",
    "LONGSPEC": "longspec-drafter",
    "SUFFIX": None,  # no drafter: drafts from the request's own text
}
ALGORITHMS = tuple(DRAFT_DIRS)
CONTEXT = 2048
MAX_RUNNING = 8
EOS = 1  # the tiny model's end-of-text token
STARTUP_SECONDS = 600
# On the CPU engine SGLang sizes the KV pool from the host's free memory: it must not fall below
# (1 - MEM_FRACTION) of what it was before the weights loaded, while other servers start beside
# it. The pool itself is max_total_tokens.
MEM_FRACTION = 0.25


def model_path() -> Path:
    return resolve_model("tiny")


def server_command(algorithm: str, port: int) -> list[str]:
    cmd = [
        sys.executable, "-m", "sglang.launch_server",
        "--model-path", str(model_path()),
        "--device", "cpu", "--dtype", "float32", "--attention-backend", "longgen_torch",
        "--disable-cuda-graph", "--disable-overlap-schedule",
        "--mem-fraction-static", str(MEM_FRACTION), "--max-total-tokens", str(CONTEXT * MAX_RUNNING),
        "--context-length", str(CONTEXT), "--max-running-requests", str(MAX_RUNNING),
        "--grammar-backend", "llguidance", "--chat-template", "chatml",
        "--enable-return-hidden-states", "--random-seed", "0",
        "--host", "127.0.0.1", "--port", str(port), "--log-level", "warning",
    ]
    if algorithm != PLAIN:
        cmd += ["--speculative-algorithm", algorithm]
        if DRAFT_DIRS[algorithm] is not None:
            cmd += ["--speculative-draft-model-path", str(model_path() / DRAFT_DIRS[algorithm])]
    return cmd


@dataclass
class Server:
    algorithm: str  # PLAIN or one of ALGORITHMS
    url: str
    process: subprocess.Popen
    log: Path

    def log_tail(self, chars: int = 6000) -> str:
        return self.log.read_text(errors="replace")[-chars:]

    def alive(self) -> bool:
        return self.process.poll() is None

    def scheduler_alive(self) -> bool:
        """Whether its scheduler process runs (the launcher outlives a crashed one for a while,
        its requests unanswered)."""
        try:
            children = psutil.Process(self.process.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            return False
        return any(_is_scheduler(child) for child in children)


def _is_scheduler(process: psutil.Process) -> bool:
    try:
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE and \
            "sglang::scheduler" in " ".join(process.cmdline())
    except psutil.Error:
        return False


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(algorithm: str, log_dir: Path) -> Server:
    """Start the server (as a user does: SGLANG_USE_CPU_ENGINE=1, nothing on PYTHONPATH; the
    plugin puts its sgl_kernel stand-in in place); :func:`wait_ready` waits for it."""
    port = _free_port()
    log = log_dir / f"{algorithm}.log"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["SGLANG_USE_CPU_ENGINE"] = "1"
    # llguidance's mask kernel is torch.compile'd: inductor would build it at each server's first
    # constrained request (tens of seconds of a CI core); eager, it masks the same tokens.
    env["TORCH_COMPILE_DISABLE"] = "1"
    with log.open("w") as out:
        process = subprocess.Popen(server_command(algorithm, port), stdout=out, stderr=subprocess.STDOUT,
                                   start_new_session=True, env=env)
    return Server(algorithm, f"http://127.0.0.1:{port}", process, log)


def wait_ready(server: Server) -> None:
    deadline = time.time() + STARTUP_SECONDS
    while time.time() < deadline:
        if not server.alive():
            raise RuntimeError(f"{server.algorithm} server exited with {server.process.returncode}:\n"
                               f"{server.log_tail()}")
        try:
            if requests.get(f"{server.url}/health", timeout=5).status_code == 200:
                return
        except requests.RequestException:
            pass
        time.sleep(1)
    stop(server)
    raise RuntimeError(f"{server.algorithm} server not ready after {STARTUP_SECONDS} s:\n{server.log_tail()}")


def stop(server: Server) -> None:
    """Stop the server's process group: its launcher, scheduler and detokenizer."""
    try:
        os.killpg(server.process.pid, signal.SIGTERM)
        server.process.wait(timeout=10)
    except subprocess.TimeoutExpired:
        pass
    except ProcessLookupError:
        return
    try:
        os.killpg(server.process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    server.process.wait(timeout=30)


class Launches:
    """Servers started ahead of their tests: the plain one and the first algorithm's together, then
    each next algorithm's while the tests of the one before run (their scheduler keeps one core
    busy; a starting server mostly imports on the other)."""

    def __init__(self, log_dir: Path, order: list[str]):
        self.log_dir = log_dir
        self.order = order  # the servers the selected tests use, in the order they run
        self.pending: dict[str, Server] = {}

    def start(self, algorithm: str) -> None:
        if algorithm not in self.pending:
            self.pending[algorithm] = launch(algorithm, self.log_dir)

    def take(self, algorithm: str) -> Server:
        """``algorithm``'s server, ready; the next one in :attr:`order` starts."""
        self.start(algorithm)
        server = self.pending.pop(algorithm)
        try:
            wait_ready(server)
        except BaseException:
            self.stop_pending()
            raise
        later = self.order[self.order.index(algorithm) + 1:] if algorithm in self.order else []
        if later:
            self.start(later[0])
        return server

    def stop_pending(self) -> None:
        for server in self.pending.values():
            stop(server)
        self.pending.clear()


def kit_case(kit: type, server: Server, **attributes):
    """An instance of ``unittest`` test case that mixes ``kit`` into SGLang's spec-server fixture
    (for its ``tokenizer`` and request helpers), pointed at ``server``; ``attributes`` set the
    kit's tunable class attributes. Its test methods are called directly: the fixture's own
    ``setUpClass`` (which launches a GPU server) never runs."""
    from sglang.test.server_fixtures.spec_eagle_fixture import SpecEagleServerBase

    body = dict(base_url=server.url, process=server.process, model=str(model_path()), _tokenizer=None,
                runTest=lambda self: None, **attributes)
    case = type(f"{kit.__name__}On{server.algorithm.title()}", (kit, SpecEagleServerBase), body)
    return case("runTest")
