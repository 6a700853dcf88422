"""The pages relprop writes, in a real browser: headless Chromium (Debian's ``chromium`` and ``chromium-driver``)
under Selenium, started as examples/generation_page.py starts it.

Each page is read back from the browser's computed styles and compared with colours computed here from the
relevance; each makes no network request (every URL in Chrome's DevTools log is file: or data:) and writes
no error to the console.
"""
from __future__ import annotations

import json
import math
import re
import sys
from pathlib import Path

import pytest
import torch

import relprop
from relprop import viz

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
pytest.importorskip("selenium", reason="needs selenium (pip install selenium)")
transformers = pytest.importorskip("transformers")
import generation_page  # noqa: E402
from selenium.webdriver.common.action_chains import ActionChains  # noqa: E402
from selenium.webdriver.common.by import By  # noqa: E402

if not (generation_page.CHROMIUM.exists() and generation_page.CHROMEDRIVER.exists()):
    pytest.skip(f"needs {generation_page.CHROMIUM} and {generation_page.CHROMEDRIVER} "
                "(apt-get install chromium chromium-driver)", allow_module_level=True)


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    driver = generation_page.chromium(tmp_path_factory.mktemp("profile"))
    try:
        yield driver
    finally:
        driver.quit()


def open_page(browser, path: Path) -> None:
    """Open ``path`` with the logs of whatever came before emptied (reading a log empties it)."""
    browser.get("about:blank")
    browser.get_log("performance")
    browser.get_log("browser")
    browser.get(path.as_uri())


def requests_and_errors(browser) -> tuple[list[str], list[str]]:
    """The URLs the page asked for since :func:`open_page`, and its console's warnings and errors."""
    urls = []
    for entry in browser.get_log("performance"):
        message = json.loads(entry["message"])["message"]
        if message["method"] in ("Network.requestWillBeSent", "Network.webSocketCreated"):
            urls.append(message["params"].get("request", message["params"]).get("url"))
    errors = [entry["message"] for entry in browser.get_log("browser") if entry["level"] in ("SEVERE", "WARNING")]
    return urls, errors


def assert_offline_and_clean(browser, path: Path) -> None:
    urls, errors = requests_and_errors(browser)
    assert path.as_uri() in urls  # the log is read: the page's own request is in it
    assert all(url.startswith(("file:", "data:")) for url in urls), urls
    assert errors == []


def background(browser, elements) -> list[tuple[int, int, int] | None]:
    """The computed background colour of each element as RGB, None where it is transparent."""
    found = browser.execute_script("return arguments[0].map(e => getComputedStyle(e).backgroundColor)", elements)
    colours = []
    for text in found:
        values = [float(v) for v in re.findall(r"[\d.]+", text)]
        colours.append(None if len(values) == 4 and values[3] == 0 else tuple(round(v) for v in values[:3]))
    return colours


def white_red_blue(value: float) -> tuple[int, int, int]:
    """White at 0, red at +1, blue at -1, linear between (the page's map, and matplotlib's ``bwr``)."""
    shade = math.floor(255 * (1 - min(1.0, abs(value))) + 0.5)
    return (255, shade, shade) if value >= 0 else (shade, shade, 255)


def assert_colours(found, expected, tolerance: int) -> None:
    assert len(found) == len(expected)
    for index, (colour, wanted) in enumerate(zip(found, expected)):
        if wanted is None or colour is None:
            assert colour == wanted, f"element {index}: {colour} is not {wanted}"
        else:
            assert max(abs(a - b) for a, b in zip(colour, wanted)) <= tolerance, f"element {index}: {colour} {wanted}"


def test_the_checks_see_a_request_and_a_console_error(browser, tmp_path):
    """The two checks every page gets can fail: a page that fetches and throws is caught by both."""
    page = tmp_path / "bad.html"
    page.write_text('<img src="http://127.0.0.1:9/x.png"><script>notDefined()</script>', encoding="utf-8")
    open_page(browser, page)
    urls, errors = requests_and_errors(browser)
    assert "http://127.0.0.1:9/x.png" in urls
    assert any("notDefined" in error for error in errors)


#: a vocabulary of one token per id, with tokens of whitespace alone: new lines, a space, a tab
VOCABULARY = ["<s>", "\n", " ", "\n\n", "\t", *"abcdefgh", " one", " two", ":"]


class Vocabulary:
    """The tokenizer explain_generation needs to name tokens: id ``i`` is ``VOCABULARY[i]``."""

    def convert_ids_to_tokens(self, ids: list[int]) -> list[str]:
        return [VOCABULARY[i] for i in ids]

    def convert_tokens_to_string(self, tokens: list[str]) -> str:
        return "".join(tokens)


@pytest.fixture(scope="module")
def generation() -> relprop.Generation:
    """A tiny random Llama's relevance for a text alternating words and whitespace (12 tokens, 6 blank)."""
    config = transformers.LlamaConfig(vocab_size=len(VOCABULARY), hidden_size=16, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=1, intermediate_size=32)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).double().eval()
    ids = {token: i for i, token in enumerate(VOCABULARY)}
    prompt = [ids[t] for t in ["<s>", " one", ":", "\n", "a"]]
    written = [ids[t] for t in ["\n", "b", "\n", "c", " ", "d", "\n\n", "e", "\t", "f", "\n", " two"]]
    return relprop.explain_generation(model, torch.tensor([prompt]), continuation=torch.tensor([written]),
                                      tokenizer=Vocabulary())


def expected_page_colours(generation: relprop.Generation, g: int) -> list[tuple[int, int, int] | None]:
    """Every token's background while generated token ``g`` is shown: its row on its scale, none from it on."""
    row, scale = generation.relevance[0, g].double(), float(generation.scales()[g])
    at = generation.prompt_length + g
    return [white_red_blue(float(row[i]) / scale) if i < at else None for i in range(row.numel())]


def test_every_generated_token_shows_its_row_on_hover_and_on_click(browser, generation, tmp_path):
    page = tmp_path / "generation.html"
    page.write_text(generation.html(), encoding="utf-8")
    open_page(browser, page)
    spans = browser.find_elements(By.CSS_SELECTOR, "#text .t")
    generated = browser.find_elements(By.CSS_SELECTOR, "#text .gen")
    tokens = generation.tokens[0]
    assert len(spans) == len(tokens) and len(generated) == 12
    # a token of whitespace alone shows as marks, and its line breaks still break the line
    marks = {"\n": "\u21b5", "\n\n": "\u21b5\u21b5", " ": "\u2423", "\t": "\u21e5"}
    assert [span.text for span in spans] == [marks.get(token, token) for token in tokens]
    tops = [span.rect["y"] for span in spans]
    assert all(tops[i + 1] > tops[i] for i, token in enumerate(tokens[:-1]) if "\n" in token)
    assert all(tops[i + 1] == tops[i] for i, token in enumerate(tokens[:-1]) if "\n" not in token)
    # each generated token has an area of its own, not covered by another element, for the mouse to reach
    covered = browser.execute_script("""return arguments[0].map(s => { const r = s.getBoundingClientRect();
        return r.width > 0 && r.height > 0 && document.elementFromPoint(r.x + r.width / 2, r.y + r.height / 2) === s;
    })""", generated)
    assert covered == [True] * 12
    for g, span in enumerate(generated):
        ActionChains(browser).move_to_element(span).perform()
        assert_colours(background(browser, spans), expected_page_colours(generation, g), tolerance=1)
        assert "on" in span.get_attribute("class").split()
    for g, span in enumerate(generated):  # a click alone (as a touch screen gives it), the mouse elsewhere
        browser.execute_script("arguments[0].click()", span)
        assert_colours(background(browser, spans), expected_page_colours(generation, g), tolerance=1)
    assert_offline_and_clean(browser, page)


def test_the_first_row_shows_before_any_hover(browser, generation, tmp_path):
    page = tmp_path / "generation.html"
    page.write_text(generation.html(), encoding="utf-8")
    open_page(browser, page)
    spans = browser.find_elements(By.CSS_SELECTOR, "#text .t")
    assert_colours(background(browser, spans), expected_page_colours(generation, 0), tolerance=1)
    assert_offline_and_clean(browser, page)


def test_the_text_page_colours_each_token_by_its_relevance(browser, tmp_path):
    """``relprop explain --text``'s text.html: each token on matplotlib's bwr, scaled by the largest |relevance|."""
    tokens = ["[CLS]", "a", "naïve", "<b>film</b>", "[SEP]"]
    relevance = torch.tensor([0.1, -0.4, 2.0, -1.0, 0.0])
    page = tmp_path / "text.html"
    page.write_text(viz.text_html(tokens, relevance), encoding="utf-8")
    open_page(browser, page)
    spans = browser.find_elements(By.CSS_SELECTOR, "span")
    assert [span.text for span in spans] == tokens  # escaped, and read as UTF-8
    # bwr has 255 entries: a value lands within one entry (2 levels of 255) of the straight line
    assert_colours(background(browser, spans), [white_red_blue(v / 2.0) for v in relevance.tolist()], tolerance=2)
    assert_offline_and_clean(browser, page)


def test_the_token_pair_pictures_show_the_pairs(browser, tmp_path):
    """The BiLRP token matrix and lines (examples/sentence_similarity.py's page): one cell per pair on bwr."""
    from relprop.viz import pairplot

    tokens, other = ["[CLS]", "cats", "sleep", "[SEP]"], ["[CLS]", "dogs", "nap", "[SEP]"]
    pairs = torch.tensor([[0.0, 0.1, 0.0, 0.0], [0.2, 1.5, -0.3, 0.0], [0.0, -0.6, 0.9, 0.05], [0.0, 0.0, 0.0, 0.0]])
    page = tmp_path / "pairs.html"
    page.write_text("<html><body>" + pairplot.token_lines_html(tokens, other, pairs, top=3)
                    + pairplot.token_matrix_html(tokens, other, pairs) + "</body></html>", encoding="utf-8")
    open_page(browser, page)
    cells = browser.find_elements(By.CSS_SELECTOR, "td")
    expected = [white_red_blue(v / 1.5) for v in pairs.flatten().tolist()]
    assert_colours(background(browser, cells), expected, tolerance=2)
    lines = browser.execute_script("return Array.from(document.querySelectorAll('line'))"
                                   ".map(l => l.getBBox().height > 0 && l.querySelector('title').textContent)")
    assert sorted(lines) == sorted(["cats ~ dogs: 1.5", "sleep ~ nap: 0.9", "sleep ~ dogs: -0.6"])
    assert_offline_and_clean(browser, page)


def test_the_atlas_page_shows_every_channel(browser, tmp_path):
    """The concept atlas's index.html: each channel's picture loads, from the folder the page is in."""
    from relprop.viz.atlas import render_atlas
    from relprop.workflows.concepts import reference_samples
    from relprop.workflows.mnist import SmallCNN

    torch.manual_seed(0)
    model = SmallCNN().double().eval()
    digits = torch.utils.data.TensorDataset(torch.rand(12, 1, 28, 28, dtype=torch.float64),
                                            torch.zeros(12, dtype=torch.long))
    found = reference_samples(model, digits, ["classifier.1"], top_k=2, batch_size=12)
    page = render_atlas(found, model, digits, "classifier.1", tmp_path / "atlas", channels=[0, 5, 7], count=2,
                        size=16)
    open_page(browser, page)
    loaded = browser.execute_script("return Array.from(document.images).map(i => [i.getAttribute('src'), "
                                    "i.complete && i.naturalWidth > 0])")
    assert sorted(loaded) == [[f"channel-{c:04d}.png", True] for c in (0, 5, 7)]
    assert_offline_and_clean(browser, page)


def test_the_notebook_view_shows_every_row(browser, generation, tmp_path):
    """``Generation._repr_html_`` (Jupyter's view): one line per generated token, its context in its row's colours."""
    page = tmp_path / "view.html"
    page.write_text(f"<!DOCTYPE html><meta charset='utf-8'>{generation._repr_html_()}", encoding="utf-8")
    open_page(browser, page)
    lines = browser.find_elements(By.CSS_SELECTOR, "div > div")
    assert len(lines) == 12
    for g, line in enumerate(lines):
        context = line.find_elements(By.CSS_SELECTOR, "span")
        assert len(context) == generation.prompt_length + g
        assert_colours(background(browser, context), expected_page_colours(generation, g)[:len(context)], tolerance=1)
    assert_offline_and_clean(browser, page)
