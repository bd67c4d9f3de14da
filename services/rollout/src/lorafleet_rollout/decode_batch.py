"""The torch engine's running batch (`DecodeBatch`): the rows that decode together, one step
for all of them, rows joining as their prompts finish prefill and leaving as they finish.

Row i lives in the decoder's cache slot i. Rows of one step may use different adapters or the
base model (one `lora.Route` for the step, rebuilt only when rows change) and may read a
shared prompt segment instead of their own slot's first columns (`shared_prefixes.py`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from lorafleet_rollout import metrics
from lorafleet_rollout.decoder import Decoder
from lorafleet_rollout.kv_cache import Segment
from lorafleet_rollout.kv_pool import KvPool
from lorafleet_rollout.lora import Route, make_route
from lorafleet_rollout.prefix_cache import PrefixCache
from lorafleet_rollout.sample_jobs import Job, Seq, result
from lorafleet_rollout.sampling import choose_tokens
from lorafleet_rollout.shared_prefixes import SharedPrefixes, aliases, shared_length

#: Decode columns reserved beyond a sequence's current length when the cache (re)grows.
_SPARE_COLUMNS = 256
_SHARED_ROWS = metrics.DECODE_ROWS.labels("shared")
_OWN_ROWS = metrics.DECODE_ROWS.labels("own")


class DecodeBatch:
    """The decoding rows and what one step over them needs. Used by the scheduler thread
    only (others may read `seqs` as a hint: whether anything decodes)."""

    def __init__(self, prefix_cache: PrefixCache, kv_pool: KvPool) -> None:
        self.seqs: list[Seq] = []  # row i of the decode batch lives in cache slot i
        self._route: Route | None = None
        self._shared: list[tuple[Segment, torch.Tensor]] = []  # segment, its rows
        self._shared_rows = 0
        self._route_stale = True  # route and _shared need rebuilding (rows changed)
        self._layout = -1  # the slots' layout the route was built for (`AdapterSlots.layout`)
        self._kv_pool = kv_pool
        self._prefixes = SharedPrefixes(prefix_cache, kv_pool)

    def join(
        self,
        model: Decoder,
        job: Job,
        logits: torch.Tensor,
        joining: Sequence[Job],
        limit: int,
    ) -> None:
        """A prefilled job's samples (`job.seqs`, just started; `logits` of its last prompt
        token) take their first token and join, each with a decode slot holding the
        keys/values it does not share (`shared_prefixes.py`), room for `limit` new tokens
        at most; a job none of whose samples goes on is answered."""
        self._append(job.seqs, logits.expand(job.rows, -1))
        live = [s for s in job.seqs if s.reason is None]
        segment = None
        assert job.kv is not None
        if live:
            segment = self._prefixes.segment_for(model, job, live, joining, self.seqs)
            base = 0 if segment is None else segment.length
            first = len(self.seqs)
            own = len(job.request.prompt_tokens) - base
            used = max((s.pos - shared_length(s) for s in self.seqs), default=0)
            model.cache.reserve(first + len(live), own + min(limit, _SPARE_COLUMNS) + 1, used)
            model.cache.fill(slice(first, first + len(live)), job.kv[:, :, :, base:])
            self.seqs.extend(live)
            self._route_stale = True
        if segment is None or not aliases(segment, job.kv):
            self._kv_pool.give(job.kv)
        job.kv = None
        if not live:
            job.resolve(result(job))

    def step(self, model: Decoder) -> None:
        """Decode one token for every row, then retire the rows that finished."""
        if self._route_stale or self._layout != model.layout:
            self._route = make_route([model.slot(s.job.adapter) for s in self.seqs])
            self._layout = model.layout
            groups: dict[Segment, list[int]] = {}
            for row, seq in enumerate(self.seqs):
                if seq.segment is not None:
                    groups.setdefault(seq.segment, []).append(row)
            self._shared = [(seg, torch.tensor(rows)) for seg, rows in groups.items()]
            self._shared_rows = sum(map(len, groups.values()))
            self._route_stale = False
        _SHARED_ROWS.inc(self._shared_rows)
        _OWN_ROWS.inc(len(self.seqs) - self._shared_rows)
        pos = torch.tensor([s.pos for s in self.seqs])
        cols = pos - torch.tensor([shared_length(s) for s in self.seqs])
        length = int(cols.max()) + 1
        if length > model.cache.capacity:
            model.cache.reserve(len(self.seqs), length + _SPARE_COLUMNS)
        logits = model.decode(
            torch.tensor([s.tokens[-1] for s in self.seqs]),
            pos,
            cols,
            length,
            self._route,
            self._shared,
        )
        for seq in self.seqs:
            seq.pos += 1
        self._append(self.seqs, logits.float())
        self._retire_finished(model, length)

    def clear(self) -> None:
        """Forget every row (the scheduler answers their jobs and clears the cache)."""
        self.seqs = []
        self._prefixes.clear()
        self._route_stale = True

    def _append(self, seqs: list[Seq], logits: torch.Tensor) -> None:
        params = [s.job.request.params for s in seqs]
        tokens, logprobs = choose_tokens(
            logits,
            torch.tensor([p.temperature for p in params]),
            torch.tensor([p.top_k for p in params]),
            torch.tensor([p.top_p for p in params]),
            [s.generator for s in seqs],
        )
        for seq, tok, lp in zip(seqs, tokens.tolist(), logprobs.tolist(), strict=True):
            seq.tokens.append(tok)
            seq.logprobs.append(lp)
            seq.reason = seq.rule.check(seq.tokens)
        metrics.TOKENS.inc(len(seqs))

    def _retire_finished(self, model: Decoder, length: int) -> None:
        """Drop finished or cancelled rows; answer jobs whose rows all finished. Rows from the
        end of the batch move into the freed slots, so only those rows are copied."""
        gone = [i for i, s in enumerate(self.seqs) if s.reason is not None or s.job.cancelled]
        if not gone:
            return
        for job in {self.seqs[i].job for i in gone}:
            if not job.cancelled and all(s.reason is not None for s in job.seqs):
                job.resolve(result(job))
        for i in gone:
            key = self.seqs[i].prefix
            if key is not None:
                self._prefixes.release(key)
        size = len(self.seqs) - len(gone)
        holes = [i for i in gone if i < size]
        movers = [i for i in range(size, len(self.seqs)) if i not in set(gone)]
        if holes:
            model.cache.move(torch.tensor(holes), torch.tensor(movers), length)
            for hole, mover in zip(holes, movers, strict=True):
                self.seqs[hole] = self.seqs[mover]
        del self.seqs[size:]
        self._route_stale = True
