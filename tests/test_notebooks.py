"""The tutorial notebooks of docs/tutorials run from top to bottom and show what they say they show.

Each runs with nbclient in a fresh kernel of this Python (ipykernel), in its own folder; a cell that raises fails
the test, and so does a warning in the notebook or in the kernel's own log. The kernel runs as the README starts
Jupyter (``jupyter lab --KernelManager.transport_encryption=auto``): its channels encrypted with CurveZMQ keys
Jupyter provisions (jupyter_client 8.9, jupyter_server 2.20), since ipykernel 7.3 warns at every start over plain
TCP ("Kernel is running over TCP without encryption"). The site shows the outputs stored in the notebooks without running them (docs/conf.py), so the stored
outputs are checked too: what a fresh run prints, the stored notebook prints, and both show the same pictures
(their sizes; the pixels may differ in rounding from machine to machine). After
changing a notebook, run it and store its outputs with

    python tests/test_notebooks.py [NAME ...]       # e.g. generation; all of them without a name
"""
from __future__ import annotations

import io
import re
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest

TUTORIALS = Path(__file__).resolve().parents[1] / "docs" / "tutorials"
NOTEBOOKS = sorted(TUTORIALS.glob("*.ipynb"))

#: per notebook: what its printed or shown text must hold (the model's answer, from the library), and the size of
#: the pictures of ``ImageRelevance`` it shows, (height, width), where they have one size
EXPECTED: dict[str, tuple[list[str], tuple[int, int] | None]] = {
    "imagenet": (["Egyptian cat", "tiger cat", "espresso: probability"], (224, 224)),
    "generation": (["' Paris", "relevance in total"], None),
    "similarity": (["cat ~ kitten", "pair relevance in total"], None),
    "concept-atlas": (["torch.Size([32, 6])", "accuracy on the 3000 other digits"], None),
}


#: the longest a cell may run: the 30-minute hang guard of the suite's other long runs (tests/test_cli.py)
CELL_TIMEOUT = 1800


def execute(path: Path) -> tuple[Any, str]:
    """The notebook at ``path``, run from top to bottom in its folder (nbclient raises on a cell's error), and
    what its kernel wrote to its standard error (the kernel's log; the cells' own warnings are in the notebook).

    Run as a user runs it: no environment variable quiets the dependencies' progress bars; a notebook that shows
    one, or warns, fails :func:`test_notebook_runs_and_shows_what_is_stored`.
    """
    import nbformat
    from nbclient import NotebookClient
    from traitlets.config import Config

    book = nbformat.read(path, as_version=4)
    # as `jupyter lab --KernelManager.transport_encryption=auto`: CurveZMQ keys where the kernel takes them
    launch = Config({"KernelManager": {"transport_encryption": "auto"}})
    with tempfile.TemporaryFile("w+") as log:
        # "python3" is the kernel of the Python that runs this (jupyter_client starts it with sys.executable)
        NotebookClient(book, timeout=CELL_TIMEOUT, kernel_name="python3", record_timing=False, config=launch,
                       resources={"metadata": {"path": str(path.parent)}}).execute(stderr=log)
        log.seek(0)
        return book, log.read()


def _outputs(book: Any) -> list[dict[str, Any]]:
    return [output for cell in book.cells if cell.cell_type == "code" for output in cell.get("outputs", [])]


def texts(book: Any) -> str:
    """Everything the notebook prints or shows as text or HTML."""
    found = []
    for output in _outputs(book):
        if output.output_type == "stream":
            found.append(output.text)
        for kind in ("text/plain", "text/html"):
            found.append(output.get("data", {}).get(kind, ""))
    return "\n".join(found)


def printed(book: Any) -> list[str]:
    """What the notebook prints (its standard output), cell by cell."""
    return ["".join(output.text for output in cell.get("outputs", [])
                    if output.output_type == "stream" and output.name == "stdout")
            for cell in book.cells if cell.cell_type == "code"]


_NUMBER = re.compile(r"-?\d+(?:\.\d+)?(?:e-?\d+)?")


def _same(fresh: list[str], stored: list[str]) -> bool:
    """The same text, and the same numbers up to their last printed digit (another machine may round otherwise)."""
    if len(fresh) != len(stored):
        return False
    for now, then in zip(fresh, stored):
        if _NUMBER.split(now) != _NUMBER.split(then):
            return False
        for a, b in zip(_NUMBER.findall(now), _NUMBER.findall(then)):
            if "." not in b:  # a count, a class, a shape: exactly
                if a != b:
                    return False
                continue
            last = 10.0 ** -len(b.partition(".")[2].partition("e")[0])  # one unit of the last printed digit
            if abs(float(a) - float(b)) > last + 1e-2 * abs(float(b)):
                return False
    return True


def noise(book: Any) -> list[str]:
    """What the notebook shows besides its results: anything on stderr (warnings), and widgets (progress bars)."""
    found = [output.text for output in _outputs(book) if output.output_type == "stream" and output.name == "stderr"]
    return found + [output.data.get("text/plain", "a widget") for output in _outputs(book)
                    if "application/vnd.jupyter.widget-view+json" in output.get("data", {})]


def pictures(book: Any) -> list[tuple[int, int]]:
    """The (height, width) of every PNG the notebook shows, decoded."""
    import base64

    import matplotlib.pyplot as plt

    return [plt.imread(io.BytesIO(base64.b64decode(output.data["image/png"])), format="png").shape[:2]
            for output in _outputs(book) if "image/png" in output.get("data", {})]


def test_every_notebook_has_its_expectations():
    assert {path.stem for path in NOTEBOOKS} == set(EXPECTED)


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=[path.stem for path in NOTEBOOKS])
def test_notebook_runs_and_shows_what_is_stored(path: Path):
    pytest.importorskip("nbclient", reason="pip install -e '.[notebooks]' (Jupyter: nbclient, ipykernel)")
    import nbformat

    stored = nbformat.read(path, as_version=4)
    fresh, kernel_log = execute(path)
    assert not kernel_log, f"{path.name}: the kernel warns: {kernel_log}"
    claims, size = EXPECTED[path.stem]
    for book in (fresh, stored):
        text = texts(book)
        missing = [claim for claim in claims if claim not in text]
        assert not missing, f"{path.name} does not show {missing}"
        assert not [output for output in _outputs(book) if output.output_type == "error"]
        assert not noise(book), f"{path.name} warns or shows a progress bar: {noise(book)}"
    assert _same(printed(fresh), printed(stored)), \
        f"{path.name}: the stored outputs are not what it prints now; python tests/test_notebooks.py {path.stem}"
    shown = pictures(fresh)
    assert shown and shown == pictures(stored)
    if size is not None:
        assert size in shown


if __name__ == "__main__":  # store the outputs of the named notebooks (all without a name)
    import nbformat

    for notebook in [TUTORIALS / f"{name}.ipynb" for name in sys.argv[1:]] or NOTEBOOKS:
        nbformat.write(execute(notebook)[0], notebook)
        print(f"ran and stored {notebook}")
