"""benchmarks/compare_main.py: the bitwise comparison of two checkouts reports any difference."""
import re
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import compare_main  # noqa: E402


def test_compare_tells_equal_from_different_and_missing(tmp_path, capsys):
    relevance = torch.randn(2, 3, dtype=torch.float64)
    old = {f"net {preset}": [relevance.clone()] for preset in compare_main.PRESETS}
    torch.save(old, tmp_path / "old.pt")
    torch.save(old, tmp_path / "same.pt")
    changed = dict(old)
    changed["net epsilon"] = [relevance + torch.finfo(torch.float64).eps * relevance.abs().max()]  # one ulp or so
    del changed["net cp-lrp"]
    torch.save(changed, tmp_path / "new.pt")
    assert compare_main.compare(str(tmp_path / "old.pt"), str(tmp_path / "same.pt")) == 0
    assert "0 of 8 pairs differ" in capsys.readouterr().out
    assert compare_main.compare(str(tmp_path / "old.pt"), str(tmp_path / "new.pt")) == 1
    out = capsys.readouterr().out
    # the differing pair shows its largest difference relative to the largest relevance: an ulp or so
    assert re.search(r"\| net \| DIFFERS \([1-4]\.\de-16\) \| equal \|", out)
    assert out.rstrip().endswith("2 of 8 pairs differ or are missing")
    assert "| missing |" in out
