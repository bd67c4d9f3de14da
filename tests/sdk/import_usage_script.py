"""PEFT import and usage accounting, seen from a real tinker SDK (issue 12 items 6, 7).

MODE=resume: IMPORT_PATH (a state made by `lorafleet adapters import`) is resumed with
create_training_client_from_state; reports the first forward's logprobs of TOKENS (JSON),
and a greedy sample from a sampler on the same path with its logprobs.
MODE=work: LENGTHS (JSON list of datum lengths) per forward_backward, STEPS optim_steps, one
forward, one sample of SAMPLE_MAX tokens, one save_state; reports exactly what it sent and got
back, so the test can compute the usage the fleet must have counted. Only the SDK is imported.
"""

import json
import os

import tinker
from tinker import types

BASE = os.environ["SMOKE_BASE_MODEL"]


def done(x):
    """0.38's create_* calls return futures; 0.24.1's return the object."""
    return x.result() if hasattr(x, "result") else x


def datum(ids):
    return types.Datum(
        model_input=types.ModelInput.from_ints(ids[:-1]),
        loss_fn_inputs={"target_tokens": ids[1:], "weights": [1.0] * (len(ids) - 1)},
    )


def resume() -> dict:
    sc = tinker.ServiceClient()
    path = os.environ["IMPORT_PATH"]
    ids = json.loads(os.environ["TOKENS"])
    tc = done(sc.create_training_client_from_state(path))
    out = tc.forward([datum(ids)], "cross_entropy").result()
    logprobs = out.loss_fn_outputs[0]["logprobs"].tolist()
    sampler = done(sc.create_sampling_client(model_path=path))
    params = types.SamplingParams(max_tokens=4, temperature=0.0)
    res = sampler.sample(types.ModelInput.from_ints(ids), 1, params).result()
    seq = res.sequences[0]
    return {
        "logprobs": logprobs,
        "sample_tokens": list(seq.tokens),
        "sample_logprobs": list(seq.logprobs or []),
    }


def work() -> dict:
    sc = tinker.ServiceClient()
    lengths = json.loads(os.environ["LENGTHS"])
    steps = int(os.environ["STEPS"])
    tc = done(sc.create_lora_training_client(base_model=BASE, rank=4, train_unembed=False))
    batch = [datum([(7 * i + 3 * j) % 50 + 5 for j in range(n + 1)]) for i, n in enumerate(lengths)]
    for _ in range(steps):
        tc.forward_backward(batch, "cross_entropy").result()
        tc.optim_step(types.AdamParams(learning_rate=1e-3)).result()
    tc.forward(batch[:1], "cross_entropy").result()
    saved = tc.save_state("usage").result().path
    sampler = done(tc.save_weights_and_get_sampling_client("usage-sampler"))
    prompt = [5, 6, 7, 8, 9]
    max_tokens = int(os.environ["SAMPLE_MAX"])
    params = types.SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=1)
    res = sampler.sample(types.ModelInput.from_ints(prompt), 2, params).result()
    return {
        "tokens_trained": steps * sum(lengths),
        "tokens_forward": lengths[0],
        "optim_steps": steps,
        "tokens_prompt": len(prompt),
        "tokens_sampled": sum(len(s.tokens) for s in res.sequences),
        "saved": saved,
    }


if __name__ == "__main__":
    result = resume() if os.environ["MODE"] == "resume" else work()
    print("SMOKE OK " + json.dumps(result), flush=True)
