"""How a group splits a batch's rows: contiguous, balanced by tokens, slots whole where that
balances (rowshare.balance; the group test checks the split trains like one process)."""

from __future__ import annotations

from lorafleet_trainer.rowshare import balance


def tokens(lengths: list[int], ranges: list[tuple[int, int]]) -> list[int]:
    return [sum(lengths[a:b]) for a, b in ranges]


def test_balanced_by_tokens_not_by_rows() -> None:
    lengths = [100, 10, 10, 10, 10, 10, 10, 10, 10, 10, 10]
    ranges = balance(lengths, list(range(len(lengths))), 2)
    assert ranges == [(0, 1), (1, 11)]  # 100 tokens each, 1 row against 10
    assert tokens(lengths, ranges) == [100, 100]


def test_cut_moves_to_a_slot_boundary_within_the_slack() -> None:
    lengths = [2] * 50  # the even cut is after row 25 (50 tokens each)
    slots = [0] * 23 + [1] * 27  # a slot boundary 4 tokens off: within 10 % of 50
    assert balance(lengths, slots, 2) == [(0, 23), (23, 50)]
    slots = [0] * 22 + [1] * 28  # 6 tokens off: the slot is split instead
    assert balance(lengths, slots, 2) == [(0, 25), (25, 50)]


def test_every_rank_gets_a_row_while_there_are_enough() -> None:
    lengths = [1000, 1, 1]
    ranges = balance(lengths, [0, 1, 2], 3)
    assert ranges == [(0, 1), (1, 2), (2, 3)]
    assert sorted(b - a for a, b in balance([5], [0], 2)) == [0, 1]  # fewer rows than ranks
    assert balance([], [], 2) == [(0, 0), (0, 0)]
