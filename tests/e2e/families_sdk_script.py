"""The SDK flow on one base model: train, save for the sampler, sample, and the trainer's view.

Run by tests/e2e/test_families_sdk.py with a tinker venv's python against a fleet started by
`lorafleet up --model <folder>` (TINKER_BASE_URL, TINKER_API_KEY, SMOKE_BASE_MODEL set).
Only the SDK is imported. Prints one line "SMOKE OK <json>": each sampled sequence with its
logprobs, the sampler's compute_logprobs of prompt + sample, and the trainer's forward
logprobs of the same tokens (the weights did not change in between).
"""

import json
import os

import tinker
from tinker import types

TEXT = "The capital of France is Paris. The capital of Italy is Rome."


def datum(ids):
    return types.Datum(
        model_input=types.ModelInput.from_ints(ids[:-1]),
        loss_fn_inputs={"target_tokens": ids[1:], "weights": [1.0] * (len(ids) - 1)},
    )


def main() -> None:
    sc = tinker.ServiceClient()
    # Default flags: attention, MLP (an MoE's expert banks, per expert) and lm_head.
    tc = sc.create_lora_training_client(base_model=os.environ["SMOKE_BASE_MODEL"], rank=4)
    tc = tc.result() if hasattr(tc, "result") else tc
    ids = tc.get_tokenizer().encode(TEXT)
    losses = []
    for _ in range(3):
        fb = tc.forward_backward([datum(ids)], "cross_entropy")
        tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
        losses.append(fb.result().metrics["loss:sum"])
    path = tc.save_weights_for_sampler("families").result().path
    smp = sc.create_sampling_client(model_path=path)
    smp = smp.result() if hasattr(smp, "result") else smp
    prompt = ids[:6]
    samples = {}
    for name, params in {
        "t1": types.SamplingParams(max_tokens=12, temperature=1.0, seed=11),
        "greedy": types.SamplingParams(max_tokens=12, temperature=0.0),
    }.items():
        out = smp.sample(types.ModelInput.from_ints(prompt), 2, params).result()
        samples[name] = []
        for seq in out.sequences:
            full = prompt + list(seq.tokens)
            trainer = tc.forward([datum(full)], "cross_entropy").result()
            samples[name].append(
                {
                    "tokens": list(seq.tokens),
                    "logprobs": list(seq.logprobs),
                    "sampler_prompt_logprobs": smp.compute_logprobs(
                        types.ModelInput.from_ints(full)
                    ).result(),
                    "trainer_logprobs": trainer.loss_fn_outputs[0]["logprobs"].tolist(),
                }
            )
    print("SMOKE OK " + json.dumps({"losses": losses, "prompt": prompt, "samples": samples}))
    os._exit(0)  # skip waiting on the SDK's background threads


if __name__ == "__main__":
    main()
