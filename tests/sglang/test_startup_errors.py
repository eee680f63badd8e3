"""A bad draft directory stops startup, naming the file, before any SGLang process is spawned."""

from __future__ import annotations

import shutil

import pytest

from sgl_longgen.core.heads import TokenSwiftHeads
from sglang_harness import engine_args, heads_path, heads_with


def start(draft_dir):
    import sglang as sgl

    return sgl.Engine(**engine_args(speculative_algorithm="TOKENSWIFT", speculative_draft_model_path=str(draft_dir)))


def test_missing_directory(tmp_path):
    with pytest.raises(ValueError, match="heads directory not found"):
        start(tmp_path / "nope")


def test_missing_weights_file(tmp_path):
    shutil.copytree(heads_path(), tmp_path / "heads")
    (tmp_path / "heads" / "heads.safetensors").unlink()
    with pytest.raises(ValueError, match="heads.safetensors"):
        start(tmp_path / "heads")


def test_missing_config_file(tmp_path):
    shutil.copytree(heads_path(), tmp_path / "heads")
    (tmp_path / "heads" / "heads.json").unlink()
    with pytest.raises(ValueError, match="heads.json"):
        start(tmp_path / "heads")


def test_heads_of_another_model(tmp_path):
    TokenSwiftHeads(64, 3).save(tmp_path / "heads")
    with pytest.raises(ValueError, match=r"have hidden size 64 but the model's is 128 \(.*heads.json\)"):
        start(tmp_path / "heads")


def test_weights_that_do_not_match_their_config(tmp_path):
    shutil.copytree(heads_path(), tmp_path / "heads")
    TokenSwiftHeads(64, 3).save(tmp_path / "other")
    shutil.copy(tmp_path / "other" / "heads.safetensors", tmp_path / "heads" / "heads.safetensors")
    with pytest.raises(ValueError, match=r"heads.safetensors: tensor heads.0.norm_in.weight has shape"):
        start(tmp_path / "heads")


def test_invalid_defaults_file(tmp_path):
    heads_with(tmp_path / "heads", "[tokenswift.partial_kv]\nbudget = 0\n")
    with pytest.raises(ValueError, match=r"longgen.toml.*budget"):
        start(tmp_path / "heads")


def test_launch_server_stops_with_the_message(tmp_path):
    import subprocess
    import sys

    from sglang_harness import model_path

    res = subprocess.run(
        [sys.executable, "-m", "sglang.launch_server", "--model-path", str(model_path()), "--device", "cpu",
         "--speculative-algorithm", "TOKENSWIFT", "--speculative-draft-model-path", str(tmp_path / "nope")],
        capture_output=True, text=True, timeout=600,
    )
    assert res.returncode != 0
    assert f"TOKENSWIFT: heads directory not found: {tmp_path / 'nope'}" in res.stderr


def test_paged_kv_pools_are_refused():
    import sglang as sgl

    with pytest.raises(ValueError, match="TOKENSWIFT needs --page-size 1"):
        sgl.Engine(**engine_args(speculative_algorithm="TOKENSWIFT", speculative_draft_model_path=str(heads_path()),
                                 page_size=16))


def test_per_head_partial_kv_is_refused_naming_the_file(tmp_path):
    heads_with(tmp_path / "heads", '[tokenswift.partial_kv]\ngranularity = "head"\n')
    with pytest.raises(ValueError, match=r"longgen.toml: \[tokenswift.partial_kv\] granularity = 'head'"):
        start(tmp_path / "heads")


@pytest.mark.parametrize("backend", ["fa3", "torch_native", "triton"])
def test_attention_backends_that_cannot_verify_our_trees_are_refused(backend):
    import sglang as sgl

    with pytest.raises(ValueError, match=rf"TOKENSWIFT runs with --attention-backend longgen, flashinfer, "
                                         rf"longgen_torch \(or none: SGLang's choice\), not {backend}"):
        sgl.Engine(**engine_args(speculative_algorithm="TOKENSWIFT", speculative_draft_model_path=str(heads_path()),
                                 attention_backend=backend))
