"""Session-wide test environment.

On a machine without a GPU, SGLang runs on its CPU engine (``SGLANG_USE_CPU_ENGINE=1``); the
plugin puts its ``sgl_kernel`` stand-in in place when the real one cannot load, as it does for a
user's server. Here that happens before any test imports SGLang's modules directly.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")
    from sgl_longgen.sglang.cpu import install_stand_in

    install_stand_in()


@dataclass
class CliResult:
    returncode: int
    stdout: str
    stderr: str


@pytest.fixture
def cli(capsys):
    """``sgl-longgen ARGS`` in this process: its exit code and what it printed."""
    from sgl_longgen.cli import main

    def run(*args: str) -> CliResult:
        capsys.readouterr()
        code = main(list(args))
        out = capsys.readouterr()
        return CliResult(code, out.out, out.err)

    return run
