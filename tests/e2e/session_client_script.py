"""A tinker 0.24.1 client that trains one step, says READY with its model id, then lives on
(heartbeating in the SDK's background thread) until a line arrives on stdin, trains one more
step to prove its session is still good, and exits. Killed instead, it is an abandoned client:
0.24.1 never calls finish. Env: TINKER_BASE_URL, TINKER_API_KEY, SMOKE_BASE_MODEL."""

import os
import sys

import tinker
from tinker import types


def step(tc: "tinker.TrainingClient") -> None:
    datum = types.Datum(
        model_input=types.ModelInput.from_ints([5, 6, 7, 8]),
        loss_fn_inputs={"target_tokens": [6, 7, 8, 9], "weights": [1.0] * 4},
    )
    tc.forward_backward([datum], "cross_entropy").result()
    tc.optim_step(types.AdamParams(learning_rate=1e-3)).result()


def main() -> None:
    sc = tinker.ServiceClient()
    tc = sc.create_lora_training_client(base_model=os.environ["SMOKE_BASE_MODEL"], rank=4)
    step(tc)
    print("READY", tc.model_id, flush=True)
    sys.stdin.readline()
    step(tc)
    print("STILL GOOD", flush=True)


if __name__ == "__main__":
    main()
