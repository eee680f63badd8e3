"""Session-wide test environment.

On a machine without a GPU, SGLang runs on its CPU engine (``SGLANG_USE_CPU_ENGINE=1``) with a
test-only import shim for ``sgl_kernel`` (``tests/shim``), whose PyPI wheel needs CUDA. Both must
be in place before anything imports SGLang, and must reach the processes SGLang spawns.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

SHIM = Path(__file__).parent / "shim"

if not torch.cuda.is_available():
    os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")
    sys.path.insert(0, str(SHIM))
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(SHIM), os.environ.get("PYTHONPATH")) if p)
