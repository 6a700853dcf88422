"""The documentation runs: the Python blocks of README.md and docs/**/*.md, the docstrings' examples, the site.

- every ```python block of README.md and of every page under docs/ runs as it is: alone, in a fresh namespace,
  in an empty folder (files a block writes land in ``tmp_path``), with an op without a rule or a rule that
  breaks conservation as an error (a wrong example);
- every ``>>>`` example in the docstrings of the package's modules runs under :mod:`doctest`;
- ``sphinx-build -W`` builds the site (docs/conf.py) with warnings as errors;
- the README's relative links and images point at files that exist (a package index shows the README alone).
"""
from __future__ import annotations

import doctest
import importlib
import pkgutil
import re
import subprocess
import sys
from pathlib import Path

import pytest

import relprop

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
README = ROOT / "README.md"
#: the pages whose python blocks run: the README and every Markdown page of the site (not its build output)
PAGES = [README, *sorted(path for path in DOCS.rglob("*.md") if "_build" not in path.relative_to(DOCS).parts)]


#: a fence's opening line (CommonMark: three or more backticks, an info string without backticks)
_FENCE = re.compile(r"^(`{3,})([^`]*)$")


def python_blocks(path: Path) -> list[tuple[str, int, str]]:
    """``(id, line, code)`` of each ```python block of one page; the id names the page, the section and the line."""
    blocks, section, fence, info, start, code = [], "top", None, "", 0, []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        opening = _FENCE.match(line)
        if fence is None and opening:
            fence, info, start, code = opening.group(1), opening.group(2).strip(), number + 1, []
        elif fence is not None and line.strip().startswith(fence) and not line.strip().strip("`"):
            if info == "python":
                blocks.append((f"{path.relative_to(ROOT)}:{section}-line{start}", start, "\n".join(code) + "\n"))
            fence = None
        elif fence is not None:
            code.append(line)
        elif line.startswith("#"):
            section = re.sub(r"\W+", "-", line.lstrip("#")).strip("-").lower()
    return blocks


BLOCKS = [(name, path, line, code) for path in PAGES for name, line, code in python_blocks(path)]


def test_the_pages_have_python_blocks():
    """The examples exist (an empty list would make every test below vacuous)."""
    count = {path: sum(block[1] == path for block in BLOCKS) for path in PAGES}
    assert count[README] >= 1  # the quick start
    assert count[DOCS / "extending.md"] >= 4  # the extension guide's worked examples
    assert count[DOCS / "guide" / "quickstart.md"] >= 2
    assert len(BLOCKS) >= 15


# an example that reaches an op without a rule, or whose rule breaks conservation, is a wrong example
@pytest.mark.filterwarnings("error::relprop.UnhandledOpWarning", "error::relprop.ConservationWarning")
@pytest.mark.parametrize("path, line, code", [block[1:] for block in BLOCKS], ids=[block[0] for block in BLOCKS])
def test_block_runs(path: Path, line: int, code: str, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # files a block writes land here
    # compiled with the file and line in the name, so that a failing assert points into the document
    exec(compile(code, f"{path}:{line}", "exec"), {"__name__": "__main__"})


SECTIONS = {
    1: "Semantics", 2: "Rules for linear maps", 3: "Op families", 4: "Composites and presets", 5: "Transformers",
    6: "Checks that hold for any correct implementation", 7: "Mechanism", 8: "DeepLift on the engine",
    9: "The compiled tier",
}
#: a citation of docs/design.md by section number ("design.md section 4", "design.md, section 4")
_CITATION = re.compile(r"design\.md,? sections? (\w+)")


def test_design_sections_that_the_code_cites_exist():
    """The code, the tests and the docs cite docs/design.md by section number: the numbers must stay put."""
    text = (DOCS / "design.md").read_text(encoding="utf-8")
    found = {int(number): title for number, title in re.findall(r"^## (\d+)\. (.+)$", text, re.MULTILINE)}
    assert found == SECTIONS
    for path in [*(ROOT / "src" / "relprop").rglob("*.py"), *(ROOT / "tests").glob("*.py"), *PAGES]:
        for cited in _CITATION.findall(path.read_text(encoding="utf-8")):
            assert cited.isdigit() and int(cited) in found, f"{path.relative_to(ROOT)} cites section {cited!r}"


#: a Markdown link or image with a relative target: [text](target) or ![alt](target)
_LINK = re.compile(r"\]\(([^)\s]+)\)")


def test_the_readmes_links_point_at_files():
    """Every relative link and image of the README names a file of the repository (anchors aside)."""
    targets = [target for target in _LINK.findall(README.read_text(encoding="utf-8")) if "://" not in target]
    assert targets, "the README links into docs/"
    missing = [target for target in targets if not (ROOT / target.split("#")[0]).exists()]
    assert not missing, f"README.md links to files that do not exist: {missing}"


# ---- the docstrings' examples ----------------------------------------------------------------------------------

def _modules() -> list[object]:
    """Every module of the package (private ones too: their docstrings are what the public names show)."""
    found = [relprop]
    for info in pkgutil.walk_packages(relprop.__path__, prefix="relprop."):
        if info.name.rsplit(".", 1)[-1] == "__main__":  # importing it would run the command line
            continue
        try:
            found.append(importlib.import_module(info.name))
        except ImportError:  # a module of an optional extra that is not installed
            continue
    return found


def _docstring_examples() -> list[doctest.DocTest]:
    finder = doctest.DocTestFinder(exclude_empty=True)
    seen, tests = set(), []
    for module in _modules():
        for test in finder.find(module, module.__name__):
            if test.examples and (test.filename, test.lineno) not in seen:  # re-exported objects once
                seen.add((test.filename, test.lineno))
                tests.append(test)
    return sorted(tests, key=lambda test: test.name)


def _short_name(test: doctest.DocTest) -> str:
    """The object's name without the module that defines it (``LRP.context``), which a move of files keeps;
    a module's own docstring keeps the module's name."""
    module = getattr(test.globs.get("__spec__"), "name", None) or test.globs.get("__name__", "")
    return test.name[len(module) + 1:] if test.name.startswith(module + ".") else test.name


#: docstring examples that do not run yet: they use names they never define (``model``, ``images``, ...) or
#: print values they do not show. Fix the docstring (define what it uses, show what it prints) and remove its
#: entry; the test then fails until the entry goes, so the list only shrinks.
NOT_RUNNABLE_YET: dict[str, str] = {}

DOCTESTS = _docstring_examples()


def test_the_docstring_examples_are_found():
    assert DOCTESTS, "the package's docstrings have >>> examples"
    names = {_short_name(test) for test in DOCTESTS}
    stale = set(NOT_RUNNABLE_YET) - names
    assert not stale, f"NOT_RUNNABLE_YET names docstrings without examples (remove them): {sorted(stale)}"


@pytest.mark.filterwarnings("error::relprop.UnhandledOpWarning", "error::relprop.ConservationWarning")
@pytest.mark.parametrize("test", DOCTESTS, ids=[test.name for test in DOCTESTS])
def test_docstring_example_runs(test: doctest.DocTest, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    name = _short_name(test)
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    output: list[str] = []
    result = runner.run(test, out=output.append, clear_globs=False)  # the same DocTest object runs once only
    if name in NOT_RUNNABLE_YET:
        assert result.failed, f"the docstring example of {name} runs now: remove it from NOT_RUNNABLE_YET"
        pytest.xfail(f"{name}: {NOT_RUNNABLE_YET[name]}")
    assert not result.failed, "".join(output)


# ---- the site ----------------------------------------------------------------------------------------------------

def test_the_docs_build_with_warnings_as_errors(tmp_path):
    """``sphinx-build -W`` on docs/: MyST pages, the tutorial notebooks with their stored outputs, the API reference
    from the docstrings, no warning at all."""
    pytest.importorskip("sphinx", reason="sphinx is not installed: pip install -e '.[docs]' (the dev extra has it)")
    pytest.importorskip("myst_nb", reason="myst-nb is not installed: pip install -e '.[docs]'")
    pytest.importorskip("furo", reason="furo is not installed: pip install -e '.[docs]'")
    command = [sys.executable, "-m", "sphinx", "-W", "--keep-going", "-q", "-b", "html",
               "-d", str(tmp_path / "doctrees"), str(DOCS), str(tmp_path / "html")]
    done = subprocess.run(command, check=False, capture_output=True, text=True, timeout=1800)
    assert done.returncode == 0, f"sphinx-build -W failed:\n{done.stdout}\n{done.stderr}"
    assert (tmp_path / "html" / "api.html").exists()
    # a notebook's pictures are its stored outputs, written out as image files of the page
    page = (tmp_path / "html" / "tutorials" / "imagenet.html").read_text(encoding="utf-8")
    assert page.count("<img") >= 4 and "furo" in page
