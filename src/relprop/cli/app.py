"""The command group, its error handling and the options commands share."""
from __future__ import annotations

import errno
import json
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import click
import torch

from relprop import __version__, composites, rules

IMAGE_SUFFIXES = {".png", ".jpg", ".jpeg", ".bmp", ".gif", ".tif", ".tiff", ".webp"}
#: The extra that installs each optional package, for the message when one is missing.
EXTRAS = {"torchvision": "vision", "PIL": "vision", "matplotlib": "vision", "tqdm": "vision", "numpy": "vision",
          "safetensors": "scale", "transformers": "text", "tokenizers": "text", "mlxtend": "demo"}

F = TypeVar("F", bound=Callable[..., Any])


class CommandError(click.ClickException):
    """A problem with the command's input: one line on stderr, exit code 2."""

    exit_code = 2


class Interrupted(click.ClickException):
    """Ctrl-C: one line on stderr, exit code 130."""

    exit_code = 130


def _missing_extra(error: ModuleNotFoundError) -> str:
    package = (error.name or "").split(".")[0]
    if package in EXTRAS:
        return f"this needs the package {package}: pip install 'relprop[{EXTRAS[package]}]'"
    return f"{error} (install the missing package)"


class Command(click.Command):
    """A command whose errors are one line (exit code 2) unless ``--debug`` asks for the traceback."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.params.append(click.Option(["--debug"], is_flag=True, expose_value=False, is_eager=True,
                                        callback=_remember_debug, help="Show the full traceback of an error."))

    def invoke(self, ctx: click.Context) -> Any:
        failure: click.ClickException
        try:
            return super().invoke(ctx)
        except (click.exceptions.Exit, click.Abort):
            raise
        except click.ClickException as error:
            failure = error
        except KeyboardInterrupt:
            failure = Interrupted("interrupted; the files finished so far are kept")
        except Exception as error:
            if ctx.meta.get("relprop.debug"):
                raise
            failure = CommandError(_missing_extra(error) if isinstance(error, ModuleNotFoundError) else
                                   f"{type(error).__name__}: {error} (rerun with --debug for the traceback)")
        setattr(failure, "ctx", getattr(failure, "ctx", None) or ctx)  # names the command
        raise failure


def _remember_debug(ctx: click.Context, _: click.Parameter, value: bool) -> None:
    ctx.meta["relprop.debug"] = value


class _Group(click.Group):
    command_class = Command


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"], "show_default": True,
                                             "max_content_width": 110})
@click.version_option(__version__, prog_name="relprop", message="%(prog)s %(version)s")
def app() -> None:
    """Layer-wise relevance propagation for PyTorch models: explain images, text and language models' generations,
    evaluate explanations, find the heads that carry a behaviour.

    Each command's line below says what it writes; relprop COMMAND --help gives its options and an example.
    """


def example(*lines: str) -> str:
    """A command's help epilog: its example command lines, kept as written (click rewraps other paragraphs)."""
    return "\b\nExample:\n" + "\n".join(f"  {line}" for line in lines)


# ---------------------------------------------------------------------------------------------------------------
# Shared options

def _check_cmap(_: click.Context, __: click.Parameter, value: str) -> str:
    from relprop import viz

    try:
        viz.colormap(value)
    except ValueError as error:
        raise click.BadParameter(str(error)) from None
    return value


def _writable_folder(ctx: click.Context, _: click.Parameter, value: str) -> Path:
    """``--out``, checked writable before any work: its nearest existing folder takes a test file."""
    out = Path(value)
    existing = out
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise click.BadParameter(f"{value}: {existing} is a file, not a folder")
    try:
        with tempfile.TemporaryFile(dir=existing):
            pass
    except OSError as error:
        why = {errno.EACCES: "permission denied", errno.EPERM: "permission denied",
               errno.EROFS: "a read-only file system", errno.ENOSPC: "no space left on the device"}.get(
                   error.errno or 0, f"the system says: {error.strerror}")
        if existing != out:
            raise click.BadParameter(f"cannot create the folder {value}: {existing} takes no new files or folders "
                                     f"({why}); choose another folder") from None
        raise click.BadParameter(f"{value} is not writable ({why}); choose another folder") from None
    return out


def out_option(default: str = "out") -> Callable[[F], F]:
    """``--out FOLDER``, checked writable before the command starts; the command gets a ``Path``."""
    return click.option("--out", default=default, callback=_writable_folder, metavar="FOLDER",
                        help="Folder for the results (created; checked writable before any work starts).")


def model_options(function: F) -> F:
    """``--model``, ``--weights``, ``--random-weights``: the arguments of :func:`load_model`."""
    options = [
        click.option("--model", required=True, metavar="SPEC",
                     help="efficientnet-lite0 (pretrained on ImageNet, shipped offline), a torchvision model name, "
                          "a torch.export .pt2 file, or module:function returning an nn.Module (the module is looked "
                          "up in the current folder first)."),
        click.option("--weights", type=click.Path(dir_okay=False),
                     help="A state_dict file (torch.save(model.state_dict())) to load into the model."),
        click.option("--random-weights", is_flag=True, help="Allow a torchvision model without --weights."),
    ]
    for option in reversed(options):
        function = option(function)
    return function


def image_options(function: F) -> F:
    """``--size``, ``--channels``, ``--normalize``, ``--crop/--whole``: the arguments of :func:`load_images`."""
    options = [
        click.option("--size", type=click.IntRange(min=1), default=224,
                     help="Images become SIZE x SIZE pixels, cropped or whole (--crop/--whole); 28 for MNIST models."),
        click.option("--channels", type=click.Choice(["1", "3"]), default="3", callback=lambda c, p, v: int(v),
                     help="1 for grey (MNIST), 3 for colour."),
        click.option("--normalize", type=click.Choice(["imagenet", "inception", "none"]), default=None,
                     show_default="the named model's, else imagenet with 3 channels, none with 1",
                     help="Pixel normalisation: ImageNet mean and std, inception (pixels in [-1, 1], as "
                          "efficientnet-lite0 expects), or pixels in [0, 1]."),
        click.option("--crop/--whole", "whole", default=None, callback=lambda c, p, v: None if v is None else not v,
                     show_default="crop with --normalize imagenet, whole with none",
                     help="Resize the short side to SIZE*256/224 and take the centre SIZE x SIZE, as torchvision's "
                          "ImageNet transforms do (the picture shows that crop); or squash the whole image to "
                          "SIZE x SIZE."),
    ]
    for option in reversed(options):
        function = option(function)
    return function


#: the rules ``--func-rule`` can name, each with its default parameters
RULES: dict[str, Callable[[], rules.Rule]] = {
    "epsilon": rules.Epsilon, "lrp-0": lambda: rules.Epsilon(0.0), "zplus": rules.ZPlus,
    "alpha2-beta1": lambda: rules.AlphaBeta(2.0, 1.0), "gamma": rules.Gamma, "flat": rules.Flat,
    "wsquare": rules.WSquare, "pass": rules.Pass, "gradient": rules.Gradient, "proportional": rules.Proportional,
    "smooth-stride": rules.SmoothStride, "uniform": rules.UniformProduct, "softmax": rules.Softmax,
}


def preset_option(function: F) -> F:
    """``--preset``, ``--smooth-stride`` and ``--func-rule``: the LRP rules (a composite of :mod:`relprop.composites`).

    The last two are kept in the click context for :func:`_composite`, so a command takes ``preset`` alone.
    """
    options = [
        click.option("--preset", type=click.Choice(list(composites.PRESETS)), default="epsilon-plus-flat",
                     metavar="NAME", help=f"The LRP rules, one of {', '.join(composites.PRESETS)}."),
        click.option("--smooth-stride", is_flag=True, expose_value=False, callback=_remember_smooth_stride,
                     help="Propagate strided convolutions and max pools (ResNet's stem and downsampling layers) as "
                          "their stride-1 form averaged over each stride x stride block: no checkerboard in the "
                          "heatmap."),
        click.option("--func-rule", multiple=True, metavar="FUNCTION=RULE", expose_value=False,
                     callback=_remember_func_rules,
                     help="The rule for every call of a torch function, by name (repeatable), e.g. "
                          f"max_pool2d=proportional; rules: {', '.join(RULES)}."),
    ]
    for option in reversed(options):
        function = option(function)
    return function


def _remember_smooth_stride(ctx: click.Context, _: click.Parameter, value: bool) -> None:
    ctx.meta["relprop.smooth_stride"] = value


def _remember_func_rules(ctx: click.Context, __: click.Parameter, values: tuple[str, ...]) -> None:
    """``--func-rule NAME=RULE``: the torch function of that name (``torch.nn.functional``, ``torch``, ``Tensor``)."""
    func_map = {}
    for value in values:
        name, _, rule = value.partition("=")
        func = next((f for f in (getattr(namespace, name.strip(), None) for namespace in (torch.nn.functional, torch,
                                                                                            torch.Tensor))
                     if callable(f)), None)
        if func is None:
            raise click.BadParameter(f"{value!r}: no torch function named {name.strip()!r} (give NAME=RULE, with a "
                                     "name from torch.nn.functional or torch, e.g. max_pool2d=proportional)")
        if rule.strip() not in RULES:
            raise click.BadParameter(f"{value!r}: unknown rule {rule.strip()!r}; rules: {', '.join(RULES)}")
        try:
            composites.function_name(func, check=True)
        except ValueError as error:
            raise click.BadParameter(f"{value!r}: {str(error).removeprefix('relprop: ')}") from None
        func_map[func] = RULES[rule.strip()]()
    ctx.meta["relprop.func_map"] = func_map
    ctx.meta["relprop.func_rules"] = values  # as written, for the pictures' titles


def _write_json(data: Any, path: Path) -> None:
    from relprop.viz import atomic_path

    with atomic_path(path) as temporary:
        temporary.write_text(json.dumps(data, indent=1))


def _bar(total: int, desc: str, unit: str) -> Any:
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, unit=unit, disable=None)  # only on a terminal
