"""The GPU check's serving section (issue 21 item 6): the real SGLang and vLLM servers serve
adapters exported by our trainer, and their logprobs are compared with the trainer's.

Two models from the shared tiny builds (`lorafleet_models.tiny`, cached under .cache/models:
carry that folder to a device that should not rebuild them): the dense tiny Llama and the tiny
Qwen3-MoE. Per model the trainer (float32) takes a few Adam steps on one rank-8 adapter with
lm_head (the SDK's default `train_unembed=True`; on the MoE model also the per-expert banks) and
exports it as a publish does. Each server is started through what the fleet uses, never a
restated command line: SGLang through `sglang_server.SGLangServer` (its GPU profile on CUDA,
its CPU profile otherwise) and driven by `SGLangEngine` (which converts expert LoRA at publish,
`sglang_lora.py`); vLLM through `sampling_vllm.vllm_server` and driven by `VLLMEngine`. Each
part samples 16 greedy tokens with prompt logprobs, with the adapter and without, and reports
the largest |sampler - trainer| logprob difference over prompt and generated tokens.

Precision: on a CPU both servers run float32 (the ≤ 1e-4 bound applies); on a GPU they serve
the model in bfloat16 (its weights rounded to bf16 first, so the float32 trainer reads the
very same weights) and the figure is the bf16 serving error, reported without a bound.

A part that cannot run here says so instead of failing the check: "skipped: <why>" when the
server package is missing, "refused: <why>" for what the fleet refuses to serve (SGLang's CPU
backend and MoE LoRA; vLLM and expert LoRA, README's engine table), "error: <why>" with the
server log's tail when a server fails.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import httpx
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from lorafleet import quantize
from lorafleet.testing import free_port
from lorafleet_models.tiny import ensure_model
from lorafleet_rollout import sglang_server
from lorafleet_rollout.http_engine import wait_healthy
from lorafleet_rollout.sglang_engine import SGLangEngine
from lorafleet_rollout.types import LoraSpec, SampleRequest, SamplingSpec
from lorafleet_rollout.vllm_engine import VLLMEngine
from lorafleet_trainer.domain import AdamParams, Datum, ForwardBackwardInput, ForwardBackwardItem
from lorafleet_trainer.domain import LoraSpec as TrainerLoraSpec
from lorafleet_trainer.engine import TrainerEngine

REPO = Path(__file__).resolve().parents[1]
MODELS = REPO / ".cache" / "models"
RANK, ALPHA = 8, 16.0  # sampling_vllm.vllm_server serves ranks up to 8
TOL_FLOAT32 = 1e-4
PROMPT = (17, 402, 93, 1100, 8, 250, 61, 733)
GREEDY = SamplingSpec(max_tokens=16, temperature=0.0, disable_eos_stop=True)
VLLM_EXPERTS_REFUSAL = (
    "vLLM serves no expert LoRA in the layout our trainer exports (PEFT target_parameters): "
    "it needs --enable-mixed-moe-lora-format and is_3d_lora_weight, which VLLMEngine does not "
    "send (README, 'which engine serves which adapter kinds')"
)


@dataclass
class Trained:
    """One trainer-exported adapter and the trainer's own logprobs for any token sequence."""

    folder: Path
    #: What the adapter adapts, from its adapter_config.json (lm_head; the expert banks).
    targets: list[str]
    logprobs: Callable[[str | None, list[int]], torch.Tensor]


def served_model(preset: str, cuda: bool, work: Path) -> Path:
    """The model folder servers load: the tiny build itself on CPU (float32); on a GPU a copy
    with its weights rounded to bfloat16, the dtype the servers then serve."""
    folder = ensure_model(preset, MODELS)
    if not cuda:
        return folder
    out = work / f"{preset}-bf16"
    if not out.exists():
        shutil.copytree(folder, out)
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
        model.to(torch.bfloat16).save_pretrained(out)
    return out


def train(model: Path, device: str, work: Path, quantization: str = quantize.NONE) -> Trained:
    """Six Adam steps of one adapter with lm_head (and expert banks on MoE), then PEFT export.
    The trainer runs float32 on the served weights (bf16-exact on a GPU), quantized as the
    fleet's `quantization` says (its base-only logprobs then come from the same weights)."""
    engine = TrainerEngine.from_pretrained(
        model,
        device=device,
        dtype="float32",
        num_slots=1,
        max_rank=RANK,
        storage_root=work / f"{model.name}-{quantization}-states",
        quantization=quantization,
    )
    engine.bind(0, "reg", TrainerLoraSpec(rank=RANK, alpha=ALPHA, seed=1, train_unembed=True))
    gen = torch.Generator().manual_seed(100)
    target = [*PROMPT, *torch.randint(3, 2000, (16,), generator=gen).tolist()]
    datum = Datum(target[:-1], {"target_tokens": torch.tensor(target[1:])})
    for step in range(6):
        fb = ForwardBackwardInput([datum], "cross_entropy")
        item = ForwardBackwardItem(f"fb{step}", 0, "reg", fb)
        out = engine.forward_backward([item])[0]
        if isinstance(out, Exception):
            raise out
        engine.optim_step(f"opt{step}", 0, "reg", AdamParams(learning_rate=2e-2))
    folder = work / f"{model.name}-{quantization}-reg@1"
    engine.export_adapter(0, "reg", folder)
    base = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).to(device).eval()
    quantize.dequantize_in_place(base, quantization)

    def logprobs(adapter: str | None, tokens: list[int]) -> torch.Tensor:
        """log p(tokens[t] | tokens[:t]) for t >= 1: the adapter's through the trainer's own
        forward pass, the base's through plain transformers."""
        if adapter is None:
            with torch.no_grad():
                ids = torch.tensor([tokens], device=device)
                lp = torch.log_softmax(base(input_ids=ids).logits[0, :-1].float(), -1)
                return lp.gather(-1, ids[0, 1:, None]).squeeze(-1).cpu()
        d = Datum(tokens[:-1], {"target_tokens": torch.tensor(tokens[1:])})
        probe = ForwardBackwardInput([d], "cross_entropy", forward_only=True)
        item = ForwardBackwardItem("", 0, "reg", probe)
        return engine.forward_backward([item])[0].logprobs[0].cpu()

    config = json.loads((folder / "adapter_config.json").read_text())
    targets = [*(config.get("target_modules") or []), *(config.get("target_parameters") or [])]
    return Trained(folder, sorted(targets), logprobs)


async def compare(engine: SGLangEngine | VLLMEngine, trained: Trained, cuda: bool) -> dict:
    """Greedy tokens with prompt logprobs, adapter and base: the largest difference from the
    trainer's logprobs (prompt positions after the first, and every generated token)."""
    await engine.load_adapter("reg@1", trained.folder, LoraSpec(RANK, ALPHA))
    worst, tokens = 0.0, {}
    try:
        for adapter in ("reg@1", None):
            request = SampleRequest(adapter, PROMPT, GREEDY, prompt_logprobs=True)
            result = await engine.sample(request)
            seq = result.sequences[0]
            want = trained.logprobs(adapter, [*PROMPT, *seq.tokens]).double()
            got = torch.tensor([*result.prompt_logprobs[1:], *seq.logprobs], dtype=torch.float64)
            worst = max(worst, float((got - want).abs().max()))
            tokens[adapter] = seq.tokens
    finally:
        await engine.unload_adapter("reg@1")
    out: dict = {
        "dtype": "bfloat16" if cuda else "float32",
        "adapter_targets": trained.targets,
        "logprob_max_abs_diff_vs_trainer": worst,
        "adapter_changes_tokens": tokens["reg@1"] != tokens[None],
    }
    if not cuda:
        out["within_1e-4"] = worst <= TOL_FLOAT32
    return out


def server_python(package: str, cpu_python: Path, setup: str, cuda: bool) -> Path | str:
    """The interpreter that has the server package, or why there is none: on a GPU whatever
    Python runs this check (the device image's stack), on a CPU the project's CPU venv."""
    if not cuda:
        return cpu_python if cpu_python.exists() else f"skipped: no {cpu_python} (run {setup})"
    why = []
    candidates = dict.fromkeys([sys.executable, shutil.which("python3"), shutil.which("python")])
    for python in filter(None, candidates):
        probe = subprocess.run(
            [python, "-c", f"import {package}"], capture_output=True, text=True, timeout=300
        )
        if probe.returncode == 0:
            return Path(python)
        why.append(f"{python}: {(probe.stderr.strip().splitlines() or ['no output'])[-1]}")
    return f"skipped: {package} is not importable ({'; '.join(why)})"


async def sglang_part(
    model: Path,
    trained: Callable[[], Trained],
    cuda: bool,
    work: Path,
    quantization: str = quantize.NONE,
) -> dict:
    python = server_python(
        "sglang", sglang_server.DEFAULT_PYTHON, "services/rollout/tests/setup_sglang_venv.sh", cuda
    )
    if isinstance(python, str):
        return {"result": python}
    server = sglang_server.SGLangServer(
        model,
        free_port(),
        python=python,
        device="cuda" if cuda else "cpu",
        max_lora_rank=RANK,
        max_loras_per_batch=2,
        max_loaded_loras=4,
        quantization=quantization,
    )
    try:
        server.check()
    except ValueError as exc:  # the CPU profile refuses MoE models
        return {"result": f"refused: {exc}"}
    adapter = trained()
    log = work / f"sglang-{model.name}-{quantization}.log"
    started = time.monotonic()
    proc = server.start(log)
    try:
        await asyncio.to_thread(server.wait_healthy, proc, log, 600)
        healthy = time.monotonic() - started
        engine = SGLangEngine(server.url, model, max_lora_rank=RANK, ready_timeout=60)
        await engine.start()
        try:
            return {"server_start_s": round(healthy, 1), **await compare(engine, adapter, cuda)}
        finally:
            await engine.close()
    except Exception as exc:
        return {"result": f"error: {type(exc).__name__}: {exc}", "log_tail": _tail(log)}
    finally:
        sglang_server.stop(proc)


async def vllm_part(
    model: Path,
    trained: Callable[[], Trained],
    cuda: bool,
    work: Path,
    quantization: str = quantize.NONE,
) -> dict:
    import sampling_vllm

    python = server_python(
        "vllm", sampling_vllm.VLLM_PYTHON, "services/rollout/tests/setup_vllm_venv.sh", cuda
    )
    if isinstance(python, str):
        return {"result": python}
    adapter = trained()
    log = work / f"vllm-{model.name}-{quantization}.log"
    dtype = "bfloat16" if cuda else "float32"
    started = time.monotonic()
    context = AutoConfig.from_pretrained(model).max_position_embeddings
    server = sampling_vllm.vllm_server(
        model,
        2,
        True,
        log,
        python=python,
        dtype=dtype,
        max_model_len=context,
        quantization=quantization,
    )
    with server as (url, proc):
        engine = VLLMEngine(url, model, max_lora_rank=RANK, ready_timeout=600)
        try:
            async with httpx.AsyncClient(base_url=url) as client:  # fails early if vLLM exits
                await wait_healthy(
                    client, "/health", name="vLLM", url=url, ready_timeout=600, proc=proc
                )
            await engine.start()
            healthy = time.monotonic() - started
            return {"server_start_s": round(healthy, 1), **await compare(engine, adapter, cuda)}
        except Exception as exc:
            return {"result": f"error: {type(exc).__name__}: {exc}", "log_tail": _tail(log)}
        finally:
            await engine.close()


async def serving_section(device: str, work: Path) -> dict:
    """SGLang and vLLM, dense and MoE; each adapter trained once, only if a server needs it."""
    cuda = device == "cuda"
    out: dict = {}
    for kind, preset in (("dense", "tiny"), ("moe", "tiny-moe")):
        model = served_model(preset, cuda, work)
        cache: list[Trained] = []

        def trained(model: Path = model, cache: list[Trained] = cache) -> Trained:
            if not cache:
                cache.append(train(model, device, work))
            return cache[0]

        out[f"sglang_{kind}"] = await sglang_part(model, trained, cuda, work)
        if kind == "moe":
            out["vllm_moe"] = {"result": f"refused: {VLLM_EXPERTS_REFUSAL}"}
        else:
            out["vllm_dense"] = await vllm_part(model, trained, cuda, work)
    return out


async def quantized_serving(device: str, work: Path) -> dict:
    """The fleet's fp8 base on the dense model: the trainer on `lorafleet.quantize`'s fp8
    weights against SGLang and vLLM started with their own --quantization fp8 (per-matrix
    e4m3 weights, as ours; on GPUs with fp8 GEMMs they quantize activations too, which the
    trainer does not, so the difference is reported, not bounded). GPU only: the engines'
    fp8 kernels are CUDA kernels."""
    if device != "cuda":
        return {"result": "skipped: SGLang's and vLLM's fp8 paths need a GPU"}
    model = served_model("tiny", True, work)
    cache: list[Trained] = []

    def trained() -> Trained:
        if not cache:
            cache.append(train(model, device, work, quantize.FP8))
        return cache[0]

    return {
        "sglang_dense_fp8": await sglang_part(model, trained, True, work, quantize.FP8),
        "vllm_dense_fp8": await vllm_part(model, trained, True, work, quantize.FP8),
    }


def _tail(log: Path, lines: int = 12) -> list[str]:
    try:
        return log.read_text(errors="replace").strip().splitlines()[-lines:]
    except FileNotFoundError:
        return []
