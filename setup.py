"""The build's one addition to ``pyproject.toml``: ``sgl_longgen_cpu_engine.pth`` at the top of
site-packages, so a user's own program on SGLang's CPU engine gets the ``sgl_kernel`` stand-in
before SGLang's first import (``sgl_longgen/sglang/cpu/import_hook.py``).

A wheel's top level is site-packages. A regular wheel takes it from ``build_lib``; an editable
wheel (``pip install -e``) finds the package in the source tree and holds only what is written to
the directory its install step targets (setuptools' ``editable_wheel`` points ``install_lib``
there), so that is where the file goes in editable mode.
"""

from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

PTH = Path("sgl_longgen", "sglang", "cpu", "sgl_longgen_cpu_engine.pth")


class BuildPyWithPth(build_py):
    def run(self):
        super().run()
        if self.editable_mode:
            top = self.get_finalized_command("install").install_lib
        else:
            top = self.build_lib
        self.mkpath(top)
        self.copy_file(str(PTH), str(Path(top, PTH.name)), preserve_mode=False)

    def get_outputs(self, include_bytecode=True):
        outputs = super().get_outputs(include_bytecode)
        if not self.editable_mode:
            outputs.append(str(Path(self.build_lib, PTH.name)))
        return outputs


setup(cmdclass={"build_py": BuildPyWithPth})
