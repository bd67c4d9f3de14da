"""A real SDK client whose call waits for a trainer slot when that trainer fails for good.

Run by tests/e2e/test_supervision.py with a tinker venv's python (TINKER_BASE_URL,
TINKER_API_KEY, SMOKE_BASE_MODEL, SLOTS set). It creates SLOTS + 1 training runs, so the
last one waits for a slot, submits a forward_backward on it and prints "WAITING <ids>"
(the bound runs' ids, then the waiting one's). Then it blocks on that call's result, as a
training loop does, and prints one line "WAITED <json>": the error's type and message and
the wall-clock time it arrived.
"""

import json
import os
import time

import tinker
from tinker import types


def main() -> None:
    sc = tinker.ServiceClient()
    model = os.environ["SMOKE_BASE_MODEL"]
    clients = [
        sc.create_lora_training_client(base_model=model, rank=4)
        for _ in range(int(os.environ["SLOTS"]) + 1)
    ]
    datum = types.Datum(
        model_input=types.ModelInput.from_ints([5, 6, 7, 8]),
        loss_fn_inputs={"target_tokens": [6, 7, 8, 9], "weights": [1.0] * 4},
    )
    future = clients[-1].forward_backward([datum], "cross_entropy")
    print("WAITING " + " ".join(c.model_id for c in clients), flush=True)
    try:
        future.result()
        outcome = {"type": "", "message": "it ran"}
    except Exception as exc:  # what the SDK raises is what a user sees
        outcome = {"type": type(exc).__name__, "message": str(exc)}
    print("WAITED " + json.dumps({**outcome, "at": time.time()}), flush=True)


if __name__ == "__main__":
    main()
