"""Explaining what a language model generates: the relevance of the context for every generated token.

One forward pass over the prompt and the generated text, recorded once
(:meth:`relprop.LRP.record`), and one seed per generated token: the logit of
token ``g`` at the position that predicted it. Row ``g`` of the result is the
relevance of every earlier token, prompt and generated, for that logit, as an
attribution of the sequence cut after the position would give it.
"""
from __future__ import annotations

import html
import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from relprop import composites
from relprop.methods.attribution import LRP

__all__ = ["Generation", "explain_generation"]


@dataclass
class Generation:
    """A generation and the relevance of its context for each generated token.

    Attributes
    ----------
    sequences : Tensor
        ``(B, T + G)`` token ids: the prompts (left-padded to ``T``) followed by ``G`` generated tokens.
    relevance : Tensor
        ``(B, G, T + G)``: row ``g`` is the relevance of each position for the logit of generated token
        ``g`` at the position that predicted it; zero from position ``T + g`` on, and on padding.
    prompt_length : int
        ``T``.
    attention_mask : Tensor
        ``(B, T + G)``: 1 for tokens, 0 for left padding.
    tokens : list of list of str, optional
        The tokens as text, per sequence, where a tokenizer was given.
    """

    sequences: Tensor
    relevance: Tensor
    prompt_length: int
    attention_mask: Tensor
    tokens: list[list[str]] | None = None

    @property
    def generated(self) -> Tensor:
        """``(B, G)``: the generated token ids."""
        return self.sequences[:, self.prompt_length:]

    def scales(self, index: int = 0) -> Tensor:
        """``(G,)``: the scale each row of sequence ``index`` is shown on, as :meth:`html` and the matrix show it.

        The largest relevance in absolute value among the context tokens between the first token and the
        predicting one (the token before the generated one). Those two often hold much of the relevance: the
        first where the model parks attention (a sink), the predicting one as the position the logit is read
        at; on their scale the rest of the context would hardly show. A row whose context has no other token
        takes the largest of all; an empty or zero row, 1.
        """
        start = int((~self.attention_mask[index].bool()).sum())  # left padding
        found = []
        for g, row in enumerate(self.relevance[index][:, start:].double()):
            end = self.prompt_length - start + g  # the context of generated token g
            middle = row[1:end - 1]
            found.append(_scale(middle if middle.numel() and bool(middle.abs().max() > 0) else row[:end]))
        return torch.tensor(found, dtype=torch.float64)

    def html(self, index: int = 0, header: Mapping[str, str] | None = None) -> str:
        """A page of sequence ``index``: hover or click a generated token to see its sources as a heatmap.

        Self-contained (no script or style from elsewhere): it works offline. Each row is shown on its own
        scale (:meth:`scales`): the first and the predicting token, which often hold much of the relevance,
        are left out of it and marked, so that they do not wash out the rest. ``header`` names what was
        explained at the top of the page, one line per entry (``{"prompt": ..., "model": ..., "preset": ...}``).
        """
        keep = self.attention_mask[index].bool()
        start = int((~keep).sum())  # left padding
        words = self.tokens[index] if self.tokens is not None else [str(t) for t in self.sequences[index].tolist()]
        rows = self.relevance[index][:, start:].double()
        scales = self.scales(index).tolist()
        prompt = self.prompt_length - start
        data = {"rows": [[round(v, 6) for v in row.tolist()] for row in rows], "scales": scales, "prompt": prompt}
        spans = "".join(_span(word, i, i >= prompt) for i, word in enumerate(words[start:]))
        parts = {"__SPANS__": spans, "__DATA__": json.dumps(data), "__HEADER__": _header(header or {})}
        # one pass: a prompt that holds a placeholder's name stays as written
        return re.sub("__(SPANS|DATA|HEADER)__", lambda found: parts[found.group(0)], _PAGE)

    def _repr_html_(self) -> str:
        """Jupyter's view: every row at once, without a script (a notebook shows it as it was saved).

        One line per generated token (bold, boxed) after its context, each context token coloured as :meth:`html`
        colours it on hover: its relevance for that token over the row's scale (:meth:`scales`).
        """
        parts = ['<div style="font-family: monospace; line-height: 1.9">',
                 '<p style="font-family: sans-serif; font-size: 90%; color: #555">Each line: a generated token '
                 "(boxed) after the context, coloured by its relevance for that token, red for it, blue against "
                 "it, on the line's scale (<code>Generation.scales</code>: the first token and the one before "
                 "the box, left out of it, may saturate); hover for the values. "
                 "<code>Generation.html()</code> writes the same as an interactive page.</p>"]
        for index in range(self.sequences.shape[0]):
            if self.sequences.shape[0] > 1:
                parts.append(f'<p style="font-family: sans-serif">sequence {index}</p>')
            start = int((~self.attention_mask[index].bool()).sum())  # left padding
            words = self.tokens[index] if self.tokens is not None else [str(t) for t in self.sequences[index].tolist()]
            words = words[start:]
            prompt = self.prompt_length - start
            for g, (row, scale) in enumerate(zip(self.relevance[index][:, start:].double().tolist(),
                                                 self.scales(index).tolist())):
                at = prompt + g
                spans = "".join(f'<span style="background: {_colour(value / scale)}; margin-right: 1px" '
                                f'title="relevance {value:.3g}">{html.escape(_visible(word))}</span>'
                                for word, value in zip(words[:at], row[:at]))
                parts.append(f'<div>{spans}<b style="outline: 1px solid black">'
                             f"{html.escape(_visible(words[at]))}</b></div>")
        return "".join(parts) + "</div>"


def _header(fields: Mapping[str, str]) -> str:
    """The page's header: what was explained, one line per entry; nothing without entries."""
    if not fields:
        return ""
    rows = "".join(f"<dt>{html.escape(name)}</dt><dd>{html.escape(value)}</dd>" for name, value in fields.items())
    return f'<header id="about"><h1>Relevance of the context for each generated token</h1><dl>{rows}</dl></header>'


def _span(word: str, index: int, generated: bool) -> str:
    """One token of the page. A token of whitespace alone shows as marks (``↵`` new line, ``⇥`` tab, ``␣``
    space; ``∅`` for an empty one) followed by its line breaks: as text it would have no area to hover over
    or to show its colour on."""
    classes = "t gen" if generated else "t"
    if word.strip():
        return f'<span class="{classes}" data-i="{index}">{html.escape(word)}</span>'
    word = word.replace("\r\n", "\n")
    marks = "".join(_MARKS.get(character, "\u2423") for character in word) or "\u2205"
    return f'<span class="{classes} ws" data-i="{index}">{marks}</span>' + "<br>" * word.count("\n")


_MARKS = {"\n": "\u21b5", "\r": "\u21b5", "\t": "\u21e5"}


def _colour(value: float) -> str:
    """The page's colour of a relevance over its row's scale: white at 0, red at +1, blue at -1 (clipped)."""
    level = math.floor(255 * (1 - min(1.0, abs(value))) + 0.5)  # rounded as the page's script rounds
    return f"rgb(255,{level},{level})" if value >= 0 else f"rgb({level},{level},255)"


def _visible(word: str) -> str:
    """A token on one line: line breaks and tabs as the page's marks, a token of spaces alone as ``␣``."""
    shown = "".join(_MARKS.get(character, character) for character in word.replace("\r\n", "\n"))
    return shown if shown.strip() else "\u2423" * len(shown) or "\u2205"


def _scale(row: Tensor) -> float:
    """The largest relevance in absolute value of ``row`` (1 where it is empty or zero)."""
    largest = float(row.abs().max()) if row.numel() else 0.0
    return largest if largest > 0 else 1.0


_PAGE = """<!DOCTYPE html>
<html><head><meta charset="utf-8"><title>relprop: relevance of the context for each generated token</title>
<style>
body { font-family: sans-serif; max-width: 60em; margin: 2em auto; line-height: 2.1; }
.t { font-family: monospace; white-space: pre-wrap; padding: 2px 0; border-radius: 3px; }
.gen { text-decoration: underline dotted; cursor: pointer; }
.gen.on { outline: 2px solid black; }
.sink { border-bottom: 3px double grey; }
.ws { color: grey; }
#note { color: #555; font-size: 90%; line-height: 1.4; }
#about h1 { font-size: 130%; margin-bottom: 0.3em; }
#about dl { display: grid; grid-template-columns: max-content auto; align-items: baseline; gap: 0 1em; line-height: 1.4;
            margin: 0; }
#about dt { color: #555; }
#about dd { margin: 0; font-family: monospace; white-space: pre-wrap; }
</style></head><body>
__HEADER__
<p id="note">Hover over (or click) an underlined, generated token: the text before it is coloured by its
relevance for that token, red for evidence for it, blue against it, on the scale of the largest relevance
between the first token and the one before the hovered token (those two, double underlined, often hold much
of it: their colours saturate, their values show on hover). Tokens of whitespace alone show as grey marks:
&#8629; a new line, &#9251; a space, &#8677; a tab.</p>
<div id="text">__SPANS__</div>
<script>
const data = __DATA__;
const spans = Array.from(document.querySelectorAll(".t"));
function colour(v) {  // white at 0, red at +1, blue at -1
  const a = Math.min(1, Math.abs(v)), c = Math.round(255 * (1 - a));
  return v >= 0 ? `rgb(255,${c},${c})` : `rgb(${c},${c},255)`;
}
function show(g) {
  const row = data.rows[g], scale = data.scales[g], at = data.prompt + g;
  spans.forEach((s, i) => {
    s.classList.toggle("on", i === at);
    s.classList.toggle("sink", i === 0 || i === at - 1);
    s.style.background = i < at ? colour(row[i] / scale) : "";
    s.title = i < at ? `relevance ${row[i].toPrecision(3)}` : "";
  });
}
spans.forEach((s, i) => {
  if (i >= data.prompt) {
    s.addEventListener("mouseenter", () => show(i - data.prompt));
    s.addEventListener("click", () => show(i - data.prompt));
  }
});
if (data.rows.length) show(0);
</script></body></html>
"""


def _as_ids(value: Any, tokenizer: Any, name: str) -> Tensor:
    """Token ids from a tensor, or from text with the tokenizer, as a ``(B, n)`` long tensor."""
    if isinstance(value, str):
        if tokenizer is None:
            raise ValueError(f"relprop: {name} is text; pass tokenizer= to turn it into token ids")
        value = tokenizer(value, return_tensors="pt", add_special_tokens=False)["input_ids"]
    ids = torch.as_tensor(value)
    if ids.dim() == 1:
        ids = ids.unsqueeze(0)
    if ids.dim() != 2 or ids.is_floating_point():
        raise ValueError(f"relprop: {name} must be token ids of shape (batch, length), got shape {tuple(ids.shape)}")
    return ids.long()


def explain_generation(model: nn.Module, input_ids: Tensor | str, max_new_tokens: int | None = None,
                       continuation: Tensor | str | None = None, composite: composites.Composite | str = "attnlrp",
                       attention_mask: Tensor | None = None, tokenizer: Any = None, compile: bool | str = False,
                       **generate_kwargs: Any) -> Generation:
    """The relevance of the context for every token a causal language model generates.

    Parameters
    ----------
    model : nn.Module
        A causal language model with Hugging Face's interface (``model.generate``, ``logits``).
    input_ids : Tensor or str
        ``(B, T)`` prompt token ids, left-padded for prompts of different lengths (with ``attention_mask``),
        or one prompt as text (with ``tokenizer``).
    max_new_tokens : int, optional
        How many tokens to generate (greedy unless ``generate_kwargs`` say otherwise); 16 when neither it
        nor ``continuation`` is given.
    continuation : Tensor or str, optional
        ``(B, G)`` token ids (or text) to explain instead of generating: teacher-forced after the prompt.
    composite : Composite or str
        The rules (AttnLRP by default).
    attention_mask : Tensor, optional
        ``(B, T)``: 1 for prompt tokens, 0 for left padding.
    tokenizer : optional
        A Hugging Face tokenizer: text prompts, and :attr:`Generation.tokens`.
    compile : bool or str
        Explain through the compiled tier (``relprop.LRP(..., compile=...)``); not passed to ``generate``.
    **generate_kwargs
        Passed to ``model.generate``.

    Returns
    -------
    Generation
        One forward pass over the whole sequence, and one backward pass per generated token.

    Examples
    --------
    >>> import torch, transformers
    >>> import relprop
    >>> config = transformers.LlamaConfig(vocab_size=40, hidden_size=16, num_hidden_layers=1,
    ...                                   num_attention_heads=2, num_key_value_heads=1, intermediate_size=32)
    >>> model = transformers.LlamaForCausalLM(config).eval()
    >>> found = relprop.explain_generation(model, torch.tensor([[3, 7, 9, 4]]), max_new_tokens=3)
    >>> found.sequences.shape, found.relevance.shape
    (torch.Size([1, 7]), torch.Size([1, 3, 7]))
    """
    prompt = _as_ids(input_ids, tokenizer, "input_ids")
    batch, length = prompt.shape
    mask = torch.ones_like(prompt) if attention_mask is None else torch.as_tensor(attention_mask).long()
    if mask.shape != prompt.shape:
        raise ValueError(f"relprop: attention_mask has shape {tuple(mask.shape)}; the prompts have "
                         f"{tuple(prompt.shape)}")
    if continuation is not None:
        if max_new_tokens is not None or generate_kwargs:
            raise ValueError("relprop: continuation is explained as given; max_new_tokens and generate arguments "
                             "do not apply to it")
        following = _as_ids(continuation, tokenizer, "continuation")
        if following.shape[0] != batch:
            following = following.expand(batch, -1) if following.shape[0] == 1 else following
        if following.shape[0] != batch:
            raise ValueError(f"relprop: {following.shape[0]} continuations for {batch} prompts")
        sequences = torch.cat([prompt, following.to(prompt.device)], 1)
    else:
        options = {"do_sample": False, "max_new_tokens": 16 if max_new_tokens is None else max_new_tokens,
                   **generate_kwargs}
        if getattr(getattr(model, "generation_config", None), "pad_token_id", None) is None:
            options.setdefault("pad_token_id", getattr(getattr(model, "config", None), "eos_token_id", None) or 0)
        generate = getattr(model, "generate", None)
        if generate is None:
            raise TypeError(f"relprop: {type(model).__name__} has no generate(); pass the text to explain as "
                            "continuation=")
        with torch.no_grad():
            sequences = generate(prompt, attention_mask=mask, **options)
    generated = sequences.shape[1] - length
    full_mask = torch.cat([mask, torch.ones(batch, generated, dtype=mask.dtype, device=mask.device)], 1)
    relevance = torch.zeros(batch, generated, sequences.shape[1], dtype=torch.float32)
    if generated:
        relevance = _relevance(_explainer(model, composite, compile), sequences, full_mask, length)
    tokens = None
    if tokenizer is not None:
        tokens = [tokenizer.convert_ids_to_tokens(row) for row in sequences.tolist()]
        tokens = [[_readable(tokenizer, token) for token in row] for row in tokens]
    return Generation(sequences, relevance, length, full_mask, tokens)


#: the compiled explainers of the model explained last, by composite and compiler: a later generation of that
#: model reuses their programs. They hold their model, so explaining another model releases them.
_KEPT: list[tuple[nn.Module, dict[Any, LRP]]] = []


def _explainer(model: nn.Module, composite: composites.Composite | str, compile: bool | str) -> LRP:
    """The explainer of a generation; with ``compile``, the one kept for this model and composite (and compiler)."""
    if not compile:
        return LRP(model, composite)
    if not _KEPT or _KEPT[0][0] is not model:
        _KEPT[:] = [(model, {})]
    kept = _KEPT[0][1]
    key = (composite, compile)
    if key not in kept:
        lrp = LRP(model, composite, compile=compile)
        if lrp.compiled is not None:
            lrp.compiled.dynamic = 1  # one program for prompts and generations of every length
        kept[key] = lrp
    return kept[key]


def _relevance(lrp: LRP, sequences: Tensor, mask: Tensor, length: int) -> Tensor:
    """``(B, G, T + G)``: one recorded pass over all but the last token, one seed per generated token."""
    inputs = sequences[:, :-1]
    attention = mask[:, :-1]
    # the positions generate() used: counted from the first token of each (left-padded) prompt
    positions = (attention.cumsum(-1) - 1).clamp(min=0)
    explained = lrp.record(inputs, {"attention_mask": attention, "position_ids": positions})
    logits = explained.logits
    batch, generated = sequences.shape[0], sequences.shape[1] - length
    rows = torch.arange(batch, device=logits.device)
    found = torch.zeros(batch, generated, sequences.shape[1], dtype=logits.dtype)
    for g in range(generated):
        seed = torch.zeros_like(logits)
        tokens = sequences[:, length + g].to(logits.device)
        seed[rows, length + g - 1, tokens] = logits.detach()[rows, length + g - 1, tokens]
        (relevance,) = explained.relevance(seed)
        # nothing after the predicting position reaches its logit in a causal model, padding takes none
        found[:, g, :length + g] = (relevance[:, :length + g] * attention[:, :length + g]).detach().cpu()
    return found


def _readable(tokenizer: Any, token: str) -> str:
    """A token as it reads in the text (byte-level BPE's ``Ġ`` is a space)."""
    text = tokenizer.convert_tokens_to_string([token])
    return text if text else token
