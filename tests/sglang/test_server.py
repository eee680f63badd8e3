"""TOKENSWIFT behind SGLang's own HTTP server: native and OpenAI routes, and a frontend program."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import pytest
import requests

from sglang_harness import CONTEXT, heads_path, model_path


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server():
    port = _free_port()
    cmd = [
        sys.executable, "-m", "sglang.launch_server",
        "--model-path", str(model_path()),
        "--speculative-algorithm", "TOKENSWIFT",
        "--speculative-draft-model-path", str(heads_path()),
        "--disable-overlap-schedule",
        "--device", "cpu", "--dtype", "float32", "--attention-backend", "longgen_torch",
        "--disable-cuda-graph", "--mem-fraction-static", "0.05", "--max-total-tokens", "16384",
        "--context-length", str(CONTEXT), "--max-running-requests", "4",
        "--host", "127.0.0.1", "--port", str(port), "--log-level", "warning",
    ]
    # As a user starts it: SGLANG_USE_CPU_ENGINE=1 and nothing on PYTHONPATH; the plugin puts its
    # sgl_kernel stand-in in place.
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["SGLANG_USE_CPU_ENGINE"] = "1"
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True, env=env)
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 600
    try:
        while time.time() < deadline:
            if proc.poll() is not None:
                pytest.fail(f"server exited with {proc.returncode}:\n{proc.stdout.read()[-5000:]}")
            try:
                if requests.get(f"{url}/health", timeout=5).status_code == 200:
                    break
            except requests.RequestException:
                pass
            time.sleep(2)
        else:
            pytest.fail("server did not become healthy in time")
        yield url
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)


PROMPT = "def fibonacci(n):\n    "


def test_generate_route(server):
    body = {"text": PROMPT, "sampling_params": {"max_new_tokens": 48, "temperature": 0, "ignore_eos": True}}
    res = requests.post(f"{server}/generate", json=body, timeout=300)
    assert res.status_code == 200, res.text
    out = res.json()
    assert out["meta_info"]["completion_tokens"] == 48
    assert out["meta_info"]["spec_accept_length"] > 1.0
    assert isinstance(out["text"], str)


def test_openai_completions_route(server):
    body = {"model": "default", "prompt": PROMPT, "max_tokens": 32, "temperature": 0}
    res = requests.post(f"{server}/v1/completions", json=body, timeout=300)
    assert res.status_code == 200, res.text
    out = res.json()
    assert out["usage"]["completion_tokens"] <= 32
    # Greedy: the OpenAI route and the native route agree.
    native = requests.post(f"{server}/generate", json={
        "text": PROMPT, "sampling_params": {"max_new_tokens": 32, "temperature": 0}}, timeout=300).json()
    assert out["choices"][0]["text"] == native["text"]


def test_frontend_program(server):
    import sglang as sgl

    @sgl.function
    def complete(s, code):
        s += code
        s += sgl.gen("body", max_tokens=24, temperature=0)

    backend = sgl.RuntimeEndpoint(server)
    state = complete.run(code=PROMPT, backend=backend)
    native = requests.post(f"{server}/generate", json={
        "text": PROMPT, "sampling_params": {"max_new_tokens": 24, "temperature": 0}}, timeout=300).json()
    assert state["body"] == native["text"]


def test_context_overflow_is_refused(server):
    body = {"input_ids": [256] + [7] * (CONTEXT - 10), "sampling_params": {"max_new_tokens": 100}}
    res = requests.post(f"{server}/generate", json=body, timeout=300)
    assert res.status_code == 400
    assert "context" in res.text.lower() or "length" in res.text.lower()


def test_token_ids_outside_the_vocabulary_are_refused_and_the_server_keeps_serving(server):
    body = {"input_ids": [0, 99999], "sampling_params": {"max_new_tokens": 8}}
    res = requests.post(f"{server}/generate", json=body, timeout=300)
    assert res.status_code == 400, res.text
    assert "input_ids[1] = 99999" in res.text
    res = requests.post(f"{server}/generate", json={"input_ids": [0, -3], "sampling_params": {}}, timeout=300)
    assert res.status_code == 400 and "input_ids[1] = -3" in res.text
    good = requests.post(f"{server}/generate", json={
        "text": PROMPT, "sampling_params": {"max_new_tokens": 16, "temperature": 0, "ignore_eos": True}}, timeout=300)
    assert good.status_code == 200 and good.json()["meta_info"]["completion_tokens"] == 16


def test_bad_request_settings_are_refused_and_the_server_keeps_serving(server):
    """A value the scheduler would meet inside a step (the contextual penalty's, say) is a 400 naming it."""
    for params, named in (({"custom_params": {"penalty": "abc"}}, "custom_params.penalty"),
                          ({"custom_params": {"longgen_typo": 1}}, "custom_params.longgen_typo"),
                          ({"temperature": "hot"}, "sampling_params.temperature")):
        body = {"input_ids": [256, 100, 101], "sampling_params": {"max_new_tokens": 4, **params}}
        res = requests.post(f"{server}/generate", json=body, timeout=300)
        assert res.status_code == 400, res.text
        assert named in res.text
    good = requests.post(f"{server}/generate", json={
        "text": PROMPT, "sampling_params": {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True,
                                            "custom_params": {"penalty": 1.2, "penalty_window": 16}}}, timeout=300)
    assert good.status_code == 200 and good.json()["meta_info"]["completion_tokens"] == 8
