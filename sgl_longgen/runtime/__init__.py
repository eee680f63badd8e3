"""The reference runtime: a small pure-PyTorch engine running the same algorithms on CPU.

It is the losslessness oracle for the tests, the embedded default behind ``sgl-longgen generate``
and ``demo``, and the home of training code.
"""

from __future__ import annotations

from pathlib import Path

from ..config import GenerateConfig
from ..core.heads import load_heads
from ..errors import LonggenError
from .checkpoint import LoadedModel, load_model
from .decoder import ARDecoder, Decoder, GenerationResult
from .embedded import DEFAULTS_FILE, HEADS_SUBDIR, resolve_model
from .tokenswift import TokenSwiftDecoder

__all__ = [
    "ARDecoder", "Decoder", "GenerationResult", "LoadedModel", "TokenSwiftDecoder",
    "build_decoder", "default_heads_dir", "load_model", "resolve_model",
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


def build_decoder(loaded: LoadedModel, config: GenerateConfig, heads_dir: Path | None = None) -> Decoder:
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
    raise LonggenError(f"unknown method {config.method!r}")
