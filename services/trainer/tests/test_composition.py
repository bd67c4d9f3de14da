"""A slot's result does not depend on which other slots share its pass, bit for bit.

The controller compares a run that shared its passes with the same run alone (paging,
recovery), and a trainer group compares with one process: both need a slot's logprobs and
A/B gradients to be a function of its own rows only (lora.py). The base model's own kernels
see the padded batch, and on the CPU a token's rounding there depends on the batch width,
so every pass here has the same width: the slot's longest row is the longest in each.
"""

from __future__ import annotations

import torch

from lorafleet_trainer.domain import Datum, ForwardBackwardInput, ForwardBackwardItem, LoraSpec

LENGTHS = (12, 5, 9)  # the slot's rows; 12 is the width of every pass below
MINE = LoraSpec(rank=4, alpha=8.0, seed=3, dropout=0.1)

# Neighbours: (rank, their row lengths, adapted modules or None for all). The same rank as
# the slot with other row counts, other ranks, a slot that skips most modules, and one
# whose rows sort ahead of the slot's (higher rank), so the slot's rows move in the batch.
NEIGHBOURS: dict[str, list[tuple[int, tuple[int, ...], tuple[str, ...] | None]]] = {
    "same rank, one row": [(4, (7,), None)],
    "same rank, more rows": [(4, (3, 11, 6, 8), None)],
    "other ranks and sizes": [(16, (10, 4), None), (1, (6,), None), (8, (12, 2, 5), None)],
    "partial targets": [(4, (9,), ("q_proj", "down_proj")), (2, (4, 4), ("v_proj",))],
}


def datum(gen: torch.Generator, n: int, vocab: int) -> Datum:
    return Datum(
        torch.randint(0, vocab, (n,), generator=gen).tolist(),
        {
            "target_tokens": torch.randint(0, vocab, (n,), generator=gen),
            "weights": torch.rand(n, generator=gen),
        },
    )


def run(engine, h, neighbours) -> tuple[list[torch.Tensor], dict[str, torch.Tensor]]:
    """The slot (slot 0) beside `neighbours` in one forward_backward: its logprobs, grads."""
    vocab = engine.vocab_size
    gen = torch.Generator().manual_seed(0)
    items = [
        ForwardBackwardItem(
            "op",
            0,
            "me",
            ForwardBackwardInput([datum(gen, n, vocab) for n in LENGTHS], "cross_entropy"),
        )
    ]
    engine.bind(0, "me", MINE)
    h.perturb(engine, 0, seed=11)
    for slot, (rank, lengths, targets) in enumerate(neighbours, start=1):
        spec = LoraSpec(rank=rank, alpha=3.0 * rank, seed=slot, dropout=0.05 * slot)
        if targets is not None:
            spec = LoraSpec(rank=rank, seed=slot, target_modules=targets)
        engine.bind(slot, f"n{slot}", spec)
        h.perturb(engine, slot, seed=100 + slot)
        data = [datum(gen, n, vocab) for n in lengths]
        items.insert(
            slot % 2,  # the request order is not the batch order either
            ForwardBackwardItem(
                "op", slot, f"n{slot}", ForwardBackwardInput(data, "cross_entropy")
            ),
        )
    results = engine.forward_backward(items)
    mine = next(r for item, r in zip(items, results, strict=True) if item.slot == 0)
    grads = h.slot_grads(engine, 0)
    for slot in range(len(neighbours) + 1):
        engine.unbind(slot, "me" if slot == 0 else f"n{slot}")
    return mine.logprobs, grads


def test_a_slot_is_bit_identical_whatever_shares_its_pass(make_engine, h) -> None:
    engine = make_engine(num_slots=5)
    logprobs, grads = run(engine, h, [])
    for case, neighbours in NEIGHBOURS.items():
        got_logprobs, got_grads = run(engine, h, neighbours)
        for got, want in zip(got_logprobs, logprobs, strict=True):
            assert torch.equal(got, want), case
        assert got_grads.keys() == grads.keys()
        unequal = [key for key in grads if not torch.equal(got_grads[key], grads[key])]
        assert not unequal, (case, unequal)
