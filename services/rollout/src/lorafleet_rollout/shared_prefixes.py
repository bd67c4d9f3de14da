"""What a prefilled request's decoding rows share (`SharedPrefixes`): its whole prompt when it
has several samples, else a cached prompt prefix it shares with running rows of its adapter
(a common system prompt), as one `kv_cache.Segment` read once per step for all of them."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from lorafleet_rollout.decoder import Decoder
from lorafleet_rollout.kv_cache import Segment
from lorafleet_rollout.kv_pool import KvPool
from lorafleet_rollout.prefix_cache import PrefixCache
from lorafleet_rollout.sample_jobs import Job, Seq

#: Shortest cached prefix worth a shared decode segment (each costs a copy of the prefix, and a
#: few torch ops per layer where the native kernels are missing).
MIN_SEGMENT = 64

#: A prefix-cache hit: (adapter, prompt tokens).
PrefixKey = tuple[str | None, tuple[int, ...]]


@dataclass(eq=False)
class Prefix:
    """A cached prompt prefix that running rows share in decode, and how many do."""

    segment: Segment
    #: [layers, 2, kv_heads, length, dim]: the segment's memory, a spare again when no row
    #: reads it (a fresh copy per batch cost page faults: a 1,000-token prefix is ~25 MB).
    kv: torch.Tensor
    rows: int = 0


class SharedPrefixes:
    """The shared prefixes of running rows, by prefix-cache hit: from the second row on,
    requests that hit the same prefix share one copy of it in decode too. Used by the
    scheduler thread only."""

    def __init__(self, prefix_cache: PrefixCache, kv_pool: KvPool) -> None:
        self.prefix_cache = prefix_cache
        self.kv_pool = kv_pool
        self.entries: dict[PrefixKey, Prefix] = {}

    def segment_for(
        self,
        model: Decoder,
        job: Job,
        live: list[Seq],
        joining: Sequence[Job],
        running: list[Seq],
    ) -> Segment | None:
        """What a prefilled job's rows share in decode: its whole prompt when it has several
        samples, else the cached prefix it shares with running rows (`_shared_prefix`),
        else nothing. `running` are the decode batch's rows, row i in cache slot i."""
        segment = None
        if len(live) > 1:
            segment = Segment(job.keys, job.values)
        elif job.cached:
            segment = self._shared_prefix(model, job, live[0], joining, running)
        for seq in live:
            seq.segment = segment
        return segment

    def _shared_prefix(
        self, model: Decoder, job: Job, seq: Seq, joining: Sequence[Job], running: list[Seq]
    ) -> Segment | None:
        """The cached prefix a one-row request shares with running rows of its adapter (a
        common system prompt: where cached prompts diverge, else its whole hit), as one
        segment for all of them. Rows that hold that prefix in their own slot (the first
        to arrive) move their later columns down onto it, a copy of those columns only, so
        no row's attention reads the shared part from its own slot."""
        prompt, matched = job.request.prompt_tokens, job.cached
        length = self.prefix_cache.branch(job.adapter, prompt, matched) or matched
        if length < MIN_SEGMENT:
            return None
        key = (job.adapter, prompt[:length])
        entry = self.entries.get(key)
        if entry is None:
            partners = [
                row
                for row, other in enumerate(running)
                if other.segment is None
                and other.job.adapter == job.adapter
                and other.job.request.prompt_tokens[:length] == key[1]
            ]
            later = any(  # prompts joining right after this one, in the same step
                other is not job
                and other.adapter == job.adapter
                and other.request.prompt_tokens[:length] == key[1]
                for other in joining
            )
            if not partners and not later:
                return None  # the first: later arrivals find it here and share with it
            # Contiguous copies: the attention matmuls read a strided segment ~25 % slower.
            assert job.kv is not None
            layers, _, heads, _, dim = job.kv.shape
            prefix = self.kv_pool.take((layers, 2, heads, length, dim), job.kv.dtype)
            prefix.copy_(job.kv[:, :, :, :length])
            entry = Prefix(Segment(list(prefix[:, 0]), list(prefix[:, 1])), prefix)
            self.entries[key] = entry
            for row in partners:
                partner = running[row]
                model.cache.shift(row, length, partner.pos)
                partner.segment, partner.prefix = entry.segment, key
                entry.rows += 1
        entry.rows += 1
        seq.prefix = key
        return entry.segment

    def release(self, key: PrefixKey) -> None:
        """A row reading the prefix `key` is gone; the last one's leaving frees its memory
        (once the scheduler's shared list, which still holds the segment, is rebuilt)."""
        self.entries[key].rows -= 1
        if not self.entries[key].rows:
            self.kv_pool.give(self.entries.pop(key).kv)

    def clear(self) -> None:
        self.entries = {}


def aliases(segment: Segment, kv: torch.Tensor) -> bool:
    """Whether a decode segment reads `kv`'s memory (then kv must not be reused)."""
    return segment.layers[0][0].untyped_storage().data_ptr() == kv.untyped_storage().data_ptr()


def shared_length(seq: Seq) -> int:
    """Prompt tokens a row reads from its shared segment, not from its own slot."""
    return 0 if seq.segment is None else seq.segment.length
