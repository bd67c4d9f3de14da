"""choose_tokens draws from the right distribution, with and without top-k / top-p cuts."""

from __future__ import annotations

import torch

from lorafleet_rollout.sampling import choose_tokens, make_generator

LOGITS = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -30.0])


def frequencies(temperature: float, top_k: int, top_p: float, n: int = 4000) -> torch.Tensor:
    """Token frequencies of n rows with these parameters, each with its own seeded generator."""
    tokens, logprobs = choose_tokens(
        LOGITS.expand(n, -1).clone(),
        torch.full((n,), temperature),
        torch.full((n,), top_k),
        torch.full((n,), top_p),
        [make_generator(seed) for seed in range(n)],
    )
    assert torch.allclose(logprobs, torch.log_softmax(LOGITS, -1)[tokens])  # always the raw ones
    return torch.bincount(tokens, minlength=len(LOGITS)).float() / n


def test_draws_follow_the_cut_distribution() -> None:
    full = torch.softmax(LOGITS / 0.7, -1)
    assert (frequencies(0.7, -1, 1.0) - full).abs().max() < 0.03
    top2 = torch.softmax(LOGITS[:2] / 0.7, -1)
    got = frequencies(0.7, 2, 1.0)
    assert (got[:2] - top2).abs().max() < 0.03 and got[2:].sum() == 0
    # top_p at temperature 1: keep tokens while the mass before them is < top_p; with a top_k
    # too, that mass is measured within the top k (renormalized), as vLLM and transformers do.
    for k, cut in ((-1, 0.8), (3, 0.8), (4, 0.9)):
        probs = torch.softmax(LOGITS if k < 0 else LOGITS[:k], -1)
        keep = (probs.cumsum(-1) - probs) < cut
        want = torch.zeros(len(LOGITS))
        want[: len(probs)] = torch.where(keep, probs, 0.0) / probs[keep].sum()
        assert (frequencies(1.0, k, cut) - want).abs().max() < 0.03, (k, cut)


def test_mixed_rows_keep_their_own_draws() -> None:
    """A row's token depends only on its own generator, not on what else is in the batch."""
    params = [(0.0, -1, 1.0), (1.0, -1, 1.0), (1.0, 2, 1.0), (0.9, -1, 0.5), (1.3, 4, 0.9)]

    def run(rows: list[int]) -> list[int]:
        picked = [params[r] for r in rows]
        tokens, _ = choose_tokens(
            LOGITS.expand(len(rows), -1).clone(),
            torch.tensor([p[0] for p in picked]),
            torch.tensor([p[1] for p in picked]),
            torch.tensor([p[2] for p in picked]),
            [make_generator(100 + r) for r in rows],
        )
        return tokens.tolist()

    together = run(list(range(len(params))))
    assert together == [run([r])[0] for r in range(len(params))]
    assert together[0] == 0  # greedy
