"""Real SDK clients, more than the fleet has trainer slots, each pausing between steps.

Run by tests/e2e/test_paging_sdk.py with a tinker venv's python (TINKER_BASE_URL,
TINKER_API_KEY, SMOKE_BASE_MODEL, PAGING_CLIENTS, PAGING_STEPS, PAGING_PAUSE set). First every
client trains at once, one thread each (its own run, seed and data), pausing PAGING_PAUSE
seconds after each step as a client that samples does; then each run again alone, without
pauses. Prints one line "RESULT <json>": per seed, both runs' forward_backward logprobs and
loss per step and a last forward's logprobs (the final weights), as the SDK returned them.
"""

import json
import os
import threading
import time

import tinker
from tinker import types


def tokens(seed: int, step: int) -> list[int]:
    return [(7 * step + 11 * seed + 5 * i) % 250 + 1 for i in range(9)]


def datum(seed: int, step: int) -> types.Datum:
    t = tokens(seed, step)
    return types.Datum(
        model_input=types.ModelInput.from_ints(t[:-1]),
        loss_fn_inputs={"target_tokens": t[1:], "weights": [1.0] * (len(t) - 1)},
    )


def train(sc: "tinker.ServiceClient", seed: int, steps: int, pause: float) -> list[object]:
    tc = sc.create_lora_training_client(
        base_model=os.environ["SMOKE_BASE_MODEL"], rank=4, seed=seed
    )
    seen: list[object] = []
    for step in range(steps):
        out = tc.forward_backward([datum(seed, step)], "cross_entropy").result()
        seen.append([out.loss_fn_outputs[0]["logprobs"].data, out.metrics.get("loss:sum")])
        tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
        time.sleep(pause)
    final = tc.forward([datum(seed, steps)], "cross_entropy").result()
    seen.append(final.loss_fn_outputs[0]["logprobs"].data)
    return seen


def main() -> None:
    clients = int(os.environ["PAGING_CLIENTS"])
    steps, pause = int(os.environ["PAGING_STEPS"]), float(os.environ["PAGING_PAUSE"])
    sc = tinker.ServiceClient()
    shared: dict[int, list[object]] = {}
    errors: list[str] = []

    def client(seed: int) -> None:
        try:
            shared[seed] = train(sc, seed, steps, pause)
        except Exception as exc:  # what the SDK raised is what a user sees
            errors.append(f"{seed}: {type(exc).__name__}: {exc}")

    threads = [threading.Thread(target=client, args=(s,)) for s in range(1, clients + 1)]
    start = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    shared_s = time.monotonic() - start
    alone = {seed: train(sc, seed, steps, 0.0) for seed in range(1, clients + 1)}
    print("RESULT " + json.dumps({"errors": errors, "shared": shared, "alone": alone,
                                  "shared_s": shared_s}), flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
