"""The SDK flow served by SGLang: train, save for the sampler, sample, and the trainer's view.

Run by tests/sdk/test_sdk_sglang.py with a tinker venv's python against a fleet started with
`engine="sglang"` (`lorafleet up --engine sglang`). Only the SDK is imported. It prints one
JSON line starting with "SMOKE OK": the sampled sequences with their logprobs, the sampler's
compute_logprobs of prompt + sample, and the trainer's forward logprobs of the same tokens
(the weights did not change in between), which the test compares.
"""

import json
import os

import tinker
from tinker import types

BASE = os.environ["SMOKE_BASE_MODEL"]
TEXT = "The capital of France is Paris. The capital of Italy is Rome."


def trainer_logprobs(tc, ids):
    d = types.Datum(
        model_input=types.ModelInput.from_ints(ids[:-1]),
        loss_fn_inputs={"target_tokens": ids[1:], "weights": [1.0] * (len(ids) - 1)},
    )
    return tc.forward([d], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].tolist()


def main() -> None:
    sc = tinker.ServiceClient()
    tc = sc.create_lora_training_client(base_model=BASE, rank=8)  # train_unembed: lm_head too
    tc = tc.result() if hasattr(tc, "result") else tc
    ids = tc.get_tokenizer().encode(TEXT)
    d = types.Datum(
        model_input=types.ModelInput.from_ints(ids[:-1]),
        loss_fn_inputs={"target_tokens": ids[1:], "weights": [1.0] * (len(ids) - 1)},
    )
    losses = []
    for _ in range(4):
        fb = tc.forward_backward([d], "cross_entropy")
        tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
        losses.append(fb.result().metrics["loss:sum"])
    path = tc.save_weights_for_sampler("sglang").result().path
    smp = sc.create_sampling_client(model_path=path)
    smp = smp.result() if hasattr(smp, "result") else smp
    prompt = ids[:6]
    samples = {}
    for name, params in {
        "t1": types.SamplingParams(max_tokens=12, temperature=1.0, seed=11),
        "t07": types.SamplingParams(max_tokens=12, temperature=0.7, seed=12),
        "greedy": types.SamplingParams(max_tokens=12, temperature=0.0),
    }.items():
        out = smp.sample(types.ModelInput.from_ints(prompt), 2, params).result()
        samples[name] = []
        for seq in out.sequences:
            full = prompt + list(seq.tokens)
            samples[name].append(
                {
                    "tokens": list(seq.tokens),
                    "logprobs": list(seq.logprobs),
                    "sampler_prompt_logprobs": smp.compute_logprobs(
                        types.ModelInput.from_ints(full)
                    ).result(),
                    "trainer_logprobs": trainer_logprobs(tc, full),
                }
            )
    print(
        "SMOKE OK "
        + json.dumps(
            {"version": tinker.__version__, "losses": losses, "prompt": prompt, "samples": samples}
        ),
        flush=True,
    )
    os._exit(0)  # skip waiting on the SDK's background threads


if __name__ == "__main__":
    main()
