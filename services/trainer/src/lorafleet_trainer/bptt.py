"""Truncated-BPTT windows: a window computed after its document's earlier context.

Managed document jobs (issue 13, juno's `/train`) cut a document into windows of
`chunk_tokens`; each window attends to the document's earlier windows, but gradients stop
at their keys and values. Here a window is a datum whose `context` holds those earlier
tokens: the context runs first under `torch.no_grad()` through the slot's adapter, giving a
key/value cache that is a constant to autograd, and the window runs on top of it (positions
continue after the context). The window's loss therefore trains the adapter only through
the window's own computation, while its attention still reads the whole document so far.

The context is computed with the slot's weights as they are at this call, and without
dropout: it is conditioning, not a training row. (Juno reuses the cache computed while the
earlier window trained; the two agree whenever no optimizer update falls between windows of
one document.)

Each window runs as its own batch of one: windows of other lengths would need per-row
caches with left padding, and the jobs that send them are sequential anyway.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from lorafleet_trainer.lora import Router, RowGroup


def window_logits(
    model: nn.Module,
    router: Router,
    group: RowGroup,
    context: list[int],
    tokens: list[int],
    device: torch.device,
) -> torch.Tensor:
    """Logits (len(tokens), vocab) of `tokens` read after `context`, whose keys/values are
    detached. `group` routes the single row through its slot (with the row's dropout)."""
    quiet = dataclasses.replace(group, size=1, dropout=0.0, dropout_keys=None)
    with torch.no_grad(), router.route([quiet], device):
        cache = model(
            input_ids=torch.tensor([context], dtype=torch.int64, device=device), use_cache=True
        ).cache
    with router.route([dataclasses.replace(group, size=1)], device):
        out = model(
            input_ids=torch.tensor([tokens], dtype=torch.int64, device=device),
            cache=cache,
            use_cache=True,
        )
    return out.logits[0]
