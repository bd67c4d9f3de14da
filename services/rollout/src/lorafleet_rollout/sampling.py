"""Choosing the next token for a batch of rows with per-row sampling parameters.

Reported logprobs are the plain log-softmax of the raw logits, whatever the temperature,
top-k or top-p: Tinker's RL losses compare them with the trainer's forward logprobs of the
same tokens, which never see sampling transforms. Randomness comes from one torch.Generator
per sequence (one uniform draw per token), so a seeded request draws the same tokens whatever
else shares its batch.

A draw inverts the cumulative distribution. Rows without top-k or top-p invert it in
vocabulary order: sorting is only needed to cut a distribution, and a full sort of the
vocabulary cost more than a whole decode step at 128 rows (76 ms for 128 x 2048 on this
machine); rows with top-k only sort their k best (`topk`), and only top-p without top-k
sorts everything.
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
    sampled = (temperature > 0).nonzero().flatten().tolist()
    if sampled:
        draws = torch.stack([torch.rand((), generator=generators[i]) for i in sampled])
        ks, ps = top_k.tolist(), top_p.tolist()
        plain = [n for n, i in enumerate(sampled) if ks[i] <= 0 and ps[i] >= 1.0]
        cut = [n for n, i in enumerate(sampled) if ks[i] > 0 or ps[i] < 1.0]
        scaled = logits[sampled] / temperature[sampled, None]
        if plain:
            index = torch.tensor([sampled[n] for n in plain])
            tokens[index] = _invert(torch.softmax(scaled[plain], dim=-1), draws[plain])
        if cut:
            index = torch.tensor([sampled[n] for n in cut])
            tokens[index] = _draw_cut(scaled[cut], top_k[index], top_p[index], draws[cut])
    return tokens, logprobs.gather(-1, tokens[:, None]).flatten()


def _invert(probs: torch.Tensor, draws: torch.Tensor) -> torch.Tensor:
    """The column of each row [R, N] where its cumulative probability passes draw * total."""
    cdf = probs.cumsum(dim=-1)
    pick = torch.searchsorted(cdf, (draws * cdf[:, -1])[:, None], right=True)
    # Never pick a zero-probability entry because of rounding at the top of the cdf.
    last = torch.where(probs > 0, torch.arange(probs.shape[-1]), 0).amax(dim=-1, keepdim=True)
    return torch.minimum(pick, last).flatten()


def _draw_cut(
    scaled: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, draws: torch.Tensor
) -> torch.Tensor:
    """Draw from rows cut to their top-k and/or top-p; rows [R, V] already temperature-scaled."""
    width = scaled.shape[-1] if bool((top_k <= 0).any()) else int(top_k.max())
    values, order = scaled.topk(min(width, scaled.shape[-1]), dim=-1)
    ranks = torch.arange(values.shape[-1]).expand_as(values)
    k = top_k[:, None]
    values = values.masked_fill((k > 0) & (ranks >= k), float("-inf"))
    probs = torch.softmax(values, dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs
    probs = probs.masked_fill(mass_before >= top_p[:, None], 0.0)
    return order.gather(-1, _invert(probs, draws)[:, None]).flatten()


def make_generator(seed: int | None) -> torch.Generator:
    """A CPU generator seeded from `seed`, or from fresh entropy when there is none."""
    gen = torch.Generator()
    if seed is None:
        gen.seed()
    else:
        gen.manual_seed(seed % (2**63))
    return gen
