"""The house rules, checked: every import points down the layers, the bookkeeping layers never
load torch, and no module reaches into another's private names.

Layers, lowest first (docs/architecture.md draws the same picture). A module may import its own
package and any lower layer; packages that share a layer may not import each other.
"""
from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"
PKG = SRC / "kvserve"

LAYERS = [
    {"vllm_compat", "errors"},
    {"json_configs"},
    {"config", "version"},
    {"envs"},
    {"core"},
    {"kv"},
    {"sched"},
    {"routing"},
    {"ops"},
    {"cache"},
    {"attention"},
    {"model"},
    {"runner"},
    {"engine"},
    {"semantic_cache"},
    {"tools", "server"},
    {"cli", "__main__", "__init__"},
]
RANK = {name: i for i, layer in enumerate(LAYERS) for name in layer}
NO_TORCH = ("vllm_compat", "errors", "json_configs", "config", "envs", "core", "kv", "sched", "routing")


def _modules() -> list[tuple[str, Path]]:
    out = []
    for path in sorted(PKG.rglob("*.py")):
        rel = path.relative_to(SRC).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out.append((".".join(parts), path))
    return out


def _unit(module: str) -> str:
    """The package (or top-level module) of kvserve a module belongs to."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _imports(module: str, path: Path) -> list[tuple[int, str, list[str]]]:
    """(line, imported module, names) for every import in the file, lazy ones included."""
    tree = ast.parse(path.read_text(), str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name, []) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(up + ([node.module] if node.module else []))
            # `from kvserve import envs` imports the module kvserve.envs
            subs = [f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in MODULE_NAMES]
            found += [(node.lineno, s, []) for s in subs] or [(node.lineno, base, [a.name for a in node.names])]
    return found


MODULES = _modules()
MODULE_NAMES = {m for m, _ in MODULES}
TOP = len(LAYERS) - 1  # the entry points may import each other


def test_every_module_is_in_a_layer():
    missing = sorted({_unit(m) for m, _ in MODULES} - set(RANK))
    assert not missing, f"add these to LAYERS (and docs/architecture.md): {missing}"


def test_imports_point_down():
    wrong = []
    for module, path in MODULES:
        unit = _unit(module)
        for line, target, _ in _imports(module, path):
            if not target.startswith("kvserve"):
                continue
            to = _unit(target) if target != "kvserve" else "__init__"
            if to == unit:
                continue
            if RANK[to] > RANK[unit] or (RANK[to] == RANK[unit] and RANK[unit] != TOP):
                wrong.append(f"{path.relative_to(SRC)}:{line} ({unit}) imports {target} ({to})")
    assert not wrong, "imports that run up or across the layers:\n" + "\n".join(wrong)


def test_bookkeeping_layers_do_not_import_torch_directly():
    wrong = [f"{path.relative_to(SRC)}:{line}" for module, path in MODULES if _unit(module) in NO_TORCH
             for line, target, _ in _imports(module, path) if target.split(".")[0] == "torch"]
    assert not wrong, f"torch imported where no tensor belongs: {wrong}"


@pytest.mark.parametrize("unit", NO_TORCH)
def test_bookkeeping_layers_do_not_load_torch(unit):
    """Transitively too: importing every module of the layer leaves torch unloaded, which is what
    lets the simulator and the property tests drive the scheduler and KV manager without it."""
    names = [m for m, _ in MODULES if _unit(m) == unit]
    code = ("import sys\n" + "".join(f"import {m}\n" for m in names)
            + "print('LOADED' if 'torch' in sys.modules else 'CLEAN')\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={"PYTHONPATH": str(SRC), "PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "CLEAN", f"importing kvserve.{unit} loads torch"


def test_no_module_imports_another_modules_private_names():
    wrong = [f"{path.relative_to(SRC)}:{line} imports {target}.{name}" for module, path in MODULES
             for line, target, names in _imports(module, path) if target.startswith("kvserve")
             for name in names if name.startswith("_") and not name.startswith("__")]
    assert not wrong, wrong
