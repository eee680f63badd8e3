"""A user's own program on SGLang's CPU engine needs nothing but the installed package.

The program runs as a subprocess from a clean environment (no ``PYTHONPATH``, none of this test
session's set-up, its own directory as the working one): ``import sglang as sgl``, then
``sgl.Engine`` with TOKENSWIFT, as the README's Python example does. SGLang imports
``sgl_kernel`` before it loads plugins, so this works only through the ``.pth`` file the package
installs (``sgl_longgen/sglang/cpu/import_hook.py``); an environment installed before that file
existed fails here with ``sgl_kernel``'s ImportError (install the package again).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

from sglang_harness import PROMPTS, greedy, heads_path, model_path

NEW_TOKENS = 6

PROGRAM = textwrap.dedent("""
    import json
    import sys

    import sglang as sgl


    def main():
        model, heads, prompt, params = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), json.loads(sys.argv[4])
        engine = sgl.Engine(model_path=model, speculative_algorithm="TOKENSWIFT", speculative_draft_model_path=heads,
                            attention_backend="longgen_torch", device="cpu", dtype="float32", disable_cuda_graph=True,
                            mem_fraction_static=0.05, max_total_tokens=16384, skip_tokenizer_init=True,
                            log_level="error")
        out = engine.generate(input_ids=prompt, sampling_params=params)
        print("OUTPUT", json.dumps(out["output_ids"]))
        engine.shutdown()


    if __name__ == "__main__":
        main()
""")


def clean_env(**extra: str) -> dict:
    """What a user's shell would hold: no PYTHONPATH (the test session's stand-in path), nothing of ours."""
    env = {"PATH": os.environ["PATH"], "HOME": os.environ.get("HOME", "/tmp")}
    for key in ("SGLANG_LONGGEN_HOME", "OMP_NUM_THREADS"):
        if key in os.environ:
            env[key] = os.environ[key]
    env.update(extra)
    return env


def test_engine_in_a_user_program(plain_engine, tmp_path):
    script = tmp_path / "program.py"
    script.write_text(PROGRAM)
    prompt, params = PROMPTS[1], greedy(NEW_TOKENS)
    proc = subprocess.run([sys.executable, str(script), str(model_path()), str(heads_path()), json.dumps(prompt),
                           json.dumps(params)], cwd=tmp_path, env=clean_env(SGLANG_USE_CPU_ENGINE="1"),
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    lines = [line for line in proc.stdout.splitlines() if line.startswith("OUTPUT ")]
    assert len(lines) == 1, proc.stdout[-2000:]
    got = json.loads(lines[0].removeprefix("OUTPUT "))
    want = plain_engine.generate(input_ids=prompt, sampling_params=params)["output_ids"]
    assert got == want and len(got) == NEW_TOKENS


def test_other_processes_pay_a_lookup(tmp_path):
    """Without ``SGLANG_USE_CPU_ENGINE`` nothing of ours is imported at startup; with it, only the
    finder waiting for SGLang's first import (not torch, not SGLang)."""
    probe = ("import sys; print(json.dumps([m in sys.modules for m in ('sgl_longgen', 'torch', 'sglang')] + "
             "[type(f).__name__ for f in sys.meta_path]))")
    outputs = []
    for extra in ({}, {"SGLANG_USE_CPU_ENGINE": "1"}):
        proc = subprocess.run([sys.executable, "-c", "import json; " + probe], cwd=tmp_path, env=clean_env(**extra),
                              capture_output=True, text=True, timeout=120, check=True)
        outputs.append(json.loads(proc.stdout))
    plain, cpu = outputs
    assert plain[:3] == [False, False, False] and "FirstSGLangImport" not in plain[3:]
    assert cpu[:3] == [True, False, False] and "FirstSGLangImport" in cpu[3:]
