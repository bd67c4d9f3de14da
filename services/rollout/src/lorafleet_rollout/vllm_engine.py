"""VLLMEngine: drives a vLLM OpenAI-compatible server with runtime LoRA updating.

The server must run with VLLM_ALLOW_RUNTIME_LORA_UPDATING=True and --enable-lora (command in
platform.md §4.4). Adapters load by folder under their registration-scoped id
(`/v1/load_lora_adapter`) and a completion selects one with `model` = that id, or the served
base model name; prompts travel as token ids and tokens come back as "token_id:N" strings.
vLLM's default logprobs mode reports raw logprobs, as the trainer computes them.
"""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any

import httpx

from lorafleet.contract import sample_seed
from lorafleet.errors import InvalidArgument, NotFound, Unavailable
from lorafleet_rollout import metrics
from lorafleet_rollout.engine import AdapterSource
from lorafleet_rollout.http_engine import engine_info, wait_healthy
from lorafleet_rollout.types import (
    EngineInfo,
    LoraSpec,
    SampledSequence,
    SampleRequest,
    SampleResult,
)


class VLLMEngine:
    def __init__(
        self,
        url: str,
        model_path: Path | str,
        *,
        served_model_name: str = "base",
        max_lora_rank: int = 64,
        ready_timeout: float = 600.0,
    ) -> None:
        self.url = url.rstrip("/")
        self.model_path = str(model_path)
        self.served_model_name = served_model_name
        self.max_lora_rank = max_lora_rank
        self.ready_timeout = ready_timeout
        self._client = httpx.AsyncClient(base_url=self.url, timeout=httpx.Timeout(600.0))
        self._info: EngineInfo | None = None

    async def start(self) -> None:
        await wait_healthy(
            self._client, "/health", name="vLLM", url=self.url, ready_timeout=self.ready_timeout
        )
        self._info = await engine_info("vllm", self.model_path, self.max_lora_rank)

    async def close(self) -> None:
        await self._client.aclose()

    def info(self) -> EngineInfo:
        if self._info is None:
            raise Unavailable("the vLLM server is not ready yet")
        return self._info

    async def load_adapter(self, adapter_id: str, source: AdapterSource, lora: LoraSpec) -> None:
        if not isinstance(source, Path):
            raise InvalidArgument("the vLLM engine loads adapters from folders", field="adapter")
        await self._post(
            "/v1/load_lora_adapter", {"lora_name": adapter_id, "lora_path": str(source)}
        )

    async def unload_adapter(self, adapter_id: str) -> None:
        await self._post("/v1/unload_lora_adapter", {"lora_name": adapter_id})

    async def _post(self, route: str, body: dict[str, Any]) -> httpx.Response:
        try:
            response = await self._client.post(route, json=body)
        except httpx.TransportError as exc:
            raise Unavailable(f"vLLM at {self.url}: {exc}") from None
        if response.status_code == 404 and route == "/v1/completions":
            raise NotFound(f"vLLM does not serve {body['model']}: {response.text}", field="adapter")
        if response.status_code >= 500:
            raise Unavailable(f"vLLM {route} answered {response.status_code}: {response.text}")
        if response.status_code != 200:
            raise InvalidArgument(
                f"vLLM {route} answered {response.status_code}: {response.text}", field="adapter"
            )
        return response

    def completion_body(self, request: SampleRequest) -> dict[str, Any]:
        p = request.params
        want_prompt = request.prompt_logprobs or request.topk_prompt_logprobs > 0
        body: dict[str, Any] = {
            "model": request.adapter_id or self.served_model_name,
            "prompt": list(request.prompt_tokens),
            "max_tokens": p.max_tokens
            or self.info().max_context_length - len(request.prompt_tokens),
            "temperature": p.temperature,
            "top_p": p.top_p,
            "top_k": p.top_k if p.top_k > 0 else -1,
            # vLLM refuses n > 1 when greedy; the samples are all the same sequence anyway.
            "n": 1 if p.temperature == 0 else request.num_samples,
            "stop": list(p.stop_strings),
            "stop_token_ids": list(p.stop_token_ids),
            "ignore_eos": p.disable_eos_stop,
            "include_stop_str_in_output": True,
            "skip_special_tokens": False,
            "logprobs": 0,
            "return_tokens_as_token_ids": True,
        }
        if p.seed is not None:
            body["seed"] = sample_seed(p.seed, 0)  # vLLM derives its n samples' seeds
        if want_prompt:
            body["prompt_logprobs"] = max(request.topk_prompt_logprobs, 1)
        return body

    async def sample(self, request: SampleRequest) -> SampleResult:
        started = time.monotonic()
        response = await self._post("/v1/completions", self.completion_body(request))
        metrics.TTFT.observe(time.monotonic() - started)
        choices = sorted(response.json()["choices"], key=lambda c: c["index"])
        if request.params.temperature == 0:
            choices = choices[:1] * request.num_samples
        sequences = tuple(
            SampledSequence(
                tuple(int(t.removeprefix("token_id:")) for t in c["logprobs"]["tokens"]),
                tuple(float(lp) for lp in c["logprobs"]["token_logprobs"]),
                "length" if c["finish_reason"] == "length" else "stop",
            )
            for c in choices
        )
        prompt: tuple[float, ...] = ()
        topk: tuple[tuple[tuple[int, float], ...], ...] = ()
        rows = choices[0].get("prompt_logprobs") if choices else None
        if rows:
            if request.prompt_logprobs:
                prompt = tuple(
                    math.nan if row is None else float(row[str(tok)]["logprob"])
                    for row, tok in zip(rows, request.prompt_tokens, strict=True)
                )
            k = request.topk_prompt_logprobs
            if k:
                topk = tuple(
                    ()
                    if row is None
                    else tuple(
                        (int(tok), float(e["logprob"]))
                        for tok, e in sorted(row.items(), key=lambda kv: kv[1]["rank"])
                        if e["rank"] <= k
                    )
                    for row in rows
                )
        return SampleResult(sequences, prompt, topk)
