"""SGLangEngine: drives a real SGLang server (GPU clusters, or its CPU backend) over HTTP.

Schema: `sglang_api.py` (sglang 0.5.23). What the driver guarantees, and why:

* **Nothing the server cannot serve reaches it.** At start the driver reads the server's
  `--lora-target-modules` and `--max-lora-rank` (/server_info); every adapter is checked
  against them and written in SGLang's layout (expert LoRA converted) by `sglang_lora.py`
  before `/load_lora_adapter`. SGLang itself only warns about weights that map to no module and
  then dies on the first batch using them.
* **A retired version is never served.** SGLang remembers every name it ever loaded and, when a
  request names one that was unloaded, silently re-loads it from its original path
  (`TokenizerManager._resolve_lora_path`). So each load gets a fresh server name
  (`<adapter id>#<nonce>`) and its own published folder, which the driver deletes on unload: the
  driver never sends a retired name, and a request that did would find no folder to re-load
  from. Fresh names also keep SGLang's radix cache (keyed by adapter) from serving prefixes of
  older weights.
* **A restarted server is reconciled.** A restarted SGLang has forgotten every adapter. The
  driver compares the server's list (`/v1/models`) with the versions it serves, re-loads the
  missing ones from their published folders and unloads names of its own (`#` in them) it no
  longer serves (the server is this rollout's alone); it does so every `reconcile_interval`
  seconds and at once when /generate says an adapter it serves was never loaded (then retries
  that request once).
* **The service decides what is loaded.** Past `--max-loaded-loras` SGLang would unload its own
  least recently used adapter behind the service's back; the driver reports the limit
  (`EngineInfo.max_loaded_adapters`) and `RolloutCore` evicts (`/unload_lora_adapter`) before
  any load that would pass it.
* **Every request names its adapter** in `lora_path` (None for the base): without it SGLang
  silently samples the base model.
* **Seeds.** SGLang honours seeds only when started with `--enable-deterministic-inference`
  (GPU attention backends only), and then gives the n copies of one request the same seed, so
  they come out identical. On such a server a seeded request goes as a batch of n single-sample
  requests, each with its own seed from `lorafleet.contract.sample_seed`; otherwise (seeds
  ignored: `start()` logs that once) as one request with n, which prefills the prompt once.
* **Logprobs are the model's own.** Unless SGLANG_RETURN_ORIGINAL_LOGPROB=1 is set in the
  server's environment, SGLang reports logprobs of the temperature-scaled distribution, which
  RL losses must not get. The launcher (`sglang_server.py`, the chart) sets it; `start()`
  verifies it on the server (the top token's logprob at temperature 1 and 0.25 must agree) and
  refuses to serve otherwise.
* **Streaming** reads SGLang's SSE frames (cumulative snapshots, one stream per sample tagged by
  `index`) and keeps the last frame of every sample; TTFT is observed at the first frame.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import math
import shutil
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import httpx
from pydantic import BaseModel, TypeAdapter, ValidationError
from transformers import AutoConfig

from lorafleet import quantize
from lorafleet.contract import sample_seed
from lorafleet.errors import (
    FailedPrecondition,
    InvalidArgument,
    LorafleetError,
    NotFound,
    Unavailable,
)
from lorafleet_rollout import metrics, sglang_api, sglang_server
from lorafleet_rollout.engine import AdapterSource
from lorafleet_rollout.http_engine import engine_info, wait_healthy
from lorafleet_rollout.sglang_lora import ModelShape, ServerLora, publish
from lorafleet_rollout.sglang_server import SGLangServer
from lorafleet_rollout.types import (
    EngineInfo,
    LoraSpec,
    SampledSequence,
    SampleRequest,
    SampleResult,
)

log = logging.getLogger(__name__)

_M = TypeVar("_M", bound=BaseModel)
_RESULTS = TypeAdapter(list[sglang_api.GenerateResult])
#: Logprob probe (see `_check_logprobs`): a temperature far from 1 and the largest gap between
#: the two readings of one logprob that still counts as equal (bf16 kernels differ by ~1e-2
#: between batch shapes; a scaled logprob differs by far more unless the top token is certain).
_PROBE_TEMPERATURE = 0.25
_PROBE_TOLERANCE = 0.05


@dataclass(frozen=True)
class _Published:
    """One adapter version as the server knows it: its server name and its folder."""

    name: str
    folder: Path


class _Forgotten(Exception):
    """/generate named an adapter the server has no record of (it restarted)."""


class SGLangEngine:
    def __init__(
        self,
        url: str,
        model_path: Path | str,
        *,
        max_lora_rank: int = 64,
        max_loaded_adapters: int = 16,
        launch: bool = False,
        quantization: str = quantize.NONE,
        stream: bool = False,
        ready_timeout: float = 600.0,
        reconcile_interval: float = 5.0,
    ) -> None:
        self.url = url.rstrip("/")
        self.model_path = str(model_path)
        self.max_lora_rank = max_lora_rank
        self.max_loaded_adapters = max_loaded_adapters
        self.launch = launch
        self.quantization = quantization
        self.stream = stream
        self.ready_timeout = ready_timeout
        self.reconcile_interval = reconcile_interval
        self._client = httpx.AsyncClient(base_url=self.url, timeout=httpx.Timeout(600.0))
        self._proc: subprocess.Popen[bytes] | None = None
        self._info: EngineInfo | None = None
        self._server: ServerLora | None = None
        self._shape: ModelShape | None = None
        self._live: dict[str, _Published] = {}
        #: Serialises loads, unloads and reconciliation (never sampling).
        self._adapters = asyncio.Lock()
        self._watch: asyncio.Task[None] | None = None
        self._seeds_honoured = False
        #: Adapters re-loaded by reconciliation since start (a restart shows here).
        self.reloads = 0

    def launcher(self) -> SGLangServer:
        """The server `launch=True` starts, with the flags and environment every lorafleet
        SGLang gets (`sglang_server.py`: LoRA targets incl. lm_head, original logprobs)."""
        url = httpx.URL(self.url)
        python = sglang_server.DEFAULT_PYTHON
        return SGLangServer(
            Path(self.model_path),
            url.port or 30000,
            host=url.host,
            python=python if python.exists() else Path(sys.executable),
            device=sglang_server.default_device(),
            max_lora_rank=self.max_lora_rank,
            max_loras_per_batch=min(8, self.max_loaded_adapters),
            max_loaded_loras=self.max_loaded_adapters,
            quantization=self.quantization,
        )

    async def start(self) -> None:
        if self.launch:
            launch = self.launcher()
            self._proc = await asyncio.to_thread(
                subprocess.Popen, launch.command(), env=launch.env(), start_new_session=True
            )
        await wait_healthy(
            self._client,
            sglang_api.HEALTH,
            name="SGLang",
            url=self.url,
            ready_timeout=self.ready_timeout,
            proc=self._proc,
        )
        server = await self._get(sglang_api.SERVER_INFO, sglang_api.ServerInfo)
        if server.enable_lora is False:
            raise FailedPrecondition(
                f"SGLang at {self.url} was started without --enable-lora", field="engine_url"
            )
        if server.version and server.version != sglang_api.SGLANG_VERSION:
            log.warning(
                "SGLang at %s is %s; this driver was read from %s",
                self.url,
                server.version,
                sglang_api.SGLANG_VERSION,
            )
        rank = min(self.max_lora_rank, server.max_lora_rank or self.max_lora_rank)
        self._server = ServerLora.from_flags(server.lora_target_modules, rank)
        self._seeds_honoured = server.enable_deterministic_inference
        if not self._seeds_honoured:
            log.info(
                "SGLang at %s ignores sampling seeds (no --enable-deterministic-inference)",
                self.url,
            )
        config = await asyncio.to_thread(AutoConfig.from_pretrained, self.model_path)
        self._shape = ModelShape.from_config(config)
        info = await engine_info("sglang", self.model_path, rank)
        self._info = dataclasses.replace(info, max_loaded_adapters=server.max_loaded_loras or 0)
        await self._check_logprobs()
        if self.reconcile_interval > 0:
            self._watch = asyncio.get_running_loop().create_task(self._reconcile_forever())

    async def close(self) -> None:
        if self._watch is not None:
            self._watch.cancel()
            await asyncio.gather(self._watch, return_exceptions=True)
        await self._client.aclose()
        for published in self._live.values():
            shutil.rmtree(published.folder, ignore_errors=True)
        self._live.clear()
        if self._proc is not None:
            await asyncio.to_thread(sglang_server.stop, self._proc)

    def info(self) -> EngineInfo:
        if self._info is None:
            raise Unavailable("the SGLang server is not ready yet")
        return self._info

    # ------------------------------------------------------------------ adapters
    async def load_adapter(self, adapter_id: str, source: AdapterSource, lora: LoraSpec) -> None:
        if not isinstance(source, Path):
            raise InvalidArgument("the SGLang engine loads adapters from folders", field="adapter")
        if self._server is None or self._shape is None:
            raise Unavailable("the SGLang server is not ready yet")
        async with self._adapters:
            if adapter_id in self._live:
                raise InvalidArgument(f"adapter {adapter_id} is already loaded", field="adapter")
            name = f"{adapter_id}#{uuid.uuid4().hex[:12]}"
            # Beside the source, so on the volume the server reads; ours to delete on unload.
            folder = source.with_name(f"{source.name}.sglang-{name.rsplit('#', 1)[1]}")
            await asyncio.to_thread(publish, source, folder, self._server, self._shape)
            try:
                await self._load(name, folder)
            except BaseException:
                shutil.rmtree(folder, ignore_errors=True)
                raise
            self._live[adapter_id] = _Published(name, folder)

    async def unload_adapter(self, adapter_id: str) -> None:
        async with self._adapters:
            published = self._live.pop(adapter_id, None)
            if published is None:
                raise InvalidArgument(f"adapter {adapter_id} is not loaded", field="adapter")
            try:
                result = await self._lora_call(
                    sglang_api.UNLOAD_LORA, sglang_api.UnloadLoraAdapter(lora_name=published.name)
                )
                if not result.success:
                    # Not on the server (a restart forgot it) is what unloading wanted.
                    log.warning("SGLang unload of %s: %s", published.name, result.error_message)
            finally:
                # Without its folder, SGLang's silent re-load of the name has nothing to read.
                shutil.rmtree(published.folder, ignore_errors=True)

    async def _load(self, name: str, folder: Path) -> None:
        body = sglang_api.LoadLoraAdapter(lora_name=name, lora_path=str(folder))
        result = await self._lora_call(sglang_api.LOAD_LORA, body)
        if not result.success:
            raise InvalidArgument(
                f"SGLang refused {sglang_api.LOAD_LORA}: {result.error_message}", field="adapter"
            )

    async def _lora_call(
        self, route: str, body: sglang_api._Request
    ) -> sglang_api.LoraUpdateResult:
        response = await self._post(route, body)
        try:
            return sglang_api.LoraUpdateResult.model_validate_json(response.content)
        except ValidationError:
            raise Unavailable(
                f"SGLang {route} answered {response.status_code}: {response.text[:500]}"
            ) from None

    async def reconcile(self) -> int:
        """Make the server's adapters the versions this driver serves; returns how many were
        re-loaded (after a restart: all of them)."""
        async with self._adapters:
            models = await self._get(sglang_api.MODELS, sglang_api.ModelList)
            listed = {card.id for card in models.data if card.parent is not None}
            ours = {p.name for p in self._live.values()}
            reloaded = 0
            for published in self._live.values():
                if published.name not in listed:
                    await self._load(published.name, published.folder)
                    reloaded += 1
            for name in sorted(listed - ours):
                if "#" in name:  # one of ours whose unload did not reach the server
                    await self._lora_call(
                        sglang_api.UNLOAD_LORA, sglang_api.UnloadLoraAdapter(lora_name=name)
                    )
            if reloaded:
                self.reloads += reloaded
                log.warning("SGLang at %s had lost %d adapter(s): re-loaded", self.url, reloaded)
            return reloaded

    async def _reconcile_forever(self) -> None:
        while True:
            await asyncio.sleep(self.reconcile_interval)
            try:
                await self.reconcile()
            except (LorafleetError, httpx.HTTPError) as exc:
                log.warning("reconciling with SGLang at %s failed: %s", self.url, exc)

    # ------------------------------------------------------------------ sampling
    def generate_body(
        self, request: SampleRequest, lora_name: str | None
    ) -> sglang_api.GenerateRequest:
        """A seeded request, on a server that honours seeds, goes as n single-sample copies each
        with its own seed (module docstring); otherwise as one prompt with n, so SGLang's
        parallel sampling prefills the prompt once for all n."""
        p = request.params
        want_prompt = request.prompt_logprobs or request.topk_prompt_logprobs > 0
        context = self.info().max_context_length
        n = request.num_samples
        copies = n if p.seed is not None and self._seeds_honoured else 1
        params = [
            sglang_api.SamplingParams(
                max_new_tokens=p.max_tokens or context - len(request.prompt_tokens),
                temperature=p.temperature,
                top_p=p.top_p,
                top_k=p.top_k if p.top_k > 0 else -1,
                stop=list(p.stop_strings) or None,
                stop_token_ids=list(p.stop_token_ids) or None,
                ignore_eos=p.disable_eos_stop,
                n=n // copies,
                sampling_seed=None if p.seed is None else sample_seed(p.seed, i),
            )
            for i in range(copies)
        ]
        return sglang_api.GenerateRequest(
            input_ids=[list(request.prompt_tokens)] * copies,
            sampling_params=params,
            lora_path=[lora_name] * copies,
            return_logprob=True,
            logprob_start_len=0 if want_prompt else -1,
            top_logprobs_num=request.topk_prompt_logprobs,
            stream=self.stream,
            rid=[uuid.uuid4().hex for _ in range(copies)],
        )

    async def sample(self, request: SampleRequest) -> SampleResult:
        for attempt in (0, 1):
            name = self._name(request.adapter_id)
            try:
                results = await self._generate(self.generate_body(request, name))
            except _Forgotten:
                if attempt:
                    break
                await self.reconcile()
                continue
            return _to_result(results, request)
        raise Unavailable(f"SGLang at {self.url} keeps forgetting adapter {request.adapter_id}")

    def _name(self, adapter_id: str | None) -> str | None:
        if adapter_id is None:
            return None
        published = self._live.get(adapter_id)
        if published is None:
            raise NotFound(f"adapter {adapter_id} is not loaded", field="adapter")
        return published.name

    async def _generate(self, body: sglang_api.GenerateRequest) -> list[sglang_api.GenerateResult]:
        started = time.monotonic()
        if body.stream:
            frames = await self._stream(body, started)
        else:
            response = await self._post(sglang_api.GENERATE, body)
            self._raise_for(response)
            frames = response.content
            metrics.TTFT.observe(time.monotonic() - started)
        try:
            return _RESULTS.validate_json(frames)
        except ValidationError as exc:
            raise Unavailable(
                f"SGLang answered outside schema {sglang_api.SGLANG_VERSION}: {exc}"
            ) from None

    async def _stream(self, body: sglang_api.GenerateRequest, started: float) -> bytes:
        """Read `data: {...}` frames up to `data: [DONE]`; keep every sample's last frame."""
        last: dict[int, str] = {}
        try:
            async with self._client.stream(
                "POST", sglang_api.GENERATE, json=body.model_dump(mode="json")
            ) as response:
                if response.status_code != 200:
                    await response.aread()
                    self._raise_for(response)
                async for line in response.aiter_lines():
                    if not line.startswith("data:"):
                        continue
                    data = line.removeprefix("data:").strip()
                    if data == "[DONE]":
                        return ("[" + ",".join(last[i] for i in sorted(last)) + "]").encode()
                    frame = json.loads(data)
                    if "error" in frame:
                        self._raise_error(400, str(frame["error"].get("message", frame)))
                    if not last:
                        metrics.TTFT.observe(time.monotonic() - started)
                    last[int(frame.get("index") or 0)] = data
        except httpx.TransportError as exc:
            raise Unavailable(f"SGLang at {self.url}: {exc}") from None
        raise Unavailable("the SGLang stream ended without data: [DONE]")

    def _raise_for(self, response: httpx.Response) -> None:
        if response.status_code == 200:
            return
        try:
            detail = json.loads(response.content)
            message = detail.get("detail") or detail["error"]["message"]
        except (ValueError, KeyError, TypeError, AttributeError):
            message = response.text
        self._raise_error(response.status_code, str(message))

    def _raise_error(self, status: int, message: str) -> None:
        if status == 400 and message.startswith(sglang_api.NEVER_LOADED):
            raise _Forgotten(message)
        error: type[LorafleetError] = InvalidArgument
        if status >= 500:
            error = Unavailable
        raise error(f"SGLang /generate answered {status}: {message}", field="adapter")

    async def _check_logprobs(self) -> None:
        """Refuse a server reporting temperature-scaled logprobs (module docstring).

        The top token's logprob after a short prompt, read at temperature 1 (where scaled and
        unscaled agree) and at a low temperature: equal iff the server reports the model's own.
        A top token the model is all but certain of reads alike either way, so the check can
        miss a misconfigured server on such a model; it never refuses a correct one.
        """
        prompt = [t % self.info().vocab_size for t in range(1, 9)]
        readings = []
        for temperature in (1.0, _PROBE_TEMPERATURE):
            body = sglang_api.GenerateRequest(
                input_ids=[prompt],
                sampling_params=[
                    sglang_api.SamplingParams(
                        max_new_tokens=1, temperature=temperature, ignore_eos=True
                    )
                ],
                lora_path=[None],
                top_logprobs_num=1,
            )
            (result,) = await self._generate(body)
            top = result.meta_info.output_top_logprobs
            if not top or not top[0] or top[0][0][0] is None:
                raise Unavailable(f"SGLang at {self.url} returned no output_top_logprobs")
            readings.append(float(top[0][0][0]))
        if abs(readings[0] - readings[1]) > _PROBE_TOLERANCE:
            raise FailedPrecondition(
                f"SGLang at {self.url} reports temperature-scaled logprobs (top token "
                f"{readings[0]:.4f} at temperature 1, {readings[1]:.4f} at "
                f"{_PROBE_TEMPERATURE}): start it with SGLANG_RETURN_ORIGINAL_LOGPROB=1",
                field="engine_url",
            )

    # ------------------------------------------------------------------ transport
    async def _post(self, route: str, body: sglang_api._Request) -> httpx.Response:
        try:
            return await self._client.post(route, json=body.model_dump(mode="json"))
        except httpx.TransportError as exc:
            raise Unavailable(f"SGLang at {self.url}: {exc}") from None

    async def _get(self, route: str, model: type[_M]) -> _M:
        try:
            response = await self._client.get(route, timeout=30.0)
        except httpx.TransportError as exc:
            raise Unavailable(f"SGLang at {self.url}: {exc}") from None
        if response.status_code != 200:
            raise Unavailable(f"SGLang {route} answered {response.status_code}")
        try:
            return model.model_validate_json(response.content)
        except ValidationError as exc:
            raise Unavailable(f"SGLang {route} answered outside schema: {exc}") from None


def _to_result(results: list[sglang_api.GenerateResult], request: SampleRequest) -> SampleResult:
    sequences = []
    for r in results:
        reason = r.meta_info.finish_reason
        if reason is None or reason.type == "abort":
            raise Unavailable(f"SGLang aborted the request: {reason and reason.message}")
        logprobs = tuple(
            float(lp if lp is not None else math.nan)
            for lp, _, _ in r.meta_info.output_token_logprobs
        )
        sequences.append(
            SampledSequence(
                tuple(r.output_ids), logprobs, "length" if reason.type == "length" else "stop"
            )
        )
    first = results[0].meta_info
    prompt: tuple[float, ...] = ()
    if request.prompt_logprobs and first.input_token_logprobs is not None:
        prompt = tuple(
            math.nan if lp is None else float(lp) for lp, _, _ in first.input_token_logprobs
        )
    topk: tuple[tuple[tuple[int, float], ...], ...] = ()
    if request.topk_prompt_logprobs and first.input_top_logprobs is not None:
        topk = tuple(
            () if row is None else tuple((tok, float(lp)) for lp, tok, _ in row if lp is not None)
            for row in first.input_top_logprobs
        )
        topk = ((), *topk[1:]) if topk else ()
    return SampleResult(tuple(sequences), prompt, topk)
