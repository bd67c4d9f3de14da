"""A schema-faithful fake SGLang server: FastAPI + uvicorn in a thread, TorchEngine inside.

It enforces the request schema of `lorafleet_rollout.sglang_api` (SGLang 0.5.23; unknown or
misspelt fields are rejected, and `lora_path` must be present even though real SGLang defaults
it to the base model, so the driver's "always name the adapter" rule is checked), answers an
unknown adapter with 400 and a `{success, error_message, loaded_adapters}` body, returns
`meta_info` with `finish_reason` and `output_token_logprobs`, and streams SSE frames ending in
`data: [DONE]`. Real SGLang cannot run on these CPUs (platform.md §4.2).
"""

from __future__ import annotations

import asyncio
import json
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError

from lorafleet.errors import LorafleetError
from lorafleet.testing import free_port, wait_for_port
from lorafleet_rollout import sglang_api as api
from lorafleet_rollout.torch_engine import TorchEngine
from lorafleet_rollout.types import LoraSpec, SampleRequest, SampleResult, SamplingSpec


def build_app(model_dir: Path) -> FastAPI:
    engine = TorchEngine(model_dir)
    loaded: dict[str, str] = {}
    app = FastAPI(on_startup=[engine.start], on_shutdown=[engine.close])

    def lora_error(message: str) -> JSONResponse:
        body = api.LoraUpdateResult(success=False, error_message=message, loaded_adapters=loaded)
        return JSONResponse(body.model_dump(), status_code=400)

    async def parse(request: Request, model: type[api._Request]) -> Any:
        try:
            return model.model_validate_json(await request.body())
        except ValidationError as exc:
            return JSONResponse({"error": {"message": str(exc)}}, status_code=400)

    @app.get(api.HEALTH)
    async def health() -> Response:
        return Response(status_code=200)

    @app.post(api.LOAD_LORA)
    async def load(request: Request) -> Response:
        body = await parse(request, api.LoadLoraAdapter)
        if isinstance(body, Response):
            return body
        if body.lora_name in loaded:
            return lora_error(f"LoRA adapter {body.lora_name} is already loaded")
        config = json.loads((Path(body.lora_path) / "adapter_config.json").read_text())
        lora = LoraSpec(config["r"], config["lora_alpha"])
        await engine.load_adapter(body.lora_name, Path(body.lora_path), lora)
        loaded[body.lora_name] = body.lora_path
        return JSONResponse(api.LoraUpdateResult(success=True, loaded_adapters=loaded).model_dump())

    @app.post(api.UNLOAD_LORA)
    async def unload(request: Request) -> Response:
        body = await parse(request, api.UnloadLoraAdapter)
        if isinstance(body, Response):
            return body
        if body.lora_name not in loaded:
            return lora_error(f"LoRA adapter {body.lora_name} is not loaded")
        await engine.unload_adapter(body.lora_name)
        del loaded[body.lora_name]
        return JSONResponse(api.LoraUpdateResult(success=True, loaded_adapters=loaded).model_dump())

    @app.post(api.GENERATE)
    async def generate(request: Request) -> Response:
        raw = json.loads(await request.body())
        if "lora_path" not in raw:
            return JSONResponse(
                {"error": {"message": "lora_path missing: this would silently run the base"}},
                status_code=400,
            )
        body = await parse(request, api.GenerateRequest)
        if isinstance(body, Response):
            return body
        batch = bool(body.input_ids) and isinstance(body.input_ids[0], list)
        prompts = body.input_ids if batch else [body.input_ids]
        loras = (
            body.lora_path if isinstance(body.lora_path, list) else [body.lora_path] * len(prompts)
        )
        params = body.sampling_params
        params = params if isinstance(params, list) else [params] * len(prompts)
        if len(loras) != len(prompts) or len(params) != len(prompts):
            return JSONResponse({"error": {"message": "one lora_path per prompt"}}, status_code=400)
        unknown = sorted({name for name in loras if name is not None and name not in loaded})
        if unknown:
            return lora_error(f"The following requested LoRA adapters are not loaded: {unknown}")
        if body.stream and len(prompts) * params[0].n != 1:
            return JSONResponse(
                {"error": {"message": "fake: stream one sequence"}}, status_code=400
            )
        want_prompt = body.return_logprob and body.logprob_start_len >= 0
        try:
            results = await asyncio.gather(
                *(
                    engine.sample(
                        SampleRequest(
                            lora,
                            tuple(prompt),
                            _spec(p),
                            num_samples=p.n,
                            prompt_logprobs=want_prompt,
                            topk_prompt_logprobs=body.top_logprobs_num if want_prompt else 0,
                        )
                    )
                    for prompt, lora, p in zip(prompts, loras, params, strict=True)
                )
            )
        except LorafleetError as exc:
            return JSONResponse({"error": {"message": str(exc)}}, status_code=400)
        out = [
            item
            for prompt, result in zip(prompts, results, strict=True)
            for item in _render(prompt, result, body)
        ]
        if body.stream:
            return StreamingResponse(_sse(out[0]), media_type="text/event-stream")
        return JSONResponse(out if batch or len(out) > 1 else out[0])

    return app


def _spec(p: api.SamplingParams) -> SamplingSpec:
    return SamplingSpec(
        max_tokens=p.max_new_tokens,
        temperature=p.temperature,
        top_p=p.top_p,
        top_k=p.top_k,
        stop_strings=tuple(p.stop or ()),
        stop_token_ids=tuple(p.stop_token_ids or ()),
        disable_eos_stop=p.ignore_eos,
        seed=p.sampling_seed,
    )


def _render(prompt: list[int], result: SampleResult, body: api.GenerateRequest) -> list[dict]:
    items = []
    for seq in result.sequences:
        if seq.stop_reason == "length":
            finish = {"type": "length", "length": len(seq.tokens)}
        else:
            finish = {"type": "stop", "matched": seq.tokens[-1]}
        meta: dict[str, Any] = {
            "id": uuid.uuid4().hex,
            "finish_reason": finish,
            "prompt_tokens": len(prompt),
            "completion_tokens": len(seq.tokens),
            "cached_tokens": 0,
            "output_token_logprobs": [
                [lp, tok, None] for lp, tok in zip(seq.logprobs, seq.tokens, strict=True)
            ],
        }
        if result.prompt_logprobs:
            meta["input_token_logprobs"] = [
                [None if t == 0 else lp, tok, None]
                for t, (lp, tok) in enumerate(zip(result.prompt_logprobs, prompt, strict=True))
            ]
        if result.topk_prompt_logprobs:
            meta["input_top_logprobs"] = [
                [[lp, tok, None] for tok, lp in row] if row else None
                for row in result.topk_prompt_logprobs
            ]
        items.append({"text": "", "output_ids": list(seq.tokens), "meta_info": meta})
    return items


def _sse(item: dict) -> Iterator[str]:
    """Cumulative snapshots, one per token, as SGLang streams them by default."""
    ids = item["output_ids"]
    meta = item["meta_info"]
    for k in range(1, len(ids) + 1):
        snapshot = dict(meta)
        snapshot["output_token_logprobs"] = meta["output_token_logprobs"][:k]
        snapshot["completion_tokens"] = k
        if k < len(ids):
            snapshot["finish_reason"] = None
        yield f"data: {json.dumps({'text': '', 'output_ids': ids[:k], 'meta_info': snapshot})}\n\n"
    yield "data: [DONE]\n\n"


class FakeSGLang:
    """Run the fake on a free loopback port in a background thread."""

    def __init__(self, model_dir: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(
            build_app(model_dir), host="127.0.0.1", port=self.port, log_level="warning"
        )
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> FakeSGLang:
        self.thread.start()
        wait_for_port(self.port, timeout=60)
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(30)
