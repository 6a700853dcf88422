"""``relprop explain-text``: what a language model writes, and which words of the context made it write each token."""
from __future__ import annotations

import sys
from pathlib import Path

import click
import torch

from relprop import composites
from relprop.cli.app import CommandError, _write_json, app, out_option
from relprop.workflows.generation import explain_generation


def _language_model(name: str) -> tuple[torch.nn.Module, object]:
    """``smollm2`` (the packaged SmolLM2-135M-Instruct), or a local Hugging Face causal language model folder."""
    if name == "smollm2":
        from relprop.workflows.smollm2 import load_smollm2

        try:
            return load_smollm2()
        except ImportError as error:  # the package or an extra missing: the message says what to install
            raise CommandError(str(error)) from None
    if not Path(name).is_dir():
        raise CommandError(f"no such model: {name} (use smollm2, or a folder with a Hugging Face causal language "
                           "model)")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return AutoModelForCausalLM.from_pretrained(name).eval(), AutoTokenizer.from_pretrained(name)


@app.command("explain-text")
@click.argument("prompt")
@click.option("--model", default="smollm2", show_default=True, metavar="NAME",
              help="smollm2 (SmolLM2-135M-Instruct, shipped offline), or a local Hugging Face model folder.")
@click.option("--max-new-tokens", type=click.IntRange(1, 512), default=16, help="Tokens to generate (greedy).")
@click.option("--continuation", default=None, help="Explain this text after the prompt instead of generating.")
@click.option("--preset", type=click.Choice(["attnlrp", "cp-lrp"]), default="attnlrp",
              help="AttnLRP, or CP-LRP (attention weights and gates held constant).")
@out_option()
def explain_text(prompt: str, model: str, max_new_tokens: int, continuation: str | None, preset: str,
                 out: Path) -> None:
    """Generate from PROMPT and explain every generated token: out/generation.html (hover a token to see its
    sources), out/relevance.png (the relevance matrix) and out/generation.json."""
    from relprop import viz

    torch.set_num_threads(min(torch.get_num_threads(), 4))  # small batches: more threads only contend
    network, tokenizer = _language_model(model)
    found = explain_generation(network, prompt, max_new_tokens=None if continuation else max_new_tokens,
                               continuation=continuation, composite=composites.get(preset), tokenizer=tokenizer)
    tokens = found.tokens[0] if found.tokens is not None else []
    prompt_length = found.prompt_length
    click.echo(f"{prompt!r} -> {''.join(tokens[prompt_length:])!r} ({preset})")
    for g, row in enumerate(found.relevance[0]):
        context = row[:prompt_length + g]
        top = context[1:].abs().argsort(descending=True)[:3] + 1  # the first token apart: often a sink
        sources = ", ".join(f"{tokens[i]!r} {context[i]:+.2f}" for i in top.tolist())
        total = context.abs().sum().clamp_min(1e-30)
        click.echo(f"  {tokens[prompt_length + g]!r}: {sources} (of |relevance|: first token "
                   f"{context[0].abs() / total:.0%}, predicting token {context[-1].abs() / total:.0%})")
    out.mkdir(parents=True, exist_ok=True)
    with viz.atomic_path(out / "generation.html") as temporary:
        temporary.write_text(found.html(), encoding="utf-8")
    viz.save_generation_matrix(found, out / "relevance.png")
    _write_json({"prompt": prompt, "tokens": tokens, "prompt_length": prompt_length, "preset": preset,
                 "ids": found.sequences[0].tolist(), "relevance": found.relevance[0].tolist()},
                out / "generation.json")
    click.echo(f"-> {out / 'generation.html'}, {out / 'relevance.png'}", file=sys.stdout)
