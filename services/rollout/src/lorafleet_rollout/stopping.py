"""When a sequence is finished, following Tinker's rules.

The matched stop token or the token that completes a stop string is kept in the output,
with stop_reason "stop"; EOS stops too unless the client disabled it (an explicit empty
stop list); hitting max_tokens is "length".
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from lorafleet_rollout.types import SamplingSpec, StopReason

Decode = Callable[[Sequence[int]], str]


class StopRule:
    """Per-sequence stop check, called once after every generated token."""

    def __init__(
        self, params: SamplingSpec, eos_ids: frozenset[int], limit: int, decode: Decode | None
    ) -> None:
        self.stop_ids = frozenset(params.stop_token_ids) | (
            frozenset() if params.disable_eos_stop else eos_ids
        )
        self.stop_strings = params.stop_strings
        self.limit = limit
        self.decode = decode
        # A stop string is at most this many tokens long (every token decodes to >= 1 byte),
        # so only the tail needs decoding.
        self.window = max((len(s.encode()) for s in self.stop_strings), default=0) + 1

    def check(self, generated: Sequence[int]) -> StopReason | None:
        if generated[-1] in self.stop_ids:
            return "stop"
        if self.stop_strings and self.decode is not None:
            tail = self.decode(generated[-self.window :])
            if any(s in tail for s in self.stop_strings):
                return "stop"
        if len(generated) >= self.limit:
            return "length"
        return None
