"""``relprop demo``, ``relprop explain`` and ``relprop evaluate``."""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import click
import torch
from torch import Tensor

from relprop.cli.app import (
    CommandError,
    _bar,
    _check_cmap,
    _write_json,
    app,
    example,
    image_options,
    model_options,
    out_option,
    preset_option,
)
from relprop.cli.inputs import (
    NAMED_MODELS,
    NAMED_NORMALIZATION,
    _composite,
    _output_names,
    crops,
    load_images,
    load_model,
    predict,
    readable_images,
    shape_advice,
)
from relprop.methods.attribution import LRP
from relprop.workflows.dataset import explain_batch


@app.command(short_help="MNIST demo: heatmaps.png, pixel_flipping.png, aopc.json.",
             epilog=example("relprop demo --out out"))
@out_option()
@click.option("--examples", type=click.IntRange(1, 1000), default=8, help="Test digits shown in the heatmap grid.")
@click.option("--evaluated", type=click.IntRange(1, 1000), default=200, help="Test digits used for pixel flipping.")
def demo(out: Path, examples: int, evaluated: int) -> None:
    """Train a small CNN on real MNIST digits, explain it with several methods and evaluate them."""
    from relprop.cli import demo as demo_module

    demo_module.run(out, examples=examples, evaluated=evaluated)


@app.command(short_help="A heatmap and an overlay per image, and explain.json.",
             epilog=example("relprop explain --model efficientnet-lite0 --sample-photos --figure --out out",
                            "relprop explain cat.png --model resnet18 --weights resnet18.pth --out out"))
@click.argument("images", nargs=-1, type=click.Path())
@model_options
@preset_option
@image_options
@out_option()
@click.option("--target", type=click.IntRange(min=0), default=None, show_default="each image's top class",
              help="Class (or, with --text, token id) to explain.")
@click.option("--batch-size", type=click.IntRange(min=1), default=16, help="Images explained together.")
@click.option("--cmap", default="bwr", callback=_check_cmap, help="Colour map: a matplotlib name, or coldnhot.")
@click.option("--clip", type=click.FloatRange(0, 100, min_open=True), default=None, show_default="off",
              help="Scale each heatmap by this percentile of |relevance| (e.g. 99.5) instead of its maximum.")
@click.option("--scale", type=click.IntRange(min=1), default=1,
              help="Draw each heatmap pixel at least SCALE x SCALE screen pixels (small maps are enlarged to about "
                   "256 pixels anyway, so that the title and the colour bar fit).")
@click.option("--figure", is_flag=True, help="Also write explain.png: every image and its heatmap, with the "
                                             "predicted class and a colour bar (one row per image).")
@click.option("--strict", is_flag=True, help="Fail on ops without an LRP rule instead of warning.")
@click.option("--compile", "compiled", is_flag=True, help="Explain through one torch.compile program (pays from "
                                                        "a few batches of one shape on; see docs/design.md).")
@click.option("--text", default=None, help="Explain this text instead of images; --model is then a local Hugging "
                                           "Face model folder (needs pip install 'relprop[text]').")
@click.option("--sample-photos", is_flag=True, help="Also explain the photos scikit-image ships (a cat, coffee, "
                                                    "an astronaut, ...), written to OUT/photos first.")
def explain(images: tuple[str, ...], model: str, weights: str | None, random_weights: bool, preset: str, size: int,
            channels: int, normalize: str | None, whole: bool | None, out: Path, target: int | None, batch_size: int,
            cmap: str, clip: float | None, scale: int, figure: bool, strict: bool, text: str | None,
            sample_photos: bool, compiled: bool) -> None:
    """Write a relevance heatmap and an overlay per image, and explain.json.

    Each picture has a title (the class explained, and the options that made it) and a
    colour bar with its range of relevance; the overlay is drawn on the crop the model saw.
    Output names follow the images' paths below their common folder. An image that
    cannot be read is skipped with a warning (the others are explained); if none
    can be read, nothing is done. A blank map (a logit of 0, relevance all zero) is
    explained with a warning. Ctrl-C keeps the images finished so far.
    """
    if text is not None:
        return _explain_text(text, model, preset, target, out)
    if sample_photos:
        images = (*images, *_write_sample_photos(out / "photos"))
    if not images:
        raise CommandError("give image files (or --sample-photos), or --text with a Hugging Face model folder as "
                           "--model")
    from relprop import viz

    paths = readable_images(images, channels)
    network = load_model(model, weights, random_weights)
    normalize = normalize or NAMED_NORMALIZATION.get(model)
    names_of = _class_names(model)
    composite, preset = _model_composite(model, preset, normalize, channels)
    lrp = LRP(network, composite, strict=strict, compile=compiled)
    names = _output_names(paths)
    options = _options_text(preset, clip, normalize, channels, whole)
    summary: list[dict[str, Any]] = []
    shown: list[tuple[Tensor, Tensor]] = []  # pixels and channel-summed relevance, for --figure
    with _bar(len(paths), "explaining", "image") as bar:
        for start in range(0, len(paths), batch_size):
            batch = slice(start, start + batch_size)
            inputs, raw = load_images(paths[batch], size, normalize, channels, whole)
            entries, relevance = _explain_batch(lrp, inputs, target)
            for entry, path, name, image, rel in zip(entries, paths[batch], names[batch], raw, relevance):
                files = {kind: out / f"{name}_{kind}.png" for kind in ("relevance", "overlay")}
                entry = {"image": path, **entry, "warning": _blank(entry, rel),
                         **{kind: str(file) for kind, file in files.items()}}
                if names_of is not None:
                    entry["class_name"], entry["prediction_name"] = names_of(entry["target"]), names_of(
                        entry["prediction"])
                named = f" ({entry['class_name']})" if names_of is not None else ""
                bar.write(f"{path}: class {entry['target']}{named} (logit {entry['logit']:.3f}, relevance sum "
                          f"{entry['relevance_sum']:.3f}) -> {files['relevance']}", file=sys.stdout)
                if entry["warning"] is not None:
                    bar.write(f"relprop: warning: {path}: a blank map, {entry['warning']}", file=sys.stderr)
                title = (f"{name}: class {entry['target']}{named} (logit {entry['logit']:.3g}, relevance sum "
                         f"{entry['relevance_sum']:.3g}"
                         + (f"; blank: {entry['warning']}" if entry["warning"] else "") + f")\n{options}")
                viz.save_explanation(rel, files["relevance"], title=title, cmap=cmap, clip=clip, scale=scale)
                viz.save_explanation(rel, files["overlay"], image=image, title=title, cmap=cmap, clip=clip,
                                     scale=scale)
                summary.append(entry)
                if figure:
                    shown.append((image, rel.sum(0)))
            _write_json(summary, out / "explain.json")  # after every batch: it lists exactly the finished images
            bar.update(len(relevance))
    if lrp.compiled is not None:  # whether the last batch ran compiled: a fallback was warned about when it came
        ran = ("ran compiled" if lrp.compiled.fallback is None else
               f"ran under interception ({lrp.compiled.fallback})")
        click.echo(f"--compile: the last batch {ran}; {lrp.compiled.compilations} program(s) compiled")
    if figure:
        classes = None if names_of is None else [names_of(i) for i in range(max(e["prediction"] for e in summary) + 1)]
        column = f"LRP {preset}" + (f", class {target}" if target is not None else "")
        viz.save_heatmap_grid(torch.stack([p for p, _ in shown]), {column: torch.stack([r for _, r in shown])},
                              out / "explain.png", predictions=[e["prediction"] for e in summary], cmap=cmap,
                              clip=clip, title=options, class_names=classes)
    summaries = [out / "explain.json", *([out / "explain.png"] if figure else [])]
    click.echo(f"-> {', '.join(map(str, summaries))}, and a _relevance.png and an _overlay.png per image in {out}")


def _options_text(preset: str, clip: float | None, normalize: str | None, channels: int, whole: bool | None) -> str:
    """The options that made the pictures, for their titles: ``LRP epsilon-plus-flat, --smooth-stride, ...``."""
    ctx = click.get_current_context(silent=True)
    meta = ctx.meta if ctx is not None else {}
    parts = [f"LRP {preset}"]
    if meta.get("relprop.smooth_stride"):
        parts.append("--smooth-stride")
    parts += [f"--func-rule\u00a0{rule}" for rule in meta.get("relprop.func_rules", ())]  # kept on one line
    parts.append(f"--clip\u00a0{clip:g}" if clip is not None else "no --clip")
    parts.append("centre crop" if crops(normalize, channels, whole) else "whole image")
    return ", ".join(parts)


def _blank(entry: dict[str, Any], relevance: Tensor) -> str | None:
    """Why an image's map is blank (or meaningless), or None: the logit is 0, the relevance is zero or not finite."""
    if entry["logit"] == 0:
        return "logit is 0"
    if not torch.isfinite(relevance).all():
        return "relevance is not finite (NaN or infinite)"
    if not relevance.any():
        return "relevance is all zero"
    if not relevance.sum(0).any():
        return "relevance cancels to zero in every pixel (over the channels)"
    return None


def _write_sample_photos(folder: Path) -> list[str]:
    """scikit-image's sample photos as PNG files in ``folder``, for the model to read like the user's."""
    from PIL import Image

    from relprop.workflows.imagenet import sample_photos

    try:
        photos = sample_photos()
    except ImportError as error:
        raise CommandError(str(error).removeprefix("relprop: ")) from None
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, array in photos.items():
        path = folder / f"{name}.png"
        Image.fromarray(array).save(path)
        paths.append(str(path))
    return paths


def _class_names(model: str) -> Any:
    """``index -> English name`` of an ImageNet model by name, else None."""
    if model not in NAMED_MODELS:
        return None
    from relprop.workflows.imagenet import class_name

    return class_name


def _model_composite(model: str, preset: str, normalize: str | None, channels: int) -> tuple[Any, str]:
    """The preset and its name; for efficientnet-lite0 without --preset, the composite measured most faithful
    on it."""
    source = click.get_current_context().get_parameter_source("preset")
    if model == "efficientnet-lite0" and source in (None, click.core.ParameterSource.DEFAULT):
        from relprop.workflows.imagenet import efficientnet_composite

        return efficientnet_composite(), "efficientnet (Gamma by depth)"
    return _composite(preset, normalize, channels), preset


def _explain_batch(lrp: LRP, inputs: Tensor, target: int | None) -> tuple[list[dict], Tensor]:
    """One batch explained: per image its target, prediction, logit and relevance sum; and the relevance."""
    with shape_advice(inputs):
        relevance, logits, chosen = explain_batch(lrp, inputs, lambda logits: _targets(target, logits))
    entries = [{"target": t, "prediction": int(row.argmax()), "logit": row[t].item(), "relevance_sum": r.sum().item()}
               for t, row, r in zip(chosen, logits, relevance)]
    return entries, relevance


def _targets(target: int | None, logits: Tensor) -> list[int]:
    classes = logits.shape[1] if logits.dim() == 2 else 0
    if logits.dim() != 2:
        raise CommandError(f"the model gives outputs of shape {tuple(logits.shape)}; explain needs one score per "
                           "class, (batch, classes)")
    if target is not None and target >= classes:
        raise CommandError(f"--target {target} is out of range: the model has {classes} classes (0 to {classes - 1})")
    return [target] * len(logits) if target is not None else logits.argmax(1).tolist()


def _explain_text(text: str, folder: str, preset: str, target: int | None, out: Path) -> None:
    """A local Hugging Face model folder: relevance per token of ``text``, printed and written as HTML."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

    from relprop import viz
    from relprop.workflows.smollm2 import loading_bars

    if not Path(folder).is_dir():
        raise CommandError(f"no such model folder: {folder} (with --text, --model is a Hugging Face model folder)")
    config = AutoConfig.from_pretrained(folder)
    causal = any(name.endswith("ForCausalLM") for name in (config.architectures or []))
    factory = AutoModelForCausalLM if causal else AutoModelForSequenceClassification
    with loading_bars(False):  # transformers' "Loading weights" bar would clutter the relevance printed
        model = factory.from_pretrained(folder).eval()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    encoded = tokenizer([text], return_tensors="pt")
    with torch.no_grad():
        logits = model(**encoded).logits
    scores = logits[0, -1] if causal else logits[0]
    if target is not None and target >= len(scores):
        raise CommandError(f"--target {target} is out of range: the model has {len(scores)} "
                           f"{'tokens' if causal else 'classes'} (0 to {len(scores) - 1})")
    chosen = target if target is not None else int(scores.argmax())
    preset = preset if preset in ("attnlrp", "cp-lrp") else "attnlrp"
    relevance = LRP(model, _composite(preset, None, 3)).attribute(
        encoded["input_ids"], target=(-1, chosen) if causal else chosen,
        additional_forward_args={"attention_mask": encoded["attention_mask"]})
    tokens = tokenizer.convert_ids_to_tokens(encoded["input_ids"][0])
    label = tokenizer.decode([chosen]) if causal else (config.id2label or {}).get(chosen, str(chosen))
    click.echo(f"explaining {'next token' if causal else 'class'} {label!r} ({preset}):")
    click.echo(viz.text_terminal(tokens, relevance[0]) if sys.stdout.isatty() else
               " ".join(f"{token}({value:+.3g})" for token, value in zip(tokens, relevance[0].tolist())))
    with viz.atomic_path(out / "text.html") as temporary:
        temporary.write_text(viz.text_html(tokens, relevance[0]))
    _write_json({"tokens": tokens, "relevance": relevance[0].tolist(), "target": chosen, "label": label},
                out / "text.json")
    click.echo(f"-> {out / 'text.html'}, {out / 'text.json'}")


@app.command(short_help="Pixel-flipping AOPC per method: aopc.json and a plot.",
             epilog=example("relprop evaluate digits/*.png --model mymodels:build --size 28 --channels 1 --out out"))
@click.argument("images", nargs=-1, required=True, type=click.Path())
@model_options
@preset_option
@image_options
@out_option()
@click.option("--steps", type=click.IntRange(min=1), default=50,
              help="Perturbation steps; step k has replaced k/STEPS of the regions.")
@click.option("--region", type=click.IntRange(min=1), default=8, help="Side in pixels of the square regions replaced.")
@click.option("--baseline", default="0.0", callback=lambda c, p, v: _baseline(v),
              help="The value replaced regions take (in the model's normalised input), or uniform (noise).")
def evaluate(images: tuple[str, ...], model: str, weights: str | None, random_weights: bool, preset: str, size: int,
             channels: int, normalize: str | None, whole: bool | None, out: Path, steps: int, region: int,
             baseline: float | str) -> None:
    """Pixel-flipping AOPC of LRP against Gradient, Integrated Gradients and a random order.

    Prints the scores, then writes aopc.json and pixel_flipping.png. An image that
    cannot be read is skipped with a warning; if none can be read, nothing is done.
    """
    from relprop import methods, viz
    from relprop.workflows import evaluate as evaluation

    paths = readable_images(images, channels)
    network = load_model(model, weights, random_weights)
    normalize = normalize or NAMED_NORMALIZATION.get(model)
    inputs, _ = load_images(paths, size, normalize, channels, whole)
    target = torch.tensor(_targets(None, predict(network, inputs)))
    composite, preset = _model_composite(model, preset, normalize, channels)
    explainers: dict[str, Any] = {f"LRP {preset}": LRP(network, composite),
                                  "Gradient": methods.InputGradient(network),
                                  "Integrated Gradients": methods.IntegratedGradients(network)}
    curves = {}
    for name, explainer in [*explainers.items(), ("random", None)]:
        attribution = explainer.attribute(inputs, target=target) if explainer is not None else None
        curves[name] = evaluation.pixel_flipping(network, inputs, attribution, target, steps=steps, region=region,
                                                 baseline=baseline, generator=torch.Generator().manual_seed(0),
                                                 progress=f"pixel flipping: {name}")
    scores = {name: evaluation.aopc(curve).mean().item() for name, curve in curves.items()}
    click.echo(f"AOPC on {len(paths)} image(s), {region}x{region} regions set to {baseline}, most relevant first "
               "(higher is better):")
    for name, score in sorted(scores.items(), key=lambda item: -item[1]):
        click.echo(f"  {name:28s} {score:.4f}")
    _write_json(scores, out / "aopc.json")
    viz.save_pixel_flipping({f"{region}x{region} regions set to {baseline}": curves}, out / "pixel_flipping.png")
    click.echo(f"wrote {out / 'aopc.json'}, {out / 'pixel_flipping.png'}")


def _baseline(value: str) -> float | str:
    if value == "uniform":
        return value
    try:
        return float(value)
    except ValueError:
        raise click.BadParameter(f"{value!r} is neither a number nor uniform") from None
