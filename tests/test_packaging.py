"""The wheel carries what the package needs at run time, beyond its Python modules.

The CPU kernels are compiled on first use from sources shipped as package data; a source or header
missing from the wheel would make every non-editable install fall back to the pure-torch paths
(slower, and silently: the build failure is only logged)."""
from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from kvserve.ops import cpu_kernels as cpu_kernel

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_the_wheel_ships_every_kernel_source_and_header(tmp_path):
    # From a copy without egg-info or build output: setuptools also ships what a stale
    # SOURCES.txt lists, which hid a header missing from the package data.
    tree = tmp_path / "tree"
    tree.mkdir()
    shutil.copy(ROOT / "pyproject.toml", tree)
    shutil.copy(ROOT / "README.md", tree)
    shutil.copytree(ROOT / "src", tree / "src", ignore=shutil.ignore_patterns("*.egg-info", "__pycache__"))
    # The installed setuptools when there is one (no download); else pip fetches it, as installs do.
    isolation = [] if importlib.util.find_spec("setuptools") is None else ["--no-build-isolation"]
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", *isolation, "-q",
                    "-w", str(tmp_path), str(tree)], check=True, capture_output=True, timeout=300)
    wheel = next(tmp_path.glob("kvserve-*.whl"))
    names = set(zipfile.ZipFile(wheel).namelist())
    package = ROOT / "src" / "kvserve"
    needed = {f"kvserve/{p.relative_to(package).as_posix()}" for p in (*cpu_kernel._SOURCES, *cpu_kernel._HEADERS)}
    assert needed <= names, sorted(needed - names)


@pytest.mark.slow
def test_a_compiler_that_fails_is_an_error_that_quotes_it(tmp_path):
    """Where a compiler exists but the kernels do not build, the engine does not fall back to the
    torch paths in silence: `kvserve generate` stops with the compiler's own message, in one line
    of its error, and says how to run without the kernels."""
    cc = tmp_path / "g++"
    cc.write_text('#!/bin/sh\nif [ "$1" = "--version" ]; then echo "broken-g++ 1.0"; exit 0; fi\n'
                  'echo "broken-g++: internal compiler error: simulated" >&2; exit 1\n')
    cc.chmod(0o755)
    src = str(Path(__file__).resolve().parents[1] / "src")  # the checkout's code, never an installed copy
    env = {**os.environ, "CXX": str(cc), "KVSERVE_CACHE_DIR": str(tmp_path / "cache"),
           "PYTHONPATH": os.pathsep.join(p for p in (src, os.environ.get("PYTHONPATH")) if p)}
    out = subprocess.run([sys.executable, "-m", "kvserve", "generate", "hi", "--max-tokens", "1"],
                         capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 2, out.stderr[-2000:]
    assert "internal compiler error: simulated" in out.stderr and "KVSERVE_CPU_KERNEL=0" in out.stderr
    assert "Traceback" not in out.stderr
