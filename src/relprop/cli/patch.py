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
from relprop.workflows.circuits import faithfulness
from relprop.workflows.components import BLOCK_KINDS as COMPONENTS
from relprop.workflows.patching import METHODS, Patching, recovery

#: the rules relevance patching can take: RelP's own (the first, relprop.patching's default too), and the LRP
#: presets for transformers
PRESETS = ("relp", "relp-ah", "attnlrp", "cp-lrp", "epsilon")
#: the kinds patched unless --components says otherwise
DEFAULT_COMPONENTS = ("heads", "mlps", "residual")
#: the kinds with one unit per layer and position, drawn as layers x positions maps with the tokens: what was
#: patched (the title), and what a row is
BY_POSITION = {"residual": ("Each position of the residual stream",
                            "residual stream entering layer\n(the last row: leaving the last)"),
               "attn_out": ("Each attention block's output at each position", "attention output of layer"),
               "mlp_out": ("Each MLP's output at each position", "MLP output of layer")}
#: the kinds a circuit is made of (MIB's nodes): the residual stream carries everything, so it is none
CIRCUIT_KINDS = ("heads", "mlps", "attn_out", "mlp_out")


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


def _names(preset: str) -> dict[str, str]:
    """Each method as the pictures name it."""
    return {"activation": "activation patching (exact)", "attribution": "attribution patching (gradient)",
            "relp": f"relevance patching (RelP, {preset})"}


def _maps(found: dict[str, dict[str, torch.Tensor]], kinds: list[str], tokens: list[str], out: Path,
          about: str, preset: str) -> list[Path]:
    """One picture per kind drawn as maps: heads.png (layers x heads) and NAME.png for the kinds by position."""
    from relprop.viz.patching import save_head_maps, save_residual_maps

    named, label = _names(preset), "effect on m: m(patched) - m(corrupted)"
    written = []
    for kind in kinds:
        values = {named[method]: found[method][kind] for method in METHODS}
        if kind == "heads":
            written.append(save_head_maps(values, out / "heads.png", title=f"Each attention head patched clean "
                                          f"{about}", label=label))
        elif kind in BY_POSITION:
            what, rows = BY_POSITION[kind]
            written.append(save_residual_maps(values, tokens, out / f"{kind}.png", label=label, rows=rows,
                                              title=f"{what} patched clean {about}"))
    return written


@app.command("patch", short_help="Which heads carry a behaviour: heatmaps, curves, JSON.",
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
@click.option("--components", "kinds", type=click.Choice(list(COMPONENTS)), multiple=True,
              default=DEFAULT_COMPONENTS, show_default=True,
              help="The kinds of component patched (repeatable): heads, MLPs, the residual stream per position, "
                   "attention and MLP outputs per position (attn_out, mlp_out: the RelP paper's grid).")
@click.option("--preset", type=click.Choice(PRESETS), default="relp",
              help="The rules of relevance patching: relp and relp-ah are RelP's own (Jafari et al. 2025).")
@bars_option
@out_option()
def patch(model: str, clean: str, corrupted: str, answer: str, foil: str, kinds: tuple[str, ...], preset: str,
          loading_bars: bool, out: Path) -> None:
    """Activation, attribution and relevance patching of one prompt pair, metric logit[answer] - logit[foil] at the
    last position: out/heads.png (layers x heads), out/residual.png (layers x positions; attn_out.png and
    mlp_out.png alike), out/circuit.png (the metric recovered by the top heads of each method),
    out/faithfulness.png (each method's circuits of heads and MLPs as MIB scores them, CPR and CMD) and
    out/patching.json."""
    torch.set_num_threads(min(torch.get_num_threads(), 4))  # small batches: more threads only contend
    chosen = list(dict.fromkeys(kinds))
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
    found = {"activation": {name: pair.activation(name)[0] for name in chosen},
             "attribution": {name: value[0] for name, value in pair.estimate(chosen, None).items()},
             "relp": {name: value[0] for name, value in pair.estimate(chosen, composites.get(preset)).items()}}
    m_clean, m_corrupted = (float(m[0]) for m in pair.metrics())
    click.echo(f"metric logit[{answer!r}] - logit[{foil!r}]: clean {m_clean:.2f}, corrupted {m_corrupted:.2f} "
               f"(relevance patching's rules: {preset})")
    out.mkdir(parents=True, exist_ok=True)
    about = (f"({_model_name(model)})\nm = logit[{answer!r}] - logit[{foil!r}] at the last position\n"
             f"clean: {clean!r} (m {m_clean:.2f})\ncorrupted: {corrupted!r} (m {m_corrupted:.2f})")
    tokens = [tokenizer.decode([t]) for t in clean_ids[0].tolist()]
    written = _maps(found, chosen, tokens, out, about, preset)
    saved: dict[str, Any] = {"clean": clean, "corrupted": corrupted, "answer": answer, "foil": foil,
                             "preset": preset, "model": _model_name(model), "components": chosen, "tokens": tokens,
                             "metric": {"clean": m_clean, "corrupted": m_corrupted},
                             **{name: {method: found[method][name].tolist() for method in METHODS}
                                for name in chosen}}
    if "heads" in chosen:
        saved["recovery"] = _recovery(network, (clean_ids, corrupted_ids), target, found, out, about, preset)
        written.append(out / "circuit.png")
    circuit = [kind for kind in chosen if kind in CIRCUIT_KINDS]
    if circuit:
        saved["faithfulness"] = _faithfulness_curves(network, (clean_ids, corrupted_ids), target, found, circuit,
                                                     out, about, preset)
        written.append(out / "faithfulness.png")
    _write_json(saved, out / "patching.json")
    click.echo(f"-> {', '.join(str(path) for path in [*written, out / 'patching.json'])}", file=sys.stdout)


def _recovery(network: torch.nn.Module, ids: tuple[torch.Tensor, torch.Tensor], target: tuple[int, int],
              found: dict[str, dict[str, torch.Tensor]], out: Path, about: str, preset: str) -> dict[str, Any]:
    """The share of the metric the top k heads of each method recover: printed, drawn (circuit.png), returned."""
    from relprop.viz.patching import save_circuit_curves

    units = found["relp"]["heads"].numel()
    ks = [k for k in (1, 2, 4, 8, 16, 32, 64, 128, 256, 512) if k < units] + [units]
    curves = {method: recovery(network, *ids, target, found[method]["heads"].unsqueeze(0), ks)[0]
              for method in METHODS}
    shown = min(2, len(ks) - 1)
    for method in METHODS:
        heads = found[method]["heads"]
        top = heads.flatten().argsort(descending=True)[:3].tolist()
        named = ", ".join(f"L{i // heads.shape[1]}H{i % heads.shape[1]} {heads.flatten()[i]:+.2f}" for i in top)
        click.echo(f"  {method}: top heads {named}; top {ks[shown]} recover {float(curves[method][shown]):.0%}")
    names = _names(preset)
    save_circuit_curves(ks, {names[method]: curves[method] for method in METHODS}, out / "circuit.png",
                        title=f"The top k heads patched clean, all others corrupted {about}")
    return {"ks": ks, **{method: curves[method].tolist() for method in METHODS}}


def _faithfulness_curves(network: torch.nn.Module, ids: tuple[torch.Tensor, torch.Tensor], target: tuple[int, int],
                         found: dict[str, dict[str, torch.Tensor]], kinds: list[str], out: Path, about: str,
                         preset: str) -> dict[str, Any]:
    """Each method's circuits of ``kinds`` scored as MIB scores them: printed, drawn (faithfulness.png), returned."""
    from relprop.viz.circuits import save_faithfulness_curves

    scored = {method: faithfulness(network, *ids, target, {kind: found[method][kind].unsqueeze(0) for kind in kinds})
              for method in METHODS}
    click.echo(f"  circuits of {', '.join(kinds)} at MIB's sizes: " + ", ".join(
        f"{method} CPR {scored[method].cpr:.3f} CMD {scored[method].cmd:.3f}" for method in METHODS))
    names = _names(preset)
    save_faithfulness_curves({names[method]: scored[method] for method in METHODS}, out / "faithfulness.png",
                             title=f"Faithfulness F of each method's circuits: its top units ({', '.join(kinds)}) "
                                   f"patched clean, the rest corrupted {about}")
    return {method: {"budgets": list(value.budgets), "sizes": list(value.sizes), "curve": value.curve.tolist(),
                     "cpr": value.cpr, "cmd": value.cmd} for method, value in scored.items()}
