"""The batch package's import layout, read from the source (every import, lazy ones included).

An import cycle works until someone moves an import to module level or imports the modules in
another order; and SGLang may be imported only by ``sgl_longgen.sglang``, so a driver (which
imports the engine modules to name the actor class) never loads it.
"""

from __future__ import annotations

import ast
from functools import lru_cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE_DIRS = {"sgl_longgen.cluster": ROOT / "cluster", "sgl_longgen.kernels": ROOT / "kernels",
                "sgl_longgen": ROOT / "sgl_longgen"}


def source(module: str) -> Path | None:
    for prefix, folder in PACKAGE_DIRS.items():  # the most specific mapping first
        if module == prefix or module.startswith(prefix + "."):
            rel = module[len(prefix):].lstrip(".").split(".") if module != prefix else []
            base = folder.joinpath(*rel)
            for path in (base.with_suffix(".py") if rel else None, base / "__init__.py"):
                if path is not None and path.is_file():
                    return path
            return None
    return None


@lru_cache(maxsize=None)
def imports(module: str) -> frozenset[str]:
    """Every module ``module`` imports, anywhere in its body (third-party ones by their full name)."""
    path = source(module)
    if path is None:
        return frozenset()
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                out.add(sub if source(sub) is not None else base)
    return frozenset(out)


def cycle_through(module: str) -> list[str] | None:
    """A chain of imports from ``module`` back to itself, if there is one."""
    seen: set[str] = set()
    stack = [(dep, [module, dep]) for dep in imports(module)]
    while stack:
        current, chain = stack.pop()
        if current == module:
            return chain
        if current in seen or source(current) is None:
            continue
        seen.add(current)
        stack += [(dep, chain + [dep]) for dep in imports(current)]
    return None


CLUSTER = sorted(f"sgl_longgen.cluster.{p.stem}" for p in (ROOT / "cluster").glob("*.py") if p.stem != "__init__")


def test_no_batch_module_imports_itself_back():
    cycles = {m: chain for m in CLUSTER if (chain := cycle_through(m))}
    assert not cycles, "\n".join(" -> ".join(chain) for chain in cycles.values())


def test_the_engine_modules_are_layered():
    assert imports("sgl_longgen.cluster.engines") >= {"sgl_longgen.cluster.reference_engine",
                                                      "sgl_longgen.cluster.sglang_engine"}
    for engine in ("reference_engine", "sglang_engine"):
        mine = {m for m in imports(f"sgl_longgen.cluster.{engine}") if m.startswith("sgl_longgen.cluster.")}
        assert "sgl_longgen.cluster.engine_common" in mine
        assert not mine & {"sgl_longgen.cluster.engines", "sgl_longgen.cluster.reference_engine",
                           "sgl_longgen.cluster.sglang_engine"}, engine


def test_only_sgl_longgen_sglang_imports_sglang():
    offenders = {m: sorted(d for d in imports(m) if d == "sglang" or d.startswith("sglang."))
                 for m in CLUSTER}
    assert not any(offenders.values()), offenders
    assert "sgl_longgen.sglang.engine" in imports("sgl_longgen.cluster.sglang_engine")


def test_the_driver_side_never_loads_sglang(tmp_path):
    import subprocess
    import sys

    code = ("import sys\n"
            "from sgl_longgen.cluster import runner\n"
            "from sgl_longgen.cluster.engines import actor_class\n"
            "actor_class('sglang'); actor_class('reference')\n"
            "print(sorted(m for m in sys.modules if m == 'sglang' or m.startswith('sglang.')))\n")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "[]"
