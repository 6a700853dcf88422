"""What a new user trips over (issue #38, items 4 to 6): photos cropped as ImageNet models expect, labelled
pictures, warnings for blank maps, epsilon-gamma-box's bounds alike in Python and on the command line, and
messages that name things as the user wrote them."""
import json
from pathlib import Path

import numpy as np
import pytest
import torch

import relprop
from relprop import composites

pytest.importorskip("PIL")
from PIL import Image  # noqa: E402

from test_cli import relprop_run  # noqa: E402


def photo(path: Path, width: int = 90, height: int = 60) -> Path:
    """A non-square photo: a left half darker than the right, a bright square right of the centre."""
    generator = np.random.default_rng(0)
    pixels = generator.integers(0, 256, (height, width, 3), dtype=np.uint8)
    pixels[:, : width // 2] //= 3
    pixels[height // 3: 2 * height // 3, width // 2: width // 2 + height // 3] = 255
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(pixels).save(path)
    return path


# --- item 4: photos as ImageNet models expect --------------------------------------------------------------------

@pytest.mark.parametrize("size", [224, 100, 33])
@pytest.mark.parametrize("shape", [(90, 60), (60, 90), (301, 299)])
def test_photos_are_resized_and_centre_cropped_as_torchvision_does(tmp_path, size, shape):
    transforms = pytest.importorskip("torchvision.transforms")
    from relprop.cli.inputs import load_images

    path = photo(tmp_path / "p.png", *shape)
    inputs, pixels = load_images([str(path)], size, "imagenet", 3)
    expected = transforms.Compose([transforms.Resize(round(size * 256 / 224), antialias=True),
                                   transforms.CenterCrop(size), transforms.ToTensor()])(Image.open(path).convert("RGB"))
    assert pixels.shape == (1, 3, size, size)
    assert torch.allclose(pixels[0], expected, atol=1e-6)
    mean, std = torch.tensor([0.485, 0.456, 0.406]), torch.tensor([0.229, 0.224, 0.225])
    assert torch.allclose(inputs[0], (expected - mean[:, None, None]) / std[:, None, None], atol=1e-5)


def test_whole_squashes_the_photo_and_grey_images_stay_whole_by_default(tmp_path):
    from relprop.cli.inputs import crops, load_images

    path = photo(tmp_path / "p.png")
    _, whole = load_images([str(path)], 32, "imagenet", 3, whole=True)
    squashed = np.asarray(Image.open(path).convert("RGB").resize((32, 32)), dtype=np.float32) / 255
    assert torch.allclose(whole[0], torch.from_numpy(squashed).permute(2, 0, 1))
    assert crops(None, 3, None) and crops("imagenet", 3, None) and not crops(None, 3, True)
    assert not crops(None, 1, None) and not crops("none", 3, None) and crops("none", 1, False)


def test_explain_draws_labelled_pictures_of_the_crop_and_warns_about_blank_maps(tmp_path):
    photos = [photo(tmp_path / "wide.png"), photo(tmp_path / "tall.png", 60, 90)]
    result = relprop_run("explain", *photos, "--model", "cli_factory:tiny_rgb", "--size", 32, "--clip", 99,
                         "--smooth-stride", "--figure", "--out", tmp_path / "crop", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""  # no warning: nothing blank
    summary = json.loads((tmp_path / "crop" / "explain.json").read_text())
    assert [entry["warning"] for entry in summary] == [None, None]
    for entry in summary:
        for kind in ("relevance", "overlay"):
            width, height = Image.open(entry[kind]).size
            assert width > 256 + 60 and height > 256  # the map enlarged, a colour bar beside it, a title above
    result = relprop_run("explain", *photos, "--model", "cli_factory:tiny_rgb", "--size", 32, "--whole",
                         "--out", tmp_path / "whole", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    whole = json.loads((tmp_path / "whole" / "explain.json").read_text())
    assert [e["logit"] for e in whole] != [e["logit"] for e in summary]  # the model saw other pixels


def test_a_blank_map_is_one_warning_line_per_image_and_a_field_of_explain_json(tmp_path):
    from test_cli import digit

    digits = [digit(tmp_path / "d0.png"), digit(tmp_path / "d1.png", 1)]
    result = relprop_run("explain", *digits, "--model", "cli_factory:zero_logits", "--size", 28, "--channels", 1,
                         "--out", tmp_path / "out", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stderr.splitlines() == [f"relprop: warning: {path}: a blank map, logit is 0" for path in digits]
    summary = json.loads((tmp_path / "out" / "explain.json").read_text())
    assert [entry["warning"] for entry in summary] == ["logit is 0", "logit is 0"]


def test_blank_names_why():
    from relprop.cli.explain import _blank

    assert _blank({"logit": 0.0}, torch.zeros(3, 4, 4)) == "logit is 0"
    assert _blank({"logit": 1.0}, torch.zeros(3, 4, 4)) == "relevance is all zero"
    assert _blank({"logit": 1.0}, torch.full((3, 4, 4), float("nan"))).startswith("relevance is not finite")
    cancelling = torch.stack([torch.ones(4, 4), -torch.ones(4, 4)])
    assert _blank({"logit": 1.0}, cancelling).startswith("relevance cancels")
    assert _blank({"logit": 1.0}, torch.rand(3, 4, 4)) is None


# --- item 5: epsilon-gamma-box's bounds, the same in Python and on the command line ------------------------------

def test_epsilon_gamma_box_takes_the_preprocessing_in_python_as_on_the_command_line():
    from relprop.cli.inputs import _composite

    mean, std = torch.tensor([0.485, 0.456, 0.406]), torch.tensor([0.229, 0.224, 0.225])
    for python in (composites.get("epsilon-gamma-box", normalization="imagenet"),
                   composites.EpsilonGammaBox(mean=mean.tolist(), std=std.tolist()),
                   composites.EpsilonGammaBox(low=(0 - mean).reshape(1, 3, 1, 1) / std.reshape(1, 3, 1, 1),
                                              high=(1 - mean).reshape(1, 3, 1, 1) / std.reshape(1, 3, 1, 1))):
        for command_line in (_composite("epsilon-gamma-box", None, 3), _composite("epsilon-gamma-box", "imagenet", 3)):
            assert torch.allclose(python.low, command_line.low) and torch.allclose(python.high, command_line.high)
    grey = _composite("epsilon-gamma-box", None, 1)
    assert float(grey.low.flatten()[0]) == 0.0 and float(grey.high.flatten()[0]) == 1.0
    assert repr(_composite("epsilon-gamma-box", None, 3)) == \
        "EpsilonGammaBox(epsilon=1e-06, normalization='imagenet', gamma=0.25)"


def test_epsilon_gamma_box_without_bounds_refuses_with_one_message_everywhere():
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 2, 3), torch.nn.Flatten()).eval()
    messages = []
    for build in (lambda: relprop.LRP(model, "epsilon-gamma-box"), lambda: composites.get("epsilon-gamma-box"),
                  lambda: composites.EpsilonGammaBox(), lambda: relprop.audit(model, torch.rand(1, 3, 5, 5), 0,
                                                                              "epsilon-gamma-box")):
        with pytest.raises(ValueError) as caught:
            build()
        messages.append(str(caught.value))
    assert messages == [composites.BOUNDS_NEEDED] * 4
    assert "normalization='imagenet'" in messages[0] and "--normalize" in messages[0]
    with pytest.raises(ValueError, match="one description of its bounds"):
        composites.EpsilonGammaBox(0.0, 1.0, normalization="imagenet")
    with pytest.raises(ValueError, match="unknown normalization 'cifar'"):
        composites.EpsilonGammaBox(normalization="cifar")


# --- item 6: messages ----------------------------------------------------------------------------------------------

def tiny_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Conv2d(1, 3, 3), torch.nn.ReLU(), torch.nn.Flatten(),
                               torch.nn.Linear(3 * 4 * 4, 4)).eval()


def tiny_data(size: int = 6) -> torch.utils.data.TensorDataset:
    return torch.utils.data.TensorDataset(torch.rand(size, 1, 6, 6, generator=torch.Generator().manual_seed(1)))


def test_run_mismatch_names_presets_and_parameters_as_written(tmp_path):
    from relprop.workflows.dataset import RunMismatch, explain_dataset

    explain_dataset(tiny_model(), tiny_data(), tmp_path, composite="epsilon-plus-flat", progress=False)
    with pytest.raises(RunMismatch) as caught:
        explain_dataset(tiny_model(), tiny_data(), tmp_path, composite=composites.EpsilonPlus(epsilon=0.1),
                        progress=False)
    assert ("the composite (rules and their parameters) (was 'epsilon-plus-flat' = EpsilonPlusFlat(epsilon=1e-06), "
            "now EpsilonPlus(epsilon=0.1))") in str(caught.value)
    assert "{" not in str(caught.value) and "..." not in str(caught.value)
    with pytest.raises(RunMismatch, match=r"EpsilonPlusFlat\(epsilon=1e-06, smooth_stride=True\)"):
        explain_dataset(tiny_model(), tiny_data(), tmp_path, composite=composites.EpsilonPlusFlat(smooth_stride=True),
                        progress=False)
    custom = composites.EpsilonPlusFlat(name_map={"3": relprop.rules.Epsilon(0.5)})
    explain_dataset(tiny_model(), tiny_data(), tmp_path / "custom", composite=custom, progress=False)
    custom.name_map = [("3", relprop.rules.Epsilon(0.25))]
    with pytest.raises(RunMismatch, match=r"name_map=\{'3': Epsilon\(epsilon=0.5, zero_bias=False\)\}\), now "):
        explain_dataset(tiny_model(), tiny_data(), tmp_path / "custom", composite=custom, progress=False)
    # the same name, other rules inside (a default rule set by hand): said so, not shown as two equal names
    custom.name_map = [("3", relprop.rules.Epsilon(0.5))]
    custom._linear = relprop.rules.Epsilon(0.25)
    with pytest.raises(RunMismatch, match="with other rules or parameters inside than before"):
        explain_dataset(tiny_model(), tiny_data(), tmp_path / "custom", composite=custom, progress=False)


def test_a_finished_run_says_so_in_one_line_instead_of_an_empty_progress_bar(tmp_path, capsys):
    from relprop.workflows.dataset import explain_dataset

    explain_dataset(tiny_model(), tiny_data(), tmp_path, shard_size=4)
    capsys.readouterr()
    explain_dataset(tiny_model(), tiny_data(), tmp_path, shard_size=4)
    assert capsys.readouterr().err == f"relprop: {tmp_path} holds this run complete (2 of 2 shards done): nothing " \
                                      "left to do\n"


def test_rerunning_a_finished_explain_dataset_on_a_terminal_prints_one_line_and_no_bar(tmp_path):
    from test_cli import MNIST, digit, stderr_on_a_terminal

    for i in range(2):
        digit(tmp_path / "images" / f"d{i}.png", i)
    run = ["explain-dataset", tmp_path / "images", *MNIST, "--out", tmp_path / "shards"]
    first = stderr_on_a_terminal(run, tmp_path)
    assert "explaining (1 process)" in first  # the bar, on a terminal
    again = stderr_on_a_terminal(run, tmp_path)
    assert again.strip() == f"relprop: {tmp_path / 'shards'} holds this run complete (1 of 1 shards done): " \
                            "nothing left to do"


def test_out_that_cannot_be_created_says_so_and_why(tmp_path):
    from test_cli import digit

    for out in ("/proc/relprop-nope", "/proc/relprop-nope/deeper"):
        result = relprop_run("explain", digit(tmp_path / "d.png"), "--model", "cli_factory:small_cnn", "--size", 28,
                             "--channels", 1, "--out", out, cwd=tmp_path)
        assert result.returncode == 2 and len(result.stderr.splitlines()) == 1, result.stderr
        assert f"cannot create the folder {out}: /proc takes no new files or folders" in result.stderr
        assert "choose another folder" in result.stderr and "Traceback" not in result.stderr


def test_a_models_size_assertion_says_what_to_do(tmp_path):
    pytest.importorskip("torchvision")
    result = relprop_run("explain", photo(tmp_path / "p.png"), "--model", "vit_b_16", "--random-weights", "--size",
                         200, "--out", tmp_path / "out", cwd=tmp_path)
    assert result.returncode == 2 and len(result.stderr.splitlines()) == 1, result.stderr
    assert result.stderr.strip() == ("relprop explain: error: the model cannot take images of shape (3, 200, 200) "
                                     "(it says: Wrong image height! Expected 224 but got 200!); rerun with --size 224")


def test_shape_advice_reads_the_flag_from_the_models_words():
    from relprop.cli.inputs import _what_to_do

    assert _what_to_do("Input height (200) doesn't match model (224).") == "rerun with --size 224"  # timm
    assert _what_to_do("expected input[1, 3, 28, 28] to have 1 channels, but got 3 channels instead") == \
        "rerun with --channels 1"
    assert _what_to_do("mat1 and mat2 shapes cannot be multiplied (1x512 and 400x10)").startswith("set --size")


def test_the_audit_shows_full_rule_names():
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.ReLU(), torch.nn.Flatten(),
                                torch.nn.Linear(4 * 6 * 6, 3)).eval()
    table = str(relprop.audit(model, torch.rand(1, 3, 8, 8), target=0, composite="epsilon-plus-flat"))
    assert "Epsilon(epsilon=1e-06, zero_bias=False)" in table and "Flat(stabilizer=1e-06, zero_bias=True)" in table
    header, rule = table.splitlines()[0], table.splitlines()[2]
    assert header.index("R in") < rule.index("0.") + 12  # the numbers stay in their columns
