"""The ``sgl_kernel`` stand-in in a user's own program on SGLang's CPU engine.

``sgl.Engine`` imports SGLang's modules, which import ``sgl_kernel``, before it loads the
plugins of the ``sglang.srt.plugins`` entry point: the plugin's own call of
:func:`~sgl_longgen.sglang.cpu.install_stand_in` comes too late for a program that starts
SGLang itself. So the package ships ``sgl_longgen_cpu_engine.pth`` (put at the top of
site-packages by the build, see ``setup.py``): in a Python process started with
``SGLANG_USE_CPU_ENGINE`` set, it calls :func:`arm`, which puts a finder at the head of
``sys.meta_path`` that waits for the first import of ``sglang``. That import then puts the
stand-in in place (where the installed ``sgl_kernel`` cannot load) before SGLang's first module
runs, and the finder steps aside.

Any other process pays one environment lookup at startup; one with the variable set pays for
this module and, once it imports SGLang, for the import of ``sgl_kernel`` that SGLang would make
anyway. A working ``sgl_kernel`` (a GPU machine, a CPU build) is never replaced.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys

from . import cpu_engine, install_stand_in


class _StandInFirst(importlib.abc.Loader):
    """``sglang``'s own loader, with the stand-in put in place just before the package runs."""

    def __init__(self, loader):
        self.loader = loader

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module) -> None:
        # The module looks as if its own loader had imported it.
        module.__loader__ = self.loader
        if module.__spec__ is not None:
            module.__spec__.loader = self.loader
        install_stand_in()
        self.loader.exec_module(module)


class FirstSGLangImport(importlib.abc.MetaPathFinder):
    """Finds nothing itself: on the first ``import sglang`` it steps aside and hands the import on
    to the finder that owns it, with :class:`_StandInFirst` around that finder's loader."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname != "sglang":
            return None
        disarm()
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None:
            return spec
        spec.loader = _StandInFirst(spec.loader)
        return spec


def armed() -> bool:
    return any(isinstance(finder, FirstSGLangImport) for finder in sys.meta_path)


def arm() -> None:
    """Under ``SGLANG_USE_CPU_ENGINE``, the first import of ``sglang`` puts the stand-in in place
    (see the module's docstring). Idempotent; nothing once SGLang is imported."""
    if not cpu_engine() or "sglang" in sys.modules or armed():
        return
    sys.meta_path.insert(0, FirstSGLangImport())


def disarm() -> None:
    sys.meta_path[:] = [finder for finder in sys.meta_path if not isinstance(finder, FirstSGLangImport)]
