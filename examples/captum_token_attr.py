"""The picture of docs/guide/integrations.md: captum's ``plot_token_attr`` of relprop's relevance on SmolLM2.

    python examples/captum_token_attr.py [--out docs/guide/integrations/token_attr.png]

Greedy generation of four tokens after "The Eiffel Tower is located in the city of" with SmolLM2-135M-Instruct
(the ``llm`` extra), explained by captum's ``LLMGradientAttribution`` with
:class:`relprop.integrations.captum.LLMRelevance` (AttnLRP): one row per generated token, the relevance of each
prompt token for its logit.
"""
from __future__ import annotations

import argparse
from pathlib import Path

import matplotlib

matplotlib.use("Agg")

from captum.attr import LLMGradientAttribution, TextTokenInput  # noqa: E402

from relprop.integrations.captum import LLMRelevance  # noqa: E402
from relprop.workflows.smollm2 import load_smollm2  # noqa: E402

PROMPT = "The Eiffel Tower is located in the city of"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("docs/guide/integrations/token_attr.png"))
    args = parser.parse_args()
    model, tokenizer = load_smollm2()
    llm = LLMGradientAttribution(LLMRelevance(model, "attnlrp"), tokenizer)
    result = llm.attribute(TextTokenInput(PROMPT, tokenizer), gen_args={"max_new_tokens": 4, "do_sample": False})
    figure, _ = result.plot_token_attr(show=False)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(args.out, dpi=90, bbox_inches="tight")
    print(f"{result.output_tokens} -> {args.out}")


if __name__ == "__main__":
    main()
