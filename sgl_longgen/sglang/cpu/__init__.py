"""SGLang's CPU engine without ``sgl_kernel``'s CPU build.

SGLang runs on a machine without a GPU with ``SGLANG_USE_CPU_ENGINE=1``, but its modules import
CPU ops from ``sgl_kernel`` at import time and the PyPI wheel is CUDA-only (it needs libcuda).
Where that import fails, :func:`install_stand_in` puts an import stand-in in its place
(``stand_in/sgl_kernel``: every op resolves to a placeholder that raises if called), in this
process and, through ``PYTHONPATH``, in the processes SGLang spawns. It runs at SGLang's first
import in every process started with ``SGLANG_USE_CPU_ENGINE`` set (:mod:`.import_hook`, through the
``.pth`` file the package installs: a user's own program needs no set-up), and again when the
plugin installs. The three ops a speculative run calls get PyTorch stand-ins (:mod:`.ops`),
installed as hooks by the plugin.
"""

from __future__ import annotations

import importlib
import os
import sys
from pathlib import Path

STAND_IN = Path(__file__).parent / "stand_in"


def cpu_engine() -> bool:
    return os.environ.get("SGLANG_USE_CPU_ENGINE", "").lower() in ("1", "true", "yes")


def kernels_load() -> bool:
    """The installed ``sgl_kernel`` imports here (a GPU machine, or a CPU build)."""
    if "sgl_kernel" in sys.modules and getattr(sys.modules["sgl_kernel"], "__file__", None):
        return not str(sys.modules["sgl_kernel"].__file__).startswith(str(STAND_IN))
    try:
        importlib.import_module("sgl_kernel")
        return True
    except Exception:  # noqa: BLE001 - ImportError, OSError (libcuda.so.1)
        for name in [m for m in sys.modules if m == "sgl_kernel" or m.startswith("sgl_kernel.")]:
            del sys.modules[name]
        return False


def install_stand_in() -> bool:
    """Under ``SGLANG_USE_CPU_ENGINE=1``, stand in for an ``sgl_kernel`` that cannot load.

    Returns whether the stand-in is in place. Idempotent; a working ``sgl_kernel`` is never
    replaced.
    """
    if not cpu_engine():
        return False
    path = str(STAND_IN)
    if path in sys.path:
        return True
    if kernels_load():
        return False
    sys.path.insert(0, path)
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (path, os.environ.get("PYTHONPATH")) if p)
    return True
