"""A real SDK client whose call waits on its trainer when that trainer fails for good.

Run by tests/e2e/test_supervision.py with a tinker venv's python (TINKER_BASE_URL,
TINKER_API_KEY, SMOKE_BASE_MODEL set). It creates a training run and prints "READY
<model id>", then waits for a line on stdin (the test stops the trainer meanwhile), submits a
forward_backward, prints "WAITING" and blocks on its result, as a training loop does. Then it
prints one line "WAITED <json>": the error's type and message and the wall-clock time it
arrived.
"""

import json
import os
import sys
import time

import tinker
from tinker import types


def main() -> None:
    sc = tinker.ServiceClient()
    tc = sc.create_lora_training_client(base_model=os.environ["SMOKE_BASE_MODEL"], rank=4)
    print("READY " + tc.model_id, flush=True)
    sys.stdin.readline()
    datum = types.Datum(
        model_input=types.ModelInput.from_ints([5, 6, 7, 8]),
        loss_fn_inputs={"target_tokens": [6, 7, 8, 9], "weights": [1.0] * 4},
    )
    future = tc.forward_backward([datum], "cross_entropy")
    print("WAITING", flush=True)
    try:
        future.result()
        outcome = {"type": "", "message": "it ran"}
    except Exception as exc:  # what the SDK raises is what a user sees
        outcome = {"type": type(exc).__name__, "message": str(exc)}
    print("WAITED " + json.dumps({**outcome, "at": time.time()}), flush=True)


if __name__ == "__main__":
    main()
