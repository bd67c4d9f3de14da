"""Rollout figures on the ~20 M "bench" model, measured side by side in one run. Prints JSON.

1. Sampling throughput: 16 concurrent requests over 8 rank-8 LoRA adapters (32 prompt and 64
   greedy new tokens each, EOS ignored so both sides generate the same tokens) on TorchEngine
   (continuous, mixed-adapter batching) vs what a naive server does: transformers + PEFT with
   every adapter loaded, `set_adapter`, then `generate` per request. Rounds alternate the two
   sides so load drifts on a shared host hit both; the speedup is the median round's ratio.
   Target >= 4x (S-LoRA reports 4x over HF PEFT).
2. Publishing: two rollout replicas, each its own `python -m lorafleet_rollout` process (the
   deployment shape), this process acting as the publisher. Latency = a rank-8 adapter folder
   on disk (as the trainer exports it) -> LoadAdapter streamed to both replicas -> both
   serving it; p50 target <= 100 ms. Side by side, publish by reference (shared storage): one
   header naming the files, each replica reading and verifying them itself
   (publish_by_reference_p50_ms; hashing included, as the trainer hashes when it writes).
   And sampling throughput of other adapters (16 requests
   over reg-0..3 on both replicas, `--publish-new-tokens` each) while versions of reg-pub are
   published, vs without; target >= 0.9x. Two loads: one publish per second of sampling (a
   realistic "during a publish") and back to back (the worst case: replicas pace it to their
   publish CPU budget, LORAFLEET_ROLLOUT_PUBLISH_CPU_SHARE). Each round runs quiet, 1/s,
   back to back.

Torch runs one intra-op thread by default: on a shared host OpenMP's spinning worker threads
measure the neighbours (2 threads ran both sides ~15x slower here under load); `--threads 0`
keeps torch's default.

    .venv/bin/python bench/sampling.py [--rounds 3] [--threads 1] [--skip-publish]
        [--skip-throughput]

3. `--vs-vllm`: TorchEngine against the real vLLM-CPU server on workloads (a)-(d), with and
   without adapters, at equal thread counts, each side alone (vLLM stopped by SIGSTOP during
   our rounds; the verdict is the worst round's ratio), with the GEMM peak measured in the
   same run (see `sampling_vllm.py`; replaces 1 and 2 in that run).

    .venv/bin/python bench/sampling.py --vs-vllm [--threads 1] [--rounds 3] [--workloads abcd]

4. `--vs-llama-cpp`: TorchEngine against llama.cpp (llama-cpp-python from `.venvs/llama-cpp`,
   bench/setup_llama_cpp_venv.sh) on single-adapter decode: the `--requests` prompts one at a
   time on one adapter, greedy, at equal thread counts, each side alone (see
   `sampling_llama_cpp.py`; replaces 1 and 2 in that run).

    .venv/bin/python bench/sampling.py --vs-llama-cpp [--threads 1] [--rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import json
import statistics
import tempfile
import time
from pathlib import Path

import grpc
import torch
from peft import LoraConfig, PeftModel, get_peft_model
from sampling_llama_cpp import add_arguments as add_llama_cpp_arguments
from sampling_llama_cpp import vs_llama_cpp
from sampling_vllm import add_arguments, vs_vllm
from transformers import AutoModelForCausalLM, LlamaConfig

from lorafleet import shared_storage
from lorafleet.rpc.channel import make_channel
from lorafleet.testing import child_env, free_port, service_process, wait_serving
from lorafleet.v1 import common_pb2, rollout_pb2, rollout_pb2_grpc
from lorafleet_rollout.allocator import exec_with_tunables
from lorafleet_rollout.torch_engine import TorchEngine
from lorafleet_rollout.types import LoraSpec, SampleRequest, SamplingSpec

REPO = Path(__file__).resolve().parents[1]
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
RANK = 8


def bench_model(work: Path) -> tuple[Path, str]:
    try:
        from lorafleet_models.tiny import ensure_model
    except ImportError:
        torch.manual_seed(0)
        config = LlamaConfig(
            vocab_size=2048,
            hidden_size=512,
            num_hidden_layers=6,
            intermediate_size=1536,
            num_attention_heads=8,
            num_key_value_heads=8,
            max_position_embeddings=512,
        )
        AutoModelForCausalLM.from_config(config).save_pretrained(work / "model")
        return work / "model", "random 512/6/1536 Llama"
    return ensure_model("bench", REPO / ".cache" / "models"), "lorafleet_models bench preset"


def make_adapters(model_dir: Path, work: Path, n: int, prefix: str = "a") -> list[Path]:
    folders = []
    for i in range(n):
        torch.manual_seed(100 + i if prefix == "a" else 1000 + i)
        base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        config = LoraConfig(
            r=RANK, lora_alpha=2 * RANK, target_modules=TARGETS, init_lora_weights=False
        )
        get_peft_model(base, config).save_pretrained(work / f"{prefix}{i}")
        folders.append(work / f"{prefix}{i}")
    return folders


# ------------------------------------------------------------------ 1. throughput
def baseline_model(model_dir: Path, adapters: list[Path]) -> PeftModel:
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    model = PeftModel.from_pretrained(base, adapters[0], adapter_name="a0")
    for i, folder in enumerate(adapters[1:], start=1):
        model.load_adapter(folder, adapter_name=f"a{i}")
    return model.eval()


def baseline_round(model: PeftModel, n_adapters: int, prompts: list[list[int]], new: int) -> float:
    start = time.perf_counter()
    with torch.inference_mode():
        for r, prompt in enumerate(prompts):
            model.set_adapter(f"a{r % n_adapters}")
            ids = torch.tensor([prompt])
            out = model.generate(
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=new,
                min_new_tokens=new,
                do_sample=False,
                pad_token_id=0,
            )
            assert out.shape[1] == len(prompt) + new
    return time.perf_counter() - start


async def engine_round(engine: TorchEngine, requests: list[SampleRequest], new: int) -> float:
    start = time.perf_counter()
    results = await asyncio.gather(*(engine.sample(r) for r in requests))
    elapsed = time.perf_counter() - start
    assert all(len(res.sequences[0].tokens) == new for res in results)
    return elapsed


async def throughput(
    model_dir: Path, adapters: list[Path], prompts: list[list[int]], args: argparse.Namespace
) -> dict[str, float | list[float]]:
    new = args.new_tokens
    engine = TorchEngine(model_dir, max_batch_size=len(prompts))
    await engine.start()
    for i, folder in enumerate(adapters):
        await engine.load_adapter(f"reg-{i}@1", folder, LoraSpec(RANK, 2 * RANK))
    spec = SamplingSpec(max_tokens=new, temperature=0.0, disable_eos_stop=True)
    requests = [
        SampleRequest(f"reg-{r % len(adapters)}@1", tuple(p), spec) for r, p in enumerate(prompts)
    ]
    await engine.sample(requests[0])  # warm-up
    reference = baseline_model(model_dir, adapters)
    engine_s, baseline_s = [], []
    for _ in range(args.rounds):
        engine_s.append(await engine_round(engine, requests, new))
        baseline_s.append(baseline_round(reference, len(adapters), prompts, new))
    start = time.perf_counter()
    await engine.sample(requests[0])
    single = time.perf_counter() - start
    await engine.close()
    tokens = len(prompts) * new
    return {
        "torch_engine_tok_s": round(tokens / statistics.median(engine_s), 1),
        "one_by_one_generate_tok_s": round(tokens / statistics.median(baseline_s), 1),
        "speedup": round(
            statistics.median(b / e for e, b in zip(engine_s, baseline_s, strict=True)), 2
        ),
        "speedup_per_round": [round(b / e, 2) for e, b in zip(engine_s, baseline_s, strict=True)],
        "torch_engine_single_request_s": round(single, 3),
    }


# ------------------------------------------------------------------ 2. publishing
class Replica:
    """One rollout replica as the real deployment runs it: `python -m lorafleet_rollout` in
    its own process (own GIL, own engine thread), configured by env, driven over gRPC."""

    def __init__(self, model_dir: Path, root: Path, index: int, threads: int) -> None:
        self.port = free_port()
        self.env = child_env(
            LORAFLEET_ROLLOUT_MODEL_PATH=str(model_dir),
            LORAFLEET_ROLLOUT_PORT=str(self.port),
            LORAFLEET_ROLLOUT_ADAPTER_DIR=str(root / f"replica-{index}"),
            LORAFLEET_ROLLOUT_REPLICA_ID=f"rollout-{index}",
            LORAFLEET_ROLLOUT_MAX_BATCH_SIZE="32",
            LORAFLEET_ROLLOUT_TORCH_THREADS=str(threads),
            LORAFLEET_ROLLOUT_SHARED_ADAPTER_ROOT=str(root.resolve()),
        )
        self.log = root / f"replica-{index}.log"
        self.channel: grpc.aio.Channel | None = None
        self.stub: rollout_pb2_grpc.RolloutServiceStub | None = None

    async def start(self, stack: contextlib.ExitStack) -> None:
        stack.enter_context(service_process("lorafleet_rollout", self.port, self.env, self.log))
        self.channel = make_channel(f"127.0.0.1:{self.port}")
        await wait_serving(self.channel, "lorafleet.v1.RolloutService", within=120)
        self.stub = rollout_pb2_grpc.RolloutServiceStub(self.channel)

    async def stop(self) -> None:
        if self.channel is not None:
            await self.channel.close()


def load_stream(reg: str, version: int, folder: Path) -> list[rollout_pb2.LoadAdapterChunk]:
    """The LoadAdapter messages for an exported PEFT folder (reading and hashing included)."""
    files = {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.is_file()}
    digests = {name: hashlib.sha256(data).hexdigest() for name, data in files.items()}
    header = rollout_pb2.AdapterHeader(
        adapter=common_pb2.AdapterRef(registration_id=reg, version=version),
        lora_config=common_pb2.LoraConfig(rank=RANK, alpha=2 * RANK),
        file_sha256=digests,
    )
    messages = [rollout_pb2.LoadAdapterChunk(header=header)]
    step = 1 << 20
    for name, data in files.items():
        for offset in range(0, max(len(data), 1), step):
            last = offset + step >= len(data)
            chunk = common_pb2.FileChunk(
                path=name,
                offset=offset,
                data=data[offset : offset + step],
                sha256=digests[name] if last else "",
            )
            messages.append(rollout_pb2.LoadAdapterChunk(chunk=chunk))
    return messages


def load_by_reference(reg: str, version: int, folder: Path) -> list[rollout_pb2.LoadAdapterChunk]:
    """The LoadAdapter of a publish on shared storage: a header naming the files, no chunks."""
    refs = shared_storage.describe(folder)
    header = rollout_pb2.AdapterHeader(
        adapter=common_pb2.AdapterRef(registration_id=reg, version=version),
        lora_config=common_pb2.LoraConfig(rank=RANK, alpha=2 * RANK),
        file_sha256={name: r.sha256 for name, r in refs.items()},
        file_refs={
            name: common_pb2.BlobRef(uri=r.uri, sha256=r.sha256, size_bytes=r.size_bytes)
            for name, r in refs.items()
        },
    )
    return [rollout_pb2.LoadAdapterChunk(header=header)]


async def publish(
    replicas: list[Replica], reg: str, version: int, folder: Path, by_reference: bool = False
) -> float:
    """Seconds from the exported folder to every replica serving it."""
    start = time.perf_counter()
    make = load_by_reference if by_reference else load_stream
    messages = await asyncio.to_thread(make, reg, version, folder)
    await asyncio.gather(
        *(r.stub.LoadAdapter(iter(messages), timeout=60) for r in replicas if r.stub)
    )
    return time.perf_counter() - start


async def sample_load(replicas: list[Replica], prompts: list[list[int]], new: int) -> float:
    """Seconds for every replica to serve all prompts over the 'other' adapters reg-0..3."""
    params = common_pb2.SamplingParams(max_tokens=new, temperature=0.0, disable_eos_stop=True)
    calls = [
        r.stub.Sample(
            rollout_pb2.SampleRequest(
                adapter=common_pb2.AdapterRef(registration_id=f"reg-{i % 4}", version=1),
                prompt_tokens=p,
                params=params,
            ),
            timeout=300,
        )
        for r in replicas
        if r.stub
        for i, p in enumerate(prompts)
    ]
    start = time.perf_counter()
    answers = await asyncio.gather(*calls)
    elapsed = time.perf_counter() - start
    assert all(len(a.output.sequences[0].tokens) == new for a in answers)
    return elapsed


class Publisher:
    """Publishes successive versions of "reg-pub" to every replica, timing each."""

    def __init__(self, replicas: list[Replica], pushed: list[Path]) -> None:
        self.replicas = replicas
        self.pushed = pushed
        self.version = 0

    async def once(self, by_reference: bool = False) -> float:
        self.version += 1
        folder = self.pushed[self.version % len(self.pushed)]
        return await publish(self.replicas, "reg-pub", self.version, folder, by_reference)

    async def during(self, load: asyncio.Future[float], period: float) -> list[float]:
        """Publish until `load` finishes: back to back (period 0) or one every `period` s."""
        latencies = []
        while not load.done():
            started = time.perf_counter()
            latencies.append(await self.once())
            if period:
                rest = period - (time.perf_counter() - started)
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(max(rest, 0)):
                        await asyncio.shield(load)
        return latencies


async def publishing(
    model_dir: Path,
    work: Path,
    others: list[Path],
    pushed: list[Path],
    prompts: list[list[int]],
    args: argparse.Namespace,
) -> dict[str, object]:
    replicas = [Replica(model_dir, work, i, args.threads) for i in range(2)]
    with contextlib.ExitStack() as stack:
        try:
            for replica in replicas:
                await replica.start(stack)
            for i, folder in enumerate(others):
                await publish(replicas, f"reg-{i}", 1, folder)
            publisher = Publisher(replicas, pushed)
            idle: list[float] = []
            idle_by_reference: list[float] = []
            for _ in pushed:  # alternating, so load drift hits both ways alike
                idle.append(await publisher.once())
                idle_by_reference.append(await publisher.once(by_reference=True))
            await sample_load(replicas, prompts[:2], 4)  # warm-up
            quiet: list[float] = []
            busy: dict[str, list[float]] = {"one_per_second": [], "back_to_back": []}
            latencies: dict[str, list[float]] = {"one_per_second": [], "back_to_back": []}
            for _ in range(args.rounds):
                quiet.append(await sample_load(replicas, prompts, args.publish_new_tokens))
                for mode, period in (("one_per_second", 1.0), ("back_to_back", 0.0)):
                    load = asyncio.ensure_future(
                        sample_load(replicas, prompts, args.publish_new_tokens)
                    )
                    latencies[mode] += await publisher.during(load, period)
                    busy[mode].append(await load)
        finally:
            for replica in replicas:
                await replica.stop()
    tokens = 2 * len(prompts) * args.publish_new_tokens
    report: dict[str, object] = {
        "replicas": "2 subprocesses (python -m lorafleet_rollout)",
        "publish_p50_ms": round(1000 * statistics.median(idle), 1),
        "publish_p90_ms": round(1000 * statistics.quantiles(idle, n=10)[-1], 1),
        "publish_by_reference_p50_ms": round(1000 * statistics.median(idle_by_reference), 1),
        "publish_by_reference_p90_ms": round(
            1000 * statistics.quantiles(idle_by_reference, n=10)[-1], 1
        ),
        "other_adapters_tok_s_quiet": round(tokens / statistics.median(quiet), 1),
    }
    for mode in busy:
        report[mode] = {
            "publishes": len(latencies[mode]),
            "publishes_per_s": round(len(latencies[mode]) / sum(busy[mode]), 2),
            "publish_p50_ms": round(1000 * statistics.median(latencies[mode]), 1),
            "other_adapters_tok_s": round(tokens / statistics.median(busy[mode]), 1),
            "throughput_ratio": round(
                statistics.median(q / b for q, b in zip(quiet, busy[mode], strict=True)), 3
            ),
            "throughput_ratio_per_round": [
                round(q / b, 3) for q, b in zip(quiet, busy[mode], strict=True)
            ],
        }
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--adapters", type=int, default=8)
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument(
        "--publish-new-tokens",
        type=int,
        default=512,
        help="tokens per request while publishing: ~8 s windows here; at 64 (~1 s) the "
        "ratios of one round spread over +-0.1 even with no publish paced",
    )
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="torch threads; 0 = default")
    parser.add_argument("--publishes", type=int, default=10, help="idle publishes timed")
    parser.add_argument("--skip-publish", action="store_true")
    parser.add_argument("--skip-throughput", action="store_true")
    add_arguments(parser)
    add_llama_cpp_arguments(parser)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    report: dict[str, object] = {"bench": "sampling", "torch_threads": torch.get_num_threads()}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        model_dir, report["model"] = bench_model(work)
        adapters = make_adapters(model_dir, work, 1 if args.vs_llama_cpp else args.adapters)
        gen = torch.Generator().manual_seed(0)
        prompts = [
            torch.randint(3, 2000, (args.prompt_tokens,), generator=gen).tolist()
            for _ in range(args.requests)
        ]
        if args.vs_vllm:
            report["vs_vllm"] = asyncio.run(vs_vllm(model_dir, adapters, args, work))
            print(json.dumps(report, indent=2))
            return
        if args.vs_llama_cpp:
            report["vs_llama_cpp"] = asyncio.run(
                vs_llama_cpp(model_dir, adapters[0], prompts, args, work)
            )
            print(json.dumps(report, indent=2))
            return
        report.update(
            requests=args.requests,
            adapters=args.adapters,
            prompt_tokens=args.prompt_tokens,
            new_tokens=args.new_tokens,
            rounds=args.rounds,
        )
        if not args.skip_throughput:
            report["throughput"] = asyncio.run(throughput(model_dir, adapters, prompts, args))
        if not args.skip_publish:
            pushed = make_adapters(model_dir, work, args.publishes, prefix="p")
            report["publish"] = asyncio.run(
                publishing(model_dir, work, adapters[:4], pushed, prompts[:8], args)
            )
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    # The rollout process's heap settings (allocator.py; `python -m lorafleet_rollout` starts
    # the same way): the in-process engines are measured as they are deployed.
    exec_with_tunables()
    main()
