"""Truncated-BPTT windows at linear cost: a window reads its document's earlier keys/values,
carried from the window before it.

Managed document jobs (issue 13, juno's `/train`) cut a document into windows of
`chunk_tokens`. A window is a datum whose `context` holds the tokens it reads before itself
(the controller bounds them by the model's positions: `jobs/units.py` owns that rule). The
window's loss trains the adapter only through the window's own computation: the context's
keys/values are constants to autograd, while the window's attention still reads them.

Issue 23: each token's forward runs once. After a window runs (a datum with context, or
marked `window`: a document's first), its slot keeps the detached key/value cache of
context + window (`Carried`); the next window of the same document names exactly those
tokens as its context and runs on top of the carried cache without recomputing anything.
When the carried tokens are only a prefix of the context (a window in between was left out
by `max_train_tokens`), just the missing tokens run; when they are something else (another
document, a shifted context, a restarted trainer), the context runs afresh under
`torch.no_grad()` and without dropout. `context_tokens` counts what ran.

Exactness with LoRA (juno's semantics, chosen here): carried keys/values are the ones
computed when their window ran, with the slot's weights and that window's dropout mask of
that moment, even if an optimizer update came since. Recomputing them after every update
is what made long documents quadratic. With no update between the windows of a document
(one accumulation group, or a forward-only pass) the result equals computing the whole
context now; `tests/test_bptt.py` checks both against PEFT.

Each window runs as its own batch of one: windows of other lengths would need per-row
caches with left padding, and the jobs that send them are sequential anyway.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from lorafleet_trainer.lora import Router, RowGroup


@dataclass
class Carried:
    """A slot's detached key/value cache and the tokens (from position 0) it holds."""

    tokens: tuple[int, ...]
    cache: Any  # a transformers Cache


@dataclass
class Window:
    """One window's result: its logits, the cache to carry, the context tokens that ran."""

    logits: torch.Tensor
    carried: Carried
    context_tokens: int


def _detach(cache: Any) -> Any:
    """The cache with every key/value tensor cut from autograd (in place; returns it)."""
    for layer in cache.layers:
        for attr in ("keys", "values"):
            value = getattr(layer, attr, None)
            if isinstance(value, torch.Tensor):
                setattr(layer, attr, value.detach())
    return cache


def window_logits(
    model: nn.Module,
    router: Router,
    group: RowGroup,
    context: list[int],
    tokens: list[int],
    device: torch.device,
    carried: Carried | None,
) -> Window:
    """Logits (len(tokens), vocab) of `tokens` read after `context`, whose keys/values are
    detached: taken from `carried` where it holds them, computed otherwise. `group` routes
    the single row through its slot (with the row's dropout)."""
    ctx = tuple(context)
    cache, todo = None, ctx
    if carried is not None and ctx[: len(carried.tokens)] == carried.tokens:
        cache, todo = carried.cache, ctx[len(carried.tokens) :]
    if todo:
        quiet = dataclasses.replace(group, size=1, dropout=0.0, dropout_keys=None)
        with torch.no_grad(), router.route([quiet], device):
            cache = model(
                input_ids=torch.tensor([todo], dtype=torch.int64, device=device),
                cache=cache,
                use_cache=True,
            ).cache
    with router.route([dataclasses.replace(group, size=1)], device):
        out = model(
            input_ids=torch.tensor([tokens], dtype=torch.int64, device=device),
            cache=cache,
            use_cache=True,
        )
    return Window(out.logits[0], Carried(ctx + tuple(tokens), _detach(out.cache)), len(todo))
