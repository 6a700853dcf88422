"""``relprop patch``: which heads, MLPs and residual positions carry a behaviour, by three kinds of patching."""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import click
import torch

from relprop import composites
from relprop.cli.app import CommandError, _write_json, app, example, out_option
from relprop.cli.text import _language_model, _model_name, bars_option
from relprop.workflows.patching import COMPONENTS, METHODS, Patching, recovery


def _ids(tokenizer: Any, text: str, what: str) -> torch.Tensor:
    ids = tokenizer(text, return_tensors="pt", add_special_tokens=False)["input_ids"]
    if ids.shape[1] == 0:
        raise CommandError(f"the {what} {text!r} has no tokens")
    return ids


def _token(tokenizer: Any, text: str, what: str) -> int:
    """The one token id of an answer; an answer of several tokens is refused, naming them."""
    ids = _ids(tokenizer, text, what)[0].tolist()
    if len(ids) > 1:
        pieces = ", ".join(repr(tokenizer.decode([i])) for i in ids)
        raise CommandError(f"the {what} {text!r} is {len(ids)} tokens ({pieces}); the metric is the logit of one "
                           f"token at the last position: give one token, e.g. {tokenizer.decode(ids[:1])!r}")
    return int(ids[0])


def _pictures(found: dict[str, dict[str, torch.Tensor]], tokens: list[str], ks: list[int],
              curves: dict[str, torch.Tensor], out: Path, about: str, preset: str) -> None:
    """heads.png, residual.png and circuit.png, each titled with what was patched and ``about`` (the model, the
    metric, the prompts)."""
    from relprop.viz.patching import save_circuit_curves, save_head_maps, save_residual_maps

    named = {"activation": "activation patching (exact)", "attribution": "attribution patching (gradient)",
             "relp": f"relevance patching (RelP, {preset})"}
    label = "effect on m: m(patched) - m(corrupted)"
    save_head_maps({named[method]: found[method]["heads"] for method in METHODS}, out / "heads.png",
                   title=f"Each attention head patched clean {about}", label=label)
    save_residual_maps({named[method]: found[method]["residual"] for method in METHODS}, tokens,
                       out / "residual.png", title=f"Each position of the residual stream patched clean {about}",
                       label=label)
    save_circuit_curves(ks, {named[method]: curves[method] for method in METHODS}, out / "circuit.png",
                        title=f"The top k heads patched clean, all others corrupted {about}")


@app.command("patch", short_help="Which heads carry a behaviour: heatmaps, curve, JSON.",
             epilog=example('relprop patch --clean "When Mary and John went to the store, John gave a drink to" \\',
                            '    --corrupted "When Mary and John went to the store, Mary gave a drink to" \\',
                            '    --answer " Mary" --foil " John" --out out'))
@click.option("--model", default="smollm2", show_default=True, metavar="NAME",
              help="smollm2 (SmolLM2-135M-Instruct, shipped offline), or a local Hugging Face model folder.")
@click.option("--clean", required=True, help="The prompt that shows the behaviour.")
@click.option("--corrupted", required=True, help="The same prompt, changed where the behaviour is (same token count).")
@click.option("--answer", required=True,
              help="The clean run's answer, one token, e.g. ' Mary' (mind the leading space); several are refused.")
@click.option("--foil", required=True, help="The corrupted run's answer, one token, e.g. ' John'.")
@click.option("--preset", type=click.Choice(["attnlrp", "cp-lrp", "epsilon"]), default="attnlrp",
              help="The rules of relevance patching.")
@bars_option
@out_option()
def patch(model: str, clean: str, corrupted: str, answer: str, foil: str, preset: str, loading_bars: bool,
          out: Path) -> None:
    """Activation, attribution and relevance patching of one prompt pair, metric logit[answer] - logit[foil] at the
    last position: out/heads.png (layers x heads), out/residual.png (layers x positions), out/circuit.png (the
    metric recovered by the top heads of each method) and out/patching.json."""
    torch.set_num_threads(min(torch.get_num_threads(), 4))  # small batches: more threads only contend
    network, loaded = _language_model(model, loading_bars)
    tokenizer: Any = loaded
    clean_ids, corrupted_ids = _ids(tokenizer, clean, "clean prompt"), _ids(tokenizer, corrupted, "corrupted prompt")
    if clean_ids.shape != corrupted_ids.shape:
        raise CommandError(f"the clean prompt has {clean_ids.shape[1]} tokens and the corrupted one "
                           f"{corrupted_ids.shape[1]}: patching needs the same number")
    target = (_token(tokenizer, answer, "answer"), _token(tokenizer, foil, "foil"))
    try:
        pair = Patching(network, clean_ids, corrupted_ids, target)
    except ValueError as error:  # a model that is no decoder patching can read
        raise CommandError(str(error).removeprefix("relprop: ")) from None
    found = {"activation": {name: pair.activation(name)[0] for name in COMPONENTS},
             "attribution": {name: value[0] for name, value in pair.estimate(COMPONENTS, None).items()},
             "relp": {name: value[0] for name, value in pair.estimate(COMPONENTS, composites.get(preset)).items()}}
    m_clean, m_corrupted = (float(m[0]) for m in pair.metrics())
    tokens = [tokenizer.decode([t]) for t in clean_ids[0].tolist()]
    ks = [k for k in (1, 2, 4, 8, 16, 32, 64, 128, 256, 512) if k < found["relp"]["heads"].numel()]
    ks.append(found["relp"]["heads"].numel())
    curves = {method: recovery(network, clean_ids, corrupted_ids, target, found[method]["heads"].unsqueeze(0), ks)[0]
              for method in METHODS}
    click.echo(f"metric logit[{answer!r}] - logit[{foil!r}]: clean {m_clean:.2f}, corrupted {m_corrupted:.2f} "
               f"(relp: {preset})")
    for method in METHODS:
        heads = found[method]["heads"]
        top = heads.flatten().argsort(descending=True)[:3].tolist()
        named = ", ".join(f"L{i // heads.shape[1]}H{i % heads.shape[1]} {heads.flatten()[i]:+.2f}" for i in top)
        click.echo(f"  {method}: top heads {named}; top {ks[min(2, len(ks) - 1)]} recover "
                   f"{float(curves[method][min(2, len(ks) - 1)]):.0%}")
    out.mkdir(parents=True, exist_ok=True)
    about = (f"m = logit[{answer!r}] - logit[{foil!r}] at the last position\nclean: {clean!r} (m {m_clean:.2f})\n"
             f"corrupted: {corrupted!r} (m {m_corrupted:.2f})")
    _pictures(found, tokens, ks, curves, out, f"({_model_name(model)})\n{about}", preset)
    _write_json({"clean": clean, "corrupted": corrupted, "answer": answer, "foil": foil, "preset": preset,
                 "tokens": tokens, "metric": {"clean": m_clean, "corrupted": m_corrupted},
                 **{name: {method: found[method][name].tolist() for method in METHODS} for name in COMPONENTS},
                 "recovery": {"ks": ks, **{method: curves[method].tolist() for method in METHODS}}},
                out / "patching.json")
    click.echo(f"-> {out / 'heads.png'}, {out / 'residual.png'}, {out / 'circuit.png'}, {out / 'patching.json'}",
               file=sys.stdout)
