"""The directory behind ``--speculative-draft-model-path``: checked before the server starts.

TOKENSWIFT reads a heads checkpoint (``heads.json`` + ``heads.safetensors``), OWL and HOWL an LSTM
drafter (``owl.json`` + ``owl.safetensors``), LONGSPEC a one-block drafter (``longspec.json`` +
``longspec.safetensors``); each may carry a ``longgen.toml`` with the checkpoint's defaults (tree,
n-gram, partial KV, OWL/suffix/HOWL/LongSpec settings, penalty). SUFFIX has no checkpoint: its
directory is optional and holds only a ``longgen.toml`` (its ``[suffix]``, ``[adaptive]`` and
penalty settings). Every problem
is reported naming the file while the server is still starting, instead of as a tensor-shape
error deep inside a scheduler process. Only file headers are read here.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from ..config import GenerateConfig, convert, load_toml, with_method_defaults
from ..core.heads import check_heads
from ..core.longspec_checkpoint import check_drafter as check_longspec_drafter
from ..core.longspec_checkpoint import check_target
from ..core.longspec_checkpoint import read_drafter_config as read_longspec_config
from ..core.owl import check_drafter
from ..core.rope_config import rope_settings
from ..errors import LonggenError

DEFAULTS_FILE = "longgen.toml"


@dataclass
class DraftDir:
    path: Path | None  # None: SUFFIX without a settings directory
    checkpoint: dict  # heads.json, owl.json or longspec.json ({} for SUFFIX)
    defaults: GenerateConfig  # the server reads its method tables and sampling.penalty*


def target_config(model_path: str | Path) -> dict:
    """The target's config.json (its text part for multimodal configs); {} when unreadable here."""
    cfg = Path(model_path) / "config.json"
    try:
        data = json.loads(cfg.read_text())
    except (OSError, json.JSONDecodeError):
        return {}
    return data.get("text_config", data)


def read_defaults(path: Path) -> GenerateConfig:
    f = path / DEFAULTS_FILE
    if not f.is_file():
        return GenerateConfig()
    return convert(load_toml(f), GenerateConfig, str(f))


def _require(path: str | Path | None, algorithm: str, files: str) -> Path:
    if path is None:
        raise LonggenError(f"{algorithm} needs --speculative-draft-model-path: a directory with {files}")
    return Path(path)


def inspect_heads_draft_dir(path: str | Path | None, model_path: str | Path) -> DraftDir:
    """TOKENSWIFT: heads that fit the target and the tree of their defaults."""
    path = _require(path, "TOKENSWIFT", "heads.json and heads.safetensors")
    defaults = read_defaults(path) if path.is_dir() else GenerateConfig()
    cfg = check_heads(path, target_config(model_path).get("hidden_size"), defaults.tokenswift.num_heads)
    if defaults.tokenswift.partial_kv.granularity != "shared":
        raise LonggenError(f"{path / DEFAULTS_FILE}: [tokenswift.partial_kv] granularity = "
                           f"{defaults.tokenswift.partial_kv.granularity!r} is a reference-runtime option; SGLang's "
                           "draft forward passes one KV index list per request, so it needs \"shared\"")
    return DraftDir(path, cfg, defaults)


def inspect_owl_draft_dir(path: str | Path | None, model_path: str | Path) -> DraftDir:
    """OWL / HOWL: an LSTM drafter for the target's hidden size and vocabulary."""
    path = _require(path, "OWL", "owl.json and owl.safetensors")
    target = target_config(model_path)
    cfg = check_drafter(path, target.get("hidden_size"), target.get("vocab_size"))
    defaults = read_defaults(path)
    if defaults.owl.spec and not cfg["spec"]:
        raise LonggenError(f"{path / 'owl.json'}: the drafter was trained without [SPEC]; "
                           f"set [owl] spec = false in {path / DEFAULTS_FILE}")
    return DraftDir(path, cfg, defaults)


def longspec_target(config) -> dict:
    """What a LongSpec drafter must share with its target, keyed as in ``longspec.json``, from the
    target's HF config: a ``config.json`` mapping or a parsed config object (transformers 5 folds
    ``rope_theta`` and ``rope_scaling`` into ``rope_parameters``; either spelling is read)."""
    get = config.get if isinstance(config, dict) else (lambda key, default=None: getattr(config, key, default))
    hidden, heads = get("hidden_size"), get("num_attention_heads")
    theta, scaling = rope_settings(config)
    return {"hidden_size": hidden, "vocab_size": get("vocab_size"), "num_heads": heads,
            "num_kv_heads": get("num_key_value_heads") or heads,
            "head_dim": get("head_dim") or (hidden // heads if hidden and heads else None),
            "rope_theta": theta, "rope_scaling": scaling}


def inspect_longspec_draft_dir(path: str | Path | None, model_path: str | Path) -> DraftDir:
    """LONGSPEC: a drafter block for the target's shape and RoPE (checked against its config.json
    where the model is a local directory; the worker checks SGLang's parsed config again) and, with
    a reduced draft vocabulary, its ``token_map`` (N distinct ids inside the vocabulary, N as
    ``draft_vocab_size`` says: :func:`sgl_longgen.core.longspec_checkpoint.check_drafter`)."""
    path = _require(path, "LONGSPEC", "longspec.json and longspec.safetensors")
    target = target_config(model_path)
    if target:  # first: a drafter for another model is named as such, not by a tensor shape
        check_target(path, read_longspec_config(path), longspec_target(target))
    return DraftDir(path, check_longspec_drafter(path), read_defaults(path))


def inspect_suffix_draft_dir(path: str | Path | None, model_path: str | Path) -> DraftDir:
    """SUFFIX: no checkpoint. ``path`` (optional) is a directory whose ``longgen.toml`` holds the
    server's settings, over SUFFIX's own defaults (adaptive speculation on)."""
    data: dict = {}
    source = "SUFFIX's defaults"
    if path is not None:
        path = Path(path)
        if not path.is_dir():
            raise LonggenError(f"SUFFIX needs no draft model: --speculative-draft-model-path, when given, is a "
                               f"directory with its settings in a {DEFAULTS_FILE}; {path} is not a directory")
        f = path / DEFAULTS_FILE
        if f.is_file():
            data, source = load_toml(f), str(f)
    return DraftDir(path, {}, convert(with_method_defaults({**data, "method": "suffix"}), GenerateConfig, source))
