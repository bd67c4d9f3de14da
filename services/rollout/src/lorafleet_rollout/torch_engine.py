"""TorchEngine: the embedded CPU engine, continuous batching with mixed-adapter batches.

One scheduler thread owns the model (`decoder.Decoder`). Each iteration it applies adapter
installs and removals, admits waiting requests, prefills at most `prefill_chunk` prompt tokens
(chunked prefill: a long prompt advances a chunk at a time, so it never stalls the running
batch for long), then steps every decoding sequence together. Rows of one decode step may use
different adapters or the base model: the grouped LoRA of `lora.py` routes each row through its
own adapter in a fixed number of batched matmuls, however many adapters the batch mixes.
Adapters are read, checked, paired and laid out as whole slots on a worker thread; the
scheduler thread only copies them into place, one copy per projection. While it decodes,
publishes are paced to a CPU budget (`pacing.py`), so a publisher pushing back to back cannot
take more than that share from the running batch.

A request's prompt is prefilled once, whatever its `num_samples`, and its samples attend to
that one copy of its keys/values (`decoder.Segment`); greedy samples are one sequence,
decoded once. Prompt prefixes shared across requests are reused from a
byte-bounded LRU radix cache (`prefix_cache.py`), so only the part a request does not share
is computed. Prompt logprobs come off that one prompt pass too (such a prompt is computed
whole, as the cached part has no logits).

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
import sys
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from peft import LoraConfig
from transformers import AutoModelForCausalLM, AutoTokenizer

from lorafleet import quantize
from lorafleet.contract import sample_seed
from lorafleet.errors import InvalidArgument, NotFound, Unavailable
from lorafleet_rollout import metrics
from lorafleet_rollout.decoder import Decoder, LaidOut, PrefillPart
from lorafleet_rollout.engine import AdapterSource
from lorafleet_rollout.kv_cache import Segment
from lorafleet_rollout.lora import Route, adapter_weights, make_route
from lorafleet_rollout.pacing import CpuBudget
from lorafleet_rollout.peft_io import (
    Banks,
    check_fits,
    expert_banks,
    linear_shapes,
    read_peft_dir,
)
from lorafleet_rollout.prefix_cache import BLOCK, PrefixCache
from lorafleet_rollout.sampling import choose_tokens, make_generator
from lorafleet_rollout.stopping import StopRule
from lorafleet_rollout.types import (
    EngineInfo,
    LoraSpec,
    SampledSequence,
    SampleRequest,
    SampleResult,
    StopReason,
)

log = logging.getLogger(__name__)

#: Decode columns reserved beyond a sequence's current length when the cache (re)grows.
_SPARE_COLUMNS = 256
#: Seconds an idle engine keeps its decode cache (`SlotCache`) for the next batch. Freeing it
#: at once cost the next batch a fresh zero-filled buffer: on workload (c) (4 x 1,500-token
#: prompts, bench/sampling.py --vs-vllm) page faults and zeroing took ~20 % of the time.
_KEEP_IDLE_CACHE = 10.0
#: Bytes of prompt and segment keys/values buffers kept for the next ones (`_kv_buffer`),
#: released with the idle cache: a fresh buffer each cost ~12 % of workload (c) in page
#: faults and unmapping, and (d)'s first pass ran ~20 % slower than later ones (glibc maps
#: buffers this big afresh until its threshold adapts; over 32 MB, always).
_SPARE_KV_BYTES = 1 << 30
#: Shortest cached prefix worth a shared decode segment (each costs a copy of the prefix, and a
#: few torch ops per layer where the native kernels are missing).
_MIN_SEGMENT = 64
#: Python's GIL switch interval while this engine runs. The scheduler thread gives the GIL up
#: in every torch op and must win it back from the gRPC loop and the adapter-prep thread, which
#: run Python while a publish streams in; at the default 5 ms a decode step beside a busy Python
#: thread took 2.6x its quiet time, at 0.5 ms 1.6x (measured side by side, bench model).
_SWITCH_INTERVAL = 0.0005
#: Niceness of a replica's threads other than the decoding one (0 = normal, 19 = least).
#: Others' throughput under back-to-back publishing, median of 6 rounds (bench/sampling.py,
#: 2 replicas and the publisher on 2 cores): 0.75 all equal, 0.79 at 10, 0.84 at 19, within
#: the noise; but at 19 a publish during sampling took 0.6 s (p50) against 0.15-0.22 s at 10.
#: SCHED_IDLE was worse (0.62: a starved thread holding the GIL stalls the decoding one).
_NICE = 10
#: CPU seconds publishing may take at once before the publish budget paces it (`pacing.py`):
#: a few bench-model publishes (~8 ms each across a replica's publishing threads).
_PUBLISH_BURST = 0.03
#: How often a paced publish looks again (decoding may have stopped, freeing it at once).
_PACE_POLL = 0.05
_SHARED_ROWS = metrics.DECODE_ROWS.labels("shared")
_OWN_ROWS = metrics.DECODE_ROWS.labels("own")


@dataclass(eq=False)
class _Job:
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
    seqs: list[_Seq] = field(default_factory=list)

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
class _Seq:
    job: _Job
    generator: torch.Generator
    rule: StopRule
    pos: int  # tokens before the next one fed, which goes to this position
    segment: Segment | None = None  # the shared prompt prefix it attends to, if any
    prefix: tuple[str | None, tuple[int, ...]] | None = None  # its prefix-cache hit
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    reason: StopReason | None = None


@dataclass(eq=False)
class _Prefix:
    """A cached prompt prefix that running rows share in decode, and how many do."""

    segment: Segment
    #: [layers, 2, kv_heads, length, dim]: the segment's memory, a spare again when no row
    #: reads it (a fresh copy per batch cost page faults: a 1,000-token prefix is ~25 MB).
    kv: torch.Tensor
    rows: int = 0


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
        prefix_cache_bytes: int = 256 << 20,
        prefill_chunk: int = 512,
        favour_decoding: bool = False,
        native_kernels: bool = True,
        publish_cpu_share: float = 0.0,
        publish_cpu_burst: float = _PUBLISH_BURST,
        quantization: str = quantize.NONE,
    ) -> None:
        self.model_path = model_path
        self.quantization = quantization
        self.max_batch_size = max_batch_size
        self.max_lora_rank = max_lora_rank
        self.dtype = dtype
        self.prefill_chunk = prefill_chunk
        self.favour_decoding = favour_decoding
        self._budget = (
            CpuBudget(publish_cpu_share, publish_cpu_burst) if publish_cpu_share else None
        )
        #: CPU clocks of the threads that take in publishes (pacing): the event loop's, which
        #: receives and hashes the files, and the adapter-prep thread's, once they run.
        self._publish_clocks: list[int] = []
        self.native_kernels = native_kernels
        self.prefix_cache = PrefixCache(prefix_cache_bytes)
        self._decoder: Decoder | None = None
        self._linears: dict[str, tuple[int, int]] = {}
        self._banks: Banks = {}
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
        self._prefilling: list[_Job] = []
        self._seqs: list[_Seq] = []  # row i of the decode batch lives in cache slot i
        self._route: Route | None = None
        self._shared: list[tuple[Segment, torch.Tensor]] = []  # segment, its rows
        self._shared_rows = 0
        self._route_stale = True  # route and _shared need rebuilding (rows changed)
        #: Prefix-cache hits of running rows, by (adapter, tokens): from the second row on,
        #: requests that hit the same prefix share one copy of it in decode too.
        self._prefixes: dict[tuple[str | None, tuple[int, ...]], _Prefix] = {}
        #: Flat buffers of finished prompts' keys/values, for the next ones (`_kv_buffer`).
        self._spare_kv: list[torch.Tensor] = []
        # Reading, checking and pairing a pushed adapter runs here, one at a time and niced,
        # so a publish takes CPU the running batch leaves over; the scheduler thread only
        # copies the prepared tensors into its preallocated stacks.
        self._prep = ThreadPoolExecutor(1, "adapter-prep", initializer=self._start_prep)

    # ----------------------------------------------------------------- lifecycle
    async def start(self) -> None:
        sys.setswitchinterval(min(sys.getswitchinterval(), _SWITCH_INTERVAL))
        await asyncio.to_thread(self._load_model)
        self._thread = threading.Thread(target=self._run, name="torch-engine", daemon=True)
        self._thread.start()
        if self.favour_decoding and self._thread.native_id is not None:
            _lower_all_but(self._thread.native_id)
        if self._budget is not None:
            try:
                self._publish_clocks.append(time.pthread_getcpuclockid(threading.get_ident()))
            except (AttributeError, OSError):  # not a POSIX platform
                log.warning("no per-thread CPU clock here: publishes are not paced")
                self._budget = None

    def _start_prep(self) -> None:
        _lower_priority()
        if self._budget is not None:
            self._publish_clocks.append(time.pthread_getcpuclockid(threading.get_ident()))

    def _load_model(self) -> None:
        model = AutoModelForCausalLM.from_pretrained(self.model_path, dtype=self.dtype)
        model.eval()
        # The trainer's quantized weights, dequantized once: the decoder packs and multiplies
        # them like any float weights, so its kernels are unchanged (lorafleet.quantize).
        quantize.dequantize_in_place(model, self.quantization)
        self._decoder = Decoder(model, native=self.native_kernels)
        self._linears = linear_shapes(model)
        self._banks = expert_banks(model)
        with contextlib.suppress(Exception):
            self._tokenizer = AutoTokenizer.from_pretrained(self.model_path)
        eos: set[int] = set()
        for source in (model.config, getattr(model, "generation_config", None), self._tokenizer):
            ids = getattr(source, "eos_token_id", None)
            if ids is not None:
                eos.update([ids] if isinstance(ids, int) else ids)
        self._eos = frozenset(eos)
        self._info = EngineInfo(
            engine="torch",
            base_model=str(self.model_path),
            max_context_length=self._decoder.max_positions,
            vocab_size=int(self._decoder.embed.shape[0]),
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
        await self._paced()
        loop = asyncio.get_running_loop()
        weights = await loop.run_in_executor(self._prep, self._prepare, source, lora)
        name = f"a{next(self._counter)}"
        await self._submit(lambda: self._model().install(name, weights))
        self._names[adapter_id] = name
        self._charge_publishing()  # now, so that a publish made while idle costs nothing

    async def unload_adapter(self, adapter_id: str) -> None:
        name = self._names.pop(adapter_id, None)
        if name is not None:

            def remove() -> None:
                self._model().remove(name)
                self.prefix_cache.drop(name)

            await self._submit(remove)

    async def _paced(self) -> None:
        """While the engine decodes, wait until the CPU its publishing threads took is
        within the publish budget (`pacing.py`); an idle engine never waits."""
        while True:
            wait = self._charge_publishing()
            if wait <= 0:
                return
            await asyncio.sleep(min(wait, _PACE_POLL))  # decoding may stop sooner

    def _charge_publishing(self) -> float:
        """Charge the publishing threads' CPU since the last call to the budget, or forgive
        it when nothing decodes; return how long a publish must wait now."""
        if self._budget is None:
            return 0.0
        used = sum(map(time.clock_gettime, self._publish_clocks))
        if not (self._seqs or self._prefilling):
            self._budget.refill(used)
            return 0.0
        return self._budget.wait(used)

    def _prepare(self, source: AdapterSource, lora: LoraSpec) -> LaidOut:
        """Read, check, pair and lay out an adapter's tensors, off the scheduler thread."""
        if isinstance(source, Path):
            config, tensors = read_peft_dir(source)
        else:
            config = LoraConfig(
                r=lora.rank,
                # PEFT annotates lora_alpha as int, but fractional alphas are valid Tinker
                # options and PEFT only divides by them (scale = alpha / r).
                lora_alpha=lora.alpha,  # type: ignore[arg-type]
                target_modules=list(lora.target_modules) or None,
                inference_mode=True,
            )
            tensors = source
        check_fits(tensors, config, self._linears, self.max_lora_rank, self._banks)
        return self._model().lay_out(adapter_weights(config, tensors, self._banks))

    def _model(self) -> Decoder:
        if self._decoder is None:
            raise Unavailable("the model is still loading")
        return self._decoder

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
            adapter = None
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
                    while not (
                        self._stopping
                        or self._commands
                        or self._waiting
                        or self._seqs
                        or self._prefilling
                    ):
                        cache = None if self._decoder is None else self._decoder.cache
                        if cache is None or cache.store is None:
                            self._cv.wait()
                        elif not self._cv.wait(_KEEP_IDLE_CACHE):
                            cache.clear()  # idle a while: give its memory back
                            self._spare_kv.clear()
                    if self._stopping:
                        break
                    commands, self._commands = self._commands, []
                    self._admit()
                for cmd in commands:
                    self._apply(cmd)
                try:
                    if self._prefilling:
                        self._prefill()
                    if self._seqs:
                        self._decode()
                except Exception as exc:  # a bug or OOM: fail the batch, keep serving
                    log.exception("generation step failed")
                    self._fail_all(exc)
        self._fail_all(Unavailable("the engine stopped"))

    def _admit(self) -> None:
        """Move waiting jobs that fit beside the live sequences (at least one when idle)."""
        room = self.max_batch_size - len(self._seqs)
        room -= sum(j.rows for j in self._prefilling)
        while self._waiting:
            job = self._waiting[0]
            if job.cancelled:
                self._waiting.popleft()
                continue
            if job.rows > room and (self._prefilling or self._seqs):
                break
            self._waiting.popleft()
            self._prefilling.append(job)
            room -= job.rows

    def _apply(self, cmd: _Command) -> None:
        try:
            cmd.apply()
        except Exception as exc:
            log.exception("adapter change failed")
            cmd.loop.call_soon_threadsafe(_settle, cmd.future, exc)
        else:
            cmd.loop.call_soon_threadsafe(_settle, cmd.future, None)

    def _prefill(self) -> None:
        """Advance waiting prompts by up to `prefill_chunk` tokens in all, oldest first, as
        one batch (one GEMM per projection, so the weights stream once for all of them).

        A prompt that shares uncached prefix blocks with one being computed waits for it
        (`_should_wait`): those blocks then come from the prefix cache, computed once.
        """
        model = self._model()
        budget = self.prefill_chunk
        computing = [job for job in self._prefilling if job.kv is not None]
        batch: list[tuple[_Job, int]] = []
        for job in list(self._prefilling):
            if budget <= 0:
                break
            if job.cancelled or job.adapter not in model:
                self._prefilling.remove(job)
                if not job.cancelled:  # unloaded while it waited
                    job.resolve(
                        NotFound(f"adapter {job.request.adapter_id} is not loaded", field="adapter")
                    )
                continue
            if job.kv is None:
                if self._should_wait(job, computing):
                    continue
                self._start_prefill(model, job)
                computing.append(job)
            end = min(len(job.request.prompt_tokens), job.done + budget)
            batch.append((job, end))
            budget -= end - job.done
        if not batch:
            return
        hidden = model.prefill(
            [
                PrefillPart(
                    torch.tensor(job.request.prompt_tokens[job.done : end]),
                    job.done,
                    job.keys,
                    job.values,
                    model.slot(job.adapter),
                )
                for job, end in batch
            ]
        )
        first = 0
        finished: list[tuple[_Job, torch.Tensor]] = []
        for job, end in batch:
            rows = hidden[first : first + end - job.done]
            first += end - job.done
            metrics.PROMPT_TOKENS.labels("computed").inc(end - job.done)
            slot = model.slot(job.adapter)
            if job.wants_prompt:
                spans = [(0, rows.shape[0], slot)] if slot else None
                self._prompt_logprobs(job, model.logits(rows, spans).float(), end)
            job.done = end
            if end == len(job.request.prompt_tokens):
                self._prefilling.remove(job)
                last = [(0, 1, slot)] if slot else None
                finished.append((job, model.logits(rows[-1:], last).float()))
        # Prompts sharing a prefix join one after another: the first's row moves onto the
        # shared segment before other rows grow the slot cache around its long prompt.
        finished.sort(key=lambda item: (str(item[0].adapter), item[0].request.prompt_tokens))
        joining = [job for job, _ in finished]
        for job, logits in finished:
            self._join(model, job, logits, joining)

    def _should_wait(self, job: _Job, computing: list[_Job]) -> bool:
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

    def _start_prefill(self, model: Decoder, job: _Job) -> None:
        prompt = job.request.prompt_tokens
        shape = (len(model.layers), 2, model.kv_heads, len(prompt), model.head_dim)
        # Uninitialised: every column is written (cache hit, then prefill) before it is read.
        job.kv = self._kv_buffer(shape, model.dtype)
        if job.wants_prompt:  # every prompt position's logits are needed: compute them all
            job.prompt_logprobs = [math.nan]
            job.topk = [()]
            return
        job.cached = job.done = self.prefix_cache.match_into(job.adapter, prompt, job.kv)
        metrics.PROMPT_TOKENS.labels("cached").inc(job.done)

    def _kv_buffer(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A prompt's keys/values buffer: the smallest spare one that is big enough (its pages
        are mapped already), else a new one."""
        need = math.prod(shape)
        fits = [i for i, spare in enumerate(self._spare_kv) if spare.numel() >= need]
        if not fits:
            return torch.empty(shape, dtype=dtype)
        spare = self._spare_kv.pop(min(fits, key=lambda i: self._spare_kv[i].numel()))
        return spare[:need].view(shape)

    def _spare(self, kv: torch.Tensor) -> None:
        """Keep kv's memory for `_kv_buffer` (nothing may read kv any more)."""
        self._spare_kv.append(kv.new_empty(0).set_(kv.untyped_storage()))
        while sum(t.untyped_storage().nbytes() for t in self._spare_kv) > _SPARE_KV_BYTES:
            self._spare_kv.pop(0)

    def _prompt_logprobs(self, job: _Job, logits: torch.Tensor, end: int) -> None:
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

    def _join(
        self, model: Decoder, job: _Job, logits: torch.Tensor, joining: Sequence[_Job] = ()
    ) -> None:
        """A prompt is prefilled: cache its prefix, start its samples, and give each a decode
        slot holding the keys/values it does not share (see `_segment_for`)."""
        request = job.request
        prompt = request.prompt_tokens
        assert job.kv is not None
        self.prefix_cache.insert(job.adapter, prompt, job.kv)
        params = request.params
        limit = params.max_tokens or self.info().max_context_length - len(prompt)
        for i in range(job.rows):
            # Distinct, reproducible per-sample seeds: the contract's one rule.
            seed = None if params.seed is None else sample_seed(params.seed, i)
            rule = StopRule(params, self._eos, limit, self._decode_tokens)
            job.seqs.append(_Seq(job, make_generator(seed), rule, len(prompt)))
        metrics.TTFT.observe(time.monotonic() - job.enqueued)
        self._append(job.seqs, logits.expand(job.rows, -1))
        live = [s for s in job.seqs if s.reason is None]
        segment = None
        if live:
            segment = self._segment_for(job, live, joining)
            base = 0 if segment is None else segment.length
            first = len(self._seqs)
            own = len(prompt) - base
            used = max((s.pos - _shared_length(s) for s in self._seqs), default=0)
            model.cache.reserve(first + len(live), own + min(limit, _SPARE_COLUMNS) + 1, used)
            model.cache.fill(slice(first, first + len(live)), job.kv[:, :, :, base:])
            self._seqs.extend(live)
            self._route_stale = True
        if segment is None or not _aliases(segment, job.kv):
            self._spare(job.kv)
        job.kv, job.cached = None, 0
        if not live:
            job.resolve(_result(job))

    def _segment_for(self, job: _Job, live: list[_Seq], joining: Sequence[_Job]) -> Segment | None:
        """What a prefilled job's rows share in decode: its whole prompt when it has several
        samples, else the cached prefix it shares with running rows (`_shared_prefix`),
        else nothing."""
        segment = None
        if len(live) > 1:
            segment = Segment(job.keys, job.values)
        elif job.cached:
            segment = self._shared_prefix(job, live[0], joining)
        for seq in live:
            seq.segment = segment
        return segment

    def _shared_prefix(self, job: _Job, seq: _Seq, joining: Sequence[_Job]) -> Segment | None:
        """The cached prefix a one-row request shares with running rows of its adapter (a
        common system prompt: where cached prompts diverge, else its whole hit), as one
        segment for all of them. Rows that hold that prefix in their own slot (the first
        to arrive) move their later columns down onto it, a copy of those columns only, so
        no row's attention reads the shared part from its own slot."""
        prompt, matched = job.request.prompt_tokens, job.cached
        length = self.prefix_cache.branch(job.adapter, prompt, matched) or matched
        if length < _MIN_SEGMENT:
            return None
        key = (job.adapter, prompt[:length])
        entry = self._prefixes.get(key)
        if entry is None:
            partners = [
                row
                for row, other in enumerate(self._seqs)
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
            prefix = self._kv_buffer((layers, 2, heads, length, dim), job.kv.dtype)
            prefix.copy_(job.kv[:, :, :, :length])
            entry = _Prefix(Segment(list(prefix[:, 0]), list(prefix[:, 1])), prefix)
            self._prefixes[key] = entry
            model = self._model()
            for row in partners:
                partner = self._seqs[row]
                model.cache.shift(row, length, partner.pos)
                partner.segment, partner.prefix = entry.segment, key
                entry.rows += 1
            self._route_stale = True
        entry.rows += 1
        seq.prefix = key
        return entry.segment

    def _decode(self) -> None:
        model = self._model()
        if self._route_stale:
            self._route = make_route([model.slot(s.job.adapter) for s in self._seqs])
            groups: dict[Segment, list[int]] = {}
            for row, seq in enumerate(self._seqs):
                if seq.segment is not None:
                    groups.setdefault(seq.segment, []).append(row)
            self._shared = [(seg, torch.tensor(rows)) for seg, rows in groups.items()]
            self._shared_rows = sum(map(len, groups.values()))
            self._route_stale = False
        _SHARED_ROWS.inc(self._shared_rows)
        _OWN_ROWS.inc(len(self._seqs) - self._shared_rows)
        pos = torch.tensor([s.pos for s in self._seqs])
        cols = pos - torch.tensor([_shared_length(s) for s in self._seqs])
        length = int(cols.max()) + 1
        if length > model.cache.capacity:
            model.cache.reserve(len(self._seqs), length + _SPARE_COLUMNS)
        logits = model.decode(
            torch.tensor([s.tokens[-1] for s in self._seqs]),
            pos,
            cols,
            length,
            self._route,
            self._shared,
        )
        for seq in self._seqs:
            seq.pos += 1
        self._append(self._seqs, logits.float())
        self._retire_finished(length)

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

    def _retire_finished(self, length: int) -> None:
        """Drop finished or cancelled rows; answer jobs whose rows all finished. Rows from the
        end of the batch move into the freed slots, so only those rows are copied."""
        gone = [i for i, s in enumerate(self._seqs) if s.reason is not None or s.job.cancelled]
        if not gone:
            return
        for job in {self._seqs[i].job for i in gone}:
            if not job.cancelled and all(s.reason is not None for s in job.seqs):
                job.resolve(_result(job))
        for i in gone:
            key = self._seqs[i].prefix
            if key is not None:
                self._prefixes[key].rows -= 1
                if not self._prefixes[key].rows:  # its rows are gone, and so is the segment
                    self._spare(self._prefixes.pop(key).kv)  # once `_shared` is rebuilt
        size = len(self._seqs) - len(gone)
        holes = [i for i in gone if i < size]
        movers = [i for i in range(size, len(self._seqs)) if i not in set(gone)]
        if holes:
            model = self._model()
            model.cache.move(torch.tensor(holes), torch.tensor(movers), length)
            for hole, mover in zip(holes, movers, strict=True):
                self._seqs[hole] = self._seqs[mover]
        del self._seqs[size:]
        self._route_stale = True

    def _fail_all(self, exc: BaseException) -> None:
        with self._cv:
            jobs = {s.job for s in self._seqs} | set(self._waiting) | set(self._prefilling)
            self._waiting.clear()
            commands, self._commands = self._commands, []
        for job in jobs:
            job.resolve(exc)
        for cmd in commands:
            cmd.loop.call_soon_threadsafe(_settle, cmd.future, exc)
        self._seqs = []
        self._prefilling = []
        self._prefixes = {}
        self._spare_kv = []
        self._route_stale = True
        if self._decoder is not None:
            self._decoder.cache.clear()

    def _decode_tokens(self, tokens: Sequence[int]) -> str:
        return self._tokenizer.decode(tokens, skip_special_tokens=False)


def _aliases(segment: Segment, kv: torch.Tensor) -> bool:
    """Whether a decode segment reads `kv`'s memory (then kv must not be reused)."""
    return segment.layers[0][0].untyped_storage().data_ptr() == kv.untyped_storage().data_ptr()


def _shared_length(seq: _Seq) -> int:
    """Prompt tokens a row reads from its shared segment, not from its own slot."""
    return 0 if seq.segment is None else seq.segment.length


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


def _lower_priority() -> None:
    """Nice the calling thread (Linux schedules threads individually); best effort."""
    with contextlib.suppress(OSError, AttributeError):
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), _NICE)


def _lower_all_but(decoding: int) -> None:
    """Nice every thread of this process but the decoding one; threads started later inherit
    it from the thread that starts them. A replica's other threads (gRPC, staging, hashing a
    publish) then take mostly CPU decoding leaves (see `_NICE`). Best effort: without /proc
    (not Linux) nothing changes."""
    with contextlib.suppress(OSError):
        for task in os.listdir("/proc/self/task"):
            if int(task) != decoding:
                with contextlib.suppress(OSError):
                    os.setpriority(os.PRIO_PROCESS, int(task), _NICE)


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
            for s in job.seqs * (job.request.num_samples // len(job.seqs))
        ),
        prompt_logprobs=tuple(job.prompt_logprobs) if job.request.prompt_logprobs else (),
        topk_prompt_logprobs=tuple(job.topk) if job.request.topk_prompt_logprobs else (),
    )
