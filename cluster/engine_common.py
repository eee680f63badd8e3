"""What every engine kind shares: the Ray namespace, the effective generation settings, the
resume shortcut and where the actor runs.

They live apart from the engines so that an engine module depends on this one alone, never on
:mod:`.engines`: the factory there imports every engine module, and an engine importing it back
is an import cycle that holds only as long as one side keeps its import lazy.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import msgspec

from ..config import GenerateConfig, load_toml, merge
from ..errors import LonggenError
from .messages import Task

NAMESPACE = "sgl-longgen"


# The job field naming each speculative method's draft checkpoint (see JobSpec).
DRAFT_FIELD = {"tokenswift": "heads", "owl": "drafter", "howl": "drafter", "longspec": "longspec_drafter"}


def draft_dirs(model_dir: Path | None, drafts: dict[str, str | None]) -> dict[str, Path | None]:
    """Every draft directory by job field: the one the job names, else the one inside the model
    directory (embedded models ship all three), else None."""
    from ..runtime import default_drafter_dir, default_heads_dir, default_longspec_dir

    shipped = {"heads": default_heads_dir, "drafter": default_drafter_dir, "longspec_drafter": default_longspec_dir}
    return {f: Path(drafts[f]) if drafts.get(f) else (find(model_dir) if model_dir is not None else None)
            for f, find in shipped.items()}


def effective_config(generation: dict[str, Any], dirs: dict[str, Path | None]) -> GenerateConfig:
    """Built-in defaults < the heads' ``longgen.toml`` < (owl, howl, longspec) the method's drafter's
    ``longgen.toml`` < the job's settings: the layering of ``sgl-longgen generate``."""
    from ..runtime import heads_defaults_file

    def layer(base: dict[str, Any], directory: Path | None) -> dict[str, Any]:
        f = heads_defaults_file(directory)
        return merge(base, load_toml(f)) if f is not None else base

    def build(base: dict[str, Any]) -> GenerateConfig:
        try:
            return msgspec.convert(merge(base, generation), GenerateConfig)
        except msgspec.ValidationError as exc:
            raise LonggenError(f"invalid generation settings: {exc}") from None

    base = layer({}, dirs.get("heads"))
    config = build(base)
    field = DRAFT_FIELD.get(config.method)
    if field is not None and field != "heads":
        config = build(layer(base, dirs.get(field)))
    return config


def finished_early(task: Task, eos_ids: set[int], config: GenerateConfig) -> str | None:
    """A resumed task whose checkpoint already ends the generation ("length" or "stop").

    Asking an engine to continue it would generate past the end the first run already reached.
    """
    if len(task.prefix) >= task.max_new_tokens:
        return "length"
    if task.prefix and not config.ignore_eos and task.prefix[-1] in eos_ids:
        return "stop"
    return None


def ray_node() -> tuple[str, list[str]]:
    """(node, GPU ids) for the run's engine report: which machine to look at when one misbehaves."""
    try:
        import ray

        ctx = ray.get_runtime_context()
        return ctx.get_node_id()[:12], [str(g) for g in ray.get_gpu_ids()]
    except Exception:  # outside Ray (direct use in tests or tools)
        return os.uname().nodename, []
