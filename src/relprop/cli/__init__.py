"""The ``relprop`` command line: ``demo``, ``explain``, ``evaluate``, ``explain-dataset``, ``atlas``,
``explain-text`` and ``patch``.

Examples
--------
relprop demo --out out
relprop explain cat.png --model resnet18 --weights resnet18.pth --preset epsilon-plus-flat --out out
relprop explain digit.png --model mymodels:build --size 28 --channels 1
relprop explain --text "The movie was wonderful" --model path/to/hf-model-folder --preset attnlrp
relprop evaluate *.png --model resnet18 --weights resnet18.pth --out out
relprop explain-dataset images/ --model resnet18 --weights resnet18.pth --out shards --downsample 4
torchrun --nproc_per_node=2 -m relprop.cli explain-dataset images/ --model resnet18 --weights resnet18.pth
relprop explain-text "The capital of France is" --max-new-tokens 4 --out out

Every command is a :class:`Command` of the group :data:`app`: an error is one
line on stderr with exit code 2 (a traceback only with ``--debug``), Ctrl-C
ends with one line and exit code 130, keeping what was finished. Another
module adds a command in a few lines, reusing the shared options::

    from relprop.cli import app, example, image_options, load_images, load_model, model_options, out_option

    @app.command(short_help="What it writes, in one line.", epilog=example("relprop atlas cat.png --model ..."))
    @click.argument("images", nargs=-1, required=True)
    @model_options
    @image_options
    @out_option("atlas")
    def atlas(images, model, weights, random_weights, size, channels, normalize, out):
        \"\"\"One line of help.\"\"\"
        network = load_model(model, weights, random_weights)
        ...
"""
from __future__ import annotations

import sys
from collections.abc import Sequence

import click

from relprop.cli import dataset, explain, patch, text  # noqa: F401  (each adds its commands to the group)
from relprop.cli.app import (Command, CommandError, app, example, image_options, model_options, out_option,
                             preset_option)
from relprop.cli.inputs import load_images, load_model, readable_images

__all__ = ["main", "app", "Command", "CommandError", "load_model", "load_images", "readable_images",
           "model_options", "image_options", "out_option", "preset_option", "example"]


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``relprop`` command: returns the exit code."""
    try:
        result = app.main(args=list(argv) if argv is not None else None, prog_name="relprop", standalone_mode=False)
    except click.ClickException as error:
        context = getattr(error, "ctx", None)
        where = context.command_path if context is not None else "relprop"
        hint = f" (see {where} --help)" if isinstance(error, click.UsageError) else ""
        click.echo(f"{where}: error: {' '.join(error.format_message().split())}{hint}", err=True)
        return error.exit_code
    except click.Abort:  # Ctrl-C while click itself was parsing
        click.echo("relprop: interrupted", err=True)
        return 130
    return result if isinstance(result, int) else 0


if __name__ == "__main__":
    sys.exit(main())
