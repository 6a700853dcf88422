"""Every ```python block of README.md runs as it is: alone, in a fresh namespace, in an empty folder."""
import re
from pathlib import Path

import pytest

README = Path(__file__).parents[1] / "README.md"


def python_blocks() -> list[tuple[str, int, str]]:
    """(id, line, code) of each python block; the id names the README section it sits in."""
    blocks, section, fence, start, code = [], "top", None, 0, []
    for number, line in enumerate(README.read_text(encoding="utf-8").splitlines(), start=1):
        if fence is None and line.startswith("```"):
            fence, start, code = line[3:].strip(), number + 1, []
        elif fence is not None and line.startswith("```"):
            if fence == "python":
                blocks.append((f"{section}-line{start}", start, "\n".join(code) + "\n"))
            fence = None
        elif fence is not None:
            code.append(line)
        elif line.startswith("#"):
            section = re.sub(r"\W+", "-", line.lstrip("#")).strip("-").lower()
    return blocks


BLOCKS = python_blocks()


def test_the_readme_has_python_blocks():
    assert len(BLOCKS) >= 5


@pytest.mark.parametrize("line, code", [(line, code) for _, line, code in BLOCKS], ids=[b[0] for b in BLOCKS])
def test_readme_block_runs(line, code, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # files a block writes land here
    exec(compile(code, f"{README}:{line}", "exec"), {"__name__": "__main__"})
