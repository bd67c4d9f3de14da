"""Real SDK clients, more than the fleet has trainer slots, each pausing between steps.

Run by tests/e2e/test_paging_sdk.py and bench/paging.py --sdk with a tinker venv's python
(TINKER_BASE_URL, TINKER_API_KEY, SMOKE_BASE_MODEL, PAGING_SEEDS, PAGING_STEPS, PAGING_PAUSE,
PAGING_MODE set). `together` (or `both`): one client per seed trains at once, one thread each
(its own run and data), pausing PAGING_PAUSE seconds after each step as a client that samples
does. `alone` (or `both`): each seed's run again by itself, without pauses. Prints one line
"RESULT <json>": per seed, each phase's forward_backward logprobs and loss per step and a last
forward's logprobs (the final weights), as the SDK returned them, and the together phase's
wall time.
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
    seeds = [int(s) for s in os.environ["PAGING_SEEDS"].split(",")]
    steps, pause = int(os.environ["PAGING_STEPS"]), float(os.environ["PAGING_PAUSE"])
    mode = os.environ["PAGING_MODE"]
    sc = tinker.ServiceClient()
    shared: dict[int, list[object]] = {}
    errors: list[str] = []

    def client(seed: int) -> None:
        try:
            shared[seed] = train(sc, seed, steps, pause)
        except Exception as exc:  # what the SDK raised is what a user sees
            errors.append(f"{seed}: {type(exc).__name__}: {exc}")

    start = time.monotonic()
    if mode in ("together", "both"):
        threads = [threading.Thread(target=client, args=(s,)) for s in seeds]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    shared_s = time.monotonic() - start
    alone = {s: train(sc, s, steps, 0.0) for s in seeds} if mode in ("alone", "both") else {}
    print(
        "RESULT "
        + json.dumps({"errors": errors, "shared": shared, "alone": alone, "shared_s": shared_s}),
        flush=True,
    )


if __name__ == "__main__":
    main()
