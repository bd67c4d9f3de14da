"""The base model's tokenizer, as jobs need it: encode text and render chat templates.

Built with `transformers.AutoTokenizer` from the files the trainer serving the model streams
(`TrainerService.ExportTokenizer`), written to a private folder: no hub, no model folder and
no name that must resolve in the controller (issue 23). It is the tokenizer a Tinker client
of the same model loads, so a job formats its data exactly as such a client would.
"""

from __future__ import annotations

import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any


class HfCodec:
    """`jobs.units.Codec` over a transformers tokenizer."""

    def __init__(self, tokenizer: Any) -> None:
        self._tok = tokenizer
        self.chat_template: str | None = tokenizer.chat_template or None
        specials = set(tokenizer.all_special_tokens)
        specials.update(
            str(t)
            for t in getattr(tokenizer, "added_tokens_decoder", {}).values()
            if getattr(t, "special", False)
        )
        self.special_tokens: Sequence[str] = sorted(specials)

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=False))

    def render(self, messages: list[dict[str, str]], add_generation_prompt: bool) -> str:
        out = self._tok.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt
        )
        return str(out)


def from_files(files: dict[str, bytes]) -> HfCodec:
    """The codec of a tokenizer given as its files."""
    from transformers import AutoTokenizer

    with tempfile.TemporaryDirectory(prefix="lorafleet-tokenizer-") as tmp:
        for name, data in files.items():
            (Path(tmp) / Path(name).name).write_bytes(data)  # plain names only: no traversal
        return HfCodec(AutoTokenizer.from_pretrained(tmp, local_files_only=True))
