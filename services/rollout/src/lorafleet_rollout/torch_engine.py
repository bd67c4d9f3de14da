"""TorchEngine: the embedded CPU engine, continuous batching with mixed-adapter batches.

One scheduler thread owns the model. Between decode steps it applies adapter installs and
removals, admits waiting requests (prefilled together, left-padded, then merged into the
running batch's KV cache, see `kvbatch.py`) and steps every live sequence together, so a
long generation never blocks a short one and a publish never pauses sampling. Rows of one
forward pass may use different adapters or the base model: the grouped LoRA of `lora.py`
routes each row through its own adapter (PEFT's arithmetic, platform.md §3) in a fixed
number of batched matmuls, however many adapters the batch mixes. Adapters are paired and
scaled on a worker thread; the scheduler thread only copies them into place.

Seeds are per sequence (`sampling.py`), so a seeded request draws the same tokens alone or
in any batch; reported logprobs are the plain log-softmax of the raw logits.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import itertools
import logging
import math
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from peft import LoraConfig
from transformers import AutoModelForCausalLM, AutoTokenizer

from lorafleet.errors import InvalidArgument, NotFound, Unavailable
from lorafleet_rollout import metrics
from lorafleet_rollout.engine import AdapterSource
from lorafleet_rollout.kvbatch import KVBatch, new_cache
from lorafleet_rollout.lora import AdapterWeights, LoraBank, Route, adapter_weights
from lorafleet_rollout.peft_io import check_fits, linear_shapes, read_peft_dir
from lorafleet_rollout.sampling import choose_tokens, make_generator
from lorafleet_rollout.stopping import StopRule
from lorafleet_rollout.types import (
    BASE_ADAPTER,
    EngineInfo,
    LoraSpec,
    SampledSequence,
    SampleRequest,
    SampleResult,
    StopReason,
)

log = logging.getLogger(__name__)

#: Sample i of a seeded request uses seed ^ (i * this), so samples differ but stay reproducible.
_SAMPLE_SEED_STRIDE = 0x9E3779B97F4A7C15


@dataclass(eq=False)
class _Job:
    """One SampleRequest travelling through the scheduler."""

    request: SampleRequest
    adapter: str
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future[SampleResult]
    enqueued: float = field(default_factory=time.monotonic)
    cancelled: bool = False
    prompt_logprobs: tuple[float, ...] = ()
    topk: tuple[tuple[tuple[int, float], ...], ...] = ()
    seqs: list[_Seq] = field(default_factory=list)

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
class _Seq:
    job: _Job
    generator: torch.Generator
    rule: StopRule
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    reason: StopReason | None = None


@dataclass(eq=False)
class _Command:
    """An adapter change applied by the scheduler thread between two steps."""

    apply: Callable[[], None]
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future[None]


class TorchEngine:
    """A RolloutEngine running a transformers causal LM (+ PEFT LoRA) in this process."""

    def __init__(
        self,
        model_path: Path,
        *,
        max_batch_size: int = 32,
        max_lora_rank: int = 64,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        self.model_path = model_path
        self.max_batch_size = max_batch_size
        self.max_lora_rank = max_lora_rank
        self.dtype = dtype
        self._base: torch.nn.Module | None = None
        self._bank: LoraBank | None = None
        self._linears: dict[str, tuple[int, int]] = {}
        self._tokenizer: Any = None
        self._eos: frozenset[int] = frozenset()
        self._info: EngineInfo | None = None
        self._names: dict[str, str] = {}
        self._counter = itertools.count()
        self._cv = threading.Condition()
        self._waiting: collections.deque[_Job] = collections.deque()
        self._commands: list[_Command] = []
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._seqs: list[_Seq] = []
        self._batch: KVBatch | None = None
        self._route: Route | None = None  # of the running batch; None = rebuild before a step
        # Reading, checking and pairing a pushed adapter runs here, one at a time and niced,
        # so a publish takes CPU the running batch leaves over; the scheduler thread only
        # copies the prepared tensors into its preallocated stacks.
        self._prep = ThreadPoolExecutor(1, "adapter-prep", initializer=_lower_priority)

    # ----------------------------------------------------------------- lifecycle
    async def start(self) -> None:
        await asyncio.to_thread(self._load_model)
        self._thread = threading.Thread(target=self._run, name="torch-engine", daemon=True)
        self._thread.start()

    def _load_model(self) -> None:
        model = AutoModelForCausalLM.from_pretrained(self.model_path, dtype=self.dtype)
        model.eval()
        self._base = model
        self._bank = LoraBank(model)
        self._linears = linear_shapes(model)
        with contextlib.suppress(Exception):
            self._tokenizer = AutoTokenizer.from_pretrained(self.model_path)
        eos: set[int] = set()
        for source in (model.config, getattr(model, "generation_config", None), self._tokenizer):
            ids = getattr(source, "eos_token_id", None)
            if ids is not None:
                eos.update([ids] if isinstance(ids, int) else ids)
        self._eos = frozenset(eos)
        cfg = model.config
        self._info = EngineInfo(
            engine="torch",
            base_model=str(self.model_path),
            max_context_length=int(getattr(cfg, "max_position_embeddings", 2048)),
            vocab_size=int(model.get_input_embeddings().num_embeddings),
            max_lora_rank=self.max_lora_rank,
        )

    async def close(self) -> None:
        with self._cv:
            self._stopping = True
            self._cv.notify_all()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join)
        self._prep.shutdown(wait=False, cancel_futures=True)

    def info(self) -> EngineInfo:
        if self._info is None:
            raise Unavailable("the model is still loading")
        return self._info

    # ----------------------------------------------------------------- adapters
    async def load_adapter(self, adapter_id: str, source: AdapterSource, lora: LoraSpec) -> None:
        if adapter_id in self._names:
            return
        loop = asyncio.get_running_loop()
        weights = await loop.run_in_executor(self._prep, self._prepare, source, lora)
        name = f"a{next(self._counter)}"
        await self._submit(lambda: self._bank_or_fail().install(name, weights))
        self._names[adapter_id] = name

    async def unload_adapter(self, adapter_id: str) -> None:
        name = self._names.pop(adapter_id, None)
        if name is not None:
            await self._submit(lambda: self._bank_or_fail().remove(name))

    def _prepare(self, source: AdapterSource, lora: LoraSpec) -> AdapterWeights:
        """Read, check and pair an adapter's tensors, off the scheduler thread."""
        if isinstance(source, Path):
            config, tensors = read_peft_dir(source)
        else:
            config = LoraConfig(
                r=lora.rank,
                lora_alpha=lora.alpha,
                target_modules=list(lora.target_modules) or None,
                inference_mode=True,
            )
            tensors = source
        check_fits(tensors, config, self._linears, self.max_lora_rank)
        return adapter_weights(config, tensors)

    def _bank_or_fail(self) -> LoraBank:
        if self._bank is None:
            raise Unavailable("the model is still loading")
        return self._bank

    async def _submit(self, apply: Callable[[], None]) -> None:
        loop = asyncio.get_running_loop()
        cmd = _Command(apply, loop, loop.create_future())
        with self._cv:
            if self._stopping:
                raise Unavailable("the engine is stopping")
            self._commands.append(cmd)
            self._cv.notify()
        await cmd.future

    # ----------------------------------------------------------------- sampling
    async def sample(self, request: SampleRequest) -> SampleResult:
        if request.adapter_id is None:
            adapter = BASE_ADAPTER
        elif request.adapter_id in self._names:
            adapter = self._names[request.adapter_id]
        else:
            raise NotFound(f"adapter {request.adapter_id} is not loaded", field="adapter")
        if request.params.stop_strings and self._tokenizer is None:
            raise InvalidArgument(
                "stop strings need a tokenizer and the model folder has none",
                field="params.stop_strings",
            )
        loop = asyncio.get_running_loop()
        job = _Job(request, adapter, loop, loop.create_future())
        with self._cv:
            if self._stopping:
                raise Unavailable("the engine is stopping")
            self._waiting.append(job)
            self._cv.notify()
        try:
            return await job.future
        except asyncio.CancelledError:
            job.cancelled = True
            raise

    def queued(self) -> int:
        return len(self._waiting)

    # ----------------------------------------------------------------- scheduler thread
    def _run(self) -> None:
        with torch.inference_mode():
            while True:
                with self._cv:
                    while not (self._stopping or self._commands or self._waiting or self._seqs):
                        self._cv.wait()
                    if self._stopping:
                        break
                    commands, self._commands = self._commands, []
                    admitted = self._admit()
                for cmd in commands:
                    self._apply(cmd)
                try:
                    if admitted:
                        self._prefill(admitted)
                    elif self._seqs:
                        self._decode()
                except Exception as exc:  # a bug or OOM: fail the batch, keep serving
                    log.exception("generation step failed")
                    for job in admitted:  # not yet in the running batch
                        job.resolve(exc)
                    self._fail_all(exc)
        self._fail_all(Unavailable("the engine stopped"))

    def _admit(self) -> list[_Job]:
        """Waiting jobs that fit beside the running sequences (at least one when idle)."""
        admitted: list[_Job] = []
        room = self.max_batch_size - len(self._seqs)
        while self._waiting:
            job = self._waiting[0]
            if job.cancelled:
                self._waiting.popleft()
                continue
            if job.request.num_samples > room and (admitted or self._seqs):
                break
            self._waiting.popleft()
            admitted.append(job)
            room -= job.request.num_samples
        return admitted

    def _apply(self, cmd: _Command) -> None:
        try:
            cmd.apply()
        except Exception as exc:
            log.exception("adapter change failed")
            cmd.loop.call_soon_threadsafe(_settle, cmd.future, exc)
        else:
            cmd.loop.call_soon_threadsafe(_settle, cmd.future, None)

    def _forward(self, route: Route | None, **inputs: Any) -> torch.Tensor:
        bank = self._bank_or_fail()
        bank.active = route
        try:
            return self._base(**inputs, use_cache=True).logits
        finally:
            bank.active = None

    def _room(self) -> int:
        """The most tokens any live sequence may still generate (sizes the KV buffers)."""
        return max((s.rule.limit - len(s.tokens) for s in self._seqs), default=0)

    def _prefill(self, jobs: list[_Job]) -> None:
        bank = self._bank_or_fail()
        for job in [j for j in jobs if j.adapter not in bank]:  # unloaded while it waited
            job.resolve(
                NotFound(f"adapter {job.request.adapter_id} is not loaded", field="adapter")
            )
            jobs.remove(job)
        if not jobs:
            return
        prompts = [job.request.prompt_tokens for job in jobs]
        width = max(map(len, prompts))
        ids = torch.zeros((len(jobs), width), dtype=torch.long)
        mask = torch.zeros((len(jobs), width), dtype=torch.long)
        for row, prompt in enumerate(prompts):
            ids[row, width - len(prompt) :] = torch.tensor(prompt)
            mask[row, width - len(prompt) :] = 1
        want_prompt = any(j.request.prompt_logprobs or j.request.topk_prompt_logprobs for j in jobs)
        cache = new_cache()
        logits = self._forward(
            bank.route([job.adapter for job in jobs]),
            input_ids=ids,
            attention_mask=mask,
            position_ids=(mask.cumsum(-1) - 1).clamp(min=0),
            cache=cache,
            cache_position=torch.arange(width),
            logits_to_keep=0 if want_prompt else 1,
        ).float()
        for row, job in enumerate(jobs):
            if job.request.prompt_logprobs or job.request.topk_prompt_logprobs:
                self._prompt_logprobs(job, logits[row, width - len(prompts[row]) :])
        batch = KVBatch(cache, mask, torch.tensor([len(p) for p in prompts]))
        rows: list[int] = []
        seqs: list[_Seq] = []
        context = self.info().max_context_length
        for row, job in enumerate(jobs):
            params = job.request.params
            limit = params.max_tokens or context - len(job.request.prompt_tokens)
            for i in range(job.request.num_samples):
                seed = None if params.seed is None else params.seed ^ (i * _SAMPLE_SEED_STRIDE)
                rule = StopRule(params, self._eos, limit, self._decode_tokens)
                job.seqs.append(_Seq(job, make_generator(seed), rule))
                rows.append(row)
            seqs.extend(job.seqs)
        index = torch.tensor(rows)
        self._append(seqs, logits[:, -1].index_select(0, index))
        now = time.monotonic()
        for job in jobs:
            metrics.TTFT.observe(now - job.enqueued)
        self._seqs.extend(seqs)
        batch.select(index, self._room())
        if self._batch is None:
            self._batch = batch
        else:
            self._batch.extend(batch, self._room())
        self._route = None
        self._retire_finished()

    def _prompt_logprobs(self, job: _Job, logits: torch.Tensor) -> None:
        """Logprob of prompt token t under the prediction at t-1; the first has none."""
        prompt = torch.tensor(job.request.prompt_tokens)
        logp = torch.log_softmax(logits[:-1], dim=-1)
        if job.request.prompt_logprobs:
            picked = logp.gather(-1, prompt[1:, None]).flatten().tolist()
            job.prompt_logprobs = (math.nan, *picked)
        k = job.request.topk_prompt_logprobs
        if k:
            values, indices = logp.topk(k, dim=-1)
            rows = tuple(
                tuple(zip(ids, vals, strict=True))
                for ids, vals in zip(indices.tolist(), values.tolist(), strict=True)
            )
            job.topk = ((), *rows)

    def _decode(self) -> None:
        assert self._batch is not None
        if self._route is None:
            self._route = self._bank_or_fail().route([s.job.adapter for s in self._seqs])
        last = torch.tensor([[s.tokens[-1]] for s in self._seqs])
        logits = self._forward(
            self._route,
            input_ids=last,
            cache=self._batch.cache,
            **self._batch.step_inputs(),
        )
        self._append(self._seqs, logits[:, -1].float())
        self._retire_finished()

    def _append(self, seqs: list[_Seq], logits: torch.Tensor) -> None:
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

    def _retire_finished(self) -> None:
        """Drop finished or cancelled rows from the batch; answer jobs whose rows all finished."""
        keep = [i for i, s in enumerate(self._seqs) if s.reason is None and not s.job.cancelled]
        if len(keep) == len(self._seqs):
            return
        finished = {s.job for s in self._seqs if s.reason is not None and not s.job.cancelled}
        for job in finished:
            if all(s.reason is not None for s in job.seqs):
                job.resolve(_result(job))
        self._seqs = [self._seqs[i] for i in keep]
        self._route = None
        if keep:
            assert self._batch is not None
            self._batch.select(torch.tensor(keep), self._room())
        else:
            self._batch = None

    def _fail_all(self, exc: BaseException) -> None:
        with self._cv:
            jobs = {s.job for s in self._seqs} | set(self._waiting)
            self._waiting.clear()
            commands, self._commands = self._commands, []
        for job in jobs:
            job.resolve(exc)
        for cmd in commands:
            cmd.loop.call_soon_threadsafe(_settle, cmd.future, exc)
        self._seqs = []
        self._batch = None
        self._route = None

    def _decode_tokens(self, tokens: list[int]) -> str:
        return self._tokenizer.decode(tokens, skip_special_tokens=False)


def _lower_priority() -> None:
    """Nice the calling thread (Linux schedules threads individually); best effort."""
    with contextlib.suppress(OSError, AttributeError):
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)


def _settle(future: asyncio.Future[None], exc: BaseException | None) -> None:
    if future.done():
        return
    if exc is None:
        future.set_result(None)
    else:
        future.set_exception(exc)


def _result(job: _Job) -> SampleResult:
    return SampleResult(
        sequences=tuple(
            SampledSequence(tuple(s.tokens), tuple(s.logprobs), s.reason or "length")
            for s in job.seqs
        ),
        prompt_logprobs=job.prompt_logprobs,
        topk_prompt_logprobs=job.topk,
    )
