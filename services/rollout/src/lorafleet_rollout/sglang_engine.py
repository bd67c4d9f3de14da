"""SGLangEngine: drives a real SGLang server (GPU clusters) over its HTTP API.

Adapters are loaded by folder (`/load_lora_adapter`, the folder must be readable by the
server) under their registration-scoped id and never upserted in place, so SGLang's radix
cache, keyed by adapter, can never serve prefixes of older weights. Every /generate names
its adapter in `lora_path` (None for the base) because a request without it silently runs on
the base model. Schema: `sglang_api.py`.

Logprobs: SGLang must report raw (unprocessed) logprobs to match the trainer; start the
server with SGLANG_RETURN_ORIGINAL_LOGPROB=1 when sampling with temperature != 1 (checked by
the `sglang`-marked test on a real server). With `stream=True` the driver reads SSE frames
and takes the last snapshot (SGLang's default non-incremental streaming output); TTFT is
observed at the first frame.
"""

from __future__ import annotations

import asyncio
import json
import math
import subprocess
import sys
import time
import uuid
from pathlib import Path

import httpx
from pydantic import TypeAdapter, ValidationError

from lorafleet.errors import InvalidArgument, LorafleetError, NotFound, Unavailable
from lorafleet_rollout import metrics, sglang_api
from lorafleet_rollout.engine import AdapterSource
from lorafleet_rollout.http_engine import engine_info, wait_healthy
from lorafleet_rollout.types import (
    EngineInfo,
    LoraSpec,
    SampledSequence,
    SampleRequest,
    SampleResult,
)

_RESULTS = TypeAdapter(sglang_api.GenerateResult | list[sglang_api.GenerateResult])


class SGLangEngine:
    def __init__(
        self,
        url: str,
        model_path: Path | str,
        *,
        max_lora_rank: int = 64,
        max_loaded_adapters: int = 16,
        launch: bool = False,
        stream: bool = False,
        ready_timeout: float = 600.0,
    ) -> None:
        self.url = url.rstrip("/")
        self.model_path = str(model_path)
        self.max_lora_rank = max_lora_rank
        self.max_loaded_adapters = max_loaded_adapters
        self.launch = launch
        self.stream = stream
        self.ready_timeout = ready_timeout
        self._client = httpx.AsyncClient(base_url=self.url, timeout=httpx.Timeout(600.0))
        self._proc: subprocess.Popen[bytes] | None = None
        self._info: EngineInfo | None = None

    def launch_command(self) -> list[str]:
        """The SGLang server command line with LoRA serving switched on (design-lessons §10.1)."""
        host, port = httpx.URL(self.url).host, httpx.URL(self.url).port or 30000
        return [
            sys.executable, "-m", "sglang.launch_server",
            "--model-path", self.model_path, "--host", host, "--port", str(port),
            "--enable-lora", "--max-lora-rank", str(self.max_lora_rank),
            "--lora-target-modules", "all",
            "--max-loras-per-batch", str(min(8, self.max_loaded_adapters)),
            "--max-loaded-loras", str(self.max_loaded_adapters),
        ]  # fmt: skip

    async def start(self) -> None:
        if self.launch:
            self._proc = await asyncio.to_thread(subprocess.Popen, self.launch_command())
        await wait_healthy(
            self._client,
            sglang_api.HEALTH,
            name="SGLang",
            url=self.url,
            ready_timeout=self.ready_timeout,
            proc=self._proc,
        )
        self._info = await engine_info("sglang", self.model_path, self.max_lora_rank)

    async def close(self) -> None:
        await self._client.aclose()
        if self._proc is not None and self._proc.poll() is None:
            self._proc.terminate()
            await asyncio.to_thread(self._proc.wait, 30)

    def info(self) -> EngineInfo:
        if self._info is None:
            raise Unavailable("the SGLang server is not ready yet")
        return self._info

    async def load_adapter(self, adapter_id: str, source: AdapterSource, lora: LoraSpec) -> None:
        if not isinstance(source, Path):
            raise InvalidArgument("the SGLang engine loads adapters from folders", field="adapter")
        body = sglang_api.LoadLoraAdapter(lora_name=adapter_id, lora_path=str(source))
        await self._lora_call(sglang_api.LOAD_LORA, body)

    async def unload_adapter(self, adapter_id: str) -> None:
        await self._lora_call(
            sglang_api.UNLOAD_LORA, sglang_api.UnloadLoraAdapter(lora_name=adapter_id)
        )

    async def _lora_call(self, route: str, body: sglang_api._Request) -> None:
        response = await self._post(route, body)
        result = sglang_api.LoraUpdateResult.model_validate_json(response.content)
        if response.status_code != 200 or not result.success:
            raise InvalidArgument(
                f"SGLang refused {route}: {result.error_message}", field="adapter"
            )

    async def _post(self, route: str, body: sglang_api._Request) -> httpx.Response:
        try:
            return await self._client.post(route, json=body.model_dump(mode="json"))
        except httpx.TransportError as exc:
            raise Unavailable(f"SGLang at {self.url}: {exc}") from None

    def generate_body(self, request: SampleRequest) -> sglang_api.GenerateRequest:
        p = request.params
        want_prompt = request.prompt_logprobs or request.topk_prompt_logprobs > 0
        context = self.info().max_context_length
        return sglang_api.GenerateRequest(
            input_ids=list(request.prompt_tokens),
            sampling_params=sglang_api.SamplingParams(
                max_new_tokens=p.max_tokens or context - len(request.prompt_tokens),
                temperature=p.temperature,
                top_p=p.top_p,
                top_k=p.top_k if p.top_k > 0 else -1,
                stop=list(p.stop_strings) or None,
                stop_token_ids=list(p.stop_token_ids) or None,
                ignore_eos=p.disable_eos_stop,
                n=request.num_samples,
                sampling_seed=p.seed,
            ),
            lora_path=request.adapter_id,
            return_logprob=True,
            logprob_start_len=0 if want_prompt else -1,
            top_logprobs_num=request.topk_prompt_logprobs,
            stream=self.stream,
            rid=uuid.uuid4().hex,
        )

    async def sample(self, request: SampleRequest) -> SampleResult:
        body = self.generate_body(request)
        started = time.monotonic()
        if self.stream:
            payload = await self._stream(body, started)
        else:
            response = await self._post(sglang_api.GENERATE, body)
            self._raise_for(response, body)
            payload = response.content
            metrics.TTFT.observe(time.monotonic() - started)
        try:
            parsed = _RESULTS.validate_json(payload)
        except ValidationError as exc:
            raise Unavailable(
                f"SGLang answered outside schema {sglang_api.SGLANG_VERSION}: {exc}"
            ) from None
        results = parsed if isinstance(parsed, list) else [parsed]
        return _to_result(results, request)

    async def _stream(self, body: sglang_api.GenerateRequest, started: float) -> bytes:
        """Read `data: {...}` frames up to `data: [DONE]`; the last frame is the full snapshot."""
        last = b""
        try:
            async with self._client.stream(
                "POST", sglang_api.GENERATE, json=body.model_dump(mode="json")
            ) as response:
                if response.status_code != 200:
                    await response.aread()
                    self._raise_for(response, body)
                async for line in response.aiter_lines():
                    if not line.startswith("data:"):
                        continue
                    data = line.removeprefix("data:").strip()
                    if data == "[DONE]":
                        return last
                    if not last:
                        metrics.TTFT.observe(time.monotonic() - started)
                    last = data.encode()
        except httpx.TransportError as exc:
            raise Unavailable(f"SGLang at {self.url}: {exc}") from None
        raise Unavailable("the SGLang stream ended without data: [DONE]")

    def _raise_for(self, response: httpx.Response, body: sglang_api.GenerateRequest) -> None:
        if response.status_code == 200:
            return
        try:
            detail = json.loads(response.content)
            message = detail.get("error_message") or detail["error"]["message"]
        except (ValueError, KeyError, TypeError, AttributeError):
            message = response.text
        error: type[LorafleetError] = InvalidArgument
        if response.status_code == 400 and body.lora_path and "lora" in str(message).lower():
            error = NotFound
        elif response.status_code >= 500:
            error = Unavailable
        raise error(f"SGLang /generate answered {response.status_code}: {message}", field="adapter")


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
