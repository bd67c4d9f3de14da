"""The torch engine's scheduler records: a SampleRequest on its way through (`Job`), its
decoding rows (`Seq`), an adapter change waiting for the scheduler (`Command`), and how each
answers its asyncio caller from the scheduler thread (`Job.resolve`, `settle`)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from lorafleet_rollout.kv_cache import Segment
from lorafleet_rollout.stopping import StopRule
from lorafleet_rollout.types import SampledSequence, SampleRequest, SampleResult, StopReason


@dataclass(eq=False)
class Job:
    """One SampleRequest travelling through the scheduler."""

    request: SampleRequest
    adapter: str | None  # engine-internal adapter name; None = the base model
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future[SampleResult]
    enqueued: float = field(default_factory=time.monotonic)
    cancelled: bool = False
    # Prefill progress: prompt tokens whose keys/values are in keys/values (per layer).
    done: int = 0
    cached: int = 0  # prompt tokens it took from the prefix cache
    #: [layers, 2, kv_heads, prompt length, dim] once its prefill starts (None before).
    kv: torch.Tensor | None = None
    prompt_logprobs: list[float] = field(default_factory=list)
    topk: list[tuple[tuple[int, float], ...]] = field(default_factory=list)
    seqs: list[Seq] = field(default_factory=list)

    @property
    def rows(self) -> int:
        """Decode rows it needs: greedy samples are all the same sequence, decoded once."""
        return 1 if self.request.params.temperature == 0 else self.request.num_samples

    @property
    def keys(self) -> list[torch.Tensor]:
        """Per layer [kv_heads, prompt length, dim], views of `kv`."""
        return [] if self.kv is None else list(self.kv[:, 0].unbind())

    @property
    def values(self) -> list[torch.Tensor]:
        return [] if self.kv is None else list(self.kv[:, 1].unbind())

    @property
    def wants_prompt(self) -> bool:
        return self.request.prompt_logprobs or self.request.topk_prompt_logprobs > 0

    def resolve(self, value: SampleResult | BaseException) -> None:
        def _set() -> None:
            if self.future.done():
                return
            if isinstance(value, BaseException):
                self.future.set_exception(value)
            else:
                self.future.set_result(value)

        self.loop.call_soon_threadsafe(_set)


@dataclass(eq=False)
class Seq:
    job: Job
    generator: torch.Generator
    rule: StopRule
    pos: int  # tokens before the next one fed, which goes to this position
    segment: Segment | None = None  # the shared prompt prefix it attends to, if any
    prefix: tuple[str | None, tuple[int, ...]] | None = None  # its prefix-cache hit
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    reason: StopReason | None = None


@dataclass(eq=False)
class Command:
    """An adapter change applied by the scheduler thread between two steps."""

    apply: Callable[[], None]
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future[None]


def settle(future: asyncio.Future[None], exc: BaseException | None) -> None:
    """Answer a `Command`'s caller, on its loop; one that gave up already is left alone."""
    if future.done():
        return
    if exc is None:
        future.set_result(None)
    else:
        future.set_exception(exc)


def result(job: Job) -> SampleResult:
    """A finished job's answer: a greedy job's one row stands for each of its samples."""
    return SampleResult(
        sequences=tuple(
            SampledSequence(tuple(s.tokens), tuple(s.logprobs), s.reason or "length")
            for s in job.seqs * (job.request.num_samples // len(job.seqs))
        ),
        prompt_logprobs=tuple(job.prompt_logprobs) if job.request.prompt_logprobs else (),
        topk_prompt_logprobs=tuple(job.topk) if job.request.topk_prompt_logprobs else (),
        cached_prompt_tokens=job.cached,
    )
