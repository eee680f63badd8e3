"""Every SGLang piece the plugin relies on is checked, and a missing one stops the server loudly."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from types import SimpleNamespace

import pytest

from sgl_longgen.sglang import compat
from sglang_harness import engine_args, heads_path


def test_the_installed_sglang_has_everything():
    assert compat.problems(with_cpu_hooks=True) == []
    assert compat.sglang_version() in compat.SUPPORTED_SGLANG
    # The longgen backend's pieces and FlashInfer's private members, checked on GPU hosts at
    # startup, resolve here too (FlashInfer imports without a GPU).
    assert compat.gpu_stack_present()
    assert compat.missing(with_gpu=True) == []


def test_a_missing_private_member_of_flashinfer_is_named(monkeypatch):
    monkeypatch.setitem(compat.GPU_MEMBERS, "flashinfer.BatchDecodeWithPagedKVCacheWrapper",
                        ("_plan_info", "_no_such_buffer"))
    assert compat.missing(with_gpu=True) == ["flashinfer.BatchDecodeWithPagedKVCacheWrapper._no_such_buffer"]
    assert compat.missing(with_gpu=False) == []


def test_every_hook_target_is_in_the_table():
    """The plugin installs hooks only through the compat table (no target spelled elsewhere)."""
    from pathlib import Path

    import sgl_longgen.sglang as package

    for path in Path(package.__file__).parent.rglob("*.py"):
        if path.name == "compat.py":
            continue
        text = path.read_text()
        assert "HookRegistry.register(" not in text, path
        assert '"sglang.srt.' not in text, f"{path} names an SGLang target outside compat.py"


def test_a_missing_field_on_a_live_object_is_named():
    runner = SimpleNamespace(model=None, device="cpu", model_config=None, server_args=None)  # no forward
    with pytest.raises(compat.IncompatibleSGLang, match=r"types\.SimpleNamespace\.forward \(model_runner\)"):
        compat.require_fields("model_runner", runner)


def test_a_hook_that_cannot_apply_is_reported():
    table = {"x": ("sglang.srt.server_args.ServerArgs.no_such_method", "AFTER", "a test")}
    assert compat.apply_hooks({"x": lambda result, *a, **k: None}, table) == [table["x"][0]]


def _start_in_a_fresh_process(prelude: str) -> subprocess.CompletedProcess:
    """Start a TOKENSWIFT engine in a new interpreter after ``prelude`` changed SGLang."""
    args = engine_args(speculative_algorithm="TOKENSWIFT", speculative_draft_model_path=str(heads_path()))
    code = textwrap.dedent(prelude) + textwrap.dedent(f"""
        import sglang as sgl
        try:
            sgl.Engine(**{args!r})
        except ValueError as exc:
            print("REFUSED:", exc)
            raise SystemExit(3)
        raise SystemExit(0)
    """)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)


def test_a_renamed_hook_target_stops_the_server_with_its_name():
    res = _start_in_a_fresh_process("""
        import sglang.srt.server_args as server_args
        del server_args.ServerArgs._get_default_attn_backend  # as if an SGLang release renamed it
    """)
    assert res.returncode == 3, res.stdout[-2000:] + res.stderr[-3000:]
    assert "sgl-longgen supports SGLang 0.5.17" in res.stdout
    assert "missing sglang.srt.server_args.ServerArgs._get_default_attn_backend" in res.stdout


def test_an_unsupported_release_is_refused():
    res = _start_in_a_fresh_process("""
        import sgl_longgen.sglang.compat as compat
        compat.sglang_version = lambda: "0.5.99"
    """)
    assert res.returncode == 3, res.stdout[-2000:] + res.stderr[-3000:]
    assert "sglang 0.5.99 is not a supported version" in res.stdout
    assert compat.ALLOW_UNTESTED_ENV in res.stdout
