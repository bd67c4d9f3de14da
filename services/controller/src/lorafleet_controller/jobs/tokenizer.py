"""The base model's tokenizer, as jobs need it: encode text and render chat templates.

Loaded with `transformers.AutoTokenizer` from the trainer's announced `tokenizer_id` (a local
folder or a hub name), the same call a Tinker client makes, and kept per id: a job formats
its data exactly as a client of the same model would.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any


class HfCodec:
    """`jobs.units.Codec` over a transformers tokenizer."""

    def __init__(self, tokenizer: Any) -> None:
        self._tok = tokenizer
        self.chat_template: str | None = tokenizer.chat_template or None
        specials = set(tokenizer.all_special_tokens)
        specials.update(str(t) for t in getattr(tokenizer, "added_tokens_decoder", {}).values()
                        if getattr(t, "special", False))  # fmt: skip
        self.special_tokens: Sequence[str] = sorted(specials)

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=False))

    def render(self, messages: list[dict[str, str]], add_generation_prompt: bool) -> str:
        out = self._tok.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt
        )
        return str(out)


@functools.lru_cache(maxsize=8)
def load(tokenizer_id: str) -> HfCodec:
    from transformers import AutoTokenizer

    return HfCodec(AutoTokenizer.from_pretrained(tokenizer_id))
