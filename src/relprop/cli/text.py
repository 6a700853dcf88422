"""``relprop explain-text``: what a language model writes, and which words of the context made it write each token."""
from __future__ import annotations

import sys
from datetime import UTC, datetime
from pathlib import Path

import click
import torch

from relprop import composites
from relprop.cli.app import CommandError, _write_json, app, example, out_option
from relprop.workflows.generation import Generation, explain_generation


def _language_model(name: str, bars: bool = False) -> tuple[torch.nn.Module, object]:
    """``smollm2`` (the packaged SmolLM2-135M-Instruct), or a local Hugging Face causal language model folder.

    transformers' loading bars show with ``bars`` only.
    """
    if name == "smollm2":
        from relprop.workflows import smollm2

        try:
            if not (smollm2.cache_folder() / "config.json").is_file():
                click.echo(f"relprop: converting SmolLM2's GGUF file once, into {smollm2.cache_folder()} (about a "
                           "minute; later runs load it in seconds)", err=True)
            return smollm2.load_smollm2(progress=bars)
        except ImportError as error:  # the package or an extra missing: the message says what to install
            raise CommandError(str(error)) from None
    if not Path(name).is_dir():
        raise CommandError(f"no such model: {name} (use smollm2, or a folder with a Hugging Face causal language "
                           "model)")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from relprop.workflows.smollm2 import loading_bars

    with loading_bars(bars):
        return AutoModelForCausalLM.from_pretrained(name).eval(), AutoTokenizer.from_pretrained(name)


#: the option that shows transformers' loading bars, shared by the commands that load a language model
bars_option = click.option("--loading-bars", is_flag=True,
                           help="Show transformers' progress bars while the model loads (hidden by default).")


def _model_name(model: str) -> str:
    """The model as the outputs name it: SmolLM2's own name, or its folder's."""
    return "SmolLM2-135M-Instruct" if model == "smollm2" else Path(model).resolve().name


def _print_sources(found: Generation, prompt: str, preset: str) -> None:
    """The generation, then per generated token its three strongest sources and the share of the first and the
    predicting token."""
    tokens = found.tokens[0] if found.tokens is not None else []
    length = found.prompt_length
    click.echo(f"{prompt!r} -> {''.join(tokens[length:])!r} ({preset})")
    for g, row in enumerate(found.relevance[0]):
        context = row[:length + g]
        top = context[1:].abs().argsort(descending=True)[:3] + 1  # the first token apart: often a sink
        sources = ", ".join(f"{tokens[i]!r} {context[i]:+.2f}" for i in top.tolist())
        total = context.abs().sum().clamp_min(1e-30)
        click.echo(f"  {tokens[length + g]!r}: {sources} (of |relevance|: first token "
                   f"{context[0].abs() / total:.0%}, predicting token {context[-1].abs() / total:.0%})")


@app.command("explain-text", short_help="Explain a language model's generation: HTML, PNG, JSON.",
             epilog=example('relprop explain-text "The capital of France is" --max-new-tokens 4 --out out'))
@click.argument("prompt")
@click.option("--model", default="smollm2", show_default=True, metavar="NAME",
              help="smollm2 (SmolLM2-135M-Instruct, shipped offline), or a local Hugging Face model folder.")
@click.option("--max-new-tokens", type=click.IntRange(1, 512), default=16,
              help="Tokens to generate (greedy); fewer where the model writes its end-of-sequence token.")
@click.option("--continuation", default=None, help="Explain this text after the prompt instead of generating.")
@click.option("--preset", type=click.Choice(["attnlrp", "cp-lrp"]), default="attnlrp",
              help="AttnLRP, or CP-LRP (attention weights and gates held constant).")
@bars_option
@out_option()
def explain_text(prompt: str, model: str, max_new_tokens: int, continuation: str | None, preset: str,
                 loading_bars: bool, out: Path) -> None:
    """Generate from PROMPT and explain every generated token: out/generation.html (hover a token to see its
    sources), out/relevance.png (the relevance matrix) and out/generation.json.

    Prints the generation and, per generated token, the three context tokens most relevant for it. Generation
    stops early, and says so, where the model writes its end-of-sequence token."""
    from relprop import viz

    torch.set_num_threads(min(torch.get_num_threads(), 4))  # small batches: more threads only contend
    network, tokenizer = _language_model(model, loading_bars)
    found = explain_generation(network, prompt, max_new_tokens=None if continuation else max_new_tokens,
                               continuation=continuation, composite=composites.get(preset), tokenizer=tokenizer)
    _print_sources(found, prompt, preset)
    tokens = found.tokens[0] if found.tokens is not None else []
    generated = found.generated.shape[1]
    written = f"{generated} tokens, teacher-forced (--continuation)" if continuation else f"{generated} tokens"
    if continuation is None and generated < max_new_tokens:  # generate() stops early only at end-of-sequence
        written += f", stopped at the end-of-sequence token {tokens[-1]!r}"
        click.echo(f"stopped at the end-of-sequence token {tokens[-1]!r} after {generated} of the "
                   f"{max_new_tokens} tokens asked for (--max-new-tokens)")
    header = {"prompt": prompt, "generated": written, "model": _model_name(model), "preset": preset,
              "date": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")}
    out.mkdir(parents=True, exist_ok=True)
    files = [out / "generation.html", out / "relevance.png", out / "generation.json"]
    with viz.atomic_path(files[0]) as temporary:
        temporary.write_text(found.html(header=header), encoding="utf-8")
    viz.save_generation_matrix(found, files[1], title=f"Relevance of each context token for each generated token "
                               f"({header['model']}, {preset})\nprompt: {prompt!r}; {written}")
    _write_json({**header, "tokens": tokens, "prompt_length": found.prompt_length,
                 "ids": found.sequences[0].tolist(), "relevance": found.relevance[0].tolist()}, files[2])
    click.echo(f"-> {', '.join(map(str, files))}", file=sys.stdout)
