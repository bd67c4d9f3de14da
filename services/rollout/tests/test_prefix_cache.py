"""PrefixCache: longest block-prefix matches, per-adapter trees, LRU eviction leaves first."""

from __future__ import annotations

import torch

from lorafleet_rollout.prefix_cache import BLOCK, PrefixCache

LAYERS, HEADS, DIM = 2, 3, 4
BLOCK_BYTES = LAYERS * 2 * HEADS * BLOCK * DIM * 4


def kv(prompt: tuple[int, ...]) -> torch.Tensor:
    """Keys/values [layers, 2, heads, tokens, dim] that encode each position's token, so a
    match can be checked by value."""
    column = torch.tensor(prompt, dtype=torch.float32)[None, :, None].expand(HEADS, -1, DIM)
    return torch.stack([torch.stack([column + layer, -column - layer]) for layer in range(LAYERS)])


def match(cache: PrefixCache, adapter: str | None, prompt: tuple[int, ...]) -> torch.Tensor | None:
    """What match_into copied, as [layers, 2, heads, tokens, dim] (None: no hit); checks
    that `matched` agrees and that match_into wrote nothing past its hit."""
    into = torch.full((LAYERS, 2, HEADS, len(prompt), DIM), -7.0)
    expected = cache.matched(adapter, prompt)
    found = cache.match_into(adapter, prompt, into)
    assert found == expected and found % BLOCK == 0
    assert bool((into[:, :, :, found:] == -7.0).all())
    return into[:, :, :, :found] if found else None


def test_matches_the_longest_cached_block_prefix_per_adapter() -> None:
    cache = PrefixCache(1 << 20)
    prompt = tuple(range(3 * BLOCK + 5))
    cache.insert("a", prompt, kv(prompt))
    assert cache.bytes == 3 * BLOCK_BYTES  # full blocks of prompt[:-1] only
    other = (*prompt[: 2 * BLOCK], 999, *prompt[2 * BLOCK + 1 :])
    hit = match(cache, "a", other)
    assert hit is not None and hit.shape == (LAYERS, 2, HEADS, 2 * BLOCK, DIM)
    assert torch.equal(hit, kv(prompt[: 2 * BLOCK]))
    assert match(cache, "b", prompt) is None  # keys/values depend on the adapter
    assert match(cache, "a", prompt[: BLOCK + 1]) is not None
    assert match(cache, "a", prompt[:BLOCK]) is None  # the last token is always computed
    cache.drop("a")
    assert cache.bytes == 0 and match(cache, "a", prompt) is None


def test_eviction_keeps_the_bound_and_takes_least_recent_leaves_first() -> None:
    cache = PrefixCache(4 * BLOCK_BYTES)
    shared = tuple(range(2 * BLOCK))
    first = (*shared, *range(100, 100 + BLOCK + 1))
    second = (*shared, *range(200, 200 + BLOCK + 1))
    cache.insert(None, first, kv(first))
    cache.insert(None, second, kv(second))
    assert cache.bytes == 4 * BLOCK_BYTES
    assert match(cache, None, first) is not None  # first's leaf is now the freshest
    assert cache.branch(None, first, 3 * BLOCK) == 2 * BLOCK  # where first and second diverge
    assert cache.branch(None, first, BLOCK) == 0
    third = (*range(300, 300 + BLOCK), 1)
    cache.insert(None, third, kv(third))
    assert cache.bytes <= cache.max_bytes
    assert match(cache, None, first).shape[3] == 3 * BLOCK  # still whole
    assert match(cache, None, second).shape[3] == 2 * BLOCK  # its leaf went, the shared part not
