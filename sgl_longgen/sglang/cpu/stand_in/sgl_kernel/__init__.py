"""Import stand-in for ``sgl_kernel`` on machines where the real one cannot load.

SGLang's CPU engine imports CPU ops from ``sgl_kernel`` at module import time, but the PyPI
wheel is CUDA-only. This package makes those imports succeed: every attribute and submodule
resolves to a placeholder that raises if it is *called*, so a run that reaches a real kernel
fails loudly instead of computing something else. sgl-longgen's PyTorch stand-ins cover the ops
a speculative run calls (``sgl_longgen.sglang.cpu``).
"""

import importlib.abc
import importlib.machinery
import sys
import types


class _Op:
    def __init__(self, name: str):
        self._name = name

    def __getattr__(self, attr: str):
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _Op(f"{self._name}.{attr}")

    def __call__(self, *args, **kwargs):
        raise RuntimeError(f"sgl_kernel op {self._name} is not available on this machine (sgl-longgen import stand-in)")


def __getattr__(name: str):
    if name.startswith("__"):
        raise AttributeError(name)
    return _Op(name)


class _SubmoduleFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path, target=None):
        if fullname.startswith("sgl_kernel."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        module = types.ModuleType(spec.name)
        module.__path__ = []
        prefix = spec.name

        def _getattr(name: str):
            if name.startswith("__"):
                raise AttributeError(name)
            return _Op(f"{prefix}.{name}")

        module.__getattr__ = _getattr
        return module

    def exec_module(self, module):
        pass


sys.meta_path.insert(0, _SubmoduleFinder())
