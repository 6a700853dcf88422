"""Every ```python block of docs/*.md runs, each in a fresh namespace (the blocks are self-contained examples)."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

DOCS = Path(__file__).resolve().parent.parent / "docs"
_BLOCK = re.compile(r"^```python\n(.*?)^```", re.MULTILINE | re.DOTALL)


def _blocks() -> list[tuple[str, str]]:
    """``(id, source)`` of every python block, the id naming the file and the block's first line number."""
    found = []
    for path in sorted(DOCS.glob("*.md")):
        text = path.read_text(encoding="utf-8")
        for match in _BLOCK.finditer(text):
            line = text.count("\n", 0, match.start()) + 1
            found.append((f"{path.name}:{line}", match.group(1)))
    return found


BLOCKS = _blocks()


def test_the_docs_have_examples():
    """The extension guide's worked examples exist (an empty list would make every test below vacuous)."""
    assert sum(name.startswith("extending.md") for name, _ in BLOCKS) >= 4


# an example that reaches an op without a rule, or whose rule breaks conservation, is a wrong example
@pytest.mark.filterwarnings("error::relprop.UnhandledOpWarning", "error::relprop.engine.ConservationWarning")
@pytest.mark.parametrize("name,source", BLOCKS, ids=[name for name, _ in BLOCKS])
def test_block_runs(name: str, source: str):
    # compiled with the file and line in the name, so that a failing assert points into the document
    exec(compile(source, name, "exec"), {"__name__": f"docs_{name}"})


SECTIONS = {
    1: "Semantics", 2: "Rules for linear maps", 3: "Op families", 4: "Composites and presets", 5: "Transformers",
    6: "Checks that hold for any correct implementation", 7: "Mechanism", 8: "DeepLift on the engine",
}
#: a citation of docs/design.md by section number ("design.md section 4", "design.md, section 4")
_CITATION = re.compile(r"design\.md,? sections? (\w+)")


def test_design_sections_that_the_code_cites_exist():
    """The code, the tests and the docs cite docs/design.md by section number: the numbers must stay put."""
    text = (DOCS / "design.md").read_text(encoding="utf-8")
    found = {int(number): title for number, title in re.findall(r"^## (\d+)\. (.+)$", text, re.MULTILINE)}
    assert found == SECTIONS
    root = DOCS.parent
    for path in [*root.glob("src/relprop/*.py"), *root.glob("tests/*.py"), *DOCS.glob("*.md"), root / "README.md"]:
        for cited in _CITATION.findall(path.read_text(encoding="utf-8")) if path.exists() else ():
            assert cited.isdigit() and int(cited) in found, f"{path.relative_to(root)} cites section {cited!r}"
