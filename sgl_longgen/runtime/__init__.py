"""The reference runtime: a small pure-PyTorch engine running the same algorithms on CPU.

It is the losslessness oracle for the tests, the embedded default behind ``sgl-longgen generate``
and ``demo``, and the home of training code.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..config import METHOD_DEFAULTS, GenerateConfig, convert, load_toml, merge
from ..core.heads import load_heads
from ..core.longspec_checkpoint import load_drafter as load_longspec_drafter
from ..core.longspec_checkpoint import target_settings
from ..core.owl import CONFIG_FILE as DRAFTER_CONFIG_FILE
from ..core.owl import load_drafter
from ..errors import LonggenError
from .checkpoint import LoadedModel, load_model
from .decoder import ARDecoder, Decoder, GenerationResult
from .embedded import (
    DEFAULTS_FILE,
    DRAFTER_SUBDIR,
    HEADS_SUBDIR,
    LONGSPEC_SUBDIR,
    resolve_model,
)
from .longspec import LongSpecDecoder
from .owl import HowlDecoder, OwlDecoder
from .suffix import SuffixDecoder
from .tokenswift import TokenSwiftDecoder

__all__ = [
    "ARDecoder", "Decoder", "GenerationResult", "HowlDecoder", "LoadedModel", "LongSpecDecoder", "OwlDecoder",
    "DRAFT_FIELD", "SuffixDecoder", "TokenSwiftDecoder", "build_decoder", "default_drafter_dir", "default_heads_dir",
    "default_longspec_dir", "draft_dirs", "layered_config",
    "load_model", "resolve_model",
]


def default_heads_dir(model_dir: Path) -> Path | None:
    """Heads shipped inside a model directory (embedded models have them)."""
    d = Path(model_dir) / HEADS_SUBDIR
    return d if d.is_dir() else None


def heads_defaults_file(heads_dir: Path | None) -> Path | None:
    """The ``longgen.toml`` beside a heads checkpoint: per-checkpoint defaults."""
    if heads_dir is None:
        return None
    f = Path(heads_dir) / DEFAULTS_FILE
    return f if f.is_file() else None


def default_drafter_dir(model_dir: Path | None) -> Path | None:
    """The OWL drafter shipped inside a model directory (embedded models have a random-init one)."""
    if model_dir is None:
        return None
    d = Path(model_dir) / DRAFTER_SUBDIR
    return d if d.is_dir() else None


def default_longspec_dir(model_dir: Path | None) -> Path | None:
    """The LongSpec drafter shipped inside a model directory (embedded models have one)."""
    if model_dir is None:
        return None
    d = Path(model_dir) / LONGSPEC_SUBDIR
    return d if d.is_dir() else None


# The draft checkpoint each speculative method reads, by the name `generate` (--heads, --drafter,
# --longspec-drafter) and batch jobs give its directory.
DRAFT_FIELD = {"tokenswift": "heads", "owl": "drafter", "howl": "drafter", "longspec": "longspec_drafter"}


def draft_dirs(model_dir: Path | None, given: dict[str, Any]) -> dict[str, Path | None]:
    """Every draft directory by field: the one given, else the one inside the model directory
    (embedded models ship all three), else None."""
    shipped = {"heads": default_heads_dir, "drafter": default_drafter_dir, "longspec_drafter": default_longspec_dir}
    return {f: Path(given[f]) if given.get(f) else (find(model_dir) if model_dir is not None else None)
            for f, find in shipped.items()}


def layered_config(dirs: dict[str, Path | None], settings: dict[str, Any], source: str) -> GenerateConfig:
    """Built-in defaults < the method's own (:data:`~sgl_longgen.config.METHOD_DEFAULTS`) < the
    heads' ``longgen.toml`` < (owl, howl, longspec) the method's drafter's ``longgen.toml`` <
    ``settings``. The heads ship with the model, so their defaults hold for every method; a
    drafter's only for the methods that draft with it, and the method is known only once the lower
    layers are read."""
    def layer(base: dict[str, Any], directory: Path | None) -> dict[str, Any]:
        f = heads_defaults_file(directory)
        return merge(base, load_toml(f)) if f is not None else base

    base = layer({}, dirs.get("heads"))
    config = convert(merge(base, settings), GenerateConfig, source)
    own = METHOD_DEFAULTS.get(config.method, {})
    field = DRAFT_FIELD.get(config.method)
    drafter = dirs.get(field) if field is not None and field != "heads" else None
    if own or heads_defaults_file(drafter) is not None:
        config = convert(merge(layer(merge(own, base), drafter), settings), GenerateConfig, source)
    return config


def build_decoder(loaded: LoadedModel, config: GenerateConfig, heads_dir: Path | None = None,
                  drafter_dir: Path | None = None, longspec_dir: Path | None = None) -> Decoder:
    if config.method == "ar":
        return ARDecoder(loaded, config)
    if config.method == "tokenswift":
        heads_dir = heads_dir or default_heads_dir(loaded.path)
        if heads_dir is None:
            raise LonggenError(
                f"tokenswift needs draft heads: pass --heads DIR (none found in {loaded.path / HEADS_SUBDIR}; "
                "train them with `sgl-longgen train heads`)"
            )
        heads = load_heads(heads_dir, hidden_size=loaded.config.hidden_size, num_heads=config.tokenswift.num_heads)
        return TokenSwiftDecoder(loaded, config, heads)
    if config.method in ("owl", "howl"):
        drafter_dir = drafter_dir or default_drafter_dir(loaded.path)
        if drafter_dir is None:
            where = f" (none found in {Path(loaded.path) / DRAFTER_SUBDIR})" if loaded.path is not None else ""
            raise LonggenError(f"{config.method} needs an OWL drafter: pass --drafter DIR{where}; "
                               "train one with `sgl-longgen train owl`")
        drafter = load_drafter(drafter_dir, hidden_size=loaded.config.hidden_size, vocab_size=loaded.config.vocab_size)
        if config.owl.spec and not drafter.spec:
            raise LonggenError(f"the OWL drafter in {drafter_dir} was trained without [SPEC] "
                               f"({Path(drafter_dir) / DRAFTER_CONFIG_FILE}); set owl.spec = false")
        cls = OwlDecoder if config.method == "owl" else HowlDecoder
        return cls(loaded, config, drafter)
    if config.method == "suffix":
        return SuffixDecoder(loaded, config)
    if config.method == "longspec":
        longspec_dir = longspec_dir or default_longspec_dir(loaded.path)
        if longspec_dir is None:
            where = f" (none found in {Path(loaded.path) / LONGSPEC_SUBDIR})" if loaded.path is not None else ""
            raise LonggenError(f"longspec needs a LongSpec drafter: pass --longspec-drafter DIR{where}; "
                               "train one with `sgl-longgen train longspec`")
        drafter = load_longspec_drafter(longspec_dir, target_settings(loaded.config))
        return LongSpecDecoder(loaded, config, drafter)
    raise LonggenError(f"unknown method {config.method!r}")
