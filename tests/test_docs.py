"""The docs stay a map that is true to the code: the generated flag tables match EngineArgs and
the server's parser, every relative link lands on a file (and heading) that exists, and no
session or issue numbers creep back into code or docs."""
from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "bench" / "NOTES.md"]


def _load_script(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_serving_doc_flags_are_generated_from_the_code():
    flags = _load_script("serving_flags")
    doc = flags.DOC.read_text()
    assert flags.updated(doc) == doc, "docs/serving.md is out of date: run python scripts/serving_flags.py"


def test_every_engine_flag_and_user_variable_is_in_the_serving_doc():
    """The generated part covers every EngineArgs field and every user-facing variable (a field
    added without metadata fails in cli.add_engine_args before it gets here)."""
    from dataclasses import fields

    from kvserve import envs
    from kvserve.config import EngineArgs
    doc = (ROOT / "docs" / "serving.md").read_text()
    missing = [f.name for f in fields(EngineArgs) if f"`--{f.name.replace('_', '-')}`" not in doc]
    missing += [name for name, var in envs.VARIABLES.items() if not var.developer and f"`{name}`" not in doc]
    assert not missing, missing


def _anchor(heading: str) -> str:
    """GitHub's anchor for a heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(doc):
    text = doc.read_text()
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+://", target) or target.startswith("mailto:"):
            continue
        path, _, anchor = target.partition("#")
        file = (doc.parent / path).resolve() if path else doc
        if not file.exists():
            broken.append(target)
            continue
        if anchor and file.suffix == ".md":
            headings = {_anchor(h) for h in re.findall(r"^#+ (.+)$", file.read_text(), re.M)}
            if anchor not in headings:
                broken.append(target)
    assert not broken, f"{doc.name}: {broken}"


def test_readme_is_a_map():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 150, f"README.md has {len(lines)} lines; details belong in docs/"
    block = lines[lines.index("```bash") + 1:lines.index("```")]
    assert len(block) == 2 and block[0].startswith("bash scripts/install.sh") and block[1].startswith(
        "bash scripts/test.sh"), block


def test_no_session_or_issue_numbers_in_code_or_docs():
    files = [*(ROOT / "src").rglob("*.py"), *(ROOT / "src").rglob("*.cpp"), *(ROOT / "src").rglob("*.h"),
             *DOCS, *(ROOT / "bench").glob("*.py"), *(ROOT / "scripts").glob("*")]
    pattern = re.compile(r"\b(sessions?|issue) [0-9]+", re.IGNORECASE)
    hits = [f"{f.relative_to(ROOT)}:{n}: {line.strip()}" for f in files if f.is_file()
            for n, line in enumerate(f.read_text(errors="replace").splitlines(), 1) if pattern.search(line)]
    assert not hits, "say what and why instead; the history lives in git:\n" + "\n".join(hits)
