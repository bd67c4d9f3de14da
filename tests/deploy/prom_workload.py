"""A short training-and-sampling run through the public tinker SDK, to give every dashboard
metric something to count. Run by tests/deploy/test_prometheus.py in the SDK's own venv;
TINKER_BASE_URL, TINKER_API_KEY and LORAFLEET_BASE_MODEL come from the test.
"""

from __future__ import annotations

import os
import sys

import tinker
from tinker import types

TEXT = "What is my name? Your name is Dima."


def done(x):
    """0.38 returns futures from create_* calls; 0.24 returned the object itself."""
    return x.result() if hasattr(x, "result") else x


def main() -> None:
    sc = tinker.ServiceClient()
    base = os.environ["LORAFLEET_BASE_MODEL"]
    tc = done(sc.create_lora_training_client(base_model=base, rank=4))
    tokens = list(tc.get_tokenizer().encode(TEXT))
    data = [
        types.Datum(
            model_input=types.ModelInput.from_ints(tokens[:-1]),
            loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)},
        )
    ]
    for _ in range(3):
        fb = tc.forward_backward(data, "cross_entropy")
        opt = tc.optim_step(types.AdamParams(learning_rate=1e-3))
        fb.result()
        opt.result()
    done(tc.save_state("prom-e2e"))
    sampler = done(tc.save_weights_and_get_sampling_client(name="prom-e2e"))
    prompt = types.ModelInput.from_ints(tokens[:6])
    params = types.SamplingParams(max_tokens=4, temperature=0.0, seed=0)
    for _ in range(2):
        sampler.sample(prompt, 1, params).result()
    print("WORKLOAD OK")
    sys.stdout.flush()
    os._exit(0)  # the SDK's background threads would keep the process alive


if __name__ == "__main__":
    main()
