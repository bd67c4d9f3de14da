"""Choosing the next token for a batch of rows with per-row sampling parameters.

Reported logprobs are the plain log-softmax of the raw logits, whatever the temperature,
top-k or top-p: Tinker's RL losses compare them with the trainer's forward logprobs of the
same tokens, which never see sampling transforms. Randomness comes from one torch.Generator
per sequence, so a seeded request draws the same tokens whatever else shares its batch.
"""

from __future__ import annotations

import torch


def choose_tokens(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    generators: list[torch.Generator],
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pick one token per row of `logits` [B, V] (float32); return (tokens [B], logprobs [B]).

    temperature 0 = greedy; top_k <= 0 = off; top_p in (0, 1].
    """
    logprobs = torch.log_softmax(logits, dim=-1)
    tokens = logits.argmax(dim=-1)
    sampled = (temperature > 0).nonzero().flatten()
    if sampled.numel():
        rows = logits[sampled] / temperature[sampled, None]
        sorted_logits, sorted_idx = rows.sort(dim=-1, descending=True)
        ranks = torch.arange(rows.shape[-1]).expand_as(rows)
        k = top_k[sampled, None]
        sorted_logits = sorted_logits.masked_fill((k > 0) & (ranks >= k), float("-inf"))
        probs = torch.softmax(sorted_logits, dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs
        probs = probs.masked_fill(mass_before >= top_p[sampled, None], 0.0)
        cdf = probs.cumsum(dim=-1)
        draws = torch.stack([torch.rand((), generator=generators[i]) for i in sampled.tolist()])
        pick = torch.searchsorted(cdf, (draws * cdf[:, -1])[:, None], right=True)
        pick = pick.clamp(max=rows.shape[-1] - 1)
        # Never pick a zero-probability tail entry because of rounding at the top of the cdf.
        pick = torch.minimum(pick, (probs > 0).sum(dim=-1, keepdim=True) - 1)
        tokens[sampled] = sorted_idx.gather(-1, pick).flatten()
    return tokens, logprobs.gather(-1, tokens[:, None]).flatten()


def make_generator(seed: int | None) -> torch.Generator:
    """A CPU generator seeded from `seed`, or from fresh entropy when there is none."""
    gen = torch.Generator()
    if seed is None:
        gen.seed()
    else:
        gen.manual_seed(seed % (2**63))
    return gen
