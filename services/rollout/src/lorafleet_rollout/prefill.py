"""Chunked prefill of the torch engine (`Prefill`): waiting prompts advance by up to a chunk
of tokens in all per scheduler step, oldest first, as one batch (one GEMM per projection, so
the weights stream once for all of them), taking what they can from the prefix cache. A long
prompt so advances a chunk at a time and never stalls the running batch for long."""

from __future__ import annotations

import math

import torch

from lorafleet.errors import NotFound
from lorafleet_rollout import metrics
from lorafleet_rollout.decoder import Decoder, PrefillPart
from lorafleet_rollout.kv_pool import KvPool
from lorafleet_rollout.prefix_cache import BLOCK, PrefixCache
from lorafleet_rollout.sample_jobs import Job


class Prefill:
    """Advances prompts through prefill. Used by the scheduler thread only."""

    def __init__(self, prefix_cache: PrefixCache, kv_pool: KvPool) -> None:
        self.prefix_cache = prefix_cache
        self.kv_pool = kv_pool

    def step(
        self, model: Decoder, prefilling: list[Job], chunk: int
    ) -> list[tuple[Job, torch.Tensor]]:
        """Advance `prefilling`'s prompts by up to `chunk` tokens in all. Jobs cancelled or
        whose adapter is gone leave the list (the latter answered NotFound), so do prompts
        that finish: those are returned with the logits of their last token.

        A prompt that shares uncached prefix blocks with one being computed waits for it
        (`_should_wait`): those blocks then come from the prefix cache, computed once.
        """
        budget = chunk
        computing = [job for job in prefilling if job.kv is not None]
        batch: list[tuple[Job, int]] = []
        for job in list(prefilling):
            if budget <= 0:
                break
            if job.cancelled or job.adapter not in model:
                prefilling.remove(job)
                if not job.cancelled:  # unloaded while it waited
                    job.resolve(
                        NotFound(f"adapter {job.request.adapter_id} is not loaded", field="adapter")
                    )
                continue
            if job.kv is None:
                if self._should_wait(job, computing):
                    continue
                self._start(model, job)
                computing.append(job)
            end = min(len(job.request.prompt_tokens), job.done + budget)
            batch.append((job, end))
            budget -= end - job.done
        if not batch:
            return []
        hidden = model.prefill(
            [
                PrefillPart(
                    torch.tensor(job.request.prompt_tokens[job.done : end]),
                    job.done,
                    job.keys,
                    job.values,
                    model.slot(job.adapter),
                    _outputs(job, end),
                )
                for job, end in batch
            ]
        )
        first = 0
        finished: list[tuple[Job, torch.Tensor]] = []
        for job, end in batch:
            rows = hidden[first : first + _outputs(job, end)]
            first += _outputs(job, end)
            metrics.PROMPT_TOKENS.labels("computed").inc(end - job.done)
            slot = model.slot(job.adapter)
            if job.wants_prompt:
                spans = [(0, rows.shape[0], slot)] if slot else None
                _prompt_logprobs(job, model.logits(rows, spans).float(), end)
            job.done = end
            if end == len(job.request.prompt_tokens):
                prefilling.remove(job)
                last = [(0, 1, slot)] if slot else None
                finished.append((job, model.logits(rows[-1:], last).float()))
        return finished

    def _should_wait(self, job: Job, computing: list[Job]) -> bool:
        """Whether a prompt should wait for an unfinished one (same adapter) that computes
        prefix blocks it shares and the cache does not hold yet. Prompts that only share
        cached blocks start at once, side by side."""
        if job.wants_prompt:  # computed whole anyway
            return False
        prompt = job.request.prompt_tokens
        have = self.prefix_cache.matched(job.adapter, prompt)
        return any(  # the cache holds blocks of prompt[:-1]
            other.adapter == job.adapter
            and _common_blocks(prompt[:-1], other.request.prompt_tokens[:-1]) > have
            for other in computing
        )

    def _start(self, model: Decoder, job: Job) -> None:
        prompt = job.request.prompt_tokens
        shape = (len(model.layers), 2, model.kv_heads, len(prompt), model.head_dim)
        # Uninitialised: every column is written (cache hit, then prefill) before it is read.
        job.kv = self.kv_pool.take(shape, model.dtype)
        if job.wants_prompt:  # every prompt position's logits are needed: compute them all
            job.prompt_logprobs = [math.nan]
            job.topk = [()]
            return
        job.cached = job.done = self.prefix_cache.match_into(job.adapter, prompt, job.kv)
        metrics.PROMPT_TOKENS.labels("cached").inc(job.done)


def _outputs(job: Job, end: int) -> int:
    """How many of the chunk's last positions' final hidden states are read: all of them
    for prompt logprobs, the prompt's last one when the chunk ends it, else none."""
    if job.wants_prompt:
        return end - job.done
    return 1 if end == len(job.request.prompt_tokens) else 0


def _prompt_logprobs(job: Job, logits: torch.Tensor, end: int) -> None:
    """Logprob of prompt token t under the prediction at t-1, for the chunk ending at end."""
    prompt = job.request.prompt_tokens
    targets = torch.tensor(prompt[job.done + 1 : end + 1])
    logp = torch.log_softmax(logits[: len(targets)], dim=-1)
    if job.request.prompt_logprobs:
        job.prompt_logprobs += logp.gather(-1, targets[:, None]).flatten().tolist()
    k = job.request.topk_prompt_logprobs
    if k:
        values, indices = logp.topk(k, dim=-1)
        job.topk += [
            tuple(zip(ids, vals, strict=True))
            for ids, vals in zip(indices.tolist(), values.tolist(), strict=True)
        ]


def _common_blocks(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    """Tokens in the longest common prefix of a and b, counted in whole cache blocks."""
    low, high = 0, min(len(a), len(b)) // BLOCK
    while low < high:  # binary search: slice comparisons run in C
        mid = (low + high + 1) // 2
        if a[: mid * BLOCK] == b[: mid * BLOCK]:
            low = mid
        else:
            high = mid - 1
    return low * BLOCK
