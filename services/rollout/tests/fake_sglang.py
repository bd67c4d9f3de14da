"""A strict fake SGLang 0.5.23 server: FastAPI + uvicorn in a thread, TorchEngine generating.

Strict means it refuses what the real server refuses, in the real server's words and shapes
(schema: `lorafleet_rollout.sglang_api`, read from sglang 0.5.23), and it refuses at load what
the real server would accept and then die on:

* `/load_lora_adapter` runs SGLang's own checks, ported below from the files named: the
  config (`LoRAConfig`: r, lora_alpha, target_modules, use_dora), `validate_new_adapter`
  (already loaded, DoRA, `can_support`: rank above `--max-lora-rank` or targets outside
  `--lora-target-modules`), then the weight mapping of `LoRAAdapter._process_weight` /
  `_normalize_weights` and `LoRAMemoryPool.load_lora_weight_to_buffer` as with
  `--lora-strict-loading`: a weight that maps to no module is refused here, where the real
  server only warns and then crashes on the first batch. Per-expert (MoE) weights must name an
  expert the model has and match SGLang's per-expert buffer shapes. Failures answer 400 with
  `{success, error_message, loaded_adapters}`.
* An adapter name is remembered forever, as `TokenizerManager.lora_ref_cache` does: a
  /generate naming an unloaded one silently re-loads it from its original path (and fails with
  SGLang's message when that path is gone); a name never loaded gets 400
  `{"error": {"message": "Got LoRA adapter that has never been loaded: ..."}}`.
* One request with n > 1 runs n copies with the same `sampling_seed` (identical samples, as in
  SGLang); seeds outside [-2**63, 2**63) are refused with SGLang's message; seeds are honoured
  only with `deterministic=True` (`--enable-deterministic-inference`).
* `/abort_request` ends requests with finish_reason {"type": "abort", ...}; a streamed batch
  interleaves per-sample cumulative frames tagged with `index`; `/server_info` and `/v1/models`
  report the flags and the registered adapters. `original_logprobs=False` reports logprobs of
  the temperature-scaled distribution, as a server without SGLANG_RETURN_ORIGINAL_LOGPROB=1.

It additionally refuses a /generate without `lora_path` (real SGLang silently uses the base), so
the driver's "always name the adapter" rule is checked. `FakeSGLang.restart()` replaces it with
a fresh one on the same port that has forgotten everything, as a restarted container. With
`serve=False` (a model the torch engine does not run, such as an MoE) it checks and holds
adapters but generates nothing.
"""

from __future__ import annotations

import asyncio
import json
import re
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError
from safetensors.torch import load_file
from transformers import AutoConfig

from lorafleet.errors import LorafleetError
from lorafleet.testing import free_port, wait_for_port
from lorafleet_rollout import sglang_api as api
from lorafleet_rollout.torch_engine import TorchEngine
from lorafleet_rollout.types import LoraSpec, SampleRequest, SampleResult, SamplingSpec

#: What sglang_server.py (the real tier's launcher) passes as --lora-target-modules.
DEFAULT_TARGETS = (
    "q_proj",
    "k_proj",
    "v_proj",
    "o_proj",
    "gate_proj",
    "up_proj",
    "down_proj",
    "lm_head",
)

# --- ported from sglang 0.5.23 srt/lora/utils.py --------------------------------------------
_PARAMS_MAPPING = {
    "q_proj": "qkv_proj",
    "k_proj": "qkv_proj",
    "v_proj": "qkv_proj",
    "gate_proj": "gate_up_proj",
    "up_proj": "gate_up_proj",
    "out_proj": "out_proj",
    "embed_tokens": "embed_tokens",
    "vocab_emb": "embed_tokens",
    "embeddings": "embed_tokens",
    "word_embeddings": "embed_tokens",
    "lm_head": "lm_head",
    "output": "lm_head",
    "unembed_tokens": "lm_head",
    "q_a_proj": "fused_qkv_a_proj_with_mqa",
    "kv_a_proj_with_mqa": "fused_qkv_a_proj_with_mqa",
    "wq_b": "indexer.wq_b",
    "wk": "indexer.wk",
    "weights_proj": "indexer.weights_proj",
}
_SUPPORTED = (
    "q_proj",
    "k_proj",
    "v_proj",
    "o_proj",
    "q_a_proj",
    "kv_a_proj_with_mqa",
    "q_b_proj",
    "kv_b_proj",
    "wq_b",
    "wk",
    "weights_proj",
    "gate_proj",
    "up_proj",
    "down_proj",
    "qkv_proj",
    "gate_up_proj",
    "embed_tokens",
    "lm_head",
    "qkvr",
    "wo_ud",
)


def get_normalized_target_modules(target_modules: list[str] | str) -> set[str]:
    if isinstance(target_modules, str):
        if target_modules not in ["all", "all-linear"]:
            raise ValueError(
                "Only 'all' or 'all-linear' can be used as the string for target module"
            )
        return {"all"}
    return {_PARAMS_MAPPING.get(n.split(".")[-1], n.split(".")[-1]) for n in target_modules}


def get_target_module_name(full_module_name: str, target_modules: set[str]) -> str:
    best = None
    for target_module in target_modules:
        if target_module in full_module_name and (best is None or len(target_module) > len(best)):
            best = target_module
    if best is not None:
        return best
    raise ValueError(f"Cannot find target module name for {full_module_name} in {target_modules}")


def get_layer_id(name: str) -> int | None:
    match = re.search(r"layers\.(\d+)\.", name)
    return None if match is None else int(match.group(1))


# --- ported from sglang 0.5.23 srt/lora/lora.py (LoRAAdapter) -------------------------------
def process_weights(
    weights: dict[str, torch.Tensor], adapter_targets: set[str], num_layers: int
) -> tuple[list[dict[str, torch.Tensor]], dict[str, torch.Tensor]]:
    """`_process_weight` then `normalize_qkv_proj` / `normalize_gate_up_proj` per layer."""
    layers: list[dict[str, torch.Tensor]] = [{} for _ in range(num_layers)]
    embeddings: dict[str, torch.Tensor] = {}
    for name, weight in weights.items():
        name = name.replace("unembed_tokens", "lm_head")
        layer_id = get_layer_id(name)
        if layer_id is not None:
            if layer_id >= num_layers:
                raise IndexError("list index out of range")
            layers[layer_id][name] = weight
        elif "embed_tokens" in name or "lm_head" in name:
            module = "embed_tokens" if "embed_tokens" in name else "lm_head"
            if "all" in adapter_targets or module in adapter_targets:
                embeddings[name] = weight
    for layer in layers:
        _normalize_qkv_proj(layer)
        _normalize_gate_up_proj(layer)
    return layers, embeddings


def _normalize_qkv_proj(weights: dict[str, torch.Tensor]) -> None:
    names = list(weights)
    has_k = any("k_proj" in n for n in names)
    for name in names:
        if "q_proj" in name:
            k_name, v_name = name.replace("q_proj", "k_proj"), name.replace("q_proj", "v_proj")
            k = weights[k_name] if has_k else torch.zeros_like(weights[v_name])
            weights[name.replace("q_proj", "qkv_proj")] = torch.cat(
                (weights[name], k, weights[v_name]), 0
            )
            weights.pop(name)
            if has_k:
                weights.pop(k_name)
            weights.pop(v_name)
        elif "qkv_proj" in name and "lora_A" in name:
            weights[name] = weights[name].repeat(3, 1)


def _normalize_gate_up_proj(weights: dict[str, torch.Tensor]) -> None:
    for name in list(weights):
        if "gate_proj" in name:
            up = name.replace("gate_proj", "up_proj")
            if up not in weights or weights[up].numel() == 0:
                weights[up] = torch.zeros_like(weights[name])
            dim = weights[name].dim() - 2
            weights[name.replace("gate_proj", "gate_up_proj")] = torch.cat(
                (weights[name], weights[up]), dim
            )
            weights.pop(name)
            weights.pop(up)
        elif "gate_up_proj" in name and "lora_A" in name:
            repeat = [1] * weights[name].dim()
            repeat[-2] = 2
            weights[name] = weights[name].repeat(*repeat)


# --- the fake server ------------------------------------------------------------------------
class _Refused(Exception):
    """A load SGLang refuses: its message becomes LoRAUpdateOutput.error_message."""


class _Server:
    def __init__(
        self,
        model_dir: Path,
        targets: tuple[str, ...],
        max_lora_rank: int,
        serve: bool,
        deterministic: bool,
        original_logprobs: bool,
        max_loaded_loras: int,
    ) -> None:
        self.model_dir = model_dir
        self.max_loaded_loras = max_loaded_loras
        self.flags = list(targets)
        self.max_lora_rank = max_lora_rank
        self.deterministic = deterministic
        self.original_logprobs = original_logprobs
        self.config = AutoConfig.from_pretrained(model_dir)
        pool = list(_SUPPORTED) if "all" in targets else list(targets)
        # LoRAManager keeps the normalized server targets; the pool checks against them.
        self.targets = get_normalized_target_modules(pool)
        self.engine = TorchEngine(model_dir) if serve else None
        #: name -> (lora_id, path) of registered adapters; names ever loaded, forever.
        self.registry: dict[str, tuple[str, str]] = {}
        self.ref_cache: dict[str, str] = {}
        self.tasks: dict[str, asyncio.Task[Any]] = {}
        #: Every /generate body that passed the schema, in order (what the driver sent).
        self.received: list[api.GenerateRequest] = []
        #: Set by every successful load (tests wait on it across threads).
        self.adapter_loaded = threading.Event()

    def loaded(self) -> dict[str, str]:
        return {name: path for name, (_, path) in self.registry.items()}

    async def load(self, name: str, path: str) -> None:
        """LoRAManager._load_lora_adapter: config, validate_new_adapter, weights; _Refused."""
        lora_id = uuid.uuid4().hex
        try:
            config = json.loads((Path(path) / "adapter_config.json").read_text())
            targets = config["target_modules"]
            rank, alpha = config["r"], config["lora_alpha"]
            if config.get("use_dora", False):
                raise ValueError(
                    f"Failed to load {name} because LoRA serving currently doesn't support "
                    "DoRA adapters"
                )
            if name in self.registry:
                raise ValueError(f"Failed to load LoRA adapter {name} because it is already loaded")
            if len(self.registry) >= self.max_loaded_loras:
                # The real server unloads its own least recently used adapter here, behind
                # the driver's back; the fake refuses, so a driver that relied on that fails.
                raise ValueError(
                    f"fake SGLang: loading {name} would pass --max-loaded-loras "
                    f"{self.max_loaded_loras}"
                )
            normalized = get_normalized_target_modules(targets)
            if rank > self.max_lora_rank or not ("all" in normalized or normalized <= self.targets):
                raise ValueError(
                    f"LoRA adapter {name} with rank {rank} is incompatible with the current "
                    "LoRA memory pool configuration. Please ensure that the LoRA adapter's "
                    "rank is within the configured `--max-lora-rank` and that the target "
                    "modules are included in `--lora-target-modules`."
                )
            weights = load_file(str(Path(path) / "adapter_model.safetensors"))
            self._check_weights(lora_id, weights, normalized, rank)
            if self.engine is not None:
                await self.engine.load_adapter(lora_id, Path(path), LoraSpec(rank, alpha))
        except (ValueError, KeyError, OSError, IndexError, LorafleetError) as exc:
            raise _Refused(str(exc)) from None
        self.registry[name] = (lora_id, path)
        self.ref_cache[name] = path
        self.adapter_loaded.set()

    def _check_weights(
        self, uid: str, weights: dict[str, torch.Tensor], adapter_targets: set[str], rank: int
    ) -> None:
        """load_lora_weight_to_buffer's pre-validation (as with --lora-strict-loading) and
        the per-expert buffer shapes its copy asserts."""
        layers, embeddings = process_weights(
            weights, adapter_targets, self.config.num_hidden_layers
        )
        names = [n for layer in layers for n in layer] + list(embeddings)
        skipped = set()
        for n in names:
            try:
                get_target_module_name(n, self.targets)
            except ValueError:
                skipped.add(n)
        if skipped:
            raise ValueError(
                f"LoRA adapter '{uid}': {len(skipped)} weight(s) skipped because they did not "
                f"match any target module in {sorted(self.targets)}. Skipped weights: "
                f"{sorted(skipped)}. This likely indicates a mismatch between the adapter's "
                "target modules and the base model architecture."
            )
        experts = getattr(self.config, "num_experts", 0) or 0
        for layer in layers:
            for n, w in layer.items():
                match = re.search(r"experts\.(\d+)\.", n)
                if match is None:
                    continue
                module = get_target_module_name(n, self.targets)
                if not experts or module not in ("gate_up_proj", "down_proj"):
                    raise ValueError(f"KeyError: '{module}_moe' (weight {n})")
                if int(match.group(1)) >= experts:
                    raise ValueError(f"expert {match.group(1)} of {n}: the model has {experts}")
                hidden, inter = self.config.hidden_size, self.config.moe_intermediate_size
                c = 2 if module == "gate_up_proj" else 1
                a_in, b_out = (hidden, 2 * inter) if c == 2 else (inter, hidden)
                want = (c * rank, a_in) if "lora_A" in n else (b_out, rank)
                if tuple(w.shape) != want:
                    raise ValueError(
                        f"LoRA buffer shape {want} does not match weight shape {tuple(w.shape)}."
                    )

    async def unload(self, name: str) -> None:
        if name not in self.registry:
            raise _Refused(
                f"LoRA with name {name} does not exist. Loaded LoRAs: {self.registry.keys()}"
            )
        lora_id, _ = self.registry.pop(name)
        if self.engine is not None:
            await self.engine.unload_adapter(lora_id)

    async def resolve(self, names: set[str]) -> None:
        """TokenizerManager._resolve_lora_path: silently re-load unloaded names."""
        for name in sorted(names):
            if name in self.registry:
                continue
            if name not in self.ref_cache:
                raise ValueError(
                    f"Got LoRA adapter that has never been loaded: {name}\n"
                    f"All loaded adapters: {self.ref_cache.keys()}."
                )
            try:
                await self.load(name, self.ref_cache[name])
            except _Refused as exc:
                if "already loaded" not in str(exc):
                    raise ValueError(
                        f"Failed to implicitly load LoRA adapter {name}: {exc}"
                    ) from None


def build_app(server: _Server) -> FastAPI:
    engine = server.engine
    app = FastAPI(
        on_startup=[engine.start] if engine else [], on_shutdown=[engine.close] if engine else []
    )

    def lora_result(error: str | None = None) -> JSONResponse:
        body = api.LoraUpdateResult(
            success=error is None, error_message=error or "", loaded_adapters=server.loaded()
        )
        return JSONResponse(body.model_dump(), status_code=400 if error else 200)

    def error(message: str, status: int = 400) -> JSONResponse:
        return JSONResponse({"error": {"message": message}}, status_code=status)

    async def parse(request: Request, model: type[api._Request]) -> Any:
        try:
            return model.model_validate_json(await request.body())
        except ValidationError as exc:
            return error(str(exc))

    @app.get(api.HEALTH)
    async def health() -> Response:
        return Response(status_code=200)

    @app.get(api.SERVER_INFO)
    async def server_info() -> JSONResponse:
        return JSONResponse(
            {
                "enable_lora": True,
                "max_lora_rank": server.max_lora_rank,
                "max_loaded_loras": server.max_loaded_loras,
                "lora_target_modules": server.flags,
                "enable_deterministic_inference": server.deterministic,
                "version": api.SGLANG_VERSION,
            }
        )

    @app.get(api.MODELS)
    async def models() -> JSONResponse:
        cards = [{"id": "base", "root": "base", "parent": None}]
        cards += [
            {"id": name, "root": path, "parent": "base"} for name, path in server.loaded().items()
        ]
        return JSONResponse({"object": "list", "data": cards})

    @app.post(api.LOAD_LORA)
    async def load(request: Request) -> Response:
        body = await parse(request, api.LoadLoraAdapter)
        if isinstance(body, Response):
            return body
        try:
            await server.load(body.lora_name, body.lora_path)
        except _Refused as exc:
            return lora_result(str(exc))
        return lora_result()

    @app.post(api.UNLOAD_LORA)
    async def unload(request: Request) -> Response:
        body = await parse(request, api.UnloadLoraAdapter)
        if isinstance(body, Response):
            return body
        try:
            await server.unload(body.lora_name)
        except _Refused as exc:
            return lora_result(str(exc))
        return lora_result()

    @app.post(api.ABORT)
    async def abort(request: Request) -> Response:
        body = await parse(request, api.AbortRequest)
        if isinstance(body, Response):
            return body
        for rid, task in list(server.tasks.items()):
            if body.abort_all or rid == body.rid:
                task.cancel()
        return Response(status_code=200)

    @app.post(api.GENERATE)
    async def generate(request: Request) -> Response:
        raw = json.loads(await request.body())
        if "lora_path" not in raw:
            return error("lora_path missing: this would silently run the base")
        body = await parse(request, api.GenerateRequest)
        if isinstance(body, Response):
            return body
        server.received.append(body)
        if engine is None:
            return error("fake: this model is not served by the torch engine")
        batch = bool(body.input_ids) and isinstance(body.input_ids[0], list)
        prompts = body.input_ids if batch else [body.input_ids]
        loras = (
            body.lora_path if isinstance(body.lora_path, list) else [body.lora_path] * len(prompts)
        )
        params = body.sampling_params
        params = params if isinstance(params, list) else [params] * len(prompts)
        rids = (
            body.rid
            if isinstance(body.rid, list)
            else [body.rid or uuid.uuid4().hex] * len(prompts)
        )
        if not len(loras) == len(params) == len(rids) == len(prompts):
            return error("one lora_path, sampling_params and rid per prompt")
        for p in params:
            seed = p.sampling_seed
            if seed is not None and not -(2**63) <= seed <= 2**63 - 1:
                return error(f"sampling_seed must be in [-2**63, 2**63 - 1], got {seed}.")
        try:
            await server.resolve({name for name in loras if name is not None})
        except ValueError as exc:
            return error(str(exc))
        jobs = [
            (prompt, lora, p, rid if p.n == 1 else uuid.uuid4().hex)
            for prompt, lora, p, rid in zip(prompts, loras, params, rids, strict=True)
            for _ in range(p.n)
        ]
        tasks = []
        for prompt, lora, p, rid in jobs:
            task = asyncio.ensure_future(_sample_one(server, prompt, lora, p, body, rid))
            server.tasks[rid] = task
            tasks.append(task)
        try:
            done = await asyncio.gather(*tasks, return_exceptions=True)
        finally:
            for _, _, _, rid in jobs:
                server.tasks.pop(rid, None)
        for item in done:
            if isinstance(item, BaseException) and not isinstance(item, asyncio.CancelledError):
                return error(str(item))
        out = [
            _aborted(rid) if isinstance(item, BaseException) else item
            for item, (_, _, _, rid) in zip(done, jobs, strict=True)
        ]
        if body.stream:
            return StreamingResponse(
                _sse(out, batch or len(out) > 1), media_type="text/event-stream"
            )
        return JSONResponse(out if batch or len(out) > 1 else out[0])

    return app


async def _sample_one(
    server: _Server,
    prompt: list[int],
    lora_name: str | None,
    p: api.SamplingParams,
    body: api.GenerateRequest,
    rid: str,
) -> dict[str, Any]:
    engine = server.engine
    assert engine is not None
    lora = None if lora_name is None else server.registry[lora_name][0]
    want_prompt = body.return_logprob and body.logprob_start_len >= 0
    topk = body.top_logprobs_num
    spec = SamplingSpec(
        max_tokens=p.max_new_tokens,
        temperature=p.temperature,
        top_p=p.top_p,
        top_k=p.top_k,
        stop_strings=tuple(p.stop or ()),
        stop_token_ids=tuple(p.stop_token_ids or ()),
        disable_eos_stop=p.ignore_eos,
        # Without --enable-deterministic-inference SGLang ignores the seed.
        seed=p.sampling_seed % 2**63
        if server.deterministic and p.sampling_seed is not None
        else None,
    )
    result = await engine.sample(
        SampleRequest(
            lora,
            tuple(prompt),
            spec,
            prompt_logprobs=want_prompt,
            topk_prompt_logprobs=topk if want_prompt else 0,
        )
    )
    (seq,) = result.sequences
    logprobs = list(seq.logprobs)
    top_out = None
    if topk or not server.original_logprobs:
        # Every output position's whole distribution: a prompt pass over prompt + output.
        vocab = int(server.config.vocab_size)
        full = await engine.sample(
            SampleRequest(
                lora,
                (*prompt, *seq.tokens),
                SamplingSpec(max_tokens=1, temperature=0.0),
                prompt_logprobs=True,
                topk_prompt_logprobs=vocab,
            )
        )
        rows = []
        for row in full.topk_prompt_logprobs[len(prompt) : len(prompt) + len(seq.tokens)]:
            ids = torch.tensor([t for t, _ in row])
            lps = torch.tensor([lp for _, lp in row], dtype=torch.float64)
            if not server.original_logprobs and p.temperature > 0:
                lps = torch.log_softmax(lps / p.temperature, dim=-1)
            rows.append(dict(zip(ids.tolist(), lps.tolist(), strict=True)))
        if not server.original_logprobs:
            logprobs = [row[t] for row, t in zip(rows, seq.tokens, strict=True)]
        if topk:
            top_out = [
                [[lp, t, None] for t, lp in sorted(row.items(), key=lambda kv: -kv[1])[:topk]]
                for row in rows
            ]
    return _render(rid, prompt, seq.tokens, logprobs, seq.stop_reason, result, top_out)


def _render(
    rid: str,
    prompt: list[int],
    tokens: tuple[int, ...],
    logprobs: list[float],
    stop_reason: str,
    result: SampleResult,
    top_out: list | None,
) -> dict[str, Any]:
    if stop_reason == "length":
        finish = {"type": "length", "length": len(tokens)}
    else:
        finish = {"type": "stop", "matched": tokens[-1]}
    meta: dict[str, Any] = {
        "id": rid,
        "finish_reason": finish,
        "prompt_tokens": len(prompt),
        "completion_tokens": len(tokens),
        "cached_tokens": 0,
        "output_token_logprobs": [[lp, t, None] for lp, t in zip(logprobs, tokens, strict=True)],
    }
    if result.prompt_logprobs:
        meta["input_token_logprobs"] = [
            [None if i == 0 else lp, t, None]
            for i, (lp, t) in enumerate(zip(result.prompt_logprobs, prompt, strict=True))
        ]
    if result.topk_prompt_logprobs:
        meta["input_top_logprobs"] = [
            [[lp, t, None] for t, lp in row] if row else None for row in result.topk_prompt_logprobs
        ]
    if top_out is not None:
        meta["output_top_logprobs"] = top_out
    return {"text": "", "output_ids": list(tokens), "meta_info": meta}


def _aborted(rid: str) -> dict[str, Any]:
    """An aborted request's answer (`TokenizerManager` abort handling: no prompt_tokens)."""
    finish = {
        "type": "abort",
        "message": "Abort in waiting queue",
        "status_code": None,
        "err_type": None,
    }
    meta = {
        "id": rid,
        "finish_reason": finish,
        "weight_version": "default",
        "e2e_latency": 0.0,
        "completion_tokens": 0,
        "output_token_logprobs": [],
    }
    return {"text": "", "output_ids": [], "meta_info": meta}


def _sse(items: list[dict], batch: bool) -> Iterator[str]:
    """Cumulative snapshots, one per token, samples interleaved (each tagged with its index
    in a batch), as SGLang streams them by default."""
    frames = []
    for index, item in enumerate(items):
        ids, meta = item["output_ids"], item["meta_info"]
        for k in range(1, max(len(ids), 1) + 1):
            snapshot = dict(meta)
            snapshot["output_token_logprobs"] = meta["output_token_logprobs"][:k]
            snapshot["completion_tokens"] = min(k, len(ids))
            if k < len(ids):
                snapshot["finish_reason"] = None
            frame = {"text": "", "output_ids": ids[:k], "meta_info": snapshot}
            if batch:
                frame["index"] = index
            frames.append((k, index, frame))
    for _, _, frame in sorted(frames, key=lambda f: (f[0], f[1])):
        yield f"data: {json.dumps(frame)}\n\n"
    yield "data: [DONE]\n\n"


class FakeSGLang:
    """Run the fake on a free loopback port in a background thread."""

    def __init__(
        self,
        model_dir: Path,
        *,
        targets: tuple[str, ...] = DEFAULT_TARGETS,
        max_lora_rank: int = 64,
        serve: bool = True,
        deterministic: bool = True,
        original_logprobs: bool = True,
        max_loaded_loras: int = 16,
    ) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._args = (
            model_dir,
            targets,
            max_lora_rank,
            serve,
            deterministic,
            original_logprobs,
            max_loaded_loras,
        )
        self.state = _Server(*self._args)
        self._uvicorn: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None

    def _start(self) -> None:
        config = uvicorn.Config(
            build_app(self.state), host="127.0.0.1", port=self.port, log_level="warning"
        )
        self._uvicorn = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._uvicorn.run, daemon=True)
        self._thread.start()
        wait_for_port(self.port, timeout=60)

    def _stop(self) -> None:
        assert self._uvicorn is not None and self._thread is not None
        self._uvicorn.should_exit = True
        self._thread.join(30)

    def restart(self) -> None:
        """Stop, then start a fresh server on the same port that remembers nothing."""
        self._stop()
        self.state = _Server(*self._args)
        self._start()

    def __enter__(self) -> FakeSGLang:
        self._start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop()
