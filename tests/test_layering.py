"""The package's layers, read from its source: every import of every module, those inside functions
included (a lazy import is a dependency all the same), parsed with ``ast``.

* ``core/`` is the algorithm, engine-agnostic: it imports nothing of the engines (``runtime``,
  ``sglang``), the device kernels (``kernels``), training, the commands, the Ray cluster code or
  the GPU tools (``bench``). Device-specific code that runs core's pieces (an engine's graphable
  step, the fp8 GEMM's dispatch) lives in ``kernels/``, which may use core's types;
* ``kernels/`` imports nothing of the engines: either engine runs its kernels;
* SGLang is imported only by the SGLang adapter, ``sgl_longgen/sglang/`` (so the reference
  runtime, the core, training and the commands work without it loaded), save for the exceptions
  named in :data:`IMPORTS_SGLANG_OUTSIDE_THE_ADAPTER` with their reason;
* every module that quantizes a drafter to fp8 imports, itself or through its imports, the
  kernel layer's fp8 GEMM dispatch (``kernels/fp8_linear.py``), which installs itself into
  ``core.fp8`` on import: the core cannot import it, so without it an engine's fp8 drafter would
  multiply through the PyTorch twin on a GPU.

The packages are those ``pyproject.toml`` maps into the ``sgl_longgen`` namespace (``kernels/``
and ``cluster/`` are top-level folders of the repository).
"""

from __future__ import annotations

import ast
import tomllib
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

CORE_MUST_NOT_IMPORT = ("kernels", "sglang", "runtime", "training", "commands", "cluster", "bench")
KERNELS_MUST_NOT_IMPORT = ("sglang", "runtime")

# Modules outside sgl_longgen/sglang/ that import SGLang, and why each must.
IMPORTS_SGLANG_OUTSIDE_THE_ADAPTER = {
    "sgl_longgen.bench.engine_check": "a GPU tool that reads SGLang's attention-backend registry itself, to ask "
                                      "whether the installed plugin entry points (not a helper of ours that "
                                      "registers the backend) register longgen",
}

FP8_GEMM_DISPATCH = "sgl_longgen.kernels.fp8_linear"


@cache
def package_dirs() -> dict[str, Path]:
    """Package name -> folder, as ``pyproject.toml`` maps them."""
    setup = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    return {name: ROOT / folder for name, folder in setup["package-dir"].items()}


@cache
def modules() -> dict[str, tuple[Path, bool]]:
    """Module name -> (source file, is a package's ``__init__``), for every module of the package."""
    dirs = package_dirs()
    found = {}
    for package, folder in dirs.items():
        for path in sorted(folder.rglob("*.py")):
            parts = list(path.relative_to(folder).with_suffix("").parts)
            inner = ".".join([package] + parts[:1])
            if inner in dirs and inner != package:  # a sub-package mapped from a folder of its own
                continue
            init = parts[-1] == "__init__"
            name = ".".join([package] + (parts[:-1] if init else parts))
            found[name] = (path, init)
    return found


def _absolute(module: str, is_init: bool, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    package = module.split(".") if is_init else module.split(".")[:-1]
    base = package[: len(package) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


@cache
def imports(module: str) -> frozenset[str]:
    """Every module name ``module`` imports, anywhere in its file: ``import a.b`` gives ``a.b``;
    ``from a import b`` gives ``a`` and ``a.b`` (b may be a module); ``importlib.import_module``
    and ``__import__`` of a literal name give that name."""
    path, is_init = modules()[module]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = _absolute(module, is_init, node)
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names if alias.name != "*")
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant) \
                and isinstance(node.args[0].value, str):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
            if name in ("import_module", "__import__"):
                found.add(node.args[0].value)
    return frozenset(found)


def _within(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


def offenders(importer: str, forbidden: tuple[str, ...]) -> list[str]:
    """``module: imported name`` for each import by a module inside ``importer`` of a name inside
    one of the ``forbidden`` packages (names given relative to ``sgl_longgen``)."""
    bad = []
    for module in modules():
        if _within(module, importer):
            for name in sorted(imports(module)):
                if any(_within(name, f"sgl_longgen.{f}") for f in forbidden):
                    bad.append(f"{module}: {name}")
    return bad


def test_the_package_is_all_found():
    """The scan sees every layer (a mapping it misread would make the other tests vacuous)."""
    found = modules()
    for name in ("sgl_longgen.core.longspec", "sgl_longgen.core.fp8", "sgl_longgen.kernels.longspec_step",
                 "sgl_longgen.sglang.worker", "sgl_longgen.runtime.decoder", "sgl_longgen.cluster.spec",
                 "sgl_longgen.training.longspec"):
        assert name in found, name
    # relative imports resolved against the mapped folders, those inside functions included
    assert "sgl_longgen.core.owl" in imports("sgl_longgen.kernels.owl_beam")
    assert "sgl_longgen.kernels.custom_ops" in imports("sgl_longgen.kernels.fp8_linear")  # inside fp8_linear()


def test_core_imports_no_engine_kernel_or_tool():
    assert offenders("sgl_longgen.core", CORE_MUST_NOT_IMPORT) == []


def test_kernels_import_no_engine():
    assert offenders("sgl_longgen.kernels", KERNELS_MUST_NOT_IMPORT) == []


def test_only_the_sglang_adapter_imports_sglang():
    outside = {module for module in modules()
               if not _within(module, "sgl_longgen.sglang")
               and any(_within(name, "sglang") for name in imports(module))}
    assert outside == set(IMPORTS_SGLANG_OUTSIDE_THE_ADAPTER)


def _reaches(module: str, target: str) -> bool:
    """Whether ``module``'s imports, followed through the package's own modules, reach ``target``."""
    seen, todo = set(), [module]
    while todo:
        current = todo.pop()
        if current == target:
            return True
        if current in seen or current not in modules():
            continue
        seen.add(current)
        todo.extend(imports(current))
    return False


def test_every_module_quantizing_a_drafter_brings_the_devices_fp8_gemm():
    quantizing = []
    for module, (path, _) in modules().items():
        if _within(module, "sgl_longgen.core"):
            continue  # defines the quantization; the engines pick the GEMM
        calls = {node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", None)
                 for node in ast.walk(ast.parse(path.read_text())) if isinstance(node, ast.Call)}
        if "quantize_fp8" in calls:
            quantizing.append(module)
    assert {"sgl_longgen.runtime.longspec", "sgl_longgen.runtime.owl", "sgl_longgen.sglang.longspec",
            "sgl_longgen.sglang.owl"} <= set(quantizing)
    assert [m for m in quantizing if not _reaches(m, FP8_GEMM_DISPATCH)] == []
