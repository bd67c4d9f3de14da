"""llama.cpp's side of `sampling.py --vs-llama-cpp`, run by the llama.cpp venv's python
(.venvs/llama-cpp, bench/setup_llama_cpp_venv.sh): llama-cpp-python is not in the project's
venv, and a separate process keeps its OpenMP threads off our engine's process.

    python llama_cpp_driver.py MODEL.gguf LORA.gguf THREADS N_CTX FLASH_ATTN TEXT

Loads the model with the adapter once, then prints one JSON line (version, system info, and
`TEXT` tokenized by the GGUF's own tokenizer, for the bench to check the conversion against
the model folder's tokenizer). Each line read from stdin after that is a pass:
{"prompts": [[token ids], ...], "max_tokens": N}; the prompts run one after another, each
from an empty KV cache (the bench's prompts are distinct; llama-cpp-python would otherwise
reuse a matching prefix of the previous one), greedy, N tokens whatever they are (EOS does not
stop a sequence: the bench's requests ignore it too). The answer is one JSON line with the
wall seconds and the tokens of each prompt.
"""

from __future__ import annotations

import json
import sys
import time

import llama_cpp
from llama_cpp import Llama


def run(llm: Llama, prompt: list[int], max_tokens: int) -> tuple[float, list[int]]:
    start = time.perf_counter()
    llm.reset()  # no prefix reuse: the whole prompt is computed, as on our side
    tokens: list[int] = []
    for token in llm.generate(prompt, temp=0.0, repeat_penalty=1.0, reset=False):
        tokens.append(token)
        if len(tokens) == max_tokens:
            break
    return time.perf_counter() - start, tokens


def main() -> None:
    model, lora, threads, n_ctx, flash_attn, text = sys.argv[1:]
    llm = Llama(
        model_path=model,
        lora_path=lora,
        n_threads=int(threads),
        n_threads_batch=int(threads),
        n_ctx=int(n_ctx),
        flash_attn=flash_attn == "1",
        # float32 keys and values, as our engine keeps them (llama.cpp's default is f16)
        type_k=llama_cpp.GGML_TYPE_F32,
        type_v=llama_cpp.GGML_TYPE_F32,
        logits_all=False,
        verbose=False,
    )
    hello = {
        "version": llama_cpp.__version__,
        "system_info": llama_cpp.llama_print_system_info().decode(),
        "tokenized": llm.tokenize(text.encode(), add_bos=False, special=False),
    }
    print(json.dumps(hello), flush=True)
    for line in sys.stdin:
        job = json.loads(line)
        seconds, tokens = [], []
        for prompt in job["prompts"]:
            elapsed, out = run(llm, prompt, job["max_tokens"])
            seconds.append(elapsed)
            tokens.append(out)
        print(json.dumps({"seconds": seconds, "tokens": tokens}), flush=True)


if __name__ == "__main__":
    main()
