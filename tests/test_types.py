"""The package is fully typed: ``mypy`` (configured in pyproject.toml, ``disallow_untyped_defs``) finds nothing."""
from pathlib import Path

from mypy import api

ROOT = Path(__file__).resolve().parent.parent


def test_mypy_finds_no_error_in_the_package():
    stdout, stderr, status = api.run(["--config-file", str(ROOT / "pyproject.toml"), str(ROOT / "src" / "relprop")])
    assert status == 0, stdout + stderr
