"""TorchEngine: the embedded CPU engine, continuous batching with mixed-adapter batches.

One scheduler thread owns the model (`decoder.Decoder`). Each iteration it applies adapter
installs and removals, admits waiting requests, prefills at most `prefill_chunk` prompt tokens
(chunked prefill, `prefill.py`: a long prompt advances a chunk at a time, so it never stalls
the running batch for long), then steps every decoding sequence together (`decode_batch.py`).
Rows of one decode step may use different adapters or the base model: the grouped LoRA of
`lora.py` routes each row through its own adapter in a fixed number of batched matmuls,
however many adapters the batch mixes. Adapters are read, checked, paired and laid out as
whole slots (`adapter_slots.py`) on a worker thread; the scheduler thread only copies them
into place, one copy per projection. While it decodes, publishes are paced to a CPU budget
(`pacing.py`), so a publisher pushing back to back cannot take more than that share from the
running batch; the replica's other threads yield to the decoding one (`thread_priority.py`:
the GIL switch interval, and niceness with `favour_decoding`).

A request's prompt is prefilled once, whatever its `num_samples`, and its samples attend to
that one copy of its keys/values (`shared_prefixes.py`); greedy samples are one sequence,
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
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, cast

import torch
from peft import LoraConfig
from transformers import AutoModelForCausalLM, AutoTokenizer

from lorafleet import quantize
from lorafleet.contract import sample_seed
from lorafleet.errors import InvalidArgument, NotFound, Unavailable
from lorafleet_rollout import metrics
from lorafleet_rollout.adapter_slots import LaidOut
from lorafleet_rollout.allocator import TUNABLES, keep_freed_memory, tunables_active, warm
from lorafleet_rollout.decode_batch import DecodeBatch
from lorafleet_rollout.decoder import Decoder
from lorafleet_rollout.engine import AdapterSource
from lorafleet_rollout.kv_pool import KvPool
from lorafleet_rollout.lora import adapter_weights, rank_class
from lorafleet_rollout.pacing import PUBLISH_BURST, PublishPacer
from lorafleet_rollout.peft_io import (
    Banks,
    check_fits,
    expert_banks,
    linear_shapes,
    read_peft_dir,
)
from lorafleet_rollout.prefill import Prefill
from lorafleet_rollout.prefix_cache import PrefixCache
from lorafleet_rollout.sample_jobs import Command, Job, Seq, settle
from lorafleet_rollout.sampling import make_generator
from lorafleet_rollout.stopping import StopRule
from lorafleet_rollout.thread_priority import (
    lower_all_but,
    lower_priority,
    shorten_switch_interval,
)
from lorafleet_rollout.types import EngineInfo, LoraSpec, SampleRequest, SampleResult

log = logging.getLogger(__name__)

#: Seconds an idle engine keeps its decode cache (`SlotCache`) for the next batch. Freeing it
#: at once cost the next batch a fresh zero-filled buffer: on workload (c) (4 x 1,500-token
#: prompts, bench/sampling.py --vs-vllm) page faults and zeroing took ~20 % of the time.
#: The spare keys/values buffers of prompts and segments (`kv_pool.py`) go with it.
_KEEP_IDLE_CACHE = 10.0


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
        publish_cpu_burst: float = PUBLISH_BURST,
        quantization: str = quantize.NONE,
        warm_bytes: int = 0,
    ) -> None:
        self.model_path = model_path
        #: Heap faulted in at start-up for the first batches (`allocator.warm`).
        self.warm_bytes = warm_bytes
        self.quantization = quantization
        self.max_batch_size = max_batch_size
        self.max_lora_rank = max_lora_rank
        self.dtype = dtype
        self.prefill_chunk = prefill_chunk
        self.favour_decoding = favour_decoding
        self._pacer = PublishPacer(
            publish_cpu_share, publish_cpu_burst, lambda: bool(self._batch.seqs or self._prefilling)
        )
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
        self._waiting: collections.deque[Job] = collections.deque()
        self._commands: list[Command] = []
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._prefilling: list[Job] = []
        #: Buffers of finished prompts' and segments' keys/values, for the next ones.
        self._kv_pool = KvPool()
        self._prefill_step = Prefill(self.prefix_cache, self._kv_pool)
        self._batch = DecodeBatch(self.prefix_cache, self._kv_pool)
        # Reading, checking and pairing a pushed adapter runs here, one at a time and niced,
        # so a publish takes CPU the running batch leaves over; the scheduler thread only
        # copies the prepared tensors into its preallocated stacks.
        self._prep = ThreadPoolExecutor(1, "adapter-prep", initializer=self._start_prep)

    # ----------------------------------------------------------------- lifecycle
    async def start(self) -> None:
        shorten_switch_interval()
        keep_freed_memory()
        await asyncio.to_thread(self._load_model)
        self._thread = threading.Thread(target=self._run, name="torch-engine", daemon=True)
        self._thread.start()
        if self.favour_decoding and self._thread.native_id is not None:
            lower_all_but(self._thread.native_id)
        self._pacer.watch()

    def _start_prep(self) -> None:
        lower_priority()
        self._pacer.watch()

    def _load_model(self) -> None:
        model = AutoModelForCausalLM.from_pretrained(self.model_path, dtype=self.dtype)
        model.eval()
        # The trainer's quantized weights, dequantized once: the decoder packs and multiplies
        # them like any float weights, so its kernels are unchanged (lorafleet.quantize).
        quantize.dequantize_in_place(model, self.quantization)
        self._decoder = Decoder(model, native=self.native_kernels)
        seconds = warm(self.warm_bytes)
        log.info(
            "heap %s; warmed %d bytes in %.1f s",
            f"kept (GLIBC_TUNABLES {TUNABLES})"
            if tunables_active()
            else "with glibc's defaults (freed memory goes back to the system)",
            self.warm_bytes,
            seconds,
        )
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
            rank_class=rank_class,
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
        await self._pacer.wait()
        loop = asyncio.get_running_loop()
        weights = await loop.run_in_executor(self._prep, self._prepare, source, lora)
        name = f"a{next(self._counter)}"
        await self._submit(lambda: self._model().install(name, weights))
        self._names[adapter_id] = name
        self._pacer.charge()  # now, so that a publish made while idle costs nothing

    async def unload_adapter(self, adapter_id: str) -> None:
        name = self._names.pop(adapter_id, None)
        if name is not None:

            def remove() -> None:
                self._model().remove(name)
                self.prefix_cache.drop(name)

            await self._submit(remove)

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
        cmd = Command(apply, loop, loop.create_future())
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
        job = Job(request, adapter, loop, loop.create_future())
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
                        or self._batch.seqs
                        or self._prefilling
                    ):
                        cache = None if self._decoder is None else self._decoder.cache
                        if cache is None or cache.store is None:
                            self._cv.wait()
                        elif not self._cv.wait(_KEEP_IDLE_CACHE):
                            # idle a while: its memory goes back to the heap, for the
                            # rest of the process (and the system, without allocator.TUNABLES)
                            cache.clear()
                            self._kv_pool.clear()
                    if self._stopping:
                        break
                    commands, self._commands = self._commands, []
                    self._admit()
                for cmd in commands:
                    self._apply(cmd)
                try:
                    if self._prefilling:
                        self._prefill()
                    if self._batch.seqs:
                        self._batch.step(self._model())
                except Exception as exc:  # a bug or OOM: fail the batch, keep serving
                    log.exception("generation step failed")
                    self._fail_all(exc)
        self._fail_all(Unavailable("the engine stopped"))

    def _admit(self) -> None:
        """Move waiting jobs that fit beside the live sequences (at least one when idle)."""
        room = self.max_batch_size - len(self._batch.seqs)
        room -= sum(j.rows for j in self._prefilling)
        while self._waiting:
            job = self._waiting[0]
            if job.cancelled:
                self._waiting.popleft()
                continue
            if job.rows > room and (self._prefilling or self._batch.seqs):
                break
            self._waiting.popleft()
            self._prefilling.append(job)
            room -= job.rows

    def _apply(self, cmd: Command) -> None:
        try:
            cmd.apply()
        except Exception as exc:
            log.exception("adapter change failed")
            cmd.loop.call_soon_threadsafe(settle, cmd.future, exc)
        else:
            cmd.loop.call_soon_threadsafe(settle, cmd.future, None)

    def _prefill(self) -> None:
        """Advance waiting prompts by a chunk (`prefill.py`) and start decoding those that
        finish."""
        model = self._model()
        finished = self._prefill_step.step(model, self._prefilling, self.prefill_chunk)
        # Prompts sharing a prefix join one after another: the first's row moves onto the
        # shared segment before other rows grow the slot cache around its long prompt.
        finished.sort(key=lambda item: (str(item[0].adapter), item[0].request.prompt_tokens))
        joining = [job for job, _ in finished]
        for job, logits in finished:
            self._join(model, job, logits, joining)

    def _join(
        self, model: Decoder, job: Job, logits: torch.Tensor, joining: Sequence[Job] = ()
    ) -> None:
        """A prompt is prefilled: cache its prefix, start its samples (seeds, stop rules) and
        let them join the decode batch (`decode_batch.py`)."""
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
            job.seqs.append(Seq(job, make_generator(seed), rule, len(prompt)))
        metrics.TTFT.observe(time.monotonic() - job.enqueued)
        self._batch.join(model, job, logits, joining, limit)

    def _fail_all(self, exc: BaseException) -> None:
        with self._cv:
            jobs = {s.job for s in self._batch.seqs} | set(self._waiting) | set(self._prefilling)
            self._waiting.clear()
            commands, self._commands = self._commands, []
        for job in jobs:
            job.resolve(exc)
        for cmd in commands:
            cmd.loop.call_soon_threadsafe(settle, cmd.future, exc)
        self._batch.clear()
        self._prefilling = []
        self._kv_pool.clear()
        if self._decoder is not None:
            self._decoder.cache.clear()

    def _decode_tokens(self, tokens: Sequence[int]) -> str:
        # One sequence decodes to one string (transformers types decode as str | list[str]).
        return cast(str, self._tokenizer.decode(tokens, skip_special_tokens=False))
