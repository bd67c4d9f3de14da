"""Request checks shared by every engine: bad input fails here, naming the field, before any
engine work starts, so one bad request never disturbs the batch others are running in."""

from __future__ import annotations

import math

from lorafleet import contract
from lorafleet.errors import InvalidArgument
from lorafleet_rollout.types import EngineInfo, SampleRequest


def validate_sample(request: SampleRequest, info: EngineInfo, max_num_samples: int) -> None:
    """Raise InvalidArgument (field named as in SampleRequest proto) or return None."""
    p = request.params
    prompt = request.prompt_tokens
    if not prompt:
        raise InvalidArgument("the prompt is empty", field="prompt_tokens")
    for i, tok in enumerate(prompt):
        if not 0 <= tok < info.vocab_size:
            raise InvalidArgument(
                f"token {tok} is outside the vocabulary [0, {info.vocab_size})",
                field=f"prompt_tokens[{i}]",
            )
    contract.check_num_samples(request.num_samples, max_num_samples)
    if p.max_tokens < 0:
        raise InvalidArgument(f"{p.max_tokens} is negative", field="params.max_tokens")
    if len(prompt) + max(p.max_tokens, 1) > info.max_context_length:
        raise InvalidArgument(
            f"prompt ({len(prompt)} tokens) + max_tokens ({p.max_tokens}) exceeds the context "
            f"length {info.max_context_length}",
            field="params.max_tokens",
        )
    if not math.isfinite(p.temperature) or p.temperature < 0:
        raise InvalidArgument(
            f"{p.temperature} must be a finite number >= 0", field="params.temperature"
        )
    if not math.isfinite(p.top_p) or not 0 < p.top_p <= 1:
        raise InvalidArgument(f"{p.top_p} is outside (0, 1]", field="params.top_p")
    if p.top_k < -1:
        raise InvalidArgument(f"{p.top_k} must be -1 or 0 (off) or >= 1", field="params.top_k")
    for i, tok in enumerate(p.stop_token_ids):
        if not 0 <= tok < info.vocab_size:
            raise InvalidArgument(
                f"token {tok} is outside the vocabulary", field=f"params.stop_token_ids[{i}]"
            )
    for i, text in enumerate(p.stop_strings):
        if not text:
            raise InvalidArgument("empty stop string", field=f"params.stop_strings[{i}]")
    if not 0 <= request.topk_prompt_logprobs <= min(info.vocab_size, 1024):
        raise InvalidArgument(
            f"{request.topk_prompt_logprobs} is outside [0, {min(info.vocab_size, 1024)}]",
            field="topk_prompt_logprobs",
        )
