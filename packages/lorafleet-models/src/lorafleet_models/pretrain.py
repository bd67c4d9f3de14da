"""Short, deterministic causal-LM pre-training of a freshly initialised model on the corpus.

Determinism: the token stream, the window offsets (a seeded torch.Generator) and the
initialisation depend only on the seed; the loop runs fp32 on one CPU thread, because a
thread-count-dependent reduction order would otherwise change the bytes of the weights.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from lorafleet_models.corpus import corpus_documents


@contextmanager
def single_thread() -> Iterator[None]:
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(saved)


def token_stream(corpus_text: str, tokenizer: PreTrainedTokenizerBase) -> torch.Tensor:
    """All documents as one id stream, each preceded by the end-of-text token."""
    docs = corpus_documents(corpus_text)
    encoded = tokenizer(docs, add_special_tokens=False)["input_ids"]
    ids: list[int] = []
    for doc_ids in encoded:
        ids.append(tokenizer.eos_token_id)
        ids.extend(doc_ids)
    return torch.tensor(ids, dtype=torch.long)


def pretrain(
    model: PreTrainedModel,
    stream: torch.Tensor,
    *,
    steps: int,
    batch_size: int,
    seq_len: int,
    learning_rate: float,
    seed: int,
) -> float:
    """Train in place for `steps` AdamW steps; returns the mean loss of the last 10% of steps.

    The learning rate warms up linearly over 5% of the steps, then decays by cosine to 10%.
    """
    if steps == 0:
        return float("nan")
    gen = torch.Generator().manual_seed(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=learning_rate, weight_decay=0.01)
    warmup = max(1, steps // 20)

    def lr_at(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, steps - warmup)
        return 0.1 + 0.45 * (1.0 + math.cos(math.pi * progress))

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_at)
    tail = max(1, steps // 10)
    tail_losses: list[float] = []
    model.train()
    for step in range(steps):
        starts = torch.randint(0, stream.numel() - seq_len, (batch_size,), generator=gen)
        batch = torch.stack([stream[s : s + seq_len] for s in starts.tolist()])
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        if step >= steps - tail:
            tail_losses.append(loss.item())
    model.eval()
    return sum(tail_losses) / len(tail_losses)
