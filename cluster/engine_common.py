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

from ..config import GenerateConfig
from .messages import Task

NAMESPACE = "sgl-longgen"


def effective_config(generation: dict[str, Any], dirs: dict[str, Path | None]) -> GenerateConfig:
    """The job's settings over its draft checkpoints' defaults, layered as ``sgl-longgen generate``
    layers them (:func:`sgl_longgen.runtime.layered_config`)."""
    from ..runtime import layered_config

    return layered_config(dirs, generation, "of the job (generation settings)")


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
