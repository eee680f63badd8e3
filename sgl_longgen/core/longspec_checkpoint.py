"""A LongSpec drafter checkpoint read back: its ``longspec.json`` checked, its weights' shapes and
token map checked from the file headers, the target it was built for checked, and the block loaded.

The drafter's queries meet the target's last-layer keys, so a checkpoint records the target's
shapes and RoPE (:func:`target_settings`) and a target whose are other refuses it, with one error
naming the file (:func:`check_target`). :meth:`~.longspec.LongSpecDrafter.save` writes it.
"""

from __future__ import annotations

from pathlib import Path

import torch

from ..errors import LonggenError
from .draft_vocab import check_token_map_file
from .longspec import CONFIG_FILE, FORMAT, VERSION, WEIGHTS_FILE, LongSpecDrafter, build_drafter
from .rope_config import rope_scaling_key
from .weights import (
    check_shapes,
    expected_shapes,
    header_shapes,
    read_config,
    read_weights,
)

# The target's settings a drafter must share: the shapes it reads (embedding rows, K/V heads of
# the last layer) and the RoPE its queries must carry to meet the target's keys.
TARGET_FIELDS = ("hidden_size", "vocab_size", "num_heads", "num_kv_heads", "head_dim", "rope_theta", "rope_scaling")


def target_settings(cfg) -> dict:
    """What a drafter must share with a target (a runtime ``ModelConfig``), keyed as in ``longspec.json``."""
    return {"hidden_size": cfg.hidden_size, "vocab_size": cfg.vocab_size, "num_heads": cfg.num_attention_heads,
            "num_kv_heads": cfg.n_kv_heads, "head_dim": cfg.dim_head, "rope_theta": float(cfg.rope_theta),
            "rope_scaling": cfg.rope_scaling}


def _positive_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def read_drafter_config(directory: str | Path) -> dict:
    cfg = read_config(directory, CONFIG_FILE, FORMAT, VERSION, "LongSpec drafter")
    cfg_path = Path(directory) / CONFIG_FILE
    for key in ("hidden_size", "vocab_size", "num_heads", "num_kv_heads", "head_dim", "intermediate_size", "window"):
        if not _positive_int(cfg.get(key)):
            raise LonggenError(f"{cfg_path}: '{key}' must be a positive integer")
    if cfg["num_heads"] % cfg["num_kv_heads"]:
        raise LonggenError(f"{cfg_path}: 'num_heads' must be a multiple of 'num_kv_heads'")
    for key in ("rope_theta", "norm_eps"):
        value = cfg.get(key)
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 0:
            raise LonggenError(f"{cfg_path}: '{key}' must be a positive number")
    if cfg.get("rope_scaling") is not None and not isinstance(cfg["rope_scaling"], dict):
        raise LonggenError(f"{cfg_path}: 'rope_scaling' must be a table or null")
    if "draft_vocab_size" in cfg and not (_positive_int(cfg["draft_vocab_size"])
                                          and cfg["draft_vocab_size"] <= cfg["vocab_size"]):
        raise LonggenError(f"{cfg_path}: 'draft_vocab_size' must be an integer in [1, vocab_size = "
                           f"{cfg['vocab_size']}], got {cfg['draft_vocab_size']!r}")
    return cfg


def check_target(directory: str | Path, cfg: dict, target: dict) -> None:
    """The drafter (``cfg``: its ``longspec.json``) was built for ``target`` (see
    :func:`target_settings`): its queries meet the target's last-layer keys, so the shapes and the
    RoPE must be the target's (theta as a number, scaling in one spelling). One error naming the file."""
    for key, want in target.items():
        have = cfg.get(key)
        if key == "rope_theta":
            same = have is not None and want is not None and float(have) == float(want)
        elif key == "rope_scaling":
            same = rope_scaling_key(have) == rope_scaling_key(want)
        else:
            same = have == want
        if not same:
            raise LonggenError(f"LongSpec drafter in {directory} was built for {key} = {have!r} but the model's is "
                               f"{want!r} ({Path(directory) / CONFIG_FILE})")


def check_drafter(directory: str | Path, target: dict | None = None) -> dict:
    """Validate a drafter checkpoint (file headers only) and, given ``target`` (see
    :func:`target_settings`), that it was built for that target: one error naming the file."""
    directory = Path(directory)
    cfg = read_drafter_config(directory)
    cfg_path = directory / CONFIG_FILE
    check_target(directory, cfg, target or {})
    weights = directory / WEIGHTS_FILE
    check_shapes(header_shapes(weights), expected_shapes(lambda: build_drafter(cfg)), weights, cfg_path, exact=True)
    check_token_map_file(weights, cfg, cfg_path)
    return cfg


def load_drafter(directory: str | Path, target: dict | None = None, dtype: torch.dtype = torch.float32
                 ) -> LongSpecDrafter:
    """Load a drafter checkpoint after :func:`check_drafter`."""
    directory = Path(directory)
    cfg = check_drafter(directory, target)
    drafter = build_drafter(cfg)
    drafter.load_state_dict(read_weights(directory / WEIGHTS_FILE))
    return drafter.to(dtype).eval().requires_grad_(False)
