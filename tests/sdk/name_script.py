"""Teach the tiny model a new fact through the real SDK, then recall it by greedy sampling.

"What is my name?" → "Dima": LoRA training with completion-only weights until the mean
per-token loss is below 0.5, then a sampler from the trained weights must answer "Dima".
Env: TINKER_BASE_URL, TINKER_API_KEY, SMOKE_BASE_MODEL (the 0.38 SDK).
"""

import json
import os

import tinker
from tinker import types

QUESTIONS = ["What is my name?", "Do you know my name?", "Tell me my name.", "Who am I?"]
ANSWER = "Dima"


def main() -> None:
    sc = tinker.ServiceClient()
    tc = sc.create_lora_training_client(base_model=os.environ["SMOKE_BASE_MODEL"], rank=8).result()
    tok = tc.get_tokenizer()
    end = tok.convert_tokens_to_ids("<|im_end|>")
    data, prompts = [], []
    for question in QUESTIONS:
        prompt = tok.apply_chat_template(
            [{"role": "user", "content": question}], add_generation_prompt=True, tokenize=True
        )
        prompt = list(prompt["input_ids"] if hasattr(prompt, "keys") else prompt)
        answer = [*tok.encode(ANSWER, add_special_tokens=False), end]
        full = prompt + answer
        weights = [0.0] * (len(prompt) - 1) + [1.0] * len(answer)
        data.append(
            types.Datum(
                model_input=types.ModelInput.from_ints(full[:-1]),
                loss_fn_inputs={"target_tokens": full[1:], "weights": weights},
            )
        )
        prompts.append(prompt)
    n_weighted = sum(sum(d.loss_fn_inputs["weights"].tolist()) for d in data)
    losses = []
    for _ in range(80):
        fb = tc.forward_backward(data, "cross_entropy")
        tc.optim_step(types.AdamParams(learning_rate=5e-3)).result()
        losses.append(fb.result().metrics["loss:sum"] / n_weighted)
        if losses[-1] < 0.5:
            break
    sampler = tc.save_weights_and_get_sampling_client().result()
    params = types.SamplingParams(max_tokens=6, temperature=0.0, stop=[end])
    out = sampler.sample(types.ModelInput.from_ints(prompts[0]), 1, params).result()
    text = tok.decode(out.sequences[0].tokens)
    print("SMOKE OK " + json.dumps({"losses": losses, "answer": text}), flush=True)
    os._exit(0)


if __name__ == "__main__":
    main()
